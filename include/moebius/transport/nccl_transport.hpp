#pragma once

// Executes plans over NCCL point-to-point calls (DESIGN.md §2, layer 3): the baseline every
// faster transport is measured against, and the path between hosts.
//
// Per phase, on every local rank's stream:
//   1. ops whose source rows are strided are packed into the rank's staging workspace;
//   2. one ncclGroupStart/ncclGroupEnd holds every ncclSend/ncclRecv of the phase, of every
//      local rank (a process that drives several ranks must group them, or NCCL deadlocks);
//      contiguous ops (rows == 1, or pitch == row_bytes on that side) are sent straight from
//      and received straight into the caller's memory;
//   3. ops whose destination rows are strided are received into staging and unpacked;
//   0. local ops (src_rank == dst_rank) are device copies on a side stream of the rank, forked
//      from its stream at the start of the phase and joined back at the end, so they overlap
//      the transfers.
// Each rank only ever touches its own memory (NCCL moves the bytes in between), so stream
// order on each rank (with the side stream joined) is the whole phase barrier: no host round
// trip between phases.
//
// The caller owns everything: communicators, streams, memory spaces and staging workspaces.
// One process may drive all ranks (ncclCommInitAll over its devices) or one rank each (every
// process constructs a transport with its own rank and runs the same plan).

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstddef>
#include <cstdint>
#include <exception>
#include <optional>
#include <span>
#include <vector>

#include "moebius/plan/plan.hpp"
#include "moebius/transport/transport.hpp"

namespace moebius {

// One rank driven by this process.
struct nccl_rank {
  ncclComm_t comm = nullptr;              // member of a communicator of P ranks; its NCCL rank is
                                          // the plan's rank index (ncclCommUserRank)
  int device = 0;                         // CUDA device of `comm` (ncclCommCuDevice must agree)
  cudaStream_t stream = nullptr;          // every copy and NCCL call of this rank goes here
  void* space_base[num_memory_spaces]{};  // device base pointer per memory_space
  int64_t space_bytes[num_memory_spaces]{};  // bytes per memory_space (0: absent)
  void* workspace = nullptr;    // device staging buffer, >= workspace_bytes(plan, rank)
  int64_t workspace_bytes = 0;  // its size in bytes
};

class nccl_transport final : public transport {
 public:
  // Staging bytes rank `rank` needs to run `p`: the largest, over phases, sum of the bytes of
  // the phase's remote ops that are strided on this rank's side (packed before sending,
  // received before unpacking), each region rounded up to 256 B. 0 when every remote op is
  // contiguous on this rank's side. Throws errc::invalid_argument for a rank outside
  // [0, p.num_ranks).
  //   EP->TP of one bf16 layer, E=4, H=8, I=4, P=2: rank 0 sends rank 1 the slice-1 gate and
  //   up rows of its 2 experts (2 x 2 x 2 rows x 8 cols x 2 B = 128 B, strided in EP) and
  //   their slice-1 w2 columns (2 x 8 rows x 2 cols x 2 B = 64 B, strided in EP); each
  //   region rounds up to 256 B, so workspace_bytes = 512. What it receives lands
  //   contiguously in its TP layout: no staging for that.
  //   Qwen3-235B at P=2: 1,207,959,552 B (the 805 MB w13 piece plus the 403 MB w2 piece).
  static int64_t workspace_bytes(const plan& p, int rank);

  // `local_ranks`: the ranks this process drives, each with its own communicator (all of
  // the same size P). Throws errc::invalid_argument when it is empty, when communicators
  // disagree on P, when two entries are the same NCCL rank, when a device does not match
  // its communicator's, or when a memory space has a null base but a non-zero size;
  // errc::nccl when NCCL cannot be queried. Takes no ownership of the caller's objects; creates
  // one side stream and two events per local rank (errc::cuda when that fails).
  explicit nccl_transport(std::vector<nccl_rank> local_ranks);
  ~nccl_transport() override;
  nccl_transport(const nccl_transport&) = delete;
  nccl_transport& operator=(const nccl_transport&) = delete;

  int num_ranks() const override { return num_ranks_; }
  // The plan must be for P ranks; every op must fit the smallest local rank's memory space
  // (all ranks of a deployment have equal spaces), and every local rank's workspace must
  // hold workspace_bytes(p, rank).
  void validate(const plan& p) const override;
  std::vector<int> local_ranks() const override;
  // Enqueues every phase on the local ranks' streams and (for now) synchronizes them; wait()
  // reports the failure. In a multi-process deployment every process must run the same plan
  // (with the same fault armed, in tests), or the NCCL calls do not match. When enqueueing
  // phase k fails, the streams are drained and completed_phases() is k; when synchronizing
  // fails it is 0 (CUDA errors are sticky: nothing finer can be learnt). Only empty `streams`
  // are supported so far.
  void enqueue(const plan& p, std::span<const stream_handle> streams = {}) override;
  bool poll() override { return true; }
  void wait() override;
  int64_t completed_phases() const override { return completed_phases_; }
  // The fault fires after ops [0, at.op) of phase at.phase ran on every local rank (both the
  // sending and the receiving side of each, so NCCL calls still pair up).
  void inject_fault(std::optional<fault_point> at) override { fault_ = at; }

  // Enqueues phases [first, last) of `p` without waiting: for benchmarks and for callers
  // that overlap a switch with other work on the same streams. validate(p) first.
  void enqueue_phases(const plan& p, int64_t first, int64_t last);
  // Waits for every local stream.
  void synchronize();

  const std::vector<nccl_rank>& local_rank_info() const { return ranks_; }

 private:
  // Enqueues ops [0, num_ops) of phase `phase_idx` (all of them for num_ops = -1).
  void enqueue_phase(const plan_phase& phase, int64_t num_ops);
  const nccl_rank* find_local(int rank) const;
  void release_streams() noexcept;
  void run_blocking(const plan& p);

  std::vector<nccl_rank> ranks_;
  std::vector<int> local_of_rank_;  // index into ranks_ per global rank, or -1
  std::vector<int> rank_of_local_;  // global (NCCL) rank of each entry of ranks_
  std::vector<cudaStream_t> side_;  // per local rank: where its local ops run
  std::vector<cudaEvent_t> fork_;   // per local rank: phase start on the main stream
  std::vector<cudaEvent_t> join_;   // per local rank: local ops of the phase done
  int num_ranks_ = 0;
  std::optional<fault_point> fault_;
  int64_t completed_phases_ = 0;
  bool outstanding_ = false;
  std::exception_ptr failure_;
};

}  // namespace moebius
