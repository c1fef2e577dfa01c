// Longest-first placement of 2048 sequences on 8 ranks (target <= 50 us on the host), with and
// without share groups.
//   ./bench_placement --benchmark_format=json

#include <benchmark/benchmark.h>

#include <random>
#include <vector>

#include "moebius/kv/placement.hpp"

using namespace moebius;

namespace {

void BM_place_longest_first(benchmark::State& state) {
  const auto n = static_cast<size_t>(state.range(0));
  const int P = static_cast<int>(state.range(1));
  const bool groups = state.range(2) != 0;
  std::mt19937_64 rng(7);
  std::vector<kv_demand> d(n);
  std::vector<int64_t> group_pages;
  int64_t total = 0;
  for (size_t i = 0; i < n; ++i) {
    d[i].seq_id = static_cast<int64_t>(i);
    d[i].own_pages = static_cast<int64_t>(1 + rng() % 512);  // 16..8192 tokens of 16
    if (groups && rng() % 4 == 0) {
      if (group_pages.empty() || rng() % 4 == 0) group_pages.push_back(static_cast<int64_t>(1 + rng() % 64));
      d[i].share_group = static_cast<int64_t>(group_pages.size()) - 1;
    }
    total += d[i].own_pages;
  }
  for (int64_t gp : group_pages) total += gp;
  const std::vector<int64_t> cap(static_cast<size_t>(P), total / P * 11 / 10 + 512);
  double imbalance = 0;
  for (auto _ : state) {
    kv_placement pl = place_longest_first(d, group_pages, cap);
    imbalance = pl.imbalance;
    benchmark::DoNotOptimize(pl);
  }
  state.counters["imbalance"] = imbalance;
  state.counters["seqs_per_s"] =
      benchmark::Counter(static_cast<double>(n), benchmark::Counter::kIsIterationInvariantRate);
}

}  // namespace

BENCHMARK(BM_place_longest_first)
    ->ArgNames({"seqs", "ranks", "groups"})
    ->Args({2048, 8, 0})
    ->Args({2048, 8, 1})
    ->Args({4096, 8, 0})
    ->Unit(benchmark::kMicrosecond);
BENCHMARK_MAIN();
