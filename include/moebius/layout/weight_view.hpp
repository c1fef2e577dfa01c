#pragma once

// Where each element of a layer's expert tensors lives in EP and in TP.
//
// Every tensor is logically [E, rows, cols] row-major, with w13 in canonical [gate; up] order:
//
//   tensor      logical shape          TP slices            segments
//   w13         [E, 2I, H]             rows, each half      2 (gate, up)
//   w2          [E, H, I]              columns              1
//   w13_scale   [E, 2I/bn, H/bk]       rows, each half      2
//   w2_scale    [E, H/bn, I/bk]        columns              1
//
// EP rank r holds experts [r*E/P, (r+1)*E/P) whole: [E/P, rows, cols].
// TP rank r holds every expert; along the split axis, each segment contributes its r-th
// slice of segment_len/P, in the view's gate/up order (slicing w13's 2I rows as one range
// would give a TP rank two gate slices and no up slice):
//   w13 gate_first, TP rank r: gate rows [r*I/P, (r+1)*I/P) then up rows [I + r*I/P, ...)
// Both views hold the same bytes per rank (volume invariance), so one slot fits either.

#include <cstdint>

#include "moebius/detail/host_device.hpp"
#include "moebius/layout/expert_shape.hpp"
#include "moebius/layout/layout3.hpp"

namespace moebius {

enum class weight_tensor : uint8_t { w13, w2, w13_scale, w2_scale };

inline constexpr int num_weight_tensors = 4;
inline constexpr weight_tensor all_weight_tensors[] = {weight_tensor::w13, weight_tensor::w2,
                                                       weight_tensor::w13_scale,
                                                       weight_tensor::w2_scale};

constexpr bool is_valid(weight_tensor t) {
  return static_cast<uint8_t>(t) <= static_cast<uint8_t>(weight_tensor::w2_scale);
}

constexpr const char* to_string(weight_tensor t) {
  switch (t) {
    case weight_tensor::w13: return "w13";
    case weight_tensor::w2: return "w2";
    case weight_tensor::w13_scale: return "w13_scale";
    case weight_tensor::w2_scale: return "w2_scale";
  }
  return "unknown";
}

// One logical tensor of one layer and how TP splits it.
struct tensor_geometry {
  int64_t num_experts = 0;  // E
  int64_t rows = 0;         // logical rows per expert
  int64_t cols = 0;         // logical columns per expert
  int64_t elem_bytes = 0;   // bytes per element
  int split_axis = 1;       // 1: TP slices rows (w13), 2: TP slices columns (w2)
  int num_segments = 1;     // 2 for the fused gate/up halves, 1 otherwise

  MOEBIUS_HOST_DEVICE constexpr int64_t split_extent() const {
    return split_axis == 1 ? rows : cols;
  }
  // Length of one segment along the split axis: I for w13, I for w2.
  MOEBIUS_HOST_DEVICE constexpr int64_t segment_len() const {
    return split_extent() / num_segments;
  }
  MOEBIUS_HOST_DEVICE constexpr int64_t elements() const { return num_experts * rows * cols; }
  // Whole logical tensor in bytes (all ranks together); 0 for an absent scale tensor.
  MOEBIUS_HOST_DEVICE constexpr int64_t bytes() const { return elements() * elem_bytes; }
};

// Geometry of `t` for `shape`; an absent scale tensor has zero extents. Call validate()
// first: this does no checking.
constexpr tensor_geometry geometry_of(const expert_shape& s, weight_tensor t) {
  const int64_t wb = dtype_bytes(s.weight_dtype);
  const int64_t sb = s.block_scales ? dtype_bytes(s.scale_dtype) : 0;
  const int64_t E = s.num_experts, H = s.hidden, I = s.intermediate;
  switch (t) {
    case weight_tensor::w13: return {E, 2 * I, H, wb, 1, 2};
    case weight_tensor::w2: return {E, H, I, wb, 2, 1};
    case weight_tensor::w13_scale:
      if (!s.block_scales) return {E, 0, 0, sb, 1, 2};
      return {E, 2 * I / s.scale_block_n, H / s.scale_block_k, sb, 1, 2};
    case weight_tensor::w2_scale:
      if (!s.block_scales) return {E, 0, 0, sb, 2, 1};
      return {E, H / s.scale_block_n, I / s.scale_block_k, sb, 2, 1};
  }
  return {};
}

// An element's home in a view: the rank that holds it and its element offset in that rank's
// local tensor.
struct element_location {
  int rank;
  int64_t offset;
};

// Stored position of canonical segment `seg` (0 = gate, 1 = up) under `order`.
MOEBIUS_HOST_DEVICE constexpr int64_t stored_segment(const tensor_geometry& g, gate_up_order order,
                                                     int64_t seg) {
  return (g.num_segments == 2 && order == gate_up_order::up_first) ? 1 - seg : seg;
}

template <parallel_mode Mode>
struct weight_view;

// EP: rank r holds experts [r*E/P, (r+1)*E/P) whole, [E/P, rows, cols] row-major, w13 halves
// in `order`.
//   E=4, P=2: expert 3 lives on rank 1 as local expert 1.
template <>
struct weight_view<parallel_mode::ep> {
  tensor_geometry tensor;
  int num_ranks = 1;
  gate_up_order order = gate_up_order::gate_first;

