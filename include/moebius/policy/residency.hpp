#pragma once

// Residency prediction for the switch policy's cost gate (switch_policy.hpp, DESIGN.md §7 "A
// switch must pay for itself"): how many engine steps the engine will stay in the mode it is
// about to switch to, predicted from the recent arrival and completion rates.
//
// The engine calls observe() once per step with what happened in that step; the policy calls
// steps_until_cross() when a rule fires. The model is a fluid queue in engine steps:
//
//   arrival rate   a = exponentially weighted mean of requests arriving per step, time
//                      constant `window_steps`, over a history that starts empty: before the
//                      first step nothing arrived (an engine starts idle), so a single batch
//                      (an RL rollout's 512 prompts in step 0) counts as 512 / window_steps
//                      and fades, rather than standing for a rate of 512 a step
//   lifetime       S = mean steps a request runs from admission to its last token: the
//                      exponentially weighted mean over completed requests (weight 1/64 each,
//                      bias-corrected the same way); unknown before the first completion
//   completion rate c(R) = R / S  at R running sequences (Little's law: R sequences, each
//                      present for S steps, complete at R / S per step at the load they are at
//                      now, which an average of past completions would lag behind)
//   drift          d = a - c(R)   requests per step the load moves by
//
// A switch to the high-load mode (EP) is entered at load B >= boundary T_l (the load the policy
// leaves EP under): if d < 0 the load falls below T_l after (B - T_l + 1) / -d steps; if d >= 0
// nothing in sight ends the residency and the prediction is `horizon_steps`. A switch to the
// low-load mode (TP) at B < T_h lasts until the load climbs to T_h: (T_h - B) / d steps if
// d > 0, else `horizon_steps`. Every prediction is clamped to [1, horizon_steps]. Before the
// first completion S is unknown, and so is when the load will fall: the prediction is then 1
// step (the gate bets on no residency it has no evidence for; a switch then pays only if one
// step repays it).
//
// Worked example (window_steps 256, horizon 4096). A bursty trace: 2.6 requests arrive per
// step on average over the window (bursts included), completed requests ran S = 28 steps, and
// a burst has filled the engine to B = R = 128 running. c = 128 / 28 = 4.57, d = 2.6 - 4.57 =
// -1.97: with T_l = 100 the burst drains below T_l in (128 - 100 + 1) / 1.97 = 14.7 -> 15
// steps. A switch to EP saving 0.4 ms a step gains 15 x 0.4 = 6 ms: less than a 40 ms switch,
// the gate refuses it. An RL rollout's batch instead: 512 arrivals in step 0, none after, no
// request finished yet: S unknown, residency 1 step: no switch to EP on no evidence. 100 steps
// later, 70 sequences left and S = 28: a = 512/256 x (255/256)^100 = 1.35 < c = 2.5, the load
// does not climb back to T_h = 230: residency 4096 steps.
//
// observe() and steps_until_cross() are O(1) and allocate nothing.

#include <cstdint>
#include <iosfwd>

namespace moebius {

struct residency_config {
  int64_t window_steps = 256;    // time constant of the arrival-rate average, steps (>= 1)
  int64_t horizon_steps = 4096;  // the longest prediction (no end in sight), steps (>= 1)
};

// Throws errc::invalid_argument naming the field unless 1 <= window_steps <= 2^30 and
// 1 <= horizon_steps <= 2^40.
void validate(const residency_config& config);

std::ostream& operator<<(std::ostream& os, const residency_config& config);

// What one engine step did.
struct step_observation {
  int64_t arrivals = 0;         // requests that arrived during the step (>= 0)
  int64_t completions = 0;      // requests that finished in the step (>= 0)
  int64_t completed_steps = 0;  // sum over those requests of the steps each ran (>= 0)
  int64_t running = 0;          // sequences running after the step (>= 0)
};

class residency_predictor {
 public:
  // Validates `config`.
  explicit residency_predictor(const residency_config& config = {});

  // One step. Throws errc::invalid_argument for a negative count, or completed_steps > 0 with
  // no completion.
  void observe(const step_observation& step);

  // Steps until a load that is now `load` (with the last observed running count) crosses
  // `boundary`: from at or above it to below it, or from below it to at or above it. See the
  // model above; in [1, horizon_steps]; 1 before the first completion. Throws errc::invalid_argument for a negative load or
  // boundary.
  int64_t steps_until_cross(int64_t load, int64_t boundary) const;

  double arrival_rate() const;                 // a, requests per step (0 before any step)
  double mean_lifetime_steps() const;          // S (0 while no request has finished)
  double completion_rate(int64_t running) const;  // c(R) = R / S (0 while S is unknown)
  double drift() const;                        // a - c(last running)
  int64_t steps_observed() const { return steps_; }

  void reset();
  const residency_config& config() const { return config_; }

 private:
  residency_config config_;
  double alpha_ = 0;           // 1 / window_steps
  double arrivals_ewma_ = 0;   // EWMA over a history that starts with no arrivals
  double lifetime_ewma_ = 0;
  double lifetime_decay_ = 1;  // (1 - 1/64)^completions
  int64_t steps_ = 0;
  int64_t completions_ = 0;
  int64_t running_ = 0;
};

// "residency{a=2.6/step, S=28 steps, drift=-1.97/step, 300 steps seen}"
std::ostream& operator<<(std::ostream& os, const residency_predictor& p);

}  // namespace moebius
