#include <algorithm>
#include <moebius/error.hpp>

#include "common.cuh"
#include "kernels.hpp"

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
      if (d < D) a.out[t * a.out_stride + h * D + d] = o[j] / ll;
    }
  }
}

namespace {

constexpr int k_vec = 8;        // elements per lane per position (16 bytes of bf16)
constexpr int k_max_group = 4;  // q heads per block held in registers (8: 208 registers)

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

namespace {

constexpr int k_split_unroll = 2;       // positions per lane group per loop step (loads in flight)
constexpr int64_t k_min_split_positions = 32;
constexpr int k_tc_warps = 4;
constexpr int k_tc_rows = 8;   // q heads per block of the tensor-core kernel (mma rows 0..7)
constexpr int k_tc_tile = 16;  // positions per warp step of the tensor-core kernel
constexpr int64_t k_tc_min_split_positions = 64;  // one step of its 4 warps

struct split_params {
  int32_t splits = 1;
  int32_t pages_per_split = 1;  // splits * pages_per_split >= table_stride
};

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
  const int64_t page_heads = (a.q_heads + a.group - 1) / a.group;
  const int64_t chunks =
      ((a.group < a.q_heads ? a.group : a.q_heads) + k_max_group - 1) / k_max_group;
  // Chunks of one range are adjacent (their second reads of K/V hit L2).
  int64_t b = blockIdx.x;
  const int64_t chunk = b % chunks;
  b /= chunks;
  const int32_t range = static_cast<int32_t>(b % sp.splits);
  b /= sp.splits;
  const int64_t kvh = b % page_heads;
  const int64_t t = b / page_heads;
  if (t >= detail::real_rows(a.tok.num_tokens, a.tok.tokens)) return;
  const int32_t ps = static_cast<int32_t>(g.page_size);
  const int32_t span = sp.pages_per_split * ps;
  const int32_t last = a.tok.pos[t];
  const int32_t begin = range * span;
  const int32_t end = min(last + 1, begin + span);
  if (begin >= end) return;  // past the token's context: the merge reads no such range
  const int64_t h0 = kvh * a.group + chunk * k_max_group;
  const int64_t h_end = min(min((kvh + 1) * a.group, a.q_heads), h0 + k_max_group);
  const int G = static_cast<int>(h_end - h0);
  if (G <= 0) return;
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
    if (sp.splits == 1) {
      a.out[t * a.out_stride + (h0 + j) * D + d] = o / ll;
    } else {
      // workspace: [tokens][q_heads][splits] of (m, l) after all outputs [..][D].
      const int64_t slot = (t * a.q_heads + h0 + j) * sp.splits + range;
      a.workspace[slot * D + d] = o;
      if (d == 0) {
        float* ml = a.workspace + a.tok.tokens * a.q_heads * sp.splits * D;
        ml[2 * slot] = mm;
        ml[2 * slot + 1] = ll;
      }
    }
  }
}

// One block per (token, q head): the ranges that hold positions of the token, merged.
__global__ void paged_attention_merge_kernel(const __grid_constant__ paged_attention_args a,
                                             const split_params sp) {
  const int64_t t = blockIdx.x / a.q_heads, h = blockIdx.x % a.q_heads;
  if (t >= detail::real_rows(a.tok.num_tokens, a.tok.tokens)) return;
  const int64_t D = a.geometry.head_dim;
  const int64_t span = int64_t{sp.pages_per_split} * a.geometry.page_size;
  const int64_t n = (int64_t{a.tok.pos[t]} + span) / span;  // ranges holding positions
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
    a.out[t * a.out_stride + h * D + d] = o / ll;
  }
}

namespace {

// ---- the tensor-core kernel (bf16 pools, head_dim 64 or 128) ------------------------------
constexpr float k_log2e = 1.4426950408889634f;
constexpr float k_ln2 = 0.6931471805599453f;

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));  // ex2(-inf) = +0
  return y;
}

__device__ __forceinline__ uint32_t bits_of(__nv_bfloat162 v) {
  return *reinterpret_cast<const uint32_t*>(&v);
}

