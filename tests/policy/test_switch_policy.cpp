// Switch policy: hand-made traces (burst, quiet, oscillation, rollout decay, capacity refusal,
// cost gate) with hand-computed switch steps, and random traces checked step by step against
// a naive re-implementation of the rules that keeps the whole history in a vector.

#include <cmath>
#include <cstdint>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "moebius/error.hpp"
#include "moebius/policy/calibration.hpp"
#include "moebius/policy/step_time_gate.hpp"
#include "moebius/policy/switch_policy.hpp"
#include "policy_seed.hpp"
#include "support/catch.hpp"

using namespace moebius;
using moebius::testing::policy_test_seed;

namespace {

constexpr parallel_mode EP = parallel_mode::ep;
constexpr parallel_mode TP = parallel_mode::tp;

// A config with every cooldown off: the pure hysteresis rules.
switch_policy_config no_cooldown(int64_t t_high, int64_t t_low, int64_t up_w, int64_t down_w,
                                 down_rule rule) {
  switch_policy_config c;
  c.t_high = t_high;
  c.t_low = t_low;
  c.up_window = up_w;
  c.down_window = down_w;
  c.rule = rule;
  c.cooldown_steps = 0;
  c.cooldown_s = 0.0;
  return c;
}

struct trace_result {
  std::vector<int64_t> switch_steps;
  std::vector<parallel_mode> switch_targets;
  std::vector<switch_decision> decisions;
  parallel_mode final_mode;
};

// Runs `loads` through `policy` with an engine that obeys every proposed switch; step i
// happens at time i·dt seconds.
trace_result run_trace(switch_policy& policy, parallel_mode start,
                       const std::vector<int64_t>& loads, double dt = 1.0, double t0 = 0.0) {
  trace_result r;
  parallel_mode mode = start;
  for (size_t i = 0; i < loads.size(); ++i) {
    const switch_decision d = policy.step(loads[i], mode, t0 + static_cast<double>(i) * dt);
    r.decisions.push_back(d);
    if (d.do_switch) {
      r.switch_steps.push_back(static_cast<int64_t>(i));
      r.switch_targets.push_back(d.target);
      mode = d.target;
    }
  }
  r.final_mode = mode;
  return r;
}

std::vector<int64_t> concat(std::initializer_list<std::pair<int64_t, int64_t>> runs) {
  std::vector<int64_t> v;
  for (auto [load, count] : runs) v.insert(v.end(), static_cast<size_t>(count), load);
  return v;
}

// ---- the naive reference -------------------------------------------------------------------
// Keeps every load observed since the last switch in a vector and re-reads the tail on each
// step. Shares no code with switch_policy.
struct naive_policy {
  switch_policy_config cfg;
  std::vector<int64_t> since;  // loads observed in the current mode since the last switch
  // The signals beside each load, as the rules count them (each with its config flag).
  std::vector<uint8_t> since_blocked, since_gain;
  std::optional<int64_t> last_switch_step;
  double last_switch_time = 0;
  std::optional<parallel_mode> expected;
  int64_t t = 0;
  const latency_curves* curves = nullptr;
  double cost_to[2]{};

