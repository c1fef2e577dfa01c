#include "moebius/transport/nccl_transport.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cstddef>
#include <exception>
#include <string>
#include <utility>

#include "moebius/cuda/check.hpp"
#include "moebius/cuda/handles.hpp"
#include "moebius/cuda/nccl_check.hpp"
#include "moebius/cuda/peer_kernels.hpp"
#include "moebius/error.hpp"
#include "phase_marks.hpp"
#include "plan_cache.hpp"

namespace moebius {
namespace {

constexpr int64_t k_staging_alignment = 256;
// Fused copy kernel settings for pack, unpack and local copies (cuda_peer_config's defaults).
constexpr int k_copy_threads = 512;
constexpr int64_t k_copy_chunk_bytes = int64_t{32} << 10;

constexpr int64_t align_up(int64_t v, int64_t a) {
  return (v + a - 1) / a * a;
}

// A remote op goes through staging on the side whose rows are strided.
constexpr bool strided_at_source(const copy_op& op) {
  return op.rows > 1 && op.src_pitch != op.row_bytes;
}
constexpr bool strided_at_destination(const copy_op& op) {
  return op.rows > 1 && op.dst_pitch != op.row_bytes;
}

// Calls f(op_index, staging_offset) for each op of `ops` that `rank` stages, in op order, and
// returns the staging bytes used. workspace_bytes and prepare both walk the ops through this
// one function, so the query and the execution cannot disagree.
template <class F>
int64_t walk_staging(const std::vector<copy_op>& ops, int rank, F&& f) {
  int64_t offset = 0;
  for (size_t i = 0; i < ops.size(); ++i) {
    const copy_op& op = ops[i];
    if (op.is_local()) continue;
    const bool stages = (op.src_rank == rank && strided_at_source(op)) ||
                        (op.dst_rank == rank && strided_at_destination(op));
    if (!stages) continue;
    f(i, offset);
    offset += align_up(op.bytes(), k_staging_alignment);
  }
  return offset;
}

// The steps of one phase that are device copies on a rank.
enum step : uint8_t { step_local, step_pack, step_unpack, num_steps };

// One fused-kernel launch: descriptors [desc_offset, desc_offset + num_descs) of the rank.
struct copy_launch {
  int64_t desc_offset = 0;
  int64_t num_descs = 0;
  int64_t num_chunks = 0;
  int blocks = 0;
};

// One ncclSend / ncclRecv with resolved pointers, in plan order.
struct p2p_call {
  bool send = false;
  size_t local_index = 0;
  void* buf = nullptr;
  size_t count = 0;
  int peer = 0;
};

struct prepared_plan {
  int64_t num_phases = 0;
  std::vector<device_buffer> descs;  // per local rank: every step's descriptors
  // [local rank][phase][step]
  std::vector<std::vector<std::array<copy_launch, num_steps>>> launches;
  std::vector<std::vector<p2p_call>> p2p;  // [phase]
};

}  // namespace

struct nccl_transport::impl {
  struct local_rank {
    int rank = 0;          // NCCL rank = plan rank
    rank_memory memory;
    nccl_rank_comm comm;
    int sm_count = 0;
    cuda_stream stream;    // the transport's own
    cuda_stream side;      // local copies
    cuda_event fork;
    cuda_event join;
    cuda_event done;
    std::vector<cuda_event> mark_events;  // phase marks, grown on demand
    int device() const { return memory.device; }
  };
  nccl_config config;
  std::vector<local_rank> ranks;   // sorted by rank
  std::vector<int> local_of_rank;  // index into ranks per plan rank, or -1
  detail::plan_cache<prepared_plan> cache;

  bool outstanding = false;
  std::shared_ptr<const prepared_plan> current;
  std::vector<cudaStream_t> active;  // per local rank
  std::exception_ptr failure;
  int64_t completed_on_success = 0;
  int64_t enqueued_phases = 0;      // phases fully enqueued (for a failure part-way)
  bool fault_fires = false;
  std::string fault_message;
  detail::phase_marks pending_marks;  // for the next enqueue
  std::vector<int64_t> marks;         // of the outstanding (or last) plan, those it reaches
  detail::phase_waits pending_waits;  // for the next enqueue
  std::vector<transport::phase_wait> waits;  // of the outstanding plan