// (x0, x1) ~ hi + lo with hi = bf16(x), lo = bf16(x - hi): the pair carries ~16 mantissa bits,
// so a bf16 mma over it is as accurate as fp32 arithmetic at the test tolerances (bf16 alone,
// 8 bits, would be off by ~4e-3 relative). x0 goes to the low half (the lower k or column).
__device__ __forceinline__ void split_bf16x2(float x0, float x1, uint32_t& hi, uint32_t& lo) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(x0, x1);
  const float2 hf = __bfloat1622float2(h);
  hi = bits_of(h);
  lo = bits_of(__floats2bfloat162_rn(x0 - hf.x, x1 - hf.y));
}

__device__ __forceinline__ uint32_t word_of(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// d += A (16 x 16, row-major) * B (16 x 8, column-major), bf16 in, fp32 accumulate. Fragments
// (g = lane / 4, c = lane % 4): a[0] = A[g][2c, 2c+1], a[1] = A[g+8][2c, 2c+1],
// a[2] = A[g][2c+8, 2c+9], a[3] = A[g+8][2c+8, 2c+9]; b0 = B[2c, 2c+1][g],
// b1 = B[2c+8, 2c+9][g]; d[0..1] = D[g][2c, 2c+1], d[2..3] = D[g+8][2c, 2c+1].
__device__ __forceinline__ void mma_bf16_16816(float (&d)[4], uint32_t a0, uint32_t a1,
                                               uint32_t a2, uint32_t a3, uint32_t b0,
                                               uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#else
  __trap();  // the host never picks this kernel below sm_80
#endif
}

}  // namespace

