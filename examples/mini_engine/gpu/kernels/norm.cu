#include "common.cuh"
#include "kernels.hpp"

namespace mini_engine::gpu {

// One block per row: sum of squares in fp32, then the scaled row.
__global__ void rmsnorm_kernel(const __grid_constant__ rmsnorm_args a) {
  __shared__ float scratch[32];
  const int64_t r = blockIdx.x;
  const int64_t token = r / a.heads, head = r % a.heads;
  const float* x = a.x + token * a.x_stride + head * a.head_stride;
  float* y = a.y + token * a.y_stride + head * a.head_stride;
  float ss = 0.0f;
  for (int64_t i = threadIdx.x; i < a.width; i += blockDim.x) ss += x[i] * x[i];
  ss = detail::block_sum(ss, scratch);
  const float inv = rsqrtf(ss / static_cast<float>(a.width) + a.eps);
  for (int64_t i = threadIdx.x; i < a.width; i += blockDim.x) y[i] = x[i] * inv * a.weight[i];
}

void launch_rmsnorm(const rmsnorm_args& a, cudaStream_t stream) {
  if (a.rows == 0) return;
  const int threads = a.width >= 1024 ? 512 : (a.width >= 256 ? 256 : 64);
  rmsnorm_kernel<<<static_cast<unsigned>(a.rows), threads, 0, stream>>>(a);
  check_launch("rmsnorm");
}

void check_launch(const char* what) {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) moebius::detail::throw_cuda_error(e, what, __FILE__, __LINE__);
}

}  // namespace mini_engine::gpu
