// cuda_peer_transport: enqueue on the caller's streams (graph launch or direct launches),
// barriers between phases, and poll/wait with failure decoding.
//
// Stream order per local rank r on its stream S (the caller's, or the transport's own):
//   barrier_begin(status, epoch)        resets the rank's status for this plan
//   graph launch | direct phases        phase k: fused kernel and local copy-engine copies
//                                       (on the side stream, joined back into S, when
//                                       remote copies are queued too), remote copy-engine
//                                       copies, barrier closing k
//   status -> pinned host               (inside the graph, or after the direct phases)
//   record done_event                   poll() queries it, wait() synchronizes it
// Everything the transport forks joins back into S before the barrier of the phase, so work
// the caller enqueues on S after enqueue() returns runs after the whole plan.

#include <algorithm>
#include <utility>

#include "impl.hpp"
#include "moebius/cuda/check.hpp"
#include "moebius/error.hpp"

namespace moebius {

using cuda_peer::prepared_rank;
using cuda_peer::rank_state;

void cuda_peer_transport::impl::enqueue_rank_phase(const prepared_rank& pr, int64_t k,
                                                   cudaStream_t stream,
                                                   cuda_execute_stats& counts) const {
  const rank_state& rs = ranks[static_cast<size_t>(pr.rank)];
  const cuda_peer::phase_work& w = pr.phases[static_cast<size_t>(k)];
  // The side stream takes the SM kernel and the local copy-engine ops, the rank's stream the
  // remote copy-engine ops; when both have work they overlap (the local share of a weight
  // switch is 1/P of its bytes: after the remote slabs on one stream it would cost as much
  // again), and the side stream joins back before the barrier. Ranks that share a device
  // have no hardware queue to spare and run everything on their stream.
  auto enqueue_ce = [&](size_t begin, size_t end, cudaStream_t on) {
    for (size_t i = begin; i < end; ++i) {
      const cuda_peer::ce_op& c = pr.ce_ops[i];
      if (c.height == 1) {
        MOEBIUS_CUDA_CHECK(cudaMemcpyAsync(c.dst, c.src, c.width, cudaMemcpyDefault, on));
      } else {
        MOEBIUS_CUDA_CHECK(cudaMemcpy2DAsync(c.dst, c.dst_pitch, c.src, c.src_pitch, c.width,
                                             c.height, cudaMemcpyDefault, on));
      }
      ++counts.copy_engine_calls;
    }
  };
  const bool side_work = w.num_chunks > 0 || w.ce_end > w.ce_local;
  const bool fork = rs.alone_on_device && side_work && w.ce_local > w.ce_begin;
  cudaStream_t side = fork ? rs.side_stream.get() : stream;
  if (fork) {
    MOEBIUS_CUDA_CHECK(cudaEventRecord(rs.fork_event.get(), stream));
    MOEBIUS_CUDA_CHECK(cudaStreamWaitEvent(rs.side_stream.get(), rs.fork_event.get(), 0));
  }
  if (w.num_chunks > 0) {
    peer_copy_args a;
    a.descs = pr.descs() + w.desc_offset;
    a.num_descs = w.num_descs;
    a.num_chunks = w.num_chunks;
    a.chunk_bytes = config.sm_chunk_bytes;
    a.status = rs.status;
    launch_peer_copy(a, w.blocks, config.sm_kernel_threads, side);
    ++counts.kernel_launches;
  }
  enqueue_ce(w.ce_local, w.ce_end, side);
  if (fork) MOEBIUS_CUDA_CHECK(cudaEventRecord(rs.join_event.get(), rs.side_stream.get()));
  enqueue_ce(w.ce_begin, w.ce_local, stream);
  if (fork) MOEBIUS_CUDA_CHECK(cudaStreamWaitEvent(stream, rs.join_event.get(), 0));
  counts.copy_engine_ops += static_cast<int64_t>(w.ce_end - w.ce_begin);
  counts.sm_kernel_ops += w.num_descs;
  barrier_args b;
  b.peer_flags = rs.d_peer_flags.as<uint64_t* const>();
  b.my_flags = rs.flags;
  b.status = rs.status;
  b.rank = pr.rank;
  b.num_ranks = num_ranks;
  b.phase = k;
  b.timeout_ns = static_cast<uint64_t>(config.barrier_timeout_ns);
  launch_barrier(b, stream);
  ++counts.kernel_launches;
}

void cuda_peer_transport::impl::enqueue_status_readback(size_t local_index,
                                                        cudaStream_t stream) const {
  const rank_state& rs = ranks[static_cast<size_t>(local[local_index])];
  MOEBIUS_CUDA_CHECK(cudaMemcpyAsync(host_status.as<barrier_status>() + local_index, rs.status,
                                     sizeof(barrier_status), cudaMemcpyDeviceToHost, stream));
}

void cuda_peer_transport::impl::record_marks(size_t local_index, size_t first, size_t last,
                                             cudaStream_t stream) {
  rank_state& rs = ranks[static_cast<size_t>(local[local_index])];
  while (rs.mark_events.size() < marks.size()) {
    rs.mark_events.push_back(cuda_event::create(rs.device()));
  }
  for (size_t j = first; j < last; ++j) {
    MOEBIUS_CUDA_CHECK(cudaEventRecord(rs.mark_events[j].get(), stream));
  }
}

void cuda_peer_transport::impl::check_can_enqueue(std::span<const stream_handle> streams) const {
  MOEBIUS_CHECK(!outstanding, errc::invalid_argument,
                "cuda_peer_transport::enqueue: a plan is still outstanding; call wait() first");
  MOEBIUS_CHECK(streams.empty() || streams.size() == local.size(), errc::invalid_argument,
                "cuda_peer_transport::enqueue: got ", streams.size(),
                " streams for ", local.size(), " local ranks (pass none, or one per local rank)");
}

void cuda_peer_transport::impl::start(std::shared_ptr<const cuda_prepared_plan> prepared,
                                      std::span<const stream_handle> streams, bool from_cache,
                                      double prepare_seconds, double lookup_seconds) {
  const cuda_prepared_plan::impl& st = prepared->state();
  MOEBIUS_CHECK(st.owner == this, errc::invalid_argument,
                "the prepared plan was made by another cuda_peer_transport");
  completed = 0;
  stats = cuda_execute_stats{};
  stats.from_cache = from_cache;
  stats.prepare_seconds = prepare_seconds;
  stats.lookup_seconds = lookup_seconds;
  stats.max_sm_kernel_blocks = st.max_blocks;

  active_streams.resize(local.size());
  for (size_t i = 0; i < local.size(); ++i) {
    const stream_handle s = streams.empty() ? nullptr : streams[i];
    active_streams[i] = s != nullptr ? static_cast<cudaStream_t>(s)
                                     : ranks[static_cast<size_t>(local[i])].stream.get();
  }

  // One arrival value per phase barrier; every rank advances by the same amount whatever
  // happens, so a later plan never mistakes a stale arrival for a fresh one.
  const uint64_t base = epoch;
  epoch += static_cast<uint64_t>(st.num_phases);

  marks = pending_marks.take(st.num_phases);
  waits = pending_waits.take(st.num_phases);
  limit = st.num_phases;
  fault_fires = false;
  if (fault) {
    const fault_point at = *fault;
    fault.reset();
    if (at.phase >= 0 && at.phase < st.num_phases && at.op >= 0 &&
        at.op < st.ops_per_phase[static_cast<size_t>(at.phase)]) {
      limit = at.phase;
      fault_fires = true;
    }
  }

  current = std::move(prepared);
  outstanding = true;
  failure = nullptr;
  device_guard guard;
  const auto t0 = cuda_peer::clock_type::now();
  try {
    // st.ranks and `local` list the same ranks in the same (ascending) order.
    // Marks and waits sit between phases: such a plan goes phase by phase.
    const bool use_graphs = st.graphs && !fault_fires && marks.empty() && waits.empty();
    for (size_t i = 0; i < st.ranks.size(); ++i) {
      const prepared_rank& pr = st.ranks[i];
      if (pr.rank == config.debug_absent_rank) continue;
      const rank_state& rs = ranks[static_cast<size_t>(pr.rank)];
      guard.set(rs.device());
      launch_barrier_begin(rs.status, base, active_streams[i]);
      if (use_graphs) {
        MOEBIUS_CUDA_CHECK(cudaGraphLaunch(pr.graph_exec.get(), active_streams[i]));
        ++stats.graph_launches;
        stats.copy_engine_ops += pr.ce_count;
        stats.sm_kernel_ops += pr.sm_count;
      }
    }
    // Direct enqueue goes phase by phase over the ranks, never one rank's whole plan first:
    // a full launch queue would block the host on a rank whose barrier waits for a rank
    // not yet enqueued.
    size_t next_mark = 0;  // marks below it are recorded
    size_t next_wait = 0;  // waits below it are enqueued
    for (int64_t k = 0; !use_graphs && k < limit; ++k) {
      const size_t marks_end = next_mark < marks.size() && marks[next_mark] == k ? next_mark + 1
                                                                                 : next_mark;
      const transport::phase_wait* wait =
          next_wait < waits.size() && waits[next_wait].phase == k ? &waits[next_wait++] : nullptr;
      for (size_t i = 0; i < st.ranks.size(); ++i) {
        const prepared_rank& pr = st.ranks[i];
        if (pr.rank == config.debug_absent_rank) continue;
        guard.set(pr.device);
        // Every rank's event on every rank's stream: phase k writes peers (transport.hpp).
        if (wait != nullptr) {
          for (const event_handle e : wait->events) {
            if (e == nullptr) continue;
            MOEBIUS_CUDA_CHECK(cudaStreamWaitEvent(active_streams[i], static_cast<cudaEvent_t>(e), 0));
          }
        }
        enqueue_rank_phase(pr, k, active_streams[i], stats);
        record_marks(i, next_mark, marks_end, active_streams[i]);
      }
      next_mark = marks_end;
    }
    for (size_t i = 0; i < st.ranks.size(); ++i) {
      const prepared_rank& pr = st.ranks[i];
      guard.set(pr.device);
      // Marks a fault kept from running fire here, so that no waiter hangs (transport.hpp).
      if (pr.rank != config.debug_absent_rank) {
        record_marks(i, next_mark, marks.size(), active_streams[i]);
      }
      if (!use_graphs && pr.rank != config.debug_absent_rank) {
        enqueue_status_readback(i, active_streams[i]);
      }
      MOEBIUS_CUDA_CHECK(cudaEventRecord(ranks[static_cast<size_t>(pr.rank)].done_event.get(),
                                         active_streams[i]));
    }
  } catch (...) {
    // Work already enqueued may run: wait() drains it and says how far it got.
    failure = std::current_exception();
  }
  stats.enqueue_seconds = cuda_peer::seconds_since(t0);
}

bool cuda_peer_transport::impl::poll() {
  if (!outstanding || failure) return true;
  for (const int r : local) {
    const cudaError_t e = cudaEventQuery(ranks[static_cast<size_t>(r)].done_event.get());
    if (e == cudaErrorNotReady) return false;
    // Any other error: wait() will not block on it and reports it.
  }
  return true;
}

void cuda_peer_transport::impl::drain() noexcept {
  int saved = 0;
  const bool have = cudaGetDevice(&saved) == cudaSuccess;
  for (size_t i = 0; i < active_streams.size() && i < local.size(); ++i) {
    const rank_state& rs = ranks[static_cast<size_t>(local[i])];
    (void)cudaSetDevice(rs.device());
    (void)cudaStreamSynchronize(active_streams[i]);
    if (rs.side_stream) (void)cudaStreamSynchronize(rs.side_stream.get());
  }
  if (have) (void)cudaSetDevice(saved);
}

void cuda_peer_transport::impl::wait() {
  if (!outstanding) return;
  outstanding = false;
  const std::shared_ptr<const cuda_prepared_plan> prepared = std::move(current);
  const cuda_prepared_plan::impl& st = prepared->state();
  device_guard guard;

  if (failure) {
    // An enqueue step failed after work had started: let that work finish, then say how many
    // phases passed on every rank (0 when the statuses cannot be read, e.g. after a sticky
    // CUDA error).
    drain();
    int64_t passed = limit;
    for (const prepared_rank& pr : st.ranks) {
      if (pr.rank == config.debug_absent_rank) continue;
      barrier_status s{};
      if (cudaSetDevice(pr.device) != cudaSuccess ||
          cudaMemcpy(&s, ranks[static_cast<size_t>(pr.rank)].status, sizeof(s),
                     cudaMemcpyDeviceToHost) != cudaSuccess) {
        passed = 0;
        break;
      }
      passed = std::min(passed, static_cast<int64_t>(s.passed));
    }
    completed = passed;
    std::rethrow_exception(std::exchange(failure, nullptr));
  }

  cudaError_t first = cudaSuccess;
  for (const int r : local) {
    const cudaError_t e = cudaEventSynchronize(ranks[static_cast<size_t>(r)].done_event.get());
    if (first == cudaSuccess) first = e;
  }
  if (first != cudaSuccess) {
    drain();
    completed = 0;  // a CUDA error is sticky: nothing finer can be learnt
    MOEBIUS_CUDA_CHECK(first);
  }

  // Every local rank's barrier status, copied to pinned memory by its last stream step.
  int64_t passed = limit;
  int failed_rank = -1;
  barrier_status failed{};
  const barrier_status* host = host_status.as<const barrier_status>();
  for (size_t i = 0; i < st.ranks.size(); ++i) {
    const prepared_rank& pr = st.ranks[i];
    if (pr.rank == config.debug_absent_rank) continue;
    const barrier_status s = host[i];
    passed = std::min(passed, static_cast<int64_t>(s.passed));
    if (s.error != 0 && failed_rank < 0) {
      failed_rank = pr.rank;
      failed = s;
    }
  }
  if (config.debug_absent_rank >= 0 && config.debug_absent_rank < num_ranks &&
      ranks[static_cast<size_t>(config.debug_absent_rank)].local) {
    // The absent rank ran nothing; nobody can have passed a barrier without it.
    if (limit > 0 && failed_rank < 0) passed = 0;
  }
  completed = passed;
  if (failed_rank >= 0) {
    MOEBIUS_FAIL(errc::timeout, "rank ", failed_rank, " timed out after ",
                 config.barrier_timeout_ns, " ns at the barrier closing phase ",
                 failed.failed_phase, " waiting for rank ", failed.missing_rank, " (", passed,
                 " phases completed on every rank)");
  }
  if (fault_fires) {
    MOEBIUS_FAIL(errc::injected_fault, "injected fault before phase ", limit,
                 " (nothing of that phase was enqueued)");
  }
}

// ---------------------------------------------------------------------------------------------

void cuda_peer_transport::enqueue(const plan& p, std::span<const stream_handle> streams) {
  impl_->check_can_enqueue(streams);
  // No validate(p) here: a cache hit equals a plan validated when it was prepared (the memory
  // has not changed since), and a miss is validated by prepare. Validating a 30k-op KV plan on
  // every enqueue cost more host time than the copies themselves.
  bool from_cache = false;
  double prepare_seconds = 0;
  double lookup_seconds = 0;
  std::shared_ptr<const cuda_prepared_plan> prepared =
      impl_->lookup_or_prepare(p, from_cache, prepare_seconds, lookup_seconds);
  impl_->start(std::move(prepared), streams, from_cache, prepare_seconds, lookup_seconds);
}

void cuda_peer_transport::enqueue(std::shared_ptr<const cuda_prepared_plan> prepared,
                                  std::span<const stream_handle> streams) {
  MOEBIUS_CHECK(prepared != nullptr, errc::invalid_argument,
                "cuda_peer_transport::enqueue: null prepared plan");
  impl_->check_can_enqueue(streams);
  impl_->start(std::move(prepared), streams, false, 0, 0);
}

void cuda_peer_transport::execute(std::shared_ptr<const cuda_prepared_plan> prepared) {
  enqueue(std::move(prepared));
  wait();
}

void cuda_peer_transport::mark_phases(std::span<const int64_t> after_phases) {
  impl_->pending_marks.set(after_phases, "cuda_peer_transport");
}

void cuda_peer_transport::wait_before_phases(std::span<const phase_wait> waits) {
  MOEBIUS_CHECK(waits.empty() || impl_->process_rank < 0, errc::invalid_argument,
                "cuda_peer_transport::wait_before_phases: multi_process ranks cannot wait on "
                "another process's events; wait on the host (or use single_process)");
  impl_->pending_waits.set(waits, impl_->local.size(), "cuda_peer_transport");
}

event_handle cuda_peer_transport::phase_event(size_t mark, size_t local_index) const {
  const impl& st = *impl_;
  detail::check_phase_event(mark, st.marks.size(), local_index, st.local.size(),
                            "cuda_peer_transport");
  const cuda_peer::rank_state& rs = st.ranks[static_cast<size_t>(st.local[local_index])];
  // A rank that enqueued nothing (the absent-rank test hook) recorded no events.
  return mark < rs.mark_events.size() ? rs.mark_events[mark].get() : nullptr;
}

bool cuda_peer_transport::poll() { return impl_->poll(); }
void cuda_peer_transport::wait() { impl_->wait(); }

}  // namespace moebius
