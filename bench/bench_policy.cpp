// Host cost of the switch policy (target: <= 100 ns per step, it runs on every engine step),
// of calibration (once at start-up), of a cost-model prediction and of a memory budget.
// Run: bench_policy --benchmark_format=json

#include <benchmark/benchmark.h>

#include <cstdint>
#include <random>
#include <vector>

#include "moebius/layout/arena_geometry.hpp"
#include "moebius/memory/memory_budget.hpp"
#include "moebius/policy/calibration.hpp"
#include "moebius/policy/cost_model.hpp"
#include "moebius/policy/step_time_gate.hpp"
#include "moebius/policy/switch_policy.hpp"

using namespace moebius;

namespace {

// A load trace that crosses both thresholds now and then (so every branch runs).
std::vector<int64_t> make_loads(size_t n) {
  std::mt19937_64 rng(42);
  std::vector<int64_t> v(n);
  int64_t load = 200;
  for (auto& l : v) {
    if (rng() % 64 == 0) load = static_cast<int64_t>(rng() % 600);
    load = std::max<int64_t>(0, load + static_cast<int64_t>(rng() % 7) - 3);
    l = load;
  }
  return v;
}

void run_policy(benchmark::State& state, switch_policy_config c, bool gate) {
  const std::vector<int64_t> loads = make_loads(4096);
  std::vector<latency_sample> ep, tp;
  for (double b : {1.0, 64.0, 512.0}) {
    ep.push_back({b, 20 + 0.05 * b});
    tp.push_back({b, 10 + 0.1 * b});
  }
  const calibration_result cal = calibrate(ep, tp);
  if (gate) c.expected_residency_steps = 1000;
  switch_policy p(c);
  parallel_mode mode = parallel_mode::tp;
  size_t i = 0;
  double now = 0;
  for (auto _ : state) {
    // The two phases as an engine runs them: a proposed switch priced (capacity: fits; the
    // step-time gate on a fixed 150 ms cost), then decided.
    const switch_proposal prop = p.propose(loads[i], mode, now);
    switch_pricing priced;
    if (gate && prop.proposed())
      priced.gate = weigh_step_time(cal.curves, mode, prop.target, prop.load,
                                    residency_steps(c, nullptr, prop.load, prop.target), 150.0,
                                    c.gate_margin);
    const switch_decision d = p.decide(prop, priced);
    if (d.do_switch) mode = d.target;
    benchmark::DoNotOptimize(d);
    i = (i + 1) & 4095;
    now += 0.05;
  }
  state.counters["switches"] = static_cast<double>(p.stats().switches);
  state.counters["ns_per_step"] =
      benchmark::Counter(static_cast<double>(state.iterations()),
                         benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
}

void BM_policy_step_interactive(benchmark::State& state) {
  switch_policy_config c = interactive_config(256);
  c.down_window = state.range(0);
  run_policy(state, c, false);
}
BENCHMARK(BM_policy_step_interactive)->Arg(8)->Arg(256);

void BM_policy_step_every_rule_with_cost_gate(benchmark::State& state) {
  switch_policy_config c = interactive_config(256);
  c.rule = down_rule::every;
  c.down_window = 8;
  run_policy(state, c, true);
}
BENCHMARK(BM_policy_step_every_rule_with_cost_gate);

void BM_policy_step_rollout(benchmark::State& state) {
  run_policy(state, rollout_config(256), false);
}
BENCHMARK(BM_policy_step_rollout);

// Calibration over `range(0)` batch sizes per mode, 3 repetitions each.
void BM_calibrate(benchmark::State& state, curve_fit fit) {
  std::mt19937_64 rng(7);
  std::normal_distribution<double> noise(0.0, 0.05);
  std::vector<latency_sample> ep, tp;
  for (int r = 0; r < 3; ++r) {
    for (int64_t k = 0; k < state.range(0); ++k) {
      const double b = static_cast<double>(1 + k * 2048 / state.range(0));
      ep.push_back({b, 20 + 0.05 * b + noise(rng)});
      tp.push_back({b, 10 + 0.1 * b + noise(rng)});
    }
  }
  calibration_options o;
  o.fit = fit;
  for (auto _ : state) {
    calibration_result r = calibrate(ep, tp, o);
    benchmark::DoNotOptimize(r);
  }
}
BENCHMARK_CAPTURE(BM_calibrate, line, curve_fit::least_squares_line)->Arg(12)->Arg(64);
BENCHMARK_CAPTURE(BM_calibrate, piecewise, curve_fit::piecewise_linear)->Arg(12)->Arg(64);

void BM_cost_predict(benchmark::State& state) {
  const arena_geometry g = make_arena_geometry(qwen3_235b_a22b(), 8);
  const cost_model m;
  switch_workload w = weight_switch_workload(g, 94);
  w.kv_bytes_per_rank = 10'000'000'000;
  w.kv_rounds = 4;
  for (auto _ : state) {
    switch_cost c = m.predict(w);
    benchmark::DoNotOptimize(c);
  }
  state.counters["qwen3_weights_ms"] = m.predict(weight_switch_workload(g, 94)).total_ms();
}
BENCHMARK(BM_cost_predict);

void BM_memory_budget(benchmark::State& state) {
  const arena_geometry g = make_arena_geometry(qwen3_235b_a22b(), 8);
  switch_footprint f;
  f.descriptor_ops_per_rank = 1 << 20;
  f.barrier_flag_slots = 16;
  memory_budget b;
  for (auto _ : state) {
    b = make_memory_budget(g, qwen3_235b_a22b_attention(), qwen3_235b_a22b_dense(),
                           int64_t{40} << 30, f);
    benchmark::DoNotOptimize(b);
  }
  state.counters["overhead_pct_of_experts"] = b.overhead_fraction_of_experts() * 100.0;
}
BENCHMARK(BM_memory_budget);

}  // namespace

BENCHMARK_MAIN();
