// The progressive switch in the serving loop (engine.hpp, switch_style::progressive): runs
// that switch a few layers per step, with hybrid steps in between (layers below the cursor
// TP, the rest EP, both page tables live), produce exactly the greedy tokens of static runs;
// so do runs whose switches are aborted at random cursors, or fail at a random phase of a
// random advance (rolled back), and then serve on. No request lost, duplicated or restarted;
// no KV page leaked (engine::run checks every page free at the end, validate_every_step the
// tables after every step).
//
// A switch cannot begin while a sequence is mid-prefill without its prompt's pages: the
// tables are frozen from begin() to finish(). The engine therefore reserves, before begin(),
// the rest of every prefilling prompt plus one token per step of the switch, clamped to the
// sequence's largest size; such sequences keep prefilling during the switch (tested: switches
// begun with prompts half prefilled are counted below). New requests wait for finish().
//
// Runs on the host runtime (fp32): tokens are compared with static EP and TP runs.
#include <algorithm>
#include <memory>
#include <random>
#include <span>
#include <string>

#include <moebius/transport/host_transport.hpp>

#include "catch.hpp"
#include "engine.hpp"
#include "paced_clock.hpp"
#include "same_tokens.hpp"
#include "small_trace.hpp"
#include "host_runtime.hpp"
#include "model_config.hpp"
#include "overlap_curve.hpp"
#include "weights.hpp"

using namespace mini_engine;
using moebius::parallel_mode;
using moebius::switch_outcome;
using testing::check_same_tokens;

namespace {

// The host runtime, with every step beside a switch's copies (asked for layer events) reported
// overflowed, as the GPU runtime reports a step whose routing overflowed its graphs' capacity:
// the serving loop then waits for the advance and runs the step again where it settled
// (step_options::rerun). The first pass ran (it wrote K/V); the rerun's tokens are the step's:
// it writes every layer's K/V of the step's positions again.
class rerunning_runtime final : public runtime {
 public:
  explicit rerunning_runtime(runtime& inner) : inner_(inner) {}
  pending_step enqueue(const step_layout& layout, std::span<const step_item> items,
                       const step_options& options) override {
    overflow_ = options.layer_events && !options.rerun;
    if (overflow_) {
      ++beside_;
      first_cursor_ = layout.cursor.tp_layers;
    }
    // Settled: the cursor moved past the advance's layers, or the switch rolled back.
    if (options.rerun) cursors_moved_ += layout.cursor.tp_layers != first_cursor_;
    step_options inner = options;
    inner.layer_events = false;
    if (overflow_) inner.logits = nullptr;
    return inner_.enqueue(layout, items, inner);
  }
  step_result finish(const pending_step& p) override {
    step_result r = inner_.finish(p);
    if (overflow_) {
      r.tokens.clear();
      r.overflowed = true;
    }
    return r;
  }
  int64_t beside() const { return beside_; }
  int64_t cursors_moved() const { return cursors_moved_; }

