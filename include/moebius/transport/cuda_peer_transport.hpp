#pragma once

// Executes plans on P ranks whose memory is GPU memory, writing straight into the destination
// rank's memory (DESIGN.md §2, §5): no pack, no staging buffer, no host round trip per phase.
//
// Who moves what: rank r's stream runs every op whose src_rank is r (a push). Each op runs on
// one of two engines:
//   * copy engine: cudaMemcpy2DAsync / cudaMemcpyAsync with cudaMemcpyDefault (UVA + peer
//     access or CUDA IPC mappings). Uses no SMs; best for few large strided slabs (weights).
//   * SM kernel: one fused kernel per rank per phase reads the phase's op descriptors from
//     device memory (uploaded once per prepared plan), splits large ops into chunks spread over
//     warps, packs small ops, moves 16-byte vectors (narrower at unaligned heads and tails).
//     Best for many small ops (KV pages), whose copy-engine calls would be host-bound.
// Phases are ordered across ranks by a one-block barrier kernel on each rank's stream: it
// writes the rank's arrival into every peer's flag array (system-scope release) and spins on
// its own flags (acquire) until every peer has arrived, or until the configured timeout, which
// becomes errc::timeout on the host (read back by wait()).
//
// enqueue() starts the whole plan on each local rank's stream (a caller's stream, or the
// transport's own) and returns: a prepared plan is one CUDA graph launch per rank (or direct
// launches when graphs are off or a fault is armed). Side streams the transport forks work onto
// join back into that stream, so work the caller enqueues after the plan runs after it. The
// last step of a rank's work copies its barrier status to pinned host memory and records a
// completion event: poll() queries those events, wait() synchronizes them and decodes the
// status (timeout naming rank and phase, injected fault) into completed_phases().
//
// Three ways to place ranks:
//   * single_process, ranks on different devices of this process (peer access is enabled);
//   * single_process, several "virtual ranks" on one device (every GPU test runs on one card;
//     at most CUDA_DEVICE_MAX_CONNECTIONS, default 8, ranks per device keep their streams on
//     separate hardware queues — beyond that a barrier can only time out, never hang);
//   * multi_process: this process drives one rank; ranks exchange CUDA IPC handles of their
//     memory spaces and barrier flags through a caller-supplied all-gather.

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <memory>
#include <optional>
#include <vector>

#include "moebius/memory/rank_memory.hpp"
#include "moebius/plan/plan.hpp"
#include "moebius/transport/transport.hpp"

namespace moebius {

// Which engine moves an op.
enum class engine_policy : uint8_t {
  automatic,    // copy engine for large ops when a rank has few of them in a phase, else SM kernel
  copy_engine,  // every op on the copy engines (cudaMemcpy2DAsync), no SMs: a rank's local
                // ops run on a second stream beside its remote ones
  sm_kernel,    // every op in the fused SM kernel
};

const char* to_string(engine_policy policy);

// Settings; every field has a working default.
struct cuda_peer_config {
  engine_policy engine = engine_policy::automatic;

  // automatic: an op of at least this many bytes goes to the copy engine...
  int64_t copy_engine_min_op_bytes = int64_t{1} << 20;
  // ...unless its rank has more than this many such ops in the phase (then the SM kernel takes
  // all of them: each copy-engine call costs ~2 us of host time).
  int64_t copy_engine_max_ops_per_phase = 64;

  // Fused kernel grid per rank per phase. 0: the device's SM count (per rank; with virtual
  // ranks on one device their kernels share the SMs). The grid is also capped by the work.
  int sm_kernel_blocks = 0;
  int sm_kernel_threads = 512;  // multiple of 32, at most 512 (peer_copy_max_threads)
  // A warp moves at most this many bytes of one op per work item: large ops are split into
  // chunks of this size so every warp of the grid gets work. Power of two, >= 16.
  int64_t sm_chunk_bytes = int64_t{32} << 10;

