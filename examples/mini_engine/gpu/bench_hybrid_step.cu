// What a hybrid step costs: decode-step latency of the GPU runtime during a progressive switch
// (step_layout::hybrid(): layers below the cursor TP, the rest EP, the activation hand-off at
// the boundary), through per-layer CUDA graphs and eagerly, against whole-model CUDA graph
// replays of the same batch in either pure mode. Qwen3-30B-A3B shapes (bf16),
// P = min(devices, 2), random weights and KV.
//
// Names: <kind>/P<P>/ctx<C>/B<B>[/cursor<c>], one step = B sequences decoding one token at
// position C:
//   graph/tp, graph/ep          a static layout (TP tables and cursor L, or EP and 0): one
//                               whole-model graph replay
//   hybrid_graph/cursor<c>      a hybrid layout (TP and EP tables) at cursor c through the
//                               per-layer graphs: L graph launches, the hand-off eager between
//                               them; cursor 0 and L run every layer in one mode (no hand-off:
//                               the price of L launches instead of one alone)
//   hybrid_eager/cursor<c>      the same steps eagerly (gpu_runtime::set_hybrid_eager)
// Counters: ms_per_step (device time, CUDA events, gpu_runtime::measured_step_s), wall_ms
// (host wall clock of step()), eager_steps / graph_replays / hybrid_graph_steps (which path
// ran), overflow_reruns. The TP and EP tables of a hybrid step share the KV pool's bytes here
// (the values are random, only the time matters). A summary prints the graphs' count, capture
// time and memory and, per batch, each variant's ms and its ratio to the faster whole-model
// graph; MOEBIUS_BENCH_SUMMARY names a file for it as JSON lines (one "graphs" line, then one
// line per batch and cursor).
//
// Environment: MOEBIUS_BENCH_CONTEXT (1024), MOEBIUS_BENCH_LAYERS (48), MOEBIUS_BENCH_SUMMARY.

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

const std::vector<int64_t> batches = {1, 8, 64, 256};

struct bench_state {
  model_config config;
  int P = 1;
  int64_t context = 1024;
  std::unique_ptr<gpu_runtime> rt;
  std::map<std::pair<int64_t, std::string>, double> ms;  // (batch, variant) -> device ms
};

bench_state& state() {
  static bench_state s;
  return s;
}

// cursor < 0: a static layout in `mode` (graph replay); else a hybrid layout at that cursor,
// eagerly or through the per-layer graphs.
void bm_step(benchmark::State& st, int64_t B, parallel_mode mode, int64_t cursor, bool eager,
             const std::string& variant) {
  bench_state& s = state();
  s.rt->set_hybrid_eager(eager);
  const int64_t L = s.config.num_layers;
  const moebius::kv_state tp = make_tables(s.rt->kv(), parallel_mode::tp, B, s.context + 1);
  const moebius::kv_state ep = make_tables(s.rt->kv(), parallel_mode::ep, B, s.context + 1);
  std::vector<int32_t> tokens;
  const std::vector<step_item> items = bench::decode_items(B, s.context, s.config.vocab, tokens);
  const step_layout layout =
      cursor < 0 ? step_layout{mode == parallel_mode::tp ? &tp : &ep,
                               moebius::arena_cursor{mode == parallel_mode::tp ? L : 0}}
                 : step_layout::hybrid_of(tp, ep, moebius::arena_cursor{cursor});
  for (int w = 0; w < 3; ++w) s.rt->step(layout, items);  // warm-up
  const int64_t replays0 = s.rt->graph_replays(), eager0 = s.rt->eager_steps(),
                hybrid0 = s.rt->hybrid_graph_steps(), reruns0 = s.rt->overflow_reruns();
  double device = 0, wall = 0;
  for (auto _ : st) {
    const auto t0 = std::chrono::steady_clock::now();
    auto next = s.rt->step(layout, items);
    benchmark::DoNotOptimize(next.data());
    wall += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const double d = s.rt->measured_step_s();
    st.SetIterationTime(d);
    device += d;
  }
  const double n = static_cast<double>(st.iterations());
  const double ms = 1e3 * device / n;
  s.ms[{B, variant}] = ms;
  st.counters["ms_per_step"] = ms;
  st.counters["wall_ms"] = 1e3 * wall / n;
  st.counters["batch"] = static_cast<double>(B);
  st.counters["cursor"] = static_cast<double>(cursor < 0 ? (mode == parallel_mode::tp ? L : 0)
                                                         : cursor);
  st.counters["hybrid"] = cursor < 0 ? 0 : 1;
  st.counters["P"] = s.P;
  st.counters["layers"] = static_cast<double>(L);
  st.counters["context"] = static_cast<double>(s.context);
  st.counters["graph_replays"] = static_cast<double>(s.rt->graph_replays() - replays0);
  st.counters["eager_steps"] = static_cast<double>(s.rt->eager_steps() - eager0);
  st.counters["hybrid_graph_steps"] = static_cast<double>(s.rt->hybrid_graph_steps() - hybrid0);
  st.counters["overflow_reruns"] = static_cast<double>(s.rt->overflow_reruns() - reruns0);
}

std::vector<int64_t> cursors(int64_t L) {
  std::vector<int64_t> c = {0, L / 4, L / 2, 3 * L / 4, L};
  c.erase(std::unique(c.begin(), c.end()), c.end());
  return c;
}

