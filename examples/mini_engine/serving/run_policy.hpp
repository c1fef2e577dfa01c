#pragma once

// The serving loop's switch policy (engine.hpp), in two phases: the rules (moebius::
// switch_policy) propose a target, this plans the proposal once into a local switch_plan and
// prices that one plan, and the rules decide on the priced proposal:
//
//   propose   the load (running + waiting, capped at max_running) against the thresholds;
//   price     throughput gate: first against the least the switch can cost (its weights alone:
//             a switch that cannot pay even that is refused without planning it); then the
//             capacity (the running sequences at their largest, a page sum; TP -> EP the
//             placement the plan makes) and the plan's verdict on the live KV; then the gate on
//             the plan's cost (the clock's prediction of its bytes, or by_cost the cheaper
//             style's, priced from the same plan);
//   decide    switch_policy::decide: capacity_refused, cost_exceeds_gain, or switch, handing
//             the plan, the gate and the styles' prices to the switch (engine::start_switch).
//
// A stop-the-world run plans the stop-the-world half only (plan_scope::stop_the_world). Also the
// gate's curves and their correction by what the steps take (cost_gate_options::correct_curves),
// the residency predictor and the decision log.

#include <cstdint>
#include <optional>

#include <moebius/kv/kv_geometry.hpp>
#include <moebius/policy/calibration.hpp>
#include <moebius/policy/residency.hpp>
#include <moebius/policy/switch_policy.hpp>
#include <moebius/policy/throughput_gate.hpp>
#include <moebius/switch/switch_plan.hpp>
#include <moebius/switch/switcher.hpp>

#include "dcp_capacity.hpp"
#include "engine.hpp"
#include "prefill_stalls.hpp"
#include "progressive_driver.hpp"
#include "run_report.hpp"
#include "scheduler.hpp"
#include "step_clock.hpp"

namespace mini_engine {

// A switch decided before a step, with what it was priced on.
struct decided_switch {
  moebius::parallel_mode target = moebius::parallel_mode::ep;
  std::optional<moebius::switch_plan> plan;  // the decision's one plan (none: a forced switch)
  moebius::gate_evaluation gate;             // evaluated false: no gate weighed it
  std::optional<style_price> styles;         // by_cost: both styles, priced on the plan
};

// What the policy reads of the run at a decision.
struct run_view {
  const moebius::switcher& sw;
  const scheduler& sched;
  double now_s = 0;
  double last_step_s = 0;          // the last step outside a switch (by_cost's pacing)
  bool admission_blocked = false;  // the last step's (step_batch::admission_blocked)
};

// Whether `target` steps faster than `current` at `load` on `curves` by more than `margin`, a
// share of the target's step: target(load) x (1 + margin) < current(load). run_policy asks it
// of the gate's corrected curves at the sustained load, for the rules' sustained-gain signal
// (switch_policy_config::enter_on_sustained_gain). Throws errc::invalid_argument for a load
// below 1 or a margin that is negative or not finite.
//   curves EP 60 / TP 80 ms at 300, margin 0.25: 75 < 80 -> true; margin 0.4: 84 -> false
bool faster_by_margin(const moebius::latency_curves& curves, moebius::parallel_mode current,
                      moebius::parallel_mode target, double load, double margin);

class run_policy {
 public:
  // The rules of o.policy; with o.gate.enabled, the gate o.gate.kind weighing with `curves`
  // (corrected as the steps go when o.gate.correct_curves).
  run_policy(const engine_options& o, const moebius::latency_curves& curves,
             const moebius::kv_geometry& kv, const step_clock& clock, int64_t num_layers);

  // Before every step, during a switch too: what happened since the last one (arrivals,
  // completions and the steps those ran) for the residency predictor.
  void observe_work(const scheduler& sched, double now_s);
  // The decision before step `step`; refusals and (o.explain) the decision log into `out`.
  std::optional<decided_switch> decide(const run_view& v, int64_t step, run_result& out);
  // After a step served outside a switch: its time against the curves (correct_curves).
  void observe_step(const step_record& rec);
  // The policy, its gate and the last correction, into the run's report (at its end).
  void describe(run_result& out) const;