  // A barrier wait longer than this is errc::timeout (a dead or stalled peer).
  int64_t barrier_timeout_ns = int64_t{10'000'000'000};

  // Prepared plans kept by enqueue(const plan&), keyed by fingerprint_of(plan) (sizes and a
  // few sampled ops) and confirmed by == (least recently used is dropped first). 0 disables
  // the cache (every enqueue prepares).
  int max_cached_plans = 8;

  // prepare() captures each local rank's whole plan into a CUDA graph, so enqueue() costs one
  // graph launch per rank instead of one call per op and barrier (a 12k-op Qwen3 switch:
  // ~1.6k calls per rank). Runs with an armed fault, or whose capture fails, fall back to
  // direct enqueue.
  bool use_cuda_graphs = true;

  // Test hook: this rank enqueues nothing at all, as if its process had died. -1: none.
  int debug_absent_rank = -1;
};

// Virtual ranks wait for each other in spinning barrier kernels, so the stream of every rank
// on one device needs a hardware queue of its own (and such ranks do not fork the SM kernel
// onto a second stream, which needs another queue). The CUDA default is 8 queues per device; this raises it to 32 by setting
// CUDA_DEVICE_MAX_CONNECTIONS (unless already set) and must run before the process's first
// CUDA call. Deployments with one rank per device need nothing. single_process() refuses
// layouts that need more queues than the process has.
void request_hardware_queues_for_virtual_ranks();

// Bytes per rank that multi_process() passes to the all-gather (IPC handles, offsets, sizes).
inline constexpr size_t cuda_ipc_rank_info_bytes = 512;

// What the last enqueue() did, for benchmarks and tests.
struct cuda_execute_stats {
  double enqueue_seconds = 0;      // host time spent enqueuing the whole plan (after prepare)
  double prepare_seconds = 0;      // host time of prepare() (0 when the plan came from the cache)
  double lookup_seconds = 0;       // host time of the plan-cache lookup (enqueue(const plan&):
                                   // key, then == against a same-key entry; ~5 ns an op on a hit)
  bool from_cache = false;         // the prepared plan was found in the cache
  int64_t copy_engine_ops = 0;     // ops this process ran on copy engines
  int64_t copy_engine_calls = 0;   // cudaMemcpy*Async calls (one per op)
  int64_t sm_kernel_ops = 0;       // ops this process ran in the fused kernel
  int64_t kernel_launches = 0;     // fused-kernel and barrier-kernel launches (direct enqueue)
  int64_t graph_launches = 0;      // CUDA graph launches (one per local rank with graphs)
  int max_sm_kernel_blocks = 0;    // largest fused-kernel grid of any rank and phase
};

// A plan turned into per-rank, per-phase work: engine choice, device-resident op descriptors,
// grid sizes. Made by cuda_peer_transport::prepare_plan(); valid only with the transport that made
// it, and while that transport lives.
class cuda_prepared_plan {
 public:
  ~cuda_prepared_plan();
  cuda_prepared_plan(const cuda_prepared_plan&) = delete;
  cuda_prepared_plan& operator=(const cuda_prepared_plan&) = delete;

  int64_t num_phases() const;
  int64_t num_ops() const;                  // ops of the whole plan (all ranks)
  int64_t copy_engine_ops(int rank) const;  // ops of `rank` on copy engines, all phases
  int64_t sm_kernel_ops(int rank) const;    // ops of `rank` in the fused kernel, all phases
  // Fused-kernel grid (thread blocks) of `rank` in `phase`; 0 when the phase has no kernel
  // work for the rank. This is how many SMs the switch can occupy on that rank's device.
  int sm_kernel_blocks(int rank, int64_t phase) const;
  int max_sm_kernel_blocks() const;         // over all ranks and phases
  int64_t device_descriptor_bytes() const;  // device memory the descriptors occupy
  // Every local rank's work was captured into a CUDA graph (enqueue() launches those).
  bool uses_cuda_graphs() const;

  struct impl;
  explicit cuda_prepared_plan(std::unique_ptr<impl> state);
  const impl& state() const { return *impl_; }

 private:
  std::unique_ptr<impl> impl_;
};

class cuda_peer_transport final : public transport {
 public:
  // Collective that gathers `bytes_per_rank` bytes from every rank into `recv_all`, ordered by
  // rank (recv_all holds num_ranks * bytes_per_rank bytes), like MPI_Allgather / ncclAllGather
  // / torch.distributed.all_gather_into_tensor on a CPU group.
  using all_gather_fn =
      std::function<void(const void* send, void* recv_all, size_t bytes_per_rank)>;

  // All ranks in this process: ranks[r] is rank r (device memory: rank_memory::on_device).
  // Ranks may share a device (virtual ranks) or sit on different devices (peer access is
  // enabled between every pair while the transport lives). Throws errc::invalid_argument when
  // validate_rank_memory(ranks, require_device) does (empty, null/size, overlap), a device
  // ordinal is invalid or a config field is out of range; errc::cuda naming both devices when
  // two devices cannot access each other.
  static cuda_peer_transport single_process(std::vector<rank_memory> ranks,
                                            const cuda_peer_config& config = {});

