// The all-reduce of virtual ranks (collectives over device memory, device_collectives.cu):
// every rank sums the P ranks' buffers, in rank order, into its own scratch.

#include <moebius/error.hpp>

#include "common.cuh"
#include "kernels.hpp"

namespace mini_engine::gpu {

// Each element summed in float, rank 0 first: ((parts[0] + parts[1]) + parts[2]) + ...
// Every rank runs this over the same parts, so every rank gets the same bits.
__global__ void sum_ranks_kernel(const __grid_constant__ sum_ranks_args a) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < a.n;
       i += int64_t{gridDim.x} * blockDim.x) {
    float s = a.parts[0][i];
    for (int p = 1; p < a.num_parts; ++p) s += a.parts[p][i];
    a.out[i] = s;
  }
}

void launch_sum_ranks(const sum_ranks_args& a, cudaStream_t stream) {
  MOEBIUS_CHECK(a.num_parts >= 1 && a.num_parts <= sum_ranks_args::max_parts,
                moebius::errc::invalid_argument, "sum_ranks: ", a.num_parts,
                " parts, must be in [1, ", sum_ranks_args::max_parts, "]");
  if (a.n == 0) return;
  sum_ranks_kernel<<<detail::grid_for(a.n, 256), 256, 0, stream>>>(a);
  check_launch("sum_ranks");
}

}  // namespace mini_engine::gpu
