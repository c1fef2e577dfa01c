#pragma once

// The mini-engine's GPU kernels: one argument struct per kernel, passed by value
// (__grid_constant__), and a launcher that takes it and the stream last. Every kernel is
// tested in tests/test_kernels*.cu against a host reference in double written inside each test
// case (helpers: tests/gpu_test_util.hpp), every output element checked.
//
// Conventions. Activations between kernels are fp32, row-major, with an explicit row stride
// in elements; GEMM inputs are converted to the weights' dtype (fp32 or bf16) right before
// the GEMM. A kernel that works on a bucket of tokens (a captured CUDA graph) reads how many
// are real from a device scalar `num_tokens` (nullptr: all rows), so one graph serves every
// batch up to its bucket: rows past it are skipped or marked invalid.

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <moebius/kv/kv_geometry.hpp>
#include <moebius/layout/dtype.hpp>
#include <moebius/layout/expert_shape.hpp>

namespace mini_engine::gpu {

// ---- norm.cu --------------------------------------------------------------------------------
// y[r, :] = x[r, :] / sqrt(mean(x[r, :]^2) + eps) * weight[:]. In place when y == x. Also the
// per-head q/k norm: rows = tokens * heads, width = head_dim, strides of one head.
struct rmsnorm_args {
  const float* x = nullptr;  // [rows] rows of `width`, x_stride apart
  int64_t x_stride = 0;
  float* y = nullptr;  // [rows] rows of `width`, y_stride apart
  int64_t y_stride = 0;
  const float* weight = nullptr;  // [width]
  int64_t rows = 0;
  int64_t width = 0;
  int64_t heads = 1;        // rows are (token, head): row r is token r / heads, head r % heads
  int64_t head_stride = 0;  // elements between heads of one token (heads > 1)
  float eps = 1e-6f;
};
void launch_rmsnorm(const rmsnorm_args& a, cudaStream_t stream);

// ---- rope.cu --------------------------------------------------------------------------------
// Rotates each head of each token in place (rotate_half: pairs (i, i + D/2)) by its token's
// position: x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin, angle = pos * theta^(-2i/D)
// (angles in double: positions reach 1e5 and a float angle would be off by 1e-2 rad).
struct rope_args {
  float* x = nullptr;  // [tokens] rows of heads * head_dim, row_stride apart
  int64_t row_stride = 0;
  int64_t tokens = 0;
  int64_t heads = 0;
  int64_t head_dim = 0;                 // even
  const int32_t* positions = nullptr;   // [tokens]
  const int32_t* num_tokens = nullptr;  // device scalar or nullptr
  double theta = 1e6;
};
void launch_rope(const rope_args& a, cudaStream_t stream);

// ---- attention.cu (its kernels in attention_split.cu, attention_tc.cu) ------------------------
// Token t belongs to page-table row seq[t] and sits at position pos[t]: its K/V go to page
// tables[seq[t] * table_stride + pos[t] / page_size], slot pos[t] % page_size, and it attends
// causally over positions [0, pos[t]] of its row (decode: one token per row; a prefill chunk:
// several tokens of one row, each seeing the earlier ones, written by kv_append first).
//
// Decode context parallelism (dcp > 1: the TP view of kv_geometry.hpp, where the dcp ranks of
// a replica set split every sequence's pages): this rank, of DCP index dcp_rank, holds only
// the logical pages dcp_rank, dcp_rank + dcp, .. of each sequence, and its table row lists
// them alone, in order (local page i = logical page i * dcp + dcp_rank; kv_view.hpp). Then
// position p lies on this rank iff (p / page_size) % dcp == dcp_rank, at local page
// (p / page_size) / dcp, slot p % page_size (kv_geometry::token_place): kv_append stores only
// those tokens (the rank of the other index stores the rest), and token t attends over the
// positions <= pos[t] the rank holds, which are the first dcp_tokens_held(pos[t] + 1,
// dcp_rank) local positions of its row (held pages before pos[t]'s are full), possibly none:
// the rank's part of the attention, merged across the set by dcp_merge.
//   page_size 4, dcp 2, pos[t] = 9 (logical page 2): DCP index 0 holds positions 0-3 and 8-9
//   (local 0..5), index 1 positions 4-7 (local 0..3); pos[t] = 2: index 1 holds none.
struct paged_tokens {
  const int32_t* seq = nullptr;     // [tokens] page-table row of each token
  const int32_t* pos = nullptr;     // [tokens] position of each token in its sequence
  const int32_t* tables = nullptr;  // [rows][table_stride] page ids of this rank's pool
  int64_t table_stride = 0;
  int64_t tokens = 0;                   // rows of the bucket
  const int32_t* num_tokens = nullptr;  // device scalar: real tokens (nullptr: all)
  int64_t dcp = 1;                      // ranks splitting each sequence's pages (EP: 1)
  int64_t dcp_rank = 0;                 // this rank's DCP index, [0, dcp)
};

// Stores K and V of `heads` heads per token into the pool (kv dtype: fp32 or bf16), as heads
// head0 .. head0+heads-1 of the page in `mode` (EP: global head; TP: head within the rank's
// slice).
struct kv_append_args {
  const float* k = nullptr;  // [tokens] rows of heads * head_dim, stride apart
  const float* v = nullptr;
  int64_t stride = 0;
  int64_t heads = 0;
  int64_t head0 = 0;
  std::byte* pool = nullptr;  // the rank's KV pool
  moebius::kv_geometry geometry;
  moebius::parallel_mode mode = moebius::parallel_mode::ep;
  int64_t layer = 0;
  paged_tokens tok;
};
void launch_kv_append(const kv_append_args& a, cudaStream_t stream);

// out[t, h, :] = softmax(q[t, h, :] . K[0..pos]^T * scale) V[0..pos] for local q head h,
// which reads page head h / group (GQA). One block per (token, q head); online softmax in
// fp32 over the token's pages, the last one partial.
struct paged_attention_args {
  const float* q = nullptr;  // [tokens] rows of q_heads * head_dim, q_stride apart
  int64_t q_stride = 0;
  int64_t q_heads = 0;   // local q heads
  int64_t group = 1;     // q heads per KV head
  float* out = nullptr;  // [tokens] rows of q_heads * head_dim, out_stride apart
  int64_t out_stride = 0;
  const std::byte* pool = nullptr;
  moebius::kv_geometry geometry;
  moebius::parallel_mode mode = moebius::parallel_mode::ep;
  int64_t layer = 0;
  float scale = 1.0f;
  paged_tokens tok;
  // The simple kernel (one block per q head, one position per warp step) instead of the GQA
  // kernel (one block per KV head and its q heads, 16-byte loads, several positions per warp
  // step). The GQA kernels need head_dim in {8, 16, 32, 64, 128, 256}; others use the simple
  // one anyway.
  bool simple = false;
  // The split-context GQA kernel (flash-decoding) unless `simple`: each (token, KV head) is
  // cut into `splits` ranges of whole pages, one block each, so a batch-1 decode step fills
  // the GPU instead of running 8 blocks over the whole context; a second kernel merges the
  // ranges' softmax states. Without a workspace it runs one range: one block per (token, KV
  // head) walks the whole context.
  float* workspace = nullptr;  // paged_attention_workspace_floats(*this) floats
  int64_t splits = 0;  // 0: paged_attention_splits() picks; n: n ranges of whole pages
                       // (fewer when n does not divide table_stride evenly, at most one a page)
  // The tensor-core split kernel instead of the CUDA-core one (same ranges, same workspace,
  // same merge) when the pool is bf16, head_dim is 64 or 128, the device is sm_80 or newer
  // and the bucket has at least tensor_core_min_tokens tokens (a shape: graphs replay it). One
  // block per (token, KV head, range) and up to 8 of its q heads: each K/V row is loaded once
  // for the whole GQA group, QK^T and PV run as bf16 mma with fp32 accumulation, q and the
  // probabilities as bf16 high + low halves (rows 0..7 and 8..15 of the 16-row tile), so the
  // result is as accurate as the fp32 kernel's. Why: at batch 512 (Qwen3-30B-A3B, context
  // 1024) the CUDA-core kernel spends ~30 warp instructions per (position, q head) on 16-lane
  // dot reductions and a softmax repeated on every lane of a position: 1.5 ms per layer
  // against 0.27 ms of K/V bytes. The default runs tensor cores at every bucket: at 2-8 tokens
  // and long contexts the CUDA-core kernel read K/V at 0.27-0.56 TB/s on an H200 (Qwen3-235B
  // EP rank, 8 tokens, context 8192: 59 ms of attention for 12.6 GB), the tensor-core kernel
  // at 16 tokens at 1.9 TB/s (docs/BENCHMARKS.md, per-rank step curves).
  bool tensor_cores = true;
  int64_t tensor_core_min_tokens = 1;
  // The log-sum-exp of each (token, q head)'s scaled scores over the positions it attends, in
  // natural-log units: lse[t * lse_stride + h] = m + log(sum_s exp(score_s - m)), m the largest
  // score. With tok.dcp > 1 that is the rank's part (its positions only), and out is the
  // part's own softmax average; a part with no position gives out 0 and lse -inf (it weighs
  // nothing in dcp_merge). nullptr: not written (out is the same either way).
  float* lse = nullptr;  // [tokens] rows of q_heads, lse_stride apart
  int64_t lse_stride = 0;
};
void launch_paged_attention(const paged_attention_args& a, cudaStream_t stream);
// Whether launch_paged_attention runs the tensor-core kernel for these args (a shape property:
// dtype, head_dim, tokens of the bucket, the device's compute capability).
bool paged_attention_uses_tensor_cores(const paged_attention_args& a);
// Context ranges per (token, KV head) the split kernel uses for these args (when it runs: a
// workspace, not simple): enough blocks for 4 per SM of the current
// device, at least 32 positions (whole pages) per range (the tensor-core kernel, whose blocks
// take 8 q heads and 64 positions per step: at least 64); a.splits > 0 forces about that many.
// Depends only on the shapes
// (tokens of the bucket, heads, table_stride), never on positions: a graph replays it.
//   H200 (132 SMs), 1 token, 4 KV heads, group 8 (2 blocks of 4 q heads each), page 16,
//   table_stride 65: wants 528 / 8 = 66 ranges, at most ceil(65 / 2) = 33 -> 33 ranges of
//   2 pages (264 blocks). 256 tokens: 1 range.
//   Tensor-core kernel (bf16 pool), 64 tokens: 4 blocks per token, 256 blocks; wants
//   ceil(528 / 256) = 3 ranges (at most ceil(65 / 4) = 17) -> ceil(65 / 3) = 22 pages per
//   range, 3 ranges (768 blocks). 128 tokens: 2 ranges; 256 and 512 tokens: 1 range.
int64_t paged_attention_splits(const paged_attention_args& a);
// Floats of workspace the split kernel needs for these args (tokens * q_heads * splits *
// (head_dim + 2): each range's unnormalised output, max and sum); 0 when splits is 1.
int64_t paged_attention_workspace_floats(const paged_attention_args& a);

// ---- dcp_merge.cu ---------------------------------------------------------------------------
// The cross-rank merge of decode context parallelism: the parts of one DCP set (each member's
// attention over the positions it holds, normalised by its own softmax sum, with its LSE:
// paged_attention_args::lse) combined into the attention over all the positions, for `heads`
// q heads of each token:
//   lse[t, h]    = m + log(sum_s exp(lse_s[t, h] - m)),  m = max_s lse_s[t, h]
//   out[t, h, :] = sum_s exp(lse_s[t, h] - lse[t, h]) * part_s[t, h, :]   (s = 0, 1, .. in order)
// in fp32. A part with lse -inf (its rank holds none of the positions the token sees) adds
// nothing; were every part empty, out would be 0. The parts are read where they lie (virtual
// ranks: the peers' buffers on the same device), so a rank merges without copying them.
// Tokens at or past *num_tokens are skipped.
//   two parts, lse {0, log 3}, part {[1], [5]}: lse = log 4, out = 1/4 * 1 + 3/4 * 5 = [4].
struct dcp_merge_args {
  static constexpr int max_parts = 8;
  const float* parts[max_parts] = {};     // [num_parts] each [tokens] rows of heads * head_dim
  const float* part_lse[max_parts] = {};  // [num_parts] each [tokens] rows of heads
  int num_parts = 0;
  int64_t part_stride = 0;  // elements between two tokens' rows of a part
  int64_t lse_stride = 0;   // elements between two tokens' rows of an LSE part
  int64_t tokens = 0;
  int64_t heads = 0;
  int64_t head_dim = 0;
  const int32_t* num_tokens = nullptr;  // device scalar: real tokens (nullptr: all)
  float* out = nullptr;                 // [tokens] rows of heads * head_dim, out_stride apart
  int64_t out_stride = 0;
};
void launch_dcp_merge(const dcp_merge_args& a, cudaStream_t stream);

// ---- activation.cu --------------------------------------------------------------------------
// out[r, i] = silu(in[r, i]) * in[r, inter + i]: in rows are [gate slice | up slice].
struct silu_and_mul_args {
  const float* in = nullptr;  // [rows, 2 * inter]
  void* out = nullptr;        // [rows, inter] of out_type (fp32 or bf16)
  moebius::dtype out_type = moebius::dtype::fp32;
  int64_t rows = 0;
  int64_t inter = 0;
};
void launch_silu_and_mul(const silu_and_mul_args& a, cudaStream_t stream);

// ---- dequant.cu -----------------------------------------------------------------------------
// fp8 block-scaled experts (why a dequantize step: gemm.hpp). For each local expert e with
// counts[e] > 0 (counts nullptr: every expert):
//   out[e, r, c] = e4m3(w[e, r, c]) * scale[e, r / block_n, c / block_k]   in out_type,
// exact whenever the product is a normal bf16 / fp32 (4 significant bits times a power of two;
// round_experts' scales keep it so), NaN codes (0x7f, 0xff) give NaN. Experts without tokens are
// not touched (their blocks exit at once), so the cost follows the experts a step routes to.
// The same args serve EP (w [E/P, 2I, H] of the arena, scales [E/P, 2I/b, H/b]) and TP (the
// rank's I/P slice: [E, 2I/P, H] with [E, 2I/(P b), H/b]: whole blocks per slice).
//   experts 2, rows 4, cols 8, blocks 2 x 4: scale [2, 2, 2]; out[1, 3, 5] =
//   e4m3(w[1*32 + 3*8 + 5]) * scale[1*4 + 1*2 + 1].
struct dequant_fp8_args {
  const uint8_t* w = nullptr;      // [experts, rows, cols] e4m3 codes
  const float* scale = nullptr;    // [experts, rows / block_n, cols / block_k]
  void* out = nullptr;             // [experts, rows, cols] of out_type (bf16 or fp32)
  moebius::dtype out_type = moebius::dtype::bf16;
  int64_t experts = 0;             // <= 65535
  int64_t rows = 0, cols = 0;      // whole blocks: block_n | rows, block_k | cols
  int64_t block_n = 128, block_k = 128;
  const int32_t* counts = nullptr;  // [experts] tokens per expert this step, or nullptr
};
void launch_dequant_fp8(const dequant_fp8_args& a, cudaStream_t stream);

// ---- router.cu ------------------------------------------------------------------------------
// Softmax over each token's expert logits, the top_k largest (ties: lower index first),
// weights renormalised to sum to 1 when `renormalize` (Hugging Face norm_topk_prob), else
// the softmax probabilities. Tokens at or past *num_tokens get ids -1, weights 0.
struct router_topk_args {
  const float* logits = nullptr;  // [tokens, experts]
  int64_t tokens = 0;
  int64_t experts = 0;
  int64_t top_k = 0;  // <= 32
  const int32_t* num_tokens = nullptr;
  int32_t* ids = nullptr;    // [tokens, top_k] global expert ids, best first
  float* weights = nullptr;  // [tokens, top_k]
  bool renormalize = true;
};
void launch_router_topk(const router_topk_args& a, cudaStream_t stream);

// ---- moe_permute.cu -------------------------------------------------------------------------
// Token permutation for the expert GEMMs (design in moe_plan below and gemm.hpp):
//   1. moe_route: key of pair p = (token p / k, choice p % k) = its expert's local id, or
//      num_local (not ours / invalid); value = p.
//   2. CUB radix sort of (key, value): pairs grouped by local expert, in pair order.
//   3. moe_tile_map: per expert its count, its first sorted pair and its first tile
//      (ceil(count / tile_rows) tiles each), and the cuBLAS pointer arrays of every tile slot
//      (slots past the used tiles point at their own spare rows and expert 0: computed,
//      never read).
//   4. moe_gather: each sorted pair's row = tile_start * tile_rows + rank within its expert;
//      copies its token's row there (expert dtype) and records pair_row[p].
//   5. (GEMMs, SiLU-and-mul, GEMM.)
//   6. moe_combine: out[t] = sum over j of weight[t, j] * y[pair_row[t*k+j]] (j ascending,
//      pairs with no row skipped).
// A token source: rows of `x` (expert dtype) with their routing, `row_bytes` apart (the
// packed rows that EP all-gathers; TP packs its own tokens the same way).
struct moe_tokens {
  const std::byte* rows = nullptr;  // [tokens] packed rows
  int64_t row_bytes = 0;
  int64_t ids_offset = 0;      // int32 [top_k] global expert ids (-1: none) at this byte offset
  int64_t weights_offset = 0;  // float [top_k]
  int64_t tokens = 0;
  int64_t top_k = 0;
};

// Where an expert layer's work lives for one bucket: fixed addresses, sized for the bucket.
struct moe_plan {
  int64_t num_local = 0;     // experts of this rank in this mode (EP E/P, TP E)
  int64_t first_expert = 0;  // global id of local expert 0
  int64_t tile_rows = 0;     // rows per GEMM batch entry
  int64_t max_tiles = 0;     // batch entries (ceil(pairs / tile_rows) + min(num_local, pairs))
  int64_t hidden = 0;        // H
  int64_t inter = 0;         // I of this rank (EP I, TP I/P)
  moebius::dtype type = moebius::dtype::bf16;  // GEMM dtype (fp32 or bf16; fp8 experts: the
                                               // dequantized scratch's)
  const std::byte* w13 = nullptr;  // [num_local, 2 * inter, H] in the arena slot (fp8: scratch)
  const std::byte* w2 = nullptr;   // [num_local, H, inter]
  // workspace (device)
  int32_t* keys = nullptr;         // [pairs]
  int32_t* values = nullptr;       // [pairs]
  int32_t* keys_sorted = nullptr;  // [pairs]
  int32_t* values_sorted = nullptr;
  int32_t* expert_info = nullptr;  // [3 * num_local + 1]: counts, first pair, first tile, tiles
  int32_t* pair_row = nullptr;     // [pairs]
  std::byte* x_perm = nullptr;     // [max_tiles * tile_rows, H] expert dtype
  float* gu = nullptr;             // [max_tiles * tile_rows, 2 * inter]
  std::byte* act = nullptr;        // [max_tiles * tile_rows, inter] expert dtype
  float* y = nullptr;              // [max_tiles * tile_rows, H]
  const void** ptr_w13 = nullptr;  // [max_tiles] cuBLAS pointer arrays
  const void** ptr_x = nullptr;
  void** ptr_gu = nullptr;
  const void** ptr_w2 = nullptr;
  const void** ptr_act = nullptr;
  void** ptr_y = nullptr;
  void* sort_temp = nullptr;  // CUB temp storage
  size_t sort_temp_bytes = 0;
  // Set to 1 (never cleared here) when the pairs need more than max_tiles tiles: the pairs
  // that do not fit get no row (pair_row -1) and the output is incomplete. A graph sized for
  // the expected load (not the worst case) checks it after the step and reruns eagerly.
  int32_t* overflow = nullptr;
};

// Rows of one tile for a bucket of `pairs` (token, expert) pairs over `num_local` experts:
// about half the mean rows per expert, a power of two in [8, 128].
int64_t moe_tile_rows(int64_t pairs, int64_t num_local);
// Tile slots a bucket needs: every expert's last tile may be partial.
//   pairs 8 (one token, top-8), 128 experts, 8 rows: 1 + 8 = 9 slots.
int64_t moe_max_tiles(int64_t pairs, int64_t num_local, int64_t tile_rows);
// Pairs a bucket of `tokens` tokens (top_k of `experts`) sends to `num_local` of them: the
// worst case (every token's choices among ours), or, `optimistic`, capacity_factor times the
// expected share (uniform routing) when that is smaller.
//   512 tokens, top-8 of 128, 64 local: worst 4096, expected 2048, optimistic (1.25) 2560.
int64_t moe_pair_capacity(int64_t tokens, int64_t top_k, int64_t experts, int64_t num_local,
                          bool optimistic, double capacity_factor = 1.25);
// CUB temp bytes for sorting `pairs` pairs.
size_t moe_sort_temp_bytes(int64_t pairs);

// Steps 1-4 (route, sort, tile map, gather) for `src`.
void launch_moe_permute(const moe_plan& p, const moe_tokens& src, cudaStream_t stream);

struct moe_combine_args {
  const float* y = nullptr;           // [rows, H] expert outputs (already down-projected)
  const int32_t* pair_row = nullptr;  // [tokens * top_k], -1: no row
  moe_tokens src;                     // for the weights
  float* out = nullptr;               // [tokens, H]
  int64_t hidden = 0;
};
void launch_moe_combine(const moe_combine_args& a, cudaStream_t stream);

// Packs tokens for the MoE: row t = x[t] in `type`, then its top-k ids and weights.
struct moe_pack_args {
  const float* x = nullptr;        // [tokens, hidden] (stride hidden)
  const int32_t* ids = nullptr;    // [tokens, top_k]
  const float* weights = nullptr;  // [tokens, top_k]
  moe_tokens dst;                  // layout of the packed rows (rows is written)
  std::byte* rows = nullptr;
  int64_t hidden = 0;
  moebius::dtype type = moebius::dtype::bf16;
};
void launch_moe_pack(const moe_pack_args& a, cudaStream_t stream);
// The packed row layout: x, ids, weights, each 16-byte aligned.
moe_tokens moe_token_layout(int64_t tokens, int64_t hidden, int64_t top_k, moebius::dtype type);

// ---- elementwise.cu -------------------------------------------------------------------------
// out[i] = in[i] converted (fp32 <-> bf16, or a copy), n elements.
struct convert_args {
  const void* in = nullptr;
  moebius::dtype in_type = moebius::dtype::fp32;
  void* out = nullptr;
  moebius::dtype out_type = moebius::dtype::bf16;
  int64_t n = 0;
};
void launch_convert(const convert_args& a, cudaStream_t stream);

// out[t, :] = table[ids[t], :] as fp32 (table fp32 or bf16); ids outside [0, vocab) or
// tokens past *num_tokens give zeros.
struct embedding_args {
  const void* table = nullptr;  // [vocab, hidden]
  moebius::dtype type = moebius::dtype::fp32;
  int64_t vocab = 0;
  int64_t hidden = 0;
  const int32_t* ids = nullptr;  // [tokens]
  int64_t tokens = 0;
  const int32_t* num_tokens = nullptr;
  float* out = nullptr;  // [tokens, hidden]
};
void launch_embedding(const embedding_args& a, cudaStream_t stream);

// out[t] = index of the largest x[t, :] (lowest index on ties; NaN never wins), and
// out_value[t] = that largest value when out_value is not null (vocab-parallel heads merge
// the ranks' candidates by value).
struct argmax_args {
  const float* x = nullptr;  // [rows, cols]
  int64_t rows = 0;
  int64_t cols = 0;
  int32_t* out = nullptr;      // [rows]
  float* out_value = nullptr;  // [rows] or nullptr
};
void launch_argmax(const argmax_args& a, cudaStream_t stream);

// h[t, :] += parts[0][t, :] + parts[1][t, :] + ... (parts in order, each `part_stride`
// elements after the previous), rows of `hidden`.
struct residual_add_args {
  float* h = nullptr;
  const float* parts = nullptr;
  int64_t num_parts = 1;
  int64_t part_stride = 0;
  int64_t rows = 0;
  int64_t hidden = 0;
};
void launch_residual_add(const residual_add_args& a, cudaStream_t stream);

// out[t, :] = in[map[t], :] for t < *num_tokens (rows of `hidden` floats), zeros for the
// padding rows t in [*num_tokens, rows). The activation hand-off of a hybrid step
// (gpu_runtime.hpp): TP -> EP keeps a rank's own sequences' rows of the full batch; EP -> TP
// picks every token's row out of the all-gathered [P, T_ep] blocks.
//   map = {2, 0}, num = 2, rows = 3: out = [in[2]; in[0]; 0].
struct gather_rows_args {
  const float* in = nullptr;
  const int32_t* map = nullptr;  // [rows]
  const int32_t* num_tokens = nullptr;
  float* out = nullptr;  // [rows, hidden]; must not overlap `in`
  int64_t rows = 0;
  int64_t hidden = 0;
};
void launch_gather_rows(const gather_rows_args& a, cudaStream_t stream);

// ---- sum_ranks.cu ---------------------------------------------------------------------------
// out[i] = ((parts[0][i] + parts[1][i]) + parts[2][i]) + ... (fp32, rank order, nothing
// fused), i < n: the all-reduce of virtual ranks (P ranks on one device sum each other's
// buffers; every rank sums the same parts in the same order, so all get the same bits).
// `out` must not overlap any part.
//   parts = {a, b}, n = 2: out = {a[0] + b[0], a[1] + b[1]}.
struct sum_ranks_args {
  static constexpr int max_parts = 8;
  const float* parts[max_parts] = {};  // [num_parts] device pointers, each [n]
  int num_parts = 0;
  float* out = nullptr;  // [n]
  int64_t n = 0;
};
void launch_sum_ranks(const sum_ranks_args& a, cudaStream_t stream);

// Fills n elements of `type` (fp32, bf16, or fp8_e4m3: saturated to +-448) with uniform values
// in [-scale, scale) from (seed, index) (benchmarks: weights whose values do not matter, drawn
// on the device).
struct fill_random_args {
  void* out = nullptr;
  moebius::dtype type = moebius::dtype::bf16;
  int64_t n = 0;
  uint64_t seed = 0;
  float scale = 1.0f;
  float offset = 0.0f;  // added after scaling (norm weights: 1)
};
void launch_fill_random(const fill_random_args& a, cudaStream_t stream);

// Throws moebius::error(errc::cuda) naming `what` when the last launch failed.
void check_launch(const char* what);

}  // namespace mini_engine::gpu
