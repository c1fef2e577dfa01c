// The whole switch path under a model on one GPU: steady decode at a batch, then a
// stop-the-world switch and progressive switches at several sizes per step, EP -> TP and back,
// with weights and KV moved by cuda_peer_transport over the runtime's own memory, at two KV
// occupancies.
//
// Qwen3-30B-A3B shapes (bf16), P virtual ranks on one GPU (MOEBIUS_BENCH_P, default 2): every
// rank's steps and copies share that GPU's HBM and SMs (the contention each of P GPUs would see),
// never NVLink. Context 1024. A progressive switch runs as the serving loop runs it: each
// advance is enqueued beside a decode step (step_beside.hpp: the copies run on the
// transport's streams while the step computes, each layer's copy waiting for the step's event
// of the layer copy_waits names), and the loop waits for the copies once the step is done. A
// step during the switch costs its device time (CUDA events, waits included) plus that wait
// (the part of the copies that outlasted the step): both are reported.
//
// KV occupancy: the pool holds the largest batch at 90%; at each batch and occupancy, idle
// sequences of the same context (they hold KV and move with the switch, and decode nothing) top
// the live KV up to that share of the pool. Combinations the pool cannot hold are skipped.
//
// Per batch and occupancy, one line of JSON per progressive run (MOEBIUS_BENCH_SUMMARY) and a
// table: normal step (median), the stop-the-world stall (switch_to's time), and per
// progressive size: layers per step, steps, max and p99 of the step during the switch (device
// time + the wait for the copies), the switch's length in ms, tokens served during it.
//
// Environment: MOEBIUS_BENCH_P (2), MOEBIUS_BENCH_LAYERS (48), MOEBIUS_BENCH_BATCHES
// (1,16,64,256), MOEBIUS_BENCH_OCCUPANCY (0.25,0.9), MOEBIUS_BENCH_GIB_PER_STEP
// (0.25,0.5,1,2), MOEBIUS_BENCH_KV_BLOCKS (0: the KV kernel's grid is the SM count per rank),
// MOEBIUS_BENCH_SUMMARY.

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
#include "step_beside.hpp"

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
  double max_device_ms = 0, max_wait_ms = 0;  // the parts of the longest step
  std::string outcome;
};

double ms_since(host_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(host_clock::now() - t0).count();
}

}  // namespace

