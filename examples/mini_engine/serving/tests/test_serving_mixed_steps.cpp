// Measured mixed steps (mixed_step_table.hpp): the grid's interpolation against values worked
// out by hand and against a bilinear function it must reproduce exactly, every bad table refused
// by name, and the curves clock that prices a step that prefills whole from the grid.
#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <set>
#include <string>
#include <vector>

#include <moebius/error.hpp>
#include <moebius/transport/dry_run_transport.hpp>

#include "catch.hpp"
#include "curves_step_clock.hpp"
#include "engine.hpp"
#include "mixed_step_table.hpp"
#include "own_steps.hpp"
#include "sim_runtime.hpp"
#include "small_trace.hpp"
#include "step_curves.hpp"
#include "test_seed.hpp"
#include "world.hpp"

using namespace mini_engine;
using moebius::parallel_mode;

namespace {

// EP rows b = 0: (16 tokens, 6 ms), (64, 8); b = 3: (16, 10), (64, 14) (the header's example).
mixed_step_table hand_table() {
  return mixed_step_table({{parallel_mode::ep, {{0, {16, 64}, {6, 8}}, {3, {16, 64}, {10, 14}}}}},
                          128, "hand");
}

std::string error_of(std::vector<mixed_step_grid> grids, int64_t context = 128) {
  try {
    mixed_step_table(std::move(grids), context, "bad");
  } catch (const moebius::error& e) {
    CHECK(e.code() == moebius::errc::invalid_argument);
    return e.what();
  }
  return "";
}

// Linear in log2 between (b0, y0) and (b1, y1), by hand.
double log_lerp(double b, double b0, double y0, double b1, double y1) {
  return y0 + (y1 - y0) * (std::log2(b) - std::log2(b0)) / (std::log2(b1) - std::log2(b0));
}

// TP at context 128: 9, 12, 18 ms at batch 1, 4, 16; at 512: 10, 14, 22. EP at 512 only: 8,
// 12, 20 ms at (deployment) batch 2, 8, 32.
step_curves hand_curves() {
  return step_curves({{parallel_mode::tp, 128, 1, 9},
                      {parallel_mode::tp, 128, 4, 12},
                      {parallel_mode::tp, 128, 16, 18},
                      {parallel_mode::tp, 512, 1, 10},
                      {parallel_mode::tp, 512, 4, 14},
                      {parallel_mode::tp, 512, 16, 22},
                      {parallel_mode::ep, 512, 2, 8},
                      {parallel_mode::ep, 512, 8, 12},
                      {parallel_mode::ep, 512, 32, 20}},
                     "hand");
}

step_cost tp_step(int64_t sequences, int64_t new_tokens, int64_t context) {
  step_cost c;
  c.mode = parallel_mode::tp;
  c.num_ranks = 2;
  c.num_sequences = sequences;
  c.new_tokens = new_tokens;
  c.context_tokens = sequences * context;
  return c;
}

}  // namespace