 private:
  runtime& inner_;
  bool overflow_ = false;
  int64_t first_cursor_ = 0;
  int64_t beside_ = 0, cursors_moved_ = 0;
};

struct host_world {
  model_config c;
  std::unique_ptr<host_runtime> rt;
  std::unique_ptr<moebius::host_transport> transport;
};

host_world make_host_world(int P, uint64_t seed, int64_t layers) {
  host_world w;
  w.c = tiny();
  w.c.num_layers = layers;
  validate(w.c, P);
  host_runtime_options o;
  o.num_ranks = P;
  o.num_ep_pages = 96;
  w.rt = std::make_unique<host_runtime>(make_weights(w.c, seed), o);
  w.transport = std::make_unique<moebius::host_transport>(w.rt->memory());
  return w;
}


enum class trouble { none, abort, fault };

// Static EP and TP runs, then progressive runs with forced switches before ~30% of the steps
// (and `t`: aborts or faults at random advances). Returns the switches' outcomes seen.
// `rerun`: every step during a switch runs again where its advance settled (rerunning_runtime).
void serve_progressive(int P, uint64_t seed, trouble t, bool rerun = false) {
  std::mt19937_64 rng(seed * 7919 + static_cast<uint64_t>(P));
  const int64_t L = std::uniform_int_distribution<int64_t>(2, 6)(rng);
  const int64_t per_step = std::uniform_int_distribution<int64_t>(1, 3)(rng);
  host_world w = make_host_world(P, seed, L);
  CAPTURE(P, seed, L, per_step, rerun);
  const std::vector<request> reqs = testing::small_trace(seed, static_cast<int32_t>(w.c.vocab), 12);
  REQUIRE(reqs.size() > 12);
  const testing::paced_clock clock(per_step);
  rerunning_runtime rerunning(*w.rt);
  runtime& rt = rerun ? static_cast<runtime&>(rerunning) : *w.rt;
  engine e(rt, *w.transport, w.rt->arena(), w.rt->kv(), clock, moebius::arena_cursor{0});

  engine_options o = testing::small_trace_options();
  const run_result ep = e.run(reqs, o, "static EP");
  o.start_mode = parallel_mode::tp;
  const run_result tp = e.run(reqs, o, "static TP");
  check_same_tokens(tp, ep);

  o.how = switching::forced;
  o.style = switch_style::progressive;
  for (int64_t s = 1; s < static_cast<int64_t>(ep.steps.size()) + 40; ++s)
    if (std::bernoulli_distribution(0.3)(rng)) o.forced_steps.push_back(s);
  o.start_mode = seed % 2 ? parallel_mode::ep : parallel_mode::tp;
  int64_t injected = 0;
  if (t == trouble::abort) {
    o.test_hooks.abort_after_advance = [&](const moebius::progressive_switch&, int64_t) {
      return std::bernoulli_distribution(0.3)(rng);
    };
  } else if (t == trouble::fault) {
    o.test_hooks.before_advance = [&](moebius::switcher& sw, const moebius::progressive_switch& session,
                           int64_t) {
      if (!std::bernoulli_distribution(0.3)(rng)) return;
      const moebius::switch_report& r = session.report();
      const int64_t per_layer = 1 + r.kv_rounds / std::max<int64_t>(1, r.weight_phases);
      const int64_t phases = per_layer * std::min(per_step, session.layers_remaining());
      const int64_t phase = std::uniform_int_distribution<int64_t>(0, phases - 1)(rng);
      sw.inject_fault(moebius::switch_fault{moebius::switch_fault::stage::weights,
                                            moebius::fault_point{phase, 0}});
      ++injected;
    };
  }
  const run_result sw = e.run(reqs, o, "progressive");
  check_same_tokens(sw, ep);

  int64_t committed = 0, rolled_back = 0, to_tp = 0, to_ep = 0, mid_prefill = 0, hybrid = 0;
  for (const switch_record& s : sw.switches) {
    CAPTURE(s.step, s.error);
    CHECK(s.progressive);
    CHECK(s.layers_per_step == std::min(per_step, L));
    CHECK((s.outcome == switch_outcome::committed || s.outcome == switch_outcome::rolled_back));
    if (s.outcome == switch_outcome::committed) {
      ++committed;
      (s.to == parallel_mode::tp ? to_tp : to_ep) += 1;
      CHECK(s.steps >= 1);
      CHECK(s.steps <= (L + per_step - 1) / per_step);
    } else {
      ++rolled_back;
    }
    mid_prefill += s.prefilling > 0;
  }
  int64_t in_switch = 0;
  for (const step_record& s : sw.steps) {
    hybrid += s.in_switch && s.cursor > 0 && s.cursor < L;
    in_switch += s.in_switch && s.sequences > 0;
  }
  if (rerun) {
    // Every step during a switch went beside its advance, and most reran at a moved cursor.
    CHECK(rerunning.beside() == in_switch);
    CHECK(rerunning.cursors_moved() >= committed);
  }
  if (t == trouble::none) {
    CHECK(committed >= 4);
    CHECK(to_tp >= 2);
    CHECK(to_ep >= 2);
  } else {  // about a third of the switches end early
    CHECK(committed >= 1);
    CHECK(committed + rolled_back >= 4);
  }
  CHECK(mid_prefill >= 1);
  if (per_step < L) CHECK(hybrid >= 3);  // steps that really ran both modes
  if (t == trouble::none) CHECK(rolled_back == 0);
  if (t != trouble::none) CHECK(rolled_back >= 1);
  if (t == trouble::fault) CHECK(injected >= 1);
}

}  // namespace

TEST_CASE("progressive switching gives the static run's tokens", "[cpu][progressive]") {
  for (const int P : {2, 4})
    for (uint64_t seed = 1; seed <= 3; ++seed) serve_progressive(P, seed, trouble::none);
}

