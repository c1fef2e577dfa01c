#include "moebius/plan/switch_workload.hpp"

#include <algorithm>
#include <vector>

#include "moebius/detail/checked_math.hpp"
#include "moebius/detail/enum_check.hpp"
#include "moebius/error.hpp"

namespace moebius {

switch_workload workload_of(const plan& p) {
  MOEBIUS_CHECK(p.num_ranks >= 1, errc::invalid_argument,
                "plan needs num_ranks >= 1 (num_ranks=", p.num_ranks, ")");
  const size_t P = static_cast<size_t>(p.num_ranks);
  std::vector<int64_t> weight(P, 0), kv(P, 0);
  switch_workload w;
  w.num_ranks = p.num_ranks;
  for (const plan_phase& phase : p.phases) {
    bool writes_kv = false;
    for (const copy_op& op : phase.ops) {
      MOEBIUS_CHECK(op.src_rank >= 0 && static_cast<size_t>(op.src_rank) < P,
                    errc::invalid_argument, "plan op source rank out of range (src_rank=",
                    op.src_rank, ", P=", p.num_ranks, ")");
      detail::check_enum(op.dst_space, "workload_of op dst_space (memory_space)");
      writes_kv = writes_kv || op.dst_space == memory_space::kv_pool;
      if (op.is_local()) continue;
      std::vector<int64_t>& v = op.dst_space == memory_space::kv_pool ? kv : weight;
      v[static_cast<size_t>(op.src_rank)] = detail::checked_add(
          v[static_cast<size_t>(op.src_rank)],
          detail::checked_mul(op.rows, op.row_bytes, "bytes of a plan op"), "bytes leaving a rank");
    }
    ++(writes_kv ? w.kv_rounds : w.weight_phases);
  }
  w.weight_bytes_per_rank = *std::max_element(weight.begin(), weight.end());
  w.kv_bytes_per_rank = *std::max_element(kv.begin(), kv.end());
  return w;
}

}  // namespace moebius
