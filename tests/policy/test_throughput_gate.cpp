// The throughput gate (policy/throughput_gate.hpp): the header's worked example, random loads
// against a step-by-step count of the tokens each mode makes, equal batches against the
// step-time gate of switch_policy, the residency's sources and each term turned off, bad
// input; and switch_policy's blocked-admission rule and gate hook.
#include <algorithm>
#include <cmath>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "layout/error_matchers.hpp"
#include "moebius/error.hpp"
#include "moebius/policy/calibration.hpp"
#include "moebius/policy/step_time_gate.hpp"
#include "moebius/policy/switch_policy.hpp"
#include "moebius/policy/throughput_gate.hpp"
#include "policy_seed.hpp"
#include "support/catch.hpp"

using namespace moebius;
using moebius::testing::policy_test_seed;

namespace {

// EP 30 + 0.02·b ms, TP 20 + 0.08·b ms on [1, 2048] (the header's example; crossover 166.7).
latency_curves example_curves() {
  latency_curves c;
  const std::vector<latency_sample> ep = {{1, 30.02}, {2048, 30 + 0.02 * 2048}};
  const std::vector<latency_sample> tp = {{1, 20.08}, {2048, 20 + 0.08 * 2048}};
  c.ep = latency_curve::fit(ep, curve_fit::least_squares_line);
  c.tp = latency_curve::fit(tp, curve_fit::least_squares_line);
  return c;
}

parallel_mode other(parallel_mode m) {
  return m == parallel_mode::ep ? parallel_mode::tp : parallel_mode::ep;
}

}  // namespace

TEST_CASE("throughput gate: the header's worked example", "[policy][gate]") {
  const latency_curves c = example_curves();
  serving_load l;
  l.running = 300;
  l.waiting = 500;
  l.max_running = 2048;
  l.admits_tp = 300;
  l.admits_ep = 600;
  l.predicted_residency_steps = 200;
  gate_terms no_queue;
  no_queue.queueing = false;
  const gate_evaluation g = weigh_switch(c, parallel_mode::tp, parallel_mode::ep, l, 150, 0, no_queue);
  CHECK(g.current_batch == 300);
  CHECK(g.target_batch == 600);
  CHECK(g.residency_steps == 200);
  CHECK(g.gain_ms == Catch::Approx(4600).epsilon(1e-9));
  CHECK(g.passed);
  no_queue.admission = false;
  const gate_evaluation same = weigh_switch(c, parallel_mode::tp, parallel_mode::ep, l, 150, 0, no_queue);
  CHECK(same.current_batch == 800);
  CHECK(same.target_batch == 800);
  CHECK(same.gain_ms == Catch::Approx(7600).epsilon(1e-9));

  // Under the crossover with TP's pool full: only the admission term says EP pays.
  serving_load small;
  small.running = 60;
  small.waiting = 60;
  small.max_running = 2048;
  small.admits_tp = 60;
  small.admits_ep = 120;
  small.predicted_residency_steps = 100;
  gate_terms t;
  t.queueing = false;
  CHECK(weigh_switch(c, parallel_mode::tp, parallel_mode::ep, small, 150, 0, t).passed);
  t.admission = false;
  const gate_evaluation off = weigh_switch(c, parallel_mode::tp, parallel_mode::ep, small, 150, 0, t);
  CHECK_FALSE(off.passed);
  CHECK(off.gain_ms < 0);
}