  // capacity(target) -> fits
  template <class Capacity>
  switch_decision step(int64_t load, parallel_mode mode, double now, Capacity&& capacity,
                       bool blocked = false, bool sustained = false) {
    const int64_t idx = t++;
    if (expected.has_value() && *expected != mode) {
      since.clear();
      since_blocked.clear();
      since_gain.clear();
      last_switch_step = idx;
      last_switch_time = now;
    }
    expected = mode;
    since.push_back(load);
    since_blocked.push_back(blocked && cfg.enter_on_blocked_admission);
    since_gain.push_back(sustained && cfg.enter_on_sustained_gain);

    switch_decision d;
    const size_t n = since.size();
    if (mode == TP) {
      const size_t w = static_cast<size_t>(cfg.up_window);
      bool all_high = n >= w;
      for (size_t i = 0; all_high && i < w; ++i) {
        const size_t k = n - 1 - i;
        all_high = since[k] >= cfg.t_high || since_blocked[k] != 0 || since_gain[k] != 0;
      }
      if (all_high) {
        d.target = EP;
        d.reason = since[n - 1] >= cfg.t_high  ? decision_reason::above_high
                   : since_blocked[n - 1] != 0 ? decision_reason::admission_blocked
                                               : decision_reason::sustained_gain;
      }
    } else {
      const size_t w = static_cast<size_t>(cfg.down_window);
      if (n >= w) {
        bool below;
        if (cfg.rule == down_rule::mean) {
          double sum = 0;
          for (size_t i = n - w; i < n; ++i) sum += static_cast<double>(since[i]);
          below = sum / static_cast<double>(w) < static_cast<double>(cfg.t_low);
        } else {
          below = true;
          for (size_t i = n - w; i < n; ++i) below = below && since[i] < cfg.t_low;
        }
        if (below) {
          d.target = TP;
          d.reason = decision_reason::below_low;
        }
      }
    }
    if (d.reason == decision_reason::hold) return d;

    const bool cooling = last_switch_step.has_value() &&
                         (idx - *last_switch_step <= cfg.cooldown_steps ||
                          now - last_switch_time < cfg.cooldown_s);
    if (cooling) {
      d.reason = decision_reason::cooldown;
      return d;
    }
    if (!capacity(d.target)) {
      d.reason = decision_reason::capacity_refused;
      return d;
    }
    if (curves != nullptr && cfg.expected_residency_steps > 0) {
      const double b = static_cast<double>(load);
      const double gain = (curves->latency_ms(mode, b) - curves->latency_ms(d.target, b)) *
                          static_cast<double>(cfg.expected_residency_steps);
      if (gain < cost_to[d.target == EP ? 0 : 1] * (1.0 + cfg.gate_margin)) {
        d.reason = decision_reason::cost_exceeds_gain;
        return d;
      }
    }
    d.do_switch = true;
    since.clear();
    since_blocked.clear();
    since_gain.clear();
    last_switch_step = idx;
    last_switch_time = now;
    expected = d.target;
    return d;
  }
};

// Capacity answers shared by the policy under test and the reference: a fixed random table
// indexed by (step, target), so the answer does not depend on how often it is asked.
struct capacity_table {
  std::vector<uint8_t> fits_ep, fits_tp;
  int64_t step = 0;
  bool fits(parallel_mode m) const {
    return (m == EP ? fits_ep : fits_tp)[static_cast<size_t>(step)] != 0;
  }
};

// One step as a caller of the two phases runs it: propose, then for a proposed switch price it
// (capacity from `fits`, and with `curves` the step-time gate at the config's fixed residency on
// the cost into the target, cost_to indexed EP, TP), then decide.
template <class Fits>
switch_decision priced_step(switch_policy& p, int64_t load, parallel_mode mode, double now,
                            Fits&& fits, const latency_curves* curves = nullptr,
                            const double* cost_to = nullptr, bool blocked = false,
                            bool sustained = false) {
  const switch_proposal prop = p.propose(load, mode, now, blocked, sustained);
  switch_pricing priced;
  if (prop.proposed()) {
    priced.fits = fits(prop.target);
    if (priced.fits && curves != nullptr)
      priced.gate = weigh_step_time(*curves, mode, prop.target, load,
                                    residency_steps(p.config(), nullptr, load, prop.target),
                                    cost_to[prop.target == EP ? 0 : 1], p.config().gate_margin);
  }
  return p.decide(prop, priced);
}

bool always_fits(parallel_mode) { return true; }

}  // namespace

TEST_CASE("switch_policy: burst -> one switch to EP after up_window steps", "[policy]") {
  switch_policy_config c = no_cooldown(256, 205, 3, 8, down_rule::mean);
  switch_policy p(c);
  const auto loads = concat({{50, 20}, {2000, 30}});
  const trace_result r = run_trace(p, TP, loads);
  REQUIRE(r.switch_steps == std::vector<int64_t>{22});  // steps 20, 21, 22 are >= T_h
  REQUIRE(r.switch_targets == std::vector<parallel_mode>{EP});
  CHECK(r.decisions[22].reason == decision_reason::above_high);
  CHECK(r.decisions[21].reason == decision_reason::hold);
  CHECK(p.stats().switches == 1);

  // Paper default up_window = 1: the first load >= T_h switches.
  switch_policy_config k = interactive_config(256);
  k.cooldown_s = 0;
  switch_policy fast(k);
  const std::vector<int64_t> loads2 = concat({{10, 5}, {256, 1}});
  const trace_result r2 = run_trace(fast, TP, loads2);
  CHECK(r2.switch_steps == std::vector<int64_t>{5});
}

