// Our policy (engine.hpp: the throughput gate, blocked admission, the start mode from the
// load) on the simulated runtime at the paper's deployment (Qwen3-235B-A22B on 8 H200s, each
// mode's real KV pool, steps priced by the measured per-rank curves): each of the gate's three
// terms decides one short scenario, so that the test fails when that term is removed (the
// ablation runs the same scenario with the term off and must do worse), and the policy must
// not lose to the better static layout on a short paper-shaped rollout. Everything is priced
// on a deterministic clock: the comparisons are exact reruns, not timings.
#include <algorithm>
#include <cmath>
#include <memory>
#include <random>
#include <sstream>
#include <string>

#include <moebius/transport/dry_run_transport.hpp>

#include "catch.hpp"
#include "curves_step_clock.hpp"
#include "deployment.hpp"
#include "engine.hpp"
#include "paper_traces.hpp"
#include "run_policy.hpp"
#include "sim_deployment.hpp"
#include "sim_runtime.hpp"
#include "step_curves.hpp"
#include "test_seed.hpp"
#include "trace_stats.hpp"

using namespace mini_engine;
using moebius::parallel_mode;

namespace {

// The paper's deployment on the simulated runtime, one per run (the static ones' pools differ).
struct paper_world {
  sim_geometry geometry;
  std::unique_ptr<sim_runtime> rt;
  std::unique_ptr<moebius::dry_run_transport> transport;
  std::unique_ptr<engine> eng;
};

// The demo's priced clock (demo/clock.cpp, make_sim_clock): the measured region curves and the H200 model.
struct paper_clock {
  std::unique_ptr<h200_step_model> model;
  std::unique_ptr<curves_step_clock> clock;
  paper_clock() {
    std::optional<step_curves> curves = step_curves::region("qwen3_235b", 8);
    REQUIRE(curves.has_value());
    priced_model m = qwen3_235b_a22b_priced();
    m.context_scale = 1;
    const sim_geometry g =
        make_sim_geometry(make_deployment(qwen3_235b_a22b(), deployment_kind::switching));
    model = std::make_unique<h200_step_model>(m, h200_params{}, 8, g.kv_bytes_per_token);
    clock = std::make_unique<curves_step_clock>(std::move(*curves), *model);
  }
};

const paper_clock& the_clock() {
  static const paper_clock c;
  return c;
}

paper_world make_world(deployment_kind k) {
  paper_world w;
  w.geometry = make_sim_geometry(make_deployment(qwen3_235b_a22b(), k));
  w.rt = std::make_unique<sim_runtime>(w.geometry.arena, w.geometry.kv, 1024);
  w.transport =
      std::make_unique<moebius::dry_run_transport>(w.geometry.kv.num_ranks, w.rt->spaces());
  w.eng = std::make_unique<engine>(*w.rt, *w.transport, w.geometry.arena, w.geometry.kv,
                                   *the_clock().clock, moebius::arena_cursor{0});
  return w;
}

engine_options base_options() {
  engine_options o;
  o.scheduler.max_running = 2048;
  o.scheduler.max_step_tokens = 8192;
  o.scheduler.admission = admission_policy::known;
  return o;
}

// Our policy as the demo runs it: thresholds from the curves' crossover at `context`.
engine_options ours(int64_t context, bool rollout) {
  paper_world w = make_world(deployment_kind::switching);
  std::vector<int64_t> batches;
  for (int64_t b = 1; b <= 2048; b *= 2) batches.push_back(b);
  moebius::calibration_options co;
  co.fit = moebius::curve_fit::piecewise_linear;
  const moebius::calibration_result cal = calibrate_engine(*w.eng, batches, context, co);
  REQUIRE(cal.has_thresholds);
  engine_options o = base_options();
  o.how = switching::policy;
  o.policy = rollout ? moebius::rollout_config(cal.t_high, 8)
                     : moebius::interactive_config(cal.t_high);
  o.policy = moebius::apply_calibration(cal, o.policy);
  if (rollout) o.policy.t_low = o.policy.t_high;
  o.policy.enter_on_blocked_admission = true;
  o.start_from_load = true;
  o.gate.curves = cal.curves;
  o.explain = true;
  return o;
}

run_result serve(deployment_kind k, const std::vector<request>& trace, const engine_options& o,
                 const std::string& name) {
  paper_world w = make_world(k);
  return w.eng->run(trace, o, name);
}

double mean_ttft_s(const run_result& r) {
  double sum = 0;
  for (const request_result& q : r.requests) sum += q.ttft_s();
  return sum / static_cast<double>(r.requests.size());
}

int64_t committed_to(const run_result& r, parallel_mode m) {
  int64_t n = 0;
  for (const switch_record& s : r.switches)
    n += s.outcome == moebius::switch_outcome::committed && s.to == m;
  return n;
}

std::string decisions(const run_result& r) {
  std::ostringstream os;
  for (size_t i = 0; i < std::min<size_t>(r.decisions.size(), 6); ++i) os << r.decisions[i] << "\n";
  return os.str();
}

// `n` requests arriving over `spread_s` from `start_s`, prompts and outputs drawn uniformly.
std::vector<request> requests_of(std::mt19937_64& rng, int64_t n, double start_s, double spread_s,
                                 int64_t prompt_lo, int64_t prompt_hi, int64_t out_lo,
                                 int64_t out_hi, int64_t first_id = 0) {
  std::vector<request> t;
  for (int64_t i = 0; i < n; ++i) {
    request r;
    r.id = first_id + i;
    r.arrival_s = start_s + spread_s * static_cast<double>(i) / static_cast<double>(n);
    r.prompt.assign(static_cast<size_t>(std::uniform_int_distribution<int64_t>(prompt_lo, prompt_hi)(rng)), 7);
    r.output_tokens = std::uniform_int_distribution<int64_t>(out_lo, out_hi)(rng);
    t.push_back(std::move(r));
  }
  return t;
}

// Our policy's run of `trace` on the switching deployment, and the same with one gate term off
// (named `without_name`): what each term's test compares.
struct ablation {
  run_result with, without;
};
ablation with_and_without(const std::vector<request>& trace, const engine_options& o,
                          bool moebius::gate_terms::*term, const char* without_name) {
  engine_options off = o;
  off.gate.terms.*term = false;
  return {serve(deployment_kind::switching, trace, o, "ours"),
          serve(deployment_kind::switching, trace, off, without_name)};
}

}  // namespace

