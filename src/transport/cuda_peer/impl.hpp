#pragma once

// Internal state of cuda_peer_transport and cuda_prepared_plan, shared by the files that
// implement them by concern:
//   setup.cpp       config checks, single_process(), local rank state, accessors
//   ipc.cpp         multi_process(): CUDA IPC export, all-gather, open, checks
//   prepare.cpp     engine choice, descriptors, CUDA graph capture (prepare_plan)
//   plan_cache.cpp  prepared plans keyed by fingerprint_of(plan), confirmed by ==
//   execute.cpp     enqueue on caller streams, barriers, poll/wait and failure decoding

#include <cuda_runtime_api.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "moebius/cuda/handles.hpp"
#include "moebius/cuda/peer_kernels.hpp"
#include "moebius/memory/rank_memory.hpp"
#include "moebius/transport/cuda_peer_transport.hpp"
#include "../phase_marks.hpp"
#include "../plan_cache.hpp"

namespace moebius::cuda_peer {

using clock_type = std::chrono::steady_clock;

inline double seconds_since(clock_type::time_point t0) {
  return std::chrono::duration<double>(clock_type::now() - t0).count();
}

// Hardware queues (CUDA_DEVICE_MAX_CONNECTIONS) each device of this process has.
int hardware_queues();

// Each barrier allocation: flags[num_ranks] (written by peers), then the rank's status.
inline size_t status_offset(int num_ranks) {
  return (static_cast<size_t>(num_ranks) * sizeof(uint64_t) + 255) / 256 * 256;
}
inline size_t barrier_alloc_bytes(int num_ranks) {
  return status_offset(num_ranks) + sizeof(barrier_status);
}

// One copy-engine call with resolved pointers.
struct ce_op {
  void* dst;
  size_t dst_pitch;
  const void* src;
  size_t src_pitch;
  size_t width;
  size_t height;
};

// Work of one rank in one phase.
struct phase_work {
  size_t ce_begin = 0;   // range in prepared_rank::ce_ops: remote ops first,
  size_t ce_local = 0;   // then, from here, ops within the rank's own memory
  size_t ce_end = 0;
  int64_t desc_offset = 0;  // first descriptor in the rank's device array
  int64_t num_descs = 0;
  int64_t num_chunks = 0;
  int blocks = 0;
};

struct prepared_rank {
  int rank = 0;
  int device = 0;
  std::vector<ce_op> ce_ops;
  std::vector<phase_work> phases;
  device_buffer d_descs;  // all phases' peer_copy_desc, on `device`
  int64_t num_descs = 0;
  int64_t ce_count = 0;
  int64_t sm_count = 0;
  cuda_graph graph;            // the rank's whole plan, captured (use_cuda_graphs)
  cuda_graph_exec graph_exec;

  const peer_copy_desc* descs() const { return d_descs.as<const peer_copy_desc>(); }
};

// A local rank: streams, events and barrier memory. Peers (multi_process) have only
// `memory` and `flags`.
struct rank_state {
  rank_memory memory;      // spaces as addressable in this process (peers: IPC mappings)
  bool local = false;
  // The fused kernel runs on the side stream, forked from the rank's stream, when a phase
  // also has copy-engine ops: the copy engines push the remote slabs while the SMs copy the
  // local share. Only for a rank alone on its device: a forked branch (inside a CUDA graph it
  // runs on a stream the driver picks) could share a hardware queue with another virtual
  // rank's spinning barrier and stall it.
  bool alone_on_device = true;
  cuda_stream stream;       // the transport's own stream of the rank
  cuda_stream side_stream;  // alone_on_device only
  cuda_event fork_event;
  cuda_event join_event;
  cuda_event done_event;    // recorded after the rank's last work of an enqueue
  std::vector<cuda_event> mark_events;  // phase marks (transport::mark_phases), grown on demand
  device_buffer barrier_alloc;      // flags + status
  uint64_t* flags = nullptr;        // this rank's flags as mapped in this process
  barrier_status* status = nullptr; // local ranks, device memory
  device_buffer d_peer_flags;       // [P] uint64_t*, on the rank's device
  int sm_count = 0;