TEST_CASE("progressive switches aborted at random cursors, then serving on: same tokens",
          "[cpu][progressive]") {
  for (const int P : {2, 4})
    for (uint64_t seed = 11; seed <= 12; ++seed) serve_progressive(P, seed, trouble::abort);
}

TEST_CASE("faults at random advances roll back exactly and serving goes on: same tokens",
          "[cpu][progressive]") {
  for (const int P : {2, 4})
    for (uint64_t seed = 21; seed <= 22; ++seed) serve_progressive(P, seed, trouble::fault);
}

TEST_CASE("steps rerun where their advance settled (the GPU runtime's overflow rerun beside "
          "copies) keep the static run's tokens, faults included",
          "[cpu][progressive]") {
  for (const int P : {2, 4}) {
    serve_progressive(P, 31, trouble::none, true);
    serve_progressive(P, 32, trouble::fault, true);
  }
}

TEST_CASE("the measured overlap slowdown curve: its points, between them and beyond",
          "[cpu][progressive]") {
  // Two rows as the bench writes them: a 10 ms step (1.1 at 100 MiB, 1.3 at 300 MiB) and a
  // 30 ms step (1.02, 1.06).
  const slowdown_point pts[] = {{10, 100, 1.1}, {10, 300, 1.3}, {30, 100, 1.02}, {30, 300, 1.06}};
  const overlap_slowdown_curve c{std::span<const slowdown_point>(pts)};
  const int64_t MiB = int64_t{1} << 20;
  CHECK(c.at(0.010, 0) == 1.0);
  CHECK(c.at(0.010, 100 * MiB) == Approx(1.1));
  CHECK(c.at(0.010, 50 * MiB) == Approx(1.05));    // from (0, 1.0)
  CHECK(c.at(0.010, 200 * MiB) == Approx(1.2));
  CHECK(c.at(0.010, 500 * MiB) == Approx(1.5));    // the last segment's slope
  CHECK(c.at(0.030, 300 * MiB) == Approx(1.06));
  CHECK(c.at(0.020, 300 * MiB) == Approx(1.18));   // halfway between the rows
  CHECK(c.at(0.005, 300 * MiB) == Approx(1.3));    // below the rows: the nearest
  CHECK(c.at(0.100, 300 * MiB) == Approx(1.06));   // above
  const slowdown_point bad[] = {{10, 300, 1.1}, {10, 100, 1.3}};
  CHECK_THROWS_AS(overlap_slowdown_curve(std::span<const slowdown_point>(bad)), moebius::error);
  const slowdown_point zero[] = {{0, 100, 1.1}};
  CHECK_THROWS_AS(overlap_slowdown_curve(std::span<const slowdown_point>(zero)), moebius::error);
  // The compiled-in H200 curve holds the measured batch-1 point (7.05 ms, 1 GiB: 1.139).
  CHECK(overlap_slowdown_curve::h200().at(0.0070528, 1024 * MiB) == Approx(1.139208).epsilon(1e-4));
}

TEST_CASE("the priced clock prices a step beside copies by the curve, never below the copies",
          "[cpu][progressive]") {
  priced_model m;
  const h200_step_model with(m, h200_params{}, 2, 1024);
  const h200_step_model without(m, h200_params{}, 2, 1024, nullptr);
  CHECK(std::string(with.name()).find("measured slowdown curve") != std::string::npos);
  CHECK(std::string(without.name()) == "modelled H200");
  step_cost cost;
  cost.mode = parallel_mode::ep;
  cost.num_ranks = 2;
  cost.num_sequences = cost.new_tokens = 16;
  cost.context_tokens = 16 * 1024;
  const double step = with.step_s(cost, 0);
  for (const int64_t bytes : {int64_t{0}, int64_t{1} << 28, int64_t{1} << 30, int64_t{1} << 34}) {
    CAPTURE(bytes);
    const switch_copies copies{0.0, bytes};
    const double copy = with.copies_s(copies);
    CHECK(copy == Approx(static_cast<double>(bytes) / h200_params{}.nvlink.bytes_per_s));
    const double slow = overlap_slowdown_curve::h200().at(step, bytes);
    CHECK(with.switch_step_s(cost, 0, copies) == Approx(std::max(step * slow, copy)));
    CHECK(with.slowdown().at(step, bytes) == Approx(slow));
    CHECK(without.switch_step_s(cost, 0, copies) == Approx(step + copy));
    CHECK(!without.slowdown().known());
  }
}

