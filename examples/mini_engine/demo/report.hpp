#pragma once

// What the demo prints and writes about one trace's runs on the host and GPU runtimes (the
// simulated runtime's tables: paper_report.hpp): the table, the steps during switches,
// switching beside the best static run, a bound on what any switching could gain, the gate's
// reasoning, the closing summary, and the files (CSV and SVG) every runtime writes. Nothing
// here serves or decides.

#include <chrono>
#include <cstdint>
#include <moebius/policy/calibration.hpp>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "runs.hpp"
#include "targets.hpp"

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
// pool admitted it (free_switch_bound_s: every step priced in both modes by the clock, the
// faster taken), against the cheapest switch (weights only, no KV). Admission is counted for
// the layout whose trajectory it is; the larger of the two is the bound.
struct bound_line {
  bool priced = false;  // false: a measuring clock prices no step it did not run
  double ratio = 0;     // at most this many times the static run's step time, the larger
  double one_switch_ms = 0;
  std::string parts;  // "static TP's 2849 ms of steps -> 2600 ms (<= 1.096x); static EP's ..."
};
bound_line bound_of(const std::vector<run_outcome>& runs, const step_clock& clock, int P,
                    int64_t num_layers);
void print_bound(const bound_line& b);

// Why the switching run did (not) switch, in the gate's numbers; `peak_load` > 0: the
// calibrated steps at that load too.
void print_gate(const run_result& r, const moebius::latency_curves* curves, int64_t peak_load);

// The runs' steps as one CSV (one header), their requests as another and their timelines as
// one SVG, under `dir`. `max_rows` > 0: the step log keeps every k-th step of each run (k the
// same for every run, the smallest that keeps the rows under max_rows) and every step at a
// switch or a change of mode; 0: every step. Returns k (1: every step).
int64_t write_run_files(const std::string& dir, const std::vector<run_outcome>& runs,
                        int64_t max_rows);
// "wrote DIR/steps.csv (every 33rd step, ...), DIR/requests.csv and DIR/timeline.svg"
std::string files_line(const std::string& dir, int64_t every);

// Prints a run's progress (step, time, running, done, mode, switches) at most every 5 s of the
// host's time, whichever run it comes from (runs are served two at a time): a line on stdout
// each (lines), or one line on a terminal's stderr, rewritten in place and cleared at the end
// (status: nothing when stderr is no terminal).
class progress_printer {
 public:
  enum class style : uint8_t { lines, status };
  explicit progress_printer(style s);
  // Sets `o`'s progress callback to this printer (which must outlive the run).
  void install(engine_options& o);
  // Clears the status line, if any.
  void done();

 private:
  style style_;
  bool tty_ = false;
  bool shown_ = false;
  std::mutex mutex_;
  std::chrono::steady_clock::time_point last_ = std::chrono::steady_clock::now();
};

// What one trace gave, for the closing summary.
struct trace_outcome {
  std::string name;
  trace_kind kind = trace_kind::bursty;
  bool ok = true;  // tokens identical (where they can be), every request served
  std::vector<target_check> targets;
  std::vector<std::pair<run_kind, run_summary>> runs;
  bound_line bound;
  uint64_t digest = 0;  // the first run's greedy tokens (token_digest)
  int64_t differ = 0;   // requests whose greedy tokens differ between runs
};

// FNV-1a over every request's greedy tokens, a separator after each request: one number to
// compare a trace's tokens between two builds (the GPU demo before and after a change).
uint64_t token_digest(const run_result& r);

// Requests whose greedy tokens differ between any run and the first.
int64_t requests_that_differ(const std::vector<run_outcome>& runs);

// After all traces (host, GPU): one row per trace (the best static run's tokens/s, each
// switching run's against it, p99 TTFT, the bound, the targets), a verdict and where the files
// are (under `out_dir`); `verbose`: first the targets line by line, and what a miss means.
void print_summary(const std::vector<trace_outcome>& outcomes, bool priced,
                   const char* priced_model, int P, bool verbose, const std::string& out_dir);

}  // namespace mini_engine::demo