  // Records the events of marks [first, last) on every local rank's active stream.
  void record_marks(size_t first, size_t last) {
    device_guard guard;
    for (size_t li = 0; li < ranks.size(); ++li) {
      local_rank& r = ranks[li];
      guard.set(r.device());
      while (r.mark_events.size() < marks.size()) {
        r.mark_events.push_back(cuda_event::create(r.device()));
      }
      for (size_t j = first; j < last; ++j) {
        MOEBIUS_CUDA_CHECK(cudaEventRecord(r.mark_events[j].get(), active[li]));
      }
    }
  }

  ~impl() {
    if (outstanding) drain();
  }

  std::byte* address(const local_rank& r, memory_space space, int64_t offset) const {
    return r.memory.space(space).data() + offset;
  }

  std::shared_ptr<const prepared_plan> prepare(const plan& p) const {
    auto pp = std::make_shared<prepared_plan>();
    pp->num_phases = static_cast<int64_t>(p.phases.size());
    pp->launches.resize(ranks.size());
    pp->p2p.resize(p.phases.size());
    for (size_t li = 0; li < ranks.size(); ++li) {
      const local_rank& r = ranks[li];
      const int64_t warps_per_block = k_copy_threads / 32;
      std::vector<peer_copy_desc> descs;
      for (const plan_phase& phase : p.phases) {
        std::vector<int64_t> staged(phase.ops.size(), -1);
        walk_staging(phase.ops, r.rank, [&](size_t i, int64_t off) { staged[i] = off; });
        auto* staging = static_cast<std::byte*>(r.comm.workspace);
        std::array<copy_launch, num_steps> launch{};
        for (int s = 0; s < num_steps; ++s) {
          copy_launch& l = launch[static_cast<size_t>(s)];
          l.desc_offset = static_cast<int64_t>(descs.size());
          auto add = [&](const std::byte* src, std::byte* dst, const copy_op& op,
                         int64_t src_pitch, int64_t dst_pitch) {
            peer_copy_desc d;
            d.src = src;
            d.dst = dst;
            d.rows = op.rows;
            d.row_bytes = op.row_bytes;
            d.src_pitch = op.rows == 1 ? 0 : src_pitch;
            d.dst_pitch = op.rows == 1 ? 0 : dst_pitch;
            d.first_chunk = l.num_chunks;
            l.num_chunks += split_into_chunks(d, k_copy_chunk_bytes);
            descs.push_back(d);
          };
          for (size_t i = 0; i < phase.ops.size(); ++i) {
            const copy_op& op = phase.ops[i];
            if (s == step_local && op.is_local() && op.src_rank == r.rank) {
              add(address(r, op.src_space, op.src_offset), address(r, op.dst_space, op.dst_offset),
                  op, op.src_pitch, op.dst_pitch);
            } else if (s == step_pack && staged[i] >= 0 && op.src_rank == r.rank) {
              add(address(r, op.src_space, op.src_offset), staging + staged[i], op, op.src_pitch,
                  op.row_bytes);
            } else if (s == step_unpack && staged[i] >= 0 && op.dst_rank == r.rank) {
              add(staging + staged[i], address(r, op.dst_space, op.dst_offset), op, op.row_bytes,
                  op.dst_pitch);
            }
          }
          l.num_descs = static_cast<int64_t>(descs.size()) - l.desc_offset;
          if (l.num_chunks > 0) {
            const int64_t want = (l.num_chunks + warps_per_block - 1) / warps_per_block;
            l.blocks = static_cast<int>(std::min<int64_t>(want, r.sm_count));
          }
        }
        pp->launches[li].push_back(launch);
      }
      const auto bytes = static_cast<int64_t>(descs.size() * sizeof(peer_copy_desc));
      pp->descs.push_back(device_buffer::allocate(r.device(), bytes));
      if (bytes > 0) {
        device_guard guard(r.device());
        // Stream-ordered and complete before `descs` dies.
        MOEBIUS_CUDA_CHECK(cudaMemcpyAsync(pp->descs.back().get(), descs.data(),
                                           static_cast<size_t>(bytes), cudaMemcpyHostToDevice,
                                           r.stream.get()));
        MOEBIUS_CUDA_CHECK(cudaStreamSynchronize(r.stream.get()));
      }
    }
    // Every send and receive, in plan order on both sides: NCCL pairs the calls between two
    // ranks in issue order.
    for (size_t k = 0; k < p.phases.size(); ++k) {
      const plan_phase& phase = p.phases[k];
      std::vector<std::vector<int64_t>> staged(ranks.size());
      for (size_t li = 0; li < ranks.size(); ++li) {
        staged[li].assign(phase.ops.size(), -1);
        walk_staging(phase.ops, ranks[li].rank,
                     [&](size_t i, int64_t off) { staged[li][i] = off; });
      }
      for (size_t i = 0; i < phase.ops.size(); ++i) {
        const copy_op& op = phase.ops[i];
        if (op.is_local()) continue;
        const auto count = static_cast<size_t>(op.bytes());
        const int src_li = local_of_rank[static_cast<size_t>(op.src_rank)];
        const int dst_li = local_of_rank[static_cast<size_t>(op.dst_rank)];
        if (src_li >= 0) {
          const local_rank& r = ranks[static_cast<size_t>(src_li)];
          std::byte* buf = strided_at_source(op)
                               ? static_cast<std::byte*>(r.comm.workspace) +
                                     staged[static_cast<size_t>(src_li)][i]
                               : address(r, op.src_space, op.src_offset);
          pp->p2p[k].push_back({true, static_cast<size_t>(src_li), buf, count, op.dst_rank});
        }
        if (dst_li >= 0) {
          const local_rank& r = ranks[static_cast<size_t>(dst_li)];
          std::byte* buf = strided_at_destination(op)
                               ? static_cast<std::byte*>(r.comm.workspace) +
                                     staged[static_cast<size_t>(dst_li)][i]
                               : address(r, op.dst_space, op.dst_offset);
          pp->p2p[k].push_back({false, static_cast<size_t>(dst_li), buf, count, op.src_rank});
        }
      }
    }
    return pp;
  }

