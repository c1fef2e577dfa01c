// Reshard bandwidth on real GPUs: how fast each transport switches a stack of Qwen3-235B-A22B
// MoE layers between EP and TP, against the copy-engine ceiling of the links.
//
// Every figure is a rate of the bytes that leave each GPU (traffic_of(plan).max_bytes_sent():
// (P-1)/P of a rank's expert bytes per switch), so transports and the ceiling compare directly.
// Benchmarks (names: <config>/<direction>/<method>):
//   qwen3_<dtype>_L<layers>_P<P>/{ep_to_tp,tp_to_ep}/<method>   E=128, H=4096, I=1536
//   sweep_E<E>_bf16_L<layers>_P<P>/ep_to_tp/<method>            per-layer size sweep (vary E)
//   enqueue_qwen3_94L_<dtype>_P<P>/ep_to_tp/{nccl,cuda_peer_automatic}: host enqueue time
// Methods:
//   copy_engine_ceiling  cudaMemcpyPeerAsync of the same byte count, contiguous, every rank to
//                        every peer at once (both directions at P=2): what the links allow
//   nccl                 nccl_transport (pack -> grouped ncclSend/ncclRecv -> unpack)
//   cuda_peer_copy_engine / cuda_peer_sm_kernel / cuda_peer_automatic
//                        cuda_peer_transport with engine_policy copy_engine / sm_kernel /
//                        automatic (the whole transport)
// Counters: ms_per_switch, GBps_per_gpu (1e9 B/s leaving each GPU), bytes_per_gpu, layers,
// layer_MiB_per_rank, P, virtual_ranks; enqueue benchmarks add enqueue_ms and
// enqueue_ms_94_layers.
//
// P = number of devices (at most 8). With one device P = 2 virtual ranks share it (no NCCL;
// the "ceiling" is then a local copy): names start with "virtual_" so nobody mistakes them
// for link figures.
// Environment: MOEBIUS_BENCH_LAYERS (default 24, clamped to what fits in 85% of free memory),
// MOEBIUS_BENCH_ITERS (timed switches per benchmark, default 5), MOEBIUS_BENCH_SWEEP=0 skips
// the sweep, MOEBIUS_BENCH_ENQUEUE=0 skips the 94-layer enqueue benchmarks.

#include <benchmark/benchmark.h>
#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "gpu_bench_world.hpp"
#include "moebius/cuda/check.hpp"
#include "moebius/cuda/nccl_check.hpp"
#include "moebius/layout/arena_geometry.hpp"
#include "moebius/plan/weight_plan.hpp"
#include "moebius/transport/cuda_peer_transport.hpp"
#include "moebius/transport/nccl_transport.hpp"

namespace {

using namespace moebius;
using clock_type = std::chrono::steady_clock;

constexpr double k_gb = 1e9;
constexpr double k_mib = 1024.0 * 1024.0;

using bench::budget_per_rank;
using bench::env_int;
using bench::fill_random_kernel;
using bench::sync_all;
using bench::world;

// --- one configuration: geometry, plans, memory, transports ------------------------------------

enum class method { ceiling, nccl, peer_copy_engine, peer_sm_kernel, peer_automatic };

const char* to_string(method m) {
  switch (m) {
    case method::ceiling:
      return "copy_engine_ceiling";
    case method::nccl:
      return "nccl";
    case method::peer_copy_engine:
      return "cuda_peer_copy_engine";
    case method::peer_sm_kernel:
      return "cuda_peer_sm_kernel";
    case method::peer_automatic:
      return "cuda_peer_automatic";
  }
  return "?";
}

constexpr engine_policy policy_of(method m) {
  return m == method::peer_copy_engine ? engine_policy::copy_engine
         : m == method::peer_sm_kernel ? engine_policy::sm_kernel
                                       : engine_policy::automatic;
}

struct config {
  std::string name;
  expert_shape shape;  // num_layers already fitted to memory
};

struct context {
  std::string name;
  arena_geometry geometry;
  plan forward;               // EP -> TP, all layers
  plan back;                  // TP -> EP
  int64_t bytes_per_gpu = 0;  // leaving each GPU per switch (the larger of both directions)
  std::vector<void*> arena;
  std::vector<void*> staging;
  std::vector<int64_t> staging_bytes;
  std::unique_ptr<nccl_transport> nccl;
  std::unique_ptr<cuda_peer_transport> peer[3];
  std::shared_ptr<const cuda_prepared_plan> prepared[3][2];
  std::vector<cudaStream_t> ceiling_streams;  // [src * P + dst]