// The tensor-core split kernel: block (token t, page head kvh, range r, chunk c of up to 8 q
// heads) over the same position range as paged_attention_split_kernel; warp w takes tiles of
// 16 positions tile = begin + 16 (w + 4 i). Per tile, with g = lane / 4, c = lane % 4:
//   S (16 x 16) = Q' K^T: rows 0..7 the bf16 high parts of the 8 q heads (times scale log2 e),
//     rows 8..15 their bf16 low parts, columns the 16 positions (two n-tiles of 8), k the head
//     dims in an order both operands share (dims are summed, so any order is right): lane c
//     of k-step kk holds dims 8 (4 (kk / 2) + c) + 4 (kk % 2) + {0, 1 | 2, 3}, which is word
//     2 (kk % 2) | 2 (kk % 2) + 1 of the 16-byte chunk 4 (kk / 2) + c of its K row (position
//     tile + 8 n + g): each lane loads whole 16-byte chunks (64 contiguous bytes per row per
//     load instruction), no shared memory, no transposition. The score of head g at position
//     tile + 8 n + 2c + e is S[g][..] + S[g + 8][..] (high + low), in lane (g, c).
//   Online softmax in base 2 per head (the 4 lanes of a head share its max by two shuffles;
//     each lane keeps its own partial sum), P = 2^(S - m) split into bf16 high/low rows again.
//   O (16 x D) += P V: the accumulator fragment of S is the A fragment of P (positions 2c, 2c+1
//     | 2c+8, 2c+9 of row g), V is the B operand: mma j (0 .. D/8-1) covers dims
//     64 (j / 8) + 8 n + j % 8 for column n, so lane (g, c) loads 16-byte chunks at dims
//     64 h + 8 g of positions tile + 2c + {0, 1, 8, 9} (128 contiguous bytes per row per
//     instruction) and pairs the two positions' halves with one byte permute per register.
//     O = rows 0..7 + rows 8..15.
// Per tile a lane has 2 x D/32 + 4 x D/64 16-byte loads in flight (12 at D = 128: 8 KiB per
// warp); the FMAs run on tensor cores (32 mma per 16 positions x 8 heads at D = 128) instead
// of the 16-lane reductions and per-lane softmax of the CUDA-core kernel, which made that one
// instruction-bound (~30 warp instructions per (position, q head)). The warps' states merge
// in shared memory at the end, then the output or the range's state as in the split kernel.
template <int D>
__global__ void __launch_bounds__(k_tc_warps * 32, 2)
    paged_attention_tc_kernel(const __grid_constant__ paged_attention_args a,
                              const split_params sp) {
  constexpr int KS = D / 16;  // k-steps of S
  constexpr int KC = D / 32;  // K chunks per lane per position
  constexpr int VC = D / 64;  // V chunks per lane per position
  constexpr int NT = D / 8;   // mma of P V
  __shared__ float s_m[k_tc_warps][k_tc_rows], s_l[k_tc_warps][k_tc_rows];
  __shared__ float s_o[k_tc_warps][k_tc_rows][D];
  const moebius::kv_geometry& g = a.geometry;
  const int64_t page_heads = (a.q_heads + a.group - 1) / a.group;
  const int64_t chunks =
      ((a.group < a.q_heads ? a.group : a.q_heads) + k_tc_rows - 1) / k_tc_rows;
  int64_t b = blockIdx.x;
  const int64_t chunk = b % chunks;
  b /= chunks;
  const int32_t range = static_cast<int32_t>(b % sp.splits);
  b /= sp.splits;
  const int64_t kvh = b % page_heads;
  const int64_t t = b / page_heads;
  if (t >= detail::real_rows(a.tok.num_tokens, a.tok.tokens)) return;
  const int32_t ps = static_cast<int32_t>(g.page_size);
  const int32_t span = sp.pages_per_split * ps;
  const int32_t last = a.tok.pos[t];
  const int32_t begin = range * span;
  const int32_t end = min(last + 1, begin + span);
  if (begin >= end) return;
  const int64_t h0 = kvh * a.group + chunk * k_tc_rows;
  const int64_t h_end = min(min((kvh + 1) * a.group, a.q_heads), h0 + k_tc_rows);
  const int G = static_cast<int>(h_end - h0);
  if (G <= 0) return;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int gr = lane >> 2, c = lane & 3;

  const bool hnd = g.layout == moebius::kv_layout::hnd;
  const int64_t heads =
      a.mode == moebius::parallel_mode::ep ? g.heads_per_ep_page() : g.heads_per_tp_page();
  constexpr int64_t es = 2;  // bf16
  const int64_t page_bytes = g.page_size * heads * D * es;
  const int64_t slot_bytes = hnd ? D * es : heads * D * es;
  const int64_t head_off = (hnd ? kvh * g.page_size * D : kvh * D) * es;
  const std::byte* k_lane =
      a.pool + g.tensor_offset(a.layer, moebius::kv_tensor::k) + head_off + 8 * c * es;
  const std::byte* v_lane =
      a.pool + g.tensor_offset(a.layer, moebius::kv_tensor::v) + head_off + 8 * gr * es;
  const int32_t* row = a.tok.tables + static_cast<int64_t>(a.tok.seq[t]) * a.tok.table_stride;
  const bool ps_pow2 = (ps & (ps - 1)) == 0;
  const int ps_shift = __ffs(ps) - 1;
  auto offset_of = [&](int32_t s) {
    const int32_t pg = ps_pow2 ? (s >> ps_shift) : s / ps;
    return static_cast<int64_t>(row[pg]) * page_bytes + static_cast<int64_t>(s - pg * ps) * slot_bytes;
  };

  // Q fragments of the 8 heads (rows g: high parts, rows g + 8: low parts), scaled to base 2.
  uint32_t qa[KS][4];
  {
    const float qs = a.scale * k_log2e;
    const bool has = gr < G;
    const float* qrow = a.q + t * a.q_stride + (h0 + (has ? gr : 0)) * D;
#pragma unroll
    for (int kk = 0; kk < KS; ++kk) {
      const int d = 8 * (4 * (kk / 2) + c) + 4 * (kk % 2);
      const float x0 = has ? qrow[d] * qs : 0.0f, x1 = has ? qrow[d + 1] * qs : 0.0f;
      const float x2 = has ? qrow[d + 2] * qs : 0.0f, x3 = has ? qrow[d + 3] * qs : 0.0f;
      split_bf16x2(x0, x1, qa[kk][0], qa[kk][1]);
      split_bf16x2(x2, x3, qa[kk][2], qa[kk][3]);
    }
  }

  float acc[NT][4];
#pragma unroll
  for (int j = 0; j < NT; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
  float m = -INFINITY, l = 0.0f;  // head gr's running max (base 2) and this lane's partial sum
  for (int32_t tile = begin + warp * k_tc_tile; tile < end; tile += k_tc_warps * k_tc_tile) {
    uint4 kr[2][KC], vr[4][VC];
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int32_t s = tile + 8 * u + gr;
      if (s < end) {
        const std::byte* p = k_lane + offset_of(s);
#pragma unroll
        for (int i = 0; i < KC; ++i) kr[u][i] = *reinterpret_cast<const uint4*>(p + 64 * i);
      } else {
#pragma unroll
        for (int i = 0; i < KC; ++i) kr[u][i] = make_uint4(0, 0, 0, 0);
      }
    }
#pragma unroll
    for (int v = 0; v < 4; ++v) {
      const int32_t s = tile + 2 * c + (v & 1) + 8 * (v >> 1);
      if (s < end) {
        const std::byte* p = v_lane + offset_of(s);
#pragma unroll
        for (int h = 0; h < VC; ++h) vr[v][h] = *reinterpret_cast<const uint4*>(p + 128 * h);
      } else {
#pragma unroll
        for (int h = 0; h < VC; ++h) vr[v][h] = make_uint4(0, 0, 0, 0);  // p = 0 there too
      }
    }
    float sc[2][4];
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      sc[u][0] = sc[u][1] = sc[u][2] = sc[u][3] = 0.0f;
#pragma unroll
      for (int kk = 0; kk < KS; ++kk)
        mma_bf16_16816(sc[u], qa[kk][0], qa[kk][1], qa[kk][2], qa[kk][3],
                       word_of(kr[u][kk / 2], 2 * (kk % 2)), word_of(kr[u][kk / 2], 2 * (kk % 2) + 1));
    }
    // p[2u + e]: position tile + 8u + 2c + e of head gr.
    float p[4];
#pragma unroll
    for (int u = 0; u < 2; ++u)
#pragma unroll
      for (int e = 0; e < 2; ++e)
        p[2 * u + e] = tile + 8 * u + 2 * c + e < end ? sc[u][e] + sc[u][e + 2] : -INFINITY;
    float mx = fmaxf(fmaxf(p[0], p[1]), fmaxf(p[2], p[3]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float m_new = fmaxf(m, mx);  // finite: position `tile` is < end
    const float corr = fast_exp2(m - m_new);
#pragma unroll
    for (int e = 0; e < 4; ++e) p[e] = fast_exp2(p[e] - m_new);
    l = l * corr + ((p[0] + p[1]) + (p[2] + p[3]));
    m = m_new;
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[j][e] *= corr;
    uint32_t pa0, pa1, pa2, pa3;
    split_bf16x2(p[0], p[1], pa0, pa1);
    split_bf16x2(p[2], p[3], pa2, pa3);
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      const int h = j / 8, w = (j % 8) / 2;
      const unsigned sel = (j & 1) ? 0x7632u : 0x5410u;
      const uint32_t b0 = __byte_perm(word_of(vr[0][h], w), word_of(vr[1][h], w), sel);
      const uint32_t b1 = __byte_perm(word_of(vr[2][h], w), word_of(vr[3][h], w), sel);
      mma_bf16_16816(acc[j], pa0, pa1, pa2, pa3, b0, b1);
    }
  }
  l += __shfl_xor_sync(0xffffffffu, l, 1);
  l += __shfl_xor_sync(0xffffffffu, l, 2);
  if (c == 0) {
    s_m[warp][gr] = m;
    s_l[warp][gr] = l;
  }
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    const int d = 64 * (j / 8) + 16 * c + j % 8;  // column 2c; column 2c + 1 is 8 dims on
    s_o[warp][gr][d] = acc[j][0] + acc[j][2];
    s_o[warp][gr][d + 8] = acc[j][1] + acc[j][3];
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < G * D; idx += blockDim.x) {
    const int j = idx / D, d = idx % D;
    float mm = -INFINITY;
#pragma unroll
    for (int w = 0; w < k_tc_warps; ++w) mm = fmaxf(mm, s_m[w][j]);
    float ll = 0.0f, o = 0.0f;
#pragma unroll
    for (int w = 0; w < k_tc_warps; ++w) {
      if (s_m[w][j] == -INFINITY) continue;  // a warp that saw no tile
      const float cw = exp2f(s_m[w][j] - mm);
      ll += s_l[w][j] * cw;
      o += s_o[w][j][d] * cw;
    }
    if (sp.splits == 1) {
      a.out[t * a.out_stride + (h0 + j) * D + d] = o / ll;
    } else {
      // The split kernel's workspace layout; the max back in natural-log units of the score.
      const int64_t slot = (t * a.q_heads + h0 + j) * sp.splits + range;
      a.workspace[slot * D + d] = o;
      if (d == 0) {
        float* ml = a.workspace + a.tok.tokens * a.q_heads * sp.splits * D;
        ml[2 * slot] = mm * k_ln2;
        ml[2 * slot + 1] = ll;
      }
    }
  }
}