TEST_CASE("progressive pacing follows the clock's overlap slowdown curve", "[cpu][progressive]") {
  // The link fits 4 layers a step; the curve allows 1.10x: 2 layers (1.08x), not 3 (1.12x).
  // 1.13 with at most 1.0 ms more per 10 ms step: 2 layers (0.8 ms), not 3 (1.2 ms).
  const int64_t L = 6;
  for (const double limit : {1.10, 1.13, 1.0, 1.131}) {
    host_world w = make_host_world(2, 3, L);
    const std::vector<request> reqs = testing::small_trace(3, static_cast<int32_t>(w.c.vocab), 12);
    const testing::paced_clock clock(4, 0.04);  // 4% per MB copied beside a step
    engine e(*w.rt, *w.transport, w.rt->arena(), w.rt->kv(), clock, moebius::arena_cursor{0});
    engine_options o = testing::small_trace_options();
    const run_result ep = e.run(reqs, o, "static EP");
    o.how = switching::forced;
    o.style = switch_style::progressive;
    o.max_overlap_slowdown = limit == 1.131 ? 1.13 : limit;
    if (limit == 1.131) o.max_overlap_extra_ms = 1.0;
    o.forced_steps = {3, 20, 40};
    const run_result sw = e.run(reqs, o, "progressive");
    check_same_tokens(sw, ep);
    REQUIRE(!sw.switches.empty());
    // 1.13: 3 layers (1.12x); 1.0: nothing fits, still one layer a step.
    const int64_t want = limit == 1.10 ? 2 : limit == 1.13 ? 3 : limit == 1.131 ? 2 : 1;
    for (const switch_record& s : sw.switches) {
      CHECK(s.progressive);
      CHECK(s.layers_per_step == want);
    }
  }
}

TEST_CASE("a progressive switch still open when every request has finished moves the rest as "
          "copies on the clock, before an idle jump and at the end of the run",
          "[cpu][progressive]") {
  const int64_t L = 6;
  host_world w = make_host_world(2, 11, L);
  const std::vector<request> trace = testing::small_trace(11, static_cast<int32_t>(w.c.vocab), 12);
  // paced_clock's steps and pacing (one layer a step: a switch takes 6 steps), its copies
  // priced at 100 MB/s (10 ms a layer) rather than measured on the host (microseconds).
  class copies_priced final : public step_clock {
   public:
    double step_s(const step_cost& c, double m) const override { return paced_.step_s(c, m); }
    double switch_s(const moebius::switch_report& r) const override { return paced_.switch_s(r); }
    const char* name() const override { return "paced, copies at 100 MB/s"; }
    bool needs_measurement() const override { return false; }
    int64_t layer_bytes(const moebius::layer_bytes& run, int64_t n) const override {
      return paced_.layer_bytes(run, n);
    }
    moebius::link_rate link() const override { return paced_.link(); }
    double copies_s(const switch_copies& c) const override {
      return static_cast<double>(c.bytes) / 1e8;
    }

   private:
    testing::paced_clock paced_{1};
  };
  const copies_priced clock;
  engine e(*w.rt, *w.transport, w.rt->arena(), w.rt->kv(), clock, moebius::arena_cursor{0});
  engine_options o = testing::small_trace_options();
  const run_result alone = e.run(trace, o, "static EP, the trace alone");
  // A late request 100 s after the trace: the clock jumps there once nothing runs.
  std::vector<request> reqs = trace;
  request late = trace.back();
  late.id = trace.back().id + 1000;
  late.arrival_s = alone.end_s + 100;
  reqs.push_back(late);
  const run_result ep = e.run(reqs, o, "static EP");
  // The last step before the jump: a switch forced there is still open when it ends.
  int64_t last = 0;
  for (const step_record& s : ep.steps)
    if (s.start_s < late.arrival_s) last = s.step;
  REQUIRE(last >= 2);
  o.how = switching::forced;
  o.style = switch_style::progressive;
  o.forced_steps = {last};
  for (const bool with_late : {true, false}) {
    CAPTURE(with_late, last);
    const run_result sw = e.run(with_late ? reqs : trace, o, "progressive");
    check_same_tokens(sw, with_late ? ep : alone);
    REQUIRE(sw.switches.size() == 1);
    const switch_record& s = sw.switches[0];
    CHECK(s.outcome == switch_outcome::committed);
    // The requests ran out before the switch did: the rest moved in steps of copies alone (a
    // late request to come), or at the end of the run.
    int64_t copies_alone = 0;
    for (const step_record& r : sw.steps) copies_alone += r.in_switch && r.sequences == 0;
    if (with_late) CHECK(copies_alone >= 1);
    else CHECK(s.steps < L);
    // Begin to finish on the clock: the steps served, then the rest as copies alone; never the
    // 100 s of idle time before the late request, never the rest for free.
    CHECK(s.clock_ms >= static_cast<double>(L) * 10.0 - 1e-6);
    CHECK(s.clock_ms < 1000);
    if (with_late) {
      const request_result& r = sw.requests.back();
      REQUIRE(r.id == late.id);
      CHECK(r.first_token_s - r.arrival_s < 1.0);  // it found the switch done
    } else {
      CHECK(sw.end_s >= s.start_s + s.clock_ms * 1e-3 - 1e-9);
    }
  }
}

