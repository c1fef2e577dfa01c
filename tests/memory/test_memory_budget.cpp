// Memory budget: Qwen3-235B-A22B at P=8 against hand-computed byte counts, a padded arena,
// and validation.

#include <iostream>
#include <sstream>
#include <string>

#include "moebius/error.hpp"
#include "moebius/layout/arena_geometry.hpp"
#include "moebius/memory/memory_budget.hpp"
#include "moebius/plan/weight_plan.hpp"
#include "support/catch.hpp"

using namespace moebius;

namespace {
constexpr int64_t GiB = int64_t{1} << 30;
}

TEST_CASE("memory_budget: attention and dense bytes of Qwen3-235B", "[memory_budget]") {
  const attention_shape a = qwen3_235b_a22b_attention();
  // Per layer: q and o 4096·64·128·2 = 67,108,864 each, k and v 4096·4·128·2 = 4,194,304
  // each, q/k norms 2·128·2 = 512.
  CHECK(attention_bytes_whole(a) == int64_t{94} * (2 * 67'108'864 + 2 * 4'194'304 + 512));
  CHECK(attention_bytes_whole(a) == 13'405'043'712);
  // Static TP at P=8: q/o sliced by 8; 4 kv heads on 8 ranks: one head per rank.
  CHECK(attention_bytes_tp_rank(a, 8) == int64_t{94} * (2 * 8'388'608 + 2 * 1'048'576 + 512));
  CHECK(attention_bytes_tp_rank(a, 8) == 1'774'238'720);
  CHECK(attention_bytes_tp_rank(a, 4) == int64_t{94} * (2 * 16'777'216 + 2 * 1'048'576 + 512));
  // Embedding and lm_head 151936·4096·2 each; router 128·4096·2 and 2 norms of 4096·2 per
  // layer; final norm.
  const int64_t dense = int64_t{2} * 1'244'659'712 + 94 * (1'048'576 + 16'384) + 8'192;
  CHECK(dense_bytes(qwen3_235b_a22b_dense(), a) == dense);
  CHECK(dense == 2'589'433'856);
  dense_shape tied = qwen3_235b_a22b_dense();
  tied.tied_embeddings = true;
  CHECK(dense_bytes(tied, a) == dense - 1'244'659'712);
  CHECK(dense_bytes(dense_shape{}, a) == 0);
}

TEST_CASE("memory_budget: Qwen3-235B-A22B at P=8", "[memory_budget]") {
  const arena_geometry g = make_arena_geometry(qwen3_235b_a22b(), 8);
  REQUIRE(g.layer_bytes_per_rank() == 603'979'776);
  REQUIRE(g.num_slots() == 95);

  // Device-resident descriptors: both weight plans cached, plus room for one KV round of
  // 2^20 page copies.
  const int64_t weight_ops = max_ops_per_rank(plan_weight_switch(g, {0}, {94})) +
                             max_ops_per_rank(plan_weight_switch(g, {94}, {0}));
  REQUIRE(weight_ops > 0);
  switch_footprint f;
  f.descriptor_ops_per_rank = weight_ops + (int64_t{1} << 20);
  f.barrier_flag_slots = 2 * 8;  // one per peer, two epochs
  f.flag_bytes = 128;
  f.scratch_bytes = 0;
  const int64_t kv_pool = 40 * GiB;
  const memory_budget b = make_memory_budget(g, qwen3_235b_a22b_attention(),
                                             qwen3_235b_a22b_dense(), kv_pool, f);
  std::cout << b;

  CHECK(b.expert_bytes == 94 * int64_t{603'979'776});
  CHECK(b.expert_bytes == 56'774'098'944);
  CHECK(b.arena_bytes == 95 * int64_t{603'979'776});
  CHECK(b.spare_slot_bytes == 603'979'776);
  CHECK(b.spare_slot_bytes * 95 == b.arena_bytes);  // exactly 1/(L+1) of the arena
  CHECK(b.spare_fraction_of_arena() == Catch::Approx(1.0 / 95));
  CHECK(b.padding_bytes == 0);
  CHECK(b.attention_bytes == 13'405'043'712);
  CHECK(b.attention_tp_view_bytes == 0);
  CHECK(b.static_tp_attention_bytes == 1'774'238'720);
  CHECK(b.dense_bytes == 2'589'433'856);
  CHECK(b.kv_pool_bytes == kv_pool);
  CHECK(sizeof(copy_op) == 64);
  CHECK(b.descriptor_bytes == f.descriptor_ops_per_rank * 64);
  CHECK(b.flag_bytes == 16 * 128);
  CHECK(b.scratch_bytes == 0);

  const int64_t overhead = 603'979'776 + f.descriptor_ops_per_rank * 64 + 16 * 128;
  CHECK(b.switching_overhead_bytes() == overhead);
  const int64_t static_ep = 56'774'098'944 + 13'405'043'712 + 2'589'433'856 + kv_pool;
  const int64_t static_tp = 56'774'098'944 + 1'774'238'720 + 2'589'433'856 + kv_pool;
  CHECK(b.static_ep_total_bytes() == static_ep);
  CHECK(b.static_tp_total_bytes() == static_tp);
  CHECK(b.total_bytes() == static_ep + overhead);
  CHECK(b.overhead_fraction_of_experts() ==
        Catch::Approx(static_cast<double>(overhead) / 56'774'098'944.0));
  CHECK(b.overhead_fraction_vs_static_ep() ==
        Catch::Approx(static_cast<double>(overhead) / static_cast<double>(static_ep)));
  CHECK(b.overhead_fraction_vs_static_tp() ==
        Catch::Approx(static_cast<double>(b.total_bytes() - static_tp) / static_cast<double>(static_tp)));
  // Targets: spare <= 1/(L+1) of the arena, switching overhead <= 1.5% (paper: 2.4%).
  CHECK(b.spare_fraction_of_arena() <= 1.0 / 95 + 1e-15);
  CHECK(b.overhead_fraction_of_experts() <= 0.015);
  CHECK(b.overhead_fraction_vs_static_ep() <= 0.015);

  std::ostringstream os;
  os << b;
  CHECK_THAT(os.str(), Catch::Contains("arena spare slot"));
  CHECK_THAT(os.str(), Catch::Contains("603979776 B"));
}

TEST_CASE("memory_budget: padded arena", "[memory_budget]") {
  expert_shape s;
  s.num_layers = 3;
  s.num_experts = 4;
  s.hidden = 64;
  s.intermediate = 32;  // w13 4·64·64·2/2 = 16,384 B + w2 8,192 B per rank at P=2
  const arena_geometry g = make_arena_geometry(s, 2, 256, 65536);
  REQUIRE(g.layer_bytes_per_rank() == 24'576);
  REQUIRE(g.slot_bytes == 65'536);
  attention_shape a;
  a.num_layers = 3;
  a.hidden = 64;
  a.num_q_heads = 4;
  a.num_kv_heads = 2;
  a.head_dim = 16;
  a.qk_norm = false;
  const memory_budget b = make_memory_budget(g, a, dense_shape{}, 1000, switch_footprint{});
  CHECK(b.spare_slot_bytes == 65'536);
  CHECK(b.padding_bytes == 3 * (65'536 - 24'576));
  CHECK(b.switching_overhead_bytes() == g.overhead_bytes());
  CHECK(b.attention_bytes == 3 * (2 * 64 * 64 * 2 + 2 * 64 * 32 * 2));
  CHECK(b.static_tp_attention_bytes == 3 * (2 * 64 * 32 * 2 + 2 * 64 * 16 * 2));
}

TEST_CASE("memory_budget: validation names the constraint", "[memory_budget]") {
  const arena_geometry g = make_arena_geometry(qwen3_235b_a22b(), 8);
  attention_shape a = qwen3_235b_a22b_attention();
  a.num_layers = 93;
  CHECK_THROWS_WITH(make_memory_budget(g, a, {}, 0, {}),
                    Catch::Contains("same number of layers"));
  CHECK_THROWS_WITH(make_memory_budget(g, qwen3_235b_a22b_attention(), {}, -1, {}),
                    Catch::Contains("budget inputs must be >= 0"));
  a = qwen3_235b_a22b_attention();
  a.num_kv_heads = 3;
  CHECK_THROWS_WITH(attention_bytes_whole(a), Catch::Contains("kv heads must divide q heads"));
  CHECK_THROWS_WITH(attention_bytes_tp_rank(qwen3_235b_a22b_attention(), 3),
                    Catch::Contains("TP needs P to divide the q heads"));
  switch_footprint huge;
  huge.descriptor_ops_per_rank = int64_t{1} << 60;
  CHECK_THROWS_WITH(make_memory_budget(g, qwen3_235b_a22b_attention(), {}, 0, huge),
                    Catch::Contains("overflows 64 bits"));
}
