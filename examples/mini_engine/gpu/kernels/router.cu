#include <moebius/error.hpp>

#include "common.cuh"
#include "kernels.hpp"

namespace mini_engine::gpu {

namespace {
constexpr int k_router_max_per_lane = 32;  // experts <= 1024
}

// One warp per token: lane i holds experts i, i+32, ... (PER of them, a compile-time count, so
// that every array lives in registers: a runtime-indexed array goes to local memory, which made
// this kernel several times slower at large batch); top-k by k rounds of a warp argmax (largest
// probability, then lowest index). Lane k keeps the k-th choice and writes it. The sums run in
// the same order as ever (per lane ascending, then the warp's butterfly), so the results are
// bitwise those of the reference kernel this replaced.
template <int PER>
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
  float p[PER];
  float mx = -INFINITY;
#pragma unroll
  for (int j = 0; j < PER; ++j) {
    const int64_t e = lane + 32 * j;
    p[j] = e < a.experts ? x[e] : -INFINITY;
    mx = fmaxf(mx, p[j]);
  }
  mx = detail::warp_max(mx);
  float sum = 0.0f;
#pragma unroll
  for (int j = 0; j < PER; ++j) {
    const int64_t e = lane + 32 * j;
    p[j] = e < a.experts ? expf(p[j] - mx) : -1.0f;  // -1: absent, never chosen
    if (e < a.experts) sum += p[j];
  }
  sum = detail::warp_sum(sum);
  float top_sum = 0.0f;
  int32_t my_id = 0;  // lane k: the k-th choice
  float my_p = 0.0f;
  for (int64_t k = 0; k < a.top_k; ++k) {
    float best = -2.0f;
    int32_t best_e = 0x7fffffff;
#pragma unroll
    for (int j = 0; j < PER; ++j) {
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
#pragma unroll
    for (int j = 0; j < PER; ++j)
      if (lane + 32 * j == best_e) p[j] = -2.0f;
    if (lane == k) {
      my_id = best_e;
      my_p = best / sum;
    }
    top_sum += best / sum;
  }
  if (lane < a.top_k) {
    ids[lane] = my_id;
    w[lane] = a.renormalize ? my_p / top_sum : my_p;
  }
}

template <int PER>
void launch_router_topk_per(const router_topk_args& a, cudaStream_t stream) {
  constexpr int warps = 4;
  router_topk_kernel<PER><<<detail::grid_for(a.tokens, warps, int64_t{1} << 30), warps * 32, 0,
                            stream>>>(a);
}

void launch_router_topk(const router_topk_args& a, cudaStream_t stream) {
  MOEBIUS_CHECK(a.experts <= 32 * k_router_max_per_lane && a.top_k >= 1 && a.top_k <= 32 &&
                    a.top_k <= a.experts,
                moebius::errc::invalid_argument, "router_topk: experts ", a.experts, " top_k ",
                a.top_k, " (need experts <= 1024, 1 <= top_k <= min(32, experts))");
  if (a.tokens == 0) return;
  const int64_t per = (a.experts + 31) / 32;  // experts a lane holds
  if (per <= 1) launch_router_topk_per<1>(a, stream);
  else if (per <= 2) launch_router_topk_per<2>(a, stream);
  else if (per <= 4) launch_router_topk_per<4>(a, stream);
  else if (per <= 8) launch_router_topk_per<8>(a, stream);
  else if (per <= 16) launch_router_topk_per<16>(a, stream);
  else launch_router_topk_per<k_router_max_per_lane>(a, stream);
  check_launch("router_topk");
}

}  // namespace mini_engine::gpu
