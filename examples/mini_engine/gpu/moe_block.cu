// A layer's MoE block (gpu_runtime.hpp): the router where the token is, the dispatch (EP
// attention: the packed rows all-gathered), each rank's experts over the pairs routed to them
// (permutation, fp8 dequantization, batched GEMMs over fixed-size tiles: gemm.hpp), and the
// combine (TP: all-reduce; EP: partial sums back to the tokens' owners).
//
// Expert capacity. Eager steps size the expert tiles for the worst case (every token's
// choices among one rank's experts). A graph would then pay that worst case every step (EP at
// 512 tokens, top-8 of 128 on 2 ranks: 4x the rows it needs), so graphs are sized for 1.25x
// the expected pairs per rank; a step whose routing needs more raises a device flag, and the
// step is rerun eagerly (same inputs, same K/V written again): correct always, fast when the
// routing is balanced. overflow_reruns() counts those.

#include <algorithm>

#include "runtime_impl.hpp"

namespace mini_engine::gpu {

using moebius::dtype;
using moebius::errc;
using moebius::parallel_mode;

// `optimistic` (graphs): capacity for 1.25x the expected pairs (moe_pair_capacity); a step
// whose routing needs more sets the overflow flag and is rerun eagerly with the worst case.
gpu_runtime::impl::moe_shape gpu_runtime::impl::moe_shape_of(parallel_mode layer_mode, int rank,
                                                             int64_t src_tokens,
                                                             bool optimistic) const {
  moe_shape s{};
  if (layer_mode == parallel_mode::ep) {
    s.num_local = c.num_experts / P;
    s.first = rank * s.num_local;
    s.inter = c.intermediate;
  } else {
    s.num_local = c.num_experts;
    s.first = 0;
    s.inter = c.intermediate / P;
  }
  const int64_t pairs =
      moe_pair_capacity(src_tokens, c.top_k, c.num_experts, s.num_local, optimistic);
  s.tile_rows = std::min<int64_t>(moe_tile_rows(pairs, s.num_local) * o.moe_tile_scale, 1024);
  s.max_tiles = moe_max_tiles(pairs, s.num_local, s.tile_rows);
  return s;
}

// Layer li's MoE, its experts in ps.cursor's mode of the layer: the router where the tokens
// are, the dispatch (EP attention with P > 1: every rank gets every rank's packed tokens),
// this rank's experts, the combine. `optimistic` (graphs): expert tiles for 1.25x the
// expected pairs (moe_shape_of).
void gpu_runtime::impl::moe(const pass& ps, int64_t li, bool optimistic) {
  const parallel_mode attn = ps.attn[static_cast<size_t>(li)];
  const int64_t T = ps.rows[mode_index(attn)];
  const parallel_mode lm = moebius::arena_geometry::mode_of(ps.cursor, li);
  route(li, attn, T);
  const bool dispatch = attn == parallel_mode::ep && P > 1;
  if (dispatch) {  // every rank gets every rank's packed tokens
    dispatch_all_gather(T);
    mark_all(st_collectives);
  }
  run_experts(li, lm, dispatch, dispatch ? P * T : T, optimistic);
  combine(attn, dispatch, T);
}

// The attention block's output joins the residual stream; post-attention norm, router GEMM
// (fp32: the same choices as the reference), top-k, and each token packed with its top-k
// (moe_pack) into `packed`.
void gpu_runtime::impl::route(int64_t li, parallel_mode attn, int64_t T) {
  const int64_t H = c.hidden, E = c.num_experts, K = c.top_k;
  const float eps = static_cast<float>(c.rms_eps);
  each_rank([&](int, rank_state& rs) {
    const auto& l = rs.layers[static_cast<size_t>(li)];
    launch_residual_add({rs.h, rs.proj, 1, 0, T, H}, rs.stream);
    launch_rmsnorm({rs.h, H, rs.xn, H, l.ln2, T, H, 1, 0, eps}, rs.stream);
    linear_args a;
    a.x = rs.xn;
    a.ldx = H;
    a.w = l.router;
    a.ldw = H;
    a.y = rs.router_logits;
    a.ldy = E;
    a.tokens = T;
    a.out_features = E;
    a.in_features = H;
    a.type = dtype::fp32;
    linear(rs.blas, a, rs.stream);
    launch_router_topk({rs.router_logits, T, E, K, in_num(rs, attn), rs.topk_ids, rs.topk_w,
                        c.norm_topk_prob},
                       rs.stream);
    moe_pack_args pk;
    pk.x = rs.xn;
    pk.ids = rs.topk_ids;
    pk.weights = rs.topk_w;
    pk.dst = row_layout;
    pk.dst.tokens = T;
    pk.rows = rs.packed;
    pk.hidden = H;
    pk.type = ct;
    launch_moe_pack(pk, rs.stream);
    mark(rs, st_router);
  });
}

// This rank's experts of layer li (in the arena's `lm` view) over the src_tokens packed rows
// (`gathered` after a dispatch, else `packed`): permutation into expert tiles, fp8
// dequantization of the touched experts, the batched GEMMs, and each token's weighted sum
// (moe_combine) into moe_out.
void gpu_runtime::impl::run_experts(int64_t li, parallel_mode lm, bool dispatch, int64_t src_tokens,
                                    bool optimistic) {
  const int64_t H = c.hidden;
  each_rank([&](int r, rank_state& rs) {
    moe_tokens src = row_layout;
    src.rows = dispatch ? rs.gathered : rs.packed;
    src.tokens = src_tokens;
    const moe_shape s = moe_shape_of(lm, r, src_tokens, optimistic);
    moe_plan p = rs.moe;
    p.num_local = s.num_local;
    p.first_expert = s.first;
    p.tile_rows = s.tile_rows;
    p.max_tiles = s.max_tiles;
    p.inter = s.inter;
    auto arena_at = [&](moebius::weight_tensor t) {
      return rs.arena + arena.tensor_base(lm, li, t);
    };
    // fp8: the tile map points the GEMMs at the scratch, which the dequantization fills
    // (after the permutation has counted each expert's tokens) for the touched experts.
    p.w13 = fp8 ? rs.dq_w13 : arena_at(moebius::weight_tensor::w13);
    p.w2 = fp8 ? rs.dq_w2 : arena_at(moebius::weight_tensor::w2);
    launch_moe_permute(p, src, rs.stream);
    mark(rs, st_permute);
    if (fp8) {
      dequant_fp8_args dq;
      dq.out_type = ct;
      dq.experts = s.num_local;
      dq.block_n = c.fp8_block;
      dq.block_k = c.fp8_block;
      dq.counts = p.expert_info + p.num_local;  // moe_tile_map's per-expert counts
      dq.w = reinterpret_cast<const uint8_t*>(arena_at(moebius::weight_tensor::w13));
      dq.scale = reinterpret_cast<const float*>(arena_at(moebius::weight_tensor::w13_scale));
      dq.out = rs.dq_w13;
      dq.rows = 2 * s.inter;
      dq.cols = H;
      launch_dequant_fp8(dq, rs.stream);
      dq.w = reinterpret_cast<const uint8_t*>(arena_at(moebius::weight_tensor::w2));
      dq.scale = reinterpret_cast<const float*>(arena_at(moebius::weight_tensor::w2_scale));
      dq.out = rs.dq_w2;
      dq.rows = H;
      dq.cols = s.inter;
      launch_dequant_fp8(dq, rs.stream);
      mark(rs, st_dequant);
    }
    expert_gemms(rs.blas, p, rs.stream);
    mark(rs, st_experts);
    moe_combine_args cb;
    cb.y = p.y;
    cb.pair_row = p.pair_row;
    cb.src = src;
    cb.out = rs.moe_out;
    cb.hidden = H;
    launch_moe_combine(cb, rs.stream);
    mark(rs, st_combine);
  });
}

// The partial sums back to where the tokens are, added to the residual stream: TP
// all-reduces; EP without a dispatch (P = 1) has them all; EP with one sends each owner its
// tokens' partial sums and sums them there in rank order.
void gpu_runtime::impl::combine(parallel_mode attn, bool dispatch, int64_t T) {
  const int64_t H = c.hidden;
  if (attn == parallel_mode::tp) {
    if (P > 1) {
      all_reduce(&rank_state::moe_out, T * H);
      mark_all(st_collectives);
    }
    each_rank([&](int, rank_state& rs) {
      launch_residual_add({rs.h, rs.moe_out, 1, 0, T, H}, rs.stream);
      mark(rs, st_combine);
    });
  } else if (!dispatch) {
    each_rank([&](int, rank_state& rs) {
      launch_residual_add({rs.h, rs.moe_out, 1, 0, T, H}, rs.stream);
      mark(rs, st_combine);
    });
  } else {  // combine: partial sums back to the tokens' owners, summed in rank order
    const size_t n = static_cast<size_t>(T * H);
    combine_exchange(T);
    mark_all(st_collectives);
    each_rank([&](int r, rank_state& rs) {
      MOEBIUS_CUDA_CHECK(cudaMemcpyAsync(rs.recv + r * T * H, rs.moe_out + r * T * H, n * 4,
                                         cudaMemcpyDeviceToDevice, rs.stream));
      launch_residual_add({rs.h, rs.recv, P, T * H, T, H}, rs.stream);
      mark(rs, st_combine);
    });
  }
}

}  // namespace mini_engine::gpu
