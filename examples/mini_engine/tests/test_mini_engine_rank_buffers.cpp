// The GPU runtime's per-rank buffer layout (gpu/rank_buffers.hpp), on the host: every region
// aligned, as long as asked (at least one element), inside num_bytes() and overlapping no
// other, for random sizes.

#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

#include "catch.hpp"
#include "rank_buffers.hpp"

using namespace mini_engine::gpu;

namespace {

std::vector<buffer_region> regions_of(const rank_buffer_layout& l) {
  std::vector<buffer_region> r = {l.cublas_workspace,
                                  l.embed,
                                  l.final_norm,
                                  l.lm_head,
                                  l.h,
                                  l.xn,
                                  l.xd,
                                  l.qkv,
                                  l.attn,
                                  l.proj,
                                  l.router_logits,
                                  l.topk_ids,
                                  l.topk_w,
                                  l.packed,
                                  l.gathered,
                                  l.moe_out,
                                  l.recv,
                                  l.logits,
                                  l.next,
                                  l.next_value,
                                  l.inputs[0],
                                  l.inputs[1],
                                  l.keys,
                                  l.values,
                                  l.keys_sorted,
                                  l.values_sorted,
                                  l.expert_info,
                                  l.pair_row,
                                  l.x_perm,
                                  l.gu,
                                  l.act,
                                  l.y,
                                  l.ptr_w13,
                                  l.ptr_x,
                                  l.ptr_gu,
                                  l.ptr_w2,
                                  l.ptr_act,
                                  l.ptr_y,
                                  l.sort_temp,
                                  l.overflow,
                                  l.attention_workspace};
  if (l.dequant_w13.bytes > 0) {
    r.push_back(l.dequant_w13);
    r.push_back(l.dequant_w2);
  }
  if (l.reduce_scratch.bytes > 0) r.push_back(l.reduce_scratch);
  if (l.dcp_q.bytes > 0) {
    r.push_back(l.dcp_q);
    r.push_back(l.dcp_out);
    r.push_back(l.dcp_lse);
  }
  for (const auto& x : l.layers)
    for (const buffer_region& b : {x.qkv, x.o, x.router, x.ln1, x.ln2, x.q_norm, x.k_norm})
      r.push_back(b);
  return r;
}

}  // namespace

