#include <moebius/error.hpp>

#include "common.cuh"
#include "kernels.hpp"

namespace mini_engine::gpu {

namespace {
constexpr int k_router_max_per_lane = 32;  // experts <= 1024
}

// One warp per token: lane i holds experts i, i+32, ...; top-k by k rounds of a warp argmax
// (largest probability, then lowest index).
__global__ void router_topk_kernel(const __grid_constant__ router_topk_args a) {
  const int lane = threadIdx.x & 31;
  const int64_t t = blockIdx.x * int64_t{blockDim.x / 32} + (threadIdx.x >> 5);
  if (t >= a.tokens) return;
  int32_t* ids = a.ids + t * a.top_k;
  float* w = a.weights + t * a.top_k;
  if (t >= detail::real_rows(a.num_tokens, a.tokens)) {
    for (int64_t j = lane; j < a.top_k; j += 32) {
      ids[j] = -1;
      w[j] = 0.0f;
    }
    return;
  }
  const float* x = a.logits + t * a.experts;
  float p[k_router_max_per_lane];
  float mx = -INFINITY;
  for (int j = 0; j < k_router_max_per_lane; ++j) {
    const int64_t e = lane + 32 * j;
    p[j] = e < a.experts ? x[e] : -INFINITY;
    mx = fmaxf(mx, p[j]);
  }
  mx = detail::warp_max(mx);
  float sum = 0.0f;
  for (int j = 0; j < k_router_max_per_lane; ++j) {
    const int64_t e = lane + 32 * j;
    p[j] = e < a.experts ? expf(p[j] - mx) : -1.0f;  // -1: absent, never chosen
    if (e < a.experts) sum += p[j];
  }
  sum = detail::warp_sum(sum);
  float top_sum = 0.0f;
  int32_t chosen_id[32];
  float chosen_p[32];
  for (int64_t k = 0; k < a.top_k; ++k) {
    float best = -2.0f;
    int32_t best_e = 0x7fffffff;
    for (int j = 0; j < k_router_max_per_lane; ++j) {
      if (p[j] > best) {  // ascending e within a lane: the first max is the lowest index
        best = p[j];
        best_e = lane + 32 * j;
      }
    }
    for (int o = 16; o > 0; o >>= 1) {
      const float ob = __shfl_xor_sync(0xffffffffu, best, o);
      const int32_t oe = __shfl_xor_sync(0xffffffffu, best_e, o);
      if (ob > best || (ob == best && oe < best_e)) {
        best = ob;
        best_e = oe;
      }
    }
    if ((best_e & 31) == lane) p[best_e >> 5] = -2.0f;
    chosen_id[k] = best_e;
    chosen_p[k] = best / sum;
    top_sum += best / sum;
  }
  for (int64_t k = lane; k < a.top_k; k += 32) {
    // Every lane holds the same chosen lists (the values came through full-warp shuffles).
    ids[k] = chosen_id[k];
    w[k] = a.renormalize ? chosen_p[k] / top_sum : chosen_p[k];
  }
}

void launch_router_topk(const router_topk_args& a, cudaStream_t stream) {
  MOEBIUS_CHECK(a.experts <= 32 * k_router_max_per_lane && a.top_k >= 1 && a.top_k <= 32 &&
                    a.top_k <= a.experts,
                moebius::errc::invalid_argument, "router_topk: experts ", a.experts, " top_k ",
                a.top_k, " (need experts <= 1024, 1 <= top_k <= min(32, experts))");
  if (a.tokens == 0) return;
  constexpr int warps = 4;
  router_topk_kernel<<<detail::grid_for(a.tokens, warps, int64_t{1} << 30), warps * 32, 0,
                       stream>>>(a);
  check_launch("router_topk");
}

}  // namespace mini_engine::gpu
