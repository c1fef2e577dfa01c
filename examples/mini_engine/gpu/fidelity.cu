// How far the simulated runtime is from a run it simulates, per metric (DESIGN.md §8): on one
// GPU, the GPU runtime at P = 1 (Qwen3-30B-A3B layer shapes with MOEBIUS_FIDELITY_LAYERS layers,
// default 8; bf16 dense, experts and KV; random weights drawn on the device)
//   1. measures its own decode-step curves: the wall clock of a step as the serving loop waits
//      for it (inputs, upload, graph replay, tokens back), the median of 7 after 2 warm-ups, at
//      batches 1..512 and contexts 128, 512, 2048;
//   2. serves a bursty trace on the measured clock (every step timed);
//   3. the simulated runtime serves the same trace with the same scheduler and pool, each step
//      priced by the curves of 1 (curves_step_clock: a prefill chunk as the curve's extra rows
//      at its smallest context, as the paper-scale experiments price it).
// Printed and written to $OUT/fidelity.json (or ./fidelity.json): each metric of both runs and
// the simulation's error, separately: mean and p99 TTFT, mean and p99 TPOT, throughput and the
// run's length. What this does not check: collectives and switches (P = 1 has neither; the
// paper-scale curves price collectives by a link model), and the paper's model and P.
// Environment: MOEBIUS_FIDELITY_LAYERS (8), MOEBIUS_FIDELITY_SEED (1: the trace).

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include <moebius/transport/dry_run_transport.hpp>

#include "bench_decode_batch.hpp"
#include "engine.hpp"
#include "gpu_runtime.hpp"
#include "run_report.hpp"
#include "sim_runtime.hpp"
#include "step_curves.hpp"
#include "trace.hpp"

using namespace mini_engine;
using moebius::parallel_mode;

