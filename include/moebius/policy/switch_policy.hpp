#pragma once

// The switch policy (the layer above the switcher, DESIGN.md §2): asymmetric hysteresis on the
// engine's load signal with a cooldown, a capacity check and an optional cost gate.
//
// Load signal: the number of active sequences (the decode batch) at each engine step, in the
// same unit the calibration (calibration.hpp) was measured in.
//
// Direction semantics (paper eq. 5): TP is faster below the crossover B*, EP above it.
//   TP -> EP ("enter EP", fast): the load is >= T_h for `up_window` consecutive observations
//            (paper: 1, i.e. immediately; a burst must be absorbed before TTFT explodes).
//   EP -> TP ("leave EP", slow): over the last `down_window` (W) observations the load is
//            below T_l, where "below" is the mean of the window (paper, `down_rule::mean`) or
//            every observation (`down_rule::every`, stricter). A short dip does not switch.
//   T_l < T_h (default T_l = 0.8·T_h): loads in [T_l, T_h) never cause a switch, so a load
//            that wanders around one threshold cannot flap.
//   Cooldown: after any switch (proposed by this policy, or observed as a change of the
//            current mode) no switch is proposed for `cooldown_steps` steps and
//            `cooldown_s` seconds (paper: 5 s). Windows restart at a switch: only
//            observations made in the current mode count.
//   Blocked admission (enter_on_blocked_admission, off in the paper's policy): in TP, an
//            observation with requests waiting while TP's KV pool admits none of them counts
//            as one at or above T_h (reason admission_blocked): the pool, not the batch, is
//            what limits TP then, and EP's data-parallel attention holds more sequences.
//   Capacity: before proposing a switch the policy asks the capacity check whether the
//            target mode can hold every live sequence's KV; if not it stays and says so.
//   Rollout (paper eq. 13): T_l = T_h, W = 1: in an RL rollout the load only decays, so
//            switch to TP as soon as the count drops under T_h (`rollout_config()`).
//   Gate hook (set_gate): instead of the step-time gate below, a caller's own weighing of the
//            switch (the mini-engine's throughput gate, throughput_gate.hpp), asked at the
//            same point and recorded the same way; its optional `gains` is asked before the
//            capacity check (a switch with no gain at all is refused without planning it).
//   Cost gate (DESIGN.md §7, "a switch must pay for itself"): with step-latency curves and
//            the switch's predicted cost attached (set_cost_gate), a switch a rule proposes
//            goes ahead only when
//              gain_ms = (latency(current, load) - latency(target, load)) * residency_steps
//                     >= predicted switch cost ms * (1 + gate_margin),
//            residency_steps being the steps the engine is predicted to stay in the target:
//            from a residency_predictor (residency.hpp: recent arrival and completion rates;
//            until the load crosses T_l after entering EP, T_h after entering TP) when one is
//            attached, else the fixed expected_residency_steps (0: gate off).
//
// step() is O(1), allocates nothing and keeps fixed-size state (a ring of at most
// `max_window` loads): about 21 ns of host CPU time per call here (bench_policy).

#include <cstdint>
#include <iosfwd>

#include "moebius/layout/parallel_mode.hpp"

namespace moebius {

class latency_curves;  // calibration.hpp

// How the EP -> TP window decides "the load stayed below T_l".
enum class down_rule : uint8_t {
  mean,   // mean of the last W loads < T_l (paper §7.1)
  every,  // each of the last W loads < T_l
};

constexpr bool is_valid(down_rule r) { return r == down_rule::mean || r == down_rule::every; }

constexpr const char* to_string(down_rule r) {
  switch (r) {
    case down_rule::mean: return "mean";
    case down_rule::every: return "every";
  }
  return "unknown";
}

struct switch_policy_config {
  static constexpr int64_t max_window = 256;  // ring capacity: state stays fixed-size

  int64_t t_high = 256;     // T_h: enter EP at load >= T_h (paper, Qwen3-235B on 8xH200)
  int64_t t_low = 205;      // T_l: leave EP when the load is < T_l; 0.8·T_h (paper: 205)
  int64_t up_window = 1;    // consecutive observations >= T_h before TP -> EP (paper: 1)
  int64_t down_window = 8;  // W: observations the EP -> TP rule looks at (1..max_window)
  down_rule rule = down_rule::mean;
  int64_t cooldown_steps = 0;  // C in engine steps (0: off)
  double cooldown_s = 5.0;     // C in seconds of the `now_s` passed to step() (paper: 5 s)