int main() {
  moebius::request_hardware_queues_for_virtual_ranks();  // before the first CUDA call
  if (!bench::prepare_gpu_bench()) return 0;
  const int P = static_cast<int>(env_int("MOEBIUS_BENCH_P", 2));
  const model_config config = bench::bench_model();
  const int64_t context = 1024;
  std::vector<int64_t> batches;
  for (const double b : bench::env_list("MOEBIUS_BENCH_BATCHES", {1, 16, 64, 256}))
    batches.push_back(static_cast<int64_t>(b));
  const std::vector<double> occupancies = bench::env_list("MOEBIUS_BENCH_OCCUPANCY", {0.25, 0.9});
  const std::vector<double> sizes = bench::env_list("MOEBIUS_BENCH_GIB_PER_STEP", {0.25, 0.5, 1, 2});
  // Steps of one (batch, occupancy): 8 normal, 2 around the stop-the-world switches, and at
  // most one per layer for each progressive switch; each sequence needs room for them all.
  const int64_t max_steps =
      16 + 2 * config.num_layers * static_cast<int64_t>(sizes.size());
  const int64_t tokens = context + max_steps;
  gpu_runtime_options o = bench::decode_options(config, P, batches, tokens);
  o.placement = rank_placement::virtual_ranks;
  // The pool: the largest batch at 90% (EP pages per rank; TP holds the same bytes).
  const int64_t pages_per_seq = moebius::pages_for_tokens(tokens, config.page_size);
  const int64_t max_batch = *std::max_element(batches.begin(), batches.end());
  o.num_ep_pages = static_cast<int64_t>(
      std::ceil(static_cast<double>((max_batch + P - 1) / P * pages_per_seq) / 0.9));
  // Sequences the pool holds in EP (per rank: num_ep_pages / pages_per_seq).
  const int64_t capacity = o.num_ep_pages / pages_per_seq * P;
  std::FILE* json = nullptr;
  if (const char* path = std::getenv("MOEBIUS_BENCH_SUMMARY"); path != nullptr && *path != '\0')
    json = std::fopen(path, "w");
  try {
    gpu_runtime rt(config, uint64_t{12345}, o);
    rt.fill_kv_random(777);
    // MOEBIUS_BENCH_KV_BLOCKS: the fused KV kernel's grid per rank (0: the SM count), the SMs
    // the copies may take from the step beside them.
    moebius::cuda_peer_config tc;
    tc.sm_kernel_blocks = static_cast<int>(env_int("MOEBIUS_BENCH_KV_BLOCKS", 0));
    moebius::cuda_peer_transport tr =
        moebius::cuda_peer_transport::single_process(rt.memory(), tc);
    std::printf("Qwen3-30B-A3B shapes, L=%lld, P=%d virtual ranks on one GPU, context %lld, "
                "pool %lld EP pages per rank (%lld sequences), KV kernel grid %d per rank\n",
                static_cast<long long>(config.num_layers), P, static_cast<long long>(context),
                static_cast<long long>(o.num_ep_pages), static_cast<long long>(capacity),
                tc.sm_kernel_blocks);
    for (const double occupancy : occupancies) {
      for (const int64_t B : batches) {
        // B decoding sequences, then idle ones up to the occupancy (seq ids B..): all in EP.
        const int64_t live = static_cast<int64_t>(std::llround(occupancy * static_cast<double>(capacity)));
        if (live < B) {
          std::printf("B=%lld at %.0f%% occupancy: the pool holds %lld sequences; skipped\n",
                      static_cast<long long>(B), occupancy * 100, static_cast<long long>(live));
          continue;
        }
        const moebius::kv_state ep_tables =
            bench::make_tables(rt.kv(), parallel_mode::ep, live, tokens);
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
        std::printf("B=%lld, occupancy %.0f%% (%lld sequences hold KV): normal %.2f ms; "
                    "stop-the-world EP->TP %.1f ms (%s), TP->EP %.1f ms (%s)\n",
                    static_cast<long long>(B), occupancy * 100, static_cast<long long>(live),
                    normal_ms, to_tp.total_ms, moebius::to_string(to_tp.outcome), to_ep.total_ms,
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
            auto wait_for_copies = [&] { session.wait(); };
            while (session.open() && session.layers_remaining() > 0) {
              const auto advance = [&](const moebius::step_layer_events* events) {
                session.advance(pr.layers_per_step, {}, events);
              };
              const auto settle = [&]() -> step_layout {
                wait_for_copies();
                return session.open() ? step_layout::during(session.view())
                                      : step_layout{&sw.kv_tables(), sw.cursor()};
              };
              const step_beside_result sb = step_beside(
                  rt, step_layout::during(session.view()), load.items, advance, settle);
              load.advance();
              const double device_ms = sb.step.measured_s * 1e3;
              const auto tw = host_clock::now();
              wait_for_copies();
              const double wait_ms = ms_since(tw);
              if (device_ms + wait_ms > pr.max_ms) {
                pr.max_ms = device_ms + wait_ms;
                pr.max_device_ms = device_ms;
                pr.max_wait_ms = wait_ms;
              }
              during.push_back(device_ms + wait_ms);
              pr.tokens += B;
            }
            const moebius::switch_report r = session.finish();
            pr.length_ms = ms_since(t0);
            pr.steps = static_cast<int64_t>(during.size());
            pr.p99_ms = percentile(during, 0.99);
            pr.outcome = moebius::to_string(r.outcome);
            results.push_back(pr);
          }
        }
        for (const progressive_result& pr : results) {
          std::printf("  progressive %s %.2f GiB/step: %lld layers/step, %lld steps, max %.2f ms "
                      "(device %.2f + copy wait %.2f), p99 %.2f ms (normal %.2f), length %.1f ms, "
                      "%lld tokens served, %s\n",
                      pr.direction, pr.gib_per_step, static_cast<long long>(pr.layers_per_step),
                      static_cast<long long>(pr.steps), pr.max_ms, pr.max_device_ms,
                      pr.max_wait_ms, pr.p99_ms, normal_ms, pr.length_ms,
                      static_cast<long long>(pr.tokens), pr.outcome.c_str());
          if (json != nullptr)
            std::fprintf(json,
                         "{\"direction\": \"%s\", \"P\": %d, \"kv_blocks\": %d, \"batch\": %lld, \"context\": %lld, "
                         "\"occupancy\": %.2f, \"sequences_with_kv\": %lld, \"normal_ms\": %.4f, "
                         "\"stw_to_tp_ms\": %.3f, \"stw_to_ep_ms\": %.3f, \"gib_per_step\": %.3f, "
                         "\"layers_per_step\": %lld, \"steps\": %lld, \"max_ms\": %.4f, "
                         "\"max_device_ms\": %.4f, \"max_copy_wait_ms\": %.4f, \"p99_ms\": "
                         "%.4f, \"length_ms\": %.3f, \"tokens\": %lld, \"outcome\": \"%s\"}\n",
                         pr.direction, P, tc.sm_kernel_blocks, static_cast<long long>(B),
                         static_cast<long long>(context), occupancy, static_cast<long long>(live), normal_ms, to_tp.total_ms,
                         to_ep.total_ms, pr.gib_per_step, static_cast<long long>(pr.layers_per_step),
                         static_cast<long long>(pr.steps), pr.max_ms, pr.max_device_ms,
                         pr.max_wait_ms, pr.p99_ms, pr.length_ms,
                         static_cast<long long>(pr.tokens), pr.outcome.c_str());
        }
        if (json != nullptr) std::fflush(json);
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
