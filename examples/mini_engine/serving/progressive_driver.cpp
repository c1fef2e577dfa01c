#include "progressive_driver.hpp"

#include <algorithm>
#include <limits>
#include <utility>

#include <moebius/error.hpp>

#include "host_clock.hpp"
#include "page_source.hpp"
#include "step_beside.hpp"

namespace mini_engine {

using moebius::errc;
using moebius::parallel_mode;

namespace {

// Tokens the run's requests have produced so far.
int64_t tokens_produced(const scheduler& sched) {
  int64_t n = 0;
  for (const request_result& q : sched.results()) n += static_cast<int64_t>(q.generated.size());
  return n;
}

}  // namespace

moebius::pacing_params pacing_for(const step_clock& clock, const engine_options& o,
                                  double last_step_s, const moebius::layer_bytes& per_layer,
                                  int64_t num_layers) {
  moebius::pacing_params p;
  p.step_s = last_step_s > 0 ? last_step_s : 0.01;
  p.link = clock.link();
  p.link_fraction = o.copy_link_fraction;
  p.bytes_per_layer = clock.layer_bytes(per_layer, num_layers);
  return p;
}

int64_t paced_layers(const step_clock& clock, const engine_options& o,
                     const moebius::pacing_params& p, int64_t num_layers) {
  int64_t layers = moebius::layers_per_step(p, num_layers);
  if (const overlap_slowdown slow = clock.slowdown(); slow.known()) {
    const auto too_slow = [&](int64_t n) {
      const double f = slow.at(p.step_s, n * p.bytes_per_layer);
      return f > o.max_overlap_slowdown || (f - 1) * p.step_s * 1e3 > o.max_overlap_extra_ms;
    };
    while (layers > 1 && too_slow(layers)) --layers;
  }
  return layers;
}

double style_price::batch_s() const {
  if (running + waiting <= 0) return stall_s;
  const double held = static_cast<double>(running + waiting);
  return std::min(stall_request_s, progressive_request_s) / held;
}

style_price price_styles(const step_clock& clock, const engine_options& o, const work_view& w,
                         double last_step_s, const moebius::layer_bytes& per_layer,
                         int64_t num_layers, bool progressive_possible) {
  const int64_t L = num_layers;
  style_price c;
  c.running = w.running;
  c.waiting = w.waiting;
  c.stall_s = clock.predicted_switch_s(per_layer, L);
  c.stall_request_s = static_cast<double>(w.running + w.waiting) * c.stall_s;
  c.progressive_request_s = std::numeric_limits<double>::infinity();
  if (!progressive_possible) return c;
  const moebius::pacing_params p = pacing_for(clock, o, last_step_s, per_layer, L);
  c.layers_per_step = paced_layers(clock, o, p, L);
  c.steps = (L + c.layers_per_step - 1) / c.layers_per_step;
  // A step with a layer's copies beside it, as the clock prices one
  // (step_clock::beside_copies_s). A measuring clock takes the copies' time as measured: here
  // what the pacing's link predicts.
  switch_copies copies;
  copies.bytes = c.layers_per_step * p.bytes_per_layer;
  copies.measured_s = moebius::copy_seconds(p, c.layers_per_step);
  const double slowed = clock.beside_copies_s(p.step_s, copies);
  c.extra_s_per_step = slowed - p.step_s;
  c.duration_s = static_cast<double>(c.steps) * slowed;
  c.progressive_request_s =
      static_cast<double>(w.running) * static_cast<double>(c.steps) * c.extra_s_per_step +
      static_cast<double>(w.waiting) * c.duration_s;
  return c;
}

progressive_driver::progressive_driver(moebius::switcher& sw, scheduler& sched,
                                       const step_clock& clock, const engine_options& o,
                                       int64_t num_layers, const moebius::switch_plan& planned,
                                       double last_step_s, switch_record& rec, size_t switch_idx)
    : sw_(sw),
      sched_(sched),
      clock_(clock),
      options_(o),
      num_layers_(num_layers),
      switch_idx_(switch_idx) {
  if (!planned.layer_kv) return;  // the target cannot hold one layer's KV apart
  const int64_t L = num_layers_;
  pacing_ = pacing_for(clock_, options_, last_step_s, planned.bytes_per_layer, L);
  layers_ = paced_layers(clock_, options_, pacing_, L);
  try {
    sched_.reserve_for_switch(sw_.mutable_kv_tables(), (L + layers_ - 1) / layers_);
  } catch (const moebius::error& e) {
    if (e.code() != errc::capacity) throw;
    return;  // the pages are not there: stop the world instead
  }
  // The reservation changed the tables the KV plan moves (the pacing keeps the bytes it was
  // paced on): begin runs a plan of the reserved tables.
  from_ = sw_.layout();
  to_ = planned.to;
  moebius::progressive_switch session = sw_.begin(sw_.plan(planned.to));
  if (!session.open()) {
    ended_ = session.report();
    MOEBIUS_CHECK(ended_.outcome != moebius::switch_outcome::inconsistent, errc::internal,
                  "progressive switch: begin left the engine inconsistent: ", ended_.error);
    started_ = start::ended;
    return;
  }
  rec.progressive = true;
  rec.layers_per_step = layers_;
  session_.emplace(std::move(session));
  tokens_before_ = tokens_produced(sched_);
  started_ = start::open;
}

page_source& progressive_driver::open_step() {
  // The tables are frozen: the step reads both sets through the session's view and takes no
  // page; the next paced layers move beside it.
  view_.emplace(session_->view());
  return pages_.emplace(view_->tables(view_->source()), deferred_release_);
}

void progressive_driver::enqueue_advance(step_record& rec,
                                         const moebius::step_layer_events* step_events) {
  if (options_.test_hooks.before_advance)
    options_.test_hooks.before_advance(sw_, *session_, rec.step);
  // The transport's own streams: distinct from the runtime's compute streams.
  rec.layers = static_cast<int64_t>(session_->advance(layers_, {}, step_events).layers().size());
}

double progressive_driver::wait_for_advance() {
  const auto t0 = host_clock::now();
  session_->wait();
  return seconds_since(t0);
}

served_step progressive_driver::run(runtime& rt, const step_batch& b, step_record& rec) {
  const moebius::kv_state& tables = pages_->tables();
  served_step s;
  s.tables = &tables;
  s.layout = from_;
  s.config = configuration_of(from_, sched_.geometry().dcp);
  switch_copies copies;
  step_cost cost;
  if (!b.empty()) {
    // Data-parallel attention: in EP each rank runs its own items (read before the step: a
    // switch that ends during it takes its tables along). None under TP attention throughout
    // (the experts alone switch: no EP tables).
    std::vector<rank_work> ep_split;
    if (view_->moves_kv() || view_->source() == parallel_mode::ep)
      ep_split = ep_rank_work(view_->tables(parallel_mode::ep), b.items);
    const auto t0 = host_clock::now();
    step_beside_result r = step_beside(
        rt, step_layout::during(*view_), b.items,
        [&](const moebius::step_layer_events* events) { enqueue_advance(rec, events); },
        [&]() -> step_layout {
          wait_for_advance();
          if (!session_->open()) {
            step_layout after{&sw_.kv_tables(), sw_.cursor()};
            after.dcp = sw_.dcp();
            return after;
          }
          return step_layout::during(session_->view());
        });
    s.measured_s = seconds_since(t0);
    // Where the copies ran after the step (a runtime that does not overlap them), the host's
    // time for the step holds them: they count as copies.
    if (!rt.overlaps_copies()) {
      s.measured_s = std::max(0.0, s.measured_s - r.advance_s);
      copies.measured_s = r.advance_s;
    }
    // A runtime that times itself (the GPU runtime: CUDA events) reports the device time.
    if (r.step.measured_s >= 0) s.measured_s = r.step.measured_s;
    s.tokens = std::move(r.step.tokens);
    // A hybrid step: priced as its majority layout. The paper's switch moves each layer's
    // experts and KV together: the majority mode for both; the experts alone: the attention's
    // tables, the majority of the experts.
    const bool tp_majority = sw_.cursor().tp_layers * 2 >= num_layers_;
    moebius::parallel_layout layout;
    if (from_.attention != to_.attention) {
      layout = tp_majority ? parallel_mode::tp : tables.mode;
    } else {
      layout = {tables.mode, tp_majority ? parallel_mode::tp : parallel_mode::ep};
    }
    s.config = configuration_of(layout, sched_.geometry().dcp);
    cost = cost_of(b, s.config, static_cast<int>(tables.ranks.size()), std::move(ep_split));
  } else {
    enqueue_advance(rec, nullptr);  // nothing to run: the copies alone
  }
  // What the loop waited for the copies once the step was done (all of them when none ran).
  copies.measured_s += wait_for_advance();
  copies.bytes = pacing_.bytes_per_layer * rec.layers;
  rec.copy_ms = clock_.copies_s(copies) * 1e3;
  s.clock_s = b.empty() ? clock_.copies_s(copies) : clock_.switch_step_s(cost, s.measured_s, copies);
  return s;
}

bool progressive_driver::after_step(const step_record& rec, run_result& out) {
  ++out.switches[switch_idx_].steps;
  if (!session_->open()) return true;  // the advance failed: rolled back
  if (options_.test_hooks.abort_after_advance &&
      options_.test_hooks.abort_after_advance(*session_, rec.step)) {
    session_->abort();
    return true;
  }
  if (session_->layers_remaining() > 0) return false;
  session_->finish();
  return true;
}

double progressive_driver::finish_rest() {
  switch_copies rest;
  rest.bytes = pacing_.bytes_per_layer * session_->layers_remaining();
  const auto t0 = host_clock::now();
  session_->finish();
  rest.measured_s = seconds_since(t0);
  return clock_.copies_s(rest);
}

const moebius::switch_report& progressive_driver::report() const {
  return session_ ? session_->report() : ended_;
}

int64_t progressive_driver::tokens_during() const {
  return tokens_produced(sched_) - tokens_before_;
}

void progressive_driver::release_deferred() {
  mini_engine::release_deferred(sw_.mutable_kv_tables(), deferred_release_);
}

}  // namespace mini_engine
