#pragma once

// What one engine::run carries from step to step, and the small pieces the engine's files
// share (engine.cpp: the loop; progressive_driver.cpp: a progressive switch; engine_recovery.cpp;
// engine_calibration.cpp: decode steps for the calibration). Internal to the serving loop.

#include <algorithm>
#include <functional>
#include <chrono>
#include <moebius/policy/residency.hpp>
#include <moebius/policy/switch_policy.hpp>
#include <moebius/policy/throughput_gate.hpp>
#include <moebius/switch/pacing.hpp>
#include <moebius/switch/progressive.hpp>
#include <moebius/switch/switch_plan.hpp>
#include <moebius/switch/switcher.hpp>
#include <optional>
#include <string>
#include <vector>

#include "engine.hpp"

namespace mini_engine::detail {

using host_clock = std::chrono::steady_clock;

inline double seconds_since(host_clock::time_point t0) {
  return std::chrono::duration<double>(host_clock::now() - t0).count();
}

// The switch planned once per decision (moebius::switch_plan): the capacity check plans it,
// and the cost gate's estimate, the pacing and begin/switch_to use that plan. Planned again
// only for another target or once the switcher's state has moved on (a step took pages, a
// switch ran, the progressive path reserved pages): the plan would be stale.
class switch_plans {
 public:
  explicit switch_plans(const moebius::switcher& sw) : sw_(&sw) {}
  const moebius::switch_plan& of(moebius::parallel_mode target) {
    if (!plan_ || plan_->to != target || !sw_->why_stale(*plan_).empty()) plan_ = sw_->plan(target);
    return *plan_;
  }

 private:
  const moebius::switcher* sw_;
  std::optional<moebius::switch_plan> plan_;
};

// The policy's capacity check: the switcher's plan (today's tables) and the scheduler's
// (every running sequence at its largest).
struct capacity_context {
  const moebius::switcher* sw;
  const scheduler* sched;
  switch_plans* plans;
};

// The gate's switch cost: what the clock predicts for the switch the switcher would run now
// (weights and the live KV), in ms, from the plan the capacity check made.
struct cost_context {
  switch_plans* plans;
  const step_clock* clock;
  int64_t num_layers;
  // switch_style::by_cost: the cheaper style's cost in ms of the whole batch for a switch
  // moving `per_layer` bytes a layer (engine::price_styles); empty: the stall alone.
  std::function<double(const moebius::layer_bytes& per_layer, bool progressive_possible)>
      styled_ms = {};
};

// The throughput gate's view of the run (engine_policy.cpp): what it reads when a rule fires.
struct gate_context {
  const scheduler* sched = nullptr;
  const moebius::kv_geometry* kv = nullptr;
  const moebius::latency_curves* curves = nullptr;
  const moebius::residency_predictor* residency = nullptr;
  const moebius::switch_policy_config* policy = nullptr;  // T_h, T_l: the residency's bounds
  const cost_context* cost = nullptr;
  moebius::gate_terms terms;
  double margin = 0;
  int64_t max_running = 1;
  double watermark = 0;       // the share of each pool admission keeps free
  const double* now = nullptr;  // the run's clock
};

// switch_gate::fn over a gate_context: builds the serving_load and weighs the switch.
bool throughput_gate(void* context, moebius::parallel_mode current, moebius::parallel_mode target,
                     int64_t load, moebius::gate_evaluation& out);
// switch_gate::gains over a gate_context: the same weighing against the least the switch can
// cost (its weights alone), which needs no plan.
bool throughput_gate_gains(void* context, moebius::parallel_mode current,
                           moebius::parallel_mode target, int64_t load,
                           moebius::gate_evaluation& out);
// The switch's predicted cost in ms (switch_cost_estimate::fn over a cost_context).
double predicted_switch_ms(void* context, moebius::parallel_mode target);
// A stop-the-world plan's bytes as a per-layer average (for a plan without per-layer KV).
moebius::layer_bytes whole_switch_per_layer(const moebius::switch_plan& p, int64_t num_layers);
// The serving_load the gate weighs (exposed for tests): the scheduler's work at *now, each
// pool's capacity, the known residency of a rollout, the predictor's.
moebius::serving_load serving_load_of(const gate_context& g, moebius::parallel_mode target,
                                      int64_t load);
// The start mode that follows the initial load: EP when the requests that arrive at the first
// arrival (a rollout: its first step's) reach t_high.
moebius::parallel_mode start_mode_from_load(const std::vector<request>& requests, int64_t t_high);

// How a switch ended, from the switcher's report into the run's record.
inline void record_outcome(switch_record& s, const moebius::switch_report& r) {
  s.outcome = r.outcome;
  s.error = r.error;
  s.measured_ms = r.total_ms;
}

// Whether the tables hold no sequence on any rank.
inline bool no_live_sequences(const moebius::kv_state& s) {
  return std::all_of(s.ranks.begin(), s.ranks.end(),
                     [](const moebius::kv_rank_state& r) { return r.sequences.empty(); });
}

// Tokens the run's requests have produced so far.
inline int64_t tokens_produced(const scheduler& sched) {
  int64_t n = 0;
  for (const request_result& q : sched.results()) n += static_cast<int64_t>(q.generated.size());
  return n;
}

}  // namespace mini_engine::detail

namespace mini_engine {

// What one run() carries from step to step.
struct engine::run_state {
  run_state(const moebius::kv_geometry& kv, std::vector<request> requests, const engine_options& o,
            const scheduler_options& so, const std::string& run_name, const moebius::switcher& sw)
      : options(o), name(run_name), sched(kv, std::move(requests), so), plans(sw) {}

  const engine_options& options;
  const std::string& name;
  scheduler sched;
  detail::switch_plans plans;  // the switch of this decision, planned once
  detail::capacity_context capacity{nullptr, nullptr, nullptr};
  std::optional<moebius::switch_policy> policy;
  // The cost gate: its curves, residency predictor, cost estimate and what the predictor has
  // been told (arrivals and completions are observed as differences of these counts).
  moebius::latency_curves curves;
  std::optional<moebius::residency_predictor> residency;
  detail::cost_context cost{nullptr, nullptr, 0, {}};
  int64_t seen_arrived = 0, seen_finished = 0, seen_finished_tokens = 0;
  moebius::gate_evaluation pending_gate;  // the gate's reasoning for the switch decided now
  detail::gate_context gate;               // gate_kind::throughput
  // correct_curves: the calibrated curves, and per mode (indexed by parallel_mode) the mean
  // ratio of a step's time to theirs and whether any step has been seen.
  moebius::latency_curves base_curves;
  double step_ratio[2] = {1, 1};
  bool ratio_seen[2] = {false, false};
  int64_t steps_since_correction = 0;
  double decode_rows = 0, prefill_rows = 0;  // recent steps' decode and prefill tokens (means)
  double last_factor[2] = {1, 1};  // the last correction's factors (EP, TP), for the report
  bool admission_blocked = false;          // the last step's (step_batch::admission_blocked)
  run_result out;
  double now = 0;
  size_t next_forced = 0;
  double last_step_s = 0;  // the last normal step on the serving clock (pacing)
  int64_t total = 0;

  // The progressive switch in flight, if any.
  std::optional<moebius::progressive_switch> session;
  size_t switch_idx = 0;  // its switch_record
  int64_t layers = 1;     // paced layers per step
  moebius::pacing_params pacing;
  int64_t tokens_before = 0;  // tokens produced when it began
  // Sequences finished during it: their pages go back when it has ended (frozen_pages).
  std::vector<int64_t> deferred_release;
};

}  // namespace mini_engine
