#pragma once

// One served run of the simulated runtime as JSON (the results file, --results): the paper's
// metrics, what it ran on, its policy's and gate's record, and what admission did over the run
// and in each flood. Nothing here serves or prints.

#include <string>
#include <vector>

#include <moebius/policy/calibration.hpp>
#include <nlohmann/json.hpp>

#include "paper_metrics.hpp"
#include "runs.hpp"

namespace mini_engine::demo {

// Admission over a run, in windows of `bucket_s` from time 0 (a window holds the steps that
// start in it; empty windows are left out): per window its start, the longest queue, the most
// running, the most KV tokens counted as taken (reserved) and the most written (TP: one rank's;
// EP: every rank's), the new_token_ratio at its last step (SGLang; 0 otherwise) and the
// retractions (SGLang) or preemptions (vLLM) in it. {"bucket_s", "columns", "rows"}: "columns"
// a CSV header and each row a CSV line in its order (a line, not an array: an array's numbers
// take a line each in the indented results file). Throws errc::invalid_argument naming
// bucket_s unless it is > 0 and finite.
nlohmann::json admission_over_time_json(const run_result& r, double bucket_s);

// The window admission_over_time_json uses for a run that ends at `end_s`: 1 s up to 200 s,
// then at most 200 windows a run, each a whole number of seconds (the bursty trace's runs,
// ~445 s: 3 s; a rollout of 35,000 s: 175 s), so the results JSON stays small; steps.csv has
// every step.
double admission_bucket_s(double end_s);

// Per flood period, what admission did in it: from the flood's first arrival until its last
// arrival and then until the queue is empty again (the run's end at most): the
// new_token_ratio at its first step, the longest queue and when, the most running, the most KV
// tokens reserved and what was written then, and the retractions or preemptions. An array in
// the order of `floods`; a flood that no step starts in gives zeros.
nlohmann::json flood_admission_json(const run_result& r,
                                    const std::vector<arrival_period>& floods);

// One run's metrics as JSON, with what it ran on and its policy's and gate's record (the
// details the default output leaves out); with admission over time and in each flood
// (admission_over_time_json, flood_admission_json).
nlohmann::json run_json(const std::string& trace, const run_outcome& r, const paper_metrics& m,
                        const std::string& clock, const moebius::calibration_result& cal);

}  // namespace mini_engine::demo
