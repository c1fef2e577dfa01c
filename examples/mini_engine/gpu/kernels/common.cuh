#pragma once

// Device helpers shared by the mini-engine's kernels: element loads/stores by dtype, warp
// reductions, grid sizing.

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <moebius/cuda/check.hpp>
#include <moebius/layout/dtype.hpp>

namespace mini_engine::gpu::detail {

__device__ __forceinline__ float load_as_float(const void* p, moebius::dtype t, int64_t i) {
  if (t == moebius::dtype::bf16) return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
  return static_cast<const float*>(p)[i];
}

__device__ __forceinline__ void store_from_float(void* p, moebius::dtype t, int64_t i, float v) {
  if (t == moebius::dtype::bf16)
    static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(v);
  else
    static_cast<float*>(p)[i] = v;
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over a block of up to 1024 threads; every thread gets the result. `scratch`: 32 floats.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = warp_sum(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  const int warps = (blockDim.x + 31) >> 5;
  v = lane < warps ? scratch[lane] : 0.0f;
  return warp_sum(v);
}

__device__ __forceinline__ int64_t real_rows(const int32_t* num_tokens, int64_t rows) {
  if (num_tokens == nullptr) return rows;
  const int64_t n = *num_tokens;
  return n < rows ? n : rows;
}

inline unsigned grid_for(int64_t n, int threads, int64_t max_blocks = 65535LL * 8) {
  int64_t b = (n + threads - 1) / threads;
  if (b < 1) b = 1;
  if (b > max_blocks) b = max_blocks;
  return static_cast<unsigned>(b);
}

}  // namespace mini_engine::gpu::detail
