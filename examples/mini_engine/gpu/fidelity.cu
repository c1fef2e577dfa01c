// How far the simulated runtime is from a run it simulates, per metric (DESIGN.md §8): on one
// GPU, the GPU runtime at P = 1, or P = 2 virtual ranks (Qwen3-30B-A3B layer shapes with
// MOEBIUS_FIDELITY_LAYERS layers, default 8; bf16 dense, experts and KV; random weights drawn on
// the device)
//   1. measures its own decode-step curves per mode: the wall clock of a step as the serving
//      loop waits for it (inputs, upload, graph replay, tokens back), the median of 7 after 2
//      warm-ups, at contexts 128, 512, 2048 and batches 1..512: each CUDA-graph bucket and the
//      first batch past it (curve_batches: the padding as served); and its prefill points per
//      mode: the same wall clock of a step that prefills one chunk of 16, 32, ..., 512 tokens
//      alone (one sequence, its first chunk; run eagerly, as every step that prefills);
//   2. warms up (one eager step at every row count 1..512 per mode, as an engine does at start;
//      MOEBIUS_FIDELITY_WARM=0 skips it), then serves a bursty trace on the measured clock
//      (every step timed); at P = 2 with a
//      stop-the-world switch forced every 400 steps (the virtual ranks' copies over the GPU's
//      own memory, each switch timed);
//   2b. then measures its mixed steps per mode: the same wall clock of a step that decodes b
//      sequences (a rank's own in EP; b = 0, 1, 4, 16, 64, 128, 256, up to 256 sequences in
//      the deployment) at context 128 beside one chunk of 16, 64, 256 or 512 tokens (cut to the
//      rank's 512-token budget left beside b), the median of 5 after 2 warm-ups; should it fail,
//      the pricing that needs it is left out and the rest is printed; and a few probes beside
//      it (mixed_probes in the JSON, used by no clock): a grid point's tokens as a prompt's
//      tail (after earlier tokens) and split over several prompts' chunks;
//   3. the simulated runtime serves the same trace with the same scheduler, pool and forced
//      switches, each switch priced by the cost model over the link measured on 2x H200
//      (h200_params) and each step by the curves of 1 (curves_step_clock), priced five ways:
//        "sim": as the paper-scale experiments price theirs by default: a decode step at its
//          own batch (interpolated between the measured batches: the buckets and the first
//          batch past each, so the graph's padding is in; curves_clock_options::
//          replayed_decode), a prefill chunk as the extra rows of the buckets' curve at its
//          smallest context;
//        "sim_bucket_points": as "sim" with the decode steps between the buckets' points
//          alone (the padding left out), as every run before the points past the buckets;
//        "sim_buckets_prefill": a decode step at the runtime's CUDA-graph bucket (the batch
//          padded to it, as the replayed graph runs it), a prefill step's increment from the
//          prefill points measured alone;
//        "sim_buckets_mixed": at the buckets, a step that prefills priced whole from the
//          mixed-step grid (mixed_step_table.hpp);
//        "sim_rescaled": as "sim" with each kind of step (decode; prefill) times the measured
//          run's own steps' measured / priced by it: what remains once the step prices are
//          right on average;
//      and at P = 2 once more, "sim_switch_times": priced as "sim" with its switches forced at
//      the serving times the measured run switched at instead of the same step indices (the
//      simulated run takes other steps, so the same indices fall at other times and a burst
//      may be served in the other mode): what the switches' phase alone moves.
// Printed and written to $OUT/fidelity.json (or ./fidelity.json): each metric of the runs and
// each simulation's error (errors.<key>; error and error_buckets_prefill as before), separately:
// mean and p99 TTFT, mean and p99 TPOT, throughput, the run's length, and at P = 2 the
// switches' total time; and the measured run's own steps priced by each clock (priced /
// measured, by kind of step: decode, prefill filling the step's token budget, smaller prefill;
// at P = 2 also per mode, the EP steps by their recorded split over the ranks). What this does
// not check: collectives over NVLink (virtual ranks share one GPU's memory), and the paper's
// model and P.
// Environment: MOEBIUS_FIDELITY_LAYERS (8), MOEBIUS_FIDELITY_SEED (1: the trace),
// MOEBIUS_FIDELITY_P (1 or 2), MOEBIUS_FIDELITY_WARM (1: before the measured run, one eager
// step at every row count a step can have, as an engine warms up at start; 0: the run meets
// each row count cold, as every run before the warm-up was added did).

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include <moebius/transport/cuda_peer_transport.hpp>
#include <moebius/transport/dry_run_transport.hpp>

