// One forward pass enqueued on every rank's stream: the embedding, the layers (attention
// block, MoE block) with the activation hand-off wherever a hybrid step's mode changes, the
// LM head. The same code runs eagerly and under capture (graph_cache.cu).

#include <moebius/error.hpp>
#include <utility>

#include "runtime_impl.hpp"

namespace mini_engine::gpu {

using moebius::dtype;
using moebius::errc;
using moebius::parallel_mode;

// A pure pass: every layer's attention in `attn`, T rows per rank (graphs, static steps).
void gpu_runtime::impl::forward(parallel_mode attn, moebius::arena_cursor cursor, int64_t T,
                                bool optimistic) {
  pass p;
  p.attn.assign(static_cast<size_t>(c.num_layers), attn);
  p.cursor = cursor;
  p.rows[mode_index(attn)] = T;
  forward(p, optimistic);
}

// The whole pass: embedding, the layers with a hand-off wherever the mode changes, LM head.
void gpu_runtime::impl::forward(const pass& ps, bool optimistic) {
  MOEBIUS_CHECK(static_cast<int64_t>(ps.attn.size()) == c.num_layers, errc::internal,
                "gpu_runtime: a pass of ", ps.attn.size(), " layers");
  embed(ps);
  for (int64_t li = 0; li < c.num_layers; ++li) {
    if (li > 0 && ps.attn[static_cast<size_t>(li)] != ps.attn[static_cast<size_t>(li - 1)])
      hand_off(ps.attn[static_cast<size_t>(li - 1)], ps.attn[static_cast<size_t>(li)], ps);
    layer(ps, li, optimistic);
    record_layer_done(li);
  }
  lm_head(ps);
}

// A step asked for layer events (step_options::layer_events): each rank's stream records
// layer li's event after its work of the layer (the per-layer graphs of virtual ranks fork
// back to every rank's stream after each launch); an advance beside the step waits on them.
void gpu_runtime::impl::record_layer_done(int64_t li) {
  if (!record_events) return;
  each_rank([&](int, rank_state& rs) {
    MOEBIUS_CUDA_CHECK(cudaEventRecord(rs.layer_done[static_cast<size_t>(li)], rs.stream));
  });
}

// The embedding, in the first layer's mode (its input block and rows).
void gpu_runtime::impl::embed(const pass& ps) {
  const parallel_mode m0 = ps.attn.front();
  const int64_t T = ps.rows[mode_index(m0)];
  each_rank([&](int, rank_state& rs) {
    launch_embedding(
        {rs.embed, o.dense_dtype, c.vocab, c.hidden, in_ids(rs, m0), T, in_num(rs, m0), rs.h},
        rs.stream);
    mark(rs, st_embed);
  });
}

// Layer li: attention in ps.attn[li] over that mode's input block and rows, experts in
// ps.cursor's mode of the layer. Reads and writes only buffers fixed at construction (the
// residual stream h in the mode's token layout), so a capture replays for any step whose
// inputs sit in the same input block.
void gpu_runtime::impl::layer(const pass& ps, int64_t li, bool optimistic) {
  attention(ps, li);
  moe(ps, li, optimistic);
}

// The activation hand-off between two layers of different attention modes (hybrid steps):
// the residual stream h goes from `from`'s token layout to `to`'s, through the map of
// `to`'s input block (step() fills it).
//   TP -> EP: every rank holds every token; it keeps its own sequences' rows.
//   EP -> TP: every owner's rows are all-gathered ([P, T_ep] blocks in recv), then each
//             token's row is picked out in item order.
void gpu_runtime::impl::hand_off(parallel_mode from, parallel_mode to, const pass& p) {
  const int64_t H = c.hidden, T_to = p.rows[mode_index(to)];
  const bool gather = from == parallel_mode::ep && P > 1;
  if (gather) {
    hand_off_all_gather(p.rows[mode_index(from)]);
    mark_all(st_collectives);
  }
  each_rank([&](int, rank_state& rs) {
    launch_gather_rows({gather ? rs.recv : rs.h, in_map(rs, to), in_num(rs, to), rs.xn, T_to, H},
                       rs.stream);
    MOEBIUS_CUDA_CHECK(cudaMemcpyAsync(rs.h, rs.xn, static_cast<size_t>(T_to * H) * 4,
                                       cudaMemcpyDeviceToDevice, rs.stream));
    mark(rs, st_hand_off);
  });
}

// Final norm, LM head and argmax, in the last layer's mode.
void gpu_runtime::impl::lm_head(const pass& ps) {
  const int64_t H = c.hidden, ds = moebius::dtype_bytes(o.dense_dtype);
  const dtype dd = o.dense_dtype;
  const float eps = static_cast<float>(c.rms_eps);
  const parallel_mode attn = ps.attn.back();
  const int64_t T = ps.rows[mode_index(attn)];
  each_rank([&](int r, rank_state& rs) {
    const auto [v0, vn] = vocab_slice(attn, r);
    launch_rmsnorm({rs.h, H, rs.xn, H, rs.final_norm, T, H, 1, 0, eps}, rs.stream);
    launch_convert({rs.xn, dtype::fp32, rs.xd, dd, T * H}, rs.stream);
    linear_args a;
    a.x = rs.xd;
    a.ldx = H;
    a.w = rs.lm_head + v0 * H * ds;
    a.ldw = H;
    a.y = rs.logits;
    a.ldy = vn;
    a.tokens = T;
    a.out_features = vn;
    a.in_features = H;
    a.type = dd;
    linear(rs.blas, a, rs.stream);
    launch_argmax({rs.logits, T, vn, rs.next, rs.next_value}, rs.stream);
    mark(rs, st_lm_head);
  });
}

}  // namespace mini_engine::gpu