TEST_CASE("policy: the admission term sends a long-context flood under T_h to EP") {
  // ~120 requests of 10-14k prompts at once: under T_h (~170), but TP's pool (1.14M tokens,
  // every rank holding every sequence) admits about 90 of them, EP's (2.28M) all. The rule that
  // fires is blocked admission; only a gate that runs each mode at the batch its pool admits
  // sees EP's gain (at the same batch, under the crossover, TP is the faster mode).
  std::mt19937_64 rng(mini_engine::testing::test_seed() ^ 0xad);
  const std::vector<request> trace = requests_of(rng, 120, 0, 1.0, 9000, 11000, 2000, 3000);
  // Calibrated at a chat trace's short context (the flood is a long-context burst in it).
  engine_options o = ours(600, false);
  o.start_from_load = false;
  o.start_mode = parallel_mode::tp;
  const auto [with, without] =
      with_and_without(trace, o, &moebius::gate_terms::admission, "no admission term");
  INFO("ours:\n" << decisions(with) << "without the admission term:\n" << decisions(without));
  CHECK(committed_to(with, parallel_mode::ep) >= 1);
  CHECK(committed_to(without, parallel_mode::ep) == 0);
  // The decision log (engine_options::explain) holds the switch with the gate's numbers: the
  // batch each mode's pool admits, TP's the smaller.
  const auto taken = std::find_if(with.decisions.begin(), with.decisions.end(),
                                  [](const decision_record& d) { return d.decision.do_switch; });
  REQUIRE(taken != with.decisions.end());
  CHECK(taken->decision.target == parallel_mode::ep);
  CHECK(taken->gate.evaluated);
  CHECK(taken->gate.passed);
  CHECK(taken->gate.current_batch < taken->gate.target_batch);
  CHECK(taken->gate.gain_ms >= taken->gate.cost_ms * 1.25);
  std::ostringstream line;
  line << *taken;
  CHECK(line.str().find("switch to EP") != std::string::npos);
  CHECK(line.str().find(": pays}") != std::string::npos);
  CHECK(with.end_s < without.end_s * 0.95);
  CHECK(mean_ttft_s(with) < mean_ttft_s(without));
}

