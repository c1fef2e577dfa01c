// The whole switch path under a model on one GPU: steady decode at a batch, then a
// stop-the-world switch and progressive switches at several sizes per step, EP -> TP and back,
// with weights and KV moved by cuda_peer_transport over the runtime's own memory.
//
// Qwen3-30B-A3B shapes (bf16), P virtual ranks on one GPU (MOEBIUS_BENCH_P, default 2): every
// rank's steps and copies share that GPU's HBM and SMs (the contention each of P GPUs would see),
// never NVLink. Context 1024. What a step costs is measured with the runtime's CUDA events (the
// step) and the host wall clock around the wait for an advance's copies (the serving loop waits
// for each advance before its step: the copies do not yet run beside the step, so each step
// during a progressive switch pays its copies in full; that is what this measures).
//
// Per batch, one line of JSON (MOEBIUS_BENCH_SUMMARY) and a table: normal step (median), the
// stop-the-world stall (switch_to's time), and per progressive size: layers per step, steps,
// max and p99 of (copy wait + step), the switch's length in ms, tokens served during it.
//
// Environment: MOEBIUS_BENCH_P (2), MOEBIUS_BENCH_LAYERS (48), MOEBIUS_BENCH_BATCHES (1,16,64),
// MOEBIUS_BENCH_GIB_PER_STEP (0.25,0.5,1,2), MOEBIUS_BENCH_SUMMARY.

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include <moebius/switch/switcher.hpp>
#include <moebius/transport/cuda_peer_transport.hpp>

#include "bench_decode_batch.hpp"
#include "gpu_runtime.hpp"

using namespace mini_engine;
using namespace mini_engine::gpu;
using mini_engine::gpu::bench::env_int;
using moebius::parallel_mode;

namespace {

using host_clock = std::chrono::steady_clock;

double percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t rank = static_cast<size_t>(std::ceil(q * static_cast<double>(v.size())));
  return v[std::max<size_t>(rank, 1) - 1];
}

// B sequences decoding one token a step, from position `context` on.
struct decode_load {
  std::vector<int32_t> tokens;
  std::vector<step_item> items;

  decode_load(int64_t B, int64_t context, int64_t vocab)
      : items(bench::decode_items(B, context, vocab, tokens)) {}
  void advance() {
    for (step_item& it : items) ++it.start_position;
  }
};

struct progressive_result {
  const char* direction = "";
  double gib_per_step = 0;
  int64_t layers_per_step = 0, steps = 0, tokens = 0;
  double max_ms = 0, p99_ms = 0, length_ms = 0;
  std::string outcome;
};

}  // namespace

