#pragma once

// Geometry of the offset-aliased expert arena (DESIGN.md §3).
//
// One allocation per rank of L+1 equal slots. TP layer i lives in slot i; EP layer i lives in
// slot i+1. Within a slot the four tensors sit at fixed offsets, identical for both views
// (they hold the same bytes per rank), so a CUDA graph captured for either view reads fixed
// addresses forever.
//
// The cursor k records how far a switch got: layers [0, k) are TP, layers [k, L) are EP and
// slot k is the free one. k = 0 is all-EP, k = L is all-TP; every k is a valid resting state.

#include <cstdint>
#include <iosfwd>

#include "moebius/layout/expert_shape.hpp"
#include "moebius/layout/weight_view.hpp"

namespace moebius {

// Layers [0, tp_layers) are in TP form, the rest in EP form.
struct arena_cursor {
  int64_t tp_layers = 0;

  friend constexpr bool operator==(arena_cursor, arena_cursor) = default;
};

struct arena_geometry {
  expert_shape shape;
  int num_ranks = 1;
  int64_t tensor_alignment = 0;                  // alignment of each tensor within a slot
  int64_t tensor_offset[num_weight_tensors]{};   // byte offset of each tensor within a slot
  int64_t tensor_bytes[num_weight_tensors]{};    // bytes of each tensor per rank per layer
  int64_t slot_bytes = 0;                        // bytes of one slot (aligned to slot alignment)

  // Slots per rank: L + 1.
  constexpr int64_t num_slots() const { return shape.num_layers + 1; }
  // Bytes of one rank's arena: slot_bytes * (L + 1).
  constexpr int64_t total_bytes() const { return slot_bytes * num_slots(); }
  constexpr int64_t slot_offset(int64_t slot) const { return slot * slot_bytes; }

  // Expert bytes one rank holds per layer (same in EP and TP), without padding.
  constexpr int64_t layer_bytes_per_rank() const {
    int64_t sum = 0;
    for (int64_t b : tensor_bytes) sum += b;
    return sum;
  }
  // Expert bytes one rank holds for the whole stack in a static deployment: L * layer bytes.
  constexpr int64_t static_bytes_per_rank() const {
    return layer_bytes_per_rank() * shape.num_layers;
  }
  // What the arena costs beyond a static deployment: the spare slot plus alignment padding.
  constexpr int64_t overhead_bytes() const { return total_bytes() - static_bytes_per_rank(); }
  // overhead_bytes / static_bytes_per_rank: about 1/L (Qwen3-235B, L=94: 1.06%).
  constexpr double overhead_fraction() const {
    return static_cast<double>(overhead_bytes()) / static_cast<double>(static_bytes_per_rank());
  }

  // Slot that holds `layer` in `mode`: TP layer i -> slot i, EP layer i -> slot i+1.
  static constexpr int64_t slot_of(parallel_mode mode, int64_t layer) {
    return mode == parallel_mode::tp ? layer : layer + 1;
  }
  static constexpr parallel_mode mode_of(arena_cursor c, int64_t layer) {
    return layer < c.tp_layers ? parallel_mode::tp : parallel_mode::ep;
  }
  // The free slot at cursor c is slot c.tp_layers.
  static constexpr int64_t free_slot(arena_cursor c) { return c.tp_layers; }

  // Byte offset of tensor t of `layer` within one rank's arena when the layer is in `mode`.
  constexpr int64_t tensor_base(parallel_mode mode, int64_t layer, weight_tensor t) const {
    return slot_offset(slot_of(mode, layer)) + tensor_offset[static_cast<int>(t)];
  }
};

inline constexpr int64_t default_tensor_alignment = 256;         // 16-byte vectors, cudaMalloc
inline constexpr int64_t default_slot_alignment = int64_t{2} << 20;  // 2 MiB: IPC/VMM granule

// Validates `shape` over `num_ranks` (see validate()) and lays out one rank's arena. Throws
// errc::invalid_argument for alignments that are not powers of two or a slot alignment that
// is not a multiple of the tensor alignment, errc::overflow when the arena's byte count does
// not fit in 64 bits. Allocates nothing.
//   Qwen3-235B, P=8, bf16: w13 402,653,184 B + w2 201,326,592 B per rank per layer;
//   slot 603,979,776 B (already 2 MiB aligned), 95 slots, overhead 1/94 = 1.06%.
arena_geometry make_arena_geometry(const expert_shape& shape, int num_ranks,
                                   int64_t tensor_alignment = default_tensor_alignment,
                                   int64_t slot_alignment = default_slot_alignment);

// Re-checks a geometry that may have been edited after make_arena_geometry() (its fields are
// public): throws errc::invalid_argument unless the shape is valid over num_ranks (validate
// above), tensor_alignment is a power of two, every tensor_bytes[t] is what the views of that
// shape hold per rank, the tensors sit in order at tensor_alignment-aligned offsets without
// overlapping, and slot_bytes holds them all; errc::overflow when the arena's byte count does
// not fit in 64 bits. O(1); every plan builder calls it on the geometry it receives.
//   g = make_arena_geometry(qwen3, 8); g.num_ranks = 4;  validate(g) -> throws (w13 holds
//   805,306,368 B per rank at P=4, the geometry says 402,653,184)
void validate(const arena_geometry& geometry);

// validate(geometry), then throws errc::invalid_argument unless 0 <= cursor.tp_layers <= L.
void validate(const arena_geometry& geometry, arena_cursor cursor);

std::ostream& operator<<(std::ostream& os, const arena_geometry& g);

}  // namespace moebius