#include "bench_decode_batch.hpp"
#include "curves_step_clock.hpp"
#include "engine.hpp"
#include "fidelity_measure.hpp"
#include "gpu_runtime.hpp"
#include "own_steps.hpp"
#include "run_report.hpp"
#include "sim_runtime.hpp"
#include "step_curves.hpp"
#include "trace.hpp"

using namespace mini_engine;
using namespace mini_engine::fidelity;  // fidelity_measure.hpp
using moebius::parallel_mode;

namespace {

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
          {"steps", static_cast<int64_t>(r.steps.size())}, {"preemptions", r.preemptions},
          {"switches", s.switches}, {"switch_total_ms", s.switch_total_ms}};
}

// own_step_prices as fidelity.json has them: per kind (decode, prefill_full, prefill_small) and
// per mode (by_mode.EP / TP) steps, measured_ms, priced_ms and ratio, and the skipped count.
nlohmann::json to_json(const own_step_prices& x) {
  const char* kinds[] = {"decode", "prefill_full", "prefill_small"};
  const auto out = [](const own_step_sums& v) {
    return nlohmann::json{{"steps", v.steps},
                          {"measured_ms", v.measured_ms},
                          {"priced_ms", v.priced_ms},
                          {"ratio", v.ratio()}};
  };
  nlohmann::json j, modes;
  for (int k = 0; k < 3; ++k) {
    j[kinds[k]] = out(x.by_kind[k]);
    modes["EP"][kinds[k]] = out(x.by_mode[0][k]);
    modes["TP"][kinds[k]] = out(x.by_mode[1][k]);
  }
  j["by_mode"] = modes;
  j["skipped"] = x.skipped;
  return j;
}

}  // namespace