TEST_CASE("policy: the queueing term switches before the first completion") {
  // 1,000 requests over 2 s into TP, at most 256 running: the load sits at the cap (over T_h)
  // with a queue behind it; no request finishes for about a thousand steps, so the residency
  // predictor has no evidence (1 step) and only the queue's drain says EP pays.
  std::mt19937_64 rng(mini_engine::testing::test_seed() ^ 0x9e);
  const std::vector<request> trace = requests_of(rng, 1000, 0, 2.0, 64, 256, 900, 1100);
  engine_options o = ours(600, false);
  o.start_from_load = false;
  o.start_mode = parallel_mode::tp;
  o.scheduler.max_running = 256;
  const auto [with, without] =
      with_and_without(trace, o, &moebius::gate_terms::queueing, "no queueing term");
  INFO("ours:\n" << decisions(with) << "without the queueing term:\n" << decisions(without));
  REQUIRE(committed_to(with, parallel_mode::ep) >= 1);
  const bool earlier = without.switches.empty() ||
                       with.switches.front().start_s < without.switches.front().start_s;
  CHECK(earlier);
  // What the queue waits for: its TTFT (the run's end is the longest request's, which the
  // switch's timing moves by a fraction of a second either way). Both runs end up in EP once
  // the queue is long; the earlier switch (about 13 s against 45 s) must not cost the queue.
  // Over 24 draws the ratio was 0.967-1.008 (median 0.978): the earlier run in EP gains 1-3%
  // on most draws, and on the few where its EP ranks drain unevenly and it ends up to 1.5%
  // later, loses under 1%. Hence within 1.5%.
  CHECK(mean_ttft_s(with) <= mean_ttft_s(without) * 1.015);
}

TEST_CASE("policy: known work weighs a rollout's tail; the policy never loses to static") {
  // A short paper-shaped rollout: 2 steps of 2,048 prompts, outputs log-normal (median 150, 2%
  // cut at 2,048 tokens). The tail's switch to TP is weighed over the survivors' expected
  // remaining tokens (each at least what it has generated: the longest survivor's, since the
  // step ends with it), not the residency predictor's guess; the run must not lose to the
  // better static layout. (On this trace the predictor's horizon is long too, and both runs
  // end within 0.2% of each other: the known work's effect at the paper's scale is in
  // docs/BENCHMARKS.md; here the test checks what the gate weighed.)
  paper_rollout_options ro;
  ro.steps = 2;
  ro.prompts_per_step = 2048;
  ro.output_cap = 2048;
  ro.output_median = 150;
  const std::vector<request> trace = paper_rollout_trace(mini_engine::testing::test_seed(), ro);
  const engine_options o = ours(400, true);
  const auto [with, without] =
      with_and_without(trace, o, &moebius::gate_terms::known_work, "no known work");
  engine_options stat = base_options();
  stat.start_mode = parallel_mode::tp;
  const run_result tp = serve(deployment_kind::static_tp, trace, stat, "static TP");
  stat.start_mode = parallel_mode::ep;
  const run_result ep = serve(deployment_kind::static_ep, trace, stat, "static EP");
  INFO("ours " << with.end_s << " s, without known work " << without.end_s << " s, static TP "
               << tp.end_s << " s, static EP " << ep.end_s << " s");
  // The switches to TP: each weighed over the known work, longer than the longest survivor's
  // generated tokens so far cannot be (Lindy: at least what it has generated); without the
  // term, over the predictor's residency.
  int64_t to_tp = 0;
  for (const switch_record& s : with.switches) {
    if (s.to != parallel_mode::tp || s.outcome != moebius::switch_outcome::committed) continue;
    ++to_tp;
    CAPTURE(s.step, s.gate);
    CHECK(std::string(s.gate.residency_from) == "known work");
    CHECK(s.gate.residency_steps >= 1);
    CHECK(s.gate.residency_steps <= ro.output_cap);
  }
  CHECK(to_tp >= 1);
  for (const switch_record& s : without.switches) {
    CAPTURE(s.step, s.gate);
    if (s.gate.evaluated) CHECK(std::string(s.gate.residency_from) != "known work");
  }
  CHECK(with.end_s <= std::min(tp.end_s, ep.end_s));
  for (const run_result* r : {&with, &without, &tp, &ep}) CHECK(r->failed_requests == 0);
}

