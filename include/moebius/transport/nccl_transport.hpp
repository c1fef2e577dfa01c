#pragma once

// Executes plans over NCCL point-to-point calls (DESIGN.md §2, layer 3): the baseline every
// faster transport is measured against, and the path between hosts.
//
// Per phase, on every local rank's stream (the caller's, or the transport's own):
//   1. ops whose source rows are strided are packed into the rank's staging workspace;
//   2. one ncclGroupStart/ncclGroupEnd holds every ncclSend/ncclRecv of the phase, of every
//      local rank (a process that drives several ranks must group them, or NCCL deadlocks);
//      contiguous ops (rows == 1, or pitch == row_bytes on that side) are sent straight from
//      and received straight into the caller's memory;
//   3. ops whose destination rows are strided are received into staging and unpacked;
//   0. local ops (src_rank == dst_rank) are device copies on a side stream of the rank, forked
//      from its stream at the start of the phase and joined back at the end, so they overlap
//      the transfers.
// Pack, unpack and local copies are the fused copy kernel of cuda_peer_transport
// (kernels/peer_copy.cu): descriptors of every step are uploaded once per prepared plan, and
// each step is one launch per rank per phase, however many ops it has.
// Each rank only ever touches its own memory (NCCL moves the bytes in between), so stream
// order on each rank (with the side stream joined) is the whole phase barrier: no host round
// trip between phases. enqueue() returns once everything is enqueued; a completion event per
// local rank backs poll() and wait().
//
// The caller owns communicators, memory spaces and staging workspaces. One process may drive
// all ranks (ncclCommInitAll over its devices) or one rank each (every process constructs a
// transport with its own rank and runs the same plan).

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "moebius/memory/rank_memory.hpp"
#include "moebius/plan/plan.hpp"
#include "moebius/transport/transport.hpp"

namespace moebius {

// What a local rank needs besides its memory: its NCCL communicator and its staging workspace.
struct nccl_rank_comm {
  ncclComm_t comm = nullptr;    // member of a communicator of P ranks; its NCCL rank is the
                                // plan's rank index (ncclCommUserRank), its device the rank's
  void* workspace = nullptr;    // device staging buffer, >= workspace_bytes(plan, rank)
  int64_t workspace_bytes = 0;  // its size in bytes
};

// Settings; every field has a working default.
struct nccl_config {
  // Prepared plans (device descriptors of their copy steps) kept, keyed by fingerprint_of(plan)
  // and confirmed by ==; least recently used dropped first. 0: none (every enqueue prepares).
  int max_cached_plans = 8;
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

  // The ranks this process drives: memory[i] and comms[i] belong to the same rank (its NCCL
  // rank, from comms[i].comm); both lists have one entry per local rank, in any order. Runs
  // validate_rank_memory(memory, require_device). Throws errc::invalid_argument when the lists
  // are empty or differ in length, when communicators disagree on P, when two entries are the
  // same NCCL rank, when a rank's device is not its communicator's, or when a workspace has a
  // null pointer but a non-zero size; errc::nccl when NCCL cannot be queried. Takes no
  // ownership of the caller's objects; creates two streams and three events per local rank.
  nccl_transport(std::vector<rank_memory> memory, std::vector<nccl_rank_comm> comms,
                 const nccl_config& config = {});
  ~nccl_transport() override;
  nccl_transport(const nccl_transport&) = delete;
  nccl_transport& operator=(const nccl_transport&) = delete;

  int num_ranks() const override { return num_ranks_; }
  // validate_plan_fits over the local ranks' memory (all ranks of a deployment have equal
  // spaces), and every local rank's workspace must hold workspace_bytes(p, rank).
  void validate(const plan& p) const override;
  std::vector<int> local_ranks() const override;
  // Validates and prepares `p` (descriptors of its pack, unpack and local steps, uploaded once
  // and cached by fingerprint_of(p), confirmed by ==).
  void prepare(const plan& p) override;
  // Enqueues every phase on the local ranks' streams (`streams[i]` for local_ranks()[i], on
  // that rank's device; nullptr or empty: stream_of(rank)) and returns. In a multi-process
  // deployment every process must run the same plan (with the same fault armed, in tests),
  // or the NCCL calls do not match. wait() reports failures: when enqueueing phase k failed,
  // the streams are drained and completed_phases() is k; when the device work fails it is 0
  // (CUDA errors are sticky: nothing finer can be learnt).
  void enqueue(const plan& p, std::span<const stream_handle> streams = {}) override;
  bool poll() override;
  void wait() override;
  int64_t completed_phases() const override { return completed_phases_; }
  // The fault enqueues ops [0, at.op) of phase at.phase on every local rank (both the sending
  // and the receiving side of each, so NCCL calls still pair up) and nothing after; wait()
  // then throws errc::injected_fault with completed_phases() == at.phase.
  void inject_fault(std::optional<fault_point> at) override { fault_ = at; }
  // Each mark is a CUDA event recorded on the rank's stream once the marked phase's receives,
  // unpack and local copies are done there.
  void mark_phases(std::span<const int64_t> after_phases) override;
  event_handle phase_event(size_t mark, size_t local_index) const override;
  // Each local rank's stream waits for its own event before the phase: only a rank's own
  // stream writes its memory (its receives, unpack and local copies), so that is every wait
  // the contract asks for.
  void wait_before_phases(std::span<const phase_wait> waits) override;

  // The transport's own stream of a local rank.
  cudaStream_t stream_of(int rank) const;
  int device_of(int rank) const;  // CUDA device of a local rank
  // Drops every cached prepared plan (frees their device descriptors).
  void clear_plan_cache();

  struct impl;

 private:
  std::unique_ptr<impl> impl_;
  int num_ranks_ = 0;
  std::optional<fault_point> fault_;
  int64_t completed_phases_ = 0;
};

}  // namespace moebius