  std::shared_ptr<const prepared_plan> lookup_or_prepare(const plan& p) {
    if (std::shared_ptr<const prepared_plan> hit = cache.find(p)) return hit;
    std::shared_ptr<const prepared_plan> pp = prepare(p);
    cache.insert(p, pp, config.max_cached_plans);
    return pp;
  }

  void launch_copy(size_t li, const prepared_plan& pp, const copy_launch& l,
                   cudaStream_t stream) const {
    if (l.num_chunks == 0) return;
    peer_copy_args a;
    a.descs = pp.descs[li].as<const peer_copy_desc>() + l.desc_offset;
    a.num_descs = l.num_descs;
    a.num_chunks = l.num_chunks;
    a.chunk_bytes = k_copy_chunk_bytes;
    launch_peer_copy(a, l.blocks, k_copy_threads, stream);
  }

  // Enqueues phase k of `pp` on every local rank's active stream.
  void enqueue_phase(const prepared_plan& pp, size_t k) {
    device_guard guard;
    // 0. Local copies on each rank's side stream, forked from its stream at the start of the
    // phase, so they overlap the NCCL transfers (at P = 2 they are half of a rank's bytes).
    std::vector<char> forked(ranks.size(), 0);
    for (size_t li = 0; li < ranks.size(); ++li) {
      const copy_launch& l = pp.launches[li][k][step_local];
      if (l.num_chunks == 0) continue;
      const local_rank& r = ranks[li];
      guard.set(r.device());
      MOEBIUS_CUDA_CHECK(cudaEventRecord(r.fork.get(), active[li]));
      MOEBIUS_CUDA_CHECK(cudaStreamWaitEvent(r.side.get(), r.fork.get(), 0));
      launch_copy(li, pp, l, r.side.get());
      MOEBIUS_CUDA_CHECK(cudaEventRecord(r.join.get(), r.side.get()));
      forked[li] = 1;
    }
    // 1. Pack strided sources.
    for (size_t li = 0; li < ranks.size(); ++li) {
      guard.set(ranks[li].device());
      launch_copy(li, pp, pp.launches[li][k][step_pack], active[li]);
    }
    // 2. Every send and receive of the phase, of every local rank, in one group.
    if (!pp.p2p[k].empty()) {
      MOEBIUS_NCCL_CHECK(ncclGroupStart());
      try {
        for (const p2p_call& c : pp.p2p[k]) {
          const local_rank& r = ranks[c.local_index];
          if (c.send) {
            MOEBIUS_NCCL_CHECK(ncclSend(c.buf, c.count, ncclUint8, c.peer, r.comm.comm,
                                        active[c.local_index]));
          } else {
            MOEBIUS_NCCL_CHECK(ncclRecv(c.buf, c.count, ncclUint8, c.peer, r.comm.comm,
                                        active[c.local_index]));
          }
        }
      } catch (...) {
        (void)ncclGroupEnd();
        throw;
      }
      MOEBIUS_NCCL_CHECK(ncclGroupEnd());
    }
    // 3. Unpack strided destinations (same stream, so after the receives), then make the
    // stream wait for the local copies: the phase ends when both are done.
    for (size_t li = 0; li < ranks.size(); ++li) {
      guard.set(ranks[li].device());
      launch_copy(li, pp, pp.launches[li][k][step_unpack], active[li]);
      if (forked[li] != 0) {
        MOEBIUS_CUDA_CHECK(cudaStreamWaitEvent(active[li], ranks[li].join.get(), 0));
      }
    }
  }

