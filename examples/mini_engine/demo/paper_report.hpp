#pragma once

// What the simulated runtime's experiments print and record (the paper's §9.2-9.3 at its
// scale, DESIGN.md §8): per trace, the paper's metrics per phase (serving/paper_metrics.hpp) in
// a table beside the paper's figures, a one-line verdict, and every metric of every run as JSON.
// What is simulated is said where the figures are printed: tokens are not computed; the
// collectives are priced by a link model; each of the 8 GPUs is emulated by the one rank
// measured. Nothing here serves or decides.

#include <cstdint>
#include <moebius/policy/calibration.hpp>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "deployment.hpp"
#include "options.hpp"
#include "paper_metrics.hpp"
#include "runs.hpp"

namespace mini_engine::demo {

// What the simulated runtime prints before the first trace: what it serves, on what, the KV
// capacity of every deployment in tokens, which step curves are measured and which priced
// (`curves`: demo_clock::curves_summary), and where the details are; `verbose`: the
// deployments, the clock and admission in full.
void print_sim_preamble(const options& o, const std::string& clock_name,
                        const std::string& curves, const std::vector<run_kind>& runs,
                        int64_t max_running, int64_t step_tokens);

// The layouts deployment `d` serves in: "TP-DCP2", "EP <-> TP-DCP2" (a switching design: its
// large-batch layout first).
std::string layouts_of(const deployment& d);

// "KV tokens: static TP 1.44M, static EP 2.30M, ...; switching EP 2.28M / TP 1.14M, ..." for
// every deployment the runs of `kinds` are served on (each once, in their order).
std::string capacity_line(const std::vector<run_kind>& kinds);

// The paper's metrics of each run of `trace`, in the order of `runs`.
std::vector<paper_metrics> paper_metrics_of_runs(const std::vector<request>& trace,
                                                 const std::vector<run_outcome>& runs,
                                                 const std::vector<arrival_period>& floods);

// The metrics of run `k` (m in the order of runs); throws std::logic_error when it was not served.
const paper_metrics& metrics_of(const std::vector<run_outcome>& runs,
                                const std::vector<paper_metrics>& m, run_kind k);

// "paper-bursty: 3057 requests over 374.9 s (mean 8.2/s, peak 136/s); floods at 31-38 s and
// 337-344 s"; `rate` > 0: the steady or production trace's, with the crossover B* it keeps
// running (`bstar` 0: a rate given by --rate).
void print_trace_title(const std::string& name, const std::vector<request>& trace,
                       const std::vector<arrival_period>& floods, double rate, double bstar);

// An open-loop trace: flood TTFT, quiet TPOT, switches, goodput, tokens/s per run, then the
// paper's figures (§9.2; beside a trace without floods only when `verbose`), then the verdict.
void print_interactive_table(const std::vector<run_outcome>& runs,
                             const std::vector<paper_metrics>& m, bool verbose);
void print_interactive_verdict(const std::vector<run_outcome>& runs,
                               const std::vector<paper_metrics>& m);
// The design the verdicts lead with: dcp only (TP-DCP2 <-> TP on static TP's footprint, the
// one that wins every trace under vLLM's rules: docs/BENCHMARKS.md) when it was served, else
// the paper's (ours).
run_kind default_design(const std::vector<run_outcome>& runs);

// The index of the run of kind `k` in `runs` (std::logic_error when it was not served).
size_t index_of(const std::vector<run_outcome>& runs, run_kind k);
// "quiet TPOT +14%, flood TTFT +8%" of `x` against `base` (flood only when there are floods).
std::string changes(const paper_metrics& x, const paper_metrics& base);

// A rollout: each run's total and per-step times against the better static layout, the worse
// and the per-step oracle, then the paper's figures (§9.3); `bound_s`: a free switch at every
// step with capacity ignored (free_switch_bound_s on static EP's steps).
void print_rollout_table(const std::vector<run_outcome>& runs,
                         const std::vector<paper_metrics>& m, bool verbose);
void print_rollout_bound(const std::vector<run_outcome>& runs,
                         const std::vector<paper_metrics>& m, double bound_s);
void print_rollout_verdict(const std::vector<run_outcome>& runs,
                           const std::vector<paper_metrics>& m, double bound_s);

// Each policy run's decisions (engine_options::explain) into `dir`/decisions.txt; the first
// lines of the first such run printed.
void write_decisions(const std::string& dir, const std::vector<run_outcome>& runs);

}  // namespace mini_engine::demo
