#include "moebius/transport/dry_run_transport.hpp"

#include "moebius/error.hpp"

namespace moebius {

dry_run_transport::dry_run_transport(int num_ranks, dry_run_spaces spaces)
    : synchronous_transport(num_ranks, "dry_run_transport", "there is no device") {
  MOEBIUS_CHECK(spaces.arena_bytes >= 0 && spaces.kv_pool_bytes >= 0, errc::invalid_argument,
                "dry_run_transport: negative space (arena ", spaces.arena_bytes, " B, KV pool ",
                spaces.kv_pool_bytes, " B)");
  space_bytes_[static_cast<int>(memory_space::arena)] = spaces.arena_bytes;
  space_bytes_[static_cast<int>(memory_space::kv_pool)] = spaces.kv_pool_bytes;
  traffic_.bytes_sent.assign(static_cast<size_t>(num_ranks), 0);
  traffic_.bytes_received.assign(static_cast<size_t>(num_ranks), 0);
  traffic_.bytes_local.assign(static_cast<size_t>(num_ranks), 0);
}

void dry_run_transport::validate(const plan& p) const {
  MOEBIUS_CHECK(p.num_ranks == num_ranks(), errc::invalid_argument, "the plan is for ", p.num_ranks,
                " ranks but the transport has ", num_ranks());
  moebius::validate(p, space_bytes_);
}

void dry_run_transport::run_ops(const plan_phase& phase, size_t num_ops) {
  if (num_ops < phase.ops.size()) return;
  for (const copy_op& op : phase.ops) {
    const int64_t bytes = op.rows * op.row_bytes;
    if (op.src_rank == op.dst_rank) {
      traffic_.bytes_local[static_cast<size_t>(op.src_rank)] += bytes;
    } else {
      traffic_.bytes_sent[static_cast<size_t>(op.src_rank)] += bytes;
      traffic_.bytes_received[static_cast<size_t>(op.dst_rank)] += bytes;
      ++traffic_.num_remote_ops;
    }
    ++traffic_.num_ops;
  }
}

}  // namespace moebius
