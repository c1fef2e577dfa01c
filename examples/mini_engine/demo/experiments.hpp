#pragma once

// The demo's experiments, one harness for every runtime: per trace, the runs it serves (named:
// runs.hpp) on the same trace, calibrated once, then reported (report.hpp for the host and GPU
// runtimes, paper_report.hpp for the simulated one). Every tuning constant of a run or a trace
// is in this header, with where it comes from; the code that serves only reads them.

#include <cstdint>
#include <moebius/policy/calibration.hpp>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "clock.hpp"
#include "engine.hpp"
#include "nodes_report.hpp"
#include "options.hpp"
#include "paper_metrics.hpp"
#include "paper_traces.hpp"
#include "report.hpp"
#include "runs.hpp"
#include "targets.hpp"
#include "trace.hpp"
#include "trace_stats.hpp"

namespace mini_engine::demo {

// What a trace's runs are served with, per runtime (settings_for, below).
struct run_settings {
  std::vector<run_kind> runs;
  size_t runs_at_once = 2;  // two cores: two runs side by side
  int64_t max_running = 512;
  int64_t step_tokens = 1024;
  // Our policy on an interactive trace: the cooldown between switches, and the window W the
  // EP -> TP rule averages the load over.
  double cooldown_s = 0.02;
  int64_t cooldown_steps = 8;
  int64_t down_window = 8;
  int64_t rollout_cooldown_steps = 8;  // paper eq. 13: a rollout's load only decays
  // How often a run reports progress, in steps (the printer then shows at most one line per 5 s).
  int64_t progress_every_steps = 1;
  // The context the calibration prices decode steps at, from the trace.
  int64_t (*calibration_context)(const std::vector<request>&) = nullptr;
  // On the GPU runtime the traces keep few sequences running, below any threshold the
  // calibration finds (and one GPU has no crossover): the switching runs switch every this many
  // steps instead (forced), which moves every weight and KV page.
  int64_t forced_every_steps = 100;
  int64_t forced_last_step = 100'000;
};

// The host's calibration context: the trace's prompt tokens plus half its output tokens, over
// its requests.
int64_t totals_context(const std::vector<request>& trace);

// Host and GPU: static TP, static EP, ours, ours progressive and (with a policy and its gate)
// no gate; --max-batch sequences (512) and --step-tokens a step (1024). The traces are
// compressed in time (bursts of 0.1 s), so the paper's 5 s cooldown becomes 0.02 s and 8 steps.
// The GPU runtime serves one run at a time, on its GPUs.
inline run_settings host_settings(const options& o, bool gpu) {
  run_settings s;
  s.runs = {run_kind::static_tp, run_kind::static_ep, run_kind::switching, run_kind::progressive,
            run_kind::no_gate};
  s.runs_at_once = gpu ? 1 : 2;
  s.max_running = o.max_batch;
  s.step_tokens = o.step_tokens;
  s.calibration_context = &totals_context;
  return s;
}

// Simulated: static TP, static EP, static TP-DCP2, static TEP-DCP2, ours (stop-the-world,
// progressive, by cost), the paper's policy, and our policy (stop-the-world) on the two other
// switching designs (EP <-> TP-DCP2, experts only, dcp only: deployment.hpp); the paper's limits
// (§9.1: 2,048 running) and SGLang's default chunked prefill on
// large GPUs (8,192 tokens a step); the paper's cooldown of 5 s (§7.1) and the rules' default
// window of 8; the calibration at mean_decode_context (each request's prompt plus half its
// output); progress every 2,000 steps (a rollout run is ~400k).
inline run_settings sim_settings() {
  run_settings s;
  s.runs = {run_kind::static_tp,      run_kind::static_ep,       run_kind::static_tp_dcp2,
            run_kind::static_tep_dcp2, run_kind::switching,       run_kind::progressive,
            run_kind::paper_policy,    run_kind::by_cost,         run_kind::switching_dcp2,
            run_kind::experts_only,    run_kind::dcp_only};
  s.max_running = 2048;
  s.step_tokens = 8192;
  s.cooldown_s = 5.0;
  s.cooldown_steps = 0;
  s.down_window = 8;
  s.progress_every_steps = 2000;
  s.calibration_context = &mean_decode_context;
  return s;
}

// --nodes 2: the runs a what-if over more nodes reprices (nodes_report.hpp): the paper's
// design alone, stop-the-world (static TP, static EP, ours, the paper's policy).
inline run_settings sim_nodes_settings() {
  run_settings s = sim_settings();
  s.runs = {run_kind::static_tp, run_kind::static_ep, run_kind::switching,
            run_kind::paper_policy};
  return s;
}

inline run_settings settings_for(runtime_kind runtime, const options& o) {
  if (runtime == runtime_kind::sim) return o.nodes > 1 ? sim_nodes_settings() : sim_settings();
  return host_settings(o, runtime == runtime_kind::gpu);
}

// The rollout's outputs are cut at this many tokens (paper §9.3); the trace's statistics count
// those that reach it.
inline constexpr int64_t k_rollout_output_cap = paper_rollout_options{}.output_cap;

// --search: the rollout rule's thresholds b the offline search serves the trace at.
inline const std::vector<int64_t> k_search_grid = {32, 64, 96, 128, 192, 256, 384, 512, 768, 1024};

// The host demo's traces (fixed shapes, the same for every deployment; sizes kept small enough
// for the host runtime to serve each four times in a few minutes):
//   bursty      quiet periods (0.6 s at 40 requests/s: 1-10 running) and bursts (0.1 s at
//               5500/s: ~550 requests, the engine fills to its 512 sequences)
//   rollout     an RL rollout: `--requests` (512) prompts at t = 0, outputs log-normal
//               (median 32, sigma 1.0, clamped at 1024): a long tail of long generations
//   steady      Poisson arrivals at the rate that keeps ~B* (the calibrated crossover)
//               sequences running (Little's law at the crossover's step time)
//   production  shaped like the Azure LLM inference trace 2023 (trace.hpp: Splitwise's
//               conversation medians, prompt 1020 / output 129 tokens; prompts divided by
//               the clock's context scale), mean 30 requests/s, rate redrawn every 0.5 s
// `--duration` replaces each duration. The paper's traces: serving/paper_traces.hpp.
struct trace_shapes {
  bursty_options bursty;
  rollout_options rollout;
  steady_options steady;
  production_options production;
};
trace_shapes demo_trace_shapes();

// The trace of kind `kind`; `steady_rate` > 0: the steady traces' requests/s.
std::vector<request> make_trace(const options& o, trace_kind kind, int32_t vocab,
                                double steady_rate);

// What every trace of a demo is served with.
struct harness {
  const options& o;
  runtime_kind runtime;  // host, gpu or sim (never automatic)
  run_settings settings;
  run_pool& pool;
  const demo_clock& clock;
  int P;
  progress_printer& progress;
  nlohmann::json results = nlohmann::json::array();  // simulated: every metric of every run
  // --nodes 2 (simulated): the models the runs are repriced with on more nodes; null: none.
  const nodes_models* nodes = nullptr;
};

// Serves one trace with every run and reports it (the table, the files; the details with
// --verbose).
trace_outcome serve_trace(harness& h, trace_kind kind);

}  // namespace mini_engine::demo