  // Cost gate (off when no curves are attached, or when neither a residency predictor is
  // attached nor expected_residency_steps > 0): refuse a switch whose predicted cost, times
  // (1 + gate_margin), exceeds its expected gain,
  //   gain_ms = (latency(current, load) - latency(target, load)) * residency_steps,
  // residency_steps from the attached residency_predictor, else expected_residency_steps.
  int64_t expected_residency_steps = 0;
  // The share by which the gain must exceed the predicted cost (0.5: by half again), for what
  // the predictions leave out (the residency's spread, a cost model off by tens of percent).
  double gate_margin = 0.0;
  // Enter EP also when admission is blocked in TP (see above; step()'s admission_blocked).
  bool enter_on_blocked_admission = false;
};

// T_l = round(0.8 · T_h) (paper §7.1): interactive_config(256) -> T_h 256, T_l 205.
switch_policy_config interactive_config(int64_t t_high, double low_ratio = 0.8);

// Paper eq. 13: T_l = T_h, W = 1, `every` rule; cooldown in steps only (rollout steps have
// no wall-clock pacing to honour). rollout_config(256): switch to TP at the first load < 256.
switch_policy_config rollout_config(int64_t t_high, int64_t cooldown_steps = 0);

// Throws errc::invalid_argument naming the constraint: 0 < T_l <= T_h <= 2^40, a valid
// rule, 1 <= up_window <=
// max_window, 1 <= down_window <= max_window, cooldowns >= 0 and finite,
// expected_residency_steps >= 0, 0 <= gate_margin <= 1e6 (finite).
void validate(const switch_policy_config& config);

std::ostream& operator<<(std::ostream& os, const switch_policy_config& config);

// Why step() decided what it decided (for traces).
enum class decision_reason : uint8_t {
  hold,                // no rule fired: load in the band, or window not yet full
  above_high,          // TP -> EP: load >= T_h for up_window observations
  below_low,           // EP -> TP: window below T_l
  cooldown,            // a rule fired but the cooldown has not elapsed
  capacity_refused,    // a rule fired but the target mode cannot hold the live KV
  cost_exceeds_gain,   // a rule fired but the predicted switch cost exceeds the gain
  admission_blocked,   // TP -> EP: requests wait and TP's pool admits none (up_window times)
};

inline constexpr int num_decision_reasons = 7;

constexpr bool is_valid(decision_reason r) {
  return static_cast<uint8_t>(r) < num_decision_reasons;
}

constexpr const char* to_string(decision_reason r) {
  switch (r) {
    case decision_reason::hold: return "hold";
    case decision_reason::above_high: return "above_high";
    case decision_reason::below_low: return "below_low";
    case decision_reason::cooldown: return "cooldown";
    case decision_reason::capacity_refused: return "capacity_refused";
    case decision_reason::cost_exceeds_gain: return "cost_exceeds_gain";
    case decision_reason::admission_blocked: return "admission_blocked";
  }
  return "unknown";
}

struct switch_decision {
  bool do_switch = false;              // true: switch to `target` now
  parallel_mode target = parallel_mode::ep;  // the mode a rule pointed at (valid unless hold)
  decision_reason reason = decision_reason::hold;

  // Reasons that blocked a rule (cooldown, capacity_refused, cost_exceeds_gain) leave
  // do_switch false but keep `target`, so a trace says what was refused.
  constexpr bool blocked() const {
    return reason == decision_reason::cooldown || reason == decision_reason::capacity_refused ||
           reason == decision_reason::cost_exceeds_gain;
  }
};

// "switch to EP (above_high)", "stay (hold)", "stay: TP refused (capacity_refused)".
std::ostream& operator<<(std::ostream& os, const switch_decision& d);

// Asked before a switch is proposed: can `target` hold every live sequence's KV now?
// A plain function pointer and context so step() never allocates or type-erases.
struct capacity_check {
  bool (*fn)(void* context, parallel_mode target) = nullptr;  // nullptr: always fits
  void* context = nullptr;

  bool fits(parallel_mode target) const { return fn == nullptr || fn(context, target); }
};

// Asked when the gate weighs a switch: its predicted cost in ms on the engine's clock (e.g.
// moebius::cost_model priced for the live KV). nullptr: the fixed costs of set_cost_gate.
struct switch_cost_estimate {
  double (*fn)(void* context, parallel_mode target) = nullptr;
  void* context = nullptr;
};

// What the gate weighed at the last decision it was asked about (for traces and tests).
struct gate_evaluation {
  bool evaluated = false;      // false: no rule fired past cooldown and capacity yet, or no gate
  parallel_mode target = parallel_mode::ep;
  int64_t load = 0;
  int64_t residency_steps = 0;
  double gain_ms = 0;          // (latency(current) - latency(target)) * residency_steps
  double cost_ms = 0;          // predicted switch cost (before the margin)
  bool passed = false;
  // A throughput gate (throughput_gate.hpp) also says what it weighed; 0 / "" otherwise.
  int64_t current_batch = 0;   // the batch the current mode runs
  int64_t target_batch = 0;    // the batch the target's pool would admit
  int64_t waiting = 0;         // requests waiting for admission
  const char* residency_from = "";  // "known work", "queue", "predictor", "fixed"
  // false: refused by switch_gate::gains before the switch was planned; cost_ms is then the
  // least it could cost
  bool priced = true;
};

// Asked instead of the step-time gate when set (switch_policy::set_gate): fills `out` (its
// evaluated, target and load are set by the policy) and returns whether the switch pays. A
// plain function pointer and context, as capacity_check.
//   gains (optional): whether the gain could pay the least the switch can cost (e.g. its
//   weights alone, no KV); asked before the capacity check, so that a switch that could not
//   pay even that is refused (cost_exceeds_gain, `out` with priced false and that least cost)
//   without planning it (a capacity check and a cost estimate each plan the whole KV
//   migration, which a rule that fires on every step would otherwise do on every step).
struct switch_gate {
  bool (*fn)(void* context, parallel_mode current, parallel_mode target, int64_t load,
             gate_evaluation& out) = nullptr;
  bool (*gains)(void* context, parallel_mode current, parallel_mode target, int64_t load,
                gate_evaluation& out) = nullptr;
  void* context = nullptr;
};

std::ostream& operator<<(std::ostream& os, const gate_evaluation& g);

class residency_predictor;  // residency.hpp

// Counters for traces and tests.
struct switch_policy_stats {
  int64_t steps = 0;
  int64_t switches = 0;                         // switches proposed
  int64_t external_switches = 0;                // mode changes not proposed by the policy
  int64_t by_reason[num_decision_reasons]{};    // decisions per reason
};

class switch_policy {
 public:
  // Validates `config` (see validate()).
  explicit switch_policy(const switch_policy_config& config, capacity_check capacity = {});