TEST_CASE("switch_policy: quiet -> one switch to TP after the window", "[policy]") {
  const auto loads = concat({{1000, 10}, {10, 30}});
  SECTION("every rule: W consecutive loads below T_l") {
    switch_policy p(no_cooldown(256, 205, 1, 8, down_rule::every));
    const trace_result r = run_trace(p, EP, loads);
    REQUIRE(r.switch_steps == std::vector<int64_t>{17});  // loads 10..17 are the 8 quiet ones
    CHECK(r.switch_targets == std::vector<parallel_mode>{TP});
    CHECK(r.decisions[17].reason == decision_reason::below_low);
  }
  SECTION("mean rule: mean of the last W below T_l") {
    // At step 10+k the window holds (7-k) loads of 1000 and (k+1) of 10:
    // mean < 205 <=> 7010 - 990k < 1640 <=> k >= 6 -> step 16.
    switch_policy p(no_cooldown(256, 205, 1, 8, down_rule::mean));
    const trace_result r = run_trace(p, EP, loads);
    REQUIRE(r.switch_steps == std::vector<int64_t>{16});
  }
  SECTION("a short dip does not switch") {
    switch_policy p(no_cooldown(256, 205, 1, 8, down_rule::every));
    const auto dip = concat({{1000, 10}, {10, 7}, {1000, 10}, {10, 7}, {300, 5}});
    CHECK(run_trace(p, EP, dip).switch_steps.empty());
  }
}

TEST_CASE("switch_policy: hysteresis band and cooldown stop flapping", "[policy]") {
  std::mt19937_64 rng(policy_test_seed());
  SECTION("loads in [T_l, T_h) never switch, from either mode") {
    for (down_rule rule : {down_rule::mean, down_rule::every}) {
      for (parallel_mode start : {EP, TP}) {
        switch_policy p(no_cooldown(256, 205, 1, 4, rule));
        std::vector<int64_t> loads(2000);
        for (auto& l : loads) l = std::uniform_int_distribution<int64_t>(205, 255)(rng);
        const trace_result r = run_trace(p, start, loads);
        CHECK(r.switch_steps.empty());
        CHECK(p.stats().by_reason[static_cast<int>(decision_reason::hold)] == 2000);
      }
    }
  }
  SECTION("load flipping across both thresholds: switches at least cooldown_steps apart") {
    switch_policy_config c = no_cooldown(256, 205, 1, 1, down_rule::every);
    c.cooldown_steps = 7;
    switch_policy p(c);
    std::vector<int64_t> loads;
    for (int i = 0; i < 200; ++i) loads.push_back(i % 2 == 0 ? 10 : 1000);
    const trace_result r = run_trace(p, TP, loads);
    // Worked by hand: step 1 (1000, in TP) switches; steps 2..8 are the 7 cooldown steps; the
    // first step after them whose load points the other way is 10 (load 10, in EP); and so on
    // every 9 steps: 1, 10, 19, ..., 199. Between two switches the rule fires and is held by
    // the cooldown on the 4 steps of the other load (2, 4, 6, 8): 4 x 22 gaps.
    std::vector<int64_t> want;
    for (int64_t s = 1; s < 200; s += 9) want.push_back(s);
    CHECK(r.switch_steps == want);
    for (size_t i = 1; i < r.switch_steps.size(); ++i) {
      CHECK(r.switch_steps[i] - r.switch_steps[i - 1] > 7);
    }
    CHECK(p.stats().by_reason[static_cast<int>(decision_reason::cooldown)] == 4 * 22);
    CHECK(p.stats().switches == 23);
    // Without the cooldown the same trace flaps on every step.
    switch_policy flappy(no_cooldown(256, 205, 1, 1, down_rule::every));
    CHECK(run_trace(flappy, TP, loads).switch_steps.size() == 199);
  }
  SECTION("cooldown in seconds") {
    switch_policy_config c = no_cooldown(256, 205, 1, 1, down_rule::every);
    c.cooldown_s = 5.0;
    switch_policy p(c);
    std::vector<int64_t> loads;
    for (int i = 0; i < 100; ++i) loads.push_back(i % 2 == 0 ? 1000 : 10);
    const trace_result r = run_trace(p, TP, loads, 0.5);  // 10 steps per 5 s
    // Worked by hand: step 0 (1000, in TP) switches at 0 s; 5 s later is step 10, whose load
    // (1000) keeps EP, so step 11 (10) switches back at 5.5 s; then every 11 steps: 0, 11,
    // ..., 99.
    std::vector<int64_t> want;
    for (int64_t s = 0; s < 100; s += 11) want.push_back(s);
    CHECK(r.switch_steps == want);
    REQUIRE(r.switch_steps.size() >= 5);
    CHECK(r.switch_steps[0] == 0);
    for (size_t i = 1; i < r.switch_steps.size(); ++i) {
      CHECK(static_cast<double>(r.switch_steps[i] - r.switch_steps[i - 1]) * 0.5 >= 5.0);
    }
  }
}

