#pragma once

// Small valid inputs for every public entry, for the tests that break one field at a time
// (input-validation classes, the error catalogue) and for the fuzz targets' regression tests.

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "moebius/kv/kv_geometry.hpp"
#include "moebius/kv/page_table.hpp"
#include "moebius/layout/arena_geometry.hpp"
#include "moebius/transport/host_transport.hpp"

namespace moebius::testing {

// L=2, E=4, H=8, I=8, bf16: over P=2 each rank holds w13 512 B + w2 256 B per layer.
inline expert_shape small_shape() {
  expert_shape s;
  s.num_layers = 2;
  s.num_experts = 4;
  s.hidden = 8;
  s.intermediate = 8;
  return s;
}

// small_shape() over 2 ranks, 64-byte tensor and slot alignment: slot 768 B, 3 slots.
inline arena_geometry small_arena() { return make_arena_geometry(small_shape(), 2, 64, 64); }

// 2 layers, H_kv 2, D 4, page_size 4, 8 EP pages per rank, P=2, bf16 HND: 64-byte EP pages,
// a 2048-byte pool per rank.
inline kv_geometry small_kv() { return make_kv_geometry(2, 2, 4, 4, 8, 2); }

inline kv_sequence sequence(int64_t id, std::vector<int64_t> pages, int64_t last_page_len,
                            int64_t page_size, int64_t shared_prefix_pages = 0) {
  kv_sequence q;
  q.seq_id = id;
  q.pages = std::move(pages);
  q.last_page_len = last_page_len;
  q.num_tokens = (q.num_pages() - 1) * page_size + last_page_len;
  q.shared_prefix_pages = shared_prefix_pages;
  return q;
}

// EP: rank 0 holds sequence 1 (pages 0, 1; 6 tokens), rank 1 sequence 2 (page 3; 3 tokens).
inline kv_state small_ep_state(const kv_geometry& g) {
  return make_kv_state(g, parallel_mode::ep,
                       {{sequence(1, {0, 1}, 2, g.page_size)}, {sequence(2, {3}, 3, g.page_size)}});
}

// Host memory of P ranks: an arena and a KV pool each, zero-filled.
struct host_world {
  std::vector<std::vector<std::byte>> arenas, pools;
  std::vector<rank_memory> memory;

  host_world(const arena_geometry& a, const kv_geometry& k) {
    const auto P = static_cast<size_t>(a.num_ranks);
    arenas.assign(P, std::vector<std::byte>(static_cast<size_t>(a.total_bytes())));
    pools.assign(P, std::vector<std::byte>(static_cast<size_t>(k.pool_bytes())));
    memory.resize(P);
    for (size_t r = 0; r < P; ++r) {
      memory[r].spaces[static_cast<int>(memory_space::arena)] = arenas[r];
      memory[r].spaces[static_cast<int>(memory_space::kv_pool)] = pools[r];
    }
  }
};

}  // namespace moebius::testing
