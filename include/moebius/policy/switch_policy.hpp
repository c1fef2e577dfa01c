#pragma once

// The switch policy (the layer above the switcher, DESIGN.md §2): asymmetric hysteresis on the
// engine's load signal with a cooldown; a proposed switch is refused for capacity or by a gate
// on what the caller priced (below: two phases).
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
//   Sustained gain (enter_on_sustained_gain, off in the paper's policy): in TP, an observation
//            at which the caller finds EP faster at the sustained load (its own judgement: e.g.
//            curves corrected by what the steps take, at a load averaged over minutes, by a
//            margin) counts as one at or above T_h (reason sustained_gain): T_h is the decode
//            curves' crossover, and a scheduler whose prefills hold TP's decodes (SGLang's
//            prefill-first steps) moves the real crossover below it.
//   Rollout (paper eq. 13): T_l = T_h, W = 1: in an RL rollout the load only decays, so
//            switch to TP as soon as the count drops under T_h (`rollout_config()`).
//
// Two phases: the rules propose, the caller prices, the policy decides. propose() runs the rules
// above (pure: the load, the mode and the clock) and returns a target and why, or stay. For a
// proposed switch the caller plans it once (switcher::plan) and prices that one plan: whether the
// target holds the live KV (capacity) and what a gate weighs (step_time_gate.hpp: the step-time
// gate; throughput_gate.hpp: the throughput gate), into a switch_pricing. decide() then refuses
// it for capacity (capacity_refused) or for its gate (cost_exceeds_gain), or switches (the
// cooldown starts, the windows restart). Nothing calls back into the caller: the policy holds no
// hook, no curve and no plan, and a caller that prices nothing (step(): decide with an empty
// pricing) runs the rules alone.
//
//   switch_proposal p = policy.propose(load, sw.mode(), now);
//   switch_pricing priced;
//   std::optional<switch_plan> plan;
//   if (p.proposed()) {
//     plan = sw.plan(p.target);                              // once per decision
//     priced.fits = plan->capacity.fits;
//     if (priced.fits) priced.gate = weigh_step_time(curves, sw.mode(), p.target, load,
//                                                    residency_steps(cfg, &pred, load, p.target),
//                                                    cost_ms_of(*plan), cfg.gate_margin);
//   }
//   if (policy.decide(p, priced).do_switch) sw.switch_to(*plan);
//
// Every propose() is followed by one decide() of its proposal (a hold too: it is counted there).
//
// propose() and decide() are O(1), allocate nothing and keep fixed-size state (a ring of at most
// `max_window` loads): about 21 ns of host CPU time per step here (bench_policy).

#include <cstdint>
#include <iosfwd>

#include "moebius/layout/parallel_mode.hpp"

namespace moebius {

class residency_predictor;  // residency.hpp

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

  // The residency a gate weighs when the caller has no residency_predictor (residency_steps()):
  // the steps the engine is expected to stay in the target (0: unknown; the step-time gate is
  // then off, step_time_gate.hpp).
  int64_t expected_residency_steps = 0;
  // The share by which the gain must exceed the predicted cost (0.5: by half again), for what
  // the predictions leave out (the residency's spread, a cost model off by tens of percent).
  double gate_margin = 0.0;
  // Enter EP also when admission is blocked in TP (see above; step()'s admission_blocked).
  bool enter_on_blocked_admission = false;
  // Enter EP also when the caller finds EP faster at the sustained load (see above;
  // propose()'s sustained_gain).
  bool enter_on_sustained_gain = false;
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
  hold,               // no rule fired: load in the band, or window not yet full
  above_high,         // TP -> EP: load >= T_h for up_window observations
  below_low,          // EP -> TP: window below T_l
  cooldown,           // a rule fired but the cooldown has not elapsed
  capacity_refused,   // a rule fired but the target mode cannot hold the live KV
  cost_exceeds_gain,  // a rule fired but the predicted switch cost exceeds the gain
  admission_blocked,  // TP -> EP: requests wait and TP's pool admits none (up_window times)
  sustained_gain,     // TP -> EP: the caller finds EP faster at the sustained load (likewise)
};

inline constexpr int num_decision_reasons = 8;

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
    case decision_reason::sustained_gain:
      return "sustained_gain";
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

