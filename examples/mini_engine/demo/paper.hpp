#pragma once

// The paper's two experiments at the paper's scale (Moebius §9.2-9.3; DESIGN.md §8), on the
// simulated runtime (--runtime sim): Qwen3-235B-A22B on 8 H200s at a memory fraction of 0.85,
// at most 2,048 running requests, served by the real serving loop (scheduler, admission, page
// tables and KV accounting, policy, the switcher planning every switch over a dry-run
// transport) with every step priced by the per-rank step curves measured on one H200 over the
// operating region (docs/results/step_region_*.jsonl) and every switch by the cost model. What
// is simulated, said wherever a figure is printed: tokens are not computed; the collectives are
// priced by a link model; each of the 8 GPUs is emulated by the one rank measured.
//
// Per trace (paper-bursty, paper-rollout, or a --trace FILE), five runs, each on its own
// deployment: static TP (its own pool, sized after TP's weights), static EP (its own), and the
// switching deployment (EP's footprint plus the spare slot) switching by the calibrated policy
// with its cost gate, stop-the-world and progressive, and by the paper's rules alone. Then the
// paper's metrics per phase (paper_metrics.hpp) in a table beside the paper's figures, the steps
// and requests as CSV, and every metric as JSON (--results FILE); with --search, a rollout's
// offline ceiling (one switch point per rollout step, searched over ten thresholds).

#include <string>
#include <vector>

#include "options.hpp"

namespace mini_engine::demo {

// Runs o.traces (paper-bursty, paper-rollout, file) on the simulated runtime; returns the
// process's exit status (0: every run served every request).
int run_paper_experiments(const options& o);

}  // namespace mini_engine::demo
