// Paged-KV migration bandwidth on real GPUs: how fast cuda_peer_transport (engine automatic)
// and nccl_transport run the EP->TP and TP->EP plans of a Qwen3-235B-A22B KV cache.
//
// Shape: 4 KV heads, head_dim 128, bf16, MOEBIUS_BENCH_KV_LAYERS layers (default 94), a pool
// per rank of 16 GiB (page 16) or 4 GiB (page 1), shrunk to a third of what fits, and a
// staging region of 64 slots in the arena. Two layouts: page size 16 HND and page size 1 NHD.
// States: random sequences of 64..8192 tokens filling 25 / 50 / 90% of the source view
// (kv_bench_common.hpp; TP states are fragmented).
// Names: kv_qwen3_[<preset>_]<layout>_ps<page>_L<layers>_P<P>/occ<percent>/{ep_to_tp,tp_to_ep}/
// <method>, method = cuda_peer_automatic | nccl; <preset> (absent for the present pool) names
// the engine layout the pool is in (kv/kv_pool_layout.hpp): MOEBIUS_BENCH_KV_PRESETS, a comma
// list of present, vllm_flash_attn, vllm_flashinfer, sglang_mha (default: present). SGLang's
// buffers are token-major, so its "HND page 16" case runs NHD page 16 instead.
// Every iteration runs the same plan again: the bytes moved (and where) are those of a real
// switch; the values in them do not matter for the timing, so no reverse switch is needed.
// Counters: ms (per switch), GBps_per_gpu (traffic_of(plan).max_bytes_sent() per second),
// bytes_per_gpu, rounds (plan phases), num_ops, plan_ms (host time of plan_kv_migration),
// refused (1 when check_kv_capacity says the target view cannot hold the state: nothing runs),
// occupancy (achieved), P, virtual_ranks.
//
// P = number of devices (at most 8). With one device P = 2 virtual ranks share it and NCCL is
// skipped (names start with "virtual_"); with none the program says so and exits 0.
// Environment: MOEBIUS_BENCH_ITERS (timed switches per benchmark, default 5),
// MOEBIUS_BENCH_KV_LAYERS (94), MOEBIUS_BENCH_KV_POOL_GIB (16, page size 16 HND),
// MOEBIUS_BENCH_KV_PS1_POOL_GIB (4, page size 1 NHD: its 512-byte pieces are one op each, so
// 4 GiB is already 4-15 M ops), MOEBIUS_BENCH_KV_NCCL_MAX_OPS (1,000,000: nccl_transport
// issues one ncclSend/ncclRecv per op, so larger plans skip NCCL with an error message).
//
// Diagnostics of cuda_peer (after the timed loop, so `ms` is not affected):
// MOEBIUS_BENCH_KV_DIAG_ITERS (default 3; 0: off) more runs, averaged, that split the wall time
// of execute(p) into host and device parts:
//   diag_enqueue_ms   host time of enqueue(p): the plan-cache lookup plus the launches
//   diag_lookup_ms    of which the lookup (cuda_execute_stats::lookup_seconds)
//   diag_launch_ms    of which the launches (cuda_execute_stats::enqueue_seconds)
//   diag_wait_ms      host time of wait() after that enqueue
//   diag_device_ms    CUDA events on each rank's stream around enqueue(prepared) of a plan
//                     prepared once (no lookup): the plan's device time, the largest of the ranks
//   diag_prepared_ms  wall time of that enqueue(prepared) + wait(): execute without the lookup
//   hash_of_ms, plan_eq_ms   host time of hash_of(p) and of p == (a copy of p) on this CPU
//   from_cache, graphs, graph_launches, kernel_launches, copy_engine_calls, max_sm_kernel_blocks
//                     cuda_execute_stats of the last enqueue(p) (graphs: the prepared plan
//                     was captured into CUDA graphs)
// MOEBIUS_BENCH_KV_GRAPHS=0 turns cuda_peer_config::use_cuda_graphs off (direct launches).

