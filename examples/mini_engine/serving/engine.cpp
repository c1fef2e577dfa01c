#include "engine_run_state.hpp"

#include <algorithm>
#include <cmath>
#include <optional>
#include <ostream>
#include <sstream>
#include <utility>

#include <moebius/error.hpp>
#include <moebius/kv/page_table.hpp>

#include "kv_pages.hpp"
#include "trace_stats.hpp"

namespace mini_engine {

using moebius::errc;
using moebius::kv_state;
using moebius::parallel_mode;

namespace {

// How a switch ended, from the switcher's report into the run's record.
void record_outcome(switch_record& s, const moebius::switch_report& r) {
  s.outcome = r.outcome;
  s.error = r.error;
  s.measured_ms = r.total_ms;
}

kv_state empty_tables(const moebius::kv_geometry& g, parallel_mode m) {
  kv_state s;
  s.mode = m;
  s.ranks.resize(static_cast<size_t>(g.num_ranks));
  for (moebius::kv_rank_state& r : s.ranks) {
    r.free_pages.resize(static_cast<size_t>(g.num_pages(m)));
    for (size_t p = 0; p < r.free_pages.size(); ++p) r.free_pages[p] = static_cast<int64_t>(p);
  }
  return s;
}

int64_t used_pages_all(const moebius::kv_geometry& g, const kv_state& s) {
  int64_t used = 0;
  for (int r = 0; r < g.num_ranks; ++r) used += moebius::used_pages(g, s, r);
  return used;
}


// Decode-step batches for the gate's calibration: 1, 2, 4, ... below max_running, and it.
std::vector<int64_t> calibration_batches(int64_t max_running) {
  std::vector<int64_t> b;
  for (int64_t x = 1; x < max_running; x *= 2) b.push_back(x);
  b.push_back(std::max<int64_t>(max_running, 2));
  return b;
}

}  // namespace

engine::engine(runtime& rt, moebius::transport& t, const moebius::arena_geometry& arena,
               const moebius::kv_geometry& kv, const step_clock& clock,
               moebius::arena_cursor cursor, std::optional<moebius::kv_pool_layout> kv_layout)
    : runtime_(rt),
      arena_(arena),
      kv_(kv),
      home_dcp_(kv.dcp),
      clock_(clock),
      switcher_(arena, kv, t,
                empty_tables(kv, cursor.tp_layers == 0 ? parallel_mode::ep : parallel_mode::tp),
                cursor, [this, &kv_layout] {
                  moebius::switcher_options o;
                  o.kv_layout = kv_layout;
                  // The checks see only the tokens written when the switch began (engine.hpp).
                  o.verify = [this](moebius::arena_cursor c, const kv_state& s) -> uint64_t {
                    return verify_ ? verify_(c, written_prefix(kv_, s, verify_written_)) : 0;
                  };
                  o.verify_layer = [this](int64_t layer, parallel_mode m,
                                          const kv_state& s) -> uint64_t {
                    return verify_layer_
                               ? verify_layer_(layer, m, written_prefix(kv_, s, verify_written_))
                               : 0;
                  };
                  // TP -> EP owners by the scheduler's reservations (scheduler::ep_placement);
                  // between runs (no live sequence) longest-first over the whole pools.
                  o.ep_placement = [this](const kv_state& s) {
                    if (sched_ != nullptr) return sched_->ep_placement(s);
                    std::vector<moebius::kv_demand> demands;
                    std::vector<int64_t> groups;
                    moebius::kv_demands_of(kv_, s, demands, groups);
                    return moebius::place_longest_first(
                        demands, groups,
                        std::vector<int64_t>(static_cast<size_t>(kv_.num_ranks), kv_.num_ep_pages));
                  };
                  return o;
                }()) {}


moebius::switch_report engine::switch_untimed(moebius::parallel_layout target, int64_t dcp) {
  moebius::switch_report r;
  r.from = r.to = switcher_.layout();
  r.from_dcp = r.to_dcp = switcher_.dcp();
  r.cursor = switcher_.cursor();  // already_there unless something moves below
  const bool dcp_changes = dcp > 0 && dcp != switcher_.dcp();
  // Under data-parallel attention a dcp change moves nothing: first, so that the layout's
  // switch to TP attention lands at the new dcp; under TP attention after the layout's.
  const bool dcp_first = switcher_.layout().attention == parallel_mode::ep;
  bool committed_before = false;  // a first part that committed before the report's
  auto run = [&](auto part) {
    committed_before = committed_before || r.outcome == moebius::switch_outcome::committed;
    r = part();
  };
  if (dcp_changes && dcp_first) run([&] { return switcher_.switch_dcp(dcp); });
  if (switcher_.layout() != target && switcher_.consistent())
    run([&] { return switcher_.switch_to(target); });
  if (dcp_changes && !dcp_first && switcher_.consistent() && switcher_.layout() == target)
    run([&] { return switcher_.switch_dcp(dcp); });
  follow_kv_dcp();
  if (committed_before && r.outcome != moebius::switch_outcome::committed &&
      r.outcome != moebius::switch_outcome::already_there)
    r.error += std::string(" (after a first part committed: the switcher rests in ") +
               moebius::to_string(switcher_.layout()) + " at dcp " +
               std::to_string(switcher_.dcp()) + ")";
  return r;
}

moebius::switch_plan engine::plan_switch(moebius::parallel_layout to, int64_t dcp,
                                         moebius::plan_scope scope) const {
  if (to == switcher_.layout() && dcp > 0 && dcp != switcher_.dcp()) return switcher_.plan_dcp(dcp);
  return switcher_.plan(to, scope);
}

void engine::follow_kv_dcp() {
  if (kv_.dcp == switcher_.dcp()) return;
  kv_ = moebius::with_dcp(kv_, switcher_.dcp());
  if (sched_ != nullptr) sched_->follow_dcp(kv_.dcp);
}

// Ends every run, normally or by an exception.
struct engine::run_cleanup {
  engine& e;
  std::optional<run_state>& st;
  ~run_cleanup() { e.end_run(st); }
};

void engine::end_run(std::optional<run_state>& st) noexcept {
  try {
    if (st) st->driver.reset();  // an open session aborts
  } catch (...) {  // the switcher's last_report() says what happened
  }
  sched_ = nullptr;
  verify_ = nullptr;
  verify_layer_ = nullptr;
  verify_written_.clear();
  if (switcher_.in_progress()) return;  // only if the abort above threw: nothing to free
  release_all_sequences(switcher_.mutable_kv_tables());
}

bool engine::reservations_fit(run_state& st, const moebius::switch_plan& plan, switch_record& s) {
  const parallel_mode target = plan.to.attention;  // the KV's view
  const bool placed = target == parallel_mode::ep && plan.from.attention == parallel_mode::tp;
  if (placed ? plan.ep_placement.fits
             : st.sched.fits_reservations(switcher_.kv_tables(), target, plan.to_dcp))
    return true;
  s.outcome = moebius::switch_outcome::refused_capacity;
  std::ostringstream why;
  why << "refused: the " << st.sched.num_running() << " running sequences, each at its largest, "
      << "do not fit " << moebius::to_string(target);
  if (target == parallel_mode::tp && plan.to_dcp > 1) why << " at dcp " << plan.to_dcp;
  why << " (" << kv_.num_pages(target) << " pages a rank";
  const moebius::kv_geometry to = moebius::with_dcp(kv_, plan.to_dcp);
  if (target == parallel_mode::tp && to.tp_replicas() / to.dcp > 1)
    why << ", every sequence on every " << (to.dcp > 1 ? "set of dcp ranks" : "rank") << ": H_kv="
        << kv_.num_kv_heads << " < P=" << kv_.num_ranks;
  why << "): after the switch some could not grow";
  s.error = why.str();
  return false;
}

std::optional<decided_switch> engine::decide(run_state& st, int64_t step) {
  const engine_options& o = st.options;
  if (st.policy) st.policy->observe_work(st.sched, st.now);
  if (st.driver) return std::nullopt;
  if (st.policy) {
    const run_view v{switcher_, st.sched, st.now, st.plain.last_step_s(), st.admission_blocked};
    return st.policy->decide(v, step, st.out);
  }
  if (o.how != switching::forced) return std::nullopt;
  if (!o.forced_at_s.empty()) {
    if (st.next_forced_at == o.forced_at_s.size() || o.forced_at_s[st.next_forced_at] > st.now)
      return std::nullopt;
    ++st.next_forced_at;  // one a step: each time passed is a switch, in order
  } else {
    while (st.next_forced < o.forced_steps.size() && o.forced_steps[st.next_forced] < step) {
      ++st.next_forced;
    }
    if (st.next_forced == o.forced_steps.size() || o.forced_steps[st.next_forced] != step)
      return std::nullopt;
  }
  decided_switch d;  // to the other mode
  d.target = o.layouts.mode_of(switcher_.layout(), switcher_.dcp()) == parallel_mode::ep
                 ? parallel_mode::tp
                 : parallel_mode::ep;
  return d;
}

void engine::start_switch(run_state& st, decided_switch d, step_record& rec) {
  const engine_options& o = st.options;
  switch_record s;
  s.step = rec.step;
  s.start_s = st.now;
  s.running = st.sched.num_running();
  s.prefilling = st.sched.num_prefilling();
  s.from = switcher_.layout();
  s.to = o.layouts.of(d.target);
  s.from_dcp = switcher_.dcp();
  s.to_dcp = o.layouts.dcp_of(d.target, home_dcp_);
  s.gate = d.gate;
  // A forced switch is planned here, once; the policy's arrives with the plan it was priced on.
  if (!d.plan) {
    const moebius::plan_scope scope = o.style == switch_style::stop_the_world
                                          ? moebius::plan_scope::stop_the_world
                                          : moebius::plan_scope::both;
    d.plan = plan_switch(s.to, s.to_dcp, scope);
    if (!reservations_fit(st, *d.plan, s)) {
      st.out.switches.push_back(std::move(s));
      return;
    }
  }
  if (o.test_hooks.before_switch) o.test_hooks.before_switch(switcher_, rec.step);
  verify_written_ = st.sched.written_tokens();
  // A dcp change runs stop-the-world (its plan has no per-layer part to pace).
  bool progressive = o.style == switch_style::progressive && !d.plan->changes_dcp();
  // by_cost: the cheaper style, from the plan's bytes (without a per-layer plan, stop-the-world).
  if (o.style == switch_style::by_cost && d.plan->layer_kv != nullptr && !d.plan->changes_dcp()) {
    if (!d.styles || d.styles->layers_per_step == 0)
      d.styles = price_styles(clock_, o, st.sched.work(st.now), st.plain.last_step_s(),
                              d.plan->bytes_per_layer, arena_.shape.num_layers, true);
    s.stall_request_s = d.styles->stall_request_s;
    s.progressive_request_s = d.styles->progressive_request_s;
    s.waiting = d.styles->waiting;
    progressive = d.styles->progressive();
  }
  if (progressive) {
    auto driver = std::make_unique<progressive_driver>(
        switcher_, st.sched, clock_, o, arena_.shape.num_layers, *d.plan, st.plain.last_step_s(),
        s, st.out.switches.size());
    switch (driver->started()) {
      case progressive_driver::start::open:
        st.driver = std::move(driver);
        break;
      case progressive_driver::start::ended:  // decided progressive: no stop-the-world retry
        record_outcome(s, driver->report());
        break;
      case progressive_driver::start::not_begun:
        progressive = false;
        break;
    }
  }
  if (!progressive) stop_the_world(st, std::move(*d.plan), s, rec);
  st.out.switches.push_back(std::move(s));
}

void engine::stop_the_world(run_state& st, moebius::switch_plan plan, switch_record& s,
                            step_record& rec) {
  // A plan made before the pages were handed out again (a progressive begin that could not
  // reserve them) is stale: plan once more.
  if (!switcher_.why_stale(plan).empty())
    plan = plan_switch(plan.to, plan.to_dcp, moebius::plan_scope::stop_the_world);
  const moebius::switch_report r = switcher_.switch_to(plan);
  follow_kv_dcp();
  s.from = r.from;
  s.to = r.to;
  s.from_dcp = r.from_dcp;
  s.to_dcp = r.to_dcp;
  record_outcome(s, r);
  s.clock_ms = clock_.switch_s(r) * 1e3;
  if (r.outcome == moebius::switch_outcome::inconsistent) recover_in_run(st, r, s);
  st.now += s.clock_ms * 1e-3;
  if (r.outcome == moebius::switch_outcome::committed) {
    rec.switched = true;
    rec.switch_ms = s.clock_ms;
  }
}

bool engine::serve_step(run_state& st, step_record& rec) {
  step_runner& runner = st.runner();
  page_source& pages = runner.open_step();
  rec.start_s = st.now;
  const step_batch b = st.sched.next_step(pages, st.now);
  if (b.empty() && !runner.runs_without_batch()) return false;
  rec.in_switch = st.driver != nullptr;
  rec.cursor = switcher_.cursor().tp_layers;
  served_step done = runner.run(runtime_, b, rec);
  rec.config = done.config;
  rec.mode = st.options.layouts.mode_of(done.layout, done.config.dcp);
  rec.sequences = b.num_sequences;
  rec.decode_tokens = b.decode_tokens;
  rec.prefill_tokens = b.prefill_tokens;
  rec.context_tokens = b.context_tokens;
  rec.running = st.sched.num_running();
  rec.waiting = st.sched.num_waiting(st.now);
  rec.stalled = b.stalled;
  rec.decodes_held = b.decodes_held;
  st.admission_blocked = b.admission_blocked;
  rec.preempted = b.preempted;
  rec.kv_used_pages = used_pages_all(kv_, *done.tables);
  rec.kv_written_tokens = b.kv_written_tokens;
  rec.kv_reserved_tokens = b.kv_reserved_tokens;
  rec.new_token_ratio = b.new_token_ratio;
  rec.eager = b.eager;
  rec.step_ms = done.clock_s * 1e3;
  rec.measured_ms = done.measured_s * 1e3;
  st.out.stalls += b.stalled;
  st.out.preemptions += b.preempted;
  st.now += done.clock_s;
  if (!b.empty()) st.sched.finish_step(b, done.tokens, pages, st.now);
  if (st.driver && st.driver->after_step(rec, st.out)) end_progressive(st);
  return true;
}

void engine::end_progressive(run_state& st) {
  progressive_driver& d = *st.driver;
  const moebius::switch_report r = d.report();
  follow_kv_dcp();
  switch_record& s = st.out.switches[d.switch_idx()];
  record_outcome(s, r);
  s.clock_ms = (st.now - s.start_s) * 1e3;
  s.tokens = d.tokens_during();
  if (r.outcome == moebius::switch_outcome::inconsistent) recover_in_run(st, r, s);
  d.release_deferred();
  st.driver.reset();
}

void engine::report_progress(const run_state& st, int64_t step) const {
  const engine_options& o = st.options;
  if (!o.on_progress || o.progress_every_steps <= 0 || step % o.progress_every_steps != 0) return;
  progress_info p;
  p.run = &st.out.name;
  p.step = step;
  p.now_s = st.now;
  p.running = st.sched.num_running();
  p.finished = st.sched.num_finished();
  p.total = st.total;
  p.mode = o.layouts.mode_of(switcher_.layout(), switcher_.dcp());
  p.config = configuration_of(switcher_.layout(), switcher_.dcp());
  p.switches = static_cast<int64_t>(st.out.switches.size());
  o.on_progress(p);
}

run_result engine::run(std::vector<request> requests, const engine_options& o,
                       const std::string& name) {
  MOEBIUS_CHECK(no_live_sequences(switcher_.kv_tables()), errc::invalid_argument,
                "engine::run: the KV tables still hold live sequences");
  MOEBIUS_CHECK(switcher_.consistent(), errc::invalid_argument,
                "engine::run: the switcher is inconsistent since a failed switch (",
                switcher_.last_report().error, "): no byte of the arena is trusted; call "
                "engine::recover first");
  MOEBIUS_CHECK(std::is_sorted(o.forced_steps.begin(), o.forced_steps.end()),
                errc::invalid_argument, "engine::run: forced_steps must be ascending");
  MOEBIUS_CHECK((o.layouts.ep_dcp == 0 && o.layouts.tp_dcp == 0) || o.layouts.differ_in_dcp_alone(),
                errc::invalid_argument, "engine::run: engine_options::layouts names a dcp per mode "
                "(ep_dcp ", o.layouts.ep_dcp, ", tp_dcp ", o.layouts.tp_dcp, ") but not two "
                "different ones of one TP-attention layout (", moebius::to_string(o.layouts.ep),
                " / ", moebius::to_string(o.layouts.tp), "): leave both 0 to serve at the KV "
                "geometry's");
  for (size_t i = 0; i < o.forced_at_s.size(); ++i)
    MOEBIUS_CHECK(std::isfinite(o.forced_at_s[i]) && o.forced_at_s[i] >= 0 &&
                      (i == 0 || o.forced_at_s[i] >= o.forced_at_s[i - 1]),
                  errc::invalid_argument, "engine::run: forced_at_s[", i, "] = ",
                  o.forced_at_s[i], " must be finite, >= 0 and not below the one before");
  // The gate's curves: given, or calibrated on this engine's clock before the run (the tables
  // hold no live sequence yet).
  const bool gated = o.how == switching::policy && o.gate.enabled;
  moebius::latency_curves curves;
  if (gated) {
    if (o.gate.curves) {
      curves = *o.gate.curves;
    } else {
      const int64_t context =
          o.gate.calibration_context > 0 ? o.gate.calibration_context : mean_decode_context(requests);
      curves = calibrate_engine(*this, calibration_batches(o.scheduler.max_running), context, {},
                                o.layouts)
                   .curves;
    }
  }
  // Requests are validated (token ids against the runtime's vocab) before anything else.
  scheduler_options so = o.scheduler;
  if (so.vocab == 0) so.vocab = runtime_.vocab_size();
  const parallel_mode start = o.how == switching::policy && o.start_from_load
                                  ? start_mode_from_load(requests, o.policy.t_high)
                                  : o.start_mode;
  std::optional<run_state> state;
  const run_cleanup cleanup{*this, state};
  state.emplace(kv_, std::move(requests), o, so, name, switcher_, clock_);
  run_state& st = *state;
  verify_ = o.verify;
  verify_layer_ = o.verify_layer;
  sched_ = &st.sched;
  // To the start mode's layout, with no live sequence yet; when that switch fails and rolls
  // back the run serves in the layout it is in (recorded as switch 0).
  {
    const moebius::parallel_layout from = switcher_.layout();
    const int64_t from_dcp = switcher_.dcp();
    const int64_t to_dcp = o.layouts.dcp_of(start, home_dcp_);
    const moebius::switch_report r = switch_untimed(o.layouts.of(start), to_dcp);
    if (r.outcome != moebius::switch_outcome::committed &&
        r.outcome != moebius::switch_outcome::already_there) {
      switch_record s;
      s.from = from;
      s.to = o.layouts.of(start);
      s.from_dcp = from_dcp;
      s.to_dcp = to_dcp;
      record_outcome(s, r);
      if (r.outcome == moebius::switch_outcome::inconsistent) recover_in_run(st, r, s);
      st.out.switches.push_back(std::move(s));
    }
  }
  if (o.how == switching::policy) st.policy.emplace(o, curves, kv_, clock_, arena_.shape.num_layers);
  st.out.name = name;
  st.out.clock = clock_.name();
  st.total = static_cast<int64_t>(st.sched.results().size());
  for (int64_t step = 0; !st.sched.done(); ++step) {
    MOEBIUS_CHECK(step < o.max_steps, errc::internal, "engine::run '", name, "': more than ",
                  o.max_steps, " steps (", st.sched.num_finished(), " of ", st.total,
                  " finished)");
    // Idle: nothing runs, jump the clock to the next arrival. Not while a progressive switch
    // is open: its remaining layers move first, in steps of copies alone, on the clock.
    if (!st.driver && st.sched.num_running() == 0 && st.sched.next_arrival_s() > st.now) {
      st.now = st.sched.next_arrival_s();
    }
    step_record rec;
    rec.step = step;
    if (std::optional<decided_switch> d = decide(st, step)) start_switch(st, std::move(*d), rec);
    if (!serve_step(st, rec)) continue;
    if (o.validate_every_step) moebius::validate(kv_, switcher_.kv_tables());
    if (st.policy) st.policy->observe_step(rec);
    st.out.steps.push_back(rec);
    report_progress(st, step);
  }
  if (st.driver) {  // every request finished during the switch: move the rest and commit,
    st.now += st.driver->finish_rest();  // charged on the clock as copies alone
    end_progressive(st);
  }
  MOEBIUS_CHECK(no_live_sequences(switcher_.kv_tables()), errc::internal, "engine::run '", name,
                "': pages still in use after every request finished (a leak)");
  moebius::validate(kv_, switcher_.kv_tables());
  st.out.requests = st.sched.results();
  st.out.failed_requests = st.sched.num_failed();
  if (st.policy) st.policy->describe(st.out);
  st.out.end_s = st.now;
  return std::move(st.out);
}

}  // namespace mini_engine
