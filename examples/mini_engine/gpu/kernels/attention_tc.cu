#include <algorithm>

#include "paged_attention.cuh"

namespace mini_engine::gpu {

namespace {

// ---- the tensor-core kernel (bf16 pools, head_dim 64 or 128) ------------------------------
constexpr int k_tc_warps = 4;
constexpr int k_tc_tile = 16;  // positions per warp step of the tensor-core kernel
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
  split_block blk;
  if (!split_block_of(a, sp, k_tc_rows, blk)) return;
  const int64_t t = blk.t, kvh = blk.kvh, h0 = blk.h0;
  const int32_t range = blk.range, begin = blk.begin, end = blk.end;
  const int G = blk.G;
  const int32_t ps = static_cast<int32_t>(g.page_size);
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
    store_partial(a, sp, t, h0 + j, range, d, o, mm * k_ln2, ll);  // the max back in ln units
  }
}

void launch_paged_attention_tc(const paged_attention_args& a, const split_params& sp,
                               cudaStream_t stream) {
  const int64_t D = a.geometry.head_dim;
  const int64_t page_heads = (a.q_heads + a.group - 1) / a.group;
  const int64_t tc_chunks = (std::min(a.group, a.q_heads) + k_tc_rows - 1) / k_tc_rows;
  const auto grid = static_cast<unsigned>(a.tok.tokens * page_heads * tc_chunks * sp.splits);
  if (D == 64)
    paged_attention_tc_kernel<64><<<grid, k_tc_warps * 32, 0, stream>>>(a, sp);
  else
    paged_attention_tc_kernel<128><<<grid, k_tc_warps * 32, 0, stream>>>(a, sp);
  check_launch("paged_attention_tc");
}

}  // namespace mini_engine::gpu
