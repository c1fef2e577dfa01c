// The whole switch on real GPUs: the switcher (capacity check, expert weights layer by layer,
// KV pages in rounds, new tables) on cuda_peer_transport, with Qwen3-235B-A22B shapes
// (E=128, H=4096, I=1536, bf16; KV: 4 heads of 128, page 16, HND) at 25/50/90% KV occupancy,
// EP->TP and TP->EP. Each measured switch also feeds a cost model; the program ends by
// printing the model's predictions against the measurements.
//
// Benchmarks: switch_L<layers>_P<P>_occ<percent>/{ep_to_tp,tp_to_ep}
// Counters: ms (whole switch), weights_ms, kv_ms, plan_ms, capacity_ms, kv_rounds,
//   weights_GBps / kv_GBps (bytes leaving the busiest GPU per second of that stage),
//   weight_GB / kv_GB (bytes leaving the busiest GPU), predicted_ms (cost model, fitted on
//   the earlier measurements of this run), refused (1 when the capacity check said no).
// P = number of devices (at most 8); with one device P = 2 virtual ranks share it (names
// start with "virtual_"). Environment: MOEBIUS_BENCH_LAYERS (default: 24 at P <= 2 on real
// GPUs, 94 at P >= 8, 8 with virtual ranks), MOEBIUS_BENCH_KV_GIB (KV pool per GPU,
// default 16), MOEBIUS_BENCH_ITERS (default 3).
//   ./bench_switch --benchmark_format=json
#include <benchmark/benchmark.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "moebius/cuda/check.hpp"
#include "moebius/kv/kv_geometry.hpp"
#include "moebius/kv/page_table.hpp"
#include "moebius/layout/arena_geometry.hpp"
#include "moebius/policy/cost_model.hpp"
#include "moebius/switch/switcher.hpp"
#include "moebius/transport/cuda_peer_transport.hpp"

namespace {

using namespace moebius;

int64_t env_int(const char* name, int64_t fallback) {
  const char* v = std::getenv(name);
  return (v == nullptr || *v == '\0') ? fallback : std::strtoll(v, nullptr, 10);
}

// Fills `bytes` of device memory with a hash of the position: never zeros, never repeating.
__global__ void fill_kernel(uint4* p, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    uint32_t x = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    uint4 v;
    x ^= x >> 15; x *= 0x2c1b3c6du; v.x = x;
    x ^= x >> 12; x *= 0x297a2d39u; v.y = x;
    x ^= x >> 15; x *= 0x2c1b3c6du; v.z = x;
    x ^= x >> 12; x *= 0x297a2d39u; v.w = x ^ static_cast<uint32_t>(i >> 32);
    p[i] = v;
  }
}

struct bench_world {
  int num_ranks = 0;
  bool virtual_ranks = false;
  arena_geometry weights;
  kv_geometry kv;
  std::vector<void*> arenas, pools;
  std::unique_ptr<cuda_peer_transport> transport;
  cost_model model;
  std::string prefix;
};

bench_world& world() {
  static bench_world w;
  return w;
}