TEST_CASE("mixed-step tables: exact at the points, bilinear between, clamped and extrapolated",
          "[cpu][curves]") {
  const mixed_step_table t = hand_table();
  const configuration ep = parallel_mode::ep;
  CHECK(t.has(ep));
  CHECK_FALSE(t.has(parallel_mode::tp));
  CHECK_FALSE(t.empty());
  CHECK(mixed_step_table().empty());
  CHECK(t.source() == "hand");
  CHECK(t.decode_context() == 128);
  CHECK(t.largest_batch(ep) == 3);
  // The grid points, exactly.
  CHECK(t.step_ms(ep, 0, 16) == 6);
  CHECK(t.step_ms(ep, 0, 64) == 8);
  CHECK(t.step_ms(ep, 3, 16) == 10);
  CHECK(t.step_ms(ep, 3, 64) == 14);
  // The midpoint in (log2(b + 1), log2(t)): b = 1, t = 32: (6 + 8 + 10 + 14) / 4.
  CHECK(t.step_ms(ep, 1, 32) == Approx(9.5));
  CHECK(t.step_ms(ep, 1, 16) == Approx(8));    // halfway in log2(b + 1) along t = 16
  CHECK(t.step_ms(ep, 0, 32) == Approx(7));    // halfway in log2(t) along b = 0
  // b = 2: log2(3) / 2 of the way from b = 0 to b = 3, at t = 64.
  CHECK(t.step_ms(ep, 2, 64) == Approx(8 + 6 * std::log2(3.0) / 2));
  // Clamped: below the smallest chunk, above the largest batch.
  CHECK(t.step_ms(ep, 0, 8) == 6);
  CHECK(t.step_ms(ep, 1, 1) == Approx(8));
  CHECK(t.step_ms(ep, 9, 8) == 10);
  CHECK(t.step_ms(ep, 300, 64) == 14);
  // Above the largest chunk: the last two points' slope per token (2/48 at b = 0, 4/48 at 3).
  CHECK(t.step_ms(ep, 0, 112) == Approx(10));
  CHECK(t.step_ms(ep, 3, 112) == Approx(18));
  CHECK(t.step_ms(ep, 1, 112) == Approx(14));

  // A row may stop short (a large batch leaves no room for a large chunk): above its own largest
  // chunk it extrapolates from its own last two points. A last segment that falls is flat
  // beyond; a row of one chunk is flat everywhere.
  const mixed_step_table ragged(
      {{parallel_mode::tp,
        {{0, {16, 64, 512}, {5, 7, 16}}, {1, {16}, {9}}, {64, {16, 64, 448}, {20, 19, 30}}}}},
      128, "ragged");
  const configuration tp = parallel_mode::tp;
  CHECK(ragged.step_ms(tp, 64, 512) == Approx(30 + 64 * 11.0 / 384));
  CHECK(ragged.step_ms(tp, 1, 4096) == Approx(9));
  CHECK(ragged.step_ms(tp, 64, 32) == Approx(19.5));    // the falling segment, interpolated
  CHECK(ragged.step_ms(tp, 0, 1024) == Approx(16 + 512 * 9.0 / 448));
  // Between rows 1 and 64 at t = 16: log2(b + 1) from 1 to log2(65).
  const double f = (std::log2(8.0) - 1) / (std::log2(65.0) - 1);
  CHECK(ragged.step_ms(tp, 7, 16) == Approx(9 + f * 11));

  // Asked for what it does not have.
  CHECK_THROWS_WITH(t.step_ms(tp, 1, 16), Catch::Contains("mixed-step table (hand): no TP grid"));
  CHECK_THROWS_WITH(t.step_ms(ep, -1, 16),
                    Catch::Contains("EP asked for decode batch -1 and chunk 16 tokens"));
  CHECK_THROWS_WITH(t.step_ms(ep, 0, 0.5), Catch::Contains("a chunk >= 1 token"));
}

