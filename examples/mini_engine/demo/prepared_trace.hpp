#pragma once

// A trace ready to serve (experiments.cpp serves it with every run): its requests drawn, the
// calibration at their context on the pool's calibration engine (each other switching design's
// too, simulated), its floods found, and the steady traces redrawn at the rate that keeps ~B*
// running.

#include <string>
#include <utility>
#include <vector>

#include <moebius/policy/calibration.hpp>

#include "experiments.hpp"

namespace mini_engine::demo {

// A trace ready to serve: its requests, the calibration at their context, and what the
// reports read of it.
struct prepared_trace {
  std::string name;
  std::string dir;  // where its files go
  trace_kind kind = trace_kind::bursty;
  std::vector<request> trace;
  bool rollout = false;
  moebius::calibration_result cal;
  // Simulated: each other switching design's calibration (its own layouts and deployment).
  std::vector<std::pair<deployment_kind, moebius::calibration_result>> designs;
  std::vector<arrival_period> floods;  // simulated: the paper's phases
  double rate = 0;                     // the steady traces: the rate that keeps ~B* running
  bool rate_given = false;             // ... or --rate's
};

// The trace of `kind`, calibrated at its context on the pool's calibration engine (the
// crossover where the curves themselves cross, piecewise through the points); --verbose prints
// its shape, floods and calibration. Throws usage_error for a trace with no requests.
prepared_trace prepare_trace(harness& h, trace_kind kind);

}  // namespace mini_engine::demo