bool init_world() {
  bench_world& w = world();
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::fprintf(stderr, "bench_switch: no CUDA device; nothing to measure\n");
    return false;
  }
  w.virtual_ranks = devices == 1;
  w.num_ranks = w.virtual_ranks ? 2 : std::min(devices, 8);
  w.prefix = w.virtual_ranks ? "virtual_" : "";
  const int P = w.num_ranks;
  expert_shape shape = qwen3_235b_a22b();
  shape.num_layers =
      env_int("MOEBIUS_BENCH_LAYERS", w.virtual_ranks ? 8 : (P >= 8 ? 94 : (P >= 4 ? 48 : 24)));
  w.weights = make_arena_geometry(shape, P);
  const int64_t kv_bytes = env_int("MOEBIUS_BENCH_KV_GIB", w.virtual_ranks ? 4 : 16) << 30;
  kv_geometry probe = make_kv_geometry(shape.num_layers, 4, 128, 16, 1, P);
  w.kv = make_kv_geometry(shape.num_layers, 4, 128, 16, ep_pages_for_bytes(probe, kv_bytes), P);

  std::vector<rank_memory> ranks(static_cast<size_t>(P));
  for (int r = 0; r < P; ++r) {
    const int device = w.virtual_ranks ? 0 : r;
    MOEBIUS_CUDA_CHECK(cudaSetDevice(device));
    void* a = nullptr;
    void* k = nullptr;
    MOEBIUS_CUDA_CHECK(cudaMalloc(&a, static_cast<size_t>(w.weights.total_bytes())));
    MOEBIUS_CUDA_CHECK(cudaMalloc(&k, static_cast<size_t>(w.kv.pool_bytes())));
    fill_kernel<<<1024, 256>>>(static_cast<uint4*>(a), w.weights.total_bytes() / 16, 17u * r + 1);
    fill_kernel<<<1024, 256>>>(static_cast<uint4*>(k), w.kv.pool_bytes() / 16, 31u * r + 7);
    MOEBIUS_CUDA_CHECK(cudaGetLastError());
    w.arenas.push_back(a);
    w.pools.push_back(k);
    ranks[static_cast<size_t>(r)] =
        rank_memory::on_device(device, a, w.weights.total_bytes(), k, w.kv.pool_bytes());
  }
  for (int d = 0; d < (w.virtual_ranks ? 1 : P); ++d) {
    MOEBIUS_CUDA_CHECK(cudaSetDevice(d));
    MOEBIUS_CUDA_CHECK(cudaDeviceSynchronize());
  }
  w.transport = std::make_unique<cuda_peer_transport>(cuda_peer_transport::single_process(ranks));
  std::printf("bench_switch: P=%d%s, %lld layers, arena %.1f GB + KV pool %.1f GB per GPU, "
              "%lld EP pages of %lld B per tensor\n",
              P, w.virtual_ranks ? " (virtual ranks on one GPU)" : "",
              static_cast<long long>(shape.num_layers), w.weights.total_bytes() / 1e9,
              w.kv.pool_bytes() / 1e9, static_cast<long long>(w.kv.num_ep_pages),
              static_cast<long long>(w.kv.ep_page_bytes()));
  return true;
}

// EP tables with sequences of 1..32k tokens filling about `occupancy` of every rank's pool.
kv_state ep_tables(const kv_geometry& g, double occupancy, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<std::vector<kv_sequence>> tables(static_cast<size_t>(g.num_ranks));
  int64_t next_id = 1;
  for (int r = 0; r < g.num_ranks; ++r) {
    int64_t budget = static_cast<int64_t>(occupancy * static_cast<double>(g.num_ep_pages));
    int64_t next_page = 0;
    while (budget > 0) {
      const int64_t tokens = std::min<int64_t>(
          std::uniform_int_distribution<int64_t>(1, 32768)(rng), budget * g.page_size);
      kv_sequence s;
      s.seq_id = next_id++;
      s.num_tokens = tokens;
      s.last_page_len = (tokens - 1) % g.page_size + 1;
      s.prefill_cursor = tokens;
      for (int64_t i = 0; i < pages_for_tokens(tokens, g.page_size); ++i) s.pages.push_back(next_page++);
      budget -= s.num_pages();
      tables[static_cast<size_t>(r)].push_back(std::move(s));
    }
  }
  return make_kv_state(g, parallel_mode::ep, std::move(tables));
}

