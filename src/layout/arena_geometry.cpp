#include "moebius/layout/arena_geometry.hpp"

#include <ostream>

#include "moebius/detail/checked_math.hpp"
#include "moebius/error.hpp"

namespace moebius {

namespace {
constexpr bool is_power_of_two(int64_t x) { return x > 0 && (x & (x - 1)) == 0; }
}  // namespace

arena_geometry make_arena_geometry(const expert_shape& shape, int num_ranks,
                                   int64_t tensor_alignment, int64_t slot_alignment) {
  validate(shape, num_ranks);
  MOEBIUS_CHECK(is_power_of_two(tensor_alignment), errc::invalid_argument,
                "tensor_alignment must be a power of two (tensor_alignment=", tensor_alignment,
                ")");
  MOEBIUS_CHECK(is_power_of_two(slot_alignment) && slot_alignment >= tensor_alignment,
                errc::invalid_argument,
                "slot_alignment must be a power of two >= tensor_alignment (slot_alignment=",
                slot_alignment, ", tensor_alignment=", tensor_alignment, ")");

  arena_geometry g;
  g.shape = shape;
  g.num_ranks = num_ranks;
  g.tensor_alignment = tensor_alignment;
  int64_t offset = 0;
  for (weight_tensor t : all_weight_tensors) {
    const int i = static_cast<int>(t);
    // Volume invariance: both views hold the same bytes per rank.
    const int64_t ep = make_view<parallel_mode::ep>(shape, t, num_ranks).bytes_per_rank();
    const int64_t tp = make_view<parallel_mode::tp>(shape, t, num_ranks).bytes_per_rank();
    MOEBIUS_CHECK(ep == tp, errc::internal, "EP and TP bytes per rank differ for ", to_string(t),
                  " (EP=", ep, ", TP=", tp, ")");
    g.tensor_offset[i] = offset;
    g.tensor_bytes[i] = ep;
    offset = detail::checked_align_up(detail::checked_add(offset, ep, "slot bytes"),
                                      tensor_alignment, "slot bytes");
  }
  g.slot_bytes = detail::checked_align_up(offset, slot_alignment, "slot bytes");
  detail::checked_mul(g.slot_bytes, g.num_slots(), "arena bytes per rank");
  return g;
}

void validate(const arena_geometry& g) {
  validate(g.shape, g.num_ranks);
  MOEBIUS_CHECK(is_power_of_two(g.tensor_alignment), errc::invalid_argument,
                "arena_geometry tensor_alignment must be a power of two (tensor_alignment=",
                g.tensor_alignment, ")");
  int64_t end = 0;  // first byte after the previous tensor
  for (weight_tensor t : all_weight_tensors) {
    const int i = static_cast<int>(t);
    const int64_t want = make_view<parallel_mode::ep>(g.shape, t, g.num_ranks).bytes_per_rank();
    MOEBIUS_CHECK(g.tensor_bytes[i] == want, errc::invalid_argument, "arena_geometry ",
                  to_string(t), " holds ", g.tensor_bytes[i], " bytes per rank but its shape at P=",
                  g.num_ranks, " needs ", want, " (edited after make_arena_geometry?)");
    MOEBIUS_CHECK(g.tensor_offset[i] >= end && g.tensor_offset[i] % g.tensor_alignment == 0,
                  errc::invalid_argument, "arena_geometry ", to_string(t), " offset ",
                  g.tensor_offset[i], " must be a multiple of tensor_alignment ",
                  g.tensor_alignment, " at or after the previous tensor's end ", end);
    end = detail::checked_add(g.tensor_offset[i], g.tensor_bytes[i], "slot bytes");
  }
  MOEBIUS_CHECK(g.slot_bytes >= end, errc::invalid_argument, "arena_geometry slot_bytes ",
                g.slot_bytes, " is smaller than its tensors (", end, " bytes)");
  detail::checked_mul(g.slot_bytes, g.num_slots(), "arena bytes per rank");
}

void validate(const arena_geometry& g, arena_cursor c) {
  validate(g);
  MOEBIUS_CHECK(c.tp_layers >= 0 && c.tp_layers <= g.shape.num_layers, errc::invalid_argument,
                "arena cursor must lie in [0, L] (tp_layers=", c.tp_layers,
                ", L=", g.shape.num_layers, ")");
}

std::ostream& operator<<(std::ostream& os, const arena_geometry& g) {
  os << "arena_geometry{" << g.shape << ", P=" << g.num_ranks << ", slots=" << g.num_slots()
     << " x " << g.slot_bytes << " B";
  for (weight_tensor t : all_weight_tensors) {
    const int i = static_cast<int>(t);
    if (g.tensor_bytes[i] != 0) {
      os << ", " << to_string(t) << "@" << g.tensor_offset[i] << "+" << g.tensor_bytes[i];
    }
  }
  return os << ", overhead " << g.overhead_fraction() * 100.0 << "%}";
}

}  // namespace moebius