TEST_CASE("switch_policy: rollout decay switches at the first load under T_h", "[policy]") {
  std::mt19937_64 rng(policy_test_seed() + 1);
  switch_policy p(rollout_config(256));
  CHECK(p.config().t_low == 256);
  CHECK(p.config().down_window == 1);
  parallel_mode mode = EP;
  for (int rollout_step = 0; rollout_step < 5; ++rollout_step) {
    int64_t load = 2048;
    int64_t first_under = -1;
    std::vector<int64_t> loads;
    while (load > 0) {
      loads.push_back(load);
      if (load < 256 && first_under < 0) first_under = static_cast<int64_t>(loads.size()) - 1;
      load -= std::uniform_int_distribution<int64_t>(0, 40)(rng);
    }
    loads.push_back(0);
    if (first_under < 0) first_under = static_cast<int64_t>(loads.size()) - 1;
    const trace_result r = run_trace(p, mode, loads, 1.0, 1e4 * rollout_step);
    if (rollout_step == 0) {
      REQUIRE(r.switch_steps == std::vector<int64_t>{first_under});
    } else {
      // Starts in TP from the previous tail: back to EP at once, to TP at the first < 256.
      REQUIRE(r.switch_steps == std::vector<int64_t>{0, first_under});
    }
    CHECK(r.final_mode == TP);
    mode = r.final_mode;
  }
}

TEST_CASE("switch_policy: a switch the target cannot hold is refused and reported", "[policy]") {
  bool tp_fits = false;
  const auto fits = [&tp_fits](parallel_mode m) { return m == EP || tp_fits; };
  switch_policy p(no_cooldown(256, 205, 1, 4, down_rule::every));
  for (int i = 0; i < 3; ++i) CHECK(priced_step(p, 10, EP, i, fits).reason == decision_reason::hold);
  for (int i = 3; i < 10; ++i) {
    const switch_decision d = priced_step(p, 10, EP, i, fits);
    CHECK_FALSE(d.do_switch);
    CHECK(d.reason == decision_reason::capacity_refused);
    CHECK(d.target == TP);
    CHECK(d.blocked());
  }
  std::ostringstream os;
  os << priced_step(p, 10, EP, 10, fits);
  CHECK(os.str() == "stay: TP refused (capacity_refused)");
  tp_fits = true;
  const switch_decision d = priced_step(p, 10, EP, 11, fits);
  CHECK(d.do_switch);
  CHECK(d.target == TP);
  CHECK(p.stats().by_reason[static_cast<int>(decision_reason::capacity_refused)] == 8);
}

