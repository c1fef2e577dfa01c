// Residency prediction (policy/residency.hpp): the rates against direct sums over the history,
// the crossing time against a step-by-step simulation of the fluid load, the documented worked
// example, and the cost gate of switch_policy driven by a predictor (both directions, its
// residency, gain, cost and decision recomputed by hand).
#include <algorithm>
#include <cmath>
#include <random>
#include <sstream>
#include <vector>

#include "moebius/error.hpp"
#include "moebius/policy/calibration.hpp"
#include "moebius/policy/residency.hpp"
#include "moebius/policy/step_time_gate.hpp"
#include "moebius/policy/switch_policy.hpp"
#include "layout/error_matchers.hpp"
#include "policy_seed.hpp"
#include "support/catch.hpp"

using namespace moebius;
using moebius::testing::policy_test_seed;

namespace {

// The exponentially weighted mean over a history that starts with zeros, summed directly:
// sum_i alpha (1 - alpha)^(n - 1 - i) x_i.
double direct_ewma_from_zero(const std::vector<double>& x, double alpha) {
  double sum = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    sum += alpha * std::pow(1 - alpha, static_cast<double>(x.size() - 1 - i)) * x[i];
  }
  return sum;
}

// The bias-corrected exponentially weighted mean, summed directly: sum_i w_i x_i / sum_i w_i
// with w_i = (1 - alpha)^(n - 1 - i).
double direct_ewma(const std::vector<double>& x, double alpha) {
  double num = 0, den = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const double w = std::pow(1 - alpha, static_cast<double>(x.size() - 1 - i));
    num += w * x[i];
    den += w;
  }
  return den > 0 ? num / den : 0;
}

// Steps until the fluid load, moving by `drift` each step, crosses `boundary` (from at or above
// to below, integer loads: <= boundary - 1; from below to at or above), capped at `horizon`.
int64_t simulate_cross(double load, int64_t boundary, double drift, int64_t horizon) {
  const bool above = load >= static_cast<double>(boundary);
  double l = load;
  for (int64_t n = 1; n <= horizon; ++n) {
    l += drift;
    if (above ? l <= static_cast<double>(boundary) - 1 : l >= static_cast<double>(boundary)) {
      return n;
    }
  }
  return horizon;
}

}  // namespace

