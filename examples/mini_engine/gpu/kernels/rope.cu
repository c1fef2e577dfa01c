#include "common.cuh"
#include "kernels.hpp"

namespace mini_engine::gpu {

// One thread per (token, head, pair i < D/2).
__global__ void rope_kernel(const __grid_constant__ rope_args a) {
  const int64_t half = a.head_dim / 2;
  const int64_t tokens = detail::real_rows(a.num_tokens, a.tokens);
  const int64_t n = tokens * a.heads * half;
  for (int64_t idx = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; idx < n;
       idx += int64_t{gridDim.x} * blockDim.x) {
    const int64_t i = idx % half;
    const int64_t head = (idx / half) % a.heads;
    const int64_t t = idx / (half * a.heads);
    float* x = a.x + t * a.row_stride + head * a.head_dim;
    const double inv_freq =
        pow(a.theta, -2.0 * static_cast<double>(i) / static_cast<double>(a.head_dim));
    const double angle = static_cast<double>(a.positions[t]) * inv_freq;
    double s, c;
    sincos(angle, &s, &c);
    const double x1 = x[i], x2 = x[i + half];
    x[i] = static_cast<float>(x1 * c - x2 * s);
    x[i + half] = static_cast<float>(x2 * c + x1 * s);
  }
}

void launch_rope(const rope_args& a, cudaStream_t stream) {
  const int64_t n = a.tokens * a.heads * (a.head_dim / 2);
  if (n == 0) return;
  rope_kernel<<<detail::grid_for(n, 256), 256, 0, stream>>>(a);
  check_launch("rope");
}

}  // namespace mini_engine::gpu
