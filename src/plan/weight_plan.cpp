#include "moebius/plan/weight_plan.hpp"

#include <algorithm>
#include <string>

#include "moebius/error.hpp"
#include "moebius/layout/weight_view.hpp"

namespace moebius {
namespace {

// The elements that EP rank `ep_rank` and TP rank `tp_rank` have in common form a 4-mode box
// (experts, segment, rows, cols) of the logical tensor, and both views are affine on it. We
// describe the box by its extents and each view's byte strides, fold modes that are
// contiguous in both views (CuTe's coalesce), and emit one strided copy per remaining outer
// index: usually exactly one.
struct box_mode {
  int64_t extent;
  int64_t src_stride;  // bytes
  int64_t dst_stride;  // bytes
};

struct piece {
  int64_t extent[4];  // experts, segments, rows, cols
  int64_t e0, row0, col0;
};

piece common_piece(const tensor_geometry& g, int P, int ep_rank, int tp_rank) {
  const int64_t experts = g.num_experts / P;
  const int64_t slice = g.segment_len() / P;
  piece pc{};
  pc.extent[0] = experts;
  pc.extent[1] = g.num_segments;
  pc.e0 = ep_rank * experts;
  if (g.split_axis == 1) {
    pc.extent[2] = slice;
    pc.extent[3] = g.cols;
    pc.row0 = tp_rank * slice;
    pc.col0 = 0;
  } else {
    pc.extent[2] = g.rows;
    pc.extent[3] = slice;
    pc.row0 = 0;
    pc.col0 = tp_rank * slice;
  }
  return pc;
}

// Logical coordinate of index (i0, i1, i2, i3) of piece `pc`.
struct coord {
  int64_t e, row, col;
};
coord coord_of(const tensor_geometry& g, const piece& pc, const int64_t (&i)[4]) {
  const int64_t seg_shift = i[1] * g.segment_len();
  return {pc.e0 + i[0], pc.row0 + i[2] + (g.split_axis == 1 ? seg_shift : 0),
          pc.col0 + i[3] + (g.split_axis == 2 ? seg_shift : 0)};
}

template <class SrcView, class DstView>
void emit_tensor(const SrcView& src, const DstView& dst, const piece& pc, int64_t src_base,
                 int64_t dst_base, std::vector<copy_op>& out) {
  const tensor_geometry& g = src.tensor;
  const int64_t eb = g.elem_bytes;
  const int64_t zero[4] = {0, 0, 0, 0};
  const coord c0 = coord_of(g, pc, zero);
  const element_location s0 = src.locate(c0.e, c0.row, c0.col);
  const element_location d0 = dst.locate(c0.e, c0.row, c0.col);

  // Byte strides of each mode, measured through the views themselves.
  box_mode modes[4];
  int64_t src_far = 0, dst_far = 0;
  for (int m = 0; m < 4; ++m) {
    int64_t unit[4] = {0, 0, 0, 0};
    unit[m] = 1;
    modes[m].extent = pc.extent[m];
    if (pc.extent[m] > 1) {
      const coord c = coord_of(g, pc, unit);
      modes[m].src_stride = (src.locate(c.e, c.row, c.col).offset - s0.offset) * eb;
      modes[m].dst_stride = (dst.locate(c.e, c.row, c.col).offset - d0.offset) * eb;
    } else {
      modes[m].src_stride = modes[m].dst_stride = 0;
    }
    src_far += (pc.extent[m] - 1) * modes[m].src_stride;
    dst_far += (pc.extent[m] - 1) * modes[m].dst_stride;
  }
  // The box is affine in both views by construction; check its far corner to be sure.
  {
    const int64_t last[4] = {pc.extent[0] - 1, pc.extent[1] - 1, pc.extent[2] - 1,
                             pc.extent[3] - 1};
    const coord c = coord_of(g, pc, last);
    const element_location s = src.locate(c.e, c.row, c.col);
    const element_location d = dst.locate(c.e, c.row, c.col);
    MOEBIUS_CHECK(s.rank == s0.rank && d.rank == d0.rank &&
                      (s.offset - s0.offset) * eb == src_far &&
                      (d.offset - d0.offset) * eb == dst_far,
                  errc::internal, "reshard piece is not affine in both views");
  }

  // The innermost mode is contiguous in both views (row-major, unit column stride).
  int64_t run = modes[3].extent * eb;
  int first_outer = 3;  // modes [0, first_outer) are not yet folded into `run`
  while (first_outer > 0) {
    const box_mode& m = modes[first_outer - 1];
    if (m.extent != 1 && (m.src_stride != run || m.dst_stride != run)) break;
    run *= m.extent;
    --first_outer;
  }
  // Fold adjacent outer modes whose strides nest in both views; drop unit modes.
  box_mode outer[4];
  int num_outer = 0;
  for (int m = 0; m < first_outer; ++m) {
    if (modes[m].extent == 1) continue;
    if (num_outer > 0) {
      box_mode& prev = outer[num_outer - 1];
      if (prev.src_stride == modes[m].extent * modes[m].src_stride &&
          prev.dst_stride == modes[m].extent * modes[m].dst_stride) {
        prev = {prev.extent * modes[m].extent, modes[m].src_stride, modes[m].dst_stride};
        continue;
      }
    }
    outer[num_outer++] = modes[m];
  }

  copy_op op;
  op.src_rank = s0.rank;
  op.dst_rank = d0.rank;
  op.row_bytes = run;
  op.rows = 1;
  op.src_pitch = op.dst_pitch = run;
  const int64_t src_start = src_base + s0.offset * eb;
  const int64_t dst_start = dst_base + d0.offset * eb;
  if (num_outer == 0) {
    op.src_offset = src_start;
    op.dst_offset = dst_start;
    out.push_back(op);
    return;
  }
  // The largest outer mode becomes the rows of each copy; the others are looped over. Only a
  // mode with forward pitches in both views qualifies (validate() demands src_pitch >= 0 and
  // dst_pitch >= row_bytes): when the EP and TP gate/up orders differ, the segment mode runs
  // backwards in one view, and must be looped over even when it is the only outer mode
  // (E/P == 1).
  int row_mode = -1;
  for (int m = 0; m < num_outer; ++m) {
    if (outer[m].src_stride < 0 || outer[m].dst_stride < run) continue;
    if (row_mode < 0 || outer[m].extent > outer[row_mode].extent) row_mode = m;
  }
  if (row_mode >= 0) {
    op.rows = outer[row_mode].extent;
    op.src_pitch = outer[row_mode].src_stride;
    op.dst_pitch = outer[row_mode].dst_stride;
  }
  int64_t index[4] = {0, 0, 0, 0};
  while (true) {
    int64_t src_off = src_start, dst_off = dst_start;
    for (int m = 0; m < num_outer; ++m) {
      src_off += index[m] * outer[m].src_stride;
      dst_off += index[m] * outer[m].dst_stride;
    }
    op.src_offset = src_off;
    op.dst_offset = dst_off;
    out.push_back(op);
    int m = num_outer - 1;
    for (; m >= 0; --m) {
      if (m == row_mode) continue;
      if (++index[m] < outer[m].extent) break;
      index[m] = 0;
    }
    if (m < 0) return;
  }
}

// Ops of one layer moving from `from_mode` to the other mode, with offsets relative to the
// start of the source and destination slots, ordered by source rank, then by (dst - src)
// mod P so that at any moment the ranks push to different peers. Every layer's ops are these
// shifted by its slots' offsets.
void emit_layer_template(const arena_geometry& ag, parallel_mode from_mode,
                         std::vector<copy_op>& out) {
  const int P = ag.num_ranks;
  for (int src_rank = 0; src_rank < P; ++src_rank) {
    for (int k = 0; k < P; ++k) {
      const int dst_rank = (src_rank + k) % P;
      const int ep_rank = from_mode == parallel_mode::ep ? src_rank : dst_rank;
      const int tp_rank = from_mode == parallel_mode::ep ? dst_rank : src_rank;
      for (weight_tensor t : all_weight_tensors) {
        if (ag.tensor_bytes[static_cast<int>(t)] == 0) continue;
        const ep_view ep = make_view<parallel_mode::ep>(ag.shape, t, P);
        const tp_view tp = make_view<parallel_mode::tp>(ag.shape, t, P);
        const piece pc = common_piece(ep.tensor, P, ep_rank, tp_rank);
        const int64_t base = ag.tensor_offset[static_cast<int>(t)];
        if (from_mode == parallel_mode::ep) {
          emit_tensor(ep, tp, pc, base, base, out);
        } else {
          emit_tensor(tp, ep, pc, base, base, out);
        }
      }
    }
  }
}

}  // namespace

plan plan_weight_switch(const arena_geometry& ag, arena_cursor from, arena_cursor to) {
  validate(ag, from);
  validate(ag, to);
  plan p;
  p.num_ranks = ag.num_ranks;
  const bool to_tp = to.tp_layers > from.tp_layers;
  const int64_t num_phases = to_tp ? to.tp_layers - from.tp_layers : from.tp_layers - to.tp_layers;
  p.phases.resize(static_cast<size_t>(num_phases));
  if (num_phases == 0) return p;
  const parallel_mode from_mode = to_tp ? parallel_mode::ep : parallel_mode::tp;
  const parallel_mode to_mode = to_tp ? parallel_mode::tp : parallel_mode::ep;
  std::vector<copy_op> layer_ops;
  layer_ops.reserve(static_cast<size_t>(ag.num_ranks) * ag.num_ranks * num_weight_tensors * 2);
  emit_layer_template(ag, from_mode, layer_ops);
  for (int64_t k = 0; k < num_phases; ++k) {
    // EP->TP ascends from `from`; TP->EP descends from `from - 1`.
    const int64_t layer = to_tp ? from.tp_layers + k : from.tp_layers - 1 - k;
    const int64_t src_slot = ag.slot_offset(arena_geometry::slot_of(from_mode, layer));
    const int64_t dst_slot = ag.slot_offset(arena_geometry::slot_of(to_mode, layer));
    plan_phase& ph = p.phases[static_cast<size_t>(k)];
    ph.label = "layer " + std::to_string(layer) + (to_tp ? " EP->TP" : " TP->EP");
    ph.ops = layer_ops;
    for (copy_op& op : ph.ops) {
      op.src_offset += src_slot;
      op.dst_offset += dst_slot;
    }
  }
  return p;
}

}  // namespace moebius
