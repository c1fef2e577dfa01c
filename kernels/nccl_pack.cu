// Strided device copy: packs strided rows into nccl_transport's staging workspace, unpacks
// them on the receiver, and runs strided local ops (see detail/nccl_pack.hpp).

#include <cuda_runtime.h>

#include <cstdint>

#include "moebius/detail/nccl_pack.hpp"
#include "moebius/error.hpp"

namespace moebius::detail {
namespace {

// Templates are instantiated by launch_strided_copy below (one per vector width).
//
// One flat index over every vector of every row: rows of a weight reshard are often short
// (256 B .. 8 KiB), so one block per row would leave most threads idle.
template <class Vec>
__global__ void __launch_bounds__(256)
    strided_copy_kernel(const __grid_constant__ strided_copy_args a) {
  const int64_t vecs_per_row = a.row_bytes / static_cast<int64_t>(sizeof(Vec));
  const int64_t total = vecs_per_row * a.rows;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += stride) {
    const int64_t row = i / vecs_per_row;
    const int64_t col = i - row * vecs_per_row;
    const Vec* src = reinterpret_cast<const Vec*>(a.src + row * a.src_pitch) + col;
    Vec* dst = reinterpret_cast<Vec*>(a.dst + row * a.dst_pitch) + col;
    *dst = *src;
  }
}

template <class Vec>
void launch(const strided_copy_args& a, cudaStream_t stream) {
  constexpr int threads = 256;
  const int64_t total = a.rows * (a.row_bytes / static_cast<int64_t>(sizeof(Vec)));
  int device = 0;
  int sms = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    sms = 132;
  }
  // Enough blocks to fill the GPU a few times over; the grid-stride loop does the rest.
  const int64_t wanted = (total + threads - 1) / threads;
  const int64_t cap = static_cast<int64_t>(sms) * 8;
  const unsigned blocks = static_cast<unsigned>(wanted < cap ? wanted : cap);
  strided_copy_kernel<Vec><<<blocks, threads, 0, stream>>>(a);
  const cudaError_t status = cudaGetLastError();
  MOEBIUS_CHECK(status == cudaSuccess, errc::cuda,
                "strided copy launch failed: ", cudaGetErrorString(status), " (rows=", a.rows,
                ", row_bytes=", a.row_bytes, ", vector=", sizeof(Vec), " B)");
}

}  // namespace

void launch_strided_copy(const strided_copy_args& a, cudaStream_t stream) {
  if (a.rows <= 0 || a.row_bytes <= 0) return;
  const auto fits = [&](uint64_t v) {
    return (reinterpret_cast<uintptr_t>(a.src) % v == 0) &&
           (reinterpret_cast<uintptr_t>(a.dst) % v == 0) &&
           (static_cast<uint64_t>(a.row_bytes) % v == 0) &&
           (static_cast<uint64_t>(a.src_pitch) % v == 0) &&
           (static_cast<uint64_t>(a.dst_pitch) % v == 0);
  };
  if (fits(16)) {
    launch<uint4>(a, stream);
  } else if (fits(8)) {
    launch<uint2>(a, stream);
  } else if (fits(4)) {
    launch<uint32_t>(a, stream);
  } else {
    launch<uint8_t>(a, stream);
  }
}

}  // namespace moebius::detail