void BM_switch(benchmark::State& state, double occupancy, parallel_mode direction_to) {
  bench_world& w = world();
  switcher sw(w.weights, w.kv, *w.transport, ep_tables(w.kv, occupancy, 42), arena_cursor{0});
  const parallel_mode back = direction_to == parallel_mode::tp ? parallel_mode::ep : parallel_mode::tp;
  if (direction_to == parallel_mode::ep) {
    const switch_report r = sw.switch_to(parallel_mode::tp);
    if (r.outcome != switch_outcome::committed) {
      state.counters["refused"] = 1;
      state.SkipWithError(("setup switch to TP: " + std::string(to_string(r.outcome)) + " " + r.error).c_str());
      return;
    }
  }
  // Warm-up: one round trip (descriptor upload, peer mappings, first touch).
  switch_report last = sw.switch_to(direction_to);
  if (last.outcome != switch_outcome::committed) {
    state.counters["refused"] = last.outcome == switch_outcome::refused_capacity ? 1 : 0;
    state.SkipWithError((std::string(to_string(last.outcome)) + ": " + last.error).c_str());
    return;
  }
  if (sw.switch_to(back).outcome != switch_outcome::committed) {
    state.SkipWithError("warm-up switch back failed");
    return;
  }
  double predicted_ms = 0;
  for (auto _ : state) {
    predicted_ms = w.model.predict(last.workload).total_ms();
    last = sw.switch_to(direction_to);
    if (last.outcome != switch_outcome::committed) {
      state.SkipWithError((std::string(to_string(last.outcome)) + ": " + last.error).c_str());
      return;
    }
    state.SetIterationTime((last.weights_ms + last.kv_ms) / 1e3);
    w.model.update({last.workload, last.weights_ms + last.kv_ms});
    if (sw.switch_to(back).outcome != switch_outcome::committed) {
      state.SkipWithError("switch back failed");
      return;
    }
  }
  const switch_workload wl = last.workload;
  state.counters["ms"] = last.weights_ms + last.kv_ms;
  state.counters["total_ms"] = last.total_ms;
  state.counters["weights_ms"] = last.weights_ms;
  state.counters["kv_ms"] = last.kv_ms;
  state.counters["plan_ms"] = last.plan_ms;
  state.counters["capacity_ms"] = last.capacity_ms;
  state.counters["kv_rounds"] = static_cast<double>(last.kv_rounds);
  state.counters["weight_GB"] = static_cast<double>(wl.weight_bytes_per_rank) / 1e9;
  state.counters["kv_GB"] = static_cast<double>(wl.kv_bytes_per_rank) / 1e9;
  state.counters["weights_GBps"] = static_cast<double>(wl.weight_bytes_per_rank) / (last.weights_ms * 1e6);
  state.counters["kv_GBps"] =
      last.kv_ms > 0 ? static_cast<double>(wl.kv_bytes_per_rank) / (last.kv_ms * 1e6) : 0.0;
  state.counters["predicted_ms"] = predicted_ms;
  state.counters["refused"] = 0;
}

}  // namespace

int main(int argc, char** argv) {
  // With one GPU the benchmark runs virtual ranks (two streams each) on it.
  moebius::request_hardware_queues_for_virtual_ranks();
  benchmark::Initialize(&argc, argv);
  if (!init_world()) return 0;
  const bench_world& w = world();
  const int64_t iters = env_int("MOEBIUS_BENCH_ITERS", 3);
  for (double occ : {0.25, 0.5, 0.9}) {
    for (parallel_mode to : {parallel_mode::tp, parallel_mode::ep}) {
      const std::string name = w.prefix + "switch_L" + std::to_string(w.weights.shape.num_layers) +
                               "_P" + std::to_string(w.num_ranks) + "_occ" +
                               std::to_string(static_cast<int>(occ * 100)) +
                               (to == parallel_mode::tp ? "/ep_to_tp" : "/tp_to_ep");
      benchmark::RegisterBenchmark(name.c_str(), BM_switch, occ, to)
          ->Iterations(iters)
          ->UseManualTime()
          ->Unit(benchmark::kMillisecond);
    }
  }
  benchmark::RunSpecifiedBenchmarks();
  std::cout << "\ncost model after this run (fitted on every measured switch):\n";
  world().model.report(std::cout);
  benchmark::Shutdown();
  return 0;
}