  void drain() noexcept {
    int saved = 0;
    const bool have = cudaGetDevice(&saved) == cudaSuccess;
    for (size_t li = 0; li < ranks.size() && li < active.size(); ++li) {
      (void)cudaSetDevice(ranks[li].device());
      (void)cudaStreamSynchronize(ranks[li].side.get());
      (void)cudaStreamSynchronize(active[li]);
    }
    if (have) (void)cudaSetDevice(saved);
  }
};

int64_t nccl_transport::workspace_bytes(const plan& p, int rank) {
  MOEBIUS_CHECK(rank >= 0 && rank < p.num_ranks, errc::invalid_argument, "rank ", rank,
                " is outside the plan's ranks [0, ", p.num_ranks, ")");
  int64_t most = 0;
  for (const plan_phase& phase : p.phases) {
    most = std::max(most, walk_staging(phase.ops, rank, [](size_t, int64_t) {}));
  }
  return most;
}

nccl_transport::nccl_transport(std::vector<rank_memory> memory, std::vector<nccl_rank_comm> comms,
                               const nccl_config& config)
    : impl_(std::make_unique<impl>()) {
  MOEBIUS_CHECK(config.max_cached_plans >= 0, errc::invalid_argument,
                "max_cached_plans must be >= 0 (max_cached_plans=", config.max_cached_plans, ")");
  impl_->config = config;
  MOEBIUS_CHECK(!memory.empty() && memory.size() == comms.size(), errc::invalid_argument,
                "nccl_transport needs one rank_memory and one nccl_rank_comm per local rank (got ",
                memory.size(), " and ", comms.size(), ")");
  validate_rank_memory(memory, memory_kind_rule::require_device);
  std::vector<impl::local_rank>& ranks = impl_->ranks;
  for (size_t i = 0; i < comms.size(); ++i) {
    const nccl_rank_comm& c = comms[i];
    MOEBIUS_CHECK(c.comm != nullptr, errc::invalid_argument, "local rank entry ", i,
                  " has no communicator");
    int count = 0, rank = 0, device = 0;
    MOEBIUS_NCCL_CHECK(ncclCommCount(c.comm, &count));
    MOEBIUS_NCCL_CHECK(ncclCommUserRank(c.comm, &rank));
    MOEBIUS_NCCL_CHECK(ncclCommCuDevice(c.comm, &device));
    if (i == 0) num_ranks_ = count;
    MOEBIUS_CHECK(count == num_ranks_, errc::invalid_argument,
                  "communicators of one nccl_transport must have the same size (entry 0 has ",
                  num_ranks_, " ranks, entry ", i, " has ", count, ")");
    MOEBIUS_CHECK(device == memory[i].device, errc::invalid_argument, "local rank entry ", i,
                  " has memory on device ", memory[i].device, " but its communicator uses device ",
                  device);
    MOEBIUS_CHECK(c.workspace_bytes >= 0 && (c.workspace_bytes == 0 || c.workspace != nullptr),
                  errc::invalid_argument, "rank ", rank, " workspace of ", c.workspace_bytes,
                  " bytes has a null pointer");
    impl::local_rank r;
    r.rank = rank;
    r.memory = memory[i];
    r.comm = c;
    ranks.push_back(std::move(r));
  }
  std::sort(ranks.begin(), ranks.end(),
            [](const impl::local_rank& a, const impl::local_rank& b) { return a.rank < b.rank; });
  impl_->local_of_rank.assign(static_cast<size_t>(num_ranks_), -1);
  for (size_t li = 0; li < ranks.size(); ++li) {
    int& slot = impl_->local_of_rank[static_cast<size_t>(ranks[li].rank)];
    MOEBIUS_CHECK(slot < 0, errc::invalid_argument, "NCCL rank ", ranks[li].rank,
                  " appears twice among the local ranks");
    slot = static_cast<int>(li);
  }
  for (impl::local_rank& r : ranks) {
    MOEBIUS_CUDA_CHECK(
        cudaDeviceGetAttribute(&r.sm_count, cudaDevAttrMultiProcessorCount, r.device()));
    r.stream = cuda_stream::create(r.device());
    r.side = cuda_stream::create(r.device());
    r.fork = cuda_event::create(r.device());
    r.join = cuda_event::create(r.device());
    r.done = cuda_event::create(r.device());
  }
}

nccl_transport::~nccl_transport() = default;

void nccl_transport::validate(const plan& p) const {
  std::vector<rank_memory> memory;
  for (const impl::local_rank& r : impl_->ranks) memory.push_back(r.memory);
  validate_plan_fits(p, num_ranks_, memory);
  for (const impl::local_rank& r : impl_->ranks) {
    const int64_t need = workspace_bytes(p, r.rank);
    MOEBIUS_CHECK(r.comm.workspace_bytes >= need, errc::invalid_argument, "rank ", r.rank,
                  " staging workspace holds ", r.comm.workspace_bytes,
                  " bytes but the plan needs workspace_bytes(plan, ", r.rank, ") = ", need);
  }
}

std::vector<int> nccl_transport::local_ranks() const {
  std::vector<int> local;
  for (const impl::local_rank& r : impl_->ranks) local.push_back(r.rank);
  return local;
}

cudaStream_t nccl_transport::stream_of(int rank) const {
  MOEBIUS_CHECK(rank >= 0 && rank < num_ranks_ && impl_->local_of_rank[static_cast<size_t>(rank)] >= 0,
                errc::invalid_argument, "rank ", rank, " is not driven by this process");
  return impl_->ranks[static_cast<size_t>(impl_->local_of_rank[static_cast<size_t>(rank)])]
      .stream.get();
}

int nccl_transport::device_of(int rank) const {
  MOEBIUS_CHECK(rank >= 0 && rank < num_ranks_ && impl_->local_of_rank[static_cast<size_t>(rank)] >= 0,
                errc::invalid_argument, "rank ", rank, " is not driven by this process");
  return impl_->ranks[static_cast<size_t>(impl_->local_of_rank[static_cast<size_t>(rank)])]
      .device();
}

void nccl_transport::clear_plan_cache() { impl_->cache.clear(); }

void nccl_transport::prepare(const plan& p) {
  validate(p);
  (void)impl_->lookup_or_prepare(p);
}

void nccl_transport::enqueue(const plan& p, std::span<const stream_handle> streams) {
  impl& st = *impl_;
  MOEBIUS_CHECK(!st.outstanding, errc::invalid_argument,
                "nccl_transport::enqueue: a plan is still outstanding; call wait() first");
  MOEBIUS_CHECK(streams.empty() || streams.size() == st.ranks.size(), errc::invalid_argument,
                "nccl_transport::enqueue: got ", streams.size(), " streams for ",
                st.ranks.size(), " local ranks (pass none, or one per local rank)");
  validate(p);
  // An armed fault applies to this plan only, and fires only if the plan reaches it
  // (transport.hpp): a phase or op index past the end is dropped. A faulted plan runs the
  // prefix before the fault: phases [0, k) and ops [0, op) of phase k, prepared apart from
  // the cache.
  const std::optional<fault_point> fault = std::exchange(fault_, std::nullopt);
  const auto num_phases = static_cast<int64_t>(p.phases.size());
  st.fault_fires = fault && fault->phase >= 0 && fault->phase < num_phases && fault->op >= 0 &&
                   fault->op < static_cast<int64_t>(p.phases[static_cast<size_t>(fault->phase)].ops.size());
  std::shared_ptr<const prepared_plan> pp;
  if (st.fault_fires) {
    plan prefix;
    prefix.num_ranks = p.num_ranks;
    prefix.phases.assign(p.phases.begin(), p.phases.begin() + fault->phase + 1);
    std::vector<copy_op>& ops = prefix.phases.back().ops;
    ops.resize(static_cast<size_t>(fault->op));
    pp = st.prepare(prefix);
    st.completed_on_success = fault->phase;
    st.fault_message = "injected fault before op " + std::to_string(fault->op) + " of phase " +
                       std::to_string(fault->phase) + " ('" +
                       p.phases[static_cast<size_t>(fault->phase)].label + "')";
  } else {
    pp = st.lookup_or_prepare(p);
    st.completed_on_success = num_phases;
  }

  st.active.resize(st.ranks.size());
  for (size_t li = 0; li < st.ranks.size(); ++li) {
    const stream_handle s = streams.empty() ? nullptr : streams[li];
    st.active[li] = s != nullptr ? static_cast<cudaStream_t>(s) : st.ranks[li].stream.get();
  }
  completed_phases_ = 0;
  st.outstanding = true;
  st.failure = nullptr;
  st.current = pp;
  st.enqueued_phases = 0;
  st.marks = st.pending_marks.take(num_phases);
  st.waits = st.pending_waits.take(num_phases);
  try {
    size_t next_mark = 0;  // marks below it are recorded
    size_t next_wait = 0;  // waits below it are enqueued
    for (int64_t k = 0; k < pp->num_phases; ++k) {
      if (next_wait < st.waits.size() && st.waits[next_wait].phase == k) {
        const transport::phase_wait& w = st.waits[next_wait++];
        device_guard guard;
        for (size_t li = 0; li < st.ranks.size(); ++li) {
          if (w.events[li] == nullptr) continue;
          guard.set(st.ranks[li].device());
          MOEBIUS_CUDA_CHECK(
              cudaStreamWaitEvent(st.active[li], static_cast<cudaEvent_t>(w.events[li]), 0));
        }
      }
      st.enqueue_phase(*pp, static_cast<size_t>(k));
      st.enqueued_phases = k + 1;
      if (next_mark < st.marks.size() && st.marks[next_mark] == k) {
        st.record_marks(next_mark, next_mark + 1);
        ++next_mark;
      }
    }
    st.enqueued_phases = pp->num_phases;
    // Marks a fault kept from running fire here, so that no waiter hangs (transport.hpp).
    st.record_marks(next_mark, st.marks.size());
    device_guard guard;
    for (size_t li = 0; li < st.ranks.size(); ++li) {
      guard.set(st.ranks[li].device());
      MOEBIUS_CUDA_CHECK(cudaEventRecord(st.ranks[li].done.get(), st.active[li]));
    }
  } catch (...) {
    st.failure = std::current_exception();
  }
}

void nccl_transport::mark_phases(std::span<const int64_t> after_phases) {
  impl_->pending_marks.set(after_phases, "nccl_transport");
}

void nccl_transport::wait_before_phases(std::span<const phase_wait> waits) {
  impl_->pending_waits.set(waits, impl_->ranks.size(), "nccl_transport");
}

event_handle nccl_transport::phase_event(size_t mark, size_t local_index) const {
  const impl& st = *impl_;
  detail::check_phase_event(mark, st.marks.size(), local_index, st.ranks.size(),
                            "nccl_transport");
  const impl::local_rank& r = st.ranks[local_index];
  return mark < r.mark_events.size() ? r.mark_events[mark].get() : nullptr;
}

bool nccl_transport::poll() {
  const impl& st = *impl_;
  if (!st.outstanding || st.failure) return true;
  for (const impl::local_rank& r : st.ranks) {
    if (cudaEventQuery(r.done.get()) == cudaErrorNotReady) return false;
  }
  return true;
}

void nccl_transport::wait() {
  impl& st = *impl_;
  if (!st.outstanding) return;
  st.outstanding = false;
  const std::shared_ptr<const prepared_plan> pp = std::move(st.current);
  if (st.failure) {
    // Enqueueing phase k failed: what was enqueued before it runs to the end.
    st.drain();
    completed_phases_ = std::min(st.enqueued_phases, st.completed_on_success);
    std::rethrow_exception(std::exchange(st.failure, nullptr));
  }
  cudaError_t first = cudaSuccess;
  for (const impl::local_rank& r : st.ranks) {
    const cudaError_t e = cudaEventSynchronize(r.done.get());
    if (first == cudaSuccess) first = e;
  }
  if (first != cudaSuccess) {
    st.drain();
    completed_phases_ = 0;  // a sticky CUDA error hides the rest
    MOEBIUS_CUDA_CHECK(first);
  }
  completed_phases_ = st.completed_on_success;
  if (st.fault_fires) MOEBIUS_FAIL(errc::injected_fault, st.fault_message);
}

}  // namespace moebius