TEST_CASE("residency: rates equal direct sums over the history", "[policy]") {
  std::mt19937_64 rng(policy_test_seed() + 11);
  auto uni = [&](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  for (int trial = 0; trial < 50; ++trial) {
    residency_config c;
    c.window_steps = uni(1, 300);
    residency_predictor p(c);
    std::vector<double> arrivals, lifetimes;  // lifetimes: one entry per completed request
    const int64_t steps = uni(1, 400);
    int64_t running = 0;
    for (int64_t i = 0; i < steps; ++i) {
      step_observation s;
      s.arrivals = uni(0, 3) == 0 ? uni(0, 600) : uni(0, 4);
      s.completions = uni(0, 2) == 0 ? uni(1, 5) : 0;
      // Requests finishing in one step share a mean (the predictor sees only the sum).
      const int64_t each = uni(1, 200);
      s.completed_steps = s.completions * each;
      for (int64_t k = 0; k < s.completions; ++k) lifetimes.push_back(static_cast<double>(each));
      running = uni(0, 1000);
      s.running = running;
      arrivals.push_back(static_cast<double>(s.arrivals));
      p.observe(s);
    }
    INFO("trial " << trial << " " << c << " " << p);
    const double a = direct_ewma_from_zero(arrivals, 1.0 / static_cast<double>(c.window_steps));
    CHECK(p.arrival_rate() == Catch::Approx(a).epsilon(1e-9).margin(1e-12));
    const double S = direct_ewma(lifetimes, 1.0 / 64.0);
    CHECK(p.mean_lifetime_steps() == Catch::Approx(S).epsilon(1e-9));
    const double c_rate = lifetimes.empty() ? 0.0 : static_cast<double>(running) / std::max(S, 1.0);
    CHECK(p.completion_rate(running) == Catch::Approx(c_rate).epsilon(1e-9));
    CHECK(p.drift() == Catch::Approx(a - c_rate).epsilon(1e-9).margin(1e-9));
    CHECK(p.steps_observed() == steps);
  }
}

TEST_CASE("residency: constant arrivals approach that rate from an empty history", "[policy]") {
  residency_predictor p(residency_config{4, 100});
  for (int i = 1; i <= 40; ++i) {
    p.observe({7, 0, 0, 3});
    CHECK(p.arrival_rate() == Catch::Approx(7.0 * (1 - std::pow(0.75, i))));
  }
  CHECK(p.mean_lifetime_steps() == 0);  // no completion: unknown
  CHECK(p.completion_rate(3) == 0);
  p.reset();
  CHECK(p.arrival_rate() == 0);
  CHECK(p.steps_observed() == 0);
}

TEST_CASE("residency: crossing time equals a step-by-step simulation", "[policy]") {
  std::mt19937_64 rng(policy_test_seed() + 12);
  auto uni = [&](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  int64_t finite_down = 0, finite_up = 0, at_horizon = 0, exact = 0;
  for (int trial = 0; trial < 2000; ++trial) {
    residency_config c;
    c.window_steps = 1;  // the rate is the last step's arrivals: drift set exactly
    c.horizon_steps = uni(1, 5000);
    residency_predictor p(c);
    const int64_t lifetime = uni(1, 300), running = uni(0, 2000), arrivals = uni(0, 40);
    p.observe({0, 1, lifetime, 0});
    p.observe({arrivals, 0, 0, running});
    const double drift = static_cast<double>(arrivals) -
                         static_cast<double>(running) / static_cast<double>(lifetime);
    CHECK(p.drift() == Catch::Approx(drift));
    const int64_t load = uni(0, 2000), boundary = uni(0, 2000);
    const int64_t got = p.steps_until_cross(load, boundary);
    const int64_t want = simulate_cross(static_cast<double>(load), boundary, drift, c.horizon_steps);
    INFO("trial " << trial << ": load " << load << " boundary " << boundary << " drift " << drift
                  << " horizon " << c.horizon_steps);
    // The simulation accumulates rounding: one step off only at a near-exact tie.
    CHECK(std::abs(got - want) <= 1);
    exact += got == want;
    CHECK(got >= 1);
    CHECK(got <= c.horizon_steps);
    if (got == c.horizon_steps) ++at_horizon;
    else if (load >= boundary) ++finite_down;
    else ++finite_up;
  }
  CHECK(finite_down > 100);
  CHECK(finite_up > 100);
  CHECK(at_horizon > 100);
  CHECK(exact >= 1990);
}

TEST_CASE("residency: the header's worked example", "[policy]") {
  // S = 28 steps, R = 128, T_l = 100. First with window 1, where the rate is the last step's
  // arrivals.
  residency_config c;
  c.window_steps = 1;
  residency_predictor p(c);
  p.observe({0, 1, 28, 0});
  // a = 3 (window 1): d = 3 - 128/28 = -1.571; (128 - 100 + 1) / 1.571 = 18.45 -> 19 steps.
  p.observe({3, 0, 0, 128});
  CHECK(p.steps_until_cross(128, 100) == 19);
  // The header's a = 2.6: arrivals 3,3,3,2,2 repeated, averaged over a window of 256.
  residency_predictor q(residency_config{256, 4096});
  q.observe({0, 1, 28, 0});
  for (int i = 0; i < 5000; ++i) q.observe({i % 5 < 3 ? 3 : 2, 0, 0, 128});
  const double d = q.arrival_rate() - 128.0 / 28.0;
  CHECK(q.arrival_rate() == Catch::Approx(2.6).margin(0.01));
  CHECK(q.steps_until_cross(128, 100) == static_cast<int64_t>(std::ceil(29.0 / -d)));
  CHECK(q.steps_until_cross(128, 100) == 15);
  // A rollout's batch: 512 arrivals at once, nothing finished: a = 2, S unknown: 1 step.
  residency_predictor r;
  r.observe({512, 0, 0, 512});
  CHECK(r.arrival_rate() == 2.0);
  CHECK(r.steps_until_cross(512, 100) == 1);
  CHECK(r.steps_until_cross(5, 100) == 1);
  std::ostringstream os;
  os << r;
  CHECK(os.str().find("residency{a=2/step") == 0);
  // 100 steps on, 70 left, S = 28: a = 1.35 < c = 2.5: the load does not climb back to T_h.
  r.observe({0, 1, 28, 512});
  for (int i = 0; i < 99; ++i) r.observe({0, 0, 0, 70});
  CHECK(r.arrival_rate() == Catch::Approx(2.0 * std::pow(255.0 / 256.0, 100)));
  CHECK(r.drift() == Catch::Approx(r.arrival_rate() - 70.0 / 28.0));
  CHECK(r.steps_until_cross(70, 230) == 4096);
}

TEST_CASE("residency: bad input is refused, naming it", "[policy]") {
  using Catch::Contains;
  residency_config c;
  c.window_steps = 0;
  CHECK_THROWS_WITH(residency_predictor(c), Contains("window_steps"));
  c = {};
  c.horizon_steps = 0;
  CHECK_THROWS_WITH(residency_predictor(c), Contains("horizon_steps"));
  residency_predictor p;
  CHECK_THROWS_WITH(p.observe({-1, 0, 0, 0}), Contains("arrivals=-1"));
  CHECK_THROWS_WITH(p.observe({0, 0, 5, 0}), Contains("completed_steps"));
  CHECK_THROWS_WITH(p.steps_until_cross(-1, 3), Contains("load=-1"));
  CHECK(p.steps_observed() == 0);  // a refused observation changes nothing
}

TEST_CASE("switch_policy: the gate with a residency predictor refuses a short burst",
          "[policy]") {
  // EP 20 + 0.05 b, TP 10 + 0.1 b: B* = 200; at b = 260 EP is 3 ms faster per step.
  std::vector<latency_sample> ep, tp;
  for (double b : {1.0, 64.0, 512.0}) {
    ep.push_back({b, 20 + 0.05 * b});
    tp.push_back({b, 10 + 0.1 * b});
  }
  const calibration_result cal = calibrate(ep, tp);
  switch_policy_config c;
  c.t_high = 250;
  c.t_low = 200;
  c.cooldown_s = 0;
  c.gate_margin = 0.5;
  residency_config rc;
  rc.window_steps = 1;
  for (const bool sustained : {false, true}) {
    residency_predictor pred(rc);
    pred.observe({0, 1, 20, 0});  // requests run 20 steps
    // Burst: 260 running; 3 arrivals a step (the burst is ending: 260/20 = 13 complete) or
    // 20 a step (still growing).
    pred.observe({sustained ? 20 : 3, 0, 0, 260});
    switch_policy p(c);
    const switch_proposal prop = p.propose(260, parallel_mode::tp, 0);
    REQUIRE(prop.proposed());
    CHECK(prop.target == parallel_mode::ep);
    // The caller prices the proposal: the residency up to the rule's boundary (T_l after
    // entering EP), the step-time gate on the plan's cost (here 100 ms).
    CHECK(residency_boundary(c, parallel_mode::ep) == c.t_low);
    CHECK(residency_boundary(c, parallel_mode::tp) == c.t_high);
    const gate_evaluation g =
        weigh_step_time(cal.curves, parallel_mode::tp, prop.target, prop.load,
                        residency_steps(c, &pred, prop.load, prop.target), 100.0, c.gate_margin);
    const switch_decision d = p.decide(prop, {true, g});
    INFO(g);
    REQUIRE(g.evaluated);
    // Short: drift 3 - 13 = -10, (260 - 200 + 1) / 10 -> 7 steps x 3 ms = 21 ms < 150 ms.
    // Sustained: drift +7: the horizon, 4096 x 3 ms.
    CHECK(g.residency_steps == (sustained ? 4096 : 7));
    CHECK(g.gain_ms == Catch::Approx(3.0 * static_cast<double>(g.residency_steps)));
    CHECK(g.cost_ms == 100.0);
    CHECK(d.do_switch == sustained);
    CHECK(d.reason == (sustained ? decision_reason::above_high : decision_reason::cost_exceeds_gain));
  }
  // A cost estimate that is not a cost is an error, not a silent pass.
  residency_predictor pred;
  REQUIRE_MOEBIUS_ERROR(weigh_step_time(cal.curves, parallel_mode::tp, parallel_mode::ep, 260,
                                        residency_steps(c, &pred, 260, parallel_mode::ep), -1.0,
                                        c.gate_margin),
                        errc::invalid_argument, "finite and >= 0");
}

TEST_CASE("switch_policy: the predictor-driven gate in both directions matches a hand computation",
          "[policy]") {
  // The gate's numbers recomputed from the header's definitions alone, on random curves, loads,
  // rates and costs. The drift is an integer (running = k·S, window 1), so the expected
  // residency is exact integer arithmetic:
  //   enter EP at B >= T_h, stays until the load falls under T_l: d < 0: ceil((B - T_l + 1)/-d)
  //   enter TP at B <  T_l, stays until the load climbs to  T_h: d > 0: ceil((T_h - B)/d)
  //   otherwise the horizon; clamped to [1, horizon].
  // The EP -> TP half fails if leaving EP predicts the residency against T_l (the threshold of
  // the other direction) or with the entering-EP formula, or prices the switch at the cost to
  // EP.
  std::mt19937_64 rng(policy_test_seed() + 13);
  auto uni = [&](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  auto real = [&](double lo, double hi) {
    return std::uniform_real_distribution<double>(lo, hi)(rng);
  };
  auto ceil_div = [](int64_t n, int64_t d) { return (n + d - 1) / d; };
  int64_t to_tp_finite = 0, to_tp_threshold_matters = 0, to_tp_passed = 0, to_tp_refused = 0;
  int64_t to_ep_finite = 0;
  for (int trial = 0; trial < 400; ++trial) {
    // EP = ae + se·b, TP = at + st·b: TP cheaper at small batches, EP at large ones.
    const double ae = real(5, 40), se = real(0.01, 0.08);
    const double at = real(1, ae), st = real(se + 0.01, 0.3);
    std::vector<latency_sample> ep_s, tp_s;
    for (double b : {1.0, 100.0, 1000.0}) {
      ep_s.push_back({b, ae + se * b});
      tp_s.push_back({b, at + st * b});
    }
    const calibration_result cal = calibrate(ep_s, tp_s);

    switch_policy_config c;
    c.t_high = uni(20, 600);
    c.t_low = uni(10, c.t_high - 5);
    c.down_window = 1;
    c.rule = down_rule::every;
    c.cooldown_s = 0;
    c.gate_margin = uni(0, 1) ? 0.0 : static_cast<double>(uni(1, 10)) / 10.0;
    residency_config rc;
    rc.window_steps = 1;
    rc.horizon_steps = uni(50, 5000);
    const int64_t lifetime = uni(1, 300), k = uni(0, 20), arrivals = uni(0, 30);
    residency_predictor pred(rc);
    pred.observe({0, 1, lifetime, 0});
    pred.observe({arrivals, 0, 0, k * lifetime});
    const int64_t d = arrivals - k;  // requests per step, exactly

    const bool to_tp = uni(0, 3) != 0;  // mostly EP -> TP, the direction under test
    const parallel_mode current = to_tp ? parallel_mode::ep : parallel_mode::tp;
    const parallel_mode target = to_tp ? parallel_mode::tp : parallel_mode::ep;
    const int64_t load = to_tp ? uni(0, c.t_low - 1) : uni(c.t_high, 3 * c.t_high);
    int64_t want_res = rc.horizon_steps;
    if (to_tp && d > 0) want_res = ceil_div(c.t_high - load, d);
    if (!to_tp && d < 0) want_res = ceil_div(load - c.t_low + 1, -d);
    want_res = std::clamp<int64_t>(want_res, 1, rc.horizon_steps);
    if (to_tp && d > 0 && want_res < rc.horizon_steps) ++to_tp_finite;
    if (to_tp && d > 0 &&
        std::clamp<int64_t>(ceil_div(std::max<int64_t>(c.t_low - load, 1), d), 1,
                            rc.horizon_steps) != want_res) {
      ++to_tp_threshold_matters;
    }
    if (!to_tp && d < 0 && want_res < rc.horizon_steps) ++to_ep_finite;

    const double b = static_cast<double>(load);
    const double lat_current = to_tp ? ae + se * b : at + st * b;
    const double lat_target = to_tp ? at + st * b : ae + se * b;
    const double want_gain = (lat_current - lat_target) * static_cast<double>(want_res);
    // The costs into each mode differ, and sit clearly on one side of the gain (no ties).
    const double scale = std::max(std::abs(want_gain), 1.0) / (1.0 + c.gate_margin);
    const double cost_to_ep = scale * (uni(0, 1) ? real(0.2, 0.9) : real(1.1, 3.0));
    const double cost_to_tp = scale * (uni(0, 1) ? real(0.2, 0.9) : real(1.1, 3.0));
    const double want_cost = to_tp ? cost_to_tp : cost_to_ep;
    const bool want_pass = want_gain >= want_cost * (1.0 + c.gate_margin);

    switch_policy p(c);
    const switch_proposal prop = p.propose(load, current, 0.0);
    REQUIRE(prop.proposed());
    const gate_evaluation g =
        weigh_step_time(cal.curves, current, prop.target, prop.load,
                        residency_steps(c, &pred, prop.load, prop.target),
                        prop.target == parallel_mode::ep ? cost_to_ep : cost_to_tp, c.gate_margin);
    const switch_decision dec = p.decide(prop, {true, g});
    INFO("trial " << trial << " " << c << " load " << load << " drift " << d << " horizon "
                  << rc.horizon_steps << " " << g);
    REQUIRE(g.evaluated);
    CHECK(g.target == target);
    CHECK(g.load == load);
    CHECK(g.residency_steps == want_res);
    CHECK(g.gain_ms == Catch::Approx(want_gain).epsilon(1e-9).margin(1e-9));
    CHECK(g.cost_ms == want_cost);
    CHECK(g.passed == want_pass);
    CHECK(dec.do_switch == want_pass);
    CHECK(dec.target == target);
    CHECK(dec.reason == (want_pass
                             ? (to_tp ? decision_reason::below_low : decision_reason::above_high)
                             : decision_reason::cost_exceeds_gain));
    if (to_tp) (want_pass ? to_tp_passed : to_tp_refused) += 1;
  }
  // The draws reach the cases that tell the thresholds and the outcomes apart.
  CHECK(to_tp_finite > 40);
  CHECK(to_tp_threshold_matters > 40);
  CHECK(to_tp_passed > 20);
  CHECK(to_tp_refused > 20);
  CHECK(to_ep_finite > 10);
}