namespace {

constexpr int64_t k_max_tokens = 512;     // tokens a step (decode and prefill chunks)
constexpr int64_t k_max_running = 256;    // sequences at once
constexpr int64_t k_page_size = 16;       // the runtime's (kv geometry)
constexpr int64_t k_longest = 2560;       // tokens of the longest request (prompt + output)

// The decode step's wall clock at batch B and context C, median of 7 after 2 warm-ups.
double measure_step_ms(gpu::gpu_runtime& rt, int64_t B, int64_t C, int64_t vocab) {
  const moebius::kv_state tables = gpu::bench::make_tables(rt.kv(), parallel_mode::ep, B, C + 1);
  std::vector<int32_t> tokens;
  const std::vector<step_item> items = gpu::bench::decode_items(B, C, vocab, tokens);
  const step_layout layout{&tables, moebius::arena_cursor{0}};
  for (int w = 0; w < 2; ++w) rt.step(layout, items);
  std::vector<double> ms;
  for (int i = 0; i < 7; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    rt.step(layout, items);
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(ms.begin(), ms.end());
  return ms[3];
}

// A bursty trace the P = 1 runtime crosses its batch range on: quiet at 4 requests/s, bursts of
// 1 s at 150/s, prompts 32-1024 and outputs 16-512 tokens (within k_longest).
std::vector<request> fidelity_trace(uint64_t seed, int64_t vocab) {
  bursty_options t;
  t.duration_s = 24;
  t.quiet_s = 5;
  t.quiet_rate = 4;
  t.burst_s = 1;
  t.burst_rate = 150;
  t.prompt_min = 32;
  t.prompt_max = 1024;
  t.output_min = 16;
  t.output_max = 512;
  t.vocab = static_cast<int32_t>(std::min<int64_t>(vocab, 1 << 20));
  return bursty_trace(seed, t);
}

nlohmann::json metrics(const run_summary& s, const run_result& r) {
  return {{"mean_ttft_ms", s.mean_ttft_ms}, {"p99_ttft_ms", s.p99_ttft_ms},
          {"mean_tpot_ms", s.mean_tpot_ms}, {"p99_tpot_ms", s.p99_tpot_ms},
          {"tokens_per_s", s.tokens_per_s}, {"end_s", r.end_s},
          {"steps", static_cast<int64_t>(r.steps.size())}, {"preemptions", r.preemptions}};
}

}  // namespace

int main() {
  if (!gpu::bench::prepare_gpu_bench()) return 0;
  model_config c = qwen3_30b_a3b();
  c.num_layers = gpu::bench::env_int("MOEBIUS_FIDELITY_LAYERS", 8);
  const uint64_t seed = static_cast<uint64_t>(gpu::bench::env_int("MOEBIUS_FIDELITY_SEED", 1));

  gpu::gpu_runtime_options o = gpu::options_from_env();
  o.num_ranks = 1;
  o.dense_dtype = moebius::dtype::bf16;
  o.hybrid_graphs = false;  // P = 1: no switch, no hybrid step
  o.max_tokens = k_max_tokens;
  o.buckets = {1, 2, 4, 8, 16, 32, 64, 128, 256, 512};
  o.max_pages_per_seq = (k_longest + k_page_size - 1) / k_page_size;
  // The curves' largest point: 512 sequences of 2,049 tokens.
  o.num_ep_pages = 512 * ((2048 + 1 + k_page_size - 1) / k_page_size);
  std::printf("fidelity: GPU runtime P=1, Qwen3-30B-A3B layer shapes, %lld layers, bf16\n",
              static_cast<long long>(c.num_layers));
  gpu::gpu_runtime rt(c, uint64_t{12345}, o);
  rt.fill_kv_random(777);

  // 1. The curves (EP; at P = 1 TP runs the same kernels on the same shapes: given the same
  // points, as step_curves needs both modes).
  std::vector<step_curve_point> points;
  for (const int64_t C : {128, 512, 2048}) {
    for (int64_t B = 1; B <= 512; B *= 2) {
      const double ms = measure_step_ms(rt, B, C, c.vocab);
      std::printf("  curve: context %5lld batch %4lld: %8.3f ms\n", static_cast<long long>(C),
                  static_cast<long long>(B), ms);
      points.push_back({parallel_mode::ep, C, B, ms});
      points.push_back({parallel_mode::tp, C, B, ms});
    }
  }
  step_curves curves(points, "the GPU runtime's own (P=1, measured here)");

  // 2. The GPU runtime serves the trace on the measured clock.
  const std::vector<request> trace = fidelity_trace(seed, c.vocab);
  engine_options eo;
  eo.scheduler.max_running = k_max_running;
  eo.scheduler.max_step_tokens = k_max_tokens;
  eo.scheduler.admission = admission_policy::known;
  eo.start_mode = parallel_mode::ep;
  sim_runtime sim(rt.arena(), rt.kv(), static_cast<int32_t>(c.vocab));
  moebius::dry_run_transport no_switches(1, sim.spaces());
  const measured_clock measured;
  run_result gpu_run;
  {
    engine e(rt, no_switches, rt.arena(), rt.kv(), measured, moebius::arena_cursor{0});
    gpu_run = e.run(trace, eo, "GPU runtime (measured)");
  }

  // 3. The simulated runtime on the same geometry, priced by the curves.
  priced_model m;
  m.num_layers = c.num_layers;
  m.context_scale = 1;
  const moebius::kv_geometry& g = rt.kv();
  const h200_step_model model(m, h200_params{}, 1, g.num_tensors() * g.heads_per_ep_page() * g.head_bytes());
  const curves_step_clock priced(curves, model);
  moebius::dry_run_transport dry(1, sim.spaces());
  engine s(sim, dry, rt.arena(), rt.kv(), priced, moebius::arena_cursor{0});
  const run_result sim_run = s.run(trace, eo, "simulated (priced by the curves)");

  const run_summary a = summarize(gpu_run), b = summarize(sim_run);
  nlohmann::json j = {{"layers", c.num_layers},
                      {"requests", static_cast<int64_t>(trace.size())},
                      {"seed", seed},
                      {"curves", points.size() / 2},
                      {"gpu", metrics(a, gpu_run)},
                      {"sim", metrics(b, sim_run)}};
  std::printf("\n  %d requests; metric: GPU runtime (measured) / simulated (priced) / error\n",
              static_cast<int>(trace.size()));
  nlohmann::json err;
  for (const auto& [name, x] : j["gpu"].items()) {
    const double g = x.get<double>(), v = j["sim"][name].get<double>();
    const double e = g != 0 ? (v - g) / g : 0;
    err[name] = e;
    std::printf("  %-14s %12.3f %12.3f %+8.1f%%\n", name.c_str(), g, v, 100 * e);
  }
  j["error"] = err;
  const char* out = std::getenv("OUT");
  const std::string path = std::string(out != nullptr && *out != '\0' ? out : ".") + "/fidelity.json";
  std::ofstream(path) << j.dump(2) << "\n";
  std::ofstream csv(std::string(out != nullptr && *out != '\0' ? out : ".") + "/fidelity_steps.csv");
  write_steps_csv(csv, gpu_run);
  std::ofstream csv2(std::string(out != nullptr && *out != '\0' ? out : ".") + "/fidelity_sim_steps.csv");
  write_steps_csv(csv2, sim_run);
  std::printf("  wrote %s\n", path.c_str());
  return 0;
}
