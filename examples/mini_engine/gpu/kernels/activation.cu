#include "common.cuh"
#include "kernels.hpp"

namespace mini_engine::gpu {

__global__ void silu_and_mul_kernel(const __grid_constant__ silu_and_mul_args a) {
  const int64_t n = a.rows * a.inter;
  for (int64_t idx = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; idx < n;
       idx += int64_t{gridDim.x} * blockDim.x) {
    const int64_t r = idx / a.inter, i = idx % a.inter;
    const float g = a.in[r * 2 * a.inter + i];
    const float u = a.in[r * 2 * a.inter + a.inter + i];
    detail::store_from_float(a.out, a.out_type, idx, g / (1.0f + expf(-g)) * u);
  }
}

void launch_silu_and_mul(const silu_and_mul_args& a, cudaStream_t stream) {
  const int64_t n = a.rows * a.inter;
  if (n == 0) return;
  silu_and_mul_kernel<<<detail::grid_for(n, 256), 256, 0, stream>>>(a);
  check_launch("silu_and_mul");
}

}  // namespace mini_engine::gpu
