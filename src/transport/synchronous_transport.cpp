#include "moebius/transport/synchronous_transport.hpp"

#include <numeric>
#include <utility>

#include "moebius/error.hpp"
#include "phase_marks.hpp"

namespace moebius {

synchronous_transport::synchronous_transport(int num_ranks, const char* name,
                                             const char* no_streams)
    : num_ranks_(num_ranks), name_(name), no_streams_(no_streams) {
  MOEBIUS_CHECK(num_ranks >= 1, errc::invalid_argument, name, ": ", num_ranks,
                " ranks (needs >= 1)");
}

std::vector<int> synchronous_transport::local_ranks() const {
  std::vector<int> all(static_cast<size_t>(num_ranks_));
  std::iota(all.begin(), all.end(), 0);
  return all;
}

void synchronous_transport::enqueue(const plan& p, std::span<const stream_handle> streams) {
  MOEBIUS_CHECK(!outstanding_, errc::invalid_argument, name_,
                "::enqueue: a plan is still outstanding; call wait() first");
  MOEBIUS_CHECK(streams.empty() || static_cast<int>(streams.size()) == num_ranks_,
                errc::invalid_argument, name_, "::enqueue: ", streams.size(), " streams for ",
                num_ranks_, " local ranks");
  for (stream_handle s : streams) {
    MOEBIUS_CHECK(s == nullptr, errc::invalid_argument, name_, "::enqueue: ", no_streams_,
                  "; pass nullptr streams");
  }
  // An armed fault and the marks apply to this plan only, reached or not.
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
      const bool fails_here =
          fault && fault->phase == k && fault->op < static_cast<int64_t>(ph.ops.size());
      run_ops(ph, fails_here ? static_cast<size_t>(fault->op) : ph.ops.size());
      if (fails_here) {
        MOEBIUS_FAIL(fault->code, "injected fault before op ", fault->op, " of phase ", k, " ('",
                     ph.label, "')");
      }
      completed_phases_ = k + 1;
    }
  } catch (...) {
    failure_ = std::current_exception();
  }
}

void synchronous_transport::mark_phases(std::span<const int64_t> after_phases) {
  detail::phase_marks::check(after_phases, name_);
  pending_marks_.assign(after_phases.begin(), after_phases.end());
}

void synchronous_transport::wait_before_phases(std::span<const phase_wait> waits) {
  detail::phase_waits::check(waits, static_cast<size_t>(num_ranks_), name_);
  for (const phase_wait& w : waits) {
    for (const event_handle e : w.events) {
      MOEBIUS_CHECK(e == nullptr, errc::invalid_argument, name_,
                    "::wait_before_phases: ", no_streams_,
                    " to wait on; pass nullptr events (phase ", w.phase, ")");
    }
  }
}

event_handle synchronous_transport::phase_event(size_t mark, size_t local_index) const {
  detail::check_phase_event(mark, num_marks_, local_index, static_cast<size_t>(num_ranks_), name_);
  return nullptr;
}

void synchronous_transport::wait() {
  outstanding_ = false;
  if (failure_) std::rethrow_exception(std::exchange(failure_, nullptr));
}

}  // namespace moebius
