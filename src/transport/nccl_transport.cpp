#include "moebius/transport/nccl_transport.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <utility>

#include "moebius/cuda/check.hpp"
#include "moebius/cuda/nccl_check.hpp"
#include "moebius/detail/nccl_pack.hpp"
#include "moebius/error.hpp"

namespace moebius {
namespace {

constexpr int64_t k_staging_alignment = 256;

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

// Calls f(op_index, staging_offset) for each op of `ops[0, num_ops)` that `rank` stages, in
// op order, and returns the staging bytes used. workspace_bytes and enqueue_phase both walk
// the ops through this one function, so the query and the execution cannot disagree.
template <class F>
int64_t walk_staging(const std::vector<copy_op>& ops, int64_t num_ops, int rank, F&& f) {
  int64_t offset = 0;
  for (int64_t i = 0; i < num_ops; ++i) {
    const copy_op& op = ops[static_cast<size_t>(i)];
    if (op.is_local()) continue;
    const bool stages = (op.src_rank == rank && strided_at_source(op)) ||
                        (op.dst_rank == rank && strided_at_destination(op));
    if (!stages) continue;
    f(i, offset);
    offset += align_up(op.bytes(), k_staging_alignment);
  }
  return offset;
}

// Device pointer of `offset` in `space` of a local rank.
std::byte* address(const nccl_rank& r, memory_space space, int64_t offset) {
  return static_cast<std::byte*>(r.space_base[static_cast<int>(space)]) + offset;
}

// Makes a device current for a scope and restores the caller's device afterwards.
class device_guard {
 public:
  device_guard() { MOEBIUS_CUDA_CHECK(cudaGetDevice(&saved_)); }
  ~device_guard() { (void)cudaSetDevice(saved_); }
  device_guard(const device_guard&) = delete;
  device_guard& operator=(const device_guard&) = delete;
  void set(int device) { MOEBIUS_CUDA_CHECK(cudaSetDevice(device)); }

