#pragma once

// The demo's experiments: per trace, the runs it serves (each named: static TP, static EP,
// switching stop-the-world, progressive, and the policy without its cost gate) on the same
// trace, the trace shapes and the switching runs' settings. Every tuning constant of a run or a
// trace is in this header, with where it comes from; the code that serves only reads them.

#include <functional>
#include <moebius/policy/calibration.hpp>
#include <string>
#include <vector>

#include "engine.hpp"
#include "options.hpp"
#include "step_clock.hpp"
#include "targets.hpp"
#include "trace.hpp"
#include "world.hpp"

namespace mini_engine::demo {

// paper_policy: the paper's rules as written, without the cost gate (the simulated runtime's
// baseline; the host demo's no_gate is the same policy under its own name).
// by_cost: our policy choosing stop-the-world or progressive per switch (switch_style::by_cost).
enum class run_kind : uint8_t {
  static_tp,
  static_ep,
  switching,
  progressive,
  no_gate,
  paper_policy,
  by_cost
};

// "static TP", "static EP", "ours", "ours progressive", "no gate", "paper policy", "ours by
// cost": the runs' names in tables (switching, progressive and by_cost: the engine's own policy
// and gate, stop-the-world, progressive and chosen per switch).
const char* label_of(run_kind k);

// The traces (fixed shapes, the same for every deployment; sizes kept small enough for the
// host runtime to serve each four times in a few minutes):
//   bursty      quiet periods (0.6 s at 40 requests/s: 1-10 running) and bursts (0.1 s at
//               5500/s: ~550 requests, the engine fills to its 512 sequences)
//   rollout     an RL rollout: `--requests` (512) prompts at t = 0, outputs log-normal
//               (median 32, sigma 1.0, clamped at 1024): a long tail of long generations
//   steady      Poisson arrivals at the rate that keeps ~B* (the calibrated crossover)
//               sequences running (Little's law at the crossover's step time)
//   production  shaped like the Azure LLM inference trace 2023 (trace.hpp: Splitwise's
//               conversation medians, prompt 1020 / output 129 tokens; prompts divided by
//               the clock's context scale), mean 30 requests/s, rate redrawn every 0.5 s
// `--duration` replaces each duration; `crossover_rate`: the steady trace's requests/s.
struct trace_shapes {
  bursty_options bursty;
  rollout_options rollout;
  steady_options steady;
  production_options production;
};
trace_shapes demo_trace_shapes();

std::vector<request> make_trace(const options& o, trace_kind kind, int32_t vocab,
                                double crossover_rate);

// The switching runs' settings beyond the calibration. The demo's traces are compressed in
// time (bursts of 0.1 s), so the paper's 5 s cooldown becomes steps.
struct switching_settings {
  double interactive_cooldown_s = 0.02;  // bursts of 0.1 s
  int64_t interactive_cooldown_steps = 8;
  int64_t interactive_down_window = 8;
  int64_t rollout_cooldown_steps = 8;  // paper eq. 13: a rollout's load only decays
  // On the GPU runtime the traces keep few sequences running, below any threshold the
  // calibration finds (and one GPU has no crossover): the switching runs switch every this
  // many steps instead (forced), which moves every weight and KV page.
  int64_t forced_every_steps = 100;
  int64_t forced_last_step = 100'000;
};

// One run of a trace: which, and the engine options it is served with.
struct run_spec {
  run_kind kind;
  engine_options options;
};

// What one run gave.
struct run_outcome {
  run_kind kind;
  run_result result;
  run_summary summary;
  double wall_s = 0;  // the host's own time
};

// The run of kind `k` in `runs` (null when it was not served).
const run_outcome* find_run(const std::vector<run_outcome>& runs, run_kind k);

// Serves `trace` once per spec, as many at a time as `pool` has engines (each on its own
// runtime), in the order of `specs`; rethrows the first failure after every thread is joined.
std::vector<run_outcome> serve_runs(const std::vector<request>& trace,
                                    const std::vector<run_spec>& specs,
                                    const std::vector<engine*>& pool);

struct trace_outcome {
  std::string name;
  bool tokens_identical = true;
  std::vector<target_check> targets;
};

// Serves one trace with every run and prints its table, the report and the files.
//   `e`: the engine calibrated on; `pool`: the engines runs are served on (e first);
//   `set_progress`: installs the progress printer into a run's options.
trace_outcome serve_trace(const options& o, trace_kind kind, world& w, engine& e,
                          const std::vector<engine*>& pool, const step_clock& clock, int P,
                          const std::function<void(engine_options&)>& set_progress);

}  // namespace mini_engine::demo