TEST_CASE("throughput gate: random loads against a count of the tokens each mode makes",
          "[policy][gate]") {
  std::mt19937_64 rng(policy_test_seed() ^ 0x7467);
  const latency_curves c = example_curves();
  for (int trial = 0; trial < 300; ++trial) {
    serving_load l;
    l.running = std::uniform_int_distribution<int64_t>(0, 3000)(rng);
    l.waiting = std::uniform_int_distribution<int64_t>(0, 3000)(rng);
    l.max_running = std::uniform_int_distribution<int64_t>(1, 2048)(rng);
    l.admits_ep = std::uniform_int_distribution<int64_t>(0, 4000)(rng);
    l.admits_tp = std::uniform_int_distribution<int64_t>(0, 4000)(rng);
    l.queue_tokens = std::uniform_real_distribution<double>(0, 1e6)(rng);
    l.predicted_residency_steps = std::uniform_int_distribution<int64_t>(1, 5000)(rng);
    l.known_residency_steps = std::uniform_int_distribution<int64_t>(-1, 5000)(rng);
    gate_terms t;
    t.admission = rng() & 1;
    t.queueing = rng() & 1;
    t.known_work = rng() & 1;
    const parallel_mode cur = rng() & 1 ? parallel_mode::ep : parallel_mode::tp;
    const double switch_ms = std::uniform_real_distribution<double>(0, 500)(rng);
    const double margin = std::uniform_real_distribution<double>(0, 1)(rng);
    const gate_evaluation g = weigh_switch(c, cur, other(cur), l, switch_ms, margin, t);
    CAPTURE(trial, l.running, l.waiting, l.max_running, l.admits_ep, l.admits_tp, t.admission,
            t.queueing, t.known_work);

    // The batches, written out.
    auto batch = [&](parallel_mode m) {
      int64_t want = l.running + l.waiting;
      if (want > l.max_running) want = l.max_running;
      if (t.admission && want > l.admits(m)) want = l.admits(m);
      return want < 1 ? int64_t{1} : want;
    };
    REQUIRE(g.current_batch == batch(cur));
    REQUIRE(g.target_batch == batch(other(cur)));
    // The residency: the largest of the sources in force.
    int64_t r = t.known_work && l.known_residency_steps >= 0
                    ? std::max<int64_t>(1, l.known_residency_steps)
                    : l.predicted_residency_steps;
    if (t.queueing && l.waiting > 0)
      r = std::max<int64_t>(r, static_cast<int64_t>(std::ceil(l.queue_tokens / static_cast<double>(batch(other(cur))))));
    REQUIRE(g.residency_steps == r);
    // The gain: the current mode's time for r steps, less the time the target takes to make
    // the same tokens, counted step by step (its last step partial).
    double cur_ms = 0, tokens = 0;
    for (int64_t s = 0; s < r; ++s) {
      cur_ms += c.latency_ms(cur, static_cast<double>(g.current_batch));
      tokens += static_cast<double>(g.current_batch);
    }
    const double tgt_steps = tokens / static_cast<double>(g.target_batch);
    const double tgt_ms = tgt_steps * c.latency_ms(other(cur), static_cast<double>(g.target_batch));
    REQUIRE(g.gain_ms == Catch::Approx(cur_ms - tgt_ms).epsilon(1e-9).margin(1e-6));
    REQUIRE(g.passed == (g.gain_ms >= switch_ms * (1 + margin)));
    REQUIRE(g.load == l.running + l.waiting);
    REQUIRE(g.waiting == l.waiting);
  }
}

TEST_CASE("throughput gate: with equal batches it is the step-time gate", "[policy][gate]") {
  std::mt19937_64 rng(policy_test_seed() ^ 0x5eed);
  const latency_curves c = example_curves();
  for (int trial = 0; trial < 50; ++trial) {
    // Outside the band [T_l, T_h) = [160, 200), where a rule fires.
    int64_t load = std::uniform_int_distribution<int64_t>(1, 2048 - 40)(rng);
    if (load >= 160) load += 40;
    const int64_t residency = std::uniform_int_distribution<int64_t>(1, 3000)(rng);
    const double cost = std::uniform_real_distribution<double>(1, 400)(rng);
    switch_policy_config cfg = interactive_config(200);
    cfg.expected_residency_steps = residency;
    cfg.down_window = 1;
    switch_policy p(cfg);
    const parallel_mode cur = load >= 200 ? parallel_mode::tp : parallel_mode::ep;
    const switch_proposal prop = p.propose(load, cur, 0);
    REQUIRE(prop.proposed());
    const gate_evaluation step_time =
        weigh_step_time(c, cur, prop.target, load, residency_steps(cfg, nullptr, load, prop.target),
                        cost, 0);
    REQUIRE(step_time.evaluated);
    serving_load l;
    l.running = load;
    l.max_running = 2048;
    l.predicted_residency_steps = residency;
    gate_terms t;
    t.admission = false;
    const gate_evaluation g = weigh_switch(c, cur, other(cur), l, cost, 0, t);
    CAPTURE(load, residency);
    REQUIRE(g.gain_ms == Catch::Approx(step_time.gain_ms).epsilon(1e-9).margin(1e-6));
    REQUIRE(g.passed == step_time.passed);
  }
}

