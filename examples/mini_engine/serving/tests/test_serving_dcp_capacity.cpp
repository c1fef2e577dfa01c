// The dcp-only design's open-loop capacity reads (dcp_capacity.hpp): the recent means against
// their weighted sum written out, whether fuller steps pay on curves worked by hand, and whether
// the live set grows on the production-shaped trace's figures.
#include <cmath>
#include <random>
#include <vector>

#include <moebius/error.hpp>

#include "catch.hpp"
#include "dcp_capacity.hpp"
#include "test_seed.hpp"

using namespace mini_engine;

namespace {

moebius::latency_curve curve(std::vector<moebius::latency_sample> points) {
  return moebius::latency_curve::fit(points, moebius::curve_fit::piecewise_linear);
}

const moebius::latency_curve k_flat = curve({{1, 10}, {8192, 10}});
const moebius::latency_curve k_slower_flat = curve({{1, 13}, {8192, 13}});
// 0.01 ms a row through the origin: every row costs the same, a fuller step serves no faster.
const moebius::latency_curve k_proportional = curve({{1, 0.01}, {8192, 81.92}});

}  // namespace

TEST_CASE("recent_mean: the weighted mean of what it saw, the weights written out", "[cpu]") {
  std::mt19937_64 pick(testing::test_seed() + 1);
  // The default weight, or another (prefill_stalls' 1/512), drawn.
  const double w = std::uniform_int_distribution<int>(0, 1)(pick) ? recent_mean::k_weight
                                                                   : 1.0 / 512;
  CAPTURE(w);
  recent_mean m(w);
  CHECK_FALSE(m.seen());
  CHECK(m.value() == 0);
  m.add(7);
  CHECK(m.seen());
  CHECK(m.value() == Approx(7));  // the first step counts as itself, not 7/64
  std::mt19937_64 rng(testing::test_seed());
  const int n = std::uniform_int_distribution<int>(2, 500)(rng);
  std::vector<double> xs{7};
  for (int i = 1; i < n; ++i) {
    xs.push_back(std::uniform_real_distribution<double>(-100, 1000)(rng));
    m.add(xs.back());
  }
  // Step k of n weighs w (1 - w)^(n - 1 - k), over the weights' sum.
  double sum = 0, weights = 0;
  for (int k = 0; k < n; ++k) {
    const double wk = w * std::pow(1 - w, n - 1 - k);
    sum += wk * xs[static_cast<size_t>(k)];
    weights += wk;
  }
  CAPTURE(n);
  CHECK(m.value() == Approx(sum / weights).epsilon(1e-9));
  recent_mean constant;
  for (int i = 0; i < n; ++i) constant.add(42);
  CHECK(constant.value() == Approx(42).epsilon(1e-12));
  for (const double bad : {0.0, -0.5, 1.5})
    REQUIRE_THROWS_WITH(recent_mean(bad), Catch::Contains("weight"));
  CHECK(recent_mean(1).seen() == false);
}

TEST_CASE("fuller_steps_pay: more tokens a second at the budget's rows, by more than the margin",
          "[cpu]") {
  // Flat curves: a step's time does not grow with its rows, so the budget's 8,192 rows serve
  // 128x the tokens a second of 64.
  CHECK(fuller_steps_pay(64, 8192, 100000, k_flat, k_flat, 0.25));
  // Nothing waiting: the same rows, no gain.
  CHECK_FALSE(fuller_steps_pay(64, 8192, 0, k_flat, k_flat, 0.25));
  // Compute-bound: the same tokens a second at any rows.
  CHECK_FALSE(fuller_steps_pay(64, 8192, 100000, k_proportional, k_proportional, 0.25));
  CHECK_FALSE(fuller_steps_pay(6350, 8192, 100000, k_proportional, k_proportional, 0));
  // The margin: 100 -> 124 rows on flat curves is 1.24x; passes 0.2, not 0.25.
  CHECK(fuller_steps_pay(100, 8192, 24, k_flat, k_flat, 0.2));
  CHECK_FALSE(fuller_steps_pay(100, 8192, 24, k_flat, k_flat, 0.25));
  // The budget caps the rows: 100 -> 110, 1.1x.
  CHECK_FALSE(fuller_steps_pay(100, 110, 1000, k_flat, k_flat, 0.25));
  CHECK(fuller_steps_pay(100, 110, 1000, k_flat, k_flat, 0.05));
  // Steps already past the budget (a prefill chunk beside every decode) stay as they are.
  CHECK_FALSE(fuller_steps_pay(9000, 8192, 1000, k_flat, k_flat, 0));
  // The larger pool's curve is its own: 64 -> 8,192 rows at 13 ms against 10 is 98.5x.
  CHECK(fuller_steps_pay(64, 8192, 100000, k_flat, k_slower_flat, 90));
  CHECK_FALSE(fuller_steps_pay(64, 8192, 100000, k_flat, k_slower_flat, 99));
  CHECK_THROWS_WITH(fuller_steps_pay(0, 8192, 1, k_flat, k_flat, 0.25),
                    Catch::Contains("rows_now (0)"));
  CHECK_THROWS_WITH(fuller_steps_pay(1, 0, 1, k_flat, k_flat, 0.25),
                    Catch::Contains("step_tokens (0)"));
  CHECK_THROWS_WITH(fuller_steps_pay(1, 8192, -1, k_flat, k_flat, 0.25),
                    Catch::Contains("waiting_tokens (-1)"));
  CHECK_THROWS_WITH(fuller_steps_pay(1, 8192, 1, k_flat, k_flat, -0.5),
                    Catch::Contains("margin (-0.5)"));
}

TEST_CASE("live_set_grows: decode tokens a step against what completions free", "[cpu]") {
  // The production-shaped trace at 3.9x load, dcp 1: 754 running holding 1,318,290 tokens
  // (1,748 each), 3.6 completions a step free ~6,294 tokens against 754 grown.
  CHECK_FALSE(live_set_grows(754, 1318290, 3.6));
  // 0.4 completions a step free 699 tokens: fewer than the 754 grown.
  CHECK(live_set_grows(754, 1318290, 0.4));
  // The boundary: 100 running of 50 tokens each, 2 completions free exactly 100: not growing.
  CHECK_FALSE(live_set_grows(100, 5000, 2));
  CHECK(live_set_grows(100, 5000, 1.99));
  // No completion yet, or nothing running.
  CHECK(live_set_grows(754, 1318290, 0));
  CHECK(live_set_grows(0, 0, 5));
  CHECK_THROWS_WITH(live_set_grows(-1, 0, 0), Catch::Contains("running (-1)"));
  CHECK_THROWS_WITH(live_set_grows(1, -5, 0), Catch::Contains("running_tokens (-5)"));
  CHECK_THROWS_WITH(live_set_grows(1, 5, -1), Catch::Contains("completions_a_step (-1)"));
  CHECK_THROWS_WITH(live_set_grows(1, 5, std::nan("")), Catch::Contains("completions_a_step"));
}
