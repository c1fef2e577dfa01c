#include <algorithm>
#include <moebius/error.hpp>

#include "paged_attention.cuh"

namespace mini_engine::gpu {

namespace {

constexpr int k_max_dims_per_lane = 8;  // head_dim <= 256

__device__ __forceinline__ int64_t page_of(const paged_tokens& tok, int64_t t, int64_t position,
                                           int64_t page_size) {
  return tok.tables[static_cast<int64_t>(tok.seq[t]) * tok.table_stride + position / page_size];
}

}  // namespace

// One thread per (token, head, dim): K and V of the token's new position into its page (with
// dcp > 1 only where this rank holds that position's page: paged_tokens).
__global__ void kv_append_kernel(const __grid_constant__ kv_append_args a) {
  const moebius::kv_geometry& g = a.geometry;
  const int64_t tokens = detail::real_rows(a.tok.num_tokens, a.tok.tokens);
  const int64_t n = tokens * a.heads * g.head_dim;
  for (int64_t idx = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; idx < n;
       idx += int64_t{gridDim.x} * blockDim.x) {
    const int64_t d = idx % g.head_dim;
    const int64_t h = (idx / g.head_dim) % a.heads;
    const int64_t t = idx / (g.head_dim * a.heads);
    const moebius::kv_token_place at = place_in_row(a.tok, g, a.tok.pos[t]);
    if (at.dcp_rank != a.tok.dcp_rank) continue;  // another DCP index's page: that rank stores it
    const int64_t page =
        a.tok.tables[static_cast<int64_t>(a.tok.seq[t]) * a.tok.table_stride + at.local_page];
    const int64_t slot = at.slot;
    const int64_t ko = g.offset(a.mode, a.layer, moebius::kv_tensor::k, page, a.head0 + h, slot, d);
    const int64_t vo = g.offset(a.mode, a.layer, moebius::kv_tensor::v, page, a.head0 + h, slot, d);
    detail::store_from_float(a.pool + ko, g.type, 0, a.k[t * a.stride + h * g.head_dim + d]);
    detail::store_from_float(a.pool + vo, g.type, 0, a.v[t * a.stride + h * g.head_dim + d]);
  }
}

namespace {

// paged_tokens' DCP share: a degree >= 1 and an index in [0, dcp).
void check_share(const paged_tokens& tok, const char* what) {
  MOEBIUS_CHECK(tok.dcp >= 1 && tok.dcp_rank >= 0 && tok.dcp_rank < tok.dcp,
                moebius::errc::invalid_argument, what, ": DCP index ", tok.dcp_rank,
                " outside [0, dcp=", tok.dcp, ")");
}

}  // namespace

void launch_kv_append(const kv_append_args& a, cudaStream_t stream) {
  check_share(a.tok, "kv_append");
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
  const int64_t last = last_attended(a.tok, g, t);
  for (int64_t s = warp; s <= last; s += k_attention_warps) {
    const int64_t page = page_of(a.tok, t, s, g.page_size);
    const int64_t slot = s % g.page_size;
    const std::byte* kp =
        a.pool + g.offset(a.mode, a.layer, moebius::kv_tensor::k, page, kv_head, slot, 0);
    const std::byte* vp =
        a.pool + g.offset(a.mode, a.layer, moebius::kv_tensor::v, page, kv_head, slot, 0);
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
      if (d < D) store_output(a, t, h, d, o[j], mm, ll);
    }
  }
}

namespace {

constexpr int64_t k_min_split_positions = 32;
constexpr int64_t k_tc_min_split_positions = 64;  // one step of its 4 warps

int num_sms_of_current_device() {
  static int cached[64] = {};
  int dev = 0;
  MOEBIUS_CUDA_CHECK(cudaGetDevice(&dev));
  if (dev < 0 || dev >= 64) dev = 0;
  if (cached[dev] == 0) {
    int n = 0;
    MOEBIUS_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
    cached[dev] = n > 0 ? n : 1;
  }
  return cached[dev];
}

int compute_major_of_current_device() {
  static int cached[64] = {};
  int dev = 0;
  MOEBIUS_CUDA_CHECK(cudaGetDevice(&dev));
  if (dev < 0 || dev >= 64) dev = 0;
  if (cached[dev] == 0) {
    int n = 0;
    MOEBIUS_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrComputeCapabilityMajor, dev));
    cached[dev] = n > 0 ? n : 1;
  }
  return cached[dev];
}

