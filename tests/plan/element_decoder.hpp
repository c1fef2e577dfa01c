#pragma once

// Inverse of the reference placement: which logical byte (layer, tensor, expert, row, col,
// byte within the element) sits at a given arena byte of a rank, for an arena at a given
// cursor. Lets a test check what each copy op means without running it: its source byte and
// destination byte must be the same logical byte. Written from the loading rules, not from
// weight_view.

#include <cstdint>
#include <optional>
#include <ostream>

#include "moebius/layout/arena_geometry.hpp"
#include "moebius/layout/weight_view.hpp"

namespace moebius::testing {

struct logical_byte {
  int64_t layer, tensor, e, row, col, byte;

  friend bool operator==(const logical_byte&, const logical_byte&) = default;
  friend std::ostream& operator<<(std::ostream& os, const logical_byte& b) {
    return os << "{layer " << b.layer << ", tensor " << b.tensor << ", e " << b.e << ", row "
              << b.row << ", col " << b.col << ", byte " << b.byte << '}';
  }
};

// The logical byte at arena byte `offset` of `rank` when the arena rests at `cursor`, or
// nullopt for the free slot and padding.
inline std::optional<logical_byte> decode(const arena_geometry& g, arena_cursor cursor, int rank,
                                          int64_t offset) {
  const expert_shape& s = g.shape;
  const int64_t P = g.num_ranks;
  const int64_t slot = offset / g.slot_bytes;
  const int64_t in_slot = offset % g.slot_bytes;
  if (offset < 0 || slot > s.num_layers || slot == cursor.tp_layers) return std::nullopt;
  const bool tp = slot < cursor.tp_layers;
  const int64_t layer = tp ? slot : slot - 1;
  for (int t = 0; t < num_weight_tensors; ++t) {
    if (in_slot < g.tensor_offset[t] || in_slot >= g.tensor_offset[t] + g.tensor_bytes[t]) {
      continue;
    }
    const tensor_geometry tg = geometry_of(s, static_cast<weight_tensor>(t));
    const int64_t R = tg.rows, C = tg.cols, eb = tg.elem_bytes, E = tg.num_experts;
    const int64_t local = in_slot - g.tensor_offset[t];
    const int64_t elem = local / eb;
    logical_byte b{layer, t, 0, 0, 0, local % eb};
    const bool rows_split = t == 0 || t == 2;  // w13, w13_scale
    if (!tp) {
      const int64_t per = E / P;
      b.e = rank * per + elem / (R * C);
      const int64_t stored_row = elem % (R * C) / C;
      b.col = elem % C;
      b.row = stored_row;
      if (rows_split) {
        const int64_t half = R / 2;
        int64_t seg = stored_row / half;
        if (s.ep_order == gate_up_order::up_first) seg = 1 - seg;
        b.row = seg * half + stored_row % half;
      }
    } else if (rows_split) {
      const int64_t half = R / 2, slice = half / P;
      b.e = elem / (2 * slice * C);
      const int64_t local_row = elem % (2 * slice * C) / C;
      b.col = elem % C;
      int64_t seg = local_row / slice;
      if (s.tp_order == gate_up_order::up_first) seg = 1 - seg;
      b.row = seg * half + rank * slice + local_row % slice;
    } else {
      const int64_t slice = C / P;
      b.e = elem / (R * slice);
      b.row = elem % (R * slice) / slice;
      b.col = rank * slice + elem % slice;
    }
    return b;
  }
  return std::nullopt;
}

}  // namespace moebius::testing
