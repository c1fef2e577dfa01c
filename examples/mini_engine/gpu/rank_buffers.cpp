#include "rank_buffers.hpp"

#include <algorithm>

namespace mini_engine::gpu {

namespace {

// Places regions one after another, each aligned and at least one element long (as one
// cudaMalloc of max(count, 1) elements each was).
struct bump {
  int64_t next = 0;
  buffer_region take(int64_t count, int64_t elem_bytes) {
    const int64_t a = rank_buffer_layout::alignment;
    buffer_region r;
    r.offset = (next + a - 1) / a * a;
    r.bytes = std::max<int64_t>(count, 1) * elem_bytes;
    next = r.offset + r.bytes;
    return r;
  }
};

}  // namespace

rank_buffer_layout make_rank_buffer_layout(const rank_buffer_sizes& s) {
  constexpr int64_t f32 = 4, i32 = 4, byte = 1, ptr = sizeof(void*);
  const int64_t T = s.max_tokens, G = s.gathered_rows, H = s.hidden, D = s.head_dim;
  rank_buffer_layout l;
  bump b;
  l.cublas_workspace = b.take(s.cublas_workspace_bytes, byte);
  l.layers.resize(static_cast<size_t>(s.num_layers));
  for (auto& x : l.layers) {
    x.qkv = b.take(s.qkv_rows * H * s.dense_bytes, byte);
    x.o = b.take(H * s.q_dim * s.dense_bytes, byte);
    x.router = b.take(s.num_experts * H, f32);
    x.ln1 = b.take(H, f32);
    x.ln2 = b.take(H, f32);
    x.q_norm = b.take(D, f32);
    x.k_norm = b.take(D, f32);
  }
  l.embed = b.take(s.vocab * H * s.dense_bytes, byte);
  l.final_norm = b.take(H, f32);
  l.lm_head = b.take(s.vocab * H * s.dense_bytes, byte);

  l.h = b.take(T * H, f32);
  l.xn = b.take(T * H, f32);
  l.xd = b.take(T * std::max(H, s.q_dim) * s.dense_bytes, byte);
  l.qkv = b.take(T * s.qkv_rows, f32);
  l.attn = b.take(T * s.q_dim, f32);
  l.proj = b.take(T * H, f32);
  l.router_logits = b.take(T * s.num_experts, f32);
  l.topk_ids = b.take(T * s.top_k, i32);
  l.topk_w = b.take(T * s.top_k, f32);
  l.packed = b.take(T * s.packed_row_bytes, byte);
  l.gathered = b.take(G * s.packed_row_bytes, byte);
  l.moe_out = b.take(G * H, f32);
  l.recv = b.take(G * H, f32);
  l.logits = b.take(T * s.vocab, f32);
  l.next = b.take(T, i32);
  l.next_value = b.take(T, f32);
  for (buffer_region& in : l.inputs) in = b.take(s.input_count, i32);

  l.keys = b.take(s.max_pairs, i32);
  l.values = b.take(s.max_pairs, i32);
  l.keys_sorted = b.take(s.max_pairs, i32);
  l.values_sorted = b.take(s.max_pairs, i32);
  l.expert_info = b.take(3 * s.num_experts + 1, i32);
  l.pair_row = b.take(s.max_pairs, i32);
  l.x_perm = b.take(s.max_rows * H * s.expert_bytes, byte);
  l.gu = b.take(s.max_rows * 2 * s.max_inter, f32);
  l.act = b.take(s.max_rows * s.max_inter * s.expert_bytes, byte);
  l.y = b.take(s.max_rows * H, f32);
  l.ptr_w13 = b.take(s.max_tiles, ptr);
  l.ptr_x = b.take(s.max_tiles, ptr);
  l.ptr_gu = b.take(s.max_tiles, ptr);
  l.ptr_w2 = b.take(s.max_tiles, ptr);
  l.ptr_act = b.take(s.max_tiles, ptr);
  l.ptr_y = b.take(s.max_tiles, ptr);
  l.sort_temp = b.take(s.sort_temp_bytes, byte);
  l.overflow = b.take(1, i32);
  if (s.dequant_w13_bytes > 0) {  // fp8 experts only
    l.dequant_w13 = b.take(s.dequant_w13_bytes, byte);
    l.dequant_w2 = b.take(s.dequant_w2_bytes, byte);
  }
  l.attention_workspace = b.take(s.attention_floats, f32);
  if (s.reduce_scratch_floats > 0)  // virtual ranks only: last, so nothing else moves
    l.reduce_scratch = b.take(s.reduce_scratch_floats, f32);
  if (s.dcp_head_floats > 0) {  // dcp > 1 only: after everything, so nothing else moves
    l.dcp_q = b.take(s.dcp_head_floats, f32);
    l.dcp_out = b.take(s.dcp_head_floats, f32);
    l.dcp_lse = b.take(s.dcp_lse_floats, f32);
  }
  l.total_bytes = (b.next + rank_buffer_layout::alignment - 1) / rank_buffer_layout::alignment *
                  rank_buffer_layout::alignment;
  return l;
}

}  // namespace mini_engine::gpu