  // This process drives rank `rank` of `num_ranks`; `local` is its memory. Every rank's process
  // must call this collectively (same num_ranks and config). Exports CUDA IPC handles of the
  // local spaces and barrier flags, all-gathers them (cuda_ipc_rank_info_bytes per rank) and
  // opens the peers' handles, then runs validate_rank_memory over every rank's spaces as
  // mapped here (so two ranks exporting the same allocation are refused). The spaces must be
  // cudaMalloc memory (IPC-exportable). Throws errc::invalid_argument for a bad rank/num_ranks,
  // bad local memory or overlapping ranks, errc::cuda when a handle cannot be exported or
  // opened.
  static cuda_peer_transport multi_process(int rank, int num_ranks, const rank_memory& local,
                                           const all_gather_fn& all_gather,
                                           const cuda_peer_config& config = {});

  cuda_peer_transport(cuda_peer_transport&&) noexcept;
  cuda_peer_transport& operator=(cuda_peer_transport&&) noexcept;
  ~cuda_peer_transport() override;

  int num_ranks() const override;
  // Every op must fit the smallest rank's size of its memory space.
  void validate(const plan& p) const override;
  std::vector<int> local_ranks() const override;
  // Prepares `p` (or finds it in the cache) and enqueues the whole plan on every local rank's
  // stream (`streams[i]` for local_ranks()[i]; a caller stream must belong to that rank's
  // device; nullptr or empty: stream_of(rank)); does not wait. wait() reports failures:
  // errc::timeout naming the rank and phase when a barrier times out, errc::injected_fault for
  // an armed fault, errc::cuda for a CUDA failure. Multi-process: this process runs its own
  // rank's ops; the barrier closing the last phase makes every rank's writes complete and
  // visible before wait() returns on any rank.
  void enqueue(const plan& p, std::span<const stream_handle> streams = {}) override;
  // Enqueues a plan prepared by this transport (as enqueue(const plan&) after a cache hit).
  void enqueue(std::shared_ptr<const cuda_prepared_plan> prepared,
               std::span<const stream_handle> streams = {});
  // cudaEventQuery on every local rank's completion event.
  bool poll() override;
  void wait() override;
  // Phases that completed on every rank. Multi-process: what this rank can prove (it passed
  // the barrier after them); another rank may report one more.
  int64_t completed_phases() const override;
  // The next enqueue() enqueues nothing from phase `at.phase` on (in this process; ops before
  // at.op "may" have run, none did) and its wait() throws errc::injected_fault with
  // completed_phases() == at.phase.
  void inject_fault(std::optional<fault_point> at) override;
  // Each mark is a CUDA event recorded on the rank's stream after the barrier that closes the
  // marked phase (so every rank has finished it). A plan with marks is launched phase by phase,
  // not as its CUDA graph, so that the events sit between its phases.
  void mark_phases(std::span<const int64_t> after_phases) override;
  event_handle phase_event(size_t mark, size_t local_index) const override;
  // Every local rank's stream waits for every local rank's event before the phase (so no rank
  // writes a peer before the peer's event fired); such a plan also goes phase by phase.
  // single_process only: events of other processes cannot be waited on (errc::invalid_argument
  // in multi_process mode).
  void wait_before_phases(std::span<const phase_wait> waits) override;

  // Validates `p` and builds its device work (engine choice, descriptors uploaded to every
  // local rank's device). Host cost is O(ops); enqueue(prepared) then costs only launches.
  std::shared_ptr<const cuda_prepared_plan> prepare_plan(const plan& p);
  // prepare_plan(p) into the plan cache.
  void prepare(const plan& p) override;
  using transport::execute;
  // enqueue(prepared) then wait().
  void execute(std::shared_ptr<const cuda_prepared_plan> prepared);

  // The rank this process drives in multi_process mode; -1 in single_process mode.
  int process_rank() const;
  bool is_local(int rank) const;
  int device_of(int rank) const;            // CUDA ordinal of a local rank
  cudaStream_t stream_of(int rank) const;   // the transport's own stream of a local rank
  const cuda_peer_config& config() const;
  const cuda_execute_stats& last_execute_stats() const;
  // Drops every cached prepared plan (frees their device descriptors).
  void clear_plan_cache();

  struct impl;

 private:
  explicit cuda_peer_transport(std::unique_ptr<impl> state);
  std::unique_ptr<impl> impl_;
};

}  // namespace moebius
