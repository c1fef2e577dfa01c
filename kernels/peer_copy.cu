// The fused copy kernel of cuda_peer_transport: one launch moves every SM-engine op of one rank
// in one phase, reading op descriptors from device memory. Work unit: one chunk of one op
// (peer_copy_desc) per warp, warps take chunks round-robin, so a large op spreads over the
// whole grid and many small ops pack into the same warps.

#include <cstdint>

#include "moebius/cuda/peer_kernels.hpp"

#include "moebius/cuda/check.hpp"
#include "moebius/error.hpp"

namespace moebius {
namespace {

constexpr int k_warp = 32;
constexpr int k_unroll = 4;  // vectors in flight per lane: loads are issued before stores

template <class V>
__device__ __forceinline__ void copy_vectors(std::byte* __restrict__ dst,
                                             const std::byte* __restrict__ src, int64_t count,
                                             int lane) {
  V* d = reinterpret_cast<V*>(dst);
  const V* s = reinterpret_cast<const V*>(src);
  for (int64_t base = lane; base < count; base += int64_t{k_warp} * k_unroll) {
    V v[k_unroll];
#pragma unroll
    for (int u = 0; u < k_unroll; ++u) {
      const int64_t i = base + int64_t{u} * k_warp;
      if (i < count) v[u] = s[i];
    }
#pragma unroll
    for (int u = 0; u < k_unroll; ++u) {
      const int64_t i = base + int64_t{u} * k_warp;
      if (i < count) d[i] = v[u];
    }
  }
}

__device__ __forceinline__ void copy_bytes(std::byte* dst, const std::byte* src, int64_t n,
                                           int lane) {
  for (int64_t i = lane; i < n; i += k_warp) dst[i] = src[i];
}

// Copies n bytes with the widest access V that src and dst share the alignment of: a byte-wise
// head up to V alignment, V-wide body, byte-wise tail.
template <class V>
__device__ __forceinline__ void copy_with(std::byte* dst, const std::byte* src, int64_t n,
                                          int lane) {
  constexpr int64_t w = sizeof(V);
  int64_t head = (w - static_cast<int64_t>(reinterpret_cast<uintptr_t>(src) & (w - 1))) & (w - 1);
  if (head > n) head = n;
  copy_bytes(dst, src, head, lane);
  const int64_t body = (n - head) / w;
  copy_vectors<V>(dst + head, src + head, body, lane);
  const int64_t done = head + body * w;
  copy_bytes(dst + done, src + done, n - done, lane);
}

// One warp copies n bytes, any alignment.
__device__ __forceinline__ void warp_copy(std::byte* dst, const std::byte* src, int64_t n,
                                          int lane) {
  const uintptr_t mis = reinterpret_cast<uintptr_t>(src) ^ reinterpret_cast<uintptr_t>(dst);
  if ((mis & 15) == 0) {
    copy_with<uint4>(dst, src, n, lane);
  } else if ((mis & 7) == 0) {
    copy_with<uint2>(dst, src, n, lane);
  } else if ((mis & 3) == 0) {
    copy_with<uint32_t>(dst, src, n, lane);
  } else if ((mis & 1) == 0) {
    copy_with<uint16_t>(dst, src, n, lane);
  } else {
    copy_bytes(dst, src, n, lane);
  }
}

// One warp copies `nrows` rows whose addresses, pitches and length are 16-byte multiples: the
// rows are flattened into one index space of 16-byte vectors so short rows keep all lanes busy.
// nrows * row_bytes <= chunk_bytes <= 2^30, so vector indices fit 32 bits.
__device__ __forceinline__ void warp_copy_rows16(std::byte* dst, int64_t dst_pitch,
                                                 const std::byte* src, int64_t src_pitch,
                                                 int64_t nrows, int64_t row_bytes, int lane) {
  const uint32_t per_row = static_cast<uint32_t>(row_bytes / 16);
  const uint32_t total = static_cast<uint32_t>(nrows) * per_row;
  for (uint32_t base = static_cast<uint32_t>(lane); base < total; base += k_warp * k_unroll) {
    uint4 v[k_unroll];
#pragma unroll
    for (int u = 0; u < k_unroll; ++u) {
      const uint32_t i = base + static_cast<uint32_t>(u * k_warp);
      if (i < total) {
        const uint32_t row = i / per_row;
        const uint32_t col = i - row * per_row;
        v[u] = *reinterpret_cast<const uint4*>(src + row * src_pitch + int64_t{col} * 16);
      }
    }
#pragma unroll
    for (int u = 0; u < k_unroll; ++u) {
      const uint32_t i = base + static_cast<uint32_t>(u * k_warp);
      if (i < total) {
        const uint32_t row = i / per_row;
        const uint32_t col = i - row * per_row;
        *reinterpret_cast<uint4*>(dst + row * dst_pitch + int64_t{col} * 16) = v[u];
      }
    }
  }
}

__global__ void __launch_bounds__(peer_copy_max_threads)
    peer_copy_kernel(const __grid_constant__ peer_copy_args a) {
  // A barrier of this execute() timed out: the plan is abandoned, move nothing more.
  if (a.status != nullptr && *reinterpret_cast<const volatile uint32_t*>(&a.status->error) != 0) {
    return;
  }
  const int lane = static_cast<int>(threadIdx.x) & (k_warp - 1);
  const int64_t warp =
      (int64_t{blockIdx.x} * blockDim.x + threadIdx.x) / k_warp;
  const int64_t num_warps = int64_t{gridDim.x} * blockDim.x / k_warp;
  int64_t lo = 0;  // chunks ascend per warp, so the op index never decreases
  for (int64_t c = warp; c < a.num_chunks; c += num_warps) {
    int64_t hi = a.num_descs - 1;
    while (lo < hi) {
      const int64_t mid = (lo + hi + 1) / 2;
      if (a.descs[mid].first_chunk <= c) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    const peer_copy_desc d = a.descs[lo];
    const int64_t local = c - d.first_chunk;
    if (d.pieces_per_row > 1) {
      const int64_t row = local / d.pieces_per_row;
      const int64_t begin = (local - row * d.pieces_per_row) * a.chunk_bytes;
      const int64_t n = d.row_bytes - begin < a.chunk_bytes ? d.row_bytes - begin : a.chunk_bytes;
      warp_copy(d.dst + row * d.dst_pitch + begin, d.src + row * d.src_pitch + begin, n, lane);
    } else {
      const int64_t r0 = local * d.rows_per_chunk;
      const int64_t r1 = r0 + d.rows_per_chunk < d.rows ? r0 + d.rows_per_chunk : d.rows;
      const std::byte* src = d.src + r0 * d.src_pitch;
      std::byte* dst = d.dst + r0 * d.dst_pitch;
      const uintptr_t align = reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst) |
                              static_cast<uintptr_t>(d.src_pitch) |
                              static_cast<uintptr_t>(d.dst_pitch) |
                              static_cast<uintptr_t>(d.row_bytes);
      if ((align & 15) == 0) {
        warp_copy_rows16(dst, d.dst_pitch, src, d.src_pitch, r1 - r0, d.row_bytes, lane);
      } else {
        for (int64_t r = r0; r < r1; ++r) {
          warp_copy(d.dst + r * d.dst_pitch, d.src + r * d.src_pitch, d.row_bytes, lane);
        }
      }
    }
  }
}

}  // namespace

void launch_peer_copy(const peer_copy_args& args, int blocks, int threads,
                      cudaStream_t stream) {
  if (args.num_chunks == 0 || blocks <= 0) return;
  MOEBIUS_CHECK(threads >= 32 && threads <= peer_copy_max_threads && threads % 32 == 0,
                errc::invalid_argument, "peer_copy: threads must be a multiple of 32 in [32, ",
                peer_copy_max_threads, "] (threads=", threads, ")");
  peer_copy_kernel<<<static_cast<unsigned>(blocks), static_cast<unsigned>(threads), 0, stream>>>(
      args);
  detail::check_launch("peer_copy");
}

}  // namespace moebius