void print_summary() {
  bench_state& s = state();
  std::FILE* json = nullptr;
  if (const char* path = std::getenv("MOEBIUS_BENCH_SUMMARY"); path != nullptr && *path != '\0')
    json = std::fopen(path, "w");
  const gpu_runtime::graph_stats g = s.rt->graph_statistics();
  std::printf(
      "\nGraphs at start-up: %lld whole-model (%.3f s, %.1f MiB), %lld per-layer "
      "(%.3f s, %.1f MiB; device memory: cudaMemGetInfo, the largest rank)\n",
      static_cast<long long>(g.whole_model), g.whole_model_s,
      static_cast<double>(g.whole_model_bytes) / (1 << 20), static_cast<long long>(g.per_layer),
      g.per_layer_s, static_cast<double>(g.per_layer_bytes) / (1 << 20));
  if (json != nullptr)
    std::fprintf(json,
                 "{\"graphs\": \"hybrid_step\", \"whole_model\": %lld, \"per_layer\": %lld, "
                 "\"whole_model_capture_s\": %.6f, \"per_layer_capture_s\": %.6f, "
                 "\"whole_model_bytes\": %lld, \"per_layer_bytes\": %lld, \"buckets\": %zu, "
                 "\"P\": %d, \"layers\": %lld}\n",
                 static_cast<long long>(g.whole_model), static_cast<long long>(g.per_layer),
                 g.whole_model_s, g.per_layer_s, static_cast<long long>(g.whole_model_bytes),
                 static_cast<long long>(g.per_layer_bytes), batches.size(), s.P,
                 static_cast<long long>(s.config.num_layers));
  std::printf(
      "Hybrid steps (per-layer graphs / eager) vs whole-model graph steps, Qwen3-30B-A3B "
      "shapes (L=%lld), P=%d, context %lld: device ms per step (x: over the faster "
      "whole-model graph)\n",
      static_cast<long long>(s.config.num_layers), s.P, static_cast<long long>(s.context));
  for (int64_t B : batches) {
    auto tp = s.ms.find({B, "graph/tp"}), ep = s.ms.find({B, "graph/ep"});
    if (tp == s.ms.end() || ep == s.ms.end()) continue;
    const double best = std::min(tp->second, ep->second);
    std::printf("B=%-4lld graph TP %.3f, graph EP %.3f\n", static_cast<long long>(B), tp->second,
                ep->second);
    for (int64_t c : cursors(s.config.num_layers)) {
      auto hg = s.ms.find({B, "hybrid_graph/cursor" + std::to_string(c)});
      auto he = s.ms.find({B, "hybrid_eager/cursor" + std::to_string(c)});
      if (hg == s.ms.end() || he == s.ms.end()) continue;
      std::printf("       cursor %-3lld graphs %.3f (x%.3f)  eager %.3f (x%.3f)\n",
                  static_cast<long long>(c), hg->second, hg->second / best, he->second,
                  he->second / best);
      if (json != nullptr)
        std::fprintf(json,
                     "{\"batch\": %lld, \"cursor\": %lld, \"hybrid_graph_ms\": %.6f, "
                     "\"hybrid_eager_ms\": %.6f, \"hybrid_ms\": %.6f, \"graph_tp_ms\": %.6f, "
                     "\"graph_ep_ms\": %.6f, \"hybrid_graph_x\": %.4f, \"hybrid_eager_x\": %.4f, "
                     "\"P\": %d, \"layers\": %lld, \"context\": %lld}\n",
                     static_cast<long long>(B), static_cast<long long>(c), hg->second, he->second,
                     he->second, tp->second, ep->second, hg->second / best, he->second / best, s.P,
                     static_cast<long long>(s.config.num_layers),
                     static_cast<long long>(s.context));
    }
  }
  if (json != nullptr) std::fclose(json);
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
  const gpu_runtime_options o = bench::decode_options(s.config, s.P, batches, s.context);
  try {
    s.rt = std::make_unique<gpu_runtime>(s.config, uint64_t{12345}, o);
    s.rt->fill_kv_random(777);
  } catch (const std::exception& e) {
    std::printf("could not build the runtime: %s\n", e.what());
    return 1;
  }
  std::printf("P=%d, %lld layers, captured %lld graphs (%lld whole-model, %lld per-layer)\n", s.P,
              static_cast<long long>(s.config.num_layers), static_cast<long long>(s.rt->captures()),
              static_cast<long long>(s.rt->graph_statistics().whole_model),
              static_cast<long long>(s.rt->graph_statistics().per_layer));
  if (!s.rt->hybrid_graphs_enabled())
    std::printf(
        "hybrid graphs are off (MINI_ENGINE_HYBRID_EAGER=1 or no graphs): the "
        "hybrid_graph variants run eagerly too\n");
  const std::string tail = "/P" + std::to_string(s.P) + "/ctx" + std::to_string(s.context);
  for (int64_t B : batches) {
    auto add = [&](const std::string& variant, parallel_mode m, int64_t cursor, bool eager) {
      const std::string name = variant + tail + "/B" + std::to_string(B);
      benchmark::RegisterBenchmark(name.c_str(),
                                   [B, m, cursor, eager, variant](benchmark::State& st) {
                                     bm_step(st, B, m, cursor, eager, variant);
                                   })
          ->UseManualTime()
          ->Unit(benchmark::kMillisecond)
          ->MinTime(0.1);
    };
    add("graph/tp", parallel_mode::tp, -1, false);
    add("graph/ep", parallel_mode::ep, -1, false);
    for (int64_t c : cursors(s.config.num_layers)) {
      add("hybrid_graph/cursor" + std::to_string(c), parallel_mode::ep, c, false);
      add("hybrid_eager/cursor" + std::to_string(c), parallel_mode::ep, c, true);
    }
  }
  benchmark::RunSpecifiedBenchmarks();
  print_summary();
  benchmark::Shutdown();
  s.rt.reset();
  return 0;
}