TEST_CASE("policy: a short paper-shaped bursty trace; ours loses to neither static layout") {
  // The paper's bursty shape at a fifth of its length: two floods (80 and 120 requests/s) about
  // 60 s apart, 5 requests/s between, the LMSYS lengths. Ours must be within 2% of the better
  // static layout (by tokens/s) on every metric the paper reports (mean and p99 TTFT and TPOT,
  // tokens/s).
  paper_bursty_options bo;
  bo.duration_s = 75;
  bo.quiet_between_s = 60;
  bo.target_requests = 1180;  // 5 (75 - 2t) + 200 t = 1180 at t = 4.6 s a flood
  const std::vector<request> trace = paper_bursty_trace(mini_engine::testing::test_seed(), bo);
  engine_options o = ours(mean_decode_context(trace), false);
  o.policy.cooldown_s = 5;
  const run_result with = serve(deployment_kind::switching, trace, o, "ours");
  engine_options stat = base_options();
  stat.start_mode = parallel_mode::tp;
  const run_result tp = serve(deployment_kind::static_tp, trace, stat, "static TP");
  stat.start_mode = parallel_mode::ep;
  const run_result ep = serve(deployment_kind::static_ep, trace, stat, "static EP");
  const run_summary s = summarize(with), a = summarize(tp), b = summarize(ep);
  INFO("ours: TTFT " << s.mean_ttft_ms << "/" << s.p99_ttft_ms << " ms, TPOT " << s.mean_tpot_ms
                     << "/" << s.p99_tpot_ms << " ms, " << s.tokens_per_s << " tok/s, "
                     << s.switches << " switches\nstatic TP: " << a.mean_ttft_ms << "/"
                     << a.p99_ttft_ms << ", " << a.mean_tpot_ms << "/" << a.p99_tpot_ms << ", "
                     << a.tokens_per_s << "\nstatic EP: " << b.mean_ttft_ms << "/" << b.p99_ttft_ms
                     << ", " << b.mean_tpot_ms << "/" << b.p99_tpot_ms << ", " << b.tokens_per_s
                     << "\n" << decisions(with));
  const run_summary& best = a.tokens_per_s >= b.tokens_per_s ? a : b;
  CHECK(s.mean_ttft_ms <= 1.02 * best.mean_ttft_ms);
  CHECK(s.p99_ttft_ms <= 1.02 * best.p99_ttft_ms);
  CHECK(s.mean_tpot_ms <= 1.02 * best.mean_tpot_ms);
  CHECK(s.p99_tpot_ms <= 1.02 * best.p99_tpot_ms);
  CHECK(s.tokens_per_s >= 0.98 * best.tokens_per_s);
  CHECK(with.failed_requests == 0);
}

TEST_CASE("policy: faster_by_margin weighs the target by the margin") {
  // Piecewise-linear curves through EP (1, 40) (512, 60), TP (1, 20) (512, 80): at 300 EP
  // 51.70 ms, TP 55.11 ms; at 512 EP 60, TP 80.
  std::vector<moebius::latency_sample> ep{{1, 40}, {512, 60}}, tp{{1, 20}, {512, 80}};
  moebius::calibration_options co;
  co.fit = moebius::curve_fit::piecewise_linear;
  const moebius::latency_curves c = moebius::calibrate(ep, tp, co).curves;
  CHECK(faster_by_margin(c, parallel_mode::tp, parallel_mode::ep, 512, 0.25));       // 75 < 80
  CHECK_FALSE(faster_by_margin(c, parallel_mode::tp, parallel_mode::ep, 512, 0.4));  // 84
  CHECK(faster_by_margin(c, parallel_mode::tp, parallel_mode::ep, 300, 0));          // 51.7 < 55.1
  CHECK_FALSE(faster_by_margin(c, parallel_mode::tp, parallel_mode::ep, 300, 0.1));  // 56.9
  CHECK_FALSE(faster_by_margin(c, parallel_mode::tp, parallel_mode::ep, 1, 0));      // 40 > 20
  CHECK(faster_by_margin(c, parallel_mode::ep, parallel_mode::tp, 1, 0.9));          // 38 < 40
  // Equal steps are not faster: strictly less.
  CHECK_FALSE(faster_by_margin(c, parallel_mode::tp, parallel_mode::tp, 100, 0));
  CHECK_THROWS_WITH(faster_by_margin(c, parallel_mode::tp, parallel_mode::ep, 0.5, 0),
                    Catch::Contains("load must be >= 1"));
  CHECK_THROWS_WITH(faster_by_margin(c, parallel_mode::tp, parallel_mode::ep, 10, -0.1),
                    Catch::Contains("margin must be finite and >= 0"));
  CHECK_THROWS_WITH(faster_by_margin(c, parallel_mode::tp, parallel_mode::ep, 10, std::nan("")),
                    Catch::Contains("margin must be finite and >= 0"));
}

