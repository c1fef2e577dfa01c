// Virtual ranks (gpu_runtime.hpp): all P ranks on one device, where NCCL refuses two ranks of
// one communicator, so the runtime's four collectives run over device memory. Each is
//   barrier: every rank's stream waits until every rank's stream has reached this point (its
//            sources are written);
//   work:    each rank, on its own stream, pulls what it needs from its peers' buffers
//            (cudaMemcpyAsync, device to device) or sums them (sum_ranks) into its scratch;
//   barrier: no rank goes on (and overwrites a source, or its sum's buffer) before every peer
//            has read it.
// A barrier is one event per rank, recorded on its stream, that every other rank's stream
// waits for: events only, no spinning kernel, so ranks sharing a hardware queue cannot
// deadlock. Under capture (graph_cache.cu: one graph holds every rank's stream) the same calls
// become edges of that graph. The host enqueues every record of a barrier before any wait,
// so one event per rank serves every barrier (a wait sees the record just made).

#include <moebius/error.hpp>

#include "runtime_impl.hpp"

namespace mini_engine::gpu {

using moebius::errc;

namespace {

void copy_on(cudaStream_t s, void* dst, const void* src, int64_t bytes) {
  if (bytes <= 0) return;
  MOEBIUS_CUDA_CHECK(
      cudaMemcpyAsync(dst, src, static_cast<size_t>(bytes), cudaMemcpyDeviceToDevice, s));
}

}  // namespace

void gpu_runtime::impl::barrier() {
  each_rank([&](int, rank_state& rs) { MOEBIUS_CUDA_CHECK(cudaEventRecord(rs.meet, rs.stream)); });
  each_rank([&](int r, rank_state& rs) {
    for (int q = 0; q < P; ++q)
      if (q != r)
        MOEBIUS_CUDA_CHECK(cudaStreamWaitEvent(rs.stream, ranks[static_cast<size_t>(q)].meet, 0));
  });
}

void gpu_runtime::impl::join_into_first() {
  rank_state& first = ranks[0];
  each_rank([&](int r, rank_state& rs) {
    if (r > 0) MOEBIUS_CUDA_CHECK(cudaEventRecord(rs.meet, rs.stream));
  });
  each_rank([&](int r, rank_state& rs) {
    if (r > 0) MOEBIUS_CUDA_CHECK(cudaStreamWaitEvent(first.stream, rs.meet, 0));
  });
}

void gpu_runtime::impl::fork_from_first() {
  rank_state& first = ranks[0];
  set_device(first);
  MOEBIUS_CUDA_CHECK(cudaEventRecord(first.meet, first.stream));
  each_rank([&](int r, rank_state& rs) {
    if (r > 0) MOEBIUS_CUDA_CHECK(cudaStreamWaitEvent(rs.stream, first.meet, 0));
  });
}

// In place: every rank's `buf` becomes sum over q = 0..P-1 of rank q's `buf` (sum_ranks: the
// same order on every rank, so TP ranks hold the same bits).
void gpu_runtime::impl::device_all_reduce(float* rank_state::*buf, int64_t count) {
  MOEBIUS_CHECK(count <= buffer_sizes.reduce_scratch_floats, errc::internal,
                "gpu_runtime: an all-reduce of ", count, " floats, scratch for ",
                buffer_sizes.reduce_scratch_floats);
  sum_ranks_args a;
  a.num_parts = P;
  a.n = count;
  for (int q = 0; q < P; ++q) a.parts[q] = ranks[static_cast<size_t>(q)].*buf;
  barrier();
  each_rank([&](int, rank_state& rs) {
    a.out = rs.reduce_scratch;
    launch_sum_ranks(a, rs.stream);
  });
  barrier();
  each_rank(
      [&](int, rank_state& rs) { copy_on(rs.stream, rs.*buf, rs.reduce_scratch, count * 4); });
}

// Rank r's gathered block q = rank q's T packed rows (the NCCL all-gather's layout).
void gpu_runtime::impl::device_dispatch_all_gather(int64_t T) {
  const int64_t bytes = T * row_layout.row_bytes;
  barrier();
  each_rank([&](int, rank_state& rs) {
    for (int q = 0; q < P; ++q)
      copy_on(rs.stream, rs.gathered + q * bytes, ranks[static_cast<size_t>(q)].packed, bytes);
  });
  barrier();
}

// Rank r's recv block p (p != r) = rank p's moe_out block r: p's partial sums for r's T rows.
void gpu_runtime::impl::device_combine_exchange(int64_t T) {
  const int64_t n = T * c.hidden;
  barrier();
  each_rank([&](int r, rank_state& rs) {
    for (int p = 0; p < P; ++p)
      if (p != r)
        copy_on(rs.stream, rs.recv + p * n, ranks[static_cast<size_t>(p)].moe_out + r * n, n * 4);
  });
  barrier();
}

// Rank r's recv block q = rank q's first `rows` rows of the residual stream h.
void gpu_runtime::impl::device_hand_off_all_gather(int64_t rows) {
  const int64_t n = rows * c.hidden;
  barrier();
  each_rank([&](int, rank_state& rs) {
    for (int q = 0; q < P; ++q)
      copy_on(rs.stream, rs.recv + q * n, ranks[static_cast<size_t>(q)].h, n * 4);
  });
  barrier();
}

}  // namespace mini_engine::gpu