#include <benchmark/benchmark.h>
#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "kv_bench_common.hpp"
#include "gpu_bench_world.hpp"
#include "moebius/cuda/check.hpp"
#include "moebius/cuda/nccl_check.hpp"
#include "moebius/kv/kv_migration.hpp"
#include "moebius/transport/cuda_peer_transport.hpp"
#include "moebius/transport/nccl_transport.hpp"

namespace {

using namespace moebius;
using clock_type = std::chrono::steady_clock;

constexpr int64_t k_staging_slots = 64;

template <class F>
double seconds_of(F&& f) {
  const auto t0 = clock_type::now();
  f();
  return std::chrono::duration<double>(clock_type::now() - t0).count();
}

using bench::env_int;
using bench::sync_all;
using bench::world;

// A third of what one rank may use (the rest: staging, NCCL workspace), at most `want`.
int64_t pool_budget_per_rank(int64_t want) {
  return std::min(want, bench::budget_per_rank() / 3);
}

// --- one layout: memory, transports, plans ------------------------------------------------------

struct layout_config {
  int64_t page_size;
  kv_layout layout;
  kv_preset preset = kv_preset::present;
};

std::vector<kv_preset> presets_from_env() {
  const char* env = std::getenv("MOEBIUS_BENCH_KV_PRESETS");
  const std::string list = env && *env ? env : "present";
  std::vector<kv_preset> out;
  size_t at = 0;
  while (at <= list.size()) {
    const size_t end = std::min(list.find(',', at), list.size());
    const std::string name = list.substr(at, end - at);
    bool found = false;
    for (kv_preset p : {kv_preset::present, kv_preset::vllm_flash_attn,
                        kv_preset::vllm_flashinfer, kv_preset::sglang_mha})
      if (name == to_string(p)) {
        out.push_back(p);
        found = true;
      }
    MOEBIUS_CHECK(found, errc::invalid_argument, "MOEBIUS_BENCH_KV_PRESETS: unknown preset '",
                  name, "' (present, vllm_flash_attn, vllm_flashinfer, sglang_mha)");
    at = end + 1;
  }
  return out;
}

struct plan_entry {
  bool refused = false;
  std::string reason;
  kv_migration mig;
  double plan_ms = 0;
  double occupancy = 0;
  int64_t bytes_per_gpu = 0;
};

void* alloc_on(int device, int64_t bytes) {
  void* p = nullptr;
  MOEBIUS_CUDA_CHECK(cudaSetDevice(device));
  MOEBIUS_CUDA_CHECK(cudaMalloc(&p, static_cast<size_t>(std::max<int64_t>(bytes, 1))));
  MOEBIUS_CUDA_CHECK(cudaMemset(p, 0, static_cast<size_t>(std::max<int64_t>(bytes, 1))));
  MOEBIUS_CUDA_CHECK(cudaSetDevice(0));
  return p;
}

struct context {
  bool ready = false;
  int64_t page_size = 0;
  kv_layout layout = kv_layout::hnd;
  kv_preset preset = kv_preset::present;
  kv_geometry g;
  kv_pool_layout pool;  // where the bytes lie (the preset's layout of g)
  kv_staging staging;
  std::vector<void*> kv;
  std::vector<void*> arena;
  std::vector<void*> workspace;
  std::vector<int64_t> workspace_bytes;
  std::unique_ptr<cuda_peer_transport> peer;
  std::unique_ptr<nccl_transport> nccl;
  std::vector<rank_memory> memory;  // per rank, for the NCCL transport
  std::map<std::pair<int, int>, plan_entry> plans;  // (occupancy %, dir) -> plan; one kept

  context() = default;
  context(const context&) = delete;
  context& operator=(const context&) = delete;
  ~context() { release(); }

  void release() {
    peer.reset();
    nccl.reset();
    plans.clear();
    bench::gpu_world& w = world();
    for (std::vector<void*>* v : {&kv, &arena, &workspace}) {
      for (size_t r = 0; r < v->size(); ++r) {
        (void)cudaSetDevice(w.device_of[r]);
        (void)cudaFree((*v)[r]);
      }
      v->clear();
    }
    workspace_bytes.clear();
    (void)cudaSetDevice(0);
    ready = false;
  }

