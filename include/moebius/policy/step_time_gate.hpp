#pragma once

// The step-time gate (DESIGN.md §7, "a switch must pay for itself"): a proposed switch pays when
// the time the target saves per step at today's load, over the steps the engine is predicted to
// stay there, covers what the switch costs:
//
//   gain_ms = (latency(current, load) - latency(target, load)) * residency_steps
//   passes when gain_ms >= switch_ms * (1 + margin)
//
// Both modes at the same batch: on a deployment whose pools differ (TP holds fewer tokens when it
// duplicates KV heads) the throughput gate (throughput_gate.hpp) weighs the batch each pool
// admits instead. The residency comes from residency_steps() (switch_policy.hpp: the predictor up
// to the rule's boundary, or the config's fixed expectation); switch_ms from the caller's plan
// (e.g. moebius::cost_model priced for that plan's bytes).
//
// Worked example (EP 20 + 0.05 b ms, TP 10 + 0.1 b ms): EP -> TP at load 10 saves 9.5 ms a step;
// over 100 steps 950 ms: a 949 ms switch passes, a 951 ms one is refused.

#include <cstdint>

#include "moebius/layout/parallel_mode.hpp"
#include "moebius/policy/switch_policy.hpp"

namespace moebius {

class latency_curves;  // calibration.hpp

// Weighs the switch from `current` to `target` at `load` (every field of the evaluation set).
// residency_steps <= 0 means unknown: the gate is off (evaluated false: decide() lets the
// switch through on capacity alone). Throws errc::invalid_argument for modes that are equal or
// name neither EP nor TP, a negative load, or a switch_ms or margin that is negative or not
// finite.
gate_evaluation weigh_step_time(const latency_curves& curves, parallel_mode current,
                                parallel_mode target, int64_t load, int64_t residency_steps,
                                double switch_ms, double margin);

}  // namespace moebius
