// A layer's attention block (gpu_runtime.hpp): TP computes this rank's q heads and KV head
// slice from row slices of the whole fused q/k/v weight and a column slice of o_proj (no
// second copy), then all-reduces; EP (data-parallel) runs each rank's own sequences with all
// heads. The paged decode kernels: kernels/attention_split.cu and attention_tc.cu; their
// choice: kernels/attention.cu.
//
// Per layer (DESIGN.md §7):
//   attention, in the mode of the page tables passed to step():
//     TP: every rank holds every token; rank r computes q heads [r*Hq/P, (r+1)*Hq/P) and its
//         KV head slice (tp_slice_of_rank; replicated when Hkv < P) over its TP pages, from
//         row slices of the whole q/k/v weights and a column slice of o_proj (pointers with a
//         leading dimension: no second copy); NCCL all-reduce of the o_proj partial sums.
//         With dcp > 1 the replicas of a head split its pages (below).
//     EP: data-parallel: each rank runs its own sequences (their EP owner) with all heads.
//   MoE, in the mode of the layer in the arena (layers below the cursor TP, the rest EP):
//     the router runs where the token is; tokens are packed with their top-k (moe_pack);
//     EP attention: the packed rows are all-gathered (dispatch: every rank sees every token,
//         fixed size per bucket, so a graph can hold it; with top-8 of 128 experts on 2 ranks a
//         token misses a rank with probability 0.4%, so this is what a deduplicated dispatch
//         sends anyway), each rank runs its experts on the pairs routed to them, and the
//         partial outputs go back to the tokens' owners (grouped ncclSend/ncclRecv, fixed
//         [bucket, H] blocks) and are summed there in rank order (combine);
//     TP attention: each rank runs its slice of every expert (or, for an EP layer in a hybrid
//         state, its whole experts) on every token, then all-reduce.
//   Expert GEMMs: gemm.hpp (tiles of one expert per batch entry, pointers at fixed addresses).
//   LM head: TP splits the vocabulary (P | V): rank r computes logits [r*V/P, (r+1)*V/P) of
//   every token and its best candidate (id, logit); the host picks the best of the P
//   candidates (no collective). EP computes all V logits for its own tokens.
// TP with decode context parallelism (gpu_runtime_options::dcp > 1, virtual ranks): the DCP
// set's q heads gathered, each rank's part over the pages it holds, the parts merged per rank
// (dcp_attention below; device_collectives.cu). Benchmarks may emulate one rank of a
// decode-context-parallel set at P = 1 (gpu_runtime_options::emulated_dcp): attention over the
// set's q heads, projections over its own.

#include <cmath>

#include "runtime_impl.hpp"

namespace mini_engine::gpu {

using moebius::dtype;
using moebius::errc;
using moebius::parallel_mode;

// The shape of the paged attention of layer li in mode m over T rows (no pointers: what
// the workspace size depends on).
paged_attention_args gpu_runtime::impl::attention_shape(parallel_mode m, int64_t li,
                                                        int64_t T) const {
  // A DCP set's set x hq gathered q heads: dcp (TP, dcp > 1), read from dcp_q into dcp_out
  // with their LSEs; emulated_dcp, read from xn into proj (every copy on the one KV head:
  // the emulation's GQA group spans them).
  const int64_t D = c.head_dim, set = attention_set(m), hq = set * q_heads_local(m);
  paged_attention_args pa;
  pa.q_stride = set > 1 ? hq * D : qkv_ld;
  pa.q_heads = hq;
  pa.group = o.emulated_dcp * c.num_q_heads / c.num_kv_heads;
  pa.out_stride = hq * D;
  if (dcp_split(m)) pa.lse_stride = hq;
  pa.geometry = kv;
  pa.mode = m;
  pa.layer = li;
  pa.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));
  pa.tok.table_stride = max_pages;
  pa.tok.tokens = T;
  pa.simple = o.simple_attention;
  pa.splits = o.attention_splits;
  pa.tensor_cores = o.tensor_core_attention;
  pa.tensor_core_min_tokens = o.tensor_core_min_tokens;
  return pa;
}

// Rank r's T rows of mode m's input block as the KV kernels read them: rows, positions,
// page tables, and in TP with dcp > 1 the rank's DCP share (its tables list only its pages).
paged_tokens gpu_runtime::impl::tokens_of(rank_state& rs, int r, parallel_mode m,
                                          int64_t T) const {
  paged_tokens tok;
  tok.seq = in_seq(rs, m);
  tok.pos = in_pos(rs, m);
  tok.tables = in_tables(rs, m);
  tok.table_stride = max_pages;
  tok.tokens = T;
  tok.num_tokens = in_num(rs, m);
  if (dcp_split(m)) {
    tok.dcp = kv.dcp;
    tok.dcp_rank = kv.dcp_rank(r);
  }
  return tok;
}