// Blocks per token of the GQA kernels: page heads x chunks of up to k_max_group q heads (the
// tensor-core kernel: k_tc_rows).
int64_t gqa_blocks_per_token(const paged_attention_args& a, int64_t rows = k_max_group) {
  const int64_t page_heads = (a.q_heads + a.group - 1) / a.group;
  const int64_t chunks = (std::min(a.group, a.q_heads) + rows - 1) / rows;
  return page_heads * chunks;
}

split_params split_params_of(const paged_attention_args& a, int64_t splits) {
  split_params sp;
  const int64_t stride = std::max<int64_t>(a.tok.table_stride, 1);
  splits = std::clamp<int64_t>(splits, 1, stride);
  const int64_t pps = (stride + splits - 1) / splits;
  sp.pages_per_split = static_cast<int32_t>(pps);
  sp.splits = static_cast<int32_t>((stride + pps - 1) / pps);
  return sp;
}

}  // namespace

bool paged_attention_uses_tensor_cores(const paged_attention_args& a) {
  const int64_t D = a.geometry.head_dim;
  return a.tensor_cores && !a.simple &&
         a.geometry.type == moebius::dtype::bf16 && (D == 64 || D == 128) && a.tok.tokens > 0 &&
         a.tok.tokens >= a.tensor_core_min_tokens && a.group >= 1 &&
         compute_major_of_current_device() >= 8;
}

int64_t paged_attention_splits(const paged_attention_args& a) {
  if (a.tok.tokens <= 0 || a.q_heads <= 0) return 1;
  const bool tc = paged_attention_uses_tensor_cores(a);
  const int64_t stride = std::max<int64_t>(a.tok.table_stride, 1);
  const int64_t ps = std::max<int64_t>(a.geometry.page_size, 1);
  const int64_t min_pages =
      ((tc ? k_tc_min_split_positions : k_min_split_positions) + ps - 1) / ps;
  const int64_t most = (stride + min_pages - 1) / min_pages;
  const int64_t blocks = a.tok.tokens * gqa_blocks_per_token(a, tc ? k_tc_rows : k_max_group);
  // Both kernels: enough blocks for 4 per SM (the tensor-core kernel holds 2 per SM: two waves).
  const int64_t target = 4 * int64_t{num_sms_of_current_device()};
  if (a.splits > 0) return split_params_of(a, a.splits).splits;
  const int64_t want = (target + blocks - 1) / blocks;
  return split_params_of(a, std::clamp<int64_t>(want, 1, most)).splits;
}

int64_t paged_attention_workspace_floats(const paged_attention_args& a) {
  const int64_t splits = paged_attention_splits(a);
  if (splits <= 1) return 0;
  return a.tok.tokens * a.q_heads * splits * (a.geometry.head_dim + 2);
}

void launch_paged_attention(const paged_attention_args& a, cudaStream_t stream) {
  const int64_t D = a.geometry.head_dim;
  MOEBIUS_CHECK(D <= 32 * k_max_dims_per_lane, moebius::errc::invalid_argument,
                "paged_attention: head_dim ", D, " > ", 32 * k_max_dims_per_lane);
  MOEBIUS_CHECK(a.group >= 1, moebius::errc::invalid_argument, "paged_attention: group < 1");
  check_share(a.tok, "paged_attention");
  if (a.tok.tokens == 0 || a.q_heads == 0) return;
  const bool gqa_shape = D % k_vec == 0 && D / k_vec <= 32 && ((D / k_vec) & (D / k_vec - 1)) == 0;
  if (a.simple || !gqa_shape) {
    const int64_t blocks = a.tok.tokens * a.q_heads;
    paged_attention_kernel<<<static_cast<unsigned>(blocks), k_attention_warps * 32, 0, stream>>>(a);
    check_launch("paged_attention");
    return;
  }
  const split_params sp =
      split_params_of(a, a.workspace == nullptr ? 1 : paged_attention_splits(a));
  if (paged_attention_uses_tensor_cores(a))
    launch_paged_attention_tc(a, sp, stream);
  else
    launch_paged_attention_split(a, sp, stream);
  if (sp.splits > 1) launch_paged_attention_merge(a, sp, stream);
}

}  // namespace mini_engine::gpu