 private:
  int saved_ = 0;
};

}  // namespace

int64_t nccl_transport::workspace_bytes(const plan& p, int rank) {
  MOEBIUS_CHECK(rank >= 0 && rank < p.num_ranks, errc::invalid_argument, "rank ", rank,
                " is outside the plan's ranks [0, ", p.num_ranks, ")");
  int64_t most = 0;
  for (const plan_phase& phase : p.phases) {
    const int64_t bytes = walk_staging(phase.ops, static_cast<int64_t>(phase.ops.size()), rank,
                                       [](int64_t, int64_t) {});
    most = std::max(most, bytes);
  }
  return most;
}

nccl_transport::nccl_transport(std::vector<nccl_rank> local_ranks)
    : ranks_(std::move(local_ranks)) {
  MOEBIUS_CHECK(!ranks_.empty(), errc::invalid_argument, "nccl_transport needs at least one rank");
  for (size_t i = 0; i < ranks_.size(); ++i) {
    const nccl_rank& r = ranks_[i];
    MOEBIUS_CHECK(r.comm != nullptr, errc::invalid_argument, "local rank entry ", i,
                  " has no communicator");
    int count = 0, rank = 0, device = 0;
    MOEBIUS_NCCL_CHECK(ncclCommCount(r.comm, &count));
    MOEBIUS_NCCL_CHECK(ncclCommUserRank(r.comm, &rank));
    MOEBIUS_NCCL_CHECK(ncclCommCuDevice(r.comm, &device));
    if (i == 0) num_ranks_ = count;
    MOEBIUS_CHECK(count == num_ranks_, errc::invalid_argument,
                  "communicators of one nccl_transport must have the same size (entry 0 has ",
                  num_ranks_, " ranks, entry ", i, " has ", count, ")");
    MOEBIUS_CHECK(device == r.device, errc::invalid_argument, "local rank entry ", i,
                  " says device ", r.device, " but its communicator uses device ", device);
    for (int s = 0; s < num_memory_spaces; ++s) {
      MOEBIUS_CHECK(r.space_bytes[s] >= 0, errc::invalid_argument, "rank ", rank, " space ",
                    to_string(static_cast<memory_space>(s)), " has negative size ",
                    r.space_bytes[s]);
      MOEBIUS_CHECK(r.space_bytes[s] == 0 || r.space_base[s] != nullptr, errc::invalid_argument,
                    "rank ", rank, " space ", to_string(static_cast<memory_space>(s)), " has ",
                    r.space_bytes[s], " bytes but a null base pointer");
    }
    MOEBIUS_CHECK(r.workspace_bytes >= 0 && (r.workspace_bytes == 0 || r.workspace != nullptr),
                  errc::invalid_argument, "rank ", rank, " workspace of ", r.workspace_bytes,
                  " bytes has a null pointer");
    rank_of_local_.push_back(rank);
  }
  local_of_rank_.assign(static_cast<size_t>(num_ranks_), -1);
  for (size_t i = 0; i < rank_of_local_.size(); ++i) {
    int& slot = local_of_rank_[static_cast<size_t>(rank_of_local_[i])];
    MOEBIUS_CHECK(slot < 0, errc::invalid_argument, "NCCL rank ", rank_of_local_[i],
                  " appears twice among the local ranks (entries ", slot, " and ", i, ")");
    slot = static_cast<int>(i);
  }
  device_guard guard;
  try {
    for (const nccl_rank& r : ranks_) {
      guard.set(r.device);
      cudaStream_t side = nullptr;
      MOEBIUS_CUDA_CHECK(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
      side_.push_back(side);
      cudaEvent_t fork = nullptr, join = nullptr;
      MOEBIUS_CUDA_CHECK(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
      fork_.push_back(fork);
      MOEBIUS_CUDA_CHECK(cudaEventCreateWithFlags(&join, cudaEventDisableTiming));
      join_.push_back(join);
    }
  } catch (...) {
    release_streams();
    throw;
  }
}

nccl_transport::~nccl_transport() {
  release_streams();
}

void nccl_transport::release_streams() noexcept {
  int saved = 0;
  (void)cudaGetDevice(&saved);
  for (size_t li = 0; li < ranks_.size(); ++li) {
    (void)cudaSetDevice(ranks_[li].device);
    if (li < side_.size()) {
      (void)cudaStreamSynchronize(side_[li]);
      (void)cudaStreamDestroy(side_[li]);
    }
    if (li < fork_.size()) (void)cudaEventDestroy(fork_[li]);
    if (li < join_.size()) (void)cudaEventDestroy(join_[li]);
  }
  (void)cudaSetDevice(saved);
  side_.clear();
  fork_.clear();
  join_.clear();
}

const nccl_rank* nccl_transport::find_local(int rank) const {
  const int i = local_of_rank_[static_cast<size_t>(rank)];
  return i < 0 ? nullptr : &ranks_[static_cast<size_t>(i)];
}

void nccl_transport::validate(const plan& p) const {
  MOEBIUS_CHECK(p.num_ranks == num_ranks_, errc::invalid_argument, "plan is for ", p.num_ranks,
                " ranks but the NCCL communicators have ", num_ranks_);
  int64_t caps[num_memory_spaces];
  for (int s = 0; s < num_memory_spaces; ++s) {
    caps[s] = ranks_[0].space_bytes[s];
    for (const nccl_rank& r : ranks_) caps[s] = std::min(caps[s], r.space_bytes[s]);
  }
  moebius::validate(p, caps);
  for (size_t rank = 0; rank < local_of_rank_.size(); ++rank) {
    const nccl_rank* r = find_local(static_cast<int>(rank));
    if (r == nullptr) continue;
    const int64_t need = workspace_bytes(p, static_cast<int>(rank));
    MOEBIUS_CHECK(r->workspace_bytes >= need, errc::invalid_argument, "rank ", rank,
                  " staging workspace holds ", r->workspace_bytes,
                  " bytes but the plan needs workspace_bytes(plan, ", rank, ") = ", need);
  }
}

void nccl_transport::enqueue_phase(const plan_phase& phase, int64_t num_ops) {
  const std::vector<copy_op>& ops = phase.ops;
  if (num_ops < 0) num_ops = static_cast<int64_t>(ops.size());
  device_guard guard;

  // Staging offset of each op per local rank (-1: not staged). An op stages on at most one
  // side per rank, since a remote op has two different ranks.
  std::vector<std::vector<int64_t>> staged(ranks_.size());
  for (size_t li = 0; li < ranks_.size(); ++li) {
    staged[li].assign(static_cast<size_t>(num_ops), -1);
    walk_staging(ops, num_ops, rank_of_local_[li],
                 [&](int64_t i, int64_t off) { staged[li][static_cast<size_t>(i)] = off; });
  }
  const auto staging_of = [&](size_t li, int64_t op_idx) {
    return static_cast<std::byte*>(ranks_[li].workspace) + staged[li][static_cast<size_t>(op_idx)];
  };

  // 0. Local ops on each rank's side stream, forked from the main stream at the start of the
  // phase, so they overlap the NCCL transfers (at P = 2 they are half of a rank's bytes).
  std::vector<char> has_local(ranks_.size(), 0);
  for (size_t li = 0; li < ranks_.size(); ++li) {
    const nccl_rank& r = ranks_[li];
    for (int64_t i = 0; i < num_ops; ++i) {
      const copy_op& op = ops[static_cast<size_t>(i)];
      if (!op.is_local() || op.src_rank != rank_of_local_[li]) continue;
      if (!has_local[li]) {
        guard.set(r.device);
        MOEBIUS_CUDA_CHECK(cudaEventRecord(fork_[li], r.stream));
        MOEBIUS_CUDA_CHECK(cudaStreamWaitEvent(side_[li], fork_[li], 0));
        has_local[li] = 1;
      }
      std::byte* dst = address(r, op.dst_space, op.dst_offset);
      const std::byte* src = address(r, op.src_space, op.src_offset);
      const bool contiguous =
          op.rows == 1 || (op.src_pitch == op.row_bytes && op.dst_pitch == op.row_bytes);
      if (contiguous) {
        MOEBIUS_CUDA_CHECK(cudaMemcpyAsync(dst, src, static_cast<size_t>(op.bytes()),
                                           cudaMemcpyDeviceToDevice, side_[li]));
      } else {
        detail::launch_strided_copy({src, dst, op.rows, op.row_bytes, op.src_pitch, op.dst_pitch},
                                    side_[li]);
      }
    }
    if (has_local[li]) MOEBIUS_CUDA_CHECK(cudaEventRecord(join_[li], side_[li]));
  }

  // 1. Pack strided sources.
  for (size_t li = 0; li < ranks_.size(); ++li) {
    const nccl_rank& r = ranks_[li];
    guard.set(r.device);
    for (int64_t i = 0; i < num_ops; ++i) {
      const copy_op& op = ops[static_cast<size_t>(i)];
      if (staged[li][static_cast<size_t>(i)] < 0 || op.src_rank != rank_of_local_[li]) continue;
      detail::launch_strided_copy({address(r, op.src_space, op.src_offset), staging_of(li, i),
                                   op.rows, op.row_bytes, op.src_pitch, op.row_bytes},
                                  r.stream);
    }
  }

  // 2. Every send and receive of the phase, of every local rank, in one group. NCCL pairs
  // the calls between two ranks in issue order, and both sides walk the ops in plan order.
  bool any_remote = false;
  for (int64_t i = 0; i < num_ops && !any_remote; ++i) {
    const copy_op& op = ops[static_cast<size_t>(i)];
    any_remote = !op.is_local() && (find_local(op.src_rank) || find_local(op.dst_rank));
  }
  if (any_remote) {
    MOEBIUS_NCCL_CHECK(ncclGroupStart());
    try {
      for (int64_t i = 0; i < num_ops; ++i) {
        const copy_op& op = ops[static_cast<size_t>(i)];
        if (op.is_local()) continue;
        const size_t count = static_cast<size_t>(op.bytes());
        const int src_li = local_of_rank_[static_cast<size_t>(op.src_rank)];
        const int dst_li = local_of_rank_[static_cast<size_t>(op.dst_rank)];
        if (src_li >= 0) {
          const nccl_rank& r = ranks_[static_cast<size_t>(src_li)];
          const std::byte* buf = strided_at_source(op) ? staging_of(static_cast<size_t>(src_li), i)
                                                       : address(r, op.src_space, op.src_offset);
          MOEBIUS_NCCL_CHECK(ncclSend(buf, count, ncclUint8, op.dst_rank, r.comm, r.stream));
        }
        if (dst_li >= 0) {
          const nccl_rank& r = ranks_[static_cast<size_t>(dst_li)];
          std::byte* buf = strided_at_destination(op) ? staging_of(static_cast<size_t>(dst_li), i)
                                                      : address(r, op.dst_space, op.dst_offset);
          MOEBIUS_NCCL_CHECK(ncclRecv(buf, count, ncclUint8, op.src_rank, r.comm, r.stream));
        }
      }
    } catch (...) {
      (void)ncclGroupEnd();
      throw;
    }
    MOEBIUS_NCCL_CHECK(ncclGroupEnd());
  }

  // 3. Unpack strided destinations (same stream, so after the receives), then make the main
  // stream wait for the local copies: the phase ends when both are done.
  for (size_t li = 0; li < ranks_.size(); ++li) {
    const nccl_rank& r = ranks_[li];
    guard.set(r.device);
    for (int64_t i = 0; i < num_ops; ++i) {
      const copy_op& op = ops[static_cast<size_t>(i)];
      if (staged[li][static_cast<size_t>(i)] < 0 || op.dst_rank != rank_of_local_[li]) continue;
      detail::launch_strided_copy({staging_of(li, i), address(r, op.dst_space, op.dst_offset),
                                   op.rows, op.row_bytes, op.row_bytes, op.dst_pitch},
                                  r.stream);
    }
    if (has_local[li]) MOEBIUS_CUDA_CHECK(cudaStreamWaitEvent(r.stream, join_[li], 0));
  }
}

void nccl_transport::enqueue_phases(const plan& p, int64_t first, int64_t last) {
  const int64_t num_phases = static_cast<int64_t>(p.phases.size());
  MOEBIUS_CHECK(0 <= first && first <= last && last <= num_phases, errc::out_of_range,
                "phase range [", first, ", ", last, ") is outside the plan's [0, ", num_phases,
                ")");
  for (int64_t k = first; k < last; ++k) enqueue_phase(p.phases[static_cast<size_t>(k)], -1);
}

void nccl_transport::synchronize() {
  device_guard guard;
  for (const nccl_rank& r : ranks_) {
    guard.set(r.device);
    MOEBIUS_CUDA_CHECK(cudaStreamSynchronize(r.stream));
  }
}

std::vector<int> nccl_transport::local_ranks() const {
  std::vector<int> local(rank_of_local_);
  std::sort(local.begin(), local.end());
  return local;
}

void nccl_transport::enqueue(const plan& p, std::span<const stream_handle> streams) {
  MOEBIUS_CHECK(!outstanding_, errc::invalid_argument,
                "nccl_transport::enqueue: a plan is still outstanding; call wait() first");
  MOEBIUS_CHECK(streams.empty(), errc::invalid_argument,
                "nccl_transport::enqueue: caller streams are not supported yet");
  validate(p);
  outstanding_ = true;
  failure_ = nullptr;
  try {
    run_blocking(p);
  } catch (...) {
    failure_ = std::current_exception();
  }
}

void nccl_transport::wait() {
  outstanding_ = false;
  if (failure_) std::rethrow_exception(std::exchange(failure_, nullptr));
}

void nccl_transport::run_blocking(const plan& p) {
  // An armed fault applies to this execute() only, and fires only if the plan reaches it
  // (transport.hpp): a phase or op index past the end is dropped.
  const std::optional<fault_point> fault = std::exchange(fault_, std::nullopt);
  completed_phases_ = 0;
  validate(p);
  // Waits for whatever was enqueued, ignoring errors: used only on the way out of a failure.
  const auto drain = [this] {
    int saved = 0;
    (void)cudaGetDevice(&saved);
    for (size_t li = 0; li < ranks_.size(); ++li) {
      (void)cudaSetDevice(ranks_[li].device);
      (void)cudaStreamSynchronize(side_[li]);
      (void)cudaStreamSynchronize(ranks_[li].stream);
    }
    (void)cudaSetDevice(saved);
  };
  const int64_t num_phases = static_cast<int64_t>(p.phases.size());
  for (int64_t k = 0; k < num_phases; ++k) {
    const plan_phase& phase = p.phases[static_cast<size_t>(k)];
    const bool fault_here = fault && fault->phase == k && fault->op >= 0 &&
                            fault->op < static_cast<int64_t>(phase.ops.size());
    const int64_t limit = fault_here ? fault->op : -1;
    try {
      enqueue_phase(phase, limit);
    } catch (...) {
      drain();
      completed_phases_ = k;
      throw;
    }
    if (fault_here) {
      const int64_t op = fault->op;
      drain();
      completed_phases_ = k;
      MOEBIUS_FAIL(errc::injected_fault, "injected fault before op ", op, " of phase ", k, " ('",
                   phase.label, "')");
    }
  }
  synchronize();  // on failure completed_phases_ stays 0: a sticky CUDA error hides the rest
  completed_phases_ = num_phases;
}

}  // namespace moebius
