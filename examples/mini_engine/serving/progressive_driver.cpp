// A progressive switch in the serving loop: its pacing and reservations, the session it opens,
// each advance beside a step, and its end (engine.hpp; DESIGN.md §7).
#include <algorithm>
#include <limits>
#include <moebius/error.hpp>
#include <moebius/switch/pacing.hpp>

#include "engine_run_state.hpp"
#include "kv_pages.hpp"
#include "page_source.hpp"

namespace mini_engine {

using detail::host_clock;
using detail::record_outcome;
using detail::seconds_since;
using detail::tokens_produced;
using moebius::errc;
using moebius::parallel_mode;

moebius::pacing_params engine::pacing_for(const run_state& st,
                                           const moebius::layer_bytes& per_layer) const {
  moebius::pacing_params p;
  p.step_s = st.last_step_s > 0 ? st.last_step_s : 0.01;
  p.link = clock_.link();
  p.link_fraction = st.options.copy_link_fraction;
  p.bytes_per_layer = clock_.layer_bytes(per_layer, arena_.shape.num_layers);
  return p;
}

int64_t engine::paced_layers(const run_state& st, const moebius::pacing_params& p) const {
  int64_t layers = moebius::layers_per_step(p, arena_.shape.num_layers);
  // The measured overlap slowdown, when the clock has one (step_clock::slowdown()): no more
  // layers per step than keep a step within max_overlap_slowdown of its time alone and within
  // max_overlap_extra_ms of it, and at least one (a switch must end).
  if (const overlap_slowdown slow = clock_.slowdown(); slow.known()) {
    const auto too_slow = [&](int64_t n) {
      const double f = slow.at(p.step_s, n * p.bytes_per_layer);
      return f > st.options.max_overlap_slowdown ||
             (f - 1) * p.step_s * 1e3 > st.options.max_overlap_extra_ms;
    };
    while (layers > 1 && too_slow(layers)) --layers;
  }
  return layers;
}

detail::style_price engine::price_styles(const run_state& st,
                                         const moebius::layer_bytes& per_layer,
                                         bool progressive_possible) const {
  const int64_t L = arena_.shape.num_layers;
  const work_view w = st.sched.work(st.now);
  detail::style_price c;
  c.running = w.running;
  c.waiting = w.waiting;
  c.stall_s = clock_.predicted_switch_s(per_layer, L);
  c.stall_request_s = static_cast<double>(w.running + w.waiting) * c.stall_s;
  c.progressive_request_s = std::numeric_limits<double>::infinity();
  if (!progressive_possible) return c;
  const moebius::pacing_params p = pacing_for(st, per_layer);
  c.layers_per_step = paced_layers(st, p);
  c.steps = (L + c.layers_per_step - 1) / c.layers_per_step;
  // A step with a layer's copies beside it, as the clock prices one
  // (step_clock::beside_copies_s). A measuring clock takes the copies' time as measured: here
  // what the pacing's link predicts.
  switch_copies copies;
  copies.bytes = c.layers_per_step * p.bytes_per_layer;
  copies.measured_s = moebius::copy_seconds(p, c.layers_per_step);
  const double slowed = clock_.beside_copies_s(p.step_s, copies);
  c.extra_s_per_step = slowed - p.step_s;
  c.duration_s = static_cast<double>(c.steps) * slowed;
  c.progressive_request_s =
      static_cast<double>(w.running) * static_cast<double>(c.steps) * c.extra_s_per_step +
      static_cast<double>(w.waiting) * c.duration_s;
  return c;
}

bool engine::begin_progressive(run_state& st, parallel_mode target, switch_record& s) {
  // Pacing from the last step's time, the clock's link and the bytes per layer the switcher
  // will move: the plan of this decision (the capacity check's, when the policy decided).
  const moebius::switch_plan& planned = st.plans.of(target);
  if (!planned.layer_kv) return false;  // the target cannot hold one layer's KV
  const int64_t L = arena_.shape.num_layers;
  st.pacing = pacing_for(st, planned.bytes_per_layer);
  st.layers = paced_layers(st, st.pacing);
  try {
    st.sched.reserve_for_switch(switcher_.mutable_kv_tables(), (L + st.layers - 1) / st.layers);
  } catch (const moebius::error& e) {
    if (e.code() != errc::capacity) throw;
    return false;  // the pages are not there: stop the world instead
  }
  // The reservation changed the tables the KV plan moves (pacing keeps the bytes it was paced
  // on): begin runs the plan of the reserved tables.
  moebius::progressive_switch session = switcher_.begin(st.plans.of(target));
  if (!session.open()) {
    const moebius::switch_report& r = session.report();
    MOEBIUS_CHECK(r.outcome != moebius::switch_outcome::inconsistent, errc::internal,
                  "engine::run '", st.name, "': begin left the engine inconsistent: ", r.error);
    record_outcome(s, r);
    return true;  // decided progressive, and it did not start: no stop-the-world retry
  }
  s.progressive = true;
  s.layers_per_step = st.layers;
  st.session.emplace(std::move(session));
  st.switch_idx = st.out.switches.size();
  st.tokens_before = tokens_produced(st.sched);
  return true;
}

void engine::enqueue_advance(run_state& st, step_record& rec,
                             const moebius::step_layer_events* step_events) {
  const engine_options& o = st.options;
  if (o.test_hooks.before_advance) o.test_hooks.before_advance(switcher_, *st.session, rec.step);
  // The transport's own streams: distinct from the runtime's compute streams.
  rec.layers =
      static_cast<int64_t>(st.session->advance(st.layers, {}, step_events).layers().size());
}

double engine::wait_for_advance(run_state& st) {
  const auto t0 = host_clock::now();
  st.session->wait();
  return seconds_since(t0);
}

void engine::close_advance(run_state& st, const step_record& rec) {
  const engine_options& o = st.options;
  if (!st.session->open()) {  // the advance failed: rolled back
    end_progressive(st);
  } else if (o.test_hooks.abort_after_advance &&
             o.test_hooks.abort_after_advance(*st.session, rec.step)) {
    st.session->abort();
    end_progressive(st);
  }
}

void engine::end_progressive(run_state& st) {
  const moebius::switch_report r = st.session->report();
  st.session.reset();
  switch_record& s = st.out.switches[st.switch_idx];
  record_outcome(s, r);
  s.clock_ms = (st.now - s.start_s) * 1e3;
  s.tokens = tokens_produced(st.sched) - st.tokens_before;
  if (r.outcome == moebius::switch_outcome::inconsistent) recover_in_run(st, r, s);
  release_deferred(switcher_.mutable_kv_tables(), st.deferred_release);
}

}  // namespace mini_engine
