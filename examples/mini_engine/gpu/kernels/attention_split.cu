#include <algorithm>

#include "paged_attention.cuh"

namespace mini_engine::gpu {

namespace {

constexpr int k_split_unroll = 2;  // positions per lane group per loop step (loads in flight)

// Eight consecutive elements at `p` (16-byte aligned) as floats.
__device__ __forceinline__ void load8(const std::byte* p, moebius::dtype t, float (&out)[k_vec]) {
  if (t == moebius::dtype::bf16) {
    const uint4 raw = *reinterpret_cast<const uint4*>(p);
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = __bfloat1622float2(h[i]);
      out[2 * i] = f.x;
      out[2 * i + 1] = f.y;
    }
  } else {
    const float4 a = reinterpret_cast<const float4*>(p)[0];
    const float4 b = reinterpret_cast<const float4*>(p)[1];
    out[0] = a.x;
    out[1] = a.y;
    out[2] = a.z;
    out[3] = a.w;
    out[4] = b.x;
    out[5] = b.y;
    out[6] = b.z;
    out[7] = b.w;
  }
}

}  // namespace

// The split-context GQA kernel: block (token t, page head kvh, range r, chunk c) runs the lane
// groups of the GQA kernel over positions [r * span, min((r + 1) * span, pos[t] + 1)), span =
// pages_per_split * page_size, with the per-position index maths in 32 bits from a per-block
// base (the GQA kernel's 64-bit divisions per position made it latency-bound) and two
// positions per lane group per step (4 loads of 16 bytes in flight per lane). One range:
// the output directly; several: each range's (max, sum, unnormalised output) into the
// workspace for paged_attention_merge_kernel. Ranges past pos[t] exit at once.
__global__ void __launch_bounds__(k_attention_warps * 32, 4)
    paged_attention_split_kernel(const __grid_constant__ paged_attention_args a,
                                 const split_params sp) {
  extern __shared__ float smem[];
  const moebius::kv_geometry& g = a.geometry;
  split_block blk;
  if (!split_block_of(a, sp, k_max_group, blk)) return;
  const int64_t t = blk.t, kvh = blk.kvh, h0 = blk.h0;
  const int32_t range = blk.range, begin = blk.begin, end = blk.end;
  const int G = blk.G;
  const int32_t ps = static_cast<int32_t>(g.page_size);
  const int D = static_cast<int>(g.head_dim);
  const int lpp = D / k_vec;  // lanes per position
  const int ppw = 32 / lpp;   // positions per warp step
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int sub = lane / lpp;
  const int d0 = (lane % lpp) * k_vec;

  // Element (page, kvh, slot, d0) = base + page * page_bytes + slot * slot_bytes.
  const int64_t es = moebius::dtype_bytes(g.type);
  const bool hnd = g.layout == moebius::kv_layout::hnd;
  const int64_t heads = a.mode == moebius::parallel_mode::ep ? g.heads_per_ep_page() : g.heads_per_tp_page();
  const int64_t page_bytes = g.page_size * heads * g.head_dim * es;
  const int64_t slot_bytes = hnd ? g.head_dim * es : heads * g.head_dim * es;
  const int64_t head_off = (hnd ? kvh * g.page_size * g.head_dim : kvh * g.head_dim) * es;
  const std::byte* k_base =
      a.pool + g.tensor_offset(a.layer, moebius::kv_tensor::k) + head_off + d0 * es;
  const std::byte* v_base =
      a.pool + g.tensor_offset(a.layer, moebius::kv_tensor::v) + head_off + d0 * es;
  const int32_t* row = a.tok.tables + static_cast<int64_t>(a.tok.seq[t]) * a.tok.table_stride;

  float q[k_max_group][k_vec], acc[k_max_group][k_vec], m[k_max_group], l[k_max_group];
#pragma unroll
  for (int j = 0; j < k_max_group; ++j) {
    m[j] = -INFINITY;
    l[j] = 0.0f;
#pragma unroll
    for (int i = 0; i < k_vec; ++i) {
      q[j][i] = j < G ? a.q[t * a.q_stride + (h0 + j) * D + d0 + i] * a.scale : 0.0f;
      acc[j][i] = 0.0f;
    }
  }
  const int32_t step = k_attention_warps * ppw;
  for (int32_t base = begin; base < end; base += step * k_split_unroll) {
    float kf[k_split_unroll][k_vec], vf[k_split_unroll][k_vec];
    bool valid[k_split_unroll];
#pragma unroll
    for (int u = 0; u < k_split_unroll; ++u) {
      const int32_t s = base + u * step + warp * ppw + sub;
      valid[u] = s < end;
      if (valid[u]) {
        const int32_t pg = s / ps;
        const int64_t off = static_cast<int64_t>(row[pg]) * page_bytes + (s - pg * ps) * slot_bytes;
        load8(k_base + off, g.type, kf[u]);
        load8(v_base + off, g.type, vf[u]);
      } else {
#pragma unroll
        for (int i = 0; i < k_vec; ++i) kf[u][i] = vf[u][i] = 0.0f;
      }
    }
#pragma unroll
    for (int u = 0; u < k_split_unroll; ++u) {
      float score[k_max_group];
#pragma unroll
      for (int j = 0; j < k_max_group; ++j) {
        float dot = 0.0f;
#pragma unroll
        for (int i = 0; i < k_vec; ++i) dot += q[j][i] * kf[u][i];
        for (int o = lpp / 2; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
        score[j] = dot;
      }
      if (valid[u]) {
#pragma unroll
        for (int j = 0; j < k_max_group; ++j) {
          if (j >= G) break;
          const float m_new = fmaxf(m[j], score[j]);
          const float corr = expf(m[j] - m_new);
          const float p = expf(score[j] - m_new);
          l[j] = l[j] * corr + p;
#pragma unroll
          for (int i = 0; i < k_vec; ++i) acc[j][i] = acc[j][i] * corr + p * vf[u][i];
          m[j] = m_new;
        }
      }
    }
  }
  const int parts = k_attention_warps * ppw;
  float* s_m = smem;                         // [parts][k_max_group]
  float* s_l = s_m + parts * k_max_group;    // [parts][k_max_group]
  float* s_acc = s_l + parts * k_max_group;  // [parts][k_max_group][D]
  const int part = warp * ppw + sub;
#pragma unroll
  for (int j = 0; j < k_max_group; ++j) {
    if (j >= G) break;
    if (lane % lpp == 0) {
      s_m[part * k_max_group + j] = m[j];
      s_l[part * k_max_group + j] = l[j];
    }
#pragma unroll
    for (int i = 0; i < k_vec; ++i) s_acc[(part * k_max_group + j) * D + d0 + i] = acc[j][i];
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < G * D; idx += blockDim.x) {
    const int j = idx / D, d = idx % D;
    float mm = -INFINITY;
    for (int p = 0; p < parts; ++p) mm = fmaxf(mm, s_m[p * k_max_group + j]);
    float ll = 0.0f, o = 0.0f;
    for (int p = 0; p < parts; ++p) {
      const float mp = s_m[p * k_max_group + j];
      if (mp == -INFINITY) continue;
      const float c = expf(mp - mm);
      ll += s_l[p * k_max_group + j] * c;
      o += s_acc[(p * k_max_group + j) * D + d] * c;
    }
    store_partial(a, sp, t, h0 + j, range, d, o, mm, ll);
  }
}

void launch_paged_attention_split(const paged_attention_args& a, const split_params& sp,
                                  cudaStream_t stream) {
  const int64_t D = a.geometry.head_dim;
  const int64_t page_heads = (a.q_heads + a.group - 1) / a.group;
  const int64_t chunks = (std::min(a.group, a.q_heads) + k_max_group - 1) / k_max_group;
  const int64_t parts = k_attention_warps * (32 / (D / k_vec));
  const size_t smem = static_cast<size_t>(parts * k_max_group * (2 + D)) * sizeof(float);
  // At most 128 parts * 4 heads * (2 + 8) floats = 20 KiB (D = 8): no opt-in needed.
  const auto grid = static_cast<unsigned>(a.tok.tokens * page_heads * chunks * sp.splits);
  paged_attention_split_kernel<<<grid, k_attention_warps * 32, smem, stream>>>(a, sp);
  check_launch("paged_attention_split");
}

// One block per (token, q head): the ranges that hold positions of the token, merged (none:
// the empty part of a DCP rank holding none of them, store_output).
__global__ void paged_attention_merge_kernel(const __grid_constant__ paged_attention_args a,
                                             const split_params sp) {
  const int64_t t = blockIdx.x / a.q_heads, h = blockIdx.x % a.q_heads;
  if (t >= detail::real_rows(a.tok.num_tokens, a.tok.tokens)) return;
  const int64_t D = a.geometry.head_dim;
  const int64_t span = int64_t{sp.pages_per_split} * a.geometry.page_size;
  const int64_t n = (last_attended(a.tok, a.geometry, t) + span) / span;  // ranges with positions
  const int64_t slot0 = (t * a.q_heads + h) * sp.splits;
  const float* ml = a.workspace + a.tok.tokens * a.q_heads * sp.splits * D;
  float mm = -INFINITY;
  for (int64_t r = 0; r < n; ++r) mm = fmaxf(mm, ml[2 * (slot0 + r)]);
  float ll = 0.0f;
  for (int64_t r = 0; r < n; ++r) ll += ml[2 * (slot0 + r) + 1] * expf(ml[2 * (slot0 + r)] - mm);
  for (int64_t d = threadIdx.x; d < D; d += blockDim.x) {
    float o = 0.0f;
    for (int64_t r = 0; r < n; ++r)
      o += a.workspace[(slot0 + r) * D + d] * expf(ml[2 * (slot0 + r)] - mm);
    store_output(a, t, h, d, o, mm, ll);
  }
}

void launch_paged_attention_merge(const paged_attention_args& a, const split_params& sp,
                                  cudaStream_t stream) {
  paged_attention_merge_kernel<<<static_cast<unsigned>(a.tok.tokens * a.q_heads), 128, 0,
                                 stream>>>(a, sp);
  check_launch("paged_attention_merge");
}

}  // namespace mini_engine::gpu
