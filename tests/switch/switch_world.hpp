#pragma once

// A small serving state for switcher tests: arenas loaded by the independent reference, a KV
// pool of random bytes with random EP sequences, and what the tests compare.
#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "moebius/kv/kv_geometry.hpp"
#include "moebius/kv/page_table.hpp"
#include "moebius/layout/arena_geometry.hpp"
#include "moebius/memory/rank_memory.hpp"
#include "moebius/switch/checksum.hpp"
#include "moebius/switch/progressive.hpp"
#include "moebius/switch/switch_report.hpp"
#include "moebius/switch/switcher.hpp"
#include "support/reference.hpp"

namespace moebius::testing {


using namespace moebius;

// A small serving state: arenas loaded by the reference at `mode`, a KV pool with random
// sequences in `mode` filled with random bytes.
struct world {
  expert_shape shape;
  arena_geometry weights;
  kv_geometry kv;
  testing::logical_weights logical;
  rank_images arenas;
  rank_images pools;
  kv_state tables;
  std::vector<rank_memory> memory;

  std::vector<std::span<const std::byte>> arena_spans() const {
    return {arenas.begin(), arenas.end()};
  }
  std::vector<std::span<const std::byte>> pool_spans() const {
    return {pools.begin(), pools.end()};
  }
};

// Random EP tables using about `occupancy` of every rank's pool.
inline kv_state random_ep_tables(const kv_geometry& g, double occupancy, std::mt19937_64& rng) {
  std::vector<std::vector<kv_sequence>> tables(static_cast<size_t>(g.num_ranks));
  int64_t next_id = 1;
  for (int r = 0; r < g.num_ranks; ++r) {
    std::vector<int64_t> free(static_cast<size_t>(g.num_ep_pages));
    for (int64_t p = 0; p < g.num_ep_pages; ++p) free[static_cast<size_t>(p)] = p;
    std::shuffle(free.begin(), free.end(), rng);
    auto budget = static_cast<int64_t>(occupancy * static_cast<double>(g.num_ep_pages));
    size_t used = 0;
    while (budget > 0) {
      const int64_t pages = std::uniform_int_distribution<int64_t>(1, std::min<int64_t>(budget, 5))(rng);
      kv_sequence s;
      s.seq_id = next_id++;
      s.last_page_len = std::uniform_int_distribution<int64_t>(1, g.page_size)(rng);
      s.num_tokens = (pages - 1) * g.page_size + s.last_page_len;
      s.prefill_cursor = s.num_tokens;
      for (int64_t i = 0; i < pages; ++i) s.pages.push_back(free[used++]);
      tables[static_cast<size_t>(r)].push_back(std::move(s));
      budget -= pages;
    }
  }
  return make_kv_state(g, parallel_mode::ep, std::move(tables));
}

// A world of the given arena and KV geometries (the ranks are kv.num_ranks): reference experts
// in EP, a pool of random bytes, random EP tables using about `occupancy` of it.
inline world make_world(std::mt19937_64& rng, const arena_geometry& weights, const kv_geometry& kv,
                        double occupancy) {
  const int P = kv.num_ranks;
  world w;
  w.shape = weights.shape;
  w.weights = weights;
  w.kv = kv;
  w.logical = testing::random_weights(w.shape, rng);
  testing::load_reference(w.logical, w.weights, arena_cursor{0}, w.arenas);
  w.pools.assign(static_cast<size_t>(P), std::vector<std::byte>(static_cast<size_t>(w.kv.pool_bytes())));
  for (auto& pool : w.pools) {
    for (auto& b : pool) b = static_cast<std::byte>(rng());
  }
  w.tables = random_ep_tables(w.kv, occupancy, rng);
  w.memory.resize(static_cast<size_t>(P));
  for (int r = 0; r < P; ++r) {
    w.memory[static_cast<size_t>(r)].spaces[0] = w.arenas[static_cast<size_t>(r)];
    w.memory[static_cast<size_t>(r)].spaces[1] = w.pools[static_cast<size_t>(r)];
  }
  return w;
}

// `same_layers`: as many KV layers as MoE layers (a progressive switch moves them together).
inline world make_world(std::mt19937_64& rng, int P, double occupancy, bool same_layers = false) {
  const expert_shape shape = testing::random_shape(rng, P, false);
  const int64_t head_choices[] = {1, 2, 4, 8};
  int64_t heads = 0;
  do {  // H_kv and P must nest: P | H_kv or H_kv | P
    heads = head_choices[std::uniform_int_distribution<int>(0, 3)(rng)];
  } while (!(heads % P == 0 || P % heads == 0));
  const int64_t kv_layers =
      same_layers ? shape.num_layers : std::uniform_int_distribution<int64_t>(1, 3)(rng);
  const kv_geometry kv = make_kv_geometry(kv_layers, heads,
                                          std::uniform_int_distribution<int64_t>(1, 8)(rng),
                                          std::uniform_int_distribution<int64_t>(1, 8)(rng),
                                          std::uniform_int_distribution<int64_t>(4, 24)(rng), P);
  return make_world(rng, make_arena_geometry(shape, P), kv, occupancy);
}

// A world as make_world's whose KV geometry has P/H_kv > 1 and dcp = a random divisor > 1 of
// it (a TP view that splits each head's tokens, issue 40).
inline world make_dcp_world(std::mt19937_64& rng, int P, double occupancy, bool same_layers = false) {
  for (;;) {
    world w = make_world(rng, P, occupancy, same_layers);
    const int64_t reps = w.kv.tp_replicas();
    if (reps == 1) continue;
    std::vector<int64_t> allowed;
    for (int64_t d = 2; d <= reps; ++d)
      if (reps % d == 0) allowed.push_back(d);
    const auto pick = std::uniform_int_distribution<size_t>(0, allowed.size() - 1)(rng);
    w.kv = with_dcp(w.kv, allowed[pick]);
    return w;
  }
}

// A P=2 world with H_kv=1 at 95% occupancy, which TP cannot hold: every head lives on both TP
// ranks, so TP holds half of what EP holds.
inline world make_world_tp_cannot_hold(std::mt19937_64& rng, bool same_layers = false) {
  for (;;) {
    world w = make_world(rng, 2, 0.95, same_layers);
    if (w.kv.num_kv_heads == 1) return w;
  }
}

// Bytes of every page in use, per rank, in table order: equal before and after means the
// live KV is byte-identical (free pages may hold anything).
inline std::vector<std::vector<std::byte>> live_kv_bytes(const world& w, const kv_state& s) {
  std::vector<std::vector<std::byte>> out(static_cast<size_t>(w.kv.num_ranks));
  const int64_t page = w.kv.page_bytes(s.mode);
  for (int r = 0; r < w.kv.num_ranks; ++r) {
    for (const kv_sequence& seq : s.ranks[static_cast<size_t>(r)].sequences) {
      for (int64_t p : seq.pages) {
        for (int64_t t = 0; t < w.kv.num_tensors(); ++t) {
          const std::byte* src = w.pools[static_cast<size_t>(r)].data() + t * w.kv.region_bytes() + p * page;
          out[static_cast<size_t>(r)].insert(out[static_cast<size_t>(r)].end(), src, src + page);
        }
      }
    }
  }
  return out;
}

// "" when every tensor byte of every slot but `free_slot` is equal in `a` and `b` (padding
// between tensors is not live: KV staging in the free slot may leave bytes there).
inline std::string arena_diff(const world& w, const rank_images& a, const rank_images& b,
                       int64_t free_slot) {
  for (size_t r = 0; r < a.size(); ++r) {
    for (int64_t slot = 0; slot < w.weights.num_slots(); ++slot) {
      if (slot == free_slot) continue;
      for (weight_tensor t : all_weight_tensors) {
        const int64_t off = w.weights.slot_offset(slot) + w.weights.tensor_offset[static_cast<int>(t)];
        const auto n = static_cast<size_t>(w.weights.tensor_bytes[static_cast<int>(t)]);
        if (std::memcmp(a[r].data() + off, b[r].data() + off, n) != 0) {
          return "rank " + std::to_string(r) + " slot " + std::to_string(slot) + " " + to_string(t);
        }
      }
    }
  }
  return "";
}

// "" when `b` moved what `a` moved: outcome, weight phases, KV rounds and bytes sent per rank;
// otherwise the first field that differs.
inline std::string moves_diff(const switch_report& a, const switch_report& b) {
  if (a.outcome != b.outcome) return "outcome";
  if (a.weight_phases != b.weight_phases) return "weight_phases";
  if (a.kv_rounds != b.kv_rounds) return "kv_rounds";
  if (a.weight_bytes_sent != b.weight_bytes_sent) return "weight_bytes_sent";
  if (a.kv_bytes_sent != b.kv_bytes_sent) return "kv_bytes_sent";
  return "";
}

inline int64_t sum(const std::vector<int64_t>& v) {
  return std::accumulate(v.begin(), v.end(), int64_t{0});
}

// Runs the switch to `target` on `sw`, stop-the-world or progressively (`per_advance` layers an
// advance, waiting for each); the report.
inline switch_report run_switch(switcher& sw, parallel_mode target, bool progressive,
                                int64_t per_advance) {
  if (!progressive) return sw.switch_to(target);
  progressive_switch s = sw.begin(target);
  if (!s.open()) return s.report();
  while (s.open() && s.layers_remaining() > 0) {
    s.advance(per_advance);
    s.wait();
  }
  return s.open() ? s.finish() : s.report();
}

inline uint64_t state_checksum(const world& w, arena_cursor c, const kv_state& s) {
  const auto arenas = w.arena_spans();
  const auto pool_images = w.pool_spans();
  uint64_t sum = kv_checksum(w.kv, s, pool_images);
  for (int64_t l = 0; l < w.shape.num_layers; ++l) sum += 31 * weight_checksum(w.weights, c, l, arenas);
  return sum;
}

}  // namespace moebius::testing