int main() {
  moebius::request_hardware_queues_for_virtual_ranks();  // before the first CUDA call
  if (!bench::prepare_gpu_bench()) return 0;
  const int P = static_cast<int>(env_int("MOEBIUS_BENCH_P", 2));
  const model_config config = bench::bench_model();
  const int64_t context = 1024;
  std::vector<int64_t> batches;
  for (const double b : bench::env_list("MOEBIUS_BENCH_BATCHES", {1, 16, 64}))
    batches.push_back(static_cast<int64_t>(b));
  const std::vector<double> sizes = bench::env_list("MOEBIUS_BENCH_GIB_PER_STEP", {0.25, 0.5, 1, 2});
  // Steps run until the switch ends: each sequence needs room for them all.
  const int64_t max_steps = 64 + config.num_layers * 4;
  gpu_runtime_options o = bench::decode_options(config, P, batches, context + max_steps);
  o.placement = rank_placement::virtual_ranks;
  std::FILE* json = nullptr;
  if (const char* path = std::getenv("MOEBIUS_BENCH_SUMMARY"); path != nullptr && *path != '\0')
    json = std::fopen(path, "w");
  try {
    gpu_runtime rt(config, uint64_t{12345}, o);
    rt.fill_kv_random(777);
    moebius::cuda_peer_transport tr = moebius::cuda_peer_transport::single_process(rt.memory());
    std::printf("Qwen3-30B-A3B shapes, L=%lld, P=%d virtual ranks on one GPU, context %lld\n",
                static_cast<long long>(config.num_layers), P, static_cast<long long>(context));
    for (const int64_t B : batches) {
      // Tables of B sequences with room for every step of the run, in EP.
      const int64_t tokens = context + max_steps;
      const moebius::kv_state ep_tables = bench::make_tables(rt.kv(), parallel_mode::ep, B, tokens);
      moebius::switcher sw(rt.arena(), rt.kv(), tr, ep_tables, moebius::arena_cursor{0});
      decode_load load(B, context, config.vocab);
      auto run_step = [&](const step_layout& layout) {
        rt.step(layout, load.items);
        load.advance();
        return rt.measured_step_s() * 1e3;
      };
      // Normal steps in EP.
      std::vector<double> normal;
      for (int i = 0; i < 8; ++i)
        normal.push_back(run_step(step_layout{&sw.kv_tables(), sw.cursor()}));
      const double normal_ms = percentile(normal, 0.5);
      // Stop the world: EP -> TP, then back.
      const moebius::switch_report to_tp = sw.switch_to(parallel_mode::tp);
      run_step(step_layout{&sw.kv_tables(), sw.cursor()});
      const moebius::switch_report to_ep = sw.switch_to(parallel_mode::ep);
      std::printf("B=%lld: normal %.2f ms; stop-the-world EP->TP %.1f ms (%s), TP->EP %.1f ms (%s)\n",
                  static_cast<long long>(B), normal_ms, to_tp.total_ms,
                  moebius::to_string(to_tp.outcome), to_ep.total_ms,
                  moebius::to_string(to_ep.outcome));
      std::vector<progressive_result> results;
      for (const double gib : sizes) {
        for (const parallel_mode target : {parallel_mode::tp, parallel_mode::ep}) {
          const moebius::layer_bytes lb = sw.layer_bytes_of(target);
          progressive_result pr;
          pr.direction = target == parallel_mode::tp ? "EP->TP" : "TP->EP";
          pr.gib_per_step = gib;
          pr.layers_per_step = std::max<int64_t>(
              1, static_cast<int64_t>(gib * double(int64_t{1} << 30) /
                                      static_cast<double>(std::max<int64_t>(lb.busiest(), 1))));
          moebius::progressive_switch session = sw.begin(target);
          if (!session.open()) {
            pr.outcome = moebius::to_string(session.report().outcome);
            results.push_back(pr);
            continue;
          }
          std::vector<double> during;
          const auto t0 = host_clock::now();
          while (session.layers_remaining() > 0) {
            const auto ta = host_clock::now();
            session.advance(pr.layers_per_step);
            moebius::progress_state state = session.poll();
            while (state == moebius::progress_state::in_flight) state = session.poll();
            const double copy_ms =
                std::chrono::duration<double, std::milli>(host_clock::now() - ta).count();
            if (state == moebius::progress_state::ended) break;
            during.push_back(copy_ms + run_step(step_layout::during(session.view())));
            pr.tokens += B;
          }
          const moebius::switch_report r = session.finish();
          pr.length_ms = std::chrono::duration<double, std::milli>(host_clock::now() - t0).count();
          pr.steps = static_cast<int64_t>(during.size());
          pr.max_ms = during.empty() ? 0 : *std::max_element(during.begin(), during.end());
          pr.p99_ms = percentile(during, 0.99);
          pr.outcome = moebius::to_string(r.outcome);
          results.push_back(pr);
        }
      }
      for (const progressive_result& pr : results) {
        std::printf("  progressive %s %.2f GiB/step: %lld layers/step, %lld steps, max %.2f ms, p99 "
                    "%.2f ms (normal %.2f), length %.1f ms, %lld tokens served, %s\n",
                    pr.direction, pr.gib_per_step, static_cast<long long>(pr.layers_per_step),
                    static_cast<long long>(pr.steps), pr.max_ms, pr.p99_ms, normal_ms,
                    pr.length_ms, static_cast<long long>(pr.tokens), pr.outcome.c_str());
        if (json != nullptr)
          std::fprintf(json,
                       "{\"direction\": \"%s\", \"P\": %d, \"batch\": %lld, \"context\": %lld, \"normal_ms\": %.4f, "
                       "\"stw_to_tp_ms\": %.3f, \"stw_to_ep_ms\": %.3f, \"gib_per_step\": %.3f, "
                       "\"layers_per_step\": %lld, \"steps\": %lld, \"max_ms\": %.4f, \"p99_ms\": "
                       "%.4f, \"length_ms\": %.3f, \"tokens\": %lld, \"outcome\": \"%s\"}\n",
                       pr.direction, P, static_cast<long long>(B), static_cast<long long>(context),
                       normal_ms,
                       to_tp.total_ms, to_ep.total_ms, pr.gib_per_step,
                       static_cast<long long>(pr.layers_per_step),
                       static_cast<long long>(pr.steps), pr.max_ms, pr.p99_ms, pr.length_ms,
                       static_cast<long long>(pr.tokens), pr.outcome.c_str());
      }
    }
  } catch (const std::exception& e) {
    std::printf("failed: %s\n", e.what());
    if (json != nullptr) std::fclose(json);
    return 1;
  }
  if (json != nullptr) std::fclose(json);
  return 0;
}