TEST_CASE("throughput gate: where the residency comes from", "[policy][gate]") {
  const latency_curves c = example_curves();
  serving_load l;
  l.running = 100;
  l.max_running = 2048;
  l.admits_ep = l.admits_tp = 4096;
  l.predicted_residency_steps = 7;
  l.known_residency_steps = 900;
  gate_evaluation g = weigh_switch(c, parallel_mode::ep, parallel_mode::tp, l, 10, 0);
  CHECK(g.residency_steps == 900);
  CHECK(std::string(g.residency_from) == "known work");
  gate_terms t;
  t.known_work = false;
  g = weigh_switch(c, parallel_mode::ep, parallel_mode::tp, l, 10, 0, t);
  CHECK(g.residency_steps == 7);
  CHECK(std::string(g.residency_from) == "predictor");
  // A queue of 50 requests expecting 20,000 tokens at the target's batch of 150: 134 steps.
  l.known_residency_steps = -1;
  l.waiting = 50;
  l.queue_tokens = 20000;
  g = weigh_switch(c, parallel_mode::ep, parallel_mode::tp, l, 10, 0);
  CHECK(g.residency_steps == 134);
  CHECK(std::string(g.residency_from) == "queue");
  t = {};
  t.queueing = false;
  CHECK(weigh_switch(c, parallel_mode::ep, parallel_mode::tp, l, 10, 0, t).residency_steps == 7);
  std::ostringstream os;
  os << g;
  CHECK(os.str().find("(batch 150 now, 150 in TP, 50 waiting)") != std::string::npos);
  CHECK(os.str().find("over 134 steps (queue)") != std::string::npos);
}

TEST_CASE("throughput gate: bad input is refused by name", "[policy][gate]") {
  const latency_curves c = example_curves();
  serving_load l;
  l.running = 10;
  auto refused = [&](const serving_load& x, parallel_mode cur, parallel_mode tgt, double ms,
                     double margin, const char* what) {
    try {
      weigh_switch(c, cur, tgt, x, ms, margin);
      FAIL("accepted: " << what);
    } catch (const moebius::error& e) {
      CHECK(e.code() == errc::invalid_argument);
      CHECK(std::string(e.what()).find(what) != std::string::npos);
    }
  };
  refused(l, parallel_mode::ep, parallel_mode::ep, 1, 0, "both EP");
  refused(l, parallel_mode::ep, static_cast<parallel_mode>(7), 1, 0, "target");
  serving_load bad = l;
  bad.waiting = -1;
  refused(bad, parallel_mode::ep, parallel_mode::tp, 1, 0, "counts must be >= 0");
  bad = l;
  bad.max_running = 0;
  refused(bad, parallel_mode::ep, parallel_mode::tp, 1, 0, "max_running");
  bad = l;
  bad.queue_tokens = std::nan("");
  refused(bad, parallel_mode::ep, parallel_mode::tp, 1, 0, "queue_tokens");
  bad = l;
  bad.predicted_residency_steps = 0;
  refused(bad, parallel_mode::ep, parallel_mode::tp, 1, 0, "predicted_residency_steps");
  refused(l, parallel_mode::ep, parallel_mode::tp, -1, 0, "switch_ms");
  refused(l, parallel_mode::ep, parallel_mode::tp, 1, INFINITY, "margin");
}

