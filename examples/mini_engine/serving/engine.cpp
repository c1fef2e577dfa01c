#include "engine_run_state.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <optional>
#include <cstdio>
#include <ostream>
#include <sstream>
#include <utility>

#include <moebius/error.hpp>
#include <moebius/kv/page_table.hpp>
#include <moebius/switch/pacing.hpp>

#include "kv_pages.hpp"
#include "trace_stats.hpp"
#include "step_beside.hpp"

namespace mini_engine {

using moebius::errc;
using moebius::kv_state;
using moebius::parallel_mode;
using detail::host_clock;
using detail::no_live_sequences;
using detail::record_outcome;
using detail::seconds_since;
using detail::tokens_produced;

namespace {

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


moebius::switch_report engine::switch_untimed(parallel_mode target) {
  if (switcher_.mode() == target) {
    moebius::switch_report r;
    r.from = r.to = target;
    r.cursor = switcher_.cursor();
    return r;  // already_there
  }
  return switcher_.switch_to(target);
}

// Ends every run, normally or by an exception.
struct engine::run_cleanup {
  engine& e;
  std::optional<run_state>& st;
  ~run_cleanup() { e.end_run(st); }
};

void engine::end_run(std::optional<run_state>& st) noexcept {
  try {
    if (st && st->session) {
      st->session->abort();
      st->session.reset();
    }
  } catch (...) {  // the switcher's last_report() says what happened
  }
  sched_ = nullptr;
  verify_ = nullptr;
  verify_layer_ = nullptr;
  verify_written_.clear();
  if (switcher_.in_progress()) return;  // only if the abort above threw: nothing to free
  kv_state& tables = switcher_.mutable_kv_tables();
  std::vector<int64_t> ids;
  for (const moebius::kv_rank_state& r : tables.ranks)
    for (const moebius::kv_sequence& q : r.sequences) ids.push_back(q.seq_id);
  for (const int64_t id : ids) release_sequence(tables, id);
}

bool engine::reservations_fit(run_state& st, parallel_mode target, switch_record& s) {
  if (st.sched.fits_reservations(switcher_.kv_tables(), target)) return true;
  s.outcome = moebius::switch_outcome::refused_capacity;
  std::ostringstream why;
  why << "refused: the " << st.sched.num_running() << " running sequences, each at its largest, "
      << "do not fit " << moebius::to_string(target) << " (" << kv_.num_pages(target)
      << " pages a rank";
  if (target == parallel_mode::tp && kv_.tp_replicas() > 1)
    why << ", every sequence on every rank: H_kv=" << kv_.num_kv_heads << " < P=" << kv_.num_ranks;
  why << "): after the switch some could not grow";
  s.error = why.str();
  return false;
}

void engine::start_switch(run_state& st, parallel_mode target, step_record& rec) {
  switch_record s;
  s.step = rec.step;
  s.start_s = st.now;
  s.running = st.sched.num_running();
  s.prefilling = st.sched.num_prefilling();
  s.from = switcher_.mode();
  s.to = target;
  s.gate = std::exchange(st.pending_gate, moebius::gate_evaluation{});
  if (!reservations_fit(st, target, s)) {
    st.out.switches.push_back(std::move(s));
    return;
  }
  if (st.options.test_hooks.before_switch) st.options.test_hooks.before_switch(switcher_, rec.step);
  verify_written_ = st.sched.written_tokens();
  bool try_progressive = st.options.style == switch_style::progressive;
  if (st.options.style == switch_style::by_cost) {
    // Without a per-layer plan (the target cannot hold one layer's KV) only stop-the-world runs.
    const moebius::switch_plan& p = st.plans.of(target);
    if (p.layer_kv != nullptr) {
      const detail::style_price c = price_styles(st, p.bytes_per_layer, true);
      s.stall_request_s = c.stall_request_s;
      s.progressive_request_s = c.progressive_request_s;
      s.waiting = c.waiting;
      try_progressive = c.progressive();
    }
  }
  const bool progressive = try_progressive && begin_progressive(st, target, s);
  if (!progressive) stop_the_world(st, target, s, rec);
  st.out.switches.push_back(std::move(s));
}




void engine::stop_the_world(run_state& st, parallel_mode target, switch_record& s,
                            step_record& rec) {
  const moebius::switch_report r = switcher_.switch_to(st.plans.of(target));
  s.from = r.from;
  s.to = r.to;
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
  // During a progressive switch the tables are frozen: the step reads both sets through the
  // session's view and takes no page, and the next paced layers move beside it.
  const bool frozen = st.session.has_value();
  std::optional<moebius::switch_step_view> view;
  if (frozen) view = st.session->view();
  std::optional<growing_pages> growing;
  std::optional<frozen_pages> held;
  page_source& pages = frozen
      ? static_cast<page_source&>(held.emplace(view->tables(view->source()), st.deferred_release))
      : growing.emplace(kv_, switcher_.mutable_kv_tables());
  const kv_state& tables = pages.tables();
  rec.start_s = st.now;
  const step_batch b = st.sched.next_step(pages, st.now);
  if (b.empty() && !frozen) return false;
  const step_layout layout =
      frozen ? step_layout::during(*view) : step_layout{&tables, switcher_.cursor()};
  rec.in_switch = frozen;
  rec.cursor = switcher_.cursor().tp_layers;
  std::vector<int32_t> tokens;
  double measured = 0;
  switch_copies copies;
  step_cost cost;
  if (!b.empty()) {
    // Data-parallel attention: in EP each rank runs its own items (read before the step: a
    // progressive switch that ends during it takes its tables along).
    std::vector<rank_work> ep_split;
    if (frozen || tables.mode == parallel_mode::ep)
      ep_split = ep_rank_work(frozen ? view->tables(parallel_mode::ep) : tables, b.items);
    const auto t0 = host_clock::now();
    step_result done;
    if (frozen) {
      const step_beside_result r = step_beside(
          runtime_, layout, b.items,
          [&](const moebius::step_layer_events* events) { enqueue_advance(st, rec, events); },
          [&]() -> step_layout {
            wait_for_advance(st);
            if (!st.session->open())
              return step_layout{&switcher_.kv_tables(), switcher_.cursor()};
            return step_layout::during(st.session->view());
          });
      done = r.step;
      measured = seconds_since(t0);
      // Where the copies ran after the step (a runtime that does not overlap them), the
      // host's time for the step holds them: they count as copies.
      if (!runtime_.overlaps_copies()) {
        measured = std::max(0.0, measured - r.advance_s);
        copies.measured_s = r.advance_s;
      }
    } else {
      done = runtime_.finish(runtime_.enqueue(layout, b.items));
      if (done.overflowed) {  // nothing beside it: the rerun is at the same layout
        step_options rerun;
        rerun.rerun = true;
        done = runtime_.finish(runtime_.enqueue(layout, b.items, rerun));
      }
      measured = seconds_since(t0);
    }
    tokens = std::move(done.tokens);
    // A runtime that times itself (the GPU runtime: CUDA events) reports the device time.
    if (done.measured_s >= 0) measured = done.measured_s;
    cost.mode = tables.mode;
    if (frozen && switcher_.cursor().tp_layers * 2 >= arena_.shape.num_layers)
      cost.mode = parallel_mode::tp;  // a hybrid step: priced as its majority mode
    cost.num_ranks = kv_.num_ranks;
    cost.num_sequences = b.num_sequences;
    cost.new_tokens = b.decode_tokens + b.prefill_tokens;
    cost.context_tokens = b.context_tokens;
    if (cost.mode == parallel_mode::ep) cost.ranks = std::move(ep_split);
  } else {
    enqueue_advance(st, rec, nullptr);  // nothing to run: the copies alone
  }
  double dt = 0;
  if (frozen) {
    // What the loop waited for the copies once the step was done (all of them when none ran).
    copies.measured_s += wait_for_advance(st);
    copies.bytes = st.pacing.bytes_per_layer * rec.layers;
    rec.copy_ms = clock_.copies_s(copies) * 1e3;
    dt = b.empty() ? clock_.copies_s(copies) : clock_.switch_step_s(cost, measured, copies);
  } else {
    dt = clock_.step_s(cost, measured);
    st.last_step_s = dt;
  }
  rec.mode = tables.mode;
  rec.sequences = b.num_sequences;
  rec.decode_tokens = b.decode_tokens;
  rec.prefill_tokens = b.prefill_tokens;
  rec.context_tokens = b.context_tokens;
  rec.running = st.sched.num_running();
  rec.waiting = st.sched.num_waiting(st.now);
  rec.stalled = b.stalled;
  st.admission_blocked = b.admission_blocked;
  rec.preempted = b.preempted;
  rec.kv_used_pages = used_pages_all(kv_, tables);
  rec.step_ms = dt * 1e3;
  rec.measured_ms = measured * 1e3;
  st.out.stalls += b.stalled;
  st.out.preemptions += b.preempted;
  st.now += dt;
  if (!b.empty()) st.sched.finish_step(b, tokens, pages, st.now);
  if (frozen) {
    ++st.out.switches[st.switch_idx].steps;
    close_advance(st, rec);
    if (st.session && st.session->layers_remaining() == 0) {
      st.session->finish();
      end_progressive(st);
    }
  }
  return true;
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
  p.mode = switcher_.mode();
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
      curves = calibrate_engine(*this, calibration_batches(o.scheduler.max_running), context).curves;
    }
  }
  // Requests are validated (token ids against the runtime's vocab) before anything else.
  scheduler_options so = o.scheduler;
  if (so.vocab == 0) so.vocab = runtime_.vocab_size();
  const parallel_mode start = o.how == switching::policy && o.start_from_load
                                  ? detail::start_mode_from_load(requests, o.policy.t_high)
                                  : o.start_mode;
  std::optional<run_state> state;
  const run_cleanup cleanup{*this, state};
  state.emplace(kv_, std::move(requests), o, so, name, switcher_);
  run_state& st = *state;
  verify_ = o.verify;
  verify_layer_ = o.verify_layer;
  sched_ = &st.sched;
  // To the start mode, with no live sequence yet; when that switch fails and rolls back the
  // run serves in the mode it is in (recorded as switch 0).
  {
    const parallel_mode from = switcher_.mode();
    const moebius::switch_report r = switch_untimed(start);
    if (r.outcome != moebius::switch_outcome::committed &&
        r.outcome != moebius::switch_outcome::already_there) {
      switch_record s;
      s.from = from;
      s.to = start;
      record_outcome(s, r);
      if (r.outcome == moebius::switch_outcome::inconsistent) recover_in_run(st, r, s);
      st.out.switches.push_back(std::move(s));
    }
  }
  st.capacity = detail::capacity_context{&switcher_, &st.sched, &st.plans};
  if (o.how == switching::policy) setup_policy(st, curves);
  st.out.name = name;
  st.out.clock = clock_.name();
  st.total = static_cast<int64_t>(st.sched.results().size());
  for (int64_t step = 0; !st.sched.done(); ++step) {
    MOEBIUS_CHECK(step < o.max_steps, errc::internal, "engine::run '", name, "': more than ",
                  o.max_steps, " steps (", st.sched.num_finished(), " of ", st.total,
                  " finished)");
    // Idle: nothing runs, jump the clock to the next arrival. Not while a progressive switch
    // is open: its remaining layers move first, in steps of copies alone, on the clock.
    if (!st.session && st.sched.num_running() == 0 && st.sched.next_arrival_s() > st.now) {
      st.now = st.sched.next_arrival_s();
    }
    step_record rec;
    rec.step = step;
    if (const std::optional<parallel_mode> target = decide(st, step)) {
      start_switch(st, *target, rec);
    }
    if (!serve_step(st, rec)) continue;
    if (o.validate_every_step) moebius::validate(kv_, switcher_.kv_tables());
    observe_step(st, rec);
    st.out.steps.push_back(rec);
    report_progress(st, step);
  }
  if (st.session) {  // every request finished during the switch: move the rest, commit
    switch_copies rest;  // and charge them on the clock, as copies alone
    rest.bytes = st.pacing.bytes_per_layer * st.session->layers_remaining();
    const auto t0 = host_clock::now();
    st.session->finish();
    rest.measured_s = seconds_since(t0);
    st.now += clock_.copies_s(rest);
    end_progressive(st);
  }
  MOEBIUS_CHECK(no_live_sequences(switcher_.kv_tables()), errc::internal, "engine::run '", name,
                "': pages still in use after every request finished (a leak)");
  moebius::validate(kv_, switcher_.kv_tables());
  st.out.requests = st.sched.results();
  st.out.failed_requests = st.sched.num_failed();
  describe_correction(st);
  st.out.end_s = st.now;
  return std::move(st.out);
}

}  // namespace mini_engine
