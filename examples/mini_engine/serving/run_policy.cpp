#include "run_policy.hpp"

#include <algorithm>
#include <cmath>
#include <sstream>
#include <utility>
#include <vector>

#include <moebius/error.hpp>
#include <moebius/plan/plan.hpp>
#include <moebius/policy/step_time_gate.hpp>

#include "kv_need.hpp"

namespace mini_engine {

using moebius::parallel_mode;

const char* to_string(gate_kind k) {
  switch (k) {
    case gate_kind::throughput: return "throughput";
    case gate_kind::step_time: return "step_time";
  }
  return "unknown";
}

namespace {

// Appends `d` to the log, or counts it as a repeat of the last record when it decided the same
// (same reason and target in the same mode) without a priced gate in either: a rule refused
// before planning on every step of a long tail is one record with its count.
void log_decision(std::vector<decision_record>& log, decision_record d) {
  auto unpriced = [](const decision_record& r) { return !r.gate.evaluated || !r.gate.priced; };
  if (!log.empty() && unpriced(d) && unpriced(log.back()) &&
      log.back().decision.reason == d.decision.reason &&
      log.back().decision.target == d.decision.target && log.back().mode == d.mode) {
    ++log.back().repeats;
    return;
  }
  log.push_back(std::move(d));
}

moebius::switch_policy_config rules_of(const engine_options& o) {
  moebius::switch_policy_config c = o.policy;
  if (o.gate.enabled) c.gate_margin = o.gate.margin;
  return c;
}

// The exponential means' weight of one step (ratios and rows alike): the residency
// predictor's weight of one completion, ~64 steps of memory. The correction runs after every
// step: curves corrected a few seconds late let a flood's first switch through on stale ones.
constexpr double k_ratio_weight = recent_mean::k_weight;
constexpr double k_rows_weight = k_ratio_weight;
constexpr int64_t k_correction_every = 1;  // steps between two corrections
// decide_for_capacity: back to the smaller dcp when the KV the live sequences are expected to
// reach is within this share of its pool (the band keeps a tail from crossing back and forth).
constexpr double k_capacity_low = 0.8;

int mode_index(parallel_mode m) { return m == parallel_mode::ep ? 0 : 1; }

// `c` scaled by `factor`: through the same points (its knots, or a line's two ends).
moebius::latency_curve scaled(const moebius::latency_curve& c, double factor) {
  std::vector<moebius::latency_sample> points;
  if (c.kind() == moebius::curve_fit::piecewise_linear) {
    for (const moebius::latency_sample& k : c.knots()) points.push_back({k.batch, k.ms * factor});
  } else {
    for (const double b : {c.min_batch(), c.max_batch()}) points.push_back({b, c.at(b) * factor});
  }
  return moebius::latency_curve::fit(points, c.kind());
}

}  // namespace

moebius::layer_bytes whole_switch_per_layer(const moebius::switch_plan& p, int64_t num_layers) {
  moebius::layer_bytes b;
  const auto spread = [num_layers](std::vector<int64_t> v) {
    for (int64_t& x : v) x /= std::max<int64_t>(1, num_layers);
    return v;
  };
  if (p.weights) b.weight_bytes_sent = spread(moebius::traffic_of(*p.weights).bytes_sent);
  if (p.kv) b.kv_bytes_sent = spread(moebius::traffic_of(p.kv->copies).bytes_sent);
  const size_t P = std::max(b.weight_bytes_sent.size(), b.kv_bytes_sent.size());
  b.weight_bytes_sent.resize(P, 0);
  b.kv_bytes_sent.resize(P, 0);
  return b;
}

parallel_mode start_mode_from_load(const std::vector<request>& requests, int64_t t_high) {
  if (requests.empty()) return parallel_mode::tp;
  // The first arrivals: a rollout's first step, else every request at the earliest arrival.
  int64_t first_step = -1;
  double first_s = requests.front().arrival_s;
  for (const request& r : requests) {
    if (r.rollout_step >= 0 && (first_step < 0 || r.rollout_step < first_step)) first_step = r.rollout_step;
    first_s = std::min(first_s, r.arrival_s);
  }
  int64_t n = 0;
  for (const request& r : requests) {
    if (first_step >= 0 ? r.rollout_step == first_step : r.arrival_s <= first_s) ++n;
  }
  return n >= t_high ? parallel_mode::ep : parallel_mode::tp;
}

namespace {
const engine_options& checked(const engine_options& o) {
  MOEBIUS_CHECK(std::isfinite(o.gate.least_step_gain) && o.gate.least_step_gain >= 0 &&
                    o.gate.least_step_gain < 1,
                moebius::errc::invalid_argument, "cost_gate_options::least_step_gain must be in "
                "[0, 1) (got ", o.gate.least_step_gain, ")");
  return o;
}
}  // namespace

run_policy::run_policy(const engine_options& o, const moebius::latency_curves& curves,
                       const moebius::kv_geometry& kv, const step_clock& clock,
                       int64_t num_layers)
    : options_(checked(o)),
      kv_(kv),
      clock_(clock),
      num_layers_(num_layers),
      scope_(o.style == switch_style::stop_the_world ? moebius::plan_scope::stop_the_world
                                                      : moebius::plan_scope::both),
      rules_(rules_of(o)),
      gated_(o.gate.enabled),
      base_curves_(curves),
      curves_(curves) {
  if (gated_) residency_.emplace(o.gate.residency);
}

void run_policy::observe_work(const scheduler& sched, double now_s) {
  const int64_t finished = sched.num_finished();
  const int64_t completions = finished - seen_finished_;
  seen_finished_ = finished;
  completions_.add(static_cast<double>(std::max<int64_t>(0, completions)));
  if (!residency_) return;
  // A request's decode steps: its output tokens.
  const int64_t arrived = finished + sched.num_running() + sched.num_waiting(now_s);
  moebius::step_observation obs;
  obs.arrivals = std::max<int64_t>(0, arrived - seen_arrived_);
  obs.completions = completions;
  if (obs.completions > 0) {
    const int64_t finished_tokens = sched.finished_output_tokens();
    obs.completed_steps = finished_tokens - seen_finished_tokens_;
    seen_finished_tokens_ = finished_tokens;
  }
  obs.running = sched.num_running();
  residency_->observe(obs);
  seen_arrived_ = std::max(seen_arrived_, arrived);
}

moebius::serving_load run_policy::serving_load_of(const run_view& v, parallel_mode target,
                                                  int64_t load) const {
  const work_view w = v.sched.work(v.now_s);
  moebius::serving_load l;
  l.running = w.running;
  l.waiting = w.waiting;
  l.max_running = options_.scheduler.max_running;
  const int64_t live = w.running + w.waiting;
  const double per_sequence =
      live > 0 ? std::max(1.0, static_cast<double>(w.running_tokens + w.waiting_tokens) /
                                   static_cast<double>(live))
               : 1.0;
  const double watermark = options_.scheduler.admission_watermark();
  auto admits = [&](parallel_mode m) {
    const parallel_mode attention = options_.layouts.of(m).attention;
    const int64_t dcp = options_.layouts.dcp_of(m, kv_.dcp);
    return static_cast<int64_t>(
        std::min(pool_tokens(kv_, attention, dcp, watermark) / per_sequence, 1e15));
  };
  l.admits_ep = admits(parallel_mode::ep);
  l.admits_tp = admits(parallel_mode::tp);
  const double prior = output_prior(w);
  l.queue_tokens = static_cast<double>(w.waiting) * prior;
  const moebius::switch_policy_config& c = rules_.config();
  if (w.rollout)
    l.known_residency_steps =
        rollout_residency(w, target, moebius::residency_boundary(c, target), prior);
  l.predicted_residency_steps =
      std::max<int64_t>(1, moebius::residency_steps(c, residency_ ? &*residency_ : nullptr, load,
                                                    target));
  return l;
}

bool faster_by_margin(const moebius::latency_curves& curves, parallel_mode current,
                      parallel_mode target, double load, double margin) {
  MOEBIUS_CHECK(load >= 1, moebius::errc::invalid_argument,
                "faster_by_margin: load must be >= 1 (load=", load, ")");
  MOEBIUS_CHECK(std::isfinite(margin) && margin >= 0, moebius::errc::invalid_argument,
                "faster_by_margin: margin must be finite and >= 0 (margin=", margin, ")");
  return curves.latency_ms(target, load) * (1.0 + margin) < curves.latency_ms(current, load);
}

double run_policy::cost_ms(const run_view& v, const moebius::layer_bytes& per_layer,
                           bool per_layer_plan, bool kv_alone,
                           std::optional<style_price>* styles) const {
  // A dcp change moves the KV alone, stop-the-world (engine::start_switch).
  if (kv_alone) return clock_.predicted_kv_switch_s(per_layer, num_layers_) * 1e3;
  if (options_.style != switch_style::by_cost)
    return clock_.predicted_switch_s(per_layer, num_layers_) * 1e3;
  const style_price c = price_styles(clock_, options_, v.sched.work(v.now_s), v.last_step_s,
                                     per_layer, num_layers_, per_layer_plan);
  if (styles != nullptr) *styles = c;
  return c.batch_s() * 1e3;
}

moebius::gate_evaluation run_policy::weigh(const run_view& v, parallel_mode target, int64_t load,
                                           const std::optional<moebius::serving_load>& work,
                                           double switch_ms) const {
  const parallel_mode current = options_.layouts.mode_of(v.sw.layout(), v.sw.dcp());
  moebius::gate_evaluation g;
  if (work) {
    g = moebius::weigh_switch(curves_, current, target, *work, switch_ms, options_.gate.margin,
                              options_.gate.terms);
    g.load = load;
  } else {
    const moebius::switch_policy_config& c = rules_.config();
    g = moebius::weigh_step_time(curves_, current, target, load,
                                 moebius::residency_steps(c, &*residency_, load, target),
                                 switch_ms, c.gate_margin);
  }
  // The curves' resolution (cost_gate_options::least_step_gain).
  const double batch = static_cast<double>(std::max<int64_t>(1, work ? g.current_batch : load));
  g.least_step_gain_ms = options_.gate.least_step_gain * curves_.latency_ms(current, batch);
  if (g.below_resolution()) g.passed = false;
  return g;
}

run_policy::priced_proposal run_policy::price(const run_view& v,
                                              const moebius::switch_proposal& p) const {
  priced_proposal out;
  const parallel_mode target = p.target;
  const moebius::parallel_layout to = options_.layouts.of(target);
  const int64_t to_dcp = options_.layouts.dcp_of(target, v.sw.dcp());
  const bool kv_alone = to == v.sw.layout();  // a dcp change (the modes differ in it alone)
  std::optional<moebius::serving_load> work;
  if (gated_ && options_.gate.kind == gate_kind::throughput) {
    work = serving_load_of(v, target, p.load);
    // The least the switch can cost: its weights with no KV (no plan needed). A switch that
    // cannot pay even that is refused unplanned (a rule firing on every step of a long tail
    // would otherwise plan on every step).
    moebius::layer_bytes weights_only;
    weights_only.weight_bytes_sent.assign(static_cast<size_t>(kv_.num_ranks), 0);
    weights_only.kv_bytes_sent.assign(static_cast<size_t>(kv_.num_ranks), 0);
    moebius::gate_evaluation least =
        weigh(v, target, p.load, work, cost_ms(v, weights_only, true, kv_alone, nullptr));
    least.priced = false;
    if (!least.passed) {
      out.pricing.gate = least;
      return out;
    }
  }
  // Capacity: every running sequence at its largest must fit the target (the reservations the
  // scheduler holds survive the switch): a page sum, or TP -> EP the placement the plan makes
  // (switcher_options::ep_placement is the scheduler's); and the plan's verdict on the live KV.
  // The target's KV view is its layout's attention (the experts alone: the tables' own).
  const moebius::kv_state& tables = v.sw.kv_tables();
  const bool placed = to.attention == parallel_mode::ep && tables.mode == parallel_mode::tp;
  if (!placed && !v.sched.fits_reservations(tables, to.attention, to_dcp)) {
    out.pricing.fits = false;
    return out;
  }
  const moebius::switch_plan& plan =
      out.plan.emplace(kv_alone ? v.sw.plan_dcp(to_dcp) : v.sw.plan(to, scope_));
  out.pricing.fits = plan.capacity.fits && (!placed || plan.ep_placement.fits);
  if (!out.pricing.fits || !gated_) return out;
  // Without a per-layer plan (not planned, the target cannot hold one layer's KV apart, or the
  // layout's layers interleave) only stop-the-world runs: its bytes spread over the layers.
  const bool per_layer_plan = plan.layer_kv != nullptr;
  const moebius::layer_bytes per_layer =
      per_layer_plan ? plan.bytes_per_layer : whole_switch_per_layer(plan, num_layers_);
  out.pricing.gate =
      weigh(v, target, p.load, work, cost_ms(v, per_layer, per_layer_plan, kv_alone, &out.styles));
  return out;
}

std::optional<decided_switch> run_policy::decide(const run_view& v, int64_t step,
                                                 run_result& out) {
  if (options_.layouts.differ_in_dcp_alone()) return decide_for_capacity(v, step, out);
  const int64_t running = v.sched.num_running();
  const int64_t waiting = v.sched.num_waiting(v.now_s);
  const int64_t load = std::min(running + waiting, options_.scheduler.max_running);
  const bool blocked = v.admission_blocked && waiting > 0;
  const parallel_mode mode = options_.layouts.mode_of(v.sw.layout(), v.sw.dcp());
  // The rules' thresholds are the calibrated decode curves' crossover; the gate's curves,
  // corrected by what the steps take (SGLang's prefills holding TP's decodes among it), may put
  // EP ahead well below it. Asked at the sustained load, by the gate's margin.
  sustained_load_.add(static_cast<double>(load));
  const bool gain = rules_.config().enter_on_sustained_gain && mode == parallel_mode::tp &&
                    corrections_ > 0 &&
                    faster_by_margin(curves_, mode, parallel_mode::ep,
                                     std::max(1.0, sustained_load_.value()), options_.gate.margin);
  const moebius::switch_proposal p = rules_.propose(load, mode, v.now_s, blocked, gain);
  priced_proposal priced = p.proposed() ? price(v, p) : priced_proposal{};
  const moebius::switch_decision d = rules_.decide(p, priced.pricing);
  decision_record r;
  r.step = step;
  r.now_s = v.now_s;
  r.mode = mode;
  r.load = load;
  r.running = running;
  r.waiting = waiting;
  r.admission_blocked = blocked;
  r.decision = d;
  return settle(std::move(r), std::move(priced), out);
}

std::optional<decided_switch> run_policy::settle(decision_record r, priced_proposal priced,
                                                 run_result& out) const {
  const moebius::switch_decision& d = r.decision;
  if (d.reason == moebius::decision_reason::cost_exceeds_gain) {
    ++out.gate_refusals;
    out.last_refusal = priced.pricing.gate;
  }
  const bool switches = d.do_switch && d.target != r.mode;
  if (options_.explain && d.reason != moebius::decision_reason::hold) {
    if (d.reason == moebius::decision_reason::cost_exceeds_gain || d.do_switch)
      r.gate = priced.pricing.gate;
    log_decision(out.decisions, std::move(r));
  }
  if (!switches) return std::nullopt;
  decided_switch s;
  s.target = d.target;
  s.plan = std::move(priced.plan);
  s.gate = priced.pricing.gate;
  s.styles = priced.styles;
  return s;
}

std::optional<decided_switch> run_policy::decide_for_capacity(const run_view& v, int64_t step,
                                                              run_result& out) {
  const work_view w = v.sched.work(v.now_s);
  const int64_t load = std::min(w.running + w.waiting, options_.scheduler.max_running);
  const mode_layouts& m = options_.layouts;
  const parallel_mode mode = m.mode_of(v.sw.layout(), v.sw.dcp());
  // The mode at the smaller dcp holds fewer tokens: the one the KV must fit.
  const parallel_mode small = m.tp_dcp <= m.ep_dcp ? parallel_mode::tp : parallel_mode::ep;
  const parallel_mode large = small == parallel_mode::tp ? parallel_mode::ep : parallel_mode::tp;
  const double small_pool = pool_tokens(kv_, parallel_mode::tp, m.dcp_of(small, kv_.dcp),
                                        options_.scheduler.admission_watermark());
  const double prior = output_prior(w);
  // The waiting count when they will be resident beside the running: a closed-loop rollout's
  // (its step's batch, admitted together), or when the pool is what keeps them out (admission
  // blocked). A queue that the step's token budget or the running cap holds is admitted as
  // others finish, and counting it would send an overloaded server to dcp 2 for KV it never
  // holds at once (a production-shaped trace at 3.9x load: 542 waiting prompts of ~1.6k tokens).
  // In an open loop, the pool keeping the queue out counts only where the larger pool's fuller
  // steps would serve faster (fuller_steps_pay); ungated (no curves to weigh with) or before any
  // step, the capacity alone decides.
  const auto queue_pays = [&] {
    if (!gated_ || !step_rows_.seen()) return true;
    return fuller_steps_pay(std::max(1.0, step_rows_.value()), options_.scheduler.max_step_tokens,
                            w.waiting_tokens, curves_.of(small), curves_.of(large),
                            options_.gate.margin);
  };
  const bool pool_bound = w.waiting > 0 && (w.rollout || (v.admission_blocked && queue_pays()));
  double expected = static_cast<double>(w.running_tokens);
  if (pool_bound)
    expected += static_cast<double>(w.waiting_tokens) + static_cast<double>(w.waiting) * prior;
  // Each running sequence: as many again as it has (at least the prior), up to its limit. A
  // move to the larger dcp counts it in an open loop only while the live set grows
  // (live_set_grows); the move back always does (a tail that could grow stays where it fits).
  double remaining = 0;
  for (size_t i = 0; i < w.generated.size(); ++i)
    remaining += std::min(expected_remaining(w.generated[i], prior),
                          static_cast<double>(w.left_to_limit[i]));
  const bool grows = w.rollout || live_set_grows(w.running, w.running_tokens, completions_.value());
  const double expected_up = expected + (grows ? remaining : 0);
  expected += remaining;
  moebius::switch_proposal p;
  p.load = load;
  p.step = step;
  if (mode == small && expected_up > small_pool) {
    p.target = large;
    p.reason = moebius::decision_reason::above_high;
  } else if (mode == large && w.waiting == 0 && w.running > 0 &&
             expected <= k_capacity_low * small_pool && step >= retry_small_step_ &&
             v.now_s >= retry_small_s_) {
    p.target = small;
    p.reason = moebius::decision_reason::below_low;
  }
  if (!p.proposed()) return std::nullopt;
  moebius::switch_decision d;
  d.target = p.target;
  d.reason = p.reason;
  priced_proposal priced;
  if (p.target == large) {  // no byte moves: capacity alone decides
    priced.plan.emplace(v.sw.plan_dcp(m.dcp_of(large, kv_.dcp)));
    priced.pricing.fits = priced.plan->capacity.fits;
  } else {
    priced = price(v, p);
  }
  if (!priced.pricing.fits) {
    d.reason = moebius::decision_reason::capacity_refused;
  } else if (priced.pricing.gate.evaluated && !priced.pricing.gate.passed) {
    d.reason = moebius::decision_reason::cost_exceeds_gain;
  } else {
    d.do_switch = true;
  }
  // A refused move to the smaller dcp is not planned again within the rules' cooldown (each
  // try plans a copy of every live page).
  if (!d.do_switch && p.target == small) {
    const moebius::switch_policy_config& c = rules_.config();
    retry_small_step_ = step + std::max<int64_t>(1, c.cooldown_steps);
    retry_small_s_ = v.now_s + c.cooldown_s;
  }
  decision_record r;
  r.step = step;
  r.now_s = v.now_s;
  r.mode = mode;
  r.load = load;
  r.running = w.running;
  r.waiting = w.waiting;
  r.decision = d;
  return settle(std::move(r), std::move(priced), out);
}

void run_policy::observe_step(const step_record& rec) {
  if (gated_ && !rec.in_switch && rec.sequences > 0)
    step_rows_.add(static_cast<double>(rec.decode_tokens + rec.prefill_tokens));
  if (!gated_ || !options_.gate.correct_curves || rec.in_switch || rec.sequences <= 0) return;
  const int m = mode_index(rec.mode);
  // The curve at the step's rows (decode tokens and prefill chunk tokens, as the calibration's
  // decode steps would run them spread evenly): the ratio is what the spread, the contexts and
  // the clock add, not the step's share of prefill (which TP's first steps are full of).
  const double rows = static_cast<double>(std::max<int64_t>(1, rec.decode_tokens + rec.prefill_tokens));
  const double predicted_ms = base_curves_.latency_ms(rec.mode, rows);
  if (!(predicted_ms > 0) || !(rec.step_ms > 0)) return;
  const double ratio = rec.step_ms / predicted_ms;
  decode_rows_ += k_rows_weight * (static_cast<double>(rec.decode_tokens) - decode_rows_);
  prefill_rows_ += k_rows_weight * (static_cast<double>(rec.prefill_tokens) - prefill_rows_);
  step_ratio_[m] = ratio_seen_[m] ? step_ratio_[m] + k_ratio_weight * (ratio - step_ratio_[m]) : ratio;
  ratio_seen_[m] = true;
  // The held decodes of the mode serving now, from its first step since the last switch (a
  // stint before it saw other arrivals: a flood's prefills are no measure of the quiet after).
  if (m != stalls_mode_) stalls_ = prefill_stalls{};
  stalls_mode_ = m;
  stalls_.add(rec.step_ms, rec.decode_tokens, rec.decodes_held);
  if (++steps_since_correction_ < k_correction_every) return;
  steps_since_correction_ = 0;
  // A mode not seen yet: EP's step as TP's would be with the recent steps' prefill rows on one
  // rank as far as its chunk takes them (ep_prefill_slowdown); under TP attention in both modes
  // (experts only, dcp only) every rank runs every chunk in either: the same ratio.
  const double b = std::max(1.0, decode_rows_), pf = std::max(0.0, prefill_rows_);
  const bool ep_data_parallel = options_.layouts.ep.attention == parallel_mode::ep;
  const double ep_over_tp =
      ep_data_parallel ? ep_prefill_slowdown(base_curves_.ep, b, pf, kv_.num_ranks,
                                             options_.scheduler.rank_prefill_chunk(kv_.num_ranks))
                       : 1.0;
  const double r_ep = ratio_seen_[0] ? step_ratio_[0] : step_ratio_[1] * ep_over_tp;
  const double r_tp = ratio_seen_[1] ? step_ratio_[1] : step_ratio_[0] / ep_over_tp;
  // The decodes each mode's prefills hold (sglang's prefill-first steps): the serving mode's
  // measured, the other's estimated from it with its schedulers counted (data-parallel
  // attention: one a rank), both at the arrivals of now.
  const int64_t groups[2] = {ep_data_parallel ? kv_.num_ranks : 1, 1};
  const int other = 1 - m;
  double lost[2];
  lost[m] = stalls_.lost_share();
  lost[other] = unseen_lost_share(stalls_.held_share(), stalls_.lost_share(), groups[m],
                                  groups[other]);
  curves_.ep = scaled(base_curves_.ep, r_ep * stall_factor(lost[0]));
  curves_.tp = scaled(base_curves_.tp, r_tp * stall_factor(lost[1]));
  // The rules keep the calibrated thresholds (moving them under a running load makes the
  // rules fire back and forth); the gate weighs with the corrected curves.
  ++corrections_;
  last_factor_[0] = r_ep * stall_factor(lost[0]);
  last_factor_[1] = r_tp * stall_factor(lost[1]);
}

void run_policy::describe(run_result& out) const {
  const engine_options& o = options_;
  std::ostringstream p;
  p << rules_.config();
  out.policy = p.str();
  if (gated_) {
    std::ostringstream g;
    g << to_string(o.gate.kind) << " gate";
    if (o.gate.kind == gate_kind::throughput) g << " (" << o.gate.terms << ")";
    g << "; EP " << base_curves_.ep << "; TP " << base_curves_.tp << "; margin " << o.gate.margin
      << "; least gain a step " << o.gate.least_step_gain << " of the step; " << o.gate.residency;
    out.gate = g.str();
  }
  out.corrections = corrections_;
  if (corrections_ == 0) return;
  const moebius::crossover x = moebius::find_crossover(curves_);
  std::ostringstream c;
  c << "x" << last_factor_[0] << " EP, x" << last_factor_[1] << " TP";
  if (x.status == moebius::crossover_status::found) c << ", crossing at " << x.batch;
  else c << ", " << moebius::to_string(x.status);
  out.correction = c.str();
}

}  // namespace mini_engine