TEST_CASE("switch policy: blocked admission enters EP only when configured", "[policy][gate]") {
  switch_policy_config cfg = interactive_config(256);
  cfg.cooldown_s = 0;
  cfg.up_window = 2;
  {
    switch_policy paper(cfg);
    for (int s = 0; s < 5; ++s) CHECK(paper.step(40, parallel_mode::tp, s, true).reason == decision_reason::hold);
  }
  cfg.enter_on_blocked_admission = true;
  switch_policy ours(cfg);
  CHECK(ours.step(40, parallel_mode::tp, 0, true).reason == decision_reason::hold);  // 1 of 2
  CHECK(ours.step(40, parallel_mode::tp, 1, false).reason == decision_reason::hold);  // restarts
  CHECK(ours.step(40, parallel_mode::tp, 2, true).reason == decision_reason::hold);
  const switch_decision d = ours.step(40, parallel_mode::tp, 3, true);
  CHECK(d.do_switch);
  CHECK(d.target == parallel_mode::ep);
  CHECK(d.reason == decision_reason::admission_blocked);
  // In EP the flag means nothing: the load 40 < T_l leads back to TP once the window is full.
  for (int s = 4; s < 4 + cfg.down_window; ++s) ours.step(40, parallel_mode::ep, s, true);
  CHECK(ours.stats().by_reason[static_cast<int>(decision_reason::below_low)] == 1);
}

TEST_CASE("switch policy: a sustained gain enters EP only when configured, after the others",
          "[policy][gate]") {
  switch_policy_config cfg = interactive_config(256);
  cfg.cooldown_s = 0;
  cfg.up_window = 2;
  {
    switch_policy paper(cfg);
    for (int s = 0; s < 5; ++s)
      CHECK(paper.step(40, parallel_mode::tp, s, false, true).reason == decision_reason::hold);
  }
  cfg.enter_on_sustained_gain = true;
  switch_policy ours(cfg);
  CHECK(ours.step(40, parallel_mode::tp, 0, false, true).reason ==
        decision_reason::hold);  // 1 of 2
  CHECK(ours.step(40, parallel_mode::tp, 1, false, false).reason ==
        decision_reason::hold);  // restarts
  CHECK(ours.step(40, parallel_mode::tp, 2, false, true).reason == decision_reason::hold);
  // Blocked admission is not configured: it counts for nothing, the gain alone switches.
  const switch_decision d = ours.step(40, parallel_mode::tp, 3, true, true);
  CHECK(d.do_switch);
  CHECK(d.target == parallel_mode::ep);
  CHECK(d.reason == decision_reason::sustained_gain);
  CHECK(to_string(d.reason) == std::string("sustained_gain"));
  // In EP the signal means nothing: the load 40 < T_l leads back to TP once the window is full.
  for (int s = 4; s < 4 + cfg.down_window; ++s) ours.step(40, parallel_mode::ep, s, false, true);
  CHECK(ours.stats().by_reason[static_cast<int>(decision_reason::below_low)] == 1);

  // With every rule on, the reason names the first that holds: the load, then the pool, then
  // the gain; a run of observations mixing them fills one window.
  cfg.enter_on_blocked_admission = true;
  const auto first = [&](int64_t load, bool blocked) {
    switch_policy p(cfg);
    CHECK(p.step(40, parallel_mode::tp, 0, true, false).reason == decision_reason::hold);
    return p.step(load, parallel_mode::tp, 1, blocked, true).reason;
  };
  CHECK(first(300, true) == decision_reason::above_high);
  CHECK(first(40, true) == decision_reason::admission_blocked);
  CHECK(first(40, false) == decision_reason::sustained_gain);
}