TEST_CASE("switch_policy: cost gate refuses a switch that does not pay for itself",
          "[policy]") {
  // EP 20 + 0.05 b, TP 10 + 0.1 b: at b = 10, TP is 9.5 ms faster per step.
  std::vector<latency_sample> ep, tp;
  for (double b : {1.0, 64.0, 512.0}) {
    ep.push_back({b, 20 + 0.05 * b});
    tp.push_back({b, 10 + 0.1 * b});
  }
  const calibration_result cal = calibrate(ep, tp);
  switch_policy_config c = no_cooldown(256, 205, 1, 1, down_rule::every);
  c.expected_residency_steps = 100;  // gain 950 ms at b = 10
  {
    switch_policy p(c);
    const double cost[2] = {150.0, 951.0};
    const switch_decision d = priced_step(p, 10, EP, 0, always_fits, &cal.curves, cost);
    CHECK(d.reason == decision_reason::cost_exceeds_gain);
    CHECK_FALSE(d.do_switch);
  }
  {
    switch_policy p(c);
    const double cost[2] = {150.0, 949.0};
    CHECK(priced_step(p, 10, EP, 0, always_fits, &cal.curves, cost).do_switch);
  }
  {  // residency 0 turns the gate off
    c.expected_residency_steps = 0;
    switch_policy p(c);
    const double cost[2] = {1e9, 1e9};
    CHECK(priced_step(p, 10, EP, 0, always_fits, &cal.curves, cost).do_switch);
  }
}

TEST_CASE("switch_policy: failed and external switches restart the cooldown", "[policy]") {
  switch_policy_config c = no_cooldown(256, 205, 1, 1, down_rule::every);
  c.cooldown_steps = 3;
  switch_policy p(c);
  CHECK(p.step(1000, TP, 0).do_switch);  // proposes EP ...
  // ... but the switch failed and rolled back: the engine is still in TP.
  CHECK(p.step(1000, TP, 1).reason == decision_reason::cooldown);
  CHECK(p.stats().external_switches == 1);
  CHECK(p.step(1000, TP, 2).reason == decision_reason::cooldown);
  CHECK(p.step(1000, TP, 3).reason == decision_reason::cooldown);
  CHECK(p.step(1000, TP, 4).reason == decision_reason::cooldown);
  CHECK(p.step(1000, TP, 5).do_switch);  // 4 steps after the observed change at step 1
}

TEST_CASE("switch_policy: config validation names the constraint", "[policy]") {
  auto fails_with = [](switch_policy_config c, const std::string& needle) {
    try {
      validate(c);
    } catch (const moebius::error& e) {
      CHECK(e.code() == errc::invalid_argument);
      CHECK_THAT(e.what(), Catch::Contains(needle));
      return;
    }
    FAIL("no error for " << needle);
  };
  switch_policy_config c;
  c.t_low = 300;
  fails_with(c, "T_l must lie in [1, T_h]");
  c = {};
  c.t_high = 0;
  fails_with(c, "T_h must lie in");
  c = {};
  c.down_window = 0;
  fails_with(c, "down_window W must lie in [1, 256]");
  c = {};
  c.down_window = 257;
  fails_with(c, "down_window W must lie in [1, 256]");
  c = {};
  c.up_window = 0;
  fails_with(c, "up_window must lie in");
  c = {};
  c.cooldown_s = std::nan("");
  fails_with(c, "cooldown_s must be finite");
  c = {};
  c.cooldown_steps = -1;
  fails_with(c, "cooldown_steps must be >= 0");
  c = {};
  c.expected_residency_steps = -1;
  fails_with(c, "expected_residency_steps");
  c = {};
  c.gate_margin = -0.1;
  fails_with(c, "gate_margin");
  c.gate_margin = std::nan("");
  fails_with(c, "gate_margin");
  CHECK_THROWS_AS(switch_policy(c), moebius::error);
  CHECK_THROWS_AS(interactive_config(256, 1.5), moebius::error);
  CHECK(interactive_config(256).t_low == 205);  // paper: 0.8 * 256 = 204.8 -> 205
  switch_policy ok{switch_policy_config{}};
  CHECK_THROWS_AS(ok.step(-1, EP, 0), moebius::error);
}