int main() {
  moebius::request_hardware_queues_for_virtual_ranks();  // before the first CUDA call
  if (!gpu::bench::prepare_gpu_bench()) return 0;
  model_config c = qwen3_30b_a3b();
  c.num_layers = gpu::bench::env_int("MOEBIUS_FIDELITY_LAYERS", 8);
  const uint64_t seed = static_cast<uint64_t>(gpu::bench::env_int("MOEBIUS_FIDELITY_SEED", 1));
  const int64_t P_env = gpu::bench::env_int("MOEBIUS_FIDELITY_P", 1);
  if (P_env != 1 && P_env != 2) {
    std::printf("MOEBIUS_FIDELITY_P=%s: 1 or 2\n", std::getenv("MOEBIUS_FIDELITY_P"));
    return 2;
  }
  const int P = static_cast<int>(P_env);
  const int64_t model_layers = qwen3_30b_a3b().num_layers;
  if (c.num_layers < 1 || c.num_layers > model_layers) {
    std::printf("MOEBIUS_FIDELITY_LAYERS=%s: 1 to %lld (the model's layers)\n",
                std::getenv("MOEBIUS_FIDELITY_LAYERS"), static_cast<long long>(model_layers));
    return 2;
  }
  if (gpu::bench::env_int("MOEBIUS_FIDELITY_SEED", 1) < 0) {
    std::printf("MOEBIUS_FIDELITY_SEED=%s: a number >= 0\n", std::getenv("MOEBIUS_FIDELITY_SEED"));
    return 2;
  }

  gpu::gpu_runtime_options o = gpu::options_from_env();
  o.num_ranks = P;  // P = 2 on one GPU: virtual ranks
  o.dense_dtype = moebius::dtype::bf16;
  o.hybrid_graphs = false;  // stop-the-world switches only: no hybrid step
  o.max_tokens = k_max_tokens;
  o.buckets = {1, 2, 4, 8, 16, 32, 64, 128, 256, 512};
  o.max_pages_per_seq = (k_longest + k_page_size - 1) / k_page_size;
  // The curves' largest point: k_curve_largest sequences of 2,049 tokens.
  o.num_ep_pages = k_curve_largest * ((2048 + 1 + k_page_size - 1) / k_page_size);
  std::printf("fidelity: GPU runtime P=%d%s, Qwen3-30B-A3B layer shapes, %lld layers, bf16\n",
              P, P > 1 ? " (virtual ranks on one GPU)" : "", static_cast<long long>(c.num_layers));
  gpu::gpu_runtime rt(c, uint64_t{12345}, o);
  rt.fill_kv_random(777);

  // 1. The curves, per mode (at P = 1 TP runs the same kernels on the same shapes: EP's points
  // stand for both, as step_curves needs both modes): at the graph buckets (`curves`: every
  // pricing's prefill rows, and the bucket pricings' decode steps), and with the first batch past
  // each bucket too (`replayed`: the decode steps of "sim", carrying the padding as served).
  std::vector<step_curve_point> points, bucket_points;
  for (const parallel_mode m : {parallel_mode::ep, parallel_mode::tp}) {
    if (P == 1 && m == parallel_mode::tp) break;
    for (const int64_t C : {128, 512, 2048}) {
      for (const auto [B, past_bucket] : curve_batches(m, P, o.buckets, k_curve_largest)) {
        const double ms = measure_step_ms(rt, m, B, C, c.vocab, c.num_layers);
        std::printf("  curve %s: context %5lld batch %4lld: %8.3f ms\n", moebius::to_string(m),
                    static_cast<long long>(C), static_cast<long long>(B), ms);
        std::vector<parallel_mode> as = {m};
        if (P == 1) as.push_back(parallel_mode::tp);  // EP's points stand for TP's
        for (const parallel_mode a : as) {
          points.push_back({a, C, B, ms});
          if (!past_bucket) bucket_points.push_back({a, C, B, ms});
        }
      }
    }
  }
  const step_curves curves(bucket_points, "the GPU runtime's own (measured here)");
  const step_curves replayed(points, "the GPU runtime's decode steps as replayed (measured here)");

  // 1b. The prefill points, per mode (at P = 1 EP's stand for TP's, as the curves').
  std::vector<prefill_point> prefill;
  nlohmann::json prefill_json = nlohmann::json::array();
  for (const parallel_mode m : {parallel_mode::ep, parallel_mode::tp}) {
    if (P == 1 && m == parallel_mode::tp) break;
    for (const int64_t T : k_prefill_chunks) {
      double device_ms = 0;
      const double ms = measure_prefill_ms(rt, m, T, c.vocab, c.num_layers, &device_ms);
      std::printf("  prefill %s: chunk %4lld tokens alone: %8.3f ms (device %8.3f ms)\n",
                  moebius::to_string(m), static_cast<long long>(T), ms, device_ms);
      prefill.push_back({m, T, ms});
      if (P == 1) prefill.push_back({parallel_mode::tp, T, ms});
      prefill_json.push_back({{"mode", moebius::to_string(m)}, {"tokens", T}, {"step_ms", ms},
                              {"device_ms", device_ms}});
    }
  }
  const prefill_table prefill_points(prefill, "the GPU runtime's prefill steps (measured here)");

  // 1c. A token count the eager path has not run yet: its first step against the same step
  // again (prefill chunks of counts no step above used). A diagnostic (cold_prefill in the
  // JSON), used by no clock: what a served step pays the first time it meets a shape.
  nlohmann::json cold_json = nlohmann::json::array();
  for (const int64_t T : {333, 177, 99}) {
    double device_ms = 0, first_ms = 0;
    const double ms = measure_prefill_ms(rt, parallel_mode::ep, T, c.vocab, c.num_layers,
                                         &device_ms, &first_ms);
    std::printf("  cold prefill EP: chunk %4lld tokens alone: first step %8.3f ms, then %8.3f ms "
                "(device %8.3f ms)\n",
                static_cast<long long>(T), first_ms, ms, device_ms);
    cold_json.push_back({{"tokens", T}, {"first_ms", first_ms}, {"step_ms", ms},
                         {"device_ms", device_ms}});
  }

  // 1d. The start-up warm-up (warm_eager_rows), unless MOEBIUS_FIDELITY_WARM=0.
  const bool warm = gpu::bench::env_int("MOEBIUS_FIDELITY_WARM", 1) != 0;
  if (warm) {
    const double s = warm_eager_rows(rt, P, c.vocab, c.num_layers);
    std::printf("  warm-up: one eager step at each of 1..%lld rows per mode, %.1f s\n",
                static_cast<long long>(k_max_tokens), s);
  }

  // 2. The GPU runtime serves the trace on the measured clock.
  const std::vector<request> trace = fidelity_trace(seed, c.vocab);
  engine_options eo;
  eo.record_rank_split = true;  // the measured run's steps are priced again below
  eo.scheduler.max_running = k_max_running;
  eo.scheduler.max_step_tokens = k_max_tokens;
  eo.scheduler.admission = admission_policy::known;
  eo.start_mode = parallel_mode::ep;
  if (P > 1) {
    eo.how = switching::forced;
    for (int64_t step = 400; step < 100000; step += 400) eo.forced_steps.push_back(step);
  }
  const measured_clock measured;
  run_result gpu_run;
  {
    moebius::cuda_peer_transport copies = moebius::cuda_peer_transport::single_process(rt.memory());
    engine e(rt, copies, rt.arena(), rt.kv(), measured, moebius::arena_cursor{0});
    gpu_run = e.run(trace, eo, "GPU runtime (measured)");
  }

  // 2b. The mixed-step grid, measured after the run (a failure here loses nothing above; the
  // third pricing is then left out and says why).
  nlohmann::json mixed_json = nlohmann::json::array();
  std::optional<mixed_step_table> mixed_grid;
  std::string mixed_error;
  try {
    const auto t0 = std::chrono::steady_clock::now();
    mixed_grid = measure_mixed_grid(rt, P, c.vocab, c.num_layers, mixed_json);
    std::printf("  mixed-step grid: %zu points in %.1f s\n", mixed_json.size(),
                std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  } catch (const std::exception& e) {
    mixed_error = e.what();
    std::printf("  the mixed-step grid could not be measured (%s): its pricing is left out\n",
                e.what());
  }
  nlohmann::json probes_json = nlohmann::json::array();
  try {
    measure_mixed_probes(rt, c.vocab, c.num_layers, probes_json);
  } catch (const std::exception& e) {
    std::printf("  the mixed-step probes could not be measured (%s)\n", e.what());
  }

  // 3. The simulated runtime on the same geometry, priced by the curves: as replayed, between
  // the buckets' points, at the runtime's graph buckets with the measured prefill points, and at
  // the buckets with the mixed-step grid (a step that prefills priced whole from it; the
  // prefill points where it has no grid).
  priced_model m;
  m.num_layers = c.num_layers;
  m.context_scale = 1;
  m.hidden = c.hidden;
  m.num_q_heads = c.num_q_heads;
  m.num_kv_heads = c.num_kv_heads;
  m.head_dim = c.head_dim;
  m.num_experts = c.num_experts;
  m.top_k = c.top_k;
  m.intermediate = c.intermediate;
  m.vocab = c.vocab;
  const h200_step_model model(m, h200_params{}, P, kv_bytes_per_token(rt.kv()));
  // "sim": the decode steps on the curves measured as replayed; "sim_bucket_points": as every
  // run before them, between the buckets' points (the padding left out).
  curves_clock_options as_replayed;
  as_replayed.replayed_decode = replayed;
  const curves_step_clock priced(curves, model, as_replayed);
  const curves_step_clock priced_between(curves, model);
  curves_clock_options with;
  with.graph_buckets = o.buckets;  // the runtime's own (gpu_runtime_options::buckets)
  with.prefill = prefill_points;
  const curves_step_clock priced_new(curves, model, with);
  std::optional<curves_step_clock> priced_mixed;
  if (mixed_grid) {
    curves_clock_options mixed = with;
    mixed.mixed = *mixed_grid;
    priced_mixed.emplace(curves, model, mixed);
  }
  const auto simulate = [&](const step_clock& clock, const char* label,
                            const engine_options& opts) {
    sim_runtime sim(rt.arena(), rt.kv(), static_cast<int32_t>(c.vocab));
    moebius::dry_run_transport dry(P, sim.spaces());
    engine s(sim, dry, rt.arena(), rt.kv(), clock, moebius::arena_cursor{0});
    return s.run(trace, opts, label);
  };
  // The pricings, each a simulated run: key in fidelity.json, what it prices, its clock.
  struct pricing {
    std::string key, what;
    const step_clock* clock = nullptr;
    run_result run;
    run_summary summary;
  };
  // One per clock (the measured run's own steps are priced by each below), then the runs that
  // share or derive from one.
  std::vector<pricing> clock_list;
  clock_list.push_back({"sim", "as replayed", &priced, {}, {}});
  clock_list.push_back({"sim_bucket_points", "between the buckets", &priced_between, {}, {}});
  clock_list.push_back({"sim_buckets_prefill", "buckets + prefill alone", &priced_new, {}, {}});
  if (priced_mixed)
    clock_list.push_back({"sim_buckets_mixed", "buckets + mixed grid", &*priced_mixed, {}, {}});
  std::vector<pricing> wanted = clock_list;
  // As before with each kind of step rescaled to the measured run's own (rescaled_clock): what
  // is left of each metric's error once the step prices are right on average.
  double decode_factor = 1, prefill_factor = 1;
  std::optional<rescaled_clock> rescaled;
  try {
    const own_step_prices own = price_own_steps(gpu_run, priced, P, k_max_tokens);
    decode_factor = own.decode_factor();
    prefill_factor = own.prefill_factor();
    rescaled.emplace(priced, decode_factor, prefill_factor);
    std::printf("  rescaled: sim x %.4f a decode step, x %.4f a step that prefills\n",
                decode_factor, prefill_factor);
    wanted.push_back({"sim_rescaled", "sim, rescaled", &*rescaled, {}, {}});
  } catch (const std::exception& e) {
    std::printf("  the rescaled pricing is left out: %s\n", e.what());
  }
  // At P = 2 once more: the forced switches at the measured run's switch times instead of its
  // step indices (the simulated run takes other steps, so the same indices fall at other times
  // and a burst may be served in the other mode), priced as "sim": what the phase of the
  // switches alone moves.
  engine_options at_times = eo;
  at_times.forced_steps.clear();
  for (const switch_record& x : gpu_run.switches)
    if (x.step > 0) at_times.forced_at_s.push_back(x.start_s);  // not a failed first switch
  if (P > 1 && !at_times.forced_at_s.empty())
    wanted.push_back({"sim_switch_times", "sim, switches at the measured times", &priced,
                      {}, {}});
  // Each run on its own: one that fails is left out, and says why, the others kept.
  std::vector<pricing> runs;
  nlohmann::json run_errors;
  for (pricing& x : wanted) {
    try {
      x.run = simulate(*x.clock, ("simulated (" + x.what + ")").c_str(),
                       x.key == "sim_switch_times" ? at_times : eo);
      x.summary = summarize(x.run);
      runs.push_back(std::move(x));
    } catch (const std::exception& e) {
      std::printf("  the simulated run %s (%s) failed: %s\n", x.key.c_str(), x.what.c_str(),
                  e.what());
      run_errors[x.key] = e.what();
    }
  }

  const run_summary a = summarize(gpu_run);
  nlohmann::json pricing_names, errors;
  for (const pricing& x : runs) pricing_names[x.key] = x.clock->name();
  nlohmann::json j = {{"layers", c.num_layers},
                      {"P", P},
                      {"requests", static_cast<int64_t>(trace.size())},
                      {"seed", seed},
                      {"curves", points.size() / 2},
                      {"graph_buckets", o.buckets},
                      {"prefill_points", prefill_json},
                      {"mixed_grid", mixed_json},
                      {"mixed_probes", probes_json},
                      {"cold_prefill", cold_json},
                      {"warm_eager_rows", warm},
                      {"rescaled_factors", {{"decode", decode_factor}, {"prefill", prefill_factor}}},
                      {"pricing", pricing_names},
                      {"gpu", metrics(a, gpu_run)}};
  if (!mixed_error.empty()) j["mixed_grid_error"] = mixed_error;
  if (!run_errors.is_null()) j["run_errors"] = run_errors;
  for (const pricing& x : runs) j[x.key] = metrics(x.summary, x.run);
  std::printf("\n  %d requests; metric: GPU runtime (measured), then each simulated run and its "
              "error:",
              static_cast<int>(trace.size()));
  for (const pricing& x : runs) std::printf(" %s (%s);", x.key.c_str(), x.what.c_str());
  std::printf("\n");
  for (const auto& [name, g_json] : j["gpu"].items()) {
    const double g = g_json.get<double>();
    std::printf("  %-16s %12.3f", name.c_str(), g);
    for (const pricing& x : runs) {
      const double v = j[x.key][name].get<double>();
      const double e = g != 0 ? (v - g) / g : 0;
      errors[x.key][name] = e;
      std::printf(" %12.3f %+7.1f%%", v, 100 * e);
    }
    std::printf("\n");
  }
  // The errors, each pricing's under its own key; the two first also where earlier files had
  // them.
  j["errors"] = errors;
  for (const auto& [key, name] : {std::pair<const char*, const char*>{"sim", "error"},
                                  {"sim_buckets_prefill", "error_buckets_prefill"},
                                  {"sim_buckets_mixed", "error_buckets_mixed"}}) {
    if (errors.contains(key)) j[name] = errors[key];
  }
  const char* out = std::getenv("OUT");
  const std::string dir = out != nullptr && *out != '\0' ? out : ".";
  const std::string path = dir + "/fidelity.json";
  std::ofstream csv(dir + "/fidelity_steps.csv");
  write_steps_csv(csv, gpu_run);
  for (const pricing& x : runs) {
    const std::string name = x.key == "sim" ? "/fidelity_sim_steps.csv"
                                            : "/fidelity_" + x.key + "_steps.csv";
    std::ofstream f(dir + name);
    write_steps_csv(f, x.run);
  }
  // Each committed switch: measured against priced (the same switch in each run when they
  // committed the same ones).
  const auto committed = [](const run_result& r) {
    std::vector<double> ms;
    for (const switch_record& x : r.switches)
      if (x.outcome == moebius::switch_outcome::committed) ms.push_back(x.clock_ms);
    return ms;
  };
  const std::vector<double> gpu_switch = committed(gpu_run);
  if (!gpu_switch.empty() && !runs.empty()) {
    const std::vector<double> sim_switch = committed(runs.front().run);
    std::printf("  switches committed: %zu measured;", gpu_switch.size());
    for (const pricing& x : runs) std::printf(" %zu %s;", committed(x.run).size(), x.key.c_str());
    std::printf(" ms each, measured / priced (%s):", runs.front().key.c_str());
    for (size_t i = 0; i < std::min(gpu_switch.size(), sim_switch.size()); ++i)
      std::printf(" %.1f/%.1f", gpu_switch[i], sim_switch[i]);
    std::printf("\n");
    j["switches_each"] = {{"measured_ms", gpu_switch}};
    for (const pricing& x : runs) j["switches_each"]["priced_ms_" + x.key] = committed(x.run);
  }
  std::ofstream(path) << j.dump(2) << "\n";
  // The measured run's own steps priced by each clock: where the error comes from. A
  // diagnostic: should it fail, the runs' results above are written already.
  try {
    // One per clock, whether its simulated run succeeded or not.
    for (const pricing& x : clock_list)
      j["own_steps"][x.key] = to_json(price_own_steps(gpu_run, *x.clock, P, k_max_tokens));
    std::printf("  the measured run's own steps, priced / measured (summed):");
    for (const pricing& x : clock_list) std::printf(" %s /", x.what.c_str());
    std::printf("\n");
    for (const char* kind : {"decode", "prefill_full", "prefill_small"}) {
      const nlohmann::json& x = j["own_steps"]["sim"][kind];
      std::printf("    %-14s %6lld steps, %10.1f ms measured:", kind,
                  static_cast<long long>(x["steps"].get<int64_t>()),
                  x["measured_ms"].get<double>());
      for (const pricing& p : clock_list)
        std::printf(" %.3f", j["own_steps"][p.key][kind]["ratio"].get<double>());
      std::printf("\n");
    }
    if (P > 1) {
      for (const char* mode : {"EP", "TP"}) {
        for (const char* kind : {"decode", "prefill_full", "prefill_small"}) {
          const nlohmann::json& x = j["own_steps"]["sim"]["by_mode"][mode][kind];
          std::printf("    %s %-11s %6lld steps, %10.1f ms measured:", mode, kind,
                      static_cast<long long>(x["steps"].get<int64_t>()),
                      x["measured_ms"].get<double>());
          for (const pricing& p : clock_list)
            std::printf(" %.3f", j["own_steps"][p.key]["by_mode"][mode][kind]["ratio"].get<double>());
          std::printf("\n");
        }
      }
    }
    if (j["own_steps"]["sim"]["skipped"].get<int64_t>() > 0)
      std::printf("    (%lld EP steps not priced: at P = %d their rank split was not recorded)\n",
                  static_cast<long long>(j["own_steps"]["sim"]["skipped"].get<int64_t>()), P);
    std::ofstream(path) << j.dump(2) << "\n";
  } catch (const std::exception& e) {
    std::printf("  the measured run's own steps could not be priced: %s\n", e.what());
  }
  std::printf("  wrote %s\n", path.c_str());
  return 0;
}