TEST_CASE("policy: a sustained gain sends SGLang's prefill-bound TP to EP under T_h") {
  // The production-shaped trace (prompts ~1k tokens, outputs ~130) at 7.9 requests/s for 150 s,
  // under SGLang's rules: the load stays under T_h (the decode curves' crossover, ~536) and
  // TP's pool admits it, so neither the load nor blocked admission sends ours to EP for the
  // first minute or more; but SGLang's prefill-first steps hold 30-60% of TP's decode slots,
  // and the gate's curves, corrected by what the steps take, put EP ahead at the sustained
  // load by more than the gate's margin. With the rule ours goes to EP on it, sooner, and the
  // requests wait no longer for their first token (usually much less: below).
  paper_production_options po;
  po.duration_s = 150;
  po.mean_rate = 7.9;
  const std::vector<request> trace = paper_production_trace(mini_engine::testing::test_seed(), po);
  engine_options o = ours(mean_decode_context(trace), false);
  // The demo's clock (cited collectives, the busiest EP rank) puts T_h at 536, above this
  // trace's load; this file's clock (10 us collectives) at ~150, within it. Out of reach here
  // as there; T_l stays the calibrated one (the gate's residency in EP ends at it).
  o.policy.t_high = o.scheduler.max_running + 1;
  o.scheduler.engine = engine_preset::sglang;
  o.policy.enter_on_sustained_gain = true;
  engine_options off = o;
  off.policy.enter_on_sustained_gain = false;
  const run_result with = serve(deployment_kind::switching, trace, o, "ours");
  const run_result without = serve(deployment_kind::switching, trace, off, "no sustained gain");
  INFO("ours:\n" << decisions(with) << "without the rule:\n" << decisions(without));
  REQUIRE(committed_to(with, parallel_mode::ep) >= 1);
  const auto first_to_ep =
      std::find_if(with.decisions.begin(), with.decisions.end(), [](const decision_record& d) {
        return d.decision.do_switch && d.decision.target == parallel_mode::ep;
      });
  REQUIRE(first_to_ep != with.decisions.end());
  CHECK(first_to_ep->decision.reason == moebius::decision_reason::sustained_gain);
  CHECK(first_to_ep->load < o.policy.t_high);
  const bool earlier =
      without.switches.empty() || with.switches.front().start_s < without.switches.front().start_s;
  CHECK(earlier);
  const run_summary s = summarize(with), w = summarize(without);
  INFO("TTFT mean / p99: ours " << s.mean_ttft_ms << " / " << s.p99_ttft_ms
                                << " ms, without the rule " << w.mean_ttft_ms << " / "
                                << w.p99_ttft_ms << " ms");
  // Over 40 draws ours' TTFT against the run without the rule: mean 0.36-1.03x (median 0.63),
  // p99 0.18-1.00x; where the draw's load reaches EP's side late both runs are nearly one.
  CHECK(s.mean_ttft_ms <= 1.05 * w.mean_ttft_ms);
  CHECK(s.p99_ttft_ms <= 1.01 * w.p99_ttft_ms);
  CHECK(with.failed_requests == 0);
}