  MOEBIUS_HOST_DEVICE constexpr int64_t experts_per_rank() const {
    return tensor.num_experts / num_ranks;
  }
  MOEBIUS_HOST_DEVICE constexpr layout3 local_layout() const {
    return layout3::row_major(experts_per_rank(), tensor.rows, tensor.cols);
  }
  MOEBIUS_HOST_DEVICE constexpr int64_t bytes_per_rank() const {
    return local_layout().size() * tensor.elem_bytes;
  }
  MOEBIUS_HOST_DEVICE constexpr element_location locate(int64_t e, int64_t row, int64_t col) const {
    const int64_t per_rank = experts_per_rank();
    if (tensor.split_axis == 1 && tensor.num_segments == 2) {
      const int64_t len = tensor.segment_len();
      row = stored_segment(tensor, order, row / len) * len + row % len;
    }
    return {static_cast<int>(e / per_rank), local_layout()(e % per_rank, row, col)};
  }
};

// TP: rank r holds every expert; along the split axis each segment contributes its slice r
// of segment_len/P, segments in `order`.
//   w13 with I=8, P=2, gate_first: TP rank 1 holds rows 4..7 (gate) then 12..15 (up).
template <>
struct weight_view<parallel_mode::tp> {
  tensor_geometry tensor;
  int num_ranks = 1;
  gate_up_order order = gate_up_order::gate_first;

  MOEBIUS_HOST_DEVICE constexpr int64_t slice_len() const {
    return tensor.segment_len() / num_ranks;
  }
  MOEBIUS_HOST_DEVICE constexpr layout3 local_layout() const {
    const int64_t local_split = tensor.num_segments * slice_len();
    return tensor.split_axis == 1
               ? layout3::row_major(tensor.num_experts, local_split, tensor.cols)
               : layout3::row_major(tensor.num_experts, tensor.rows, local_split);
  }
  MOEBIUS_HOST_DEVICE constexpr int64_t bytes_per_rank() const {
    return local_layout().size() * tensor.elem_bytes;
  }
  MOEBIUS_HOST_DEVICE constexpr element_location locate(int64_t e, int64_t row, int64_t col) const {
    const int64_t coord = tensor.split_axis == 1 ? row : col;
    const int64_t len = tensor.segment_len();
    const int64_t slice = slice_len();
    const int64_t within = coord % len;
    const int64_t local =
        stored_segment(tensor, order, coord / len) * slice + within % slice;
    const int rank = static_cast<int>(within / slice);
    const layout3 l = local_layout();
    return {rank, tensor.split_axis == 1 ? l(e, local, col) : l(e, row, local)};
  }
};

using ep_view = weight_view<parallel_mode::ep>;
using tp_view = weight_view<parallel_mode::tp>;

// The view of tensor `t` of `shape` in `Mode` over `num_ranks` ranks (shape validated).
template <parallel_mode Mode>
constexpr weight_view<Mode> make_view(const expert_shape& shape, weight_tensor t, int num_ranks) {
  return weight_view<Mode>{geometry_of(shape, t), num_ranks,
                           Mode == parallel_mode::ep ? shape.ep_order : shape.tp_order};
}

}  // namespace moebius