TEST_CASE("mixed-step tables: bad tables are refused by name", "[cpu][curves]") {
  using rows = std::vector<mixed_step_row>;
  const configuration ep = parallel_mode::ep;
  const rows good = {{0, {16, 64}, {6, 8}}};
  // Empty: no grids, a grid without rows, a row without chunks.
  CHECK_THAT(error_of({}), Catch::Contains("mixed-step table (bad): empty (no configuration has a grid)"));
  CHECK_THAT(error_of({{ep, {}}}), Catch::Contains("EP's grid is empty (no rows)"));
  CHECK_THAT(error_of({{ep, {{0, {}, {}}}}}), Catch::Contains("EP decode batch 0: empty row"));
  // Non-increasing: batches, chunks.
  CHECK_THAT(error_of({{ep, {{4, {16}, {6}}, {4, {16}, {7}}}}}),
             Catch::Contains("EP rows must ascend strictly in decode batch (row 1: 4 after 4)"));
  CHECK_THAT(error_of({{ep, {{4, {16}, {6}}, {1, {16}, {7}}}}}),
             Catch::Contains("(row 1: 1 after 4)"));
  CHECK_THAT(error_of({{ep, {{0, {64, 16}, {6, 8}}}}}),
             Catch::Contains("EP decode batch 0: chunks must ascend strictly (point 1: 16 tokens after 64)"));
  CHECK_THAT(error_of({{ep, {{0, {16, 16}, {6, 8}}}}}),
             Catch::Contains("(point 1: 16 tokens after 16)"));
  // Non-positive: chunk tokens, ms (0, negative, not finite), the context; a negative batch.
  CHECK_THAT(error_of({{ep, {{0, {0, 16}, {6, 8}}}}}),
             Catch::Contains("EP decode batch 0 point 0 needs chunk tokens >= 1 and a positive "
                             "finite step_ms (got tokens 0, step_ms 6)"));
  CHECK_THAT(error_of({{ep, {{2, {16, 64}, {6, 0}}}}}),
             Catch::Contains("EP decode batch 2 point 1 needs chunk tokens >= 1"));
  CHECK_THAT(error_of({{ep, {{2, {16, 64}, {-1, 8}}}}}), Catch::Contains("step_ms -1)"));
  CHECK_THAT(error_of({{ep, {{2, {16}, {std::numeric_limits<double>::quiet_NaN()}}}}}),
             Catch::Contains("EP decode batch 2 point 0 needs"));
  CHECK_THAT(error_of({{ep, {{2, {16}, {std::numeric_limits<double>::infinity()}}}}}),
             Catch::Contains("EP decode batch 2 point 0 needs"));
  CHECK_THAT(error_of({{ep, {{-1, {16}, {6}}}}}),
             Catch::Contains("EP row 0 has a negative decode batch (-1)"));
  CHECK_THAT(error_of({{ep, good}}, 0), Catch::Contains("decode_context 0 must be >= 1 token"));
  // Shapes and names.
  CHECK_THAT(error_of({{ep, {{0, {16, 64}, {6}}}}}),
             Catch::Contains("EP decode batch 0: 2 chunks but 1 step_ms"));
  CHECK_THAT(error_of({{ep, good}, {parallel_mode::tp, good}, {ep, good}}),
             Catch::Contains("EP has two grids (0 and 2)"));
  const configuration unnamed{{parallel_mode::ep, parallel_mode::tp}};
  CHECK_THAT(error_of({{unnamed, good}}), Catch::Contains("grid 0 has no named configuration"));
}

TEST_CASE("mixed-step tables reproduce a bilinear function of (log2(b + 1), log2(t))",
          "[cpu][curves]") {
  // On a rectangular grid of random axes, values from f = a + c x + d y + e x y with
  // x = log2(b + 1), y = log2(t): bilinear interpolation is exact for f inside the grid, and
  // outside it clamps to the edge (b, and t below) as f at the edge does.
  std::mt19937_64 rng(testing::test_seed());
  std::uniform_real_distribution<double> coef(0.1, 3);
  for (int round = 0; round < 50; ++round) {
    const double a = 50 + coef(rng), c = coef(rng), d = coef(rng), e = coef(rng);
    const auto f = [&](double b, double t) {
      const double x = std::log2(b + 1), y = std::log2(t);
      return a + c * x + d * y + e * x * y;
    };
    const auto axis = [&](int64_t lo, int64_t hi) {
      std::set<int64_t> s;
      const size_t n = std::uniform_int_distribution<size_t>(2, 5)(rng);
      while (s.size() < n) s.insert(std::uniform_int_distribution<int64_t>(lo, hi)(rng));
      return std::vector<int64_t>(s.begin(), s.end());
    };
    const std::vector<int64_t> batches = axis(0, 300), chunks = axis(1, 1024);
    mixed_step_grid g{parallel_mode::tp, {}};
    for (const int64_t b : batches) {
      mixed_step_row r{b, chunks, {}};
      for (const int64_t t : chunks)
        r.step_ms.push_back(f(static_cast<double>(b), static_cast<double>(t)));
      g.rows.push_back(r);
    }
    const mixed_step_table table({g}, 128, "random");
    const double b0 = static_cast<double>(batches.front()), b1 = static_cast<double>(batches.back());
    const double t0 = static_cast<double>(chunks.front()), t1 = static_cast<double>(chunks.back());
    for (int q = 0; q < 20; ++q) {
      const double b = std::uniform_real_distribution<double>(b0, b1)(rng);
      const double t = std::exp2(std::uniform_real_distribution<double>(std::log2(t0), std::log2(t1))(rng));
      CHECK(table.step_ms(parallel_mode::tp, b, t) == Approx(f(b, t)).epsilon(1e-9));
      // Clamped: above the largest batch, below the smallest chunk.
      CHECK(table.step_ms(parallel_mode::tp, b1 + 1 + b, t) == Approx(f(b1, t)).epsilon(1e-9));
      CHECK(table.step_ms(parallel_mode::tp, b, std::max(1.0, t0 / 2)) == Approx(f(b, t0)).epsilon(1e-9));
    }
  }
}

