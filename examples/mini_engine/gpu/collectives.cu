// The runtime's collectives. One rank per device: NCCL calls; one thread drives every rank, so
// each collective is issued for all ranks inside one ncclGroupStart/End, in rank order, on
// each rank's stream (graphs capture them as they are). Virtual ranks (all on one device,
// where NCCL refuses two ranks of a communicator): the same collectives over device memory
// (device_collectives.cu). The callers mark the stage (profiler.hpp).

#include <moebius/cuda/nccl_check.hpp>

#include "runtime_impl.hpp"

namespace mini_engine::gpu {

using moebius::dtype;
using moebius::errc;
using moebius::parallel_mode;

// Sums `count` floats of buffer `buf` over the ranks, in place (TP: o_proj and MoE partial
// sums).
void gpu_runtime::impl::all_reduce(float* rank_state::*buf, int64_t count) {
  if (P == 1) return;
  if (virt) return device_all_reduce(buf, count);
  MOEBIUS_NCCL_CHECK(ncclGroupStart());
  for (rank_state& rs : ranks) {
    float* b = rs.*buf;
    MOEBIUS_NCCL_CHECK(
        ncclAllReduce(b, b, static_cast<size_t>(count), ncclFloat, ncclSum, rs.comm, rs.stream));
  }
  MOEBIUS_NCCL_CHECK(ncclGroupEnd());
}

// Dispatch (EP attention, P > 1): every rank receives every rank's T packed rows
// (packed -> gathered, rank order).
void gpu_runtime::impl::dispatch_all_gather(int64_t T) {
  if (virt) return device_dispatch_all_gather(T);
  const size_t bytes = static_cast<size_t>(T * row_layout.row_bytes);
  MOEBIUS_NCCL_CHECK(ncclGroupStart());
  for (rank_state& rs : ranks)
    MOEBIUS_NCCL_CHECK(ncclAllGather(rs.packed, rs.gathered, bytes, ncclUint8, rs.comm, rs.stream));
  MOEBIUS_NCCL_CHECK(ncclGroupEnd());
}

// Combine (EP attention, P > 1): each rank's partial outputs for peer q's T rows
// (moe_out block q) go to q, which receives them into recv block p; a rank's own block
// stays (the caller copies it).
void gpu_runtime::impl::combine_exchange(int64_t T) {
  if (virt) return device_combine_exchange(T);
  const int64_t H = c.hidden;
  const size_t n = static_cast<size_t>(T * H);
  MOEBIUS_NCCL_CHECK(ncclGroupStart());
  for (int r = 0; r < P; ++r) {
    rank_state& rs = ranks[static_cast<size_t>(r)];
    for (int peer = 0; peer < P; ++peer) {
      if (peer == r) continue;
      MOEBIUS_NCCL_CHECK(
          ncclSend(rs.moe_out + peer * T * H, n, ncclFloat, peer, rs.comm, rs.stream));
      MOEBIUS_NCCL_CHECK(ncclRecv(rs.recv + peer * T * H, n, ncclFloat, peer, rs.comm, rs.stream));
    }
  }
  MOEBIUS_NCCL_CHECK(ncclGroupEnd());
}

// Hand-off EP -> TP (P > 1): every rank receives every owner's `rows` rows of the residual
// stream (h -> recv, [P, rows] blocks in rank order).
void gpu_runtime::impl::hand_off_all_gather(int64_t rows) {
  if (virt) return device_hand_off_all_gather(rows);
  const size_t n = static_cast<size_t>(rows * c.hidden);
  MOEBIUS_NCCL_CHECK(ncclGroupStart());
  for (rank_state& rs : ranks)
    MOEBIUS_NCCL_CHECK(ncclAllGather(rs.h, rs.recv, n, ncclFloat, rs.comm, rs.stream));
  MOEBIUS_NCCL_CHECK(ncclGroupEnd());
}

}  // namespace mini_engine::gpu
