#pragma once

// Random KV geometries and page-table states for the KV tests.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "kv_reference.hpp"
#include "moebius/kv/page_table.hpp"

namespace moebius::testing {

inline int64_t uni(std::mt19937_64& rng, int64_t lo, int64_t hi) {
  return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
}

template <class T, size_t N>
T pick_one(std::mt19937_64& rng, const T (&v)[N]) {
  return v[static_cast<size_t>(uni(rng, 0, static_cast<int64_t>(N) - 1))];
}

// A random allowed dcp for g (a divisor of tp_replicas(), so 1 when H_kv >= P), drawn fresh.
inline kv_geometry random_dcp(std::mt19937_64& rng, kv_geometry g) {
  const int64_t reps = g.tp_replicas();
  std::vector<int64_t> allowed;
  for (int64_t d = 1; d <= reps; ++d)
    if (reps % d == 0) allowed.push_back(d);
  g.dcp = allowed[static_cast<size_t>(uni(rng, 0, static_cast<int64_t>(allowed.size()) - 1))];
  validate(g);
  return g;
}

// A random valid geometry whose pool is about `budget` bytes per rank.
inline kv_geometry random_kv_geometry(std::mt19937_64& rng, int64_t budget) {
  static constexpr int ranks[] = {1, 2, 4, 8};
  static constexpr int64_t heads[] = {0, 1, 4, 8, 32};
  static constexpr int64_t dims[] = {1, 2, 4, 8};
  static constexpr int64_t sizes[] = {1, 16, 64};
  kv_geometry g;
  g.num_ranks = pick_one(rng, ranks);
  g.num_kv_heads = pick_one(rng, heads);
  g.head_dim = pick_one(rng, dims);
  g.num_layers = uni(rng, 1, 3);
  g.page_size = pick_one(rng, sizes);
  g.type = pick_one(rng, all_dtypes);
  g.layout = uni(rng, 0, 1) ? kv_layout::hnd : kv_layout::nhd;
  g.num_ep_pages = 1;
  const int64_t per_page = g.pool_bytes();
  g.num_ep_pages = std::clamp<int64_t>(budget / per_page, 2, 4096);
  validate(g);
  return g;
}

struct kv_case {
  kv_geometry g;
  kv_state state;
  content_map content;
  double occupancy = 0;  // pages used / pages of the view, all ranks
};

// Sequences (some in share groups, some mid-prefill) filling about `occupancy` of the pool in
// `mode`, at most `max_seqs` of them. TP pages are allocated independently (and randomly) on
// each rank, so TP states are fragmented. With g.dcp > 1 a TP rank of DCP index d (r % dcp)
// gets pages for logical pages d, d + dcp, .. only (written from the rule, not the library).
// `occupancy` is then rank 0's (the busiest share's).
inline kv_case random_kv_case(std::mt19937_64& rng, const kv_geometry& g, parallel_mode mode,
                              double occupancy, int64_t max_seqs, int64_t max_tokens = 0) {
  kv_case c;
  c.g = g;
  const int P = g.num_ranks;
  const int64_t N = g.num_pages(mode);
  const int64_t S = g.page_size;
  std::vector<std::vector<int64_t>> free_list(static_cast<size_t>(P));
  for (auto& f : free_list) {
    f.resize(static_cast<size_t>(N));
    for (int64_t i = 0; i < N; ++i) f[static_cast<size_t>(i)] = i;
    std::shuffle(f.begin(), f.end(), rng);
  }
  struct group {
    int owner;
    std::vector<std::vector<int64_t>> pages;  // [rank][k]
    int64_t key;
  };
  std::vector<group> groups;
  std::vector<std::vector<kv_sequence>> tables(static_cast<size_t>(P));
  const bool tp = mode == parallel_mode::tp;
  const int64_t D = tp ? g.dcp : 1;
  auto mine = [&](int r, int64_t k) { return k % D == r % D; };  // rank r holds logical page k
  auto on_rank0 = [&](int64_t n) {  // of logical pages [0, n), those of rank 0's share
    return (n + D - 1) / D;
  };
  const int64_t total = tp ? N : N * P;  // pages in the view (TP: per rank, all ranks alike)
  int64_t used = 0;                       // TP: pages used per rank
  const auto target = static_cast<int64_t>(occupancy * static_cast<double>(total));
  int64_t max_len = std::min<int64_t>(32768, std::max<int64_t>(1, N * S / 2));
  if (max_tokens > 0) max_len = std::min(max_len, max_tokens);
  int failures = 0;
  int64_t next_id = uni(rng, 0, 1000);
  // Whether logical pages [lo, hi) of a sequence find free pages: on its owner (EP), or on
  // every rank for its share of them (TP; with dcp > 1 rank 0 need not be the one that runs
  // out: a range past a shared prefix may hold more pages of another index).
  auto alloc_ok = [&](int owner, int64_t lo, int64_t hi) {
    const auto free_on = [&](int r) {
      return static_cast<int64_t>(free_list[static_cast<size_t>(r)].size());
    };
    if (!tp) return free_on(owner) >= hi - lo;
    for (int r = 0; r < P; ++r) {
      int64_t n = 0;
      for (int64_t k = lo; k < hi; ++k) n += mine(r, k);
      if (free_on(r) < n) return false;
    }
    return true;
  };
  auto alloc = [&](int r) {
    const int64_t p = free_list[static_cast<size_t>(r)].back();
    free_list[static_cast<size_t>(r)].pop_back();
    return p;
  };
  while (used < target && static_cast<int64_t>(c.content.size()) < max_seqs && failures < 40) {
    const int owner = tp ? 0 : static_cast<int>(uni(rng, 0, P - 1));
    const double lg = std::log(static_cast<double>(max_len));
    int64_t len = static_cast<int64_t>(std::exp(std::uniform_real_distribution<double>(0, lg)(rng)));
    len = std::clamp<int64_t>(len, 1, max_len);
    kv_sequence q;
    q.seq_id = next_id;
    q.prefill_cursor = uni(rng, 0, 3) == 0 ? uni(rng, 1, len) : 0;  // mid-prefill
    int64_t shared = 0;
    group* grp = nullptr;
    const int64_t roll = uni(rng, 0, 9);
    std::vector<int64_t> cand;
    for (size_t i = 0; i < groups.size(); ++i)
      if (groups[i].owner == owner) cand.push_back(static_cast<int64_t>(i));
    if (roll < 3 && !cand.empty()) {
      grp = &groups[static_cast<size_t>(cand[static_cast<size_t>(uni(rng, 0, static_cast<int64_t>(cand.size()) - 1))])];
      shared = uni(rng, 1, static_cast<int64_t>(grp->pages[0].size()));
    } else if (roll < 5) {
      const int64_t gp = uni(rng, 1, std::min<int64_t>(8, std::max<int64_t>(1, len / S)));
      if (!alloc_ok(owner, 0, gp)) {
        ++failures;
        continue;
      }
      group ng;
      ng.owner = owner;
      ng.key = 1000000000 + static_cast<int64_t>(groups.size());
      ng.pages.resize(static_cast<size_t>(P));
      for (int r = 0; r < P; ++r) {
        if (!tp && r != owner) continue;
        for (int64_t k = 0; k < gp; ++k)
          ng.pages[static_cast<size_t>(r)].push_back(mine(r, k) ? alloc(r) : -1);
      }
      if (!tp) ng.pages[0] = ng.pages[static_cast<size_t>(owner)];
      used += on_rank0(gp);
      groups.push_back(std::move(ng));
      grp = &groups.back();
      shared = gp;
    }
    if (grp) len = std::max(len, shared * S);
    const int64_t n = pages_for_tokens(len, S);
    if (!alloc_ok(owner, shared, n)) {
      ++failures;
      continue;
    }
    failures = 0;
    q.num_tokens = len;
    q.last_page_len = len - (n - 1) * S;
    q.shared_prefix_pages = shared;
    for (int r = 0; r < P; ++r) {
      if (!tp && r != owner) continue;
      kv_sequence t = q;
      for (int64_t k = 0; k < shared; ++k)
        if (mine(r, k))
          t.pages.push_back(grp->pages[static_cast<size_t>(tp ? r : owner)][static_cast<size_t>(k)]);
      for (int64_t k = shared; k < n; ++k)
        if (mine(r, k)) t.pages.push_back(alloc(r));
      tables[static_cast<size_t>(r)].push_back(std::move(t));
    }
    used += on_rank0(n) - on_rank0(shared);
    c.content[q.seq_id] = seq_content{grp ? grp->key : -1};
    next_id += uni(rng, 1, 3);
  }
  c.state = make_kv_state(g, mode, std::move(tables));
  c.occupancy = total == 0 ? 0.0 : static_cast<double>(used) / static_cast<double>(total);
  return c;
}

}  // namespace moebius::testing