 private:
  struct priced_proposal {
    moebius::switch_pricing pricing;
    std::optional<moebius::switch_plan> plan;
    std::optional<style_price> styles;
  };
  priced_proposal price(const run_view& v, const moebius::switch_proposal& p) const;
  // A design whose two modes differ in the KV's dcp alone (dcp only) decides by capacity, not
  // by the rules' load thresholds: TP at the smaller dcp is faster a step wherever its pool
  // holds the KV (DCP's exchange costs more than halving the KV reads saves until the live KV
  // passes about what that pool holds), so
  //   to the larger dcp   when the KV the live sequences are expected to reach (each its
  //                       tokens plus expected_remaining, at most what its max_new_tokens
  //                       leaves, in an open loop only while live_set_grows; the waiting ones
  //                       their prompts plus the prior, in an open loop only where
  //                       fuller_steps_pay: dcp_capacity.hpp) passes the smaller dcp's pool:
  //                       before the pool runs out
  //                       and preempts; a dcp 1 -> 2 change moves no byte, so no gate weighs it
  //                       (its price is recorded);
  //   to the smaller dcp  when nothing waits and that estimate is within k_capacity_low of its
  //                       pool, the running sequences fit it now (fits_reservations), and the
  //                       gate finds the faster steps pay for copying the live KV once.
  // Logged as the rules' reasons (above_high, below_low) with the sequences' load.
  std::optional<decided_switch> decide_for_capacity(const run_view& v, int64_t step,
                                                    run_result& out);
  // A decision made (r.decision) on `priced`: the gate's refusal counted, the record logged
  // (o.explain; with the gate's numbers when it weighed the switch), the switch to make if any.
  std::optional<decided_switch> settle(decision_record r, priced_proposal priced,
                                       run_result& out) const;
  // The throughput gate's view of the work for a switch to `target` at `load`.
  moebius::serving_load serving_load_of(const run_view& v, moebius::parallel_mode target,
                                        int64_t load) const;
  // The switch's cost on the serving clock, in ms of the whole batch, for `per_layer` bytes a
  // layer: the predicted stall, or by_cost the cheaper style's (`styles` set); `kv_alone`: a
  // dcp change (the KV alone, stop-the-world: step_clock::predicted_kv_switch_s).
  double cost_ms(const run_view& v, const moebius::layer_bytes& per_layer, bool per_layer_plan,
                 bool kv_alone, std::optional<style_price>* styles) const;
  moebius::gate_evaluation weigh(const run_view& v, moebius::parallel_mode target, int64_t load,
                                 const std::optional<moebius::serving_load>& work,
                                 double switch_ms) const;

  const engine_options& options_;
  const moebius::kv_geometry& kv_;
  const step_clock& clock_;
  int64_t num_layers_;
  moebius::plan_scope scope_;  // what each decision plans
  moebius::switch_policy rules_;
  bool gated_;
  // decide_for_capacity: the step and time before which a refused move to the smaller dcp is
  // not proposed again.
  int64_t retry_small_step_ = 0;
  double retry_small_s_ = 0;
  // The gate's curves: as calibrated, and corrected by what the steps take.
  moebius::latency_curves base_curves_, curves_;
  std::optional<moebius::residency_predictor> residency_;
  int64_t seen_arrived_ = 0, seen_finished_ = 0, seen_finished_tokens_ = 0;
  // decide_for_capacity: completions a step (every step, gated or not: seen_finished_ kept
  // either way) and the rows a step carries (gated).
  recent_mean completions_, step_rows_;
  // The load (running + waiting, as the rules see it) over the window the held decodes are
  // measured on (prefill_stalls::k_weight: minutes, so that a flood of a few seconds moves it
  // little; before that many steps, the mean of those seen, so the signal can be raised in a
  // run's first second, as on the steady trace, where the gate let it through at load 32):
  // where the rules' sustained-gain signal asks the corrected curves. Asked at the
  // load of now, the bursty trace's floods (load 295-460 under SGLang, the crossover of TP's
  // stalled curve below it) went to EP, where the floods prefill slower: flood TTFT p99 +75%.
  recent_mean sustained_load_{prefill_stalls::k_weight};
  // correct_curves: per mode (indexed EP, TP) the mean ratio of a step's time to the curve's and
  // whether any step has been seen; the recent steps' decode and prefill tokens (means).
  double step_ratio_[2] = {1, 1};
  bool ratio_seen_[2] = {false, false};
  int64_t steps_since_correction_ = 0;
  double decode_rows_ = 0, prefill_rows_ = 0;
  // correct_curves: the decodes the serving mode's prefill-first steps held (sglang) since
  // it last started serving (stalls_mode_: EP 0, TP 1), which slow its decode tokens beyond
  // its curve (prefill_stalls.hpp); the other mode's estimated from them.
  prefill_stalls stalls_;
  int stalls_mode_ = -1;
  double last_factor_[2] = {1, 1};  // the last correction's factors (EP, TP), for the report
  int64_t corrections_ = 0;
};

// A stop-the-world plan's bytes as a per-layer average (a plan without per-layer KV).
moebius::layer_bytes whole_switch_per_layer(const moebius::switch_plan& p, int64_t num_layers);

// The start mode that follows the initial load: EP when the requests that arrive at the first
// arrival (a rollout: its first step's) reach t_high.
moebius::parallel_mode start_mode_from_load(const std::vector<request>& requests, int64_t t_high);

}  // namespace mini_engine
