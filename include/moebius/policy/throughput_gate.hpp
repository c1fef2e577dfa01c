#pragma once

// The throughput gate: whether a switch the policy's rules propose pays, weighed on what an
// engine knows about the work in front of it (DESIGN.md §7, "a switch must pay for itself";
// switch_policy.hpp: the caller weighs a proposed switch with it and hands the result to decide()). The step-time gate compares the two modes'
// step latency at the same batch; on a deployment whose pools differ (TP replicates KV heads
// when H_kv < P and holds about half of EP's tokens) that misses what decides a flood or a
// rollout's bulk: the batch each mode's pool admits. Three terms, each of which can be turned
// off (the ablations of tests/policy and the mini-engine's policy tests):
//
//   admission   each mode runs the batch its pool admits,
//                 B_m = min(running + waiting, max_running, admits_m),
//               admits_m being the sequences mode m's pool holds at the live sequences' mean
//               KV; off: both run the same batch, min(running + waiting, max_running).
//   queueing    the residency is at least the time to serve the queue: the waiting requests'
//               expected tokens at the target's batch, queue_tokens / B_target steps (a
//               request that waits behind a slow mode waits the whole drain); off: the
//               queue does not lengthen the residency.
//   known work  the residency from what is known (a rollout's survivors and the tokens each
//               has generated: known_residency_steps); off, or when unknown (< 0): the
//               residency predictor's (residency.hpp).
//
// Gain: the time the target saves producing what the current mode produces in the residency,
//   gain_ms = R · (lat_cur(B_cur) − B_cur · lat_tgt(B_tgt) / B_tgt),
// R in steps of the current mode; with equal batches the step-time gate's (lat_cur − lat_tgt)·R.
// The switch pays when gain_ms >= switch_ms · (1 + margin).
//
// Worked example (curves EP 30 + 0.02·b ms, TP 20 + 0.08·b ms; crossover 166): TP runs its
// pool's 300 sequences, 500 more wait, EP's pool admits 600, max_running 2048: B_tp = 300
// (44 ms a step, 0.147 ms a token), B_ep = 600 (42 ms, 0.070 ms a token). A 200-step residency
// gains 200 · (44 − 300 · 42 / 600) = 4,600 ms, well over a 150 ms switch. Without the admission
// term both run 800: 200 · (84 − 46) = 7,600 ms (the same verdict here; at a load under the
// crossover, 120 with TP's pool holding 60, it is the admission term alone that says EP pays).

#include <cstdint>
#include <iosfwd>

#include "moebius/layout/parallel_mode.hpp"
#include "moebius/policy/switch_policy.hpp"

namespace moebius {

class latency_curves;  // calibration.hpp

struct gate_terms {
  bool admission = true;
  bool queueing = true;
  bool known_work = true;
};

std::ostream& operator<<(std::ostream& os, const gate_terms& t);

// What the engine knows when a rule fires.
struct serving_load {
  int64_t running = 0;              // sequences running now (>= 0)
  int64_t waiting = 0;              // arrived requests waiting for admission (>= 0)
  int64_t max_running = 1;          // the scheduler's cap on running sequences (>= 1)
  int64_t admits_ep = 0;            // sequences each mode's pool holds at the live mean (>= 0)
  int64_t admits_tp = 0;
  double queue_tokens = 0;          // expected tokens the waiting requests will generate (>= 0)
  int64_t known_residency_steps = -1;     // from known work; < 0: unknown
  int64_t predicted_residency_steps = 1;  // the residency predictor's (>= 1)

  int64_t admits(parallel_mode m) const { return m == parallel_mode::ep ? admits_ep : admits_tp; }
};

// Weighs a switch from `current` to `target` (see above) and returns the evaluation
// (evaluated, passed and every number set; load = running + waiting). Throws
// errc::invalid_argument for modes that are equal or name neither EP nor TP, negative counts,
// max_running < 1, predicted_residency_steps < 1, or a switch_ms or margin that is negative or
// not finite.
gate_evaluation weigh_switch(const latency_curves& curves, parallel_mode current,
                             parallel_mode target, const serving_load& load, double switch_ms,
                             double margin, const gate_terms& terms = {});

}  // namespace moebius
