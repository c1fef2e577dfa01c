#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <moebius/error.hpp>

#include "common.cuh"
#include "kernels.hpp"

namespace mini_engine::gpu {

namespace {

constexpr int k_dequant_threads = 256;
// Elements one block expands (whole rows, at least one): 128 per thread, 16 vectors of 8.
constexpr int64_t k_dequant_elems_per_block = 32768;

int64_t dequant_rows_per_block(int64_t cols) {
  const int64_t r = k_dequant_elems_per_block / cols;
  return r >= 1 ? r : 1;
}

// Two fp8 e4m3 codes (low byte first) as floats: exact (every e4m3 value is a half).
__device__ __forceinline__ float2 fp8x2_to_float2(uint16_t codes) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(codes, __NV_E4M3);
  return __half22float2(__half2(h));
}

// Block (x, y) expands rows [x * rows_per_block, ...) of local expert y; it exits at once
// when the expert has no tokens this step (a decode step touches few of them).
template <bool Vector>
__global__ void __launch_bounds__(k_dequant_threads)
    dequant_fp8_kernel(const __grid_constant__ dequant_fp8_args a, int64_t rows_per_block) {
  const int64_t e = blockIdx.y;
  if (a.counts != nullptr && a.counts[e] <= 0) return;
  // Index maths within the block in 32 bits (the launcher checks rows, cols < 2^31 and a
  // block holds at most k_dequant_elems_per_block elements or one row): 64-bit divisions per
  // 8 codes would make this kernel compute-bound.
  const uint32_t r0 = static_cast<uint32_t>(blockIdx.x * rows_per_block);
  const uint32_t r1 = static_cast<uint32_t>(
      r0 + rows_per_block < a.rows ? r0 + rows_per_block : a.rows);
  const uint32_t cols = static_cast<uint32_t>(a.cols);
  const uint32_t bn = static_cast<uint32_t>(a.block_n), bk = static_cast<uint32_t>(a.block_k);
  const uint32_t scale_cols = cols / bk;
  const float* scale = a.scale + e * (a.rows / a.block_n) * scale_cols;
  const int64_t base = e * a.rows * a.cols;
  if constexpr (Vector) {  // 8 codes (one 8-byte load) share one scale: block_k % 8 == 0
    const uint32_t vecs = cols / 8;
    const uint32_t n = (r1 - r0) * vecs;
    for (uint32_t i = threadIdx.x; i < n; i += blockDim.x) {
      const uint32_t r = r0 + i / vecs, c = (i % vecs) * 8;
      const float s = scale[int64_t{r / bn} * scale_cols + c / bk];
      const int64_t at = base + int64_t{r} * a.cols + c;
      const uint2 codes = *reinterpret_cast<const uint2*>(a.w + at);
      float v[8];
      const uint32_t words[2] = {codes.x, codes.y};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float2 f =
            fp8x2_to_float2(static_cast<uint16_t>(words[j / 2] >> (16 * (j % 2))));
        v[2 * j] = f.x * s;
        v[2 * j + 1] = f.y * s;
      }
      if (a.out_type == moebius::dtype::bf16) {
        uint4 packed;
        uint32_t* p = reinterpret_cast<uint32_t*>(&packed);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const __nv_bfloat162 b = __floats2bfloat162_rn(v[2 * j], v[2 * j + 1]);
          p[j] = *reinterpret_cast<const uint32_t*>(&b);
        }
        *reinterpret_cast<uint4*>(static_cast<__nv_bfloat16*>(a.out) + at) = packed;
      } else {
        float4* out = reinterpret_cast<float4*>(static_cast<float*>(a.out) + at);
        out[0] = make_float4(v[0], v[1], v[2], v[3]);
        out[1] = make_float4(v[4], v[5], v[6], v[7]);
      }
    }
  } else {
    const int64_t n = int64_t{r1 - r0} * cols;  // a single row may exceed 2^32 / 8 elements
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
      const uint32_t r = r0 + static_cast<uint32_t>(i / cols), c = static_cast<uint32_t>(i % cols);
      const float s = scale[int64_t{r / bn} * scale_cols + c / bk];
      const int64_t at = base + int64_t{r} * a.cols + c;
      const float f = fp8x2_to_float2(static_cast<uint16_t>(a.w[at])).x;
      detail::store_from_float(a.out, a.out_type, at, f * s);
    }
  }
}

}  // namespace

void launch_dequant_fp8(const dequant_fp8_args& a, cudaStream_t stream) {
  MOEBIUS_CHECK(a.out_type == moebius::dtype::bf16 || a.out_type == moebius::dtype::fp32,
                moebius::errc::invalid_argument, "dequant_fp8: output must be bf16 or fp32, not ",
                moebius::to_string(a.out_type));
  MOEBIUS_CHECK(a.experts >= 0 && a.experts <= 65535 && a.rows >= 0 && a.cols >= 0 &&
                    a.rows < (int64_t{1} << 31) && a.cols < (int64_t{1} << 31) &&
                    a.block_n >= 1 && a.block_k >= 1 && a.rows % a.block_n == 0 &&
                    a.cols % a.block_k == 0,
                moebius::errc::invalid_argument, "dequant_fp8: ", a.experts, " experts of [",
                a.rows, ", ", a.cols, "] need whole blocks of [", a.block_n, ", ", a.block_k,
                "] (and at most 65535 experts, rows and cols below 2^31)");
  if (a.experts == 0 || a.rows == 0 || a.cols == 0) return;
  const int64_t rows_per_block = dequant_rows_per_block(a.cols);
  const dim3 grid(static_cast<unsigned>((a.rows + rows_per_block - 1) / rows_per_block),
                  static_cast<unsigned>(a.experts));
  // 8-code vectors need them in one scale block and aligned loads/stores (arena tensors are
  // 256-byte aligned and every expert holds a multiple of 8 elements when cols % 8 == 0).
  const bool vector = a.cols % 8 == 0 && a.block_k % 8 == 0 &&
                      reinterpret_cast<uintptr_t>(a.w) % 8 == 0 &&
                      reinterpret_cast<uintptr_t>(a.out) % 16 == 0;
  if (vector)
    dequant_fp8_kernel<true><<<grid, k_dequant_threads, 0, stream>>>(a, rows_per_block);
  else
    dequant_fp8_kernel<false><<<grid, k_dequant_threads, 0, stream>>>(a, rows_per_block);
  check_launch("dequant_fp8");
}

}  // namespace mini_engine::gpu
