#include "moebius/transport/dry_run_transport.hpp"

#include <algorithm>
#include <numeric>
#include <utility>

#include "moebius/error.hpp"
#include "phase_marks.hpp"

namespace moebius {

dry_run_transport::dry_run_transport(int num_ranks, dry_run_spaces spaces)
    : num_ranks_(num_ranks) {
  MOEBIUS_CHECK(num_ranks >= 1, errc::invalid_argument, "dry_run_transport: ", num_ranks,
                " ranks (needs >= 1)");
  MOEBIUS_CHECK(spaces.arena_bytes >= 0 && spaces.kv_pool_bytes >= 0, errc::invalid_argument,
                "dry_run_transport: negative space (arena ", spaces.arena_bytes, " B, KV pool ",
                spaces.kv_pool_bytes, " B)");
  space_bytes_[static_cast<int>(memory_space::arena)] = spaces.arena_bytes;
  space_bytes_[static_cast<int>(memory_space::kv_pool)] = spaces.kv_pool_bytes;
  traffic_.bytes_sent.assign(static_cast<size_t>(num_ranks), 0);
  traffic_.bytes_received.assign(static_cast<size_t>(num_ranks), 0);
  traffic_.bytes_local.assign(static_cast<size_t>(num_ranks), 0);
}

std::vector<int> dry_run_transport::local_ranks() const {
  std::vector<int> all(static_cast<size_t>(num_ranks_));
  std::iota(all.begin(), all.end(), 0);
  return all;
}

void dry_run_transport::validate(const plan& p) const {
  MOEBIUS_CHECK(p.num_ranks == num_ranks_, errc::invalid_argument, "the plan is for ",
                p.num_ranks, " ranks but the transport has ", num_ranks_);
  moebius::validate(p, space_bytes_);
}

void dry_run_transport::enqueue(const plan& p, std::span<const stream_handle> streams) {
  MOEBIUS_CHECK(!outstanding_, errc::invalid_argument,
                "dry_run_transport::enqueue: a plan is still outstanding; call wait() first");
  MOEBIUS_CHECK(streams.empty() || static_cast<int>(streams.size()) == num_ranks_,
                errc::invalid_argument, "dry_run_transport::enqueue: ", streams.size(),
                " streams for ", num_ranks_, " local ranks");
  for (stream_handle s : streams) {
    MOEBIUS_CHECK(s == nullptr, errc::invalid_argument,
                  "dry_run_transport::enqueue: there is no device; pass nullptr streams");
  }
  const std::optional<fault_point> fault = std::exchange(fault_, std::nullopt);
  const std::vector<int64_t> marks = std::exchange(pending_marks_, {});
  completed_phases_ = 0;
  num_marks_ = 0;
  validate(p);
  num_marks_ = detail::phase_marks::reached_count(marks, static_cast<int64_t>(p.phases.size()));
  outstanding_ = true;
  failure_ = nullptr;
  ++plans_run_;
  try {
    for (int64_t k = 0; k < static_cast<int64_t>(p.phases.size()); ++k) {
      const plan_phase& ph = p.phases[static_cast<size_t>(k)];
      if (fault && fault->phase == k && fault->op < static_cast<int64_t>(ph.ops.size())) {
        MOEBIUS_FAIL(fault->code, "injected fault before op ", fault->op, " of phase ", k, " ('",
                     ph.label, "')");
      }
      for (const copy_op& op : ph.ops) {
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
      completed_phases_ = k + 1;
    }
  } catch (...) {
    failure_ = std::current_exception();
  }
}

void dry_run_transport::mark_phases(std::span<const int64_t> after_phases) {
  detail::phase_marks::check(after_phases, "dry_run_transport");
  pending_marks_.assign(after_phases.begin(), after_phases.end());
}

void dry_run_transport::wait_before_phases(std::span<const phase_wait> waits) {
  detail::phase_waits::check(waits, static_cast<size_t>(num_ranks_), "dry_run_transport");
  for (const phase_wait& w : waits) {
    for (const event_handle e : w.events) {
      MOEBIUS_CHECK(e == nullptr, errc::invalid_argument,
                    "dry_run_transport::wait_before_phases: there is no device to wait on; pass "
                    "nullptr events (phase ", w.phase, ")");
    }
  }
}

event_handle dry_run_transport::phase_event(size_t mark, size_t local_index) const {
  detail::check_phase_event(mark, num_marks_, local_index, static_cast<size_t>(num_ranks_),
                            "dry_run_transport");
  return nullptr;
}

void dry_run_transport::wait() {
  outstanding_ = false;
  if (failure_) std::rethrow_exception(std::exchange(failure_, nullptr));
}

}  // namespace moebius
