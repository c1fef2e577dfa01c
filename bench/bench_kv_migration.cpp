// KV migration on the host: plan build time and host_transport bandwidth for the Qwen3-235B KV
// shape (4 KV heads, head_dim 128, bf16, P=8), one layer, page size 16 and 1, at 25/50/90%
// occupancy of the source view. H_kv=4 < P=8 replicates each head on 2 TP ranks, so EP->TP
// only fits up to 50% EP occupancy: the 90% EP->TP case reports the capacity check instead.
//
//   ./bench_kv_migration --benchmark_format=json
// Args: page_size, occupancy %, direction (0 = EP->TP, 1 = TP->EP).

#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstddef>
#include <string>
#include <vector>

#include "kv_bench_common.hpp"
#include "moebius/transport/host_transport.hpp"

using namespace moebius;

namespace {

constexpr int64_t kStagingSlots = 16;

// ~32 MiB of K+V per rank per layer: 1024 pages of 16 tokens, or 16384 pages of 1 token.
kv_geometry geometry_for(int64_t page_size) {
  return bench::qwen3_kv_geometry(page_size, page_size == 1 ? 16384 : 1024);
}

struct bench_case {
  kv_geometry g;
  kv_state s;
  bool fits = false;
  kv_capacity_report rep;
};

bench_case make_case(const benchmark::State& state) {
  bench_case c;
  c.g = geometry_for(state.range(0));
  const double occ = static_cast<double>(state.range(1)) / 100.0;
  const parallel_mode from = state.range(2) == 0 ? parallel_mode::ep : parallel_mode::tp;
  c.s = bench::random_kv_state(c.g, from, occ);
  kv_migration_options opt;
  const parallel_mode to = from == parallel_mode::ep ? parallel_mode::tp : parallel_mode::ep;
  opt.staging = {memory_space::arena, 0, kStagingSlots * kv_staging_slot_bytes(c.g, to)};
  c.rep = check_kv_capacity(c.g, c.s, to, opt);
  c.fits = c.rep.fits;
  return c;
}

void set_labels(benchmark::State& state, const bench_case& c) {
  state.SetLabel(std::string(state.range(2) == 0 ? "EP->TP" : "TP->EP") +
                 (c.fits ? "" : " capacity check: no (" + c.rep.reason.substr(0, 60) + "...)"));
}

void BM_kv_plan_build(benchmark::State& state) {
  const bench_case c = make_case(state);
  int64_t ops = 0, bytes = 0, rounds = 0;
  for (auto _ : state) {
    if (!c.fits) {
      benchmark::DoNotOptimize(check_kv_capacity(c.g, c.s, parallel_mode::tp));
      continue;
    }
    kv_migration m = bench::build_kv_plan(c.g, c.s, kStagingSlots);
    ops = m.copies.num_ops();
    bytes = m.stats.bytes_copied;
    rounds = m.stats.rounds;
    benchmark::DoNotOptimize(m);
  }
  state.counters["ops"] = static_cast<double>(ops);
  state.counters["bytes"] = static_cast<double>(bytes);
  state.counters["rounds"] = static_cast<double>(rounds);
  state.counters["pages_needed"] = static_cast<double>(c.rep.pages_needed);
  state.counters["pages_available"] = static_cast<double>(c.rep.pages_available);
  set_labels(state, c);
}

void BM_kv_host_transport(benchmark::State& state) {
  const bench_case c = make_case(state);
  if (!c.fits) {
    for (auto _ : state) {
    }
    set_labels(state, c);
    return;
  }
  const kv_migration m = bench::build_kv_plan(c.g, c.s, kStagingSlots);
  const int P = c.g.num_ranks;
  std::vector<std::vector<std::byte>> kv(static_cast<size_t>(P)), arena(static_cast<size_t>(P));
  std::vector<rank_memory> mem(static_cast<size_t>(P));
  const int64_t stage_bytes =
      kStagingSlots * kv_staging_slot_bytes(c.g, state.range(2) == 0 ? parallel_mode::tp
                                                                     : parallel_mode::ep);
  for (int r = 0; r < P; ++r) {
    kv[static_cast<size_t>(r)].assign(static_cast<size_t>(c.g.pool_bytes()), std::byte{1});
    arena[static_cast<size_t>(r)].assign(static_cast<size_t>(stage_bytes), std::byte{2});
    mem[static_cast<size_t>(r)].spaces[static_cast<int>(memory_space::kv_pool)] =
        kv[static_cast<size_t>(r)];
    mem[static_cast<size_t>(r)].spaces[static_cast<int>(memory_space::arena)] =
        arena[static_cast<size_t>(r)];
  }
  host_transport tr(mem);
  for (auto _ : state) tr.execute(m.copies);
  state.SetBytesProcessed(state.iterations() * m.stats.bytes_copied);
  state.counters["rounds"] = static_cast<double>(m.stats.rounds);
  state.counters["ops"] = static_cast<double>(m.copies.num_ops());
  state.counters["bytes_per_run"] = static_cast<double>(m.stats.bytes_copied);
  state.counters["staged"] = static_cast<double>(m.stats.pages_staged);
  state.counters["compacted"] = static_cast<double>(m.stats.pages_compacted);
  set_labels(state, c);
}

// Rounds and ops of the plans the GPU benchmark runs (bench_kv_migration_gpu.cu: same page
// counts, same states, seed 1 + occupancy), for P = 2, 4, 8. The plan does not depend on the
// layer count, so one layer keeps it fast. Counters: rounds, ops, compacted, staged, in_place,
// plan_ms; `refused` = 1 when the capacity check says no.
//   ./bench_kv_migration --benchmark_filter=BM_kv_gpu_case_plan
// Args: layout (0 = HND page 16, 1 = NHD page 1), occupancy %, direction, P.
void BM_kv_gpu_case_plan(benchmark::State& state) {
  const bool nhd = state.range(0) == 1;
  const int64_t page = nhd ? 1 : 16;
  const int P = static_cast<int>(state.range(3));
  const kv_geometry g = bench::qwen3_kv_geometry(page, bench::gpu_bench_ep_pages(page), P, 1,
                                                 nhd ? kv_layout::nhd : kv_layout::hnd);
  const parallel_mode from = state.range(2) == 0 ? parallel_mode::ep : parallel_mode::tp;
  const parallel_mode to = from == parallel_mode::ep ? parallel_mode::tp : parallel_mode::ep;
  const kv_state s =
      bench::random_kv_state(g, from, static_cast<double>(state.range(1)) / 100.0,
                             1 + static_cast<uint64_t>(state.range(1)));
  kv_migration_options opt;
  constexpr int64_t gpu_slots = 64;  // bench_kv_migration_gpu.cu's staging
  opt.staging = {memory_space::arena, 0,
                 gpu_slots * std::max(kv_staging_slot_bytes(g, parallel_mode::tp),
                                      kv_staging_slot_bytes(g, parallel_mode::ep))};
  const kv_capacity_report rep = check_kv_capacity(g, s, to, opt);
  kv_migration m;
  for (auto _ : state) {
    if (!rep.fits) continue;
    m = plan_kv_migration(g, s, to, opt);
    benchmark::DoNotOptimize(m);
  }
  state.counters["refused"] = rep.fits ? 0 : 1;
  state.counters["rounds"] = static_cast<double>(m.stats.rounds);
  state.counters["ops"] = static_cast<double>(m.copies.num_ops());
  state.counters["compacted"] = static_cast<double>(m.stats.pages_compacted);
  state.counters["staged"] = static_cast<double>(m.stats.pages_staged);
  state.counters["in_place"] = static_cast<double>(m.stats.pages_in_place);
  state.SetLabel(std::string(nhd ? "NHD ps1 " : "HND ps16 ") +
                 (state.range(2) == 0 ? "EP->TP" : "TP->EP") +
                 (rep.fits ? "" : " refused: " + rep.reason.substr(0, 60)));
}

void kv_gpu_case_args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"nhd", "occ", "dir", "P"});
  for (int64_t P : {2, 4, 8})
    for (int64_t layout : {0, 1})
      for (int64_t occ : {25, 50, 90})
        for (int64_t dir : {0, 1}) b->Args({layout, occ, dir, P});
  b->Unit(benchmark::kMillisecond)->Iterations(1);
}

void kv_args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"page", "occ", "dir"});
  for (int64_t page : {16, 1})
    for (int64_t occ : {25, 50, 90})
      for (int64_t dir : {0, 1}) b->Args({page, occ, dir});
  b->Unit(benchmark::kMillisecond);
}

}  // namespace

BENCHMARK(BM_kv_gpu_case_plan)->Apply(kv_gpu_case_args);
BENCHMARK(BM_kv_plan_build)->Apply(kv_args);
BENCHMARK(BM_kv_host_transport)->Apply(kv_args);
BENCHMARK_MAIN();
