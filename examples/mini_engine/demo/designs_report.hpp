#pragma once

// The switching designs of the simulated runtime against the static configurations (DESIGN.md
// §9): which design served a trace best, against the paper's baselines and the best static
// configuration, and each design's free-switch bound on a rollout.

#include <cstddef>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "paper_metrics.hpp"
#include "runs.hpp"
#include "step_clock.hpp"

namespace mini_engine::demo {

// The switching designs against the static configurations: the best switching design (our
// policy, stop-the-world, on each design: by rollout time; on an interactive trace by
// interactive goodput, then tokens/s) against the better of static TP and static EP (the
// paper's baselines) and against the best of every static configuration served. nullopt
// unless a static configuration or design beyond the paper's, and a design and TP or EP, were
// served. Indices into `runs`; `line` what print_designs_verdict prints:
//   "designs: the best switching design is ours experts (58 s): 1.379x static EP (the better of
//   static TP and EP); 1.034x static TP-DCP2 (the best of the 4 static configurations)"
struct designs_verdict {
  size_t design = 0, paper = 0, best_static = 0;
  std::string line;
};
// `bounds_s`: per switching design served, its free-switch bound (design_bounds_s); the
// rollout line then says how close the best design came to its own.
std::optional<designs_verdict> designs_verdict_of(
    const std::vector<run_outcome>& runs, const std::vector<paper_metrics>& m, bool rollout,
    const std::vector<std::pair<run_kind, double>>& bounds_s = {});
void print_designs_verdict(const std::vector<run_outcome>& runs,
                           const std::vector<paper_metrics>& m, bool rollout,
                           const std::vector<std::pair<run_kind, double>>& bounds_s = {});

// Each switching design's free-switch bound on a rollout: a free switch at every step between
// the design's two configurations, on each of its two static configurations' own trajectories
// (each admitted by its own pool: capacity counted), the shorter of the two. Designs whose
// static runs were not both served are left out. Seconds.
std::vector<std::pair<run_kind, double>> design_bounds_s(const std::vector<run_outcome>& runs,
                                                         const step_clock& clock, int num_ranks);

}  // namespace mini_engine::demo