TEST_CASE("switch policy: decide settles the proposal as the caller priced it", "[policy][gate]") {
  switch_policy_config cfg = interactive_config(100);
  cfg.cooldown_s = 0;
  switch_policy p(cfg);
  // No rule fired: a hold, whatever the pricing says (nothing was planned).
  const switch_proposal quiet = p.propose(50, parallel_mode::tp, 0);
  CHECK_FALSE(quiet.proposed());
  CHECK(p.decide(quiet, {false, {}}).reason == decision_reason::hold);
  // A gate that refuses: cost_exceeds_gain, no switch, the windows run on.
  const switch_proposal up = p.propose(150, parallel_mode::tp, 1);
  REQUIRE(up.proposed());
  CHECK(up.target == parallel_mode::ep);
  CHECK(up.load == 150);
  gate_evaluation refused;
  refused.evaluated = true;
  refused.target = up.target;
  refused.gain_ms = 12;
  refused.cost_ms = 34;
  refused.passed = false;
  CHECK(p.decide(up, {true, refused}).reason == decision_reason::cost_exceeds_gain);
  // Capacity before the gate: a target that cannot hold the live KV is refused for that, even
  // when the gate would pass.
  gate_evaluation passes = refused;
  passes.passed = true;
  const switch_proposal again = p.propose(150, parallel_mode::tp, 2);
  CHECK(p.decide(again, {false, passes}).reason == decision_reason::capacity_refused);
  // No gate weighed it (evaluated false): capacity alone decides.
  const switch_proposal third = p.propose(150, parallel_mode::tp, 3);
  const switch_decision d = p.decide(third, {true, {}});
  CHECK(d.do_switch);
  CHECK(d.target == parallel_mode::ep);
  CHECK(d.reason == decision_reason::above_high);
  CHECK(p.stats().switches == 1);
  // The cooldown of the switch is counted from the proposal's time.
  switch_policy_config cooled = interactive_config(100);
  cooled.cooldown_s = 5;
  cooled.down_window = 1;
  switch_policy q(cooled);
  CHECK(q.decide(q.propose(150, parallel_mode::tp, 10), {}).do_switch);
  const switch_proposal soon = q.propose(10, parallel_mode::ep, 14.9);
  CHECK(soon.reason == decision_reason::cooldown);
  CHECK_FALSE(q.decide(soon, {}).do_switch);
  const switch_proposal later = q.propose(10, parallel_mode::ep, 15.1);
  CHECK(later.reason == decision_reason::below_low);
  CHECK(q.decide(later, {}).do_switch);
}

TEST_CASE("switch policy: one decide per propose, of that proposal", "[policy][gate]") {
  switch_policy_config cfg = interactive_config(100);
  cfg.cooldown_s = 0;
  switch_policy p(cfg);
  const switch_proposal first = p.propose(150, parallel_mode::tp, 0);
  // A second propose before the first is decided is refused by name, and changes nothing.
  REQUIRE_MOEBIUS_ERROR(p.propose(150, parallel_mode::tp, 1), errc::invalid_argument,
                        "was not decided");
  CHECK(p.stats().steps == 1);
  // A proposal of another step (an edited or stale one) is refused by name.
  switch_proposal stale = first;
  stale.step = 7;
  REQUIRE_MOEBIUS_ERROR(p.decide(stale, {}), errc::invalid_argument, "not the last propose()");
  CHECK(p.decide(first, {}).do_switch);
  // Decided once: a second decide of it is refused.
  REQUIRE_MOEBIUS_ERROR(p.decide(first, {}), errc::invalid_argument, "already decided");
  CHECK(p.stats().switches == 1);
  // A gate weighed before planning (priced false) prints so.
  gate_evaluation least;
  least.evaluated = true;
  least.priced = false;
  least.gain_ms = -5;
  std::ostringstream os;
  os << least;
  CHECK(os.str().find("refused before planning") != std::string::npos);
}

TEST_CASE("switch policy: thresholds moved while it runs", "[policy][gate]") {
  switch_policy_config cfg = interactive_config(200);
  cfg.cooldown_s = 0;
  switch_policy p(cfg);
  CHECK_FALSE(p.step(300, parallel_mode::ep, 0).do_switch);  // in EP, 300 >= T_l: stay
  p.set_thresholds(500, 400);
  CHECK(p.config().t_high == 500);
  CHECK(p.config().t_low == 400);
  CHECK_FALSE(p.step(450, parallel_mode::tp, 1).do_switch);  // under the new T_h
  CHECK(p.step(500, parallel_mode::tp, 2).do_switch);
  CHECK_THROWS_AS(p.set_thresholds(100, 200), moebius::error);  // T_l > T_h
  CHECK_THROWS_AS(p.set_thresholds(0, 0), moebius::error);
  CHECK(p.config().t_high == 500);  // unchanged by a refused call
}
