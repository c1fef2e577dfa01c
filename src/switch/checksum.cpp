#include "moebius/switch/checksum.hpp"

#include <algorithm>
#include <cstring>

#include "moebius/error.hpp"
#include "moebius/layout/weight_view.hpp"

namespace moebius {
namespace {

// splitmix64 finaliser: a cheap, well-mixed 64-bit hash.
constexpr uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

uint64_t load_element(const std::byte* p, int64_t bytes) {
  uint64_t v = 0;
  std::memcpy(&v, p, static_cast<size_t>(bytes));
  return v;
}

template <parallel_mode Mode>
uint64_t tensor_checksum(const arena_geometry& g, int64_t layer, weight_tensor t,
                         std::span<const std::span<const std::byte>> ranks) {
  const weight_view<Mode> view = make_view<Mode>(g.shape, t, g.num_ranks);
  const tensor_geometry& tg = view.tensor;
  const int64_t base = g.tensor_base(Mode, layer, t);
  uint64_t sum = 0;
  const uint64_t tensor_key = mix((static_cast<uint64_t>(layer) << 8) | static_cast<uint64_t>(t));
  for (int64_t e = 0; e < tg.num_experts; ++e) {
    for (int64_t row = 0; row < tg.rows; ++row) {
      for (int64_t col = 0; col < tg.cols; ++col) {
        const element_location at = view.locate(e, row, col);
        const std::byte* p = ranks[static_cast<size_t>(at.rank)].data() + base +
                             at.offset * tg.elem_bytes;
        const uint64_t coord = static_cast<uint64_t>((e * tg.rows + row) * tg.cols + col);
        sum += mix(tensor_key ^ mix(coord) ^ mix(load_element(p, tg.elem_bytes) + 0x51ed));
      }
    }
  }
  return sum;
}

}  // namespace

uint64_t weight_checksum(const arena_geometry& g, arena_cursor cursor, int64_t layer,
                         std::span<const std::span<const std::byte>> rank_arenas) {
  validate(g, cursor);
  MOEBIUS_CHECK(layer >= 0 && layer < g.shape.num_layers, errc::invalid_argument,
                "layer must lie in [0, L) (layer=", layer, ", L=", g.shape.num_layers, ")");
  MOEBIUS_CHECK(static_cast<int64_t>(rank_arenas.size()) == g.num_ranks, errc::invalid_argument,
                "weight_checksum needs one arena per rank (got ", rank_arenas.size(), ", P=",
                g.num_ranks, ")");
  for (const auto& a : rank_arenas) {
    MOEBIUS_CHECK(static_cast<int64_t>(a.size()) >= g.total_bytes(), errc::out_of_range,
                  "an arena of ", a.size(), " bytes is smaller than the geometry's ",
                  g.total_bytes());
  }
  uint64_t sum = 0;
  const bool tp = arena_geometry::mode_of(cursor, layer) == parallel_mode::tp;
  for (weight_tensor t : all_weight_tensors) {
    if (g.tensor_bytes[static_cast<int>(t)] == 0) continue;
    sum += tp ? tensor_checksum<parallel_mode::tp>(g, layer, t, rank_arenas)
              : tensor_checksum<parallel_mode::ep>(g, layer, t, rank_arenas);
  }
  return sum;
}

namespace {

// Layers [layer0, layer1) of kv_checksum.
uint64_t kv_layers_checksum(const kv_geometry& g, const kv_pool_layout& layout,
                            const kv_state& s, int64_t layer0, int64_t layer1,
                            std::span<const std::span<const std::byte>> rank_pools) {
  validate(g, s);
  validate(g, layout);
  MOEBIUS_CHECK(static_cast<int64_t>(rank_pools.size()) == g.num_ranks, errc::invalid_argument,
                "kv_checksum needs one pool per rank (got ", rank_pools.size(), ", P=",
                g.num_ranks, ")");
  for (const auto& pool : rank_pools) {
    MOEBIUS_CHECK(static_cast<int64_t>(pool.size()) >= layout.pool_bytes, errc::out_of_range,
                  "a pool of ", pool.size(), " bytes is smaller than the layout's ",
                  layout.pool_bytes);
  }
  const int64_t eb = dtype_bytes(g.type);
  const int64_t heads = g.heads_per_ep_page();
  // Where a token lies in s.mode: EP sequences are whole on their owner (no DCP share).
  kv_geometry places = g;
  if (s.mode == parallel_mode::ep) places.dcp = 1;
  // Sum over every element of `seq` held by `rank` in mode s.mode; `head0` is the global index
  // of the rank's first head (TP slice), `num_heads` how many it holds. With dcp > 1 the rank
  // holds the tokens of its DCP share only; the shares' sums add up to the sequence's.
  auto sequence_sum = [&](int rank, const kv_sequence& seq, int64_t head0, int64_t num_heads) {
    uint64_t sum = 0;
    const uint64_t seq_key = mix(static_cast<uint64_t>(seq.seq_id) * 0x2545f4914f6cdd1dULL);
    const int64_t share = share_of(g, s.mode, rank);
    for (int64_t layer = layer0; layer < layer1; ++layer) {
      for (int64_t kt = 0; kt < g.kv_tensors(); ++kt) {
        for (int64_t token = 0; token < seq.num_tokens; ++token) {
          const kv_token_place at = places.token_place(token);
          if (at.dcp_rank != share) continue;
          const int64_t page = seq.pages[static_cast<size_t>(at.local_page)];
          for (int64_t h = 0; h < num_heads; ++h) {
            for (int64_t d = 0; d < g.head_dim; ++d) {
              const int64_t off = layout.offset(s.mode, layer, static_cast<kv_tensor>(kt), page,
                                                h, at.slot, d);
              const uint64_t coord = static_cast<uint64_t>(
                  (((layer * 2 + kt) * seq.num_tokens + token) * heads + head0 + h) *
                      g.head_dim + d);
              const std::byte* p = rank_pools[static_cast<size_t>(rank)].data() + off;
              sum += mix(seq_key ^ mix(coord) ^ mix(load_element(p, eb) + 0x51ed));
            }
          }
        }
      }
    }
    return sum;
  };
  uint64_t sum = 0;
  if (s.mode == parallel_mode::ep) {
    for (int r = 0; r < g.num_ranks; ++r) {
      for (const kv_sequence& seq : s.ranks[static_cast<size_t>(r)].sequences) {
        sum += sequence_sum(r, seq, 0, heads);
      }
    }
  } else {
    // Slice j lives on ranks [j * replicas, (j + 1) * replicas), in replica sets of dcp ranks
    // that each hold one DCP share (dcp 1: sets of one rank). The first set counts; in each
    // other set, the rank of DCP index k adds twice its difference to the first set's rank of
    // index k: 0 when it holds the same K/V. A change d of one replica moves the sum by 2d
    // (another set) or d * (1 - 2 (sets - 1)), an odd multiple (the first), so neither cancels.
    const int64_t sets = g.tp_replica_sets();
    for (int64_t j = 0; j < g.tp_pages_per_ep_page(); ++j) {
      const int64_t head0 = j * g.heads_per_tp_page();
      for (int64_t k = 0; k < g.dcp; ++k) {
        const int first = static_cast<int>(g.tp_rank_of(j, 0, k));
        const auto& seqs = s.ranks[static_cast<size_t>(first)].sequences;
        for (size_t i = 0; i < seqs.size(); ++i) {
          const uint64_t ref = sequence_sum(first, seqs[i], head0, g.heads_per_tp_page());
          sum += ref;
          for (int64_t set = 1; set < sets; ++set) {
            // TP states hold the same sequences in the same order on every rank (validate()).
            const int r = static_cast<int>(g.tp_rank_of(j, set, k));
            const kv_sequence& q = s.ranks[static_cast<size_t>(r)].sequences[i];
            sum += 2 * (sequence_sum(r, q, head0, g.heads_per_tp_page()) - ref);
          }
        }
      }
    }
  }
  return sum;
}

}  // namespace

uint64_t kv_checksum(const kv_geometry& g, const kv_state& s,
                     std::span<const std::span<const std::byte>> rank_pools) {
  return kv_checksum(g, present_kv_layout(g), s, rank_pools);
}

uint64_t kv_layer_checksum(const kv_geometry& g, const kv_state& s, int64_t layer,
                           std::span<const std::span<const std::byte>> rank_pools) {
  return kv_layer_checksum(g, present_kv_layout(g), s, layer, rank_pools);
}

uint64_t kv_checksum(const kv_geometry& g, const kv_pool_layout& layout, const kv_state& s,
                     std::span<const std::span<const std::byte>> rank_pools) {
  return kv_layers_checksum(g, layout, s, 0, g.num_layers, rank_pools);
}

uint64_t kv_layer_checksum(const kv_geometry& g, const kv_pool_layout& layout, const kv_state& s,
                           int64_t layer, std::span<const std::span<const std::byte>> rank_pools) {
  MOEBIUS_CHECK(layer >= 0 && layer < g.num_layers, errc::invalid_argument,
                "kv_layer_checksum: layer must lie in [0, L) (layer=", layer, ", L=",
                g.num_layers, ")");
  return kv_layers_checksum(g, layout, s, layer, layer + 1, rank_pools);
}

}  // namespace moebius