TEST_CASE("the curves clock prices a step that prefills whole from measured mixed steps",
          "[cpu][curves]") {
  priced_model pm;
  pm.context_scale = 1;
  const h200_step_model model(pm, h200_params{}, 2, 1024);
  curves_clock_options o;
  // TP grid (decode sequences at 128): b = 0: (16, 20), (64, 30); b = 3: (16, 24), (64, 36).
  // EP grid: b = 0: (16, 5), (64, 7); b = 3: (16, 19), (64, 23).
  o.mixed = mixed_step_table(
      {{parallel_mode::tp, {{0, {16, 64}, {20, 30}}, {3, {16, 64}, {24, 36}}}},
       {parallel_mode::ep, {{0, {16, 64}, {5, 7}}, {3, {16, 64}, {19, 23}}}}},
      128, "hand grid");
  o.prefill = prefill_table({{parallel_mode::tp, 16, 1000}}, "ignored where a grid is");
  const curves_step_clock clock(hand_curves(), model, o);
  CHECK_THAT(clock.name(), Catch::Contains("a step that prefills priced whole from measured mixed "
                                           "steps (decode batch x chunk tokens) of TP, EP (hand "
                                           "grid; decode context 128)"));
  const auto ms = [&](const step_cost& c) { return clock.step_s(c, 0) * 1e3; };
  // 4 sequences, 19 new tokens: b = 3 decoding, a chunk of 16. At the grid's context: the point.
  CHECK(ms(tp_step(4, 19, 128)) == Approx(24));
  // At 512: plus the curve's context difference at 4 sequences, 14 - 12.
  CHECK(ms(tp_step(4, 19, 512)) == Approx(26));
  // b = 1, t = 32: the grid's midpoint, (20 + 30 + 24 + 36) / 4... in log2(b + 1) and log2(t).
  CHECK(ms(tp_step(2, 33, 128)) == Approx(27.5));
  // A step that prefills alone: b = 0; beyond the largest chunk, 10/48 ms a token.
  CHECK(ms(tp_step(1, 16, 128)) == Approx(20));
  CHECK(ms(tp_step(1, 112, 128)) == Approx(40));
  // Above the grid's largest batch (3): clamped, plus the decode curve from 3 to 8 at 128.
  CHECK(ms(tp_step(9, 72, 128)) ==
        Approx(36 + log_lerp(8, 4, 12, 16, 18) - log_lerp(3, 1, 9, 4, 12)));
  // Decode steps are the curves' as before.
  CHECK(ms(tp_step(4, 4, 512)) == Approx(14));

  // EP at P = 2, split: rank 0 decodes 1 beside a chunk of 32 (2 sequences, 33 rows): the EP
  // grid at (1, 32), (6 + 21) / 2; the curves' context term is 0 (EP's one context, 512, is
  // above the grid's and both clamp to it). Rank 1 decodes 3: curve(6, 512). The busiest.
  step_cost ep;
  ep.mode = parallel_mode::ep;
  ep.num_ranks = 2;
  ep.ranks = {{2, 33, 2 * 512}, {3, 3, 3 * 512}};
  ep.num_sequences = 5;
  ep.new_tokens = 36;
  ep.context_tokens = 5 * 512;
  const double rank1 = log_lerp(6, 2, 8, 8, 12);
  CHECK(rank1 < 13.5);
  CHECK(ms(ep) == Approx(13.5));
  // Without an EP grid the EP step keeps the extra rows (no EP prefill points either).
  curves_clock_options tp_only;
  tp_only.mixed = mixed_step_table({{parallel_mode::tp, {{0, {16}, {20}}}}}, 128, "tp only");
  const curves_step_clock partial(hand_curves(), model, tp_only);
  const curves_step_clock rows(hand_curves(), model);
  CHECK(partial.step_s(ep, 0) == Approx(rows.step_s(ep, 0)));
  CHECK(partial.step_s(tp_step(1, 16, 128), 0) * 1e3 == Approx(20));
}

