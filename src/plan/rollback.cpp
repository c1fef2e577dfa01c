#include "moebius/plan/rollback.hpp"

#include <algorithm>
#include <tuple>

#include "moebius/error.hpp"

namespace moebius {

plan rollback_plan(const plan& executed, int64_t completed_phases) {
  MOEBIUS_CHECK(completed_phases >= 0 &&
                    completed_phases <= static_cast<int64_t>(executed.phases.size()),
                errc::invalid_argument, "completed_phases must lie in [0, ",
                executed.phases.size(), "] (completed_phases=", completed_phases, ")");
  plan undo;
  undo.num_ranks = executed.num_ranks;
  undo.phases.reserve(static_cast<size_t>(completed_phases));
  for (int64_t k = completed_phases - 1; k >= 0; --k) {
    const plan_phase& ph = executed.phases[static_cast<size_t>(k)];
    plan_phase& out = undo.phases.emplace_back();
    out.label = "undo " + ph.label;
    out.ops.reserve(ph.ops.size());
    for (const copy_op& op : ph.ops) {
      MOEBIUS_CHECK(op.src_rank >= 0 && op.src_rank < executed.num_ranks && op.dst_rank >= 0 &&
                        op.dst_rank < executed.num_ranks && is_valid(op.src_space) &&
                        is_valid(op.dst_space) && op.rows >= 1,
                    errc::invalid_argument, "cannot undo phase ", k, ": an op names a rank outside [0, ",
                    executed.num_ranks, "), an out-of-range memory_space or rows < 1: ", op);
      MOEBIUS_CHECK(op.rows == 1 || op.src_pitch >= op.row_bytes, errc::invalid_argument,
                    "cannot undo an op whose source rows overlap (src_pitch < row_bytes): ", op);
      copy_op inv = op;
      std::swap(inv.src_rank, inv.dst_rank);
      std::swap(inv.src_offset, inv.dst_offset);
      std::swap(inv.src_pitch, inv.dst_pitch);
      std::swap(inv.src_space, inv.dst_space);
      out.ops.push_back(inv);
    }
    // Several ops that read one source range become several writes of identical bytes to one
    // range: keep the first, so the undo phase keeps the no-overlapping-destinations rule.
    auto dst_key = [](const copy_op& o) {
      return std::make_tuple(o.dst_rank, o.dst_space, o.dst_offset, o.rows, o.row_bytes,
                             o.dst_pitch);
    };
    std::stable_sort(out.ops.begin(), out.ops.end(),
                     [&](const copy_op& a, const copy_op& b) { return dst_key(a) < dst_key(b); });
    out.ops.erase(std::unique(out.ops.begin(), out.ops.end(),
                              [&](const copy_op& a, const copy_op& b) {
                                return dst_key(a) == dst_key(b);
                              }),
                  out.ops.end());
    if (!ph.restores.empty()) {
      // They read what the undo above restored, so they need a phase of their own.
      undo.phases.push_back(plan_phase{"restore " + ph.label, ph.restores, {}});
    }
  }
  return undo;
}

}  // namespace moebius
