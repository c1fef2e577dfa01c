// nccl_transport::workspace_bytes on the host (no GPU needed): the staging a rank needs is the
// bytes of its remote ops that are strided on its side, worked out here by hand from the EP and
// TP layouts of Qwen3-235B-A22B at P = 2 (DESIGN.md §1).

#include "moebius/error.hpp"
#include "moebius/layout/arena_geometry.hpp"
#include "moebius/plan/weight_plan.hpp"
#include "moebius/transport/nccl_transport.hpp"
#include "support/catch.hpp"

using namespace moebius;

TEST_CASE("nccl workspace: Qwen3-235B at P=2 stages exactly the strided side of each transfer") {
  expert_shape s = qwen3_235b_a22b();
  s.num_layers = 3;
  const int P = 2;
  const arena_geometry g = make_arena_geometry(s, P);
  const int64_t E = s.num_experts, H = s.hidden, I = s.intermediate, eb = 2;
  // EP->TP, rank r sends rank q its experts' gate and up slices q (rows of I/P*H out of a
  // [2I, H] expert: strided at the EP source) and its w2 columns q (rows of I/P out of I:
  // strided at the source). What it receives lands contiguously in its TP layout.
  const int64_t w13_piece = (E / P) * 2 * (I / P) * H * eb;  // 805,306,368 B
  const int64_t w2_piece = (E / P) * H * (I / P) * eb;       // 402,653,184 B
  const plan to_tp = plan_weight_switch(g, arena_cursor{0}, arena_cursor{3});
  const plan to_ep = plan_weight_switch(g, arena_cursor{3}, arena_cursor{0});
  for (int r = 0; r < P; ++r) {
    CHECK(nccl_transport::workspace_bytes(to_tp, r) == w13_piece + w2_piece);
    // TP->EP is the mirror image: contiguous at the TP source, strided at the EP destination.
    CHECK(nccl_transport::workspace_bytes(to_ep, r) == w13_piece + w2_piece);
  }
  CHECK(nccl_transport::workspace_bytes(plan_weight_switch(g, arena_cursor{1}, arena_cursor{1}),
                                        0) == 0);
  CHECK_THROWS_AS(nccl_transport::workspace_bytes(to_tp, P), moebius::error);
  CHECK_THROWS_AS(nccl_transport::workspace_bytes(to_tp, -1), moebius::error);
}

TEST_CASE("nccl workspace: one rank needs no staging, whatever the pitches") {
  expert_shape s = qwen3_235b_a22b();
  s.num_layers = 2;
  s.num_experts = 4;
  s.tp_order = gate_up_order::up_first;  // the swap makes strided local copies
  const arena_geometry g = make_arena_geometry(s, 1);
  CHECK(nccl_transport::workspace_bytes(plan_weight_switch(g, arena_cursor{0}, arena_cursor{2}),
                                        0) == 0);
}

TEST_CASE(
    "nccl workspace: regions are rounded up to 256 bytes and summed per phase, max over phases") {
  plan p;
  p.num_ranks = 2;
  copy_op strided;  // strided at both ends: rank 0 packs, rank 1 unpacks
  strided.src_rank = 0;
  strided.dst_rank = 1;
  strided.rows = 3;
  strided.row_bytes = 10;
  strided.src_pitch = 20;
  strided.dst_pitch = 30;
  copy_op contiguous = strided;  // pitch == row_bytes on both sides: no staging
  contiguous.src_pitch = contiguous.dst_pitch = 10;
  copy_op back = strided;  // 1 -> 0, strided at the source only
  back.src_rank = 1;
  back.dst_rank = 0;
  back.dst_pitch = 10;
  back.rows = 100;  // 1000 B -> 1024
  p.phases.resize(2);
  p.phases[0].ops = {strided, contiguous, strided};  // rank 0: 2 x 256, rank 1: 2 x 256
  p.phases[1].ops = {back};                          // rank 0: 0, rank 1: 1024
  CHECK(nccl_transport::workspace_bytes(p, 0) == 512);
  CHECK(nccl_transport::workspace_bytes(p, 1) == 1024);
}