  int device() const { return memory.device; }
};

}  // namespace moebius::cuda_peer

namespace moebius {

struct cuda_prepared_plan::impl {
  const cuda_peer_transport::impl* owner = nullptr;
  int num_ranks = 0;
  int64_t num_phases = 0;
  int64_t num_ops = 0;
  std::vector<int64_t> ops_per_phase;
  std::vector<cuda_peer::prepared_rank> ranks;  // local ranks only
  std::vector<int64_t> ce_ops_of_rank;  // [num_ranks]
  std::vector<int64_t> sm_ops_of_rank;  // [num_ranks]
  std::vector<std::vector<int>> blocks;  // [rank][phase], empty for remote ranks
  int max_blocks = 0;
  int64_t descriptor_bytes = 0;
  bool graphs = false;  // every rank has graph_exec
};

struct cuda_peer_transport::impl {
  // Declaration order is release order, reversed: cached plans (graphs, descriptors) go first,
  // then rank state (streams synchronize on destruction), IPC mappings, peer access.
  std::vector<peer_access_guard> peer_access;
  std::vector<ipc_mapping> ipc_mappings;
  cuda_peer_config config;
  int num_ranks = 0;
  int process_rank = -1;
  std::vector<cuda_peer::rank_state> ranks;
  std::vector<int> local;              // local ranks, ascending
  pinned_host_buffer host_status;      // barrier_status per local rank (index in `local`)
  int64_t min_bytes[num_memory_spaces] = {};
  uint64_t epoch = 0;  // barrier arrivals used so far (all enqueues)
  std::optional<fault_point> fault;
  detail::phase_marks pending_marks;  // for the next enqueue
  std::vector<int64_t> marks;         // of the outstanding (or last) plan, those it reaches
  detail::phase_waits pending_waits;  // for the next enqueue
  std::vector<transport::phase_wait> waits;  // of the outstanding plan
  cuda_execute_stats stats;
  detail::plan_cache<cuda_prepared_plan> cache;

  // The outstanding plan (enqueue .. wait).
  bool outstanding = false;
  std::shared_ptr<const cuda_prepared_plan> current;
  std::vector<cudaStream_t> active_streams;  // per local rank: where the plan runs
  int64_t limit = 0;         // phases enqueued (num_phases, or the injected fault's phase)
  bool fault_fires = false;
  std::exception_ptr failure;  // an enqueue step failed after work had started
  int64_t completed = 0;

  ~impl();

  // setup.cpp
  void check_config() const;
  void init_local(cuda_peer::rank_state& r);  // streams, events, barrier memory
  void upload_peer_flags();
  void finish_setup();  // min sizes, pinned status, local list
  void validate(const plan& p) const;

  // prepare.cpp
  std::shared_ptr<const cuda_prepared_plan> prepare(const plan& p);
  void capture_graphs(cuda_prepared_plan::impl& st);
  std::vector<bool> choose_engines(const std::vector<const copy_op*>& ops) const;
  std::byte* pointer(int rank, memory_space s, int64_t offset) const;

  // plan_cache.cpp
  std::shared_ptr<const cuda_prepared_plan> lookup_or_prepare(const plan& p, bool& from_cache,
                                                              double& prepare_seconds,
                                                              double& lookup_seconds);

  // execute.cpp
  void enqueue_rank_phase(const cuda_peer::prepared_rank& pr, int64_t k, cudaStream_t stream,
                          cuda_execute_stats& counts) const;
  void enqueue_status_readback(size_t local_index, cudaStream_t stream) const;
  // Records the events of the marks in [first, last) on local rank `local_index`'s stream.
  void record_marks(size_t local_index, size_t first, size_t last, cudaStream_t stream);
  void check_can_enqueue(std::span<const stream_handle> streams) const;
  void start(std::shared_ptr<const cuda_prepared_plan> prepared,
             std::span<const stream_handle> streams, bool from_cache, double prepare_seconds,
             double lookup_seconds);
  bool poll();
  void wait();
  void drain() noexcept;  // waits for the outstanding plan's streams, ignoring errors
};

}  // namespace moebius