// What a gate weighed for one proposed switch (step_time_gate.hpp, throughput_gate.hpp): the
// caller hands it to decide() in its switch_pricing, and keeps it for its traces.
struct gate_evaluation {
  bool evaluated = false;      // false: no gate weighed the switch
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
  // false: weighed before the switch was planned, against the least it could cost (cost_ms):
  // a switch that cannot pay even that is refused without planning it
  bool priced = true;
  // The least gain a step the caller asked of the target (its curves' resolution: two
  // layouts priced closer than that are not told apart), in ms; 0: none asked. A gain a step
  // (gain_ms / residency_steps) below it is refused whatever the cost.
  double least_step_gain_ms = 0;
  constexpr bool below_resolution() const {
    return least_step_gain_ms > 0 && residency_steps > 0 &&
           gain_ms < least_step_gain_ms * static_cast<double>(residency_steps);
  }
};

std::ostream& operator<<(std::ostream& os, const gate_evaluation& g);

// What the rules say at one step (switch_policy::propose): a switch to `target` (reason
// above_high, below_low, admission_blocked or sustained_gain), or stay (hold: no rule fired;
// cooldown: one fired too soon after the last switch, `target` kept for traces).
struct switch_proposal {
  parallel_mode target = parallel_mode::ep;
  decision_reason reason = decision_reason::hold;
  int64_t load = 0;  // the load it was proposed at
  int64_t step = 0;  // the policy's step index it was made at (decide checks it)

  constexpr bool proposed() const {
    return reason == decision_reason::above_high || reason == decision_reason::below_low ||
           reason == decision_reason::admission_blocked ||
           reason == decision_reason::sustained_gain;
  }
};

// What the caller found pricing a proposed switch from its one plan (switch_policy::decide).
struct switch_pricing {
  bool fits = true;       // the target can hold every live sequence's KV (the plan's capacity)
  gate_evaluation gate;   // what a gate weighed; evaluated false: no gate (capacity alone)
};

// The load at which the residency a gate weighs ends: the threshold of the rule that would
// switch back, T_l after entering EP (below it EP -> TP fires), T_h after entering TP.
//   T_h 256, T_l 205: to EP -> 205, to TP -> 256.
int64_t residency_boundary(const switch_policy_config& config, parallel_mode target);

// The steps the engine is predicted to stay in `target` after switching at `load`:
// predictor->steps_until_cross(load, residency_boundary(config, target)), or, without a
// predictor, config.expected_residency_steps (0: unknown). Both gates read it.
int64_t residency_steps(const switch_policy_config& config, const residency_predictor* predictor,
                        int64_t load, parallel_mode target);

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
  explicit switch_policy(const switch_policy_config& config);

  // The rules at one engine step: `load` active sequences (>= 0), the mode the engine runs now,
  // the time in seconds (any monotonic clock; only differences are used; pass it even when
  // cooldown_s is 0), and whether admission is blocked (requests wait and the pool admitted
  // none of them at the last step; counts only with config().enter_on_blocked_admission, in
  // TP) and whether the caller finds EP faster at the sustained load (counts only with
  // config().enter_on_sustained_gain, in TP; a load at or above T_h names above_high, then
  // blocked admission admission_blocked, then sustained_gain). Returns what the rules propose;
  // decide() settles it. O(1), no allocation. Throws errc::invalid_argument for load < 0, a
  // `current` that names neither EP nor TP, a non-finite now_s (a NaN time would silently disable
  // the seconds cooldown), or when the last proposal was not decided. Any load >= 0 is accepted:
  // the window saturates each load at 2^48 (>= T_l · W for every valid config, so no decision
  // changes) and never overflows.
  switch_proposal propose(int64_t load, parallel_mode current, double now_s,
                          bool admission_blocked = false, bool sustained_gain = false);

  // Settles the proposal of the last propose(): stay (hold, cooldown), refused
  // (capacity_refused when !priced.fits, else cost_exceeds_gain when priced.gate was evaluated
  // and did not pass) or switch, which starts the cooldown at once (a failed switch also backs
  // off). O(1). Throws errc::invalid_argument for a proposal that is not the last propose()'s
  // or was already decided (nothing changes then).
  switch_decision decide(const switch_proposal& proposal, const switch_pricing& priced = {});

  // The rules alone, no capacity check and no gate: decide(propose(...)).
  switch_decision step(int64_t load, parallel_mode current, double now_s,
                       bool admission_blocked = false, bool sustained_gain = false) {
    return decide(propose(load, current, now_s, admission_blocked, sustained_gain));
  }

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

  switch_policy_config config_;
  switch_policy_stats stats_;
  bool seen_mode_ = false;
  parallel_mode last_mode_ = parallel_mode::ep;
  bool cooling_ = false;
  bool undecided_ = false;     // a proposal awaits decide()
  double proposed_s_ = 0.0;    // its now_s
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
