// Decode-step latency of the mini-engine's GPU runtime per mode and batch size (graph replay),
// Qwen3-30B-A3B shapes (L=48, H=2048, 32 q / 4 KV heads of 128, E=128 top-8, I=768,
// V=151936, bf16 weights, experts and KV) over P = min(devices, 2) GPUs, and the crossover.
//
// Names: decode/<mode>/P<P>/ctx<C>/B<B>. One step = every one of B sequences decodes one
// token at position C (each sequence has C tokens of random KV already); the time is the
// wall clock of gpu_runtime::step() (host inputs, upload, graph replay on every rank, the
// next tokens back), which is what a serving loop waits for. Weights are random (drawn on the
// device): routing is then close to uniform over experts, as in a well-balanced model.
// After the runs a summary prints, per batch, both modes and the faster one, and the
// crossover (the batch sizes at which the faster mode changes).
//
// Environment: MOEBIUS_BENCH_CONTEXT (default 1024), MOEBIUS_BENCH_MAX_BATCH (512),
// MOEBIUS_BENCH_LAYERS (48: fewer for a quick run), MOEBIUS_BENCH_SUMMARY (a file for the
// summary as JSON lines), MOEBIUS_BENCH_EXPERT_DTYPE (bf16, or fp8: e4m3 experts with 128 x 128
// block scales in the arena, dequantized per layer into a bf16 scratch of the touched experts
// before the GEMMs; names then end in /fp8, and the stage profile has a `dequant` stage). MINI_ENGINE_PROFILE=1: steps run eagerly with CUDA events between
// the stages, and each benchmark reports stage_<stage>_ms counters (device time per step of
// each stage summed over the layers: gpu_runtime::stage_times()); device_ms is always the
// step's device time (gpu_runtime::measured_step_s()).

#include <benchmark/benchmark.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <moebius/kv/page_table.hpp>
#include <string>
#include <vector>

#include <moebius/cuda/check.hpp>

#include "bench_decode_batch.hpp"
#include "gpu_runtime.hpp"

using namespace mini_engine;
using namespace mini_engine::gpu;
using moebius::parallel_mode;
using mini_engine::gpu::bench::env_int;
using mini_engine::gpu::bench::make_tables;

