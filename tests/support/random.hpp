#pragma once

// Small random helpers for tests. Every test case seeds its own generator from test_seed()
// so one case can be replayed alone with -c and MOEBIUS_TEST_SEED.

#include <cstddef>
#include <cstdint>
#include <random>

#include "moebius/layout/arena_geometry.hpp"

namespace moebius::testing {

// Uniform integer in [lo, hi].
inline int64_t uniform(std::mt19937_64& rng, int64_t lo, int64_t hi) {
  return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
}

inline bool coin(std::mt19937_64& rng) { return (rng() & 1) != 0; }

// A uniformly chosen element of a non-empty array.
template <class T, size_t N>
T pick(std::mt19937_64& rng, const T (&values)[N]) {
  return values[static_cast<size_t>(uniform(rng, 0, static_cast<int64_t>(N) - 1))];
}

// A cursor in [0, L].
inline arena_cursor random_cursor(std::mt19937_64& rng, const arena_geometry& g) {
  return arena_cursor{uniform(rng, 0, g.shape.num_layers)};
}

// The arena of `shape` over `num_ranks` with small random power-of-two alignments (1 B..256 B
// for tensors, up to 4 KiB for slots), so host images stay small and odd offsets get tested.
inline arena_geometry random_geometry(std::mt19937_64& rng, const expert_shape& shape,
                                      int num_ranks) {
  const int64_t tensor_alignment = int64_t{1} << uniform(rng, 0, 8);
  const int64_t slot_alignment = tensor_alignment << uniform(rng, 0, 4);
  return make_arena_geometry(shape, num_ranks, tensor_alignment, slot_alignment);
}

}  // namespace moebius::testing