TEST_CASE("rank_buffers: regions aligned, as long as asked, disjoint, inside the buffer",
          "[rank_buffers]") {
  std::mt19937_64 rng(20261201);
  auto pick = [&](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  for (int trial = 0; trial < 200; ++trial) {
    rank_buffer_sizes s;
    s.num_layers = pick(1, 6);
    s.hidden = pick(1, 300);
    s.head_dim = 2 * pick(1, 64);
    s.q_dim = s.head_dim * pick(1, 8);
    s.qkv_rows = s.q_dim + 2 * s.head_dim;
    s.num_experts = pick(1, 16);
    s.top_k = pick(1, s.num_experts);
    s.vocab = pick(1, 500);
    s.dense_bytes = pick(0, 1) ? 2 : 4;
    s.expert_bytes = pick(0, 1) ? 2 : 4;
    s.max_tokens = pick(1, 40);
    s.gathered_rows = s.max_tokens * pick(1, 4);
    s.packed_row_bytes = pick(1, 1000);
    s.input_count = pick(1, 5000);
    s.max_pairs = s.gathered_rows * s.top_k;
    s.max_tiles = pick(0, 50);
    s.max_rows = s.max_tiles * pick(1, 64);
    s.max_inter = pick(1, 100);
    s.sort_temp_bytes = pick(0, 10000);
    s.attention_floats = pick(0, 3000);
    if (pick(0, 1)) {
      s.dequant_w13_bytes = pick(1, 10000);
      s.dequant_w2_bytes = pick(1, 10000);
    }
    s.cublas_workspace_bytes = pick(1, 1 << 20);
    if (pick(0, 1)) s.reduce_scratch_floats = s.max_tokens * s.hidden;  // virtual ranks
    if (s.reduce_scratch_floats > 0 && pick(0, 1)) {  // dcp > 1 (virtual ranks only)
      const int64_t set_heads = pick(1, 8);
      s.dcp_head_floats = s.max_tokens * set_heads * s.head_dim;
      s.dcp_lse_floats = s.max_tokens * set_heads;
    }
    const rank_buffer_layout l = make_rank_buffer_layout(s);
    std::vector<buffer_region> r = regions_of(l);
    REQUIRE(static_cast<int64_t>(r.size()) == 41 + (s.dequant_w13_bytes > 0 ? 2 : 0) +
                                                  (s.reduce_scratch_floats > 0 ? 1 : 0) +
                                                  (s.dcp_head_floats > 0 ? 3 : 0) +
                                                  7 * s.num_layers);
    // The DCP buffers come after everything: without them every other region lies where it
    // lies (dcp = 1 lays the buffer out as before dcp existed).
    if (s.dcp_head_floats > 0) {
      rank_buffer_sizes without = s;
      without.dcp_head_floats = without.dcp_lse_floats = 0;
      const rank_buffer_layout l0 = make_rank_buffer_layout(without);
      CHECK(l.dcp_q.bytes == s.dcp_head_floats * 4);
      CHECK(l.dcp_out.bytes == s.dcp_head_floats * 4);
      CHECK(l.dcp_lse.bytes == s.dcp_lse_floats * 4);
      CHECK(l.dcp_q.offset >= l0.num_bytes());
      CHECK(l.reduce_scratch.offset == l0.reduce_scratch.offset);
      CHECK(l.attention_workspace.offset == l0.attention_workspace.offset);
      CHECK(l.h.offset == l0.h.offset);
    }
    // Virtual ranks' scratch comes last but for the DCP buffers: every other region lies
    // where it lies without it.
    if (s.reduce_scratch_floats > 0) {
      rank_buffer_sizes without = s;
      without.reduce_scratch_floats = 0;
      without.dcp_head_floats = without.dcp_lse_floats = 0;
      const rank_buffer_layout l0 = make_rank_buffer_layout(without);
      CHECK(l.reduce_scratch.bytes == s.reduce_scratch_floats * 4);
      CHECK(l.reduce_scratch.offset == l0.num_bytes());
      CHECK(l.attention_workspace.offset == l0.attention_workspace.offset);
      CHECK(l.h.offset == l0.h.offset);
    }
    for (const buffer_region& b : r) {
      CHECK(b.offset % rank_buffer_layout::alignment == 0);
      CHECK(b.bytes >= 1);
      CHECK(b.offset + b.bytes <= l.num_bytes());
    }
    std::sort(r.begin(), r.end(),
              [](const buffer_region& a, const buffer_region& b) { return a.offset < b.offset; });
    for (size_t i = 1; i < r.size(); ++i) CHECK(r[i - 1].offset + r[i - 1].bytes <= r[i].offset);
    // The sizes the runtime asked for (a few; the rest follow the same rule).
    CHECK(l.h.bytes == s.max_tokens * s.hidden * 4);
    CHECK(l.gathered.bytes == s.gathered_rows * s.packed_row_bytes);
    CHECK(l.sort_temp.bytes == std::max<int64_t>(s.sort_temp_bytes, 1));
    CHECK(l.attention_workspace.bytes == std::max<int64_t>(s.attention_floats, 1) * 4);
    CHECK(l.layers[0].qkv.bytes == s.qkv_rows * s.hidden * s.dense_bytes);
    CHECK(l.ptr_y.bytes == std::max<int64_t>(s.max_tiles, 1) * static_cast<int64_t>(sizeof(void*)));
    CHECK(l.num_bytes() % rank_buffer_layout::alignment == 0);
  }
}