void launch_paged_attention(const paged_attention_args& a, cudaStream_t stream) {
  const int64_t D = a.geometry.head_dim;
  MOEBIUS_CHECK(D <= 32 * k_max_dims_per_lane, moebius::errc::invalid_argument,
                "paged_attention: head_dim ", D, " > ", 32 * k_max_dims_per_lane);
  MOEBIUS_CHECK(a.group >= 1, moebius::errc::invalid_argument, "paged_attention: group < 1");
  if (a.tok.tokens == 0 || a.q_heads == 0) return;
  const bool gqa_shape = D % k_vec == 0 && D / k_vec <= 32 && ((D / k_vec) & (D / k_vec - 1)) == 0;
  if (a.simple || !gqa_shape) {
    const int64_t blocks = a.tok.tokens * a.q_heads;
    paged_attention_kernel<<<static_cast<unsigned>(blocks), k_attention_warps * 32, 0, stream>>>(a);
    check_launch("paged_attention");
    return;
  }
  const int64_t page_heads = (a.q_heads + a.group - 1) / a.group;
  const int64_t chunks = (std::min(a.group, a.q_heads) + k_max_group - 1) / k_max_group;
  const int64_t parts = k_attention_warps * (32 / (D / k_vec));
  const size_t smem = static_cast<size_t>(parts * k_max_group * (2 + D)) * sizeof(float);
  // At most 128 parts * 4 heads * (2 + 8) floats = 20 KiB (D = 8): no opt-in needed.
  const split_params sp =
      split_params_of(a, a.workspace == nullptr ? 1 : paged_attention_splits(a));
  if (paged_attention_uses_tensor_cores(a)) {
    const int64_t tc_chunks = (std::min(a.group, a.q_heads) + k_tc_rows - 1) / k_tc_rows;
    const auto grid = static_cast<unsigned>(a.tok.tokens * page_heads * tc_chunks * sp.splits);
    if (D == 64)
      paged_attention_tc_kernel<64><<<grid, k_tc_warps * 32, 0, stream>>>(a, sp);
    else
      paged_attention_tc_kernel<128><<<grid, k_tc_warps * 32, 0, stream>>>(a, sp);
    check_launch("paged_attention_tc");
  } else {
    const auto grid = static_cast<unsigned>(a.tok.tokens * page_heads * chunks * sp.splits);
    paged_attention_split_kernel<<<grid, k_attention_warps * 32, smem, stream>>>(a, sp);
    check_launch("paged_attention_split");
  }
  if (sp.splits > 1) {
    paged_attention_merge_kernel<<<static_cast<unsigned>(a.tok.tokens * a.q_heads), 128, 0,
                                   stream>>>(a, sp);
    check_launch("paged_attention_merge");
  }
}

}  // namespace mini_engine::gpu
