#include "kernels.hpp"

#include <moebius/error.hpp>

#include "common.cuh"

namespace mini_engine::gpu {

namespace {

constexpr int k_attention_warps = 4;
constexpr int k_max_dims_per_lane = 8;  // head_dim <= 256

__device__ __forceinline__ int64_t page_of(const paged_tokens& tok, int64_t t, int64_t position,
                                           int64_t page_size) {
  return tok.tables[static_cast<int64_t>(tok.seq[t]) * tok.table_stride + position / page_size];
}

}  // namespace

// One thread per (token, head, dim): K and V of the token's new position into its page.
__global__ void kv_append_kernel(const __grid_constant__ kv_append_args a) {
  const moebius::kv_geometry& g = a.geometry;
  const int64_t tokens = detail::real_rows(a.tok.num_tokens, a.tok.tokens);
  const int64_t n = tokens * a.heads * g.head_dim;
  for (int64_t idx = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; idx < n;
       idx += int64_t{gridDim.x} * blockDim.x) {
    const int64_t d = idx % g.head_dim;
    const int64_t h = (idx / g.head_dim) % a.heads;
    const int64_t t = idx / (g.head_dim * a.heads);
    const int64_t position = a.tok.pos[t];
    const int64_t page = page_of(a.tok, t, position, g.page_size);
    const int64_t slot = position % g.page_size;
    const int64_t ko = g.offset(a.mode, a.layer, moebius::kv_tensor::k, page, a.head0 + h, slot, d);
    const int64_t vo = g.offset(a.mode, a.layer, moebius::kv_tensor::v, page, a.head0 + h, slot, d);
    detail::store_from_float(a.pool + ko, g.type, 0, a.k[t * a.stride + h * g.head_dim + d]);
    detail::store_from_float(a.pool + vo, g.type, 0, a.v[t * a.stride + h * g.head_dim + d]);
  }
}

void launch_kv_append(const kv_append_args& a, cudaStream_t stream) {
  const int64_t n = a.tok.tokens * a.heads * a.geometry.head_dim;
  if (n == 0) return;
  kv_append_kernel<<<detail::grid_for(n, 256), 256, 0, stream>>>(a);
  check_launch("kv_append");
}

// One block of 4 warps per (token, local q head). Warp w takes positions w, w+4, ...; each
// lane holds dims lane, lane+32, ... of q and of its running output; online softmax per warp,
// merged across warps at the end.
__global__ void __launch_bounds__(k_attention_warps * 32)
    paged_attention_kernel(const __grid_constant__ paged_attention_args a) {
  const moebius::kv_geometry& g = a.geometry;
  const int64_t t = blockIdx.x / a.q_heads;
  const int64_t h = blockIdx.x % a.q_heads;
  if (t >= detail::real_rows(a.tok.num_tokens, a.tok.tokens)) return;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t D = g.head_dim;
  const int64_t kv_head = h / a.group;

  float q[k_max_dims_per_lane], acc[k_max_dims_per_lane];
#pragma unroll
  for (int j = 0; j < k_max_dims_per_lane; ++j) {
    const int64_t d = lane + 32 * j;
    q[j] = d < D ? a.q[t * a.q_stride + h * D + d] : 0.0f;
    acc[j] = 0.0f;
  }
  float m = -INFINITY, l = 0.0f;
  const int64_t last = a.tok.pos[t];
  for (int64_t s = warp; s <= last; s += k_attention_warps) {
    const int64_t page = page_of(a.tok, t, s, g.page_size);
    const int64_t slot = s % g.page_size;
    const std::byte* kp = a.pool + g.offset(a.mode, a.layer, moebius::kv_tensor::k, page, kv_head, slot, 0);
    const std::byte* vp = a.pool + g.offset(a.mode, a.layer, moebius::kv_tensor::v, page, kv_head, slot, 0);
    float dot = 0.0f;
#pragma unroll
    for (int j = 0; j < k_max_dims_per_lane; ++j) {
      const int64_t d = lane + 32 * j;
      if (d < D) dot += q[j] * detail::load_as_float(kp, g.type, d);
    }
    const float score = detail::warp_sum(dot) * a.scale;
    const float m_new = fmaxf(m, score);
    const float corr = expf(m - m_new);  // 0 when m was -inf
    const float p = expf(score - m_new);
    l = l * corr + p;
#pragma unroll
    for (int j = 0; j < k_max_dims_per_lane; ++j) {
      const int64_t d = lane + 32 * j;
      const float v = d < D ? detail::load_as_float(vp, g.type, d) : 0.0f;
      acc[j] = acc[j] * corr + p * v;
    }
    m = m_new;
  }

  __shared__ float s_m[k_attention_warps], s_l[k_attention_warps];
  __shared__ float s_acc[k_attention_warps][k_max_dims_per_lane * 32];
  if (lane == 0) {
    s_m[warp] = m;
    s_l[warp] = l;
  }
#pragma unroll
  for (int j = 0; j < k_max_dims_per_lane; ++j) s_acc[warp][lane + 32 * j] = acc[j];
  __syncthreads();
  if (warp == 0) {
    float mm = -INFINITY;
    for (int w = 0; w < k_attention_warps; ++w) mm = fmaxf(mm, s_m[w]);
    float ll = 0.0f;
    float o[k_max_dims_per_lane] = {};
    for (int w = 0; w < k_attention_warps; ++w) {
      if (s_m[w] == -INFINITY) continue;  // a warp that saw no position
      const float c = expf(s_m[w] - mm);
      ll += s_l[w] * c;
#pragma unroll
      for (int j = 0; j < k_max_dims_per_lane; ++j) o[j] += s_acc[w][lane + 32 * j] * c;
    }
#pragma unroll
    for (int j = 0; j < k_max_dims_per_lane; ++j) {
      const int64_t d = lane + 32 * j;
      if (d < D) a.out[t * a.out_stride + h * D + d] = o[j] / ll;
    }
  }
}

void launch_paged_attention(const paged_attention_args& a, cudaStream_t stream) {
  MOEBIUS_CHECK(a.geometry.head_dim <= 32 * k_max_dims_per_lane, moebius::errc::invalid_argument,
                "paged_attention: head_dim ", a.geometry.head_dim, " > ", 32 * k_max_dims_per_lane);
  MOEBIUS_CHECK(a.group >= 1, moebius::errc::invalid_argument, "paged_attention: group < 1");
  const int64_t blocks = a.tok.tokens * a.q_heads;
  if (blocks == 0) return;
  paged_attention_kernel<<<static_cast<unsigned>(blocks), k_attention_warps * 32, 0, stream>>>(a);
  check_launch("paged_attention");
}

}  // namespace mini_engine::gpu
