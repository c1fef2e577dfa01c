#pragma once

// The targets the switching runs are graded against, per trace (the issues' targets, never
// tuned for: a miss is reported with its numbers).
//   rollout   switching >= 1.16x the best static tokens/s (the paper's lowest rollout gain)
//   bursty    switching's tokens/s and p99 TTFT at least the best static's
//   others    never more than 2% worse than the best static (tokens/s, p99 TTFT)

#include <string>

#include "engine.hpp"
#include "options.hpp"

namespace mini_engine::demo {

struct target_check {
  bool met = true;
  std::string line;  // the target, the figures and "met" or "MISSED"
};

struct targets {
  double rollout_speedup = 1.16;
  double bursty_speedup = 1.0;
  double others_speedup = 0.98;   // at most 2% fewer tokens/s
  double others_p99_ttft = 1.02;  // at most 2% longer p99 TTFT
};

// `sw` (the run named `sw_name`) against the best static run on a trace of kind `kind`.
target_check check_targets(trace_kind kind, const run_summary& best, const run_summary& sw,
                           const char* sw_name, const targets& t = {});

}  // namespace mini_engine::demo
