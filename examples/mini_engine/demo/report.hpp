#pragma once

// What the demo prints and writes about one trace's runs: the table, the steps during
// switches, switching beside the best static run, a bound on what any switching could gain,
// the gate's reasoning, and the CSV and SVG files. Nothing here serves or decides.

#include <chrono>
#include <moebius/policy/calibration.hpp>
#include <mutex>
#include <string>
#include <vector>

#include "experiments.hpp"

namespace mini_engine::demo {

// run, mean/p99 TTFT, mean/p99 TPOT, tokens/s, switches, host seconds; `clock`: its name.
void print_table(const std::vector<run_outcome>& runs, const std::string& clock);

// Step latency during switches against normal steps: a stop-the-world switch stalls the step
// after it (its step time plus the switch), a progressive switch stretches each step it
// overlaps to max(step, copies).
void print_switch_steps(const std::vector<run_outcome>& runs);

// The best static run (by tokens/s), or static TP on a tie.
const run_outcome& best_static(const std::vector<run_outcome>& runs);

// Each switching run's tokens/s, p99 TTFT and TPOT and switches beside `best`'s.
void print_beside_best(const std::vector<run_outcome>& runs, const run_outcome& best);

// What a free switch at every step could save on each static layout's own trajectory, as its
// pool admitted it (free_switch_bound_s: every step priced in both modes by `clock`, the faster
// taken), against the cheapest switch (weights only, no KV). Admission is counted for the
// layout whose trajectory it is; the larger of the two is the bound printed.
void print_bound(const std::vector<run_outcome>& runs, const step_clock& clock, int P,
                 int64_t num_layers);

// Why the switching run did (not) switch, in the gate's numbers; `peak_load` > 0: the
// calibrated steps at that load too.
void print_gate(const run_result& r, const moebius::latency_curves* curves, int64_t peak_load);

// The runs' steps as one CSV (one header) and their timelines as one SVG, under
// `dir`/steps.csv and `dir`/timeline.svg.
void write_run_files(const std::string& dir, const std::vector<run_outcome>& runs);

// Prints a run's progress (step, time, running, done, mode, switches) at most every 5 s of the
// host's time, whichever run it comes from (runs are served two at a time).
class progress_printer {
 public:
  // Sets `o`'s progress callback to this printer (which must outlive the run).
  void install(engine_options& o);

 private:
  std::mutex mutex_;
  std::chrono::steady_clock::time_point last_ = std::chrono::steady_clock::now();
};

// The targets of every trace, met or missed, after all traces ran.
void print_summary(const std::vector<trace_outcome>& outcomes, bool priced,
                   const char* priced_model, int P);

}  // namespace mini_engine::demo
