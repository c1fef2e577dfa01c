#include <cuda_fp8.h>

#include "common.cuh"
#include "kernels.hpp"

namespace mini_engine::gpu {

__global__ void convert_kernel(const __grid_constant__ convert_args a) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < a.n;
       i += int64_t{gridDim.x} * blockDim.x)
    detail::store_from_float(a.out, a.out_type, i, detail::load_as_float(a.in, a.in_type, i));
}

void launch_convert(const convert_args& a, cudaStream_t stream) {
  if (a.n == 0) return;
  convert_kernel<<<detail::grid_for(a.n, 256), 256, 0, stream>>>(a);
  check_launch("convert");
}

__global__ void embedding_kernel(const __grid_constant__ embedding_args a) {
  const int64_t t = blockIdx.x;
  const int32_t id = a.ids[t];
  const bool real = t < detail::real_rows(a.num_tokens, a.tokens) && id >= 0 && id < a.vocab;
  for (int64_t c = threadIdx.x; c < a.hidden; c += blockDim.x)
    a.out[t * a.hidden + c] =
        real ? detail::load_as_float(a.table, a.type, id * a.hidden + c) : 0.0f;
}

void launch_embedding(const embedding_args& a, cudaStream_t stream) {
  if (a.tokens == 0) return;
  embedding_kernel<<<static_cast<unsigned>(a.tokens), 256, 0, stream>>>(a);
  check_launch("embedding");
}

// One block per row; (value, index) pairs reduced with "larger value, then lower index".
__global__ void argmax_kernel(const __grid_constant__ argmax_args a) {
  __shared__ float s_v[32];
  __shared__ int32_t s_i[32];
  const int64_t r = blockIdx.x;
  const float* x = a.x + r * a.cols;
  float best = -INFINITY;
  int32_t best_i = 0x7fffffff;
  for (int64_t c = threadIdx.x; c < a.cols; c += blockDim.x) {
    const float v = x[c];
    if (v > best) {  // ascending c per thread: strict > keeps the lowest index
      best = v;
      best_i = static_cast<int32_t>(c);
    }
  }
  auto better = [](float v, int32_t i, float bv, int32_t bi) {
    return v > bv || (v == bv && i < bi);
  };
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, best, o);
    const int32_t oi = __shfl_xor_sync(0xffffffffu, best_i, o);
    if (better(ov, oi, best, best_i)) {
      best = ov;
      best_i = oi;
    }
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) {
    s_v[warp] = best;
    s_i[warp] = best_i;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < static_cast<int>(blockDim.x >> 5); ++w)
      if (better(s_v[w], s_i[w], best, best_i)) {
        best = s_v[w];
        best_i = s_i[w];
      }
    a.out[r] = best_i == 0x7fffffff ? 0 : best_i;  // an all-NaN row: 0
    if (a.out_value != nullptr) a.out_value[r] = best;
  }
}

void launch_argmax(const argmax_args& a, cudaStream_t stream) {
  if (a.rows == 0) return;
  // A vocabulary row (152k logits at batch 1) is one block's work: 1024 threads keep 4x the
  // loads in flight of 256 (one SM streams the row; at batch 1 nothing else runs beside it).
  const int threads = a.cols >= 16384 ? 1024 : 256;
  argmax_kernel<<<static_cast<unsigned>(a.rows), threads, 0, stream>>>(a);
  check_launch("argmax");
}

__global__ void residual_add_kernel(const __grid_constant__ residual_add_args a) {
  const int64_t n = a.rows * a.hidden;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    float s = 0.0f;
    for (int64_t p = 0; p < a.num_parts; ++p) s += a.parts[p * a.part_stride + i];
    a.h[i] += s;
  }
}

void launch_residual_add(const residual_add_args& a, cudaStream_t stream) {
  const int64_t n = a.rows * a.hidden;
  if (n == 0) return;
  residual_add_kernel<<<detail::grid_for(n, 256), 256, 0, stream>>>(a);
  check_launch("residual_add");
}

__global__ void gather_rows_kernel(const __grid_constant__ gather_rows_args a) {
  const int64_t t = blockIdx.x;
  const bool real = t < detail::real_rows(a.num_tokens, a.rows);
  const float* src = real ? a.in + int64_t{a.map[t]} * a.hidden : nullptr;
  for (int64_t c = threadIdx.x; c < a.hidden; c += blockDim.x)
    a.out[t * a.hidden + c] = real ? src[c] : 0.0f;
}

void launch_gather_rows(const gather_rows_args& a, cudaStream_t stream) {
  if (a.rows == 0) return;
  gather_rows_kernel<<<static_cast<unsigned>(a.rows), 256, 0, stream>>>(a);
  check_launch("gather_rows");
}

__global__ void fill_random_kernel(const __grid_constant__ fill_random_args a) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < a.n;
       i += int64_t{gridDim.x} * blockDim.x) {
    uint64_t z = a.seed + 0x9e3779b97f4a7c15ull * static_cast<uint64_t>(i + 1);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    const float u = static_cast<float>(static_cast<int64_t>(z >> 40) - (int64_t{1} << 23)) *
                    (1.0f / static_cast<float>(int64_t{1} << 23));
    if (a.type == moebius::dtype::fp8_e4m3)
      static_cast<uint8_t*>(a.out)[i] =
          __nv_cvt_float_to_fp8(u * a.scale + a.offset, __NV_SATFINITE, __NV_E4M3);
    else
      detail::store_from_float(a.out, a.type, i, u * a.scale + a.offset);
  }
}

void launch_fill_random(const fill_random_args& a, cudaStream_t stream) {
  if (a.n == 0) return;
  fill_random_kernel<<<detail::grid_for(a.n, 256), 256, 0, stream>>>(a);
  check_launch("fill_random");
}

}  // namespace mini_engine::gpu
