// A progressive switch in the serving loop: its pacing and reservations, the session it opens,
// each advance beside a step, and its end (engine.hpp; DESIGN.md §7).
#include <algorithm>
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

bool engine::begin_progressive(run_state& st, parallel_mode target, switch_record& s) {
  // Pacing from the last step's time, the clock's link and the bytes per layer the switcher
  // will move: the plan of this decision (the capacity check's, when the policy decided).
  const moebius::switch_plan& planned = st.plans.of(target);
  if (!planned.layer_kv) return false;  // the target cannot hold one layer's KV
  const int64_t L = arena_.shape.num_layers;
  st.pacing.step_s = st.last_step_s > 0 ? st.last_step_s : 0.01;
  st.pacing.link = clock_.link();
  st.pacing.link_fraction = st.options.copy_link_fraction;
  st.pacing.bytes_per_layer = clock_.layer_bytes(planned.bytes_per_layer, L);
  st.layers = moebius::layers_per_step(st.pacing, L);
  // The measured overlap slowdown, when the clock has one (step_clock::slowdown()): no more
  // layers per step than keep a step within max_overlap_slowdown of its time alone and within
  // max_overlap_extra_ms of it, and at least one (a switch must end).
  if (const overlap_slowdown slow = clock_.slowdown(); slow.known()) {
    const auto too_slow = [&](int64_t layers) {
      const double f = slow.at(st.pacing.step_s, layers * st.pacing.bytes_per_layer);
      return f > st.options.max_overlap_slowdown ||
             (f - 1) * st.pacing.step_s * 1e3 > st.options.max_overlap_extra_ms;
    };
    while (st.layers > 1 && too_slow(st.layers)) --st.layers;
  }
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