TEST_CASE("a simulated run priced with mixed steps: every step priced again from its record",
          "[cpu][curves]") {
  // The simulated runtime at P = 2 with forced switches both ways, on the curves clock at graph
  // buckets with TP and EP grids: the run finishes, and each step's price is the clock's of its
  // record (step_record::ranks: the EP split it was priced by), as mini_engine_fidelity prices
  // the measured run's own steps.
  const int P = 2;
  const uint64_t seed = testing::test_seed();
  testing::world w = testing::make_world(P, 96, seed);
  sim_runtime sim(w.arena, w.kv, w.vocab);
  moebius::dry_run_transport dry(P, sim.spaces());
  priced_model pm;
  pm.context_scale = 1;
  const h200_step_model model(pm, h200_params{}, P, kv_bytes_per_token(w.kv));
  curves_clock_options o;
  o.graph_buckets = {1, 2, 4, 8};
  o.mixed = mixed_step_table(
      {{parallel_mode::tp, {{0, {2, 8}, {20, 30}}, {3, {2, 8}, {24, 36}}}},
       {parallel_mode::ep, {{0, {2, 8}, {5, 7}}, {3, {2, 8}, {19, 23}}}}},
      128, "hand grid");
  const curves_step_clock clock(hand_curves(), model, o);
  engine e(sim, dry, w.arena, w.kv, clock, moebius::arena_cursor{0});
  const std::vector<request> reqs = testing::small_trace(seed, w.vocab, 10);
  engine_options eo = testing::small_trace_options();
  eo.record_rank_split = true;  // each EP step's split, to price it again below
  eo.how = switching::forced;
  for (int64_t s = 5; s < 2000; s += 5) eo.forced_steps.push_back(s);
  const run_result r = e.run(reqs, eo, "mixed");
  REQUIRE(r.requests.size() == reqs.size());
  for (const request_result& q : r.requests)
    CHECK(static_cast<int64_t>(q.generated.size()) == q.output_tokens);
  int64_t mixed_steps[2] = {0, 0};
  for (const step_record& s : r.steps) {
    if (s.sequences <= 0 || s.in_switch) continue;
    CAPTURE(s.step, s.sequences, s.decode_tokens, s.prefill_tokens);
    step_cost cost = cost_of(s, P);  // own_steps.hpp
    if (cost.mode == parallel_mode::ep) {
      REQUIRE(s.ranks.size() == static_cast<size_t>(P));
      int64_t seqs = 0, tokens = 0, context = 0;
      for (const rank_work& x : s.ranks) {
        seqs += x.sequences;
        tokens += x.new_tokens;
        context += x.context_tokens;
      }
      CHECK(seqs == s.sequences);
      CHECK(tokens == cost.new_tokens);
      CHECK(context == s.context_tokens);
      cost.ranks = s.ranks;
    } else {
      CHECK(s.ranks.empty());
    }
    CHECK(clock.step_s(cost, 0) * 1e3 == Approx(s.step_ms).epsilon(1e-12));
    if (s.prefill_tokens > 0) ++mixed_steps[cost.mode == parallel_mode::ep ? 0 : 1];
  }
  CHECK(mixed_steps[0] > 0);
  CHECK(mixed_steps[1] > 0);
}
