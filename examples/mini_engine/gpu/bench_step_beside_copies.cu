// What copies beside a decode step cost the step: the slowdown curve a progressive switch is
// paced from (the serving clock prices steps during a switch with it, DESIGN.md §7).
//
// One GPU, P = 1, Qwen3-30B-A3B shapes (bf16 weights and KV), context 1024, graph replay. Before
// each step a device-to-device copy of V bytes is enqueued on a second stream of the same GPU,
// so that it runs while the step computes: a rank of a switch that sends V bytes and receives V
// reads and writes V of its own HBM, as this local copy does (it does not emulate the link).
//
// Names: beside/B<batch>/MiB<V>. Counters: step_ms (the step's device time, its CUDA events:
// gpu_runtime::measured_step_s), copy_ms (the copy's device time, events on its stream),
// copy_gb_per_s (V read + V written over copy_ms), and in the summary, per batch, the slowdown
// step_ms(V) / step_ms(0). The time reported is step_ms.
//
// Environment: MOEBIUS_BENCH_LAYERS (48), MOEBIUS_BENCH_CONTEXT (1024), MOEBIUS_BENCH_BATCHES
// (comma list, default 1,16,64,256), MOEBIUS_BENCH_COPY_MIB (comma list, default
// 0,256,1024,4096), MOEBIUS_BENCH_SUMMARY (a file for the summary as JSON lines).

#include <benchmark/benchmark.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include <moebius/cuda/check.hpp>
#include <moebius/kv/page_table.hpp>

#include "bench_decode_batch.hpp"
#include "gpu_runtime.hpp"

using namespace mini_engine;
using namespace mini_engine::gpu;
using mini_engine::gpu::bench::env_int;
using mini_engine::gpu::bench::make_tables;
using moebius::parallel_mode;

