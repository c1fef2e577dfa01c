// The policy's KV-need estimates (kv_need.hpp) on cases worked by hand: a pool's tokens per
// attention layout and dcp, the output prior before and after requests finish, a sequence's
// expected remaining output, and a closed-loop rollout's residency in each mode.
#include <vector>

#include <moebius/kv/kv_geometry.hpp>

#include "catch.hpp"
#include "kv_need.hpp"

using namespace mini_engine;
using moebius::parallel_mode;

namespace {

// Qwen3-235B's head count at P = 8 (H_kv = 4: two TP ranks per head), small pages.
moebius::kv_geometry qwen3_shaped(int64_t dcp) {
  moebius::kv_geometry g;
  g.num_layers = 2;
  g.num_kv_heads = 4;
  g.head_dim = 8;
  g.page_size = 16;
  g.num_ep_pages = 100;
  g.num_ranks = 8;
  g.dcp = dcp;
  return g;
}

}  // namespace

TEST_CASE("pool_tokens: EP every rank's pages, TP one rank's times dcp, less the watermark",
          "[cpu]") {
  const moebius::kv_geometry g = qwen3_shaped(1);
  // EP: 8 ranks x 100 pages x 16 tokens.
  CHECK(pool_tokens(g, parallel_mode::ep, 1, 0) == 12800);
  // TP: a rank holds 4 TP pages per EP page (one head each), 400 pages x 16 = 6,400 tokens;
  // dcp 2 splits each sequence over two ranks: 12,800, as EP's.
  CHECK(pool_tokens(g, parallel_mode::tp, 1, 0) == 6400);
  CHECK(pool_tokens(g, parallel_mode::tp, 2, 0) == 12800);
  // A 10% watermark kept free; EP ignores dcp.
  CHECK(pool_tokens(g, parallel_mode::tp, 2, 0.1) == Approx(11520));
  CHECK(pool_tokens(g, parallel_mode::ep, 2, 0.25) == Approx(9600));
}

TEST_CASE("output_prior: the finished requests' mean output, else the running ones' so far",
          "[cpu]") {
  work_view w;
  CHECK(output_prior(w) == 1);  // nothing known: at least 1
  w.running = 3;
  w.generated = {10, 20, 60};
  CHECK(output_prior(w) == Approx(30));  // (10 + 20 + 60) / 3
  w.finished = 4;
  w.finished_output_tokens = 1000;
  CHECK(output_prior(w) == Approx(250));  // finished requests win once there are any
  w = {};
  w.running = 2;
  w.generated = {0, 0};
  CHECK(output_prior(w) == 1);  // never below 1
}

TEST_CASE("expected_remaining: as many again as generated, at least the prior", "[cpu]") {
  CHECK(expected_remaining(0, 250) == 250);
  CHECK(expected_remaining(100, 250) == 250);
  CHECK(expected_remaining(900, 250) == 900);
}

TEST_CASE("rollout_residency: TP until the last survivor, EP until the live count falls under "
          "the boundary",
          "[cpu]") {
  work_view w;
  CHECK(rollout_residency(w, parallel_mode::tp, 4, 50) == 1);  // nothing live: one step
  w.running = 4;
  w.generated = {10, 300, 40, 120};
  w.waiting = 2;  // each expected to run the prior, 50
  // Remaining, sorted: 50, 50, 50 (10 -> prior), 50 (40 -> prior), 120, 300.
  CHECK(rollout_residency(w, parallel_mode::tp, 4, 50) == 300);
  // EP with boundary 4: the 6 live fall under 4 once the 3 shortest end: sorted[6 - 4] = 50.
  CHECK(rollout_residency(w, parallel_mode::ep, 4, 50) == 50);
  // Boundary 2: sorted[4] = 120. A boundary above the live count: one step.
  CHECK(rollout_residency(w, parallel_mode::ep, 2, 50) == 120);
  CHECK(rollout_residency(w, parallel_mode::ep, 7, 50) == 1);
  // A fractional prior rounds up.
  w = {};
  w.waiting = 1;
  CHECK(rollout_residency(w, parallel_mode::tp, 1, 2.2) == 3);
}
