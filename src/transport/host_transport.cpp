#include "moebius/transport/host_transport.hpp"

#include <cstring>
#include <numeric>
#include <utility>

#include "moebius/error.hpp"
#include "phase_marks.hpp"

namespace moebius {

host_transport::host_transport(std::vector<rank_memory> ranks) : ranks_(std::move(ranks)) {
  validate_rank_memory(ranks_, memory_kind_rule::require_host);
}

std::vector<int> host_transport::local_ranks() const {
  std::vector<int> all(ranks_.size());
  std::iota(all.begin(), all.end(), 0);
  return all;
}

void host_transport::validate(const plan& p) const { validate_plan_fits(p, num_ranks(), ranks_); }

void host_transport::enqueue(const plan& p, std::span<const stream_handle> streams) {
  MOEBIUS_CHECK(!outstanding_, errc::invalid_argument,
                "host_transport::enqueue: a plan is still outstanding; call wait() first");
  MOEBIUS_CHECK(streams.empty() || static_cast<int>(streams.size()) == num_ranks(),
                errc::invalid_argument, "host_transport::enqueue: ", streams.size(),
                " streams for ", num_ranks(), " local ranks");
  for (stream_handle s : streams) {
    MOEBIUS_CHECK(s == nullptr, errc::invalid_argument,
                  "host_transport::enqueue: host memory has no streams; pass nullptr");
  }
  // An armed fault applies to this plan only, reached or not.
  const std::optional<fault_point> fault = std::exchange(fault_, std::nullopt);
  const std::vector<int64_t> marks = std::exchange(pending_marks_, {});
  completed_phases_ = 0;
  num_marks_ = 0;
  validate(p);
  num_marks_ = detail::phase_marks::reached_count(marks, static_cast<int64_t>(p.phases.size()));
  outstanding_ = true;
  failure_ = nullptr;
  try {
    for (int64_t k = 0; k < static_cast<int64_t>(p.phases.size()); ++k) {
      execute_phase(p, k, fault);
      completed_phases_ = k + 1;
    }
  } catch (...) {
    failure_ = std::current_exception();
  }
}

void host_transport::mark_phases(std::span<const int64_t> after_phases) {
  detail::phase_marks::check(after_phases, "host_transport");
  pending_marks_.assign(after_phases.begin(), after_phases.end());
}

void host_transport::wait_before_phases(std::span<const phase_wait> waits) {
  detail::phase_waits::check(waits, ranks_.size(), "host_transport");
  for (const phase_wait& w : waits) {
    for (const event_handle e : w.events) {
      MOEBIUS_CHECK(e == nullptr, errc::invalid_argument,
                    "host_transport::wait_before_phases: host memory has no streams to wait on; "
                    "pass nullptr events (phase ", w.phase, ")");
    }
  }
}

event_handle host_transport::phase_event(size_t mark, size_t local_index) const {
  detail::check_phase_event(mark, num_marks_, local_index, ranks_.size(), "host_transport");
  return nullptr;
}

void host_transport::wait() {
  outstanding_ = false;
  if (failure_) std::rethrow_exception(std::exchange(failure_, nullptr));
}

void host_transport::execute_phase(const plan& p, int64_t phase_idx,
                                   const std::optional<fault_point>& fault) {
  const std::vector<copy_op>& ops = p.phases[static_cast<size_t>(phase_idx)].ops;
  for (int64_t i = 0; i < static_cast<int64_t>(ops.size()); ++i) {
    if (fault && fault->phase == phase_idx && fault->op == i) {
      MOEBIUS_FAIL(fault->code, "injected fault before op ", i, " of phase ", phase_idx,
                   " ('", p.phases[static_cast<size_t>(phase_idx)].label, "')");
    }
    const copy_op& op = ops[static_cast<size_t>(i)];
    const std::byte* src =
        ranks_[static_cast<size_t>(op.src_rank)].space(op.src_space).data() + op.src_offset;
    std::byte* dst =
        ranks_[static_cast<size_t>(op.dst_rank)].space(op.dst_space).data() + op.dst_offset;
    for (int64_t row = 0; row < op.rows; ++row) {
      std::memcpy(dst + row * op.dst_pitch, src + row * op.src_pitch,
                  static_cast<size_t>(op.row_bytes));
    }
  }
}

}  // namespace moebius
