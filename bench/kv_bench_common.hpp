#pragma once

// KV states for the KV benchmarks, shared by the host bench (bench_kv_migration.cpp) and the
// GPU one (bench_kv_migration_gpu.cu): a Qwen3-235B-shaped pool (4 KV heads, head_dim 128, bf16,
// one layer) at a given occupancy, and the migration plan of it.

#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

#include "moebius/kv/kv_migration.hpp"
#include "moebius/kv/page_table.hpp"

namespace moebius::bench {

// Qwen3-235B KV per layer: H_kv=4, D=128, bf16, P ranks, `num_ep_pages` per rank.
inline kv_geometry qwen3_kv_geometry(int64_t page_size, int64_t num_ep_pages, int num_ranks = 8,
                                     int64_t num_layers = 1, kv_layout layout = kv_layout::hnd) {
  return make_kv_geometry(num_layers, 4, 128, page_size, num_ep_pages, num_ranks, dtype::bf16,
                          layout);
}

// EP pages per rank of the GPU benchmark's pools (bench_kv_migration_gpu.cu, 94 layers): 16 GiB
// of page size 16 HND (3 MiB per page over all tensors) and 4 GiB of page size 1 NHD (188 KiB).
// The plan's shape (rounds, ops) depends on the page count and P, not on the layer count.
inline int64_t gpu_bench_ep_pages(int64_t page_size) {
  const kv_geometry g = qwen3_kv_geometry(page_size, 1, 2, 94);
  return ep_pages_for_bytes(g, (page_size == 1 ? int64_t{4} : int64_t{16}) << 30);
}

// Sequences of 64..8192 tokens (random) filling `occupancy` of the pool in `mode`, pages
// taken from shuffled free lists (so TP states are fragmented), seeded deterministically.
inline kv_state random_kv_state(const kv_geometry& g, parallel_mode mode, double occupancy,
                                uint64_t seed = 1) {
  std::mt19937_64 rng(seed);
  const int P = g.num_ranks;
  const int64_t n = g.num_pages(mode);
  std::vector<std::vector<int64_t>> free_list(static_cast<size_t>(P));
  for (auto& f : free_list) {
    f.resize(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) f[static_cast<size_t>(i)] = i;
    std::shuffle(f.begin(), f.end(), rng);
  }
  std::vector<std::vector<kv_sequence>> tables(static_cast<size_t>(P));
  const bool tp = mode == parallel_mode::tp;
  std::vector<int64_t> used(static_cast<size_t>(P), 0);
  const auto target = static_cast<int64_t>(occupancy * static_cast<double>(n));
  int64_t id = 0;
  for (int misses = 0; misses < 64;) {
    const int owner = tp ? 0 : static_cast<int>(rng() % static_cast<uint64_t>(P));
    const auto tokens = static_cast<int64_t>(64 + rng() % 8129);
    const int64_t pages = pages_for_tokens(tokens, g.page_size);
    if (used[static_cast<size_t>(owner)] + pages > target) {
      ++misses;
      continue;
    }
    kv_sequence q;
    q.seq_id = id++;
    q.num_tokens = tokens;
    q.last_page_len = tokens - (pages - 1) * g.page_size;
    for (int r = 0; r < P; ++r) {
      if (!tp && r != owner) continue;
      kv_sequence t = q;
      auto& f = free_list[static_cast<size_t>(r)];
      t.pages.assign(f.end() - pages, f.end());
      f.resize(f.size() - static_cast<size_t>(pages));
      tables[static_cast<size_t>(r)].push_back(std::move(t));
    }
    used[static_cast<size_t>(owner)] += pages;
  }
  return make_kv_state(g, mode, std::move(tables));
}

// The plan of moving `s` to the other mode, with `staging_slots` slots of staging in the
// arena space (offset 0).
inline kv_migration build_kv_plan(const kv_geometry& g, const kv_state& s, int64_t staging_slots) {
  const parallel_mode target = s.mode == parallel_mode::ep ? parallel_mode::tp : parallel_mode::ep;
  kv_migration_options opt;
  opt.staging = {memory_space::arena, 0, staging_slots * kv_staging_slot_bytes(g, target)};
  return plan_kv_migration(g, s, target, opt);
}

}  // namespace moebius::bench