// The paged attention of layer li in mode m over T rows of rank r: q rows at `q`, output
// rows to `out` (TP with dcp > 1: the rank's part, with its LSEs in dcp_lse).
paged_attention_args gpu_runtime::impl::attention_args(rank_state& rs, int r, parallel_mode m,
                                                       int64_t li, int64_t T, const float* q,
                                                       float* out) const {
  paged_attention_args pa = attention_shape(m, li, T);
  pa.q = q;
  pa.out = out;
  pa.pool = rs.kv_pool;
  pa.tok = tokens_of(rs, r, m, T);
  pa.workspace = rs.attn_work;
  if (dcp_split(m)) pa.lse = rs.dcp_lse;
  return pa;
}

// Layer li's attention in ps.attn[li] over that mode's input block and rows, on every rank:
// q, k, v of its heads with K/V into the pool, the paged attention, its o_proj partial sum
// into proj; TP sums the ranks' partials (all-reduce).
void gpu_runtime::impl::attention(const pass& ps, int64_t li) {
  const parallel_mode attn = ps.attn[static_cast<size_t>(li)];
  const int64_t T = ps.rows[mode_index(attn)];
  if (dcp_split(attn)) {
    dcp_attention(li, T);
  } else {
    each_rank([&](int r, rank_state& rs) {
      project_qkv(rs, r, attn, li, T);
      mark(rs, st_qkv);
      if (o.emulated_dcp > 1) {
        emulated_dcp_gather_q(rs, attn, T);
        launch_paged_attention(attention_args(rs, r, attn, li, T, rs.xn, rs.proj), rs.stream);
      } else {
        launch_paged_attention(attention_args(rs, r, attn, li, T, rs.qkv, rs.attn), rs.stream);
      }
      mark(rs, st_attention);
      project_o(rs, r, attn, li, T);
      mark(rs, st_o_proj);
    });
  }
  if (attn == parallel_mode::tp && P > 1) {
    all_reduce(&rank_state::proj, T * c.hidden);
    mark_all(st_collectives);
  }
}

// Layer li's TP attention with dcp > 1 (virtual ranks; gpu_runtime.hpp), as the host runtime
// computes it (host_runtime.hpp): every rank its q heads and its KV head's k/v (K/V stored
// only where the token's page lies: paged_tokens), the DCP set's q heads gathered on every
// member, each member's part over the pages it holds (partial output + LSE), and each rank's
// merge of the set's parts of its own heads into attn; then o_proj as without dcp. How the
// parts travel, and why so: device_collectives.cu.
void gpu_runtime::impl::dcp_attention(int64_t li, int64_t T) {
  const parallel_mode tp = parallel_mode::tp;
  each_rank([&](int r, rank_state& rs) {
    project_qkv(rs, r, tp, li, T);
    mark(rs, st_qkv);
  });
  device_dcp_gather_q(T);
  mark_all(st_collectives);
  each_rank([&](int r, rank_state& rs) {
    launch_paged_attention(attention_args(rs, r, tp, li, T, rs.dcp_q, rs.dcp_out), rs.stream);
    mark(rs, st_attention);
  });
  device_dcp_merge(T);
  mark_all(st_collectives);
  each_rank([&](int r, rank_state& rs) {
    project_o(rs, r, tp, li, T);
    mark(rs, st_o_proj);
  });
}

// options.emulated_dcp: the q of the rank's DCP set as the all-gather would leave it, [T,
// dcp x hq heads] in xn: dcp copies of the rank's own hq heads (the values do not change the
// attention's work).
void gpu_runtime::impl::emulated_dcp_gather_q(rank_state& rs, parallel_mode attn, int64_t T) {
  const int64_t dcp = o.emulated_dcp, width = q_heads_local(attn) * c.head_dim;
  for (int64_t j = 0; j < dcp; ++j)
    MOEBIUS_CUDA_CHECK(cudaMemcpy2DAsync(rs.xn + j * width, static_cast<size_t>(dcp * width) * 4,
                                         rs.qkv, static_cast<size_t>(qkv_ld) * 4,
                                         static_cast<size_t>(width) * 4, static_cast<size_t>(T),
                                         cudaMemcpyDeviceToDevice, rs.stream));
}

// The first TP column of rank r's q heads and its first KV head (EP: 0, all heads).
std::pair<int64_t, int64_t> gpu_runtime::impl::head_slice(parallel_mode attn, int r) const {
  const int64_t q0 = attn == parallel_mode::ep ? 0 : r * q_heads_local(attn);
  const int64_t kv0 = attn == parallel_mode::ep ? 0 : kv.tp_slice_of_rank(r) * kv_heads_local(attn);
  return {q0, kv0};
}