TEST_CASE("switch_policy: random traces match the naive rules", "[policy]") {
  std::mt19937_64 rng(policy_test_seed() + 2);
  auto uni = [&](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  std::vector<latency_sample> ep, tp;
  for (double b : {1.0, 16.0, 64.0}) {
    ep.push_back({b, 20 + 0.5 * b});
    tp.push_back({b, 10 + 1.0 * b});
  }
  const calibration_result cal = calibrate(ep, tp);

  int64_t total_switches = 0;
  for (int trial = 0; trial < 300; ++trial) {
    switch_policy_config c;
    c.t_high = uni(2, 60);
    c.t_low = uni(1, c.t_high);
    c.up_window = uni(1, 6);
    c.down_window = uni(1, trial % 10 == 0 ? 256 : 12);
    c.rule = uni(0, 1) ? down_rule::mean : down_rule::every;
    c.cooldown_steps = uni(0, 1) ? 0 : uni(0, 12);
    c.cooldown_s = uni(0, 1) ? 0.0 : static_cast<double>(uni(0, 30)) / 10.0;
    c.expected_residency_steps = uni(0, 2) == 0 ? uni(1, 50) : 0;
    c.gate_margin = uni(0, 1) ? 0.0 : static_cast<double>(uni(0, 20)) / 10.0;
    c.enter_on_blocked_admission = uni(0, 1) != 0;
    c.enter_on_sustained_gain = uni(0, 1) != 0;
    const int64_t signal_pct = uni(0, 1) ? 0 : uni(1, 60);  // how often each signal is raised
    INFO("trial " << trial << ": " << c);

    const int64_t steps = 600;
    capacity_table table;
    const int refuse_pct = static_cast<int>(uni(0, 1) ? 0 : uni(1, 50));
    for (int64_t i = 0; i < steps; ++i) {
      table.fits_ep.push_back(uni(0, 99) >= refuse_pct);
      table.fits_tp.push_back(uni(0, 99) >= refuse_pct);
    }
    switch_policy p(c);
    naive_policy ref;
    ref.cfg = c;
    const double cost_ep = static_cast<double>(uni(0, 400));
    const double cost_tp = static_cast<double>(uni(0, 400));
    const double cost_to[2] = {cost_ep, cost_tp};
    const latency_curves* gated = nullptr;
    if (uni(0, 1)) {
      gated = &cal.curves;
      ref.curves = &cal.curves;
      ref.cost_to[0] = cost_ep;
      ref.cost_to[1] = cost_tp;
    }

    // Loads: a random walk with jumps, centred near the thresholds.
    parallel_mode mode = uni(0, 1) ? EP : TP;
    int64_t load = uni(0, 2 * c.t_high);
    double now = 0;
    for (int64_t i = 0; i < steps; ++i) {
      table.step = i;
      if (uni(0, 19) == 0) {
        load = uni(0, 3 * c.t_high);
      } else {
        load = std::max<int64_t>(0, load + uni(-3, 3));
      }
      now += static_cast<double>(uni(0, 10)) / 10.0;
      const bool blocked = uni(0, 99) < signal_pct;
      const bool sustained = uni(0, 99) < signal_pct;
      const switch_decision got = priced_step(
          p, load, mode, now, [&](parallel_mode m) { return table.fits(m); }, gated, cost_to,
          blocked, sustained);
      const switch_decision want = ref.step(
          load, mode, now, [&](parallel_mode m) { return table.fits(m); }, blocked, sustained);
      INFO("step " << i << " load " << load << " mode " << to_string(mode) << ": got " << got
                   << ", want " << want);
      REQUIRE(got.do_switch == want.do_switch);
      REQUIRE(got.reason == want.reason);
      if (want.reason != decision_reason::hold) REQUIRE(got.target == want.target);
      // The engine: obeys 90% of proposals (a failed switch rolls back), and 1% of the time
      // an operator switches on its own.
      if (got.do_switch && uni(0, 9) != 0) mode = got.target;
      if (uni(0, 99) == 0) mode = mode == EP ? TP : EP;
      total_switches += got.do_switch;
    }
  }
  CHECK(total_switches > 300);  // the traces did exercise switching
}
