#pragma once

// An independent, deliberately naive model of where a static deployment keeps each expert
// byte, for tests. It shares nothing with the library's views or plan builders: only the
// arena's tensor offsets and slot size (arena_geometry) and the logical tensor extents
// (geometry_of). A switch is correct when the arena afterwards equals what a static load at
// the new cursor would have written, byte for byte.

#include <array>
#include <cstddef>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "moebius/layout/arena_geometry.hpp"
#include "moebius/layout/expert_shape.hpp"
#include "moebius/layout/weight_view.hpp"

namespace moebius::testing {

// Seed for a test: env MOEBIUS_TEST_SEED if set, else std::random_device; printed once to
// stdout ("MOEBIUS_TEST_SEED=<n>") so a failure can be replayed.
uint64_t test_seed();

// Logical expert weights of a layer stack, as a checkpoint stores them: layers[l][t] is tensor
// t of layer l, [E, rows, cols] row-major in canonical [gate; up] order (rows/cols from the
// table in weight_view.hpp). Absent scale tensors are empty.
struct logical_weights {
  expert_shape shape;
  std::vector<std::array<std::vector<std::byte>, num_weight_tensors>> layers;
};

// Random bytes for every tensor of every layer; no present tensor is all zero.
logical_weights random_weights(const expert_shape& shape, std::mt19937_64& rng);

// One host "arena" per rank, each geometry.total_bytes() long.
using rank_images = std::vector<std::vector<std::byte>>;

// Byte every fresh image is filled with; padding is never written, so it stays this value.
inline constexpr std::byte poison_byte{0xA5};

// Allocates P images of total_bytes filled with poison_byte and writes the weights at
// `cursor` the way an engine loads a static deployment: EP rank r holds experts
// [r*E/P, (r+1)*E/P); TP rank r holds, per expert, its gate rows slice then its up rows slice
// (vLLM _load_w13, SGLang FusedMoE), halves swapped for up_first, and w2 column slice r.
// Layer l goes to slot l (TP, l < cursor.tp_layers) or slot l+1 (EP). Plain nested loops
// over (expert, row, col); uses nothing of the library but geometry_of() and the arena's
// tensor offsets and slot size.
void load_reference(const logical_weights& w, const arena_geometry& g, arena_cursor cursor,
                    rank_images& ranks);

// Where load_reference puts logical element (e, row, col) of tensor t in `mode` over
// `num_ranks` ranks: the rank and the byte offset within that rank's local tensor (add the
// arena's tensor base to get an arena offset).
struct reference_home {
  int rank;
  int64_t byte;
};
reference_home reference_home_of(const expert_shape& shape, int num_ranks, weight_tensor t,
                                 parallel_mode mode, int64_t e, int64_t row, int64_t col);

// What compare_to_reference expects of padding.
enum class padding_rule {
  poison,             // every slot's padding still holds poison_byte: nothing wrote it
  end_slots_unknown,  // as poison, except slots 0 and L: a switcher stages KV through the free
                      // slot (slot L in TP, 0 in EP), padding included, and a layer that moves
                      // in later writes only its tensors
};

// Compares every byte of every occupied slot (all but the free one) of every rank with what
// load_reference would write at `cursor` (padding as `padding` says). "" when equal, else the
// first mismatch: rank, slot, layer, tensor, byte offset, expected, got.
std::string compare_to_reference(const logical_weights& w, const arena_geometry& g,
                                 arena_cursor cursor, const rank_images& ranks,
                                 padding_rule padding = padding_rule::poison);

// A random valid shape for `num_ranks` ranks, small enough that a whole EP->TP->EP on the host
// takes well under 100 ms: L in 1..6, E = P*k (<= 256 when P allows), any dtype of
// all_dtypes, independent random ep_order/tp_order, and with `block_scales` random block
// sizes from {1,2,4,8,16} (or 128 when it fits) satisfying every divisibility rule.
expert_shape random_shape(std::mt19937_64& rng, int num_ranks, bool block_scales);

// Fills the tensor bytes (not the padding) of `slot` on every rank with random bytes: a
// destination that a switch forgets to write then differs from the reference.
void scribble_slot(const arena_geometry& g, int64_t slot, rank_images& ranks,
                   std::mt19937_64& rng);

}  // namespace moebius::testing
