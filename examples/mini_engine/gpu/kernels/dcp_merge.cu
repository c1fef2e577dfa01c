// The cross-rank merge of decode context parallelism (kernels.hpp, dcp_merge_args): each rank
// of a DCP set combines the set's partial attentions of its own q heads, reading them where
// they lie (virtual ranks: the peers' buffers, device_collectives.cu).

#include <cmath>
#include <moebius/error.hpp>

#include "common.cuh"
#include "kernels.hpp"

namespace mini_engine::gpu {

// One thread per (token, head, dim). Each recomputes its (token, head)'s weights from the
// parts' LSEs (at most 8 parts: a few exponentials against the D parts it reads and the
// element it writes), in part order, so every element of a head sees the same weights.
__global__ void dcp_merge_kernel(const __grid_constant__ dcp_merge_args a) {
  const int64_t tokens = detail::real_rows(a.num_tokens, a.tokens);
  const int64_t n = tokens * a.heads * a.head_dim;
  for (int64_t idx = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; idx < n;
       idx += int64_t{gridDim.x} * blockDim.x) {
    const int64_t d = idx % a.head_dim;
    const int64_t h = (idx / a.head_dim) % a.heads;
    const int64_t t = idx / (a.head_dim * a.heads);
    float lse[dcp_merge_args::max_parts];
    float m = -INFINITY;
    for (int s = 0; s < a.num_parts; ++s) {
      lse[s] = a.part_lse[s][t * a.lse_stride + h];
      m = fmaxf(m, lse[s]);
    }
    float sum = 0.0f;
    for (int s = 0; s < a.num_parts; ++s)
      if (lse[s] != -INFINITY) sum += expf(lse[s] - m);
    const float total = m + logf(sum);  // the LSE over every part's positions
    float o = 0.0f;
    for (int s = 0; s < a.num_parts; ++s) {
      if (lse[s] == -INFINITY) continue;  // an empty part (and never 0 * NaN from its output)
      o += expf(lse[s] - total) * a.parts[s][t * a.part_stride + h * a.head_dim + d];
    }
    a.out[t * a.out_stride + h * a.head_dim + d] = o;
  }
}

void launch_dcp_merge(const dcp_merge_args& a, cudaStream_t stream) {
  MOEBIUS_CHECK(a.num_parts >= 1 && a.num_parts <= dcp_merge_args::max_parts,
                moebius::errc::invalid_argument, "dcp_merge: ", a.num_parts,
                " parts, must be in [1, ", dcp_merge_args::max_parts, "]");
  const int64_t n = a.tokens * a.heads * a.head_dim;
  if (n == 0) return;
  dcp_merge_kernel<<<detail::grid_for(n, 256), 256, 0, stream>>>(a);
  check_launch("dcp_merge");
}

}  // namespace mini_engine::gpu
