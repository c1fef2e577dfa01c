#pragma once

// Internals of the paged decode attention, shared by its three files: attention.cu (kv_append,
// the simple kernel, the split count and launch_paged_attention, which picks a kernel),
// attention_split.cu (the CUDA-core split kernel and the merge of its ranges) and
// attention_tc.cu (the tensor-core split kernel).

#include "common.cuh"
#include "kernels.hpp"

namespace mini_engine::gpu {

constexpr int k_attention_warps = 4;
constexpr int k_vec = 8;        // elements per lane per position (16 bytes of bf16)
constexpr int k_max_group = 4;  // q heads per block held in registers (8: 208 registers)
constexpr int k_tc_rows = 8;    // q heads per block of the tensor-core kernel (mma rows 0..7)

// Where position `position` of a token's sequence lies in this rank's table row
// (paged_tokens, dcp): its DCP index (the rank's own, tok.dcp_rank, or another rank stores
// it), its local page (the table index) and slot. dcp 1: (0, position / page_size, position %
// page_size).
__device__ __forceinline__ moebius::kv_token_place place_in_row(const paged_tokens& tok,
                                                                const moebius::kv_geometry& g,
                                                                int64_t position) {
  moebius::kv_geometry share = g;  // the page size; the DCP degree of this view (EP: 1)
  share.dcp = tok.dcp;
  return share.token_place(position);
}

// The last local position token t attends to: pos[t] (dcp 1), or with dcp > 1 the count of
// the rank's held positions <= pos[t], minus one; -1 when it holds none (an empty part).
//   page_size 4, dcp 2, pos[t] = 9: DCP index 0 -> 5 (positions 0-3, 8, 9), index 1 -> 3.
__device__ __forceinline__ int64_t last_attended(const paged_tokens& tok,
                                                 const moebius::kv_geometry& g, int64_t t) {
  const int64_t p = tok.pos[t];
  if (tok.dcp == 1) return p;
  moebius::kv_geometry share = g;
  share.dcp = tok.dcp;
  return share.dcp_tokens_held(p + 1, tok.dcp_rank) - 1;
}

// The attention output element and (d == 0, with args' lse) the LSE from a softmax state:
// unnormalised output o, max m (natural-log units), sum l. l == 0 is a part with no position
// (paged_tokens, dcp > 1): output 0, LSE -inf. (l is >= 1 otherwise; a NaN l stays NaN.)
__device__ __forceinline__ void store_output(const paged_attention_args& a, int64_t t, int64_t h,
                                             int64_t d, float o, float m, float l) {
  const int64_t D = a.geometry.head_dim;
  a.out[t * a.out_stride + h * D + d] = l == 0.0f ? 0.0f : o / l;
  if (a.lse != nullptr && d == 0) a.lse[t * a.lse_stride + h] = l == 0.0f ? -INFINITY : m + logf(l);
}

struct split_params {
  int32_t splits = 1;
  int32_t pages_per_split = 1;  // splits * pages_per_split >= table_stride
};

// What one block of a split kernel works on: token t, page head kvh, position range `range`,
// chunk `chunk` of up to `rows` q heads of that page head.
struct split_block {
  int64_t t, kvh, chunk;
  int32_t range;
  int32_t begin, end;  // the token's positions in the range: [begin, end)
  int64_t h0;          // the chunk's q heads: h0 .. h0 + G - 1
  int G;
};

// The block index of the split kernels decoded: blockIdx.x = ((t * page_heads + kvh) * splits
// + range) * chunks + chunk, chunks of up to `rows` q heads (k_max_group; the tensor-core
// kernel: k_tc_rows). Range r of token t holds positions [r * span, min((r + 1) * span,
// pos[t] + 1)), span = pages_per_split * page_size. False when the block has nothing to do:
// a token past num_tokens, a range past the token's context (the merge reads no such range),
// a chunk past the page head's q heads; the block then exits. The context is the token's
// positions, or with dcp > 1 the rank's held ones (last_attended); range 0 of a token whose
// rank holds none runs empty ([0, 0)) and writes the empty part (store_output).
//   page_size 16, pages_per_split 2 (span 32), pos[t] = 40: range 0 is [0, 32), range 1
//   [32, 41), ranges 2.. none.
__device__ __forceinline__ bool split_block_of(const paged_attention_args& a,
                                               const split_params& sp, int rows, split_block& blk) {
  const int64_t page_heads = (a.q_heads + a.group - 1) / a.group;
  const int64_t chunks = ((a.group < a.q_heads ? a.group : a.q_heads) + rows - 1) / rows;
  // Chunks of one range are adjacent (their second reads of K/V hit L2).
  int64_t b = blockIdx.x;
  blk.chunk = b % chunks;
  b /= chunks;
  blk.range = static_cast<int32_t>(b % sp.splits);
  b /= sp.splits;
  blk.kvh = b % page_heads;
  blk.t = b / page_heads;
  if (blk.t >= detail::real_rows(a.tok.num_tokens, a.tok.tokens)) return false;
  const int32_t span = sp.pages_per_split * static_cast<int32_t>(a.geometry.page_size);
  const int32_t last = static_cast<int32_t>(last_attended(a.tok, a.geometry, blk.t));
  blk.begin = blk.range * span;
  blk.end = max(min(last + 1, blk.begin + span), blk.begin);
  if (blk.begin == blk.end && blk.range > 0) return false;
  blk.h0 = blk.kvh * a.group + blk.chunk * rows;
  const int64_t h_end = min(min((blk.kvh + 1) * a.group, a.q_heads), blk.h0 + rows);
  blk.G = static_cast<int>(h_end - blk.h0);
  return blk.G > 0;
}

// Element d of the output of q head h of token t over context range `range`: the attention
// output itself when the context is not split, else the range's partial output, and with d ==
// 0 its running max m (natural-log units of the score) and sum l, which the merge kernel
// combines. Workspace: [tokens][q_heads][splits] of D partial outputs, then the same of (m, l).
__device__ __forceinline__ void store_partial(const paged_attention_args& a,
                                              const split_params& sp, int64_t t, int64_t h,
                                              int64_t range, int64_t d, float o, float m,
                                              float l) {
  const int64_t D = a.geometry.head_dim;
  if (sp.splits == 1) {
    store_output(a, t, h, d, o, m, l);
    return;
  }
  const int64_t slot = (t * a.q_heads + h) * sp.splits + range;
  a.workspace[slot * D + d] = o;
  if (d == 0) {
    float* ml = a.workspace + a.tok.tokens * a.q_heads * sp.splits * D;
    ml[2 * slot] = m;
    ml[2 * slot + 1] = l;
  }
}

// The launchers of the split kernels, for launch_paged_attention (a split count from
// split_params_of): the CUDA-core one, the tensor-core one (bf16 pool, head_dim 64 or 128),
// and the merge of their ranges when sp.splits > 1.
void launch_paged_attention_split(const paged_attention_args& a, const split_params& sp,
                                  cudaStream_t stream);
void launch_paged_attention_tc(const paged_attention_args& a, const split_params& sp,
                               cudaStream_t stream);
void launch_paged_attention_merge(const paged_attention_args& a, const split_params& sp,
                                  cudaStream_t stream);

}  // namespace mini_engine::gpu
