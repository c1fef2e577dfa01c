// Plan-only tests (nothing allocated) for a shape whose per-rank slot exceeds 4 GiB: offsets
// beyond 2^32 appear in the ops, match hand arithmetic, and mean the right logical bytes.

#include <cstdint>
#include <sstream>

#include "moebius/error.hpp"
#include "moebius/plan/weight_plan.hpp"
#include "plan/element_decoder.hpp"
#include "support/catch.hpp"
#include "support/plan_checks.hpp"

using namespace moebius;

namespace {

// E=256, H=7168, I=4096, fp32, P=8: per rank per layer w13 = 256*8192*7168*4/8 = 7 GiB,
// w2 = 3.5 GiB, slot = 10.5 GiB.
expert_shape huge_shape() {
  expert_shape s;
  s.num_layers = 2;
  s.num_experts = 256;
  s.hidden = 7168;
  s.intermediate = 4096;
  s.weight_dtype = dtype::fp32;
  return s;
}

// For sampled rows and bytes of every op: the source and destination are the same logical
// byte (see element_decoder.hpp), in the layer the phase moves.
void check_sampled_semantics(const plan& p, const arena_geometry& g, arena_cursor from,
                             arena_cursor to) {
  const bool to_tp = to.tp_layers > from.tp_layers;
  for (size_t k = 0; k < p.phases.size(); ++k) {
    const int64_t layer = to_tp ? from.tp_layers + static_cast<int64_t>(k)
                                : from.tp_layers - 1 - static_cast<int64_t>(k);
    const arena_cursor before{to_tp ? layer : layer + 1};
    const arena_cursor after{to_tp ? layer + 1 : layer};
    for (const copy_op& op : p.phases[k].ops) {
      for (int64_t j : {int64_t{0}, op.rows / 3, op.rows - 1}) {
        for (int64_t b : {int64_t{0}, op.row_bytes / 2 + 1, op.row_bytes - 1}) {
          const auto src = testing::decode(g, before, op.src_rank, op.src_offset + j * op.src_pitch + b);
          const auto dst = testing::decode(g, after, op.dst_rank, op.dst_offset + j * op.dst_pitch + b);
          INFO("phase " << k << " op " << op << " row " << j << " byte " << b);
          REQUIRE(src.has_value());
          REQUIRE(dst.has_value());
          REQUIRE(src->layer == layer);
          REQUIRE(*src == *dst);
        }
      }
    }
  }
}

}  // namespace

TEST_CASE("a slot beyond 4 GiB: geometry arithmetic", "[plan][large]") {
  const arena_geometry g = make_arena_geometry(huge_shape(), 8);
  CHECK(g.tensor_bytes[0] == int64_t{256} * 8192 * 7168 * 4 / 8);  // 7,516,192,768
  CHECK(g.tensor_bytes[0] == 7'516'192'768);
  CHECK(g.tensor_bytes[1] == 3'758'096'384);
  CHECK(g.slot_bytes == 11'274'289'152);  // a multiple of 2 MiB already
  CHECK(g.total_bytes() == 3 * int64_t{11'274'289'152});
}

TEST_CASE("a slot beyond 4 GiB: EP->TP ops use 64-bit offsets correctly", "[plan][large]") {
  const arena_geometry g = make_arena_geometry(huge_shape(), 8);
  const int64_t H = 7168, fp32 = 4, slot = g.slot_bytes;
  const plan p = plan_weight_switch(g, {0}, {2});
  REQUIRE(p.phases.size() == 2);
  int64_t max_end = 0;
  for (const plan_phase& ph : p.phases) {
    for (const copy_op& op : ph.ops) max_end = std::max({max_end, op.src_end(), op.dst_end()});
  }
  CHECK(max_end > (int64_t{1} << 34));
  CHECK(max_end == g.total_bytes());  // layer 1's w2 ends the arena (no padding)
  CHECK(testing::check_traffic(p, g, {0}, {2}) == "");
  check_sampled_semantics(p, g, {0}, {2});

  // Layer 1 (phase 1) goes from slot 2 to slot 1. EP rank 3 sends TP rank 5 the gate rows
  // [5*512, 6*512) of its 32 experts: the first of them starts at slot 2 + 5*512 rows of H
  // fp32, and lands on TP rank 5 at slot 1 + expert 96's first row (96 experts of 1024 rows).
  const int64_t src = 2 * slot + 5 * 512 * H * fp32;
  const int64_t dst = slot + 3 * 32 * 1024 * H * fp32;
  CHECK(src == 22'621'978'624);
  CHECK(dst == 14'092'861'440);
  bool found = false;
  int64_t pair_bytes = 0;
  for (const copy_op& op : p.phases[1].ops) {
    if (op.src_rank != 3 || op.dst_rank != 5) continue;
    pair_bytes += op.bytes();
    if (op.src_offset == src) {
      found = true;
      CHECK(op.dst_offset == dst);
    }
  }
  CHECK(found);
  CHECK(pair_bytes == g.layer_bytes_per_rank() / 8);

  // validate(plan, space): fits exactly the arena, not one byte less.
  int64_t space[num_memory_spaces] = {g.total_bytes(), 0};
  CHECK_NOTHROW(validate(p, space));
  space[0] = g.total_bytes() - 1;
  try {
    validate(p, space);
    FAIL("no throw");
  } catch (const moebius::error& e) {
    CHECK(e.code() == errc::out_of_range);
  }
}

TEST_CASE("a slot beyond 4 GiB: TP->EP with mixed gate/up orders", "[plan][large]") {
  expert_shape s = huge_shape();
  s.ep_order = gate_up_order::up_first;
  const arena_geometry g = make_arena_geometry(s, 8);
  const plan p = plan_weight_switch(g, {2}, {0});
  REQUIRE(p.phases.size() == 2);
  CHECK(testing::check_traffic(p, g, {2}, {0}) == "");
  check_sampled_semantics(p, g, {2}, {0});
  const plan q = plan_weight_switch(g, {1}, {2});
  check_sampled_semantics(q, g, {1}, {2});
}