  void setup(const layout_config& lc) {
    release();
    bench::gpu_world& w = world();
    const int64_t layers = std::max<int64_t>(1, env_int("MOEBIUS_BENCH_KV_LAYERS", 94));
    g = make_kv_geometry(layers, 4, 128, lc.page_size, 1, w.num_ranks, dtype::bf16, lc.layout);
    // Page size 1 NHD moves 512-byte pieces (one op each): a smaller pool keeps the plan at a
    // few million ops (plan build, host memory and descriptors grow with the op count).
    const int64_t want_gib =
        lc.page_size == 1 ? env_int("MOEBIUS_BENCH_KV_PS1_POOL_GIB", 4)
                          : env_int("MOEBIUS_BENCH_KV_POOL_GIB", 16);
    const int64_t budget = pool_budget_per_rank(std::max<int64_t>(1, want_gib) << 30);
    g = make_kv_geometry(layers, 4, 128, lc.page_size, ep_pages_for_bytes(g, budget),
                         w.num_ranks, dtype::bf16, lc.layout);
    pool = kv_preset_layout(lc.preset, g);
    staging = {memory_space::arena, 0,
               k_staging_slots * std::max(kv_staging_slot_bytes(g, parallel_mode::tp),
                                          kv_staging_slot_bytes(g, parallel_mode::ep))};
    std::vector<rank_memory> mem(static_cast<size_t>(w.num_ranks));
    for (int r = 0; r < w.num_ranks; ++r) {
      const int d = w.device_of[static_cast<size_t>(r)];
      kv.push_back(alloc_on(d, pool.pool_bytes));
      arena.push_back(alloc_on(d, staging.bytes));
      workspace.push_back(nullptr);
      workspace_bytes.push_back(0);
      mem[static_cast<size_t>(r)] = rank_memory::on_device(
          d, arena.back(), std::max<int64_t>(staging.bytes, 1), kv.back(), pool.pool_bytes);
    }
    cuda_peer_config cfg;
    cfg.engine = engine_policy::automatic;
    cfg.max_cached_plans = 1;  // one benchmark's plan at a time (millions of descriptors)
    cfg.use_cuda_graphs = env_int("MOEBIUS_BENCH_KV_GRAPHS", 1) != 0;
    peer = std::make_unique<cuda_peer_transport>(cuda_peer_transport::single_process(mem, cfg));
    memory = mem;
    page_size = lc.page_size;
    layout = lc.layout;
    preset = lc.preset;
    ready = true;
    std::printf("bench_kv_migration_gpu: %s %s page %lld, %lld layers, %lld EP pages, %.2f GiB "
                "pool per rank\n",
                to_string(lc.preset), to_string(g.layout), static_cast<long long>(g.page_size),
                static_cast<long long>(g.num_layers), static_cast<long long>(g.num_ep_pages),
                static_cast<double>(pool.pool_bytes) / double(int64_t{1} << 30));
  }

  // The plan of a state at `occ_pct`% of the source view; dir 0: EP->TP, 1: TP->EP.
  plan_entry& plan_for(int occ_pct, int dir) {
    auto it = plans.find({occ_pct, dir});
    if (it != plans.end()) return it->second;
    plan_entry e;
    const parallel_mode from = dir == 0 ? parallel_mode::ep : parallel_mode::tp;
    const parallel_mode to = dir == 0 ? parallel_mode::tp : parallel_mode::ep;
    const kv_state s = bench::random_kv_state(g, from, occ_pct / 100.0, 1 + static_cast<uint64_t>(occ_pct));
    int64_t used = 0;
    for (int r = 0; r < g.num_ranks; ++r) used += used_pages(g, s, r);
    e.occupancy = static_cast<double>(used) /
                  static_cast<double>(g.num_pages(from) * g.num_ranks);
    kv_migration_options opt;
    opt.staging = staging;
    const kv_capacity_report rep = check_kv_capacity(g, pool, s, to, opt);
    if (!rep.fits) {
      e.refused = true;
      e.reason = rep.reason;
    } else {
      e.plan_ms = 1e3 * seconds_of([&] { e.mig = plan_kv_migration(g, pool, s, to, opt); });
      e.bytes_per_gpu = traffic_of(e.mig.copies).max_bytes_sent();
    }
    plans.clear();  // benchmarks run grouped by plan: the previous one is not needed again
    if (peer) peer->clear_plan_cache();
    if (nccl) nccl->clear_plan_cache();
    return plans.emplace(std::make_pair(occ_pct, dir), std::move(e)).first->second;
  }

