#include "moebius/layout/expert_shape.hpp"

#include <ostream>

#include "moebius/detail/checked_math.hpp"
#include "moebius/detail/enum_check.hpp"
#include "moebius/error.hpp"
#include "moebius/layout/weight_view.hpp"

namespace moebius {

void validate(const expert_shape& s, int P) {
  using detail::checked_product;
  MOEBIUS_CHECK(P >= 1, errc::invalid_argument, "num_ranks must be >= 1 (num_ranks=", P, ")");
  MOEBIUS_CHECK(s.num_layers > 0, errc::invalid_argument,
                "num_layers (L) must be > 0 (L=", s.num_layers, ")");
  MOEBIUS_CHECK(s.num_experts > 0, errc::invalid_argument,
                "num_experts (E) must be > 0 (E=", s.num_experts, ")");
  MOEBIUS_CHECK(s.hidden > 0, errc::invalid_argument, "hidden (H) must be > 0 (H=", s.hidden, ")");
  MOEBIUS_CHECK(s.intermediate > 0, errc::invalid_argument,
                "intermediate (I) must be > 0 (I=", s.intermediate, ")");
  MOEBIUS_CHECK(dtype_bytes(s.weight_dtype) > 0, errc::invalid_argument,
                "unknown weight dtype (", static_cast<int>(s.weight_dtype), ")");
  detail::check_enum(s.ep_order, "expert_shape ep_order (gate_up_order)");
  detail::check_enum(s.tp_order, "expert_shape tp_order (gate_up_order)");
  MOEBIUS_CHECK(s.num_experts % P == 0, errc::invalid_argument,
                "num_ranks (P) must divide num_experts (E) for EP (E=", s.num_experts, ", P=", P,
                ")");
  MOEBIUS_CHECK(s.intermediate % P == 0, errc::invalid_argument,
                "num_ranks (P) must divide intermediate (I) for TP (I=", s.intermediate, ", P=", P,
                ")");
  if (s.block_scales) {
    const int64_t bn = s.scale_block_n, bk = s.scale_block_k, H = s.hidden, I = s.intermediate;
    MOEBIUS_CHECK(bn > 0 && bk > 0, errc::invalid_argument,
                  "scale blocks must be > 0 (block_n=", bn, ", block_k=", bk, ")");
    MOEBIUS_CHECK(dtype_bytes(s.scale_dtype) > 0, errc::invalid_argument, "unknown scale dtype (",
                  static_cast<int>(s.scale_dtype), ")");
    MOEBIUS_CHECK(I % bn == 0, errc::invalid_argument,
                  "scale block_n must divide intermediate (I) so each w13 half is whole blocks (I=",
                  I, ", block_n=", bn, ")");
    MOEBIUS_CHECK(H % bk == 0, errc::invalid_argument,
                  "scale block_k must divide hidden (H) for the w13 scale columns (H=", H,
                  ", block_k=", bk, ")");
    MOEBIUS_CHECK(H % bn == 0, errc::invalid_argument,
                  "scale block_n must divide hidden (H) for the w2 scale rows (H=", H,
                  ", block_n=", bn, ")");
    MOEBIUS_CHECK(I % bk == 0, errc::invalid_argument,
                  "scale block_k must divide intermediate (I) for the w2 scale columns (I=", I,
                  ", block_k=", bk, ")");
    MOEBIUS_CHECK((I / P) % bn == 0 && (I / P) % bk == 0, errc::invalid_argument,
                  "each TP slice I/P must be whole scale blocks (I/P=", I / P, ", block_n=", bn,
                  ", block_k=", bk, ", P=", P, ")");
  }
  // geometry_of() below computes w13's 2I rows unchecked.
  detail::checked_mul(2, s.intermediate, "w13 rows (2I)");
  // Every byte count of one rank's arena must fit in 64 bits: the whole logical stack is the
  // largest such number (P ranks' arenas together), so checking it covers them all.
  int64_t layer_bytes = 0;
  for (weight_tensor t : all_weight_tensors) {
    const tensor_geometry g = geometry_of(s, t);
    const int64_t bytes =
        checked_product("bytes of one layer's tensor", g.num_experts, g.rows, g.cols, g.elem_bytes);
    layer_bytes = detail::checked_add(layer_bytes, bytes, "bytes of one layer");
  }
  checked_product("bytes of the whole expert stack (L+1 slots)", layer_bytes,
                  detail::checked_add(s.num_layers, 1, "slots (L+1)"));
}

std::ostream& operator<<(std::ostream& os, const expert_shape& s) {
  os << "expert_shape{L=" << s.num_layers << ", E=" << s.num_experts << ", H=" << s.hidden
     << ", I=" << s.intermediate << ", " << to_string(s.weight_dtype)
     << ", ep_order=" << to_string(s.ep_order) << ", tp_order=" << to_string(s.tp_order);
  if (s.block_scales) {
    os << ", scales " << s.scale_block_n << 'x' << s.scale_block_k << ' '
       << to_string(s.scale_dtype);
  }
  return os << '}';
}

}  // namespace moebius