namespace {

// 10 ms steps, a stop-the-world stall of `stall_s`, 1 MB a layer, a link that paces 2 layers a
// step, and 4% slower steps per MB copied beside them: a progressive switch of L = 4 layers
// takes 2 steps, each 0.8 ms longer (10.8 ms).
class styled_clock final : public step_clock {
 public:
  explicit styled_clock(double stall_s) : stall_s_(stall_s) {}
  double step_s(const step_cost&, double) const override { return 0.01; }
  double switch_s(const moebius::switch_report&) const override { return stall_s_; }
  double predicted_switch_s(const moebius::layer_bytes&, int64_t) const override { return stall_s_; }
  const char* name() const override { return "styled"; }
  bool needs_measurement() const override { return false; }
  int64_t layer_bytes(const moebius::layer_bytes&, int64_t) const override { return 1'000'000; }
  moebius::link_rate link() const override { return moebius::link_rate{2.5e6 / (0.01 * 0.55)}; }
  overlap_slowdown slowdown() const override {
    return {[](const void*, double, int64_t bytes) { return 1.0 + 0.04 * static_cast<double>(bytes) / 1e6; },
            this};
  }

 private:
  double stall_s_;
};

}  // namespace

TEST_CASE("switch_style::by_cost runs each switch in the style that holds the requests less",
          "[cpu][progressive]") {
  // Stall 10 ms: stop-the-world holds (running + waiting) x 10 ms; progressive slows the running
  // by 2 x 0.8 ms and holds the waiting for 21.6 ms. So progressive when the queue is short
  // (waiting < 0.72 running), stop-the-world behind a long one.
  const int64_t L = 4;
  host_world w = make_host_world(2, 11, L);
  const std::vector<request> reqs = testing::small_trace(11, static_cast<int32_t>(w.c.vocab), 12);
  const styled_clock clock(0.01);
  engine e(*w.rt, *w.transport, w.rt->arena(), w.rt->kv(), clock, moebius::arena_cursor{0});
  engine_options o = testing::small_trace_options();
  const run_result ep = e.run(reqs, o, "static EP");
  o.how = switching::forced;
  for (int64_t s = 1; s < static_cast<int64_t>(ep.steps.size()); s += 7) o.forced_steps.push_back(s);
  o.style = switch_style::by_cost;
  const run_result sw = e.run(reqs, o, "by cost");
  check_same_tokens(sw, ep);
  int64_t progressive = 0, stalls = 0;
  for (const switch_record& s : sw.switches) {
    CAPTURE(s.step, s.running, s.waiting);
    REQUIRE(s.outcome == switch_outcome::committed);
    const double held = static_cast<double>(s.running + s.waiting);
    CHECK(s.stall_request_s == Approx(held * 0.01));
    CHECK(s.progressive_request_s ==
          Approx(static_cast<double>(s.running) * 2 * 0.0008 + static_cast<double>(s.waiting) * 0.0216));
    CHECK(s.progressive == (s.progressive_request_s < s.stall_request_s));
    (s.progressive ? progressive : stalls) += 1;
    if (s.progressive) CHECK(s.layers_per_step == 2);
  }
  // The trace's bursts give both.
  CHECK(progressive > 0);
  CHECK(stalls > 0);
  // A fixed style prices nothing.
  o.style = switch_style::progressive;
  for (const switch_record& s : e.run(reqs, o, "progressive").switches) {
    CHECK(s.stall_request_s == 0);
    CHECK(s.progressive_request_s == 0);
  }
}