namespace {

struct bench_state {
  model_config config;
  int P = 1;
  int64_t context = 1024, max_batch = 512;
  std::unique_ptr<gpu_runtime> rt;
  std::map<std::pair<int, int64_t>, double> ms;  // (mode, batch) -> ms per step
};

bench_state& state() {
  static bench_state s;
  return s;
}

void bm_decode(benchmark::State& st, parallel_mode mode, int64_t B) {
  bench_state& s = state();
  const int64_t L = s.config.num_layers;
  const moebius::kv_state tables = make_tables(s.rt->kv(), mode, B, s.context + 1);
  const moebius::arena_cursor cursor{mode == parallel_mode::tp ? L : 0};
  std::vector<int32_t> tokens;
  const std::vector<step_item> items = bench::decode_items(B, s.context, s.config.vocab, tokens);
  const step_layout layout{&tables, cursor};
  for (int w = 0; w < 3; ++w) s.rt->step(layout, items);  // warm-up (first replay uploads)
  const int64_t replays0 = s.rt->graph_replays(), eager0 = s.rt->eager_steps();
  const int64_t reruns0 = s.rt->overflow_reruns();
  double total = 0, device_total = 0;
  std::map<std::string, double> stage_total;  // MINI_ENGINE_PROFILE=1: seconds per stage
  std::vector<std::string> stage_order;
  for (auto _ : st) {
    const auto t0 = std::chrono::steady_clock::now();
    auto next = s.rt->step(layout, items);
    benchmark::DoNotOptimize(next.data());
    const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    st.SetIterationTime(sec);
    total += sec;
    device_total += s.rt->measured_step_s();
    for (const auto& [name, sec_stage] : s.rt->stage_times()) {
      if (stage_total.find(name) == stage_total.end()) stage_order.push_back(name);
      stage_total[name] += sec_stage;
    }
  }
  const double iters = static_cast<double>(st.iterations());
  const double ms = 1e3 * total / iters;
  st.counters["device_ms"] = 1e3 * device_total / iters;
  st.counters["profiled"] = s.rt->profiling() ? 1 : 0;
  for (const std::string& name : stage_order)
    st.counters["stage_" + name + "_ms"] = 1e3 * stage_total[name] / iters;
  s.ms[{static_cast<int>(mode), B}] = ms;
  st.counters["ms_per_step"] = ms;
  st.counters["tokens_per_s"] = static_cast<double>(B) / (ms * 1e-3);
  st.counters["batch"] = static_cast<double>(B);
  st.counters["P"] = s.P;
  st.counters["context"] = static_cast<double>(s.context);
  st.counters["graph_replays"] = static_cast<double>(s.rt->graph_replays() - replays0);
  st.counters["eager_steps"] = static_cast<double>(s.rt->eager_steps() - eager0);
  st.counters["captures"] = static_cast<double>(s.rt->captures());
  st.counters["overflow_reruns"] = static_cast<double>(s.rt->overflow_reruns() - reruns0);
}

void print_summary() {
  bench_state& s = state();
  std::FILE* json = nullptr;
  if (const char* path = std::getenv("MOEBIUS_BENCH_SUMMARY"); path != nullptr && *path != '\0')
    json = std::fopen(path, "w");
  const char* experts = moebius::to_string(s.config.expert_dtype);
  std::printf(
      "\nDecode step, Qwen3-30B-A3B shapes (L=%lld), %s experts, P=%d, context %lld: ms per "
      "step\n",
      static_cast<long long>(s.config.num_layers), experts, s.P, static_cast<long long>(s.context));
  std::printf("%8s %10s %10s %8s %s\n", "batch", "TP", "EP", "EP/TP", "faster");
  int last = -1;
  std::string crossovers;
  for (int64_t B = 1; B <= s.max_batch; B *= 2) {
    auto tp = s.ms.find({static_cast<int>(parallel_mode::tp), B});
    auto ep = s.ms.find({static_cast<int>(parallel_mode::ep), B});
    if (tp == s.ms.end() || ep == s.ms.end()) continue;
    const int faster = ep->second < tp->second ? 1 : 0;
    std::printf("%8lld %10.3f %10.3f %8.3f %s\n", static_cast<long long>(B), tp->second, ep->second,
                ep->second / tp->second, faster ? "EP" : "TP");
    if (json != nullptr)
      std::fprintf(
          json,
          "{\"batch\": %lld, \"tp_ms\": %.6f, \"ep_ms\": %.6f, \"P\": %d, \"context\": %lld, "
          "\"experts\": \"%s\"}\n",
          static_cast<long long>(B), tp->second, ep->second, s.P,
          static_cast<long long>(s.context), experts);
    if (last >= 0 && faster != last) {
      // (appends, not operator+: GCC 12 warns falsely on `" " + std::string(...)`)
      crossovers.append(faster ? " TP->EP at batch " : " EP->TP at batch ");
      crossovers.append(std::to_string(B));
    }
    last = faster;
  }
  std::printf("crossover:%s\n", crossovers.empty() ? " none (one mode is faster at every batch)"
                                                   : crossovers.c_str());
  if (json != nullptr) {
    std::fprintf(json, "{\"crossover\": \"%s\"}\n", crossovers.c_str());
    std::fclose(json);
  }
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (!bench::prepare_gpu_bench()) return 0;
  int devices = 0;
  MOEBIUS_CUDA_CHECK(cudaGetDeviceCount(&devices));
  bench_state& s = state();
  s.config = bench::bench_model();
  s.P = std::min(devices, 2);
  s.context = env_int("MOEBIUS_BENCH_CONTEXT", 1024);
  s.max_batch = env_int("MOEBIUS_BENCH_MAX_BATCH", 512);
  if (const char* t = std::getenv("MOEBIUS_BENCH_EXPERT_DTYPE"); t != nullptr && *t != '\0') {
    const std::string name = t;
    if (name == "fp8") {
      s.config.expert_dtype = moebius::dtype::fp8_e4m3;
      s.config.fp8_block = 128;  // Qwen3-30B-A3B-FP8's blocks; I/P = 384 holds 3 of them at P=2
    } else if (name != "bf16") {
      std::printf("MOEBIUS_BENCH_EXPERT_DTYPE=%s: expected bf16 or fp8\n", t);
      return 1;
    }
  }
  std::vector<int64_t> buckets;
  for (int64_t b = 1; b <= s.max_batch; b *= 2) buckets.push_back(b);
  const gpu_runtime_options o = bench::decode_options(s.config, s.P, buckets, s.context);
  std::printf(
      "building the runtime: P=%d, %lld layers, %s experts, %lld EP pages per rank, %zu buckets "
      "x 2 modes\n",
      s.P, static_cast<long long>(s.config.num_layers),
      moebius::to_string(s.config.expert_dtype), static_cast<long long>(o.num_ep_pages),
      o.buckets.size());
  try {
    s.rt = std::make_unique<gpu_runtime>(s.config, uint64_t{12345}, o);
    s.rt->fill_kv_random(777);
  } catch (const std::exception& e) {
    std::printf("could not build the runtime: %s\n", e.what());
    return 1;
  }
  std::printf("captured %lld graphs; arena %.2f GiB per rank, KV pool %.2f GiB per rank\n",
              static_cast<long long>(s.rt->captures()),
              static_cast<double>(s.rt->arena().total_bytes()) / (1 << 30),
              static_cast<double>(s.rt->kv().pool_bytes()) / (1 << 30));
  for (parallel_mode m : {parallel_mode::tp, parallel_mode::ep})
    for (int64_t B = 1; B <= s.max_batch; B *= 2) {
      const std::string name = std::string("decode/") + moebius::to_string(m) + "/P" +
                               std::to_string(s.P) + "/ctx" + std::to_string(s.context) + "/B" +
                               std::to_string(B) +
                               (s.config.expert_dtype == moebius::dtype::fp8_e4m3 ? "/fp8" : "");
      benchmark::RegisterBenchmark(name.c_str(),
                                   [m, B](benchmark::State& st) { bm_decode(st, m, B); })
          ->UseManualTime()
          ->Unit(benchmark::kMillisecond)
          ->MinTime(0.2);
    }
  benchmark::RunSpecifiedBenchmarks();
  print_summary();
  benchmark::Shutdown();
  s.rt.reset();
  return 0;
}
