#include "support/reference.hpp"

#include <cstdlib>
#include <cstring>
#include <iostream>
#include <numeric>
#include <sstream>
#include <stdexcept>

#include "support/random.hpp"

namespace moebius::testing {

uint64_t test_seed() {
  static const uint64_t seed = [] {
    uint64_t s = 0;
    if (const char* env = std::getenv("MOEBIUS_TEST_SEED"); env != nullptr && *env != '\0') {
      s = std::strtoull(env, nullptr, 0);
    } else {
      std::random_device rd;
      s = (static_cast<uint64_t>(rd()) << 32) ^ rd();
    }
    std::cout << "MOEBIUS_TEST_SEED=" << s << std::endl;
    return s;
  }();
  return seed;
}

logical_weights random_weights(const expert_shape& shape, std::mt19937_64& rng) {
  logical_weights w;
  w.shape = shape;
  w.layers.resize(static_cast<size_t>(shape.num_layers));
  for (auto& layer : w.layers) {
    for (weight_tensor t : all_weight_tensors) {
      std::vector<std::byte>& bytes = layer[static_cast<size_t>(t)];
      bytes.resize(static_cast<size_t>(geometry_of(shape, t).bytes()));
      for (size_t i = 0; i < bytes.size(); i += 8) {
        const uint64_t r = rng();
        const size_t n = std::min<size_t>(8, bytes.size() - i);
        std::memcpy(bytes.data() + i, &r, n);
      }
      if (!bytes.empty()) bytes[static_cast<size_t>(rng() % bytes.size())] |= std::byte{1};
    }
  }
  return w;
}

namespace {

bool splits_rows(weight_tensor t) {
  return t == weight_tensor::w13 || t == weight_tensor::w13_scale;
}

// Rank and byte offset within that rank's local tensor of logical element (e, r, c) of a
// tensor with R rows and C columns per expert, computed from the engines' loading rules.
struct home {
  int rank;
  int64_t byte;
};

home home_of(weight_tensor t, parallel_mode mode, const expert_shape& s, int P, int64_t E,
             int64_t R, int64_t C, int64_t eb, int64_t e, int64_t r, int64_t c) {
  if (mode == parallel_mode::ep) {
    const int64_t per = E / P;
    int64_t row = r;
    if (splits_rows(t)) {  // [gate; up] halves, stored in ep_order
      const int64_t half = R / 2;
      int64_t seg = r / half;
      if (s.ep_order == gate_up_order::up_first) seg = 1 - seg;
      row = seg * half + r % half;
    }
    return {static_cast<int>(e / per), (((e % per) * R + row) * C + c) * eb};
  }
  if (splits_rows(t)) {  // TP rank: its gate slice then its up slice (or up then gate)
    const int64_t half = R / 2;
    const int64_t slice = half / P;
    int64_t seg = r / half;
    const int64_t within = r % half;
    if (s.tp_order == gate_up_order::up_first) seg = 1 - seg;
    const int64_t row = seg * slice + within % slice;
    return {static_cast<int>(within / slice), ((e * 2 * slice + row) * C + c) * eb};
  }
  const int64_t slice = C / P;  // w2 / w2_scale: column slice
  return {static_cast<int>(c / slice), ((e * R + r) * slice + c % slice) * eb};
}

}  // namespace

reference_home reference_home_of(const expert_shape& s, int P, weight_tensor t,
                                 parallel_mode mode, int64_t e, int64_t row, int64_t col) {
  const tensor_geometry tg = geometry_of(s, t);
  const home h = home_of(t, mode, s, P, tg.num_experts, tg.rows, tg.cols, tg.elem_bytes, e, row, col);
  return {h.rank, h.byte};
}

void load_reference(const logical_weights& w, const arena_geometry& g, arena_cursor cursor,
                    rank_images& ranks) {
  const expert_shape& s = g.shape;
  const int P = g.num_ranks;
  const int64_t slots = s.num_layers + 1;
  const int64_t total = g.slot_bytes * slots;
  ranks.assign(static_cast<size_t>(P), std::vector<std::byte>(static_cast<size_t>(total), poison_byte));
  if (static_cast<int64_t>(w.layers.size()) != s.num_layers) {
    throw std::logic_error("load_reference: weights have the wrong number of layers");
  }
  for (int64_t l = 0; l < s.num_layers; ++l) {
    const bool tp = l < cursor.tp_layers;
    const parallel_mode mode = tp ? parallel_mode::tp : parallel_mode::ep;
    const int64_t slot = tp ? l : l + 1;
    for (weight_tensor t : all_weight_tensors) {
      const int ti = static_cast<int>(t);
      const tensor_geometry tg = geometry_of(s, t);
      const std::vector<std::byte>& src = w.layers[static_cast<size_t>(l)][static_cast<size_t>(ti)];
      const int64_t E = tg.num_experts, R = tg.rows, C = tg.cols, eb = tg.elem_bytes;
      if (static_cast<int64_t>(src.size()) != E * R * C * eb) {
        throw std::logic_error("load_reference: a weight tensor has the wrong size");
      }
      if (src.empty()) continue;
      const int64_t base = slot * g.slot_bytes + g.tensor_offset[ti];
      const int64_t local_bytes = E * R * C * eb / P;
      if (g.tensor_bytes[ti] != local_bytes) {
        throw std::logic_error("load_reference: arena tensor_bytes differs from E*rows*cols*eb/P");
      }
      const bool column_split = mode == parallel_mode::tp && !splits_rows(t);
      for (int64_t e = 0; e < E; ++e) {
        for (int64_t r = 0; r < R; ++r) {
          const std::byte* from = src.data() + (e * R + r) * C * eb;
          if (!column_split) {
            // The whole row lands on one rank, columns in order: locate column 0 only.
            const home h = home_of(t, mode, s, P, E, R, C, eb, e, r, 0);
            std::byte* to = ranks[static_cast<size_t>(h.rank)].data() + base + h.byte;
            for (int64_t c = 0; c < C; ++c) {
              std::memcpy(to + c * eb, from + c * eb, static_cast<size_t>(eb));
            }
          } else {
            // w2 / w2_scale in TP: column c goes to rank c / (C/P); walk rank by rank.
            const int64_t slice = C / P;
            for (int rank = 0; rank < P; ++rank) {
              const home h = home_of(t, mode, s, P, E, R, C, eb, e, r, rank * slice);
              std::byte* to = ranks[static_cast<size_t>(h.rank)].data() + base + h.byte;
              for (int64_t c = 0; c < slice; ++c) {
                std::memcpy(to + c * eb, from + (rank * slice + c) * eb, static_cast<size_t>(eb));
              }
            }
          }
        }
      }
    }
  }
}

std::string compare_to_reference(const logical_weights& w, const arena_geometry& g,
                                 arena_cursor cursor, const rank_images& ranks,
                                 padding_rule padding) {
  rank_images expected;
  load_reference(w, g, cursor, expected);
  if (padding == padding_rule::end_slots_unknown) {
    // Slots 0 and L were free at some cursor and may have staged KV: take their padding from
    // the image, so that only their tensor bytes are compared.
    const int64_t L = g.shape.num_layers;
    std::vector<bool> tensor(static_cast<size_t>(g.slot_bytes), false);  // same in every slot
    for (weight_tensor t : all_weight_tensors) {
      const int ti = static_cast<int>(t);
      for (int64_t b = 0; b < g.tensor_bytes[ti]; ++b)
        tensor[static_cast<size_t>(g.tensor_offset[ti] + b)] = true;
    }
    for (size_t r = 0; r < ranks.size() && r < expected.size(); ++r) {
      if (ranks[r].size() != expected[r].size()) continue;  // reported below
      for (const int64_t slot : {int64_t{0}, L}) {
        for (int64_t b = 0; b < g.slot_bytes; ++b) {
          const size_t i = static_cast<size_t>(slot * g.slot_bytes + b);
          if (!tensor[static_cast<size_t>(b)]) expected[r][i] = ranks[r][i];
        }
      }
    }
  }
  std::ostringstream os;
  if (ranks.size() != expected.size()) {
    os << "got " << ranks.size() << " rank images, expected " << expected.size();
    return os.str();
  }
  const int64_t slots = g.shape.num_layers + 1;
  for (size_t r = 0; r < ranks.size(); ++r) {
    if (ranks[r].size() != expected[r].size()) {
      os << "rank " << r << " image has " << ranks[r].size() << " bytes, expected "
         << expected[r].size();
      return os.str();
    }
    for (int64_t slot = 0; slot < slots; ++slot) {
      if (slot == cursor.tp_layers) continue;  // the free slot holds leftovers
      const size_t begin = static_cast<size_t>(slot * g.slot_bytes);
      const size_t end = begin + static_cast<size_t>(g.slot_bytes);
      if (std::memcmp(ranks[r].data() + begin, expected[r].data() + begin, end - begin) == 0) {
        continue;
      }
      size_t i = begin;
      while (ranks[r][i] == expected[r][i]) ++i;
      const int64_t in_slot = static_cast<int64_t>(i - begin);
      const bool tp = slot < cursor.tp_layers;
      os << "rank " << r << ", slot " << slot << " (layer " << (tp ? slot : slot - 1) << ' '
         << (tp ? "TP" : "EP") << "), ";
      const char* what = "padding";
      int64_t off = in_slot;
      for (weight_tensor t : all_weight_tensors) {
        const int ti = static_cast<int>(t);
        if (in_slot >= g.tensor_offset[ti] && in_slot < g.tensor_offset[ti] + g.tensor_bytes[ti]) {
          what = to_string(t);
          off = in_slot - g.tensor_offset[ti];
        }
      }
      os << "tensor " << what << ", byte " << off << " (slot byte " << in_slot << "): expected 0x"
         << std::hex << std::to_integer<int>(expected[r][i]) << ", got 0x"
         << std::to_integer<int>(ranks[r][i]) << std::dec;
      return os.str();
    }
  }
  return "";
}

namespace {
constexpr int64_t k_layer_budget_bytes = 96 * 1024;  // logical bytes of one layer, roughly
}

expert_shape random_shape(std::mt19937_64& rng, int num_ranks, bool block_scales) {
  const int64_t P = num_ranks;
  expert_shape s;
  s.num_layers = uniform(rng, 1, 6);
  s.weight_dtype = pick(rng, all_dtypes);
  s.ep_order = coin(rng) ? gate_up_order::up_first : gate_up_order::gate_first;
  s.tp_order = coin(rng) ? gate_up_order::up_first : gate_up_order::gate_first;
  s.block_scales = block_scales;
  int64_t budget = k_layer_budget_bytes;
  if (block_scales) {
    static constexpr int64_t small_blocks[] = {1, 2, 4, 8, 16};
    s.scale_dtype = pick(rng, all_dtypes);
    if (P <= 4 && uniform(rng, 0, 5) == 0) {
      // Real 128-wide blocks: one block per TP slice, fp8 weights, few layers.
      s.scale_block_n = coin(rng) ? 128 : pick(rng, small_blocks);
      s.scale_block_k = s.scale_block_n == 128 && coin(rng) ? pick(rng, small_blocks) : 128;
      s.weight_dtype = coin(rng) ? dtype::fp8_e4m3 : dtype::fp8_e5m2;
      s.num_layers = uniform(rng, 1, 2);
      budget = 0;  // one expert per rank, whatever it costs
    } else {
      s.scale_block_n = pick(rng, small_blocks);
      s.scale_block_k = pick(rng, small_blocks);
    }
    const int64_t q = std::lcm(s.scale_block_n, s.scale_block_k);
    // I/P and H whole blocks in both directions.
    s.intermediate = P * q * (q >= 16 ? 1 : uniform(rng, 1, 2));
    s.hidden = q * (q >= 16 ? 1 : uniform(rng, 1, 3));
  } else {
    s.intermediate = P * uniform(rng, 1, 4);
    s.hidden = uniform(rng, 1, 24);
  }
  const int64_t per_expert = 3 * s.hidden * s.intermediate * dtype_bytes(s.weight_dtype);
  const int64_t k_max = std::max<int64_t>(1, std::min<int64_t>(256 / P, budget / (P * per_expert)));
  const int64_t k = coin(rng) ? k_max : uniform(rng, 1, k_max);
  s.num_experts = P * k;
  return s;
}

void scribble_slot(const arena_geometry& g, int64_t slot, rank_images& ranks,
                   std::mt19937_64& rng) {
  for (std::vector<std::byte>& image : ranks) {
    for (int ti = 0; ti < num_weight_tensors; ++ti) {
      const int64_t begin = slot * g.slot_bytes + g.tensor_offset[ti];
      for (int64_t i = 0; i < g.tensor_bytes[ti]; i += 8) {
        const uint64_t r = rng();
        std::memcpy(image.data() + begin + i, &r,
                    static_cast<size_t>(std::min<int64_t>(8, g.tensor_bytes[ti] - i)));
      }
    }
  }
}

}  // namespace moebius::testing