// Rank r's q, k, v rows of layer li (input norm, GEMMs over row slices of the whole fused
// weight: no second copy), q/k norms and RoPE, and K/V appended to its pages: qkv holds
// [T, q | k | v] of this rank's heads.
void gpu_runtime::impl::project_qkv(rank_state& rs, int r, parallel_mode attn, int64_t li,
                                    int64_t T) {
  const int64_t H = c.hidden, D = c.head_dim;
  const int64_t ds = moebius::dtype_bytes(o.dense_dtype);
  const dtype dd = o.dense_dtype;
  const float eps = static_cast<float>(c.rms_eps);
  const int64_t hq = q_heads_local(attn), hkv = kv_heads_local(attn);
  const auto& l = rs.layers[static_cast<size_t>(li)];
  rmsnorm_args n{rs.h, H, rs.xn, H, l.ln1, T, H, 1, 0, eps};
  launch_rmsnorm(n, rs.stream);
  launch_convert({rs.xn, dtype::fp32, rs.xd, dd, T * H}, rs.stream);
  // q, k, v of this rank's heads: row slices of the whole fused weight.
  const auto [q0, kv0] = head_slice(attn, r);
  struct part {
    int64_t w_row, rows, out_col;
  };
  const part parts[3] = {{q0 * D, hq * D, 0},
                         {(c.num_q_heads + kv0) * D, hkv * D, hq * D},
                         {(c.num_q_heads + c.num_kv_heads + kv0) * D, hkv * D, (hq + hkv) * D}};
  for (const part& pt : parts) {
    linear_args a;
    a.x = rs.xd;
    a.ldx = H;
    a.w = l.qkv + pt.w_row * H * ds;
    a.ldw = H;
    a.y = rs.qkv + pt.out_col;
    a.ldy = qkv_ld;
    a.tokens = T;
    a.out_features = pt.rows;
    a.in_features = H;
    a.type = dd;
    linear(rs.blas, a, rs.stream);
  }
  float* q = rs.qkv;
  float* k = rs.qkv + hq * D;
  float* v = rs.qkv + (hq + hkv) * D;
  launch_rmsnorm({q, qkv_ld, q, qkv_ld, l.q_norm, T * hq, D, hq, D, eps}, rs.stream);
  launch_rmsnorm({k, qkv_ld, k, qkv_ld, l.k_norm, T * hkv, D, hkv, D, eps}, rs.stream);
  launch_rope({q, qkv_ld, T, hq, D, in_pos(rs, attn), in_num(rs, attn), c.rope_theta}, rs.stream);
  launch_rope({k, qkv_ld, T, hkv, D, in_pos(rs, attn), in_num(rs, attn), c.rope_theta}, rs.stream);
  kv_append_args ka;
  ka.k = k;
  ka.v = v;
  ka.stride = qkv_ld;
  ka.heads = hkv;
  ka.head0 = 0;
  ka.pool = rs.kv_pool;
  ka.geometry = kv;
  ka.mode = attn;
  ka.layer = li;
  ka.tok = tokens_of(rs, r, attn, T);  // with dcp > 1 only the tokens whose page it holds
  launch_kv_append(ka, rs.stream);
}

// Rank r's o_proj of the attention output: its columns (its heads) of the whole weight, a
// partial sum over its heads in TP, the whole product in EP, into proj.
void gpu_runtime::impl::project_o(rank_state& rs, int r, parallel_mode attn, int64_t li,
                                  int64_t T) {
  const int64_t H = c.hidden, D = c.head_dim;
  const int64_t ds = moebius::dtype_bytes(o.dense_dtype);
  const dtype dd = o.dense_dtype;
  const int64_t hq = q_heads_local(attn);
  const auto& l = rs.layers[static_cast<size_t>(li)];
  const int64_t q0 = head_slice(attn, r).first;
  // emulated_dcp: all dcp x hq heads' partial outputs (in proj) converted, standing in for the
  // merge of the exchanged partials; o_proj reads the rank's own hq of each row.
  const int64_t dcp = o.emulated_dcp;
  launch_convert({dcp > 1 ? rs.proj : rs.attn, dtype::fp32, rs.xd, dd, T * dcp * hq * D},
                 rs.stream);
  linear_args a;  // o_proj: this rank's columns (its heads) of the whole weight
  a.x = rs.xd;
  a.ldx = dcp * hq * D;
  a.w = l.o + q0 * D * ds;
  a.ldw = c.num_q_heads * D;
  a.y = rs.proj;
  a.ldy = H;
  a.tokens = T;
  a.out_features = H;
  a.in_features = hq * D;
  a.type = dd;
  linear(rs.blas, a, rs.stream);
}

}  // namespace mini_engine::gpu
