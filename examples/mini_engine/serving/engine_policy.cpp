// The serving loop's side of the switch policy: the policy and its gate set up for a run, the
// decision before each step with what feeds it (the residency predictor, the capacity check,
// the throughput gate's serving_load, the switch's predicted cost), and the decision log.
#include <algorithm>
#include <cmath>
#include <sstream>

#include <moebius/error.hpp>
#include <moebius/plan/plan.hpp>

#include "engine_run_state.hpp"

namespace mini_engine {

using moebius::parallel_mode;

const char* to_string(gate_kind k) {
  switch (k) {
    case gate_kind::throughput: return "throughput";
    case gate_kind::step_time: return "step_time";
  }
  return "unknown";
}

namespace detail {

namespace {

// Tokens the pool of mode `m` holds for admission: EP, every rank's pages (data-parallel
// attention: a sequence lives on one rank); TP, one rank's (every rank holds every sequence).
double pool_tokens(const moebius::kv_geometry& g, parallel_mode m, double watermark) {
  const double ranks = m == parallel_mode::ep ? static_cast<double>(g.num_ranks) : 1.0;
  return ranks * static_cast<double>(g.num_pages(m)) * static_cast<double>(g.page_size) *
         (1.0 - watermark);
}

// Expected decode tokens still to come for a sequence that has generated `generated`: at least
// what it has generated (a heavy-tailed length: a sequence that has run g tokens runs about g
// more) and at least the mean output of the requests finished so far (`prior`).
double expected_remaining(int64_t generated, double prior) {
  return std::max(static_cast<double>(generated), prior);
}

// The known residency of a closed-loop rollout (no request arrives on its own): in TP, until
// the last survivor of the rollout step ends (the next step's batch sends the engine back to
// EP); in EP, until the live count falls under T_l. In steps.
int64_t rollout_residency(const work_view& w, parallel_mode target, int64_t t_low, double prior) {
  std::vector<double> left;
  left.reserve(static_cast<size_t>(w.running + w.waiting));
  for (const int64_t g : w.generated) left.push_back(expected_remaining(g, prior));
  for (int64_t q = 0; q < w.waiting; ++q) left.push_back(prior);
  if (left.empty()) return 1;
  std::sort(left.begin(), left.end());
  double steps = left.back();
  if (target == parallel_mode::ep) {
    const int64_t live = static_cast<int64_t>(left.size());
    steps = live < t_low ? 1.0 : left[static_cast<size_t>(live - t_low)];
  }
  return std::max<int64_t>(1, static_cast<int64_t>(std::min(std::ceil(steps), 1e12)));
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

double predicted_switch_ms(void* c, parallel_mode target) {
  const auto* ctx = static_cast<const cost_context*>(c);
  const moebius::switch_plan& p = ctx->plans->of(target);  // the capacity check's, planned once
  // The target cannot hold the KV: the capacity check refuses it first.
  if (!p.capacity.fits) return 1e12;
  // Without a per-layer plan (the target cannot hold one layer's KV apart, or the layout's
  // layers interleave) only stop-the-world runs: its bytes spread over the layers.
  const moebius::layer_bytes per_layer =
      p.layer_kv ? p.bytes_per_layer : whole_switch_per_layer(p, ctx->num_layers);
  if (ctx->styled_ms) return ctx->styled_ms(per_layer, p.layer_kv != nullptr);
  return ctx->clock->predicted_switch_s(per_layer, ctx->num_layers) * 1e3;
}

moebius::serving_load serving_load_of(const gate_context& g, parallel_mode target, int64_t load) {
  const work_view w = g.sched->work(*g.now);
  moebius::serving_load l;
  l.running = w.running;
  l.waiting = w.waiting;
  l.max_running = g.max_running;
  const int64_t live = w.running + w.waiting;
  const double per_sequence =
      live > 0 ? std::max(1.0, static_cast<double>(w.running_tokens + w.waiting_tokens) /
                                   static_cast<double>(live))
               : 1.0;
  auto admits = [&](parallel_mode m) {
    return static_cast<int64_t>(std::min(pool_tokens(*g.kv, m, g.watermark) / per_sequence, 1e15));
  };
  l.admits_ep = admits(parallel_mode::ep);
  l.admits_tp = admits(parallel_mode::tp);
  double mean_generated = 0;
  for (const int64_t x : w.generated) mean_generated += static_cast<double>(x);
  if (w.running > 0) mean_generated /= static_cast<double>(w.running);
  const double prior = w.finished > 0 ? static_cast<double>(w.finished_output_tokens) /
                                            static_cast<double>(w.finished)
                                      : std::max(1.0, mean_generated);
  l.queue_tokens = static_cast<double>(w.waiting) * prior;
  if (w.rollout) l.known_residency_steps = rollout_residency(w, target, g.policy->t_low, prior);
  const int64_t boundary = target == parallel_mode::ep ? g.policy->t_low : g.policy->t_high;
  l.predicted_residency_steps =
      g.residency != nullptr ? g.residency->steps_until_cross(load, boundary)
                             : std::max<int64_t>(1, g.policy->expected_residency_steps);
  return l;
}

bool throughput_gate(void* context, parallel_mode current, parallel_mode target, int64_t load,
                     moebius::gate_evaluation& out) {
  const auto* g = static_cast<const gate_context*>(context);
  const moebius::serving_load l = serving_load_of(*g, target, load);
  out = moebius::weigh_switch(*g->curves, current, target, l,
                              predicted_switch_ms(const_cast<cost_context*>(g->cost), target),
                              g->margin, g->terms);
  out.load = load;
  return out.passed;
}

bool throughput_gate_gains(void* context, parallel_mode current, parallel_mode target,
                           int64_t load, moebius::gate_evaluation& out) {
  const auto* g = static_cast<const gate_context*>(context);
  // The least the switch can cost: its weights with no KV (no plan needed).
  moebius::layer_bytes weights_only;
  weights_only.weight_bytes_sent.assign(static_cast<size_t>(g->kv->num_ranks), 0);
  weights_only.kv_bytes_sent.assign(static_cast<size_t>(g->kv->num_ranks), 0);
  const double least_ms =
      g->cost->styled_ms ? g->cost->styled_ms(weights_only, true)
                         : g->cost->clock->predicted_switch_s(weights_only, g->cost->num_layers) * 1e3;
  out = moebius::weigh_switch(*g->curves, current, target, serving_load_of(*g, target, load),
                              least_ms, g->margin, g->terms);
  out.load = load;
  out.priced = false;
  return out.passed;
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

}  // namespace detail

namespace {

bool fits(void* c, parallel_mode target) {
  const auto* ctx = static_cast<const detail::capacity_context*>(c);
  // The scheduler's check first: it sums pages, where the switcher's plans the whole migration
  // (which, asked every step while the target cannot hold the KV, dominated a long run).
  return ctx->sched->fits_reservations(ctx->sw->kv_tables(), target) &&
         ctx->plans->of(target).capacity.fits;
}

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

}  // namespace

void engine::setup_policy(run_state& st, const moebius::latency_curves& curves) {
  const engine_options& o = st.options;
  const bool gated = o.gate.enabled;
  moebius::switch_policy_config config = o.policy;
  if (gated) config.gate_margin = o.gate.margin;
  st.policy.emplace(config, moebius::capacity_check{&fits, &st.capacity});
  if (gated) {
    st.curves = curves;
    st.base_curves = curves;
    st.residency.emplace(o.gate.residency);
    st.cost = detail::cost_context{&st.plans, &clock_, arena_.shape.num_layers, {}};
    if (o.style == switch_style::by_cost) {
      st.cost.styled_ms = [this, &st](const moebius::layer_bytes& per_layer, bool possible) {
        return price_styles(st, per_layer, possible).batch_s() * 1e3;
      };
    }
    if (o.gate.kind == gate_kind::throughput) {
      detail::gate_context& g = st.gate;
      g.sched = &st.sched;
      g.kv = &kv_;
      g.curves = &st.curves;
      g.residency = &*st.residency;
      g.policy = &st.policy->config();
      g.cost = &st.cost;
      g.terms = o.gate.terms;
      g.margin = o.gate.margin;
      g.max_running = o.scheduler.max_running;
      g.watermark = o.scheduler.admission == admission_policy::known ? o.scheduler.watermark : 0;
      g.now = &st.now;
      st.policy->set_gate(moebius::switch_gate{&detail::throughput_gate,
                                               &detail::throughput_gate_gains, &st.gate});
    } else {
      st.policy->set_cost_gate(&st.curves,
                               moebius::switch_cost_estimate{&detail::predicted_switch_ms, &st.cost});
      st.policy->set_residency_predictor(&*st.residency);
    }
    std::ostringstream g;
    g << to_string(o.gate.kind) << " gate";
    if (o.gate.kind == gate_kind::throughput) g << " (" << o.gate.terms << ")";
    g << "; EP " << st.curves.ep << "; TP " << st.curves.tp << "; margin " << o.gate.margin
      << "; " << o.gate.residency;
    st.out.gate = g.str();
  }
  std::ostringstream p;
  p << config;
  st.out.policy = p.str();
}

namespace {

// The exponential means' weight of one step (ratios and rows alike): the residency
// predictor's weight of one completion, ~64 steps of memory. The correction runs after every
// step: curves corrected a few seconds late let a flood's first switch through on stale ones.
constexpr double k_ratio_weight = 1.0 / 64;
constexpr double k_rows_weight = k_ratio_weight;
constexpr int64_t k_correction_every = 1;  // steps between two corrections

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

void engine::observe_step(run_state& st, const step_record& rec) {
  const engine_options& o = st.options;
  if (!st.policy || !o.gate.enabled || !o.gate.correct_curves || rec.in_switch ||
      rec.sequences <= 0)
    return;
  const int m = mode_index(rec.mode);
  // The curve at the step's rows (decode tokens and prefill chunk tokens, as the calibration's
  // decode steps would run them spread evenly): the ratio is what the spread, the contexts and
  // the clock add, not the step's share of prefill (which TP's first steps are full of).
  const double rows = static_cast<double>(std::max<int64_t>(1, rec.decode_tokens + rec.prefill_tokens));
  const double predicted_ms = st.base_curves.latency_ms(rec.mode, rows);
  if (!(predicted_ms > 0) || !(rec.step_ms > 0)) return;
  const double ratio = rec.step_ms / predicted_ms;
  st.decode_rows += k_rows_weight * (static_cast<double>(rec.decode_tokens) - st.decode_rows);
  st.prefill_rows += k_rows_weight * (static_cast<double>(rec.prefill_tokens) - st.prefill_rows);
  st.step_ratio[m] = st.ratio_seen[m] ? st.step_ratio[m] + k_ratio_weight * (ratio - st.step_ratio[m])
                                      : ratio;
  st.ratio_seen[m] = true;
  if (++st.steps_since_correction < k_correction_every) return;
  st.steps_since_correction = 0;
  // A mode not seen yet: EP's step as TP's would be with the recent steps' prefill rows on one
  // rank (an EP step is its busiest rank's: a chunk runs on its owner alone, where TP spreads
  // it), the curve at b + P p rows against b + p.
  const double b = std::max(1.0, st.decode_rows), p = std::max(0.0, st.prefill_rows);
  const double ep_over_tp = st.base_curves.ep.at(b + static_cast<double>(kv_.num_ranks) * p) /
                            st.base_curves.ep.at(b + p);
  const double r_ep = st.ratio_seen[0] ? st.step_ratio[0] : st.step_ratio[1] * ep_over_tp;
  const double r_tp = st.ratio_seen[1] ? st.step_ratio[1] : st.step_ratio[0] / ep_over_tp;
  st.curves.ep = scaled(st.base_curves.ep, r_ep);
  st.curves.tp = scaled(st.base_curves.tp, r_tp);
  // The rules keep the calibrated thresholds (moving them under a running load makes the
  // rules fire back and forth); the gate weighs with the corrected curves.
  // The report's line is written once, at the run's end (describe_correction), not per step.
  ++st.out.corrections;
  st.last_factor[0] = r_ep;
  st.last_factor[1] = r_tp;
}

void engine::describe_correction(run_state& st) {
  if (st.out.corrections == 0) return;
  const moebius::crossover x = moebius::find_crossover(st.curves);
  std::ostringstream c;
  c << "x" << st.last_factor[0] << " EP, x" << st.last_factor[1] << " TP";
  if (x.status == moebius::crossover_status::found) c << ", crossing at " << x.batch;
  else c << ", " << moebius::to_string(x.status);
  st.out.correction = c.str();
}

std::optional<parallel_mode> engine::decide(run_state& st, int64_t step) {
  const engine_options& o = st.options;
  if (st.residency) {
    // What happened since the last decision: arrivals, completions and the steps those ran
    // (a request's decode steps: its output tokens).
    const int64_t finished = st.sched.num_finished();
    const int64_t arrived = finished + st.sched.num_running() + st.sched.num_waiting(st.now);
    moebius::step_observation obs;
    obs.arrivals = std::max<int64_t>(0, arrived - st.seen_arrived);
    obs.completions = finished - st.seen_finished;
    if (obs.completions > 0) {
      const int64_t finished_tokens = st.sched.finished_output_tokens();
      obs.completed_steps = finished_tokens - st.seen_finished_tokens;
      st.seen_finished_tokens = finished_tokens;
    }
    obs.running = st.sched.num_running();
    st.residency->observe(obs);
    st.seen_arrived = std::max(st.seen_arrived, arrived);
    st.seen_finished = finished;
  }
  if (st.session) return std::nullopt;
  if (o.how == switching::policy) {
    const int64_t running = st.sched.num_running();
    const int64_t waiting = st.sched.num_waiting(st.now);
    const int64_t load = std::min(running + waiting, o.scheduler.max_running);
    const bool blocked = st.admission_blocked && waiting > 0;
    const moebius::switch_decision d = st.policy->step(load, switcher_.mode(), st.now, blocked);
    const bool weighed = d.reason == moebius::decision_reason::cost_exceeds_gain || d.do_switch;
    if (d.reason == moebius::decision_reason::cost_exceeds_gain) {
      ++st.out.gate_refusals;
      st.out.last_refusal = st.policy->last_gate();
    }
    if (o.explain && d.reason != moebius::decision_reason::hold) {
      decision_record r;
      r.step = step;
      r.now_s = st.now;
      r.mode = switcher_.mode();
      r.load = load;
      r.running = running;
      r.waiting = waiting;
      r.admission_blocked = blocked;
      r.decision = d;
      if (weighed && st.policy->gate_active()) r.gate = st.policy->last_gate();
      log_decision(st.out.decisions, std::move(r));
    }
    if (d.do_switch && d.target != switcher_.mode()) {
      st.pending_gate = st.policy->gate_active() ? st.policy->last_gate() : moebius::gate_evaluation{};
      return d.target;
    }
  } else if (o.how == switching::forced) {
    while (st.next_forced < o.forced_steps.size() && o.forced_steps[st.next_forced] < step) {
      ++st.next_forced;
    }
    if (st.next_forced < o.forced_steps.size() && o.forced_steps[st.next_forced] == step) {
      return switcher_.mode() == parallel_mode::ep ? parallel_mode::tp : parallel_mode::ep;
    }
  }
  return std::nullopt;
}

}  // namespace mini_engine