  // One engine step: `load` active sequences (>= 0), the mode the engine runs now, the time
  // in seconds (any monotonic clock; only differences are used; pass it even when
  // cooldown_s is 0). Returns stay or
  // switch_to(target); a proposed switch starts the cooldown at once (a failed switch also
  // backs off). O(1), no allocation. Throws errc::invalid_argument for load < 0, a `current`
  // that names neither EP nor TP, or a non-finite now_s (a NaN time would silently disable
  // the seconds cooldown). Any load >= 0 is accepted: the window saturates each load at
  // 2^48 (>= T_l · W for every valid config, so no decision changes) and never overflows.
  // `admission_blocked`: requests wait and the pool admitted none of them at the last step
  // (counts only with config().enter_on_blocked_admission, in TP).
  switch_decision step(int64_t load, parallel_mode current, double now_s,
                       bool admission_blocked = false);

  // Attaches the cost gate: step-latency curves of both modes and the predicted time of a
  // switch into each mode (cost_model.hpp). `curves` must outlive the policy; nullptr
  // detaches. Active only when config().expected_residency_steps > 0.
  void set_cost_gate(const latency_curves* curves, double switch_ms_to_ep,
                     double switch_ms_to_tp);
  // The same with a cost asked of `estimate` each time the gate weighs a switch (a finite
  // cost >= 0, else errc::invalid_argument from step()).
  void set_cost_gate(const latency_curves* curves, switch_cost_estimate estimate);
  // Predicts the residency for the gate (the engine feeds it each step); must outlive the
  // policy; nullptr: expected_residency_steps.
  void set_residency_predictor(const residency_predictor* predictor) { residency_ = predictor; }
  // A caller's gate in place of the step-time gate (switch_gate); {} detaches it. Its context
  // must outlive the policy.
  void set_gate(switch_gate gate) { gate_ = gate; }
  // Whether a gate is in force (a switch_gate, or curves attached and a predictor or a fixed
  // residency).
  bool gate_active() const;
  const gate_evaluation& last_gate() const { return last_gate_; }

  // New thresholds from here on (an engine that corrects its curves by what its steps take
  // moves the crossover); the windows, cooldown and stats stay. Throws errc::invalid_argument
  // unless 0 < t_low <= t_high <= 2^40 (nothing changes then).
  void set_thresholds(int64_t t_high, int64_t t_low);

  // Forgets history, cooldown and stats (e.g. at the start of a rollout step).
  void reset();

  const switch_policy_config& config() const { return config_; }
  const switch_policy_stats& stats() const { return stats_; }
  // Mean of the loads currently in the EP -> TP window (0 when empty), each saturated at 2^48.
  double window_mean() const;

 private:
  void restart_windows(int64_t step_idx, double now_s);
  bool in_cooldown(double now_s) const;
  bool gain_exceeds_cost(parallel_mode current, parallel_mode target, int64_t load);
  bool gains_anything(parallel_mode current, parallel_mode target, int64_t load);

  switch_policy_config config_;
  capacity_check capacity_;
  const latency_curves* curves_ = nullptr;
  double switch_ms_[2]{};  // indexed by parallel_mode
  switch_cost_estimate estimate_;
  switch_gate gate_;
  const residency_predictor* residency_ = nullptr;
  gate_evaluation last_gate_;

  switch_policy_stats stats_;
  bool seen_mode_ = false;
  parallel_mode last_mode_ = parallel_mode::ep;
  bool cooling_ = false;
  int64_t last_switch_step_ = 0;
  double last_switch_s_ = 0.0;
  int64_t above_run_ = 0;      // consecutive loads >= T_h since the last switch
  int64_t below_run_ = 0;      // consecutive loads < T_l since the last switch
  int64_t ring_[switch_policy_config::max_window]{};
  int64_t ring_head_ = 0;      // next write position
  int64_t ring_count_ = 0;     // loads in the ring (<= down_window)
  int64_t ring_sum_ = 0;       // sum of the loads in the ring
};

}  // namespace moebius