  // An nccl_transport whose workspaces hold what `p` needs (recreated when they grow).
  nccl_transport& nccl_for(const plan& p) {
    bench::gpu_world& w = world();
    bool grow = nccl == nullptr;
    for (int r = 0; r < w.num_ranks; ++r)
      if (nccl_transport::workspace_bytes(p, r) > workspace_bytes[static_cast<size_t>(r)])
        grow = true;
    if (!grow) return *nccl;
    nccl.reset();
    std::vector<nccl_rank_comm> comms;
    for (int r = 0; r < w.num_ranks; ++r) {
      const size_t i = static_cast<size_t>(r);
      const int64_t need = std::max(workspace_bytes[i], nccl_transport::workspace_bytes(p, r));
      if (need > workspace_bytes[i]) {
        MOEBIUS_CUDA_CHECK(cudaSetDevice(w.device_of[i]));
        MOEBIUS_CUDA_CHECK(cudaFree(workspace[i]));
        workspace[i] = alloc_on(w.device_of[i], need);
        workspace_bytes[i] = need;
      }
      comms.push_back({w.comms[i], workspace[i], workspace_bytes[i]});
    }
    nccl_config cfg;
    cfg.max_cached_plans = 1;  // as the peer transport: one benchmark's plan at a time
    nccl = std::make_unique<nccl_transport>(memory, std::move(comms), cfg);
    return *nccl;
  }
};

context& current() {
  static context c;
  return c;
}

context& use(const layout_config& lc) {
  context& c = current();
  if (!c.ready || c.page_size != lc.page_size || c.layout != lc.layout || c.preset != lc.preset)
    c.setup(lc);
  return c;
}

// The diagnostic runs of cuda_peer (see the top of the file): counters prefixed diag_, the
// host cost of hash_of and plan equality, and the last enqueue's stats.
void diagnose_peer(benchmark::State& st, cuda_peer_transport& peer, const plan& p) {
  const int64_t iters = env_int("MOEBIUS_BENCH_KV_DIAG_ITERS", 3);
  if (iters <= 0) return;
  bench::gpu_world& w = world();
  const std::vector<int> ranks = peer.local_ranks();
  double enqueue_s = 0, lookup_s = 0, launch_s = 0, wait_s = 0, device_ms = 0, prepared_s = 0;
  for (int64_t i = 0; i < iters; ++i) {
    sync_all();
    const double e = seconds_of([&] { peer.enqueue(p); });
    const cuda_execute_stats stats = peer.last_execute_stats();
    wait_s += seconds_of([&] { peer.wait(); });
    enqueue_s += e;
    lookup_s += stats.lookup_seconds;
    launch_s += stats.enqueue_seconds;
  }
  const cuda_execute_stats last = peer.last_execute_stats();

  // Device time: the same plan prepared once more (a second set of descriptors and graphs),
  // enqueued without a lookup between timing events on each rank's stream.
  const std::shared_ptr<const cuda_prepared_plan> prepared = peer.prepare_plan(p);
  std::vector<cudaEvent_t> start(ranks.size()), stop(ranks.size());
  for (size_t i = 0; i < ranks.size(); ++i) {
    MOEBIUS_CUDA_CHECK(cudaSetDevice(peer.device_of(ranks[i])));
    MOEBIUS_CUDA_CHECK(cudaEventCreate(&start[i]));
    MOEBIUS_CUDA_CHECK(cudaEventCreate(&stop[i]));
  }
  for (int64_t it = 0; it < iters; ++it) {
    sync_all();
    prepared_s += seconds_of([&] {
      for (size_t i = 0; i < ranks.size(); ++i) {
        MOEBIUS_CUDA_CHECK(cudaEventRecord(start[i], peer.stream_of(ranks[i])));
      }
      peer.enqueue(prepared);
      for (size_t i = 0; i < ranks.size(); ++i) {
        MOEBIUS_CUDA_CHECK(cudaEventRecord(stop[i], peer.stream_of(ranks[i])));
      }
      peer.wait();
    });
    float worst = 0;
    for (size_t i = 0; i < ranks.size(); ++i) {
      float ms = 0;
      MOEBIUS_CUDA_CHECK(cudaEventElapsedTime(&ms, start[i], stop[i]));
      worst = std::max(worst, ms);
    }
    device_ms += worst;
  }
  for (size_t i = 0; i < ranks.size(); ++i) {
    (void)cudaEventDestroy(start[i]);
    (void)cudaEventDestroy(stop[i]);
  }
  MOEBIUS_CUDA_CHECK(cudaSetDevice(w.device_of[0]));

  const plan copy = p;
  volatile uint64_t hash_sink = 0;
  volatile bool equal_sink = false;
  const double hash_s = seconds_of([&] { hash_sink = hash_of(p); });
  const double eq_s = seconds_of([&] { equal_sink = (copy == p); });
  (void)hash_sink;
  (void)equal_sink;

  const double n = static_cast<double>(iters);
  st.counters["diag_enqueue_ms"] = enqueue_s / n * 1e3;
  st.counters["diag_lookup_ms"] = lookup_s / n * 1e3;
  st.counters["diag_launch_ms"] = launch_s / n * 1e3;
  st.counters["diag_wait_ms"] = wait_s / n * 1e3;
  st.counters["diag_device_ms"] = device_ms / n;
  st.counters["diag_prepared_ms"] = prepared_s / n * 1e3;
  st.counters["hash_of_ms"] = hash_s * 1e3;
  st.counters["plan_eq_ms"] = eq_s * 1e3;
  st.counters["from_cache"] = last.from_cache ? 1 : 0;
  st.counters["graphs"] = prepared->uses_cuda_graphs() ? 1 : 0;
  st.counters["graph_launches"] = static_cast<double>(last.graph_launches);
  st.counters["kernel_launches"] = static_cast<double>(last.kernel_launches);
  st.counters["copy_engine_calls"] = static_cast<double>(last.copy_engine_calls);
  st.counters["max_sm_kernel_blocks"] = last.max_sm_kernel_blocks;
}

enum class method { peer_automatic, nccl };

const char* to_string(method m) { return m == method::nccl ? "nccl" : "cuda_peer_automatic"; }

void bench_kv(benchmark::State& st, layout_config lc, int occ_pct, int dir, method m) {
  bench::gpu_world& w = world();
  try {
    context& c = use(lc);
    plan_entry& e = c.plan_for(occ_pct, dir);
    st.counters["P"] = w.num_ranks;
    st.counters["virtual_ranks"] = w.virtual_ranks ? 1 : 0;
    st.counters["occupancy"] = e.occupancy;
    st.counters["refused"] = e.refused ? 1 : 0;
    if (e.refused) {
      for (auto _ : st) st.SetIterationTime(1e-9);
      st.SetLabel("refused: " + e.reason);
      return;
    }
    const plan& p = e.mig.copies;
    // nccl_transport issues one ncclSend/ncclRecv (and, when strided, one pack kernel) per op:
    // millions of them per group take minutes, so the baseline is capped.
    const int64_t nccl_max_ops = env_int("MOEBIUS_BENCH_KV_NCCL_MAX_OPS", 1'000'000);
    if (m == method::nccl && p.num_ops() > nccl_max_ops) {
      st.SkipWithError(("nccl skipped: " + std::to_string(p.num_ops()) +
                        " ops > MOEBIUS_BENCH_KV_NCCL_MAX_OPS = " + std::to_string(nccl_max_ops))
                           .c_str());
      for (auto _ : st) {
      }
      return;
    }
    transport* tr = m == method::nccl ? static_cast<transport*>(&c.nccl_for(p))
                                      : static_cast<transport*>(c.peer.get());
    tr->execute(p);  // warm-up (cuda_peer: prepares and caches the plan)
    double total = 0;
    int64_t n = 0;
    for (auto _ : st) {
      sync_all();
      const double s = seconds_of([&] { tr->execute(p); });
      st.SetIterationTime(s);
      total += s;
      ++n;
    }
    const double per = total / static_cast<double>(std::max<int64_t>(n, 1));
    st.counters["ms"] = per * 1e3;
    st.counters["GBps_per_gpu"] = static_cast<double>(e.bytes_per_gpu) / per / 1e9;
    st.counters["bytes_per_gpu"] = static_cast<double>(e.bytes_per_gpu);
    st.counters["rounds"] = static_cast<double>(e.mig.stats.rounds);
    st.counters["num_ops"] = static_cast<double>(p.num_ops());
    st.counters["plan_ms"] = e.plan_ms;
    if (m == method::peer_automatic) diagnose_peer(st, *c.peer, p);
  } catch (const std::exception& ex) {
    st.SkipWithError(ex.what());
    for (auto _ : st) {
    }
  }
}

void register_all() {
  bench::gpu_world& w = world();
  const int64_t iters = std::max<int64_t>(1, env_int("MOEBIUS_BENCH_ITERS", 5));
  const int64_t layers = std::max<int64_t>(1, env_int("MOEBIUS_BENCH_KV_LAYERS", 94));
  std::vector<layout_config> layouts;
  for (kv_preset p : presets_from_env()) {
    const kv_layout first = p == kv_preset::sglang_mha ? kv_layout::nhd : kv_layout::hnd;
    layouts.push_back({16, first, p});
    layouts.push_back({1, kv_layout::nhd, p});
  }
  std::vector<method> methods = {method::peer_automatic};
  if (!w.virtual_ranks) methods.push_back(method::nccl);
  for (const layout_config& lc : layouts)
    for (int occ : {25, 50, 90})
      for (int dir : {0, 1})
        for (method m : methods) {
          const std::string tag =
              lc.preset == kv_preset::present ? "" : std::string(to_string(lc.preset)) + "_";
          const std::string name = w.prefix + "kv_qwen3_" + tag + to_string(lc.layout) + "_ps" +
                                   std::to_string(lc.page_size) + "_L" + std::to_string(layers) +
                                   "_P" + std::to_string(w.num_ranks) + "/occ" +
                                   std::to_string(occ) + (dir == 0 ? "/ep_to_tp/" : "/tp_to_ep/") +
                                   to_string(m);
          benchmark::RegisterBenchmark(name.c_str(),
                                       [lc, occ, dir, m](benchmark::State& st) {
                                         bench_kv(st, lc, occ, dir, m);
                                       })
              ->UseManualTime()
              ->Iterations(iters)
              ->Unit(benchmark::kMillisecond);
        }
}

}  // namespace

int main(int argc, char** argv) {
  if (const int status = bench::start_gpu_benchmark(&argc, argv, "bench_kv_migration_gpu");
      status >= 0) {
    return status;
  }
  try {
    std::printf("bench_kv_migration_gpu: P = %d%s\n", world().num_ranks,
                world().virtual_ranks ? " virtual ranks on one device" : " devices");
    register_all();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_kv_migration_gpu: setup failed: %s\n", e.what());
    return 1;
  }
  benchmark::RunSpecifiedBenchmarks();
  current().release();
  benchmark::Shutdown();
  return 0;
}