namespace {

std::vector<int64_t> env_sizes(const char* name, const std::vector<double>& fallback) {
  std::vector<int64_t> out;
  for (const double v : bench::env_list(name, fallback)) out.push_back(static_cast<int64_t>(v));
  return out;
}

struct bench_state {
  model_config config;
  int64_t context = 1024;
  std::unique_ptr<gpu_runtime> rt;
  void* src = nullptr;
  void* dst = nullptr;
  cudaStream_t copy_stream = nullptr;
  cudaEvent_t copy_begin = nullptr, copy_end = nullptr;
  std::map<std::pair<int64_t, int64_t>, double> step_ms, copy_ms;  // (batch, MiB)
};

bench_state& state() {
  static bench_state s;
  return s;
}

void bm_beside(benchmark::State& st, int64_t B, int64_t mib) {
  bench_state& s = state();
  const int64_t L = s.config.num_layers;
  const moebius::kv_state tables = make_tables(s.rt->kv(), parallel_mode::tp, B, s.context + 1);
  std::vector<int32_t> tokens;
  const std::vector<step_item> items = bench::decode_items(B, s.context, s.config.vocab, tokens);
  const step_layout layout{&tables, moebius::arena_cursor{L}};
  const size_t bytes = static_cast<size_t>(mib) << 20;
  for (int w = 0; w < 3; ++w) s.rt->step(layout, items);  // warm-up
  double step_total = 0, copy_total = 0;
  for (auto _ : st) {
    if (bytes > 0) {
      MOEBIUS_CUDA_CHECK(cudaEventRecord(s.copy_begin, s.copy_stream));
      MOEBIUS_CUDA_CHECK(cudaMemcpyAsync(s.dst, s.src, bytes, cudaMemcpyDeviceToDevice,
                                         s.copy_stream));
      MOEBIUS_CUDA_CHECK(cudaEventRecord(s.copy_end, s.copy_stream));
    }
    auto next = s.rt->step(layout, items);  // returns once the step's tokens are on the host
    benchmark::DoNotOptimize(next.data());
    float copy = 0;
    if (bytes > 0) {
      MOEBIUS_CUDA_CHECK(cudaEventSynchronize(s.copy_end));
      MOEBIUS_CUDA_CHECK(cudaEventElapsedTime(&copy, s.copy_begin, s.copy_end));
    }
    const double step_s = s.rt->measured_step_s();
    st.SetIterationTime(step_s);
    step_total += step_s * 1e3;
    copy_total += copy;
  }
  const double iters = static_cast<double>(st.iterations());
  s.step_ms[{B, mib}] = step_total / iters;
  s.copy_ms[{B, mib}] = copy_total / iters;
  st.counters["step_ms"] = step_total / iters;
  st.counters["copy_ms"] = copy_total / iters;
  st.counters["copy_gb_per_s"] =
      copy_total > 0 ? 2.0 * static_cast<double>(bytes) * iters / (copy_total * 1e-3) / 1e9 : 0;
  st.counters["batch"] = static_cast<double>(B);
  st.counters["copy_mib"] = static_cast<double>(mib);
  st.counters["context"] = static_cast<double>(s.context);
  st.counters["layers"] = static_cast<double>(L);
}

void print_summary(const std::vector<int64_t>& batches, const std::vector<int64_t>& mibs) {
  bench_state& s = state();
  std::FILE* json = nullptr;
  if (const char* path = std::getenv("MOEBIUS_BENCH_SUMMARY"); path != nullptr && *path != '\0')
    json = std::fopen(path, "w");
  std::printf("\nStep beside copies (one H200, P=1, L=%lld, context %lld): step ms alone, then "
              "step(V) / step(0) and copy ms\n",
              static_cast<long long>(s.config.num_layers), static_cast<long long>(s.context));
  for (const int64_t B : batches) {
    const auto alone = s.step_ms.find({B, 0});
    if (alone == s.step_ms.end()) continue;
    std::printf("B=%-4lld %8.3f ms", static_cast<long long>(B), alone->second);
    for (const int64_t mib : mibs) {
      if (mib == 0) continue;
      const auto it = s.step_ms.find({B, mib});
      if (it == s.step_ms.end()) continue;
      const double ratio = it->second / alone->second;
      std::printf("  +%lld MiB %.3fx (copy %.2f ms)", static_cast<long long>(mib), ratio,
                  s.copy_ms[{B, mib}]);
      if (json != nullptr)
        std::fprintf(json,
                     "{\"batch\": %lld, \"copy_mib\": %lld, \"step_ms\": %.6f, \"alone_ms\": "
                     "%.6f, \"slowdown\": %.6f, \"copy_ms\": %.6f, \"context\": %lld}\n",
                     static_cast<long long>(B), static_cast<long long>(mib), it->second,
                     alone->second, ratio, s.copy_ms[{B, mib}], static_cast<long long>(s.context));
    }
    std::printf("\n");
  }
  if (json != nullptr) std::fclose(json);
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (!bench::prepare_gpu_bench()) return 0;
  bench_state& s = state();
  s.config = bench::bench_model();
  s.context = env_int("MOEBIUS_BENCH_CONTEXT", 1024);
  const std::vector<int64_t> batches = env_sizes("MOEBIUS_BENCH_BATCHES", {1, 16, 64, 256});
  const std::vector<int64_t> mibs = env_sizes("MOEBIUS_BENCH_COPY_MIB", {0, 256, 1024, 4096});
  const int64_t max_mib = *std::max_element(mibs.begin(), mibs.end());

  const gpu_runtime_options o = bench::decode_options(s.config, 1, batches, s.context);
  try {
    s.rt = std::make_unique<gpu_runtime>(s.config, uint64_t{12345}, o);
    s.rt->fill_kv_random(777);
    const size_t bytes = static_cast<size_t>(std::max<int64_t>(max_mib, 1)) << 20;
    MOEBIUS_CUDA_CHECK(cudaMalloc(&s.src, bytes));
    MOEBIUS_CUDA_CHECK(cudaMalloc(&s.dst, bytes));
    MOEBIUS_CUDA_CHECK(cudaMemset(s.src, 0x5a, bytes));  // never time copies of untouched pages
    MOEBIUS_CUDA_CHECK(cudaMemset(s.dst, 0xa5, bytes));
    MOEBIUS_CUDA_CHECK(cudaStreamCreateWithFlags(&s.copy_stream, cudaStreamNonBlocking));
    MOEBIUS_CUDA_CHECK(cudaEventCreate(&s.copy_begin));
    MOEBIUS_CUDA_CHECK(cudaEventCreate(&s.copy_end));
    MOEBIUS_CUDA_CHECK(cudaDeviceSynchronize());
  } catch (const std::exception& e) {
    std::printf("could not set up: %s\n", e.what());
    return 1;
  }
  for (const int64_t B : batches)
    for (const int64_t mib : mibs) {
      const std::string name =
          "beside/B" + std::to_string(B) + "/MiB" + std::to_string(mib);
      benchmark::RegisterBenchmark(name.c_str(),
                                   [B, mib](benchmark::State& st) { bm_beside(st, B, mib); })
          ->UseManualTime()
          ->Unit(benchmark::kMillisecond)
          ->MinTime(0.3);
    }
  benchmark::RunSpecifiedBenchmarks();
  print_summary(batches, mibs);
  benchmark::Shutdown();
  s.rt.reset();
  (void)cudaFree(s.src);
  (void)cudaFree(s.dst);
  return 0;
}