  context() = default;
  context(const context&) = delete;
  context& operator=(const context&) = delete;
  ~context() { release(); }

  void release() {
    for (auto& pp : prepared) {
      pp[0].reset();
      pp[1].reset();
    }
    for (auto& p : peer) p.reset();
    nccl.reset();
    bench::gpu_world& w = world();
    // A failed use() may leave fewer staging buffers than arenas.
    for (size_t r = 0; r < arena.size(); ++r) {
      (void)cudaSetDevice(w.device_of[r]);
      (void)cudaFree(arena[r]);
      if (r < staging.size() && staging[r] != nullptr) (void)cudaFree(staging[r]);
    }
    staging_bytes.clear();
    for (cudaStream_t s : ceiling_streams) (void)cudaStreamDestroy(s);
    arena.clear();
    staging.clear();
    ceiling_streams.clear();
    name.clear();
  }
};

context& current() {
  static context c;
  return c;
}

// Staging bytes nccl_transport needs per rank for a whole switch of `g` (same for every layer
// count, so a one-layer plan answers it).
int64_t staging_per_rank(const arena_geometry& g) {
  int64_t most = 0;
  const plan f = plan_weight_switch(g, arena_cursor{0}, arena_cursor{g.shape.num_layers});
  const plan b = plan_weight_switch(g, arena_cursor{g.shape.num_layers}, arena_cursor{0});
  for (int r = 0; r < f.num_ranks; ++r) {
    most = std::max(
        {most, nccl_transport::workspace_bytes(f, r), nccl_transport::workspace_bytes(b, r)});
  }
  return most;
}

// Largest layer count <= wanted whose arena (+ NCCL staging) fits one rank's budget; 0 when
// not even one layer fits.
int64_t fit_layers(expert_shape shape, int64_t wanted) {
  const int P = world().num_ranks;
  shape.num_layers = 1;
  const arena_geometry one = make_arena_geometry(shape, P);
  const int64_t ws = world().virtual_ranks ? 0 : staging_per_rank(one);
  const int64_t budget = budget_per_rank() - ws;
  const int64_t slots = budget / one.slot_bytes;
  return std::clamp<int64_t>(slots - 1, 0, wanted);
}

context& use(const config& cfg) {
  context& c = current();
  if (c.name == cfg.name) return c;
  c.release();
  bench::gpu_world& w = world();
  const int P = w.num_ranks;
  c.geometry = make_arena_geometry(cfg.shape, P);
  c.forward = plan_weight_switch(c.geometry, arena_cursor{0}, arena_cursor{cfg.shape.num_layers});
  c.back = plan_weight_switch(c.geometry, arena_cursor{cfg.shape.num_layers}, arena_cursor{0});
  c.bytes_per_gpu =
      std::max(traffic_of(c.forward).max_bytes_sent(), traffic_of(c.back).max_bytes_sent());

  std::vector<rank_memory> peer_ranks;
  std::vector<nccl_rank_comm> nccl_comms;
  for (int r = 0; r < P; ++r) {
    const int dev = w.device_of[static_cast<size_t>(r)];
    MOEBIUS_CUDA_CHECK(cudaSetDevice(dev));
    void* a = nullptr;
    MOEBIUS_CUDA_CHECK(cudaMalloc(&a, static_cast<size_t>(c.geometry.total_bytes())));
    c.arena.push_back(a);
    const int64_t words = c.geometry.total_bytes() / 8;
    fill_random_kernel<<<1024, 256>>>(static_cast<uint64_t*>(a), words,
                                      0x5EED0000ull + static_cast<uint64_t>(r));
    MOEBIUS_CUDA_CHECK(cudaGetLastError());

    int64_t ws = 0;
    void* s = nullptr;
    if (!w.virtual_ranks) {
      ws = std::max(nccl_transport::workspace_bytes(c.forward, r),
                    nccl_transport::workspace_bytes(c.back, r));
      if (ws > 0) MOEBIUS_CUDA_CHECK(cudaMalloc(&s, static_cast<size_t>(ws)));
    }
    c.staging.push_back(s);
    c.staging_bytes.push_back(ws);

    peer_ranks.push_back(rank_memory::on_device(dev, a, c.geometry.total_bytes()));
    if (!w.virtual_ranks) nccl_comms.push_back({w.comms[static_cast<size_t>(r)], s, ws});
  }
  for (int src = 0; src < P; ++src) {
    for (int dst = 0; dst < P; ++dst) {
      cudaStream_t s = nullptr;
      MOEBIUS_CUDA_CHECK(cudaSetDevice(w.device_of[static_cast<size_t>(src)]));
      MOEBIUS_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
      c.ceiling_streams.push_back(s);
    }
  }
  if (!w.virtual_ranks) {
    c.nccl = std::make_unique<nccl_transport>(peer_ranks, nccl_comms);
    c.nccl->prepare(c.forward);
    c.nccl->prepare(c.back);
  }
  for (int k = 0; k < 3; ++k) {
    cuda_peer_config pc;
    pc.engine = policy_of(static_cast<method>(k + 2));
    pc.max_cached_plans = 0;  // we hold the prepared plans ourselves
    c.peer[k] =
        std::make_unique<cuda_peer_transport>(cuda_peer_transport::single_process(peer_ranks, pc));
    c.prepared[k][0] = c.peer[k]->prepare_plan(c.forward);
    c.prepared[k][1] = c.peer[k]->prepare_plan(c.back);
  }
  sync_all();
  c.name = cfg.name;
  return c;
}

// Moves bytes_per_gpu from every rank, split evenly over its peers, with contiguous
// cudaMemcpyPeerAsync calls all in flight at once. Source: the first half of the sender's
// arena; destination: the sender's share of the second half of the receiver's arena (chunks
// repeat over it: the bytes are garbage anyway).
void run_ceiling(context& c) {
  bench::gpu_world& w = world();
  const int P = w.num_ranks;
  const int64_t half = c.geometry.total_bytes() / 2 / 256 * 256;
  const int64_t region = half / (P - 1) / 256 * 256;
  const int64_t per_peer = c.bytes_per_gpu / (P - 1);
  for (int src = 0; src < P; ++src) {
    MOEBIUS_CUDA_CHECK(cudaSetDevice(w.device_of[static_cast<size_t>(src)]));
    for (int dst = 0; dst < P; ++dst) {
      if (dst == src) continue;
      const int slot = (src - dst + P) % P - 1;  // 0 .. P-2: the sender's share at dst
      cudaStream_t s = c.ceiling_streams[static_cast<size_t>(src * P + dst)];
      const auto* from = static_cast<const std::byte*>(c.arena[static_cast<size_t>(src)]);
      auto* to = static_cast<std::byte*>(c.arena[static_cast<size_t>(dst)]) + half +
                 static_cast<int64_t>(slot) * region;
      for (int64_t done = 0; done < per_peer;) {
        const int64_t n = std::min(region, per_peer - done);
        MOEBIUS_CUDA_CHECK(cudaMemcpyPeerAsync(to, w.device_of[static_cast<size_t>(dst)], from,
                                               w.device_of[static_cast<size_t>(src)],
                                               static_cast<size_t>(n), s));
        done += n;
      }
    }
  }
  for (size_t i = 0; i < c.ceiling_streams.size(); ++i) {
    if (i / static_cast<size_t>(P) == i % static_cast<size_t>(P)) continue;
    MOEBIUS_CUDA_CHECK(cudaSetDevice(w.device_of[i / static_cast<size_t>(P)]));
    MOEBIUS_CUDA_CHECK(cudaStreamSynchronize(c.ceiling_streams[i]));
  }
}

// Runs one switch (dir 0: EP->TP, 1: TP->EP) and returns when it is complete on every rank.
void run_switch(context& c, method m, int dir) {
  const plan& p = dir == 0 ? c.forward : c.back;
  switch (m) {
    case method::ceiling:
      run_ceiling(c);
      return;
    case method::nccl:
      c.nccl->enqueue(p, bench::world_streams());
      c.nccl->wait();
      return;
    default: {
      const int k = static_cast<int>(m) - 2;
      c.peer[k]->execute(c.prepared[k][dir]);
      return;
    }
  }
}

double seconds_of(const std::function<void()>& f) {
  const auto t0 = clock_type::now();
  f();
  return std::chrono::duration<double>(clock_type::now() - t0).count();
}

void set_common_counters(benchmark::State& st, const context& c, double total_seconds,
                         int64_t switches) {
  bench::gpu_world& w = world();
  const double per = total_seconds / static_cast<double>(std::max<int64_t>(switches, 1));
  st.counters["ms_per_switch"] = per * 1e3;
  st.counters["GBps_per_gpu"] = static_cast<double>(c.bytes_per_gpu) / per / k_gb;
  st.counters["bytes_per_gpu"] = static_cast<double>(c.bytes_per_gpu);
  st.counters["layers"] = static_cast<double>(c.geometry.shape.num_layers);
  st.counters["layer_MiB_per_rank"] =
      static_cast<double>(c.geometry.layer_bytes_per_rank()) / k_mib;
  st.counters["P"] = w.num_ranks;
  st.counters["virtual_ranks"] = w.virtual_ranks ? 1 : 0;
}

// One timed switch per iteration in direction `dir`; the reverse switch between iterations is
// not timed (it restores the starting layout). One untimed round trip warms up first.
void bench_switch(benchmark::State& st, const config& cfg, method m, int dir) {
  context* c = nullptr;
  try {
    c = &use(cfg);
  } catch (const std::exception& e) {
    st.SkipWithError(e.what());
    for (auto _ : st) {
    }
    return;
  }
  double total = 0;
  int64_t n = 0;
  try {
    run_switch(*c, m, 0);
    run_switch(*c, m, 1);
    for (auto _ : st) {
      if (dir == 1) run_switch(*c, m, 0);
      sync_all();
      const double s = seconds_of([&] { run_switch(*c, m, dir); });
      st.SetIterationTime(s);
      total += s;
      ++n;
      if (dir == 0) run_switch(*c, m, 1);
    }
  } catch (const std::exception& e) {
    st.SkipWithError(e.what());
    return;
  }
  set_common_counters(st, *c, total, n);
  st.SetLabel(c->geometry.shape.weight_dtype == dtype::bf16 ? "bf16" : "fp8+scales");
}

// Host time to enqueue the whole prepared plan (cuda_peer: last_execute_stats; NCCL: the
// enqueue() call), plus the switch time. Extrapolated to 94 layers when fewer fit.
void bench_enqueue(benchmark::State& st, const config& cfg, method m) {
  context* c = nullptr;
  try {
    c = &use(cfg);
  } catch (const std::exception& e) {
    st.SkipWithError(e.what());
    for (auto _ : st) {
    }
    return;
  }
  double total = 0, enqueue = 0;
  int64_t n = 0;
  try {
    run_switch(*c, m, 0);
    run_switch(*c, m, 1);
    for (auto _ : st) {
      sync_all();
      double enq = 0;
      const double s = seconds_of([&] {
        if (m == method::nccl) {
          enq = seconds_of([&] { c->nccl->enqueue(c->forward, bench::world_streams()); });
          c->nccl->wait();
        } else {
          const int k = static_cast<int>(m) - 2;
          c->peer[k]->execute(c->prepared[k][0]);
          enq = c->peer[k]->last_execute_stats().enqueue_seconds;
        }
      });
      st.SetIterationTime(s);
      total += s;
      enqueue += enq;
      ++n;
      run_switch(*c, m, 1);
    }
  } catch (const std::exception& e) {
    st.SkipWithError(e.what());
    return;
  }
  set_common_counters(st, *c, total, n);
  const double enq_ms = enqueue / static_cast<double>(std::max<int64_t>(n, 1)) * 1e3;
  st.counters["enqueue_ms"] = enq_ms;
  st.counters["enqueue_ms_94_layers"] =
      enq_ms * 94.0 / static_cast<double>(c->geometry.shape.num_layers);
  st.counters["num_ops"] = static_cast<double>(c->forward.num_ops());
  st.SetLabel(c->geometry.shape.num_layers == 94
                  ? "94 layers"
                  : "extrapolated from " + std::to_string(c->geometry.shape.num_layers) +
                        " layers");
}

expert_shape qwen3(dtype t, bool scales) {
  expert_shape s = qwen3_235b_a22b();
  s.weight_dtype = t;
  s.block_scales = scales;
  return s;
}

std::vector<method> methods() {
  std::vector<method> ms = {method::ceiling};
  if (!world().virtual_ranks) ms.push_back(method::nccl);
  ms.insert(ms.end(), {method::peer_copy_engine, method::peer_sm_kernel, method::peer_automatic});
  return ms;
}

void register_all() {
  bench::gpu_world& w = world();
  const int P = w.num_ranks;
  const int64_t iters = std::max<int64_t>(1, env_int("MOEBIUS_BENCH_ITERS", 5));
  const int64_t want_layers = std::max<int64_t>(1, env_int("MOEBIUS_BENCH_LAYERS", 24));
  const auto reg_switch = [&](const config& cfg, method m, int dir) {
    const std::string name =
        w.prefix + cfg.name + (dir == 0 ? "/ep_to_tp/" : "/tp_to_ep/") + to_string(m);
    benchmark::RegisterBenchmark(
        name.c_str(), [cfg, m, dir](benchmark::State& st) { bench_switch(st, cfg, m, dir); })
        ->UseManualTime()
        ->Iterations(iters)
        ->Unit(benchmark::kMillisecond);
  };
  const auto try_shape = [&](expert_shape s) {
    try {
      validate(s, P);
      return true;
    } catch (const std::exception& e) {
      std::fprintf(stderr, "bench_reshard_bandwidth: skipping %s at P=%d: %s\n",
                   to_string(s.weight_dtype), P, e.what());
      return false;
    }
  };

  // Qwen3-235B-A22B layers: bf16, then block-scaled fp8 (I/P must be whole 128-blocks).
  for (const auto& [shape, tag] : {std::pair{qwen3(dtype::bf16, false), "bf16"},
                                   std::pair{qwen3(dtype::fp8_e4m3, true), "fp8"}}) {
    if (!try_shape(shape)) continue;
    expert_shape s = shape;
    s.num_layers = fit_layers(s, want_layers);
    if (s.num_layers == 0) {
      std::fprintf(stderr, "bench_reshard_bandwidth: not even one %s layer fits\n", tag);
      continue;
    }
    const config cfg{std::string("qwen3_") + tag + "_L" + std::to_string(s.num_layers) + "_P" +
                         std::to_string(P),
                     s};
    for (int dir = 0; dir < 2; ++dir) {
      for (method m : methods()) reg_switch(cfg, m, dir);
    }
  }

  // Per-layer size sweep (bf16, vary E): ~72 MiB .. 2.3 GiB per rank per layer at P = 2.
  // Layers: enough for ~12 GiB leaving... capped at 96 and at what fits.
  if (env_int("MOEBIUS_BENCH_SWEEP", 1) != 0) {
    for (int64_t e : {4, 8, 16, 32, 64, 128}) {
      expert_shape s = qwen3(dtype::bf16, false);
      s.num_experts = e;
      if (e % P != 0 || !try_shape(s)) continue;
      s.num_layers = 1;
      const int64_t layer = make_arena_geometry(s, P).layer_bytes_per_rank();
      const int64_t want = std::clamp<int64_t>((int64_t{12} << 30) / layer, 4, 96);
      s.num_layers = fit_layers(s, want);
      if (s.num_layers == 0) continue;
      const config cfg{"sweep_E" + std::to_string(e) + "_bf16_L" + std::to_string(s.num_layers) +
                           "_P" + std::to_string(P),
                       s};
      for (method m : methods()) reg_switch(cfg, m, 0);
    }
  }

  // Host enqueue time of a prepared 94-layer Qwen3 plan (fp8 at P=2 fits one H200; bf16 at
  // P>=4). Falls back to the largest layer count that fits and extrapolates.
  if (env_int("MOEBIUS_BENCH_ENQUEUE", 1) != 0) {
    expert_shape best{};
    for (expert_shape s : {qwen3(dtype::bf16, false), qwen3(dtype::fp8_e4m3, true)}) {
      if (!try_shape(s)) continue;
      s.num_layers = fit_layers(s, 94);
      if (s.num_layers > best.num_layers) best = s;
    }
    if (best.num_layers > 0) {
      const config cfg{std::string("enqueue_qwen3_94L_") +
                           (best.weight_dtype == dtype::bf16 ? "bf16" : "fp8") + "_L" +
                           std::to_string(best.num_layers) + "_P" + std::to_string(P),
                       best};
      std::vector<method> ms;
      if (!w.virtual_ranks) ms.push_back(method::nccl);
      ms.push_back(method::peer_automatic);
      for (method m : ms) {
        const std::string name = w.prefix + cfg.name + "/ep_to_tp/" + to_string(m);
        benchmark::RegisterBenchmark(name.c_str(),
                                     [cfg, m](benchmark::State& st) { bench_enqueue(st, cfg, m); })
            ->UseManualTime()
            ->Iterations(std::min<int64_t>(iters, 3))
            ->Unit(benchmark::kMillisecond);
      }
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (const int status = bench::start_gpu_benchmark(&argc, argv, "bench_reshard_bandwidth");
      status >= 0) {
    return status;
  }
  try {
    std::printf("bench_reshard_bandwidth: P = %d%s, %lld GiB budget per rank\n", world().num_ranks,
                world().virtual_ranks ? " virtual ranks on one device" : " devices",
                static_cast<long long>(budget_per_rank() >> 30));
    register_all();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_reshard_bandwidth: setup failed: %s\n", e.what());
    return 1;
  }
  benchmark::RunSpecifiedBenchmarks();
  current().release();
  benchmark::Shutdown();
  return 0;
}
