// The failure protocol of a switch transaction (switcher.hpp, transaction.hpp): a failure the
// transport reports exactly is undone, the exact reverse of what completed, unit by unit from
// the last; one that leaves bytes unknown, or an undo that fails, ends the switch inconsistent
// with the log recover() reads (recovery.cpp).

#include <algorithm>
#include <optional>
#include <utility>

#include "moebius/detail/nvtx.hpp"
#include "moebius/error.hpp"
#include "moebius/plan/rollback.hpp"
#include "moebius/plan/weight_plan.hpp"
#include "transaction.hpp"

namespace moebius::detail {

failure_info classify(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const error& err) {
    return {err.what(), err.code() == errc::timeout || err.code() == errc::cuda ||
                            err.code() == errc::nccl};
  } catch (const std::exception& err) {
    return {std::string("moebius: ") + err.what(), false};
  }
}

void switch_transaction::fail(std::string failure, bool state_unknown) {
  rep_.error = std::move(failure);
  if (state_unknown) {
    // No undo over bytes in an unknown state: report where the arena was known to rest.
    rep_.error += "; not undone: after a barrier timeout or a device error a rank may have "
                  "written past the reached phase";
    mark_inconsistent(rep_.error);
    return;
  }
  undo();
}

std::string switch_transaction::run_undo(const plan& p, int64_t& completed,
                                         bool& state_unknown) {
  completed = 0;
  arm(switch_fault::stage::undo);
  std::string failure;
  try {
    st_.mover.execute(p);
  } catch (...) {
    const failure_info f = classify(std::current_exception());
    failure = f.text;
    state_unknown = f.state_unknown;
  }
  st_.mover.inject_fault(std::nullopt);
  completed = failure.empty() ? static_cast<int64_t>(p.phases.size())
                              : st_.mover.completed_phases();
  return failure;
}

void switch_transaction::undo() {
  const auto tu = clock_type::now();
  std::optional<nvtx_range> undo_range(std::in_place, "moebius/switch/undo");
  std::string failure;
  bool state_unknown = false;
  // The exact reverse of what ran, unit by unit from the last: its completed KV rounds, then
  // its weights back to where the unit started.
  for (size_t i = units_.size(); i-- > 0 && failure.empty();) {
    const unit& u = units_[i];
    const int64_t done = std::clamp<int64_t>(phases_done_ - u.first_phase, 0, u.phases());
    if (done == 0) continue;
    int64_t completed = 0;
    const int64_t kv_done = done - std::min(done, u.weight_phases());
    if (kv_done > 0) {
      failure = run_undo(rollback_plan(*kv_plan_of(i), kv_done), completed, state_unknown);
      if (!failure.empty()) {  // the weights still rest at u.to
        wreck_.undo_failed_unit = static_cast<int64_t>(i);
        wreck_.undo_failed_in_kv = true;
        break;
      }
    }
    const arena_cursor reached = cursor_at(u.first_phase + std::min(done, u.weight_phases()));
    if (!(reached == u.from)) {
      const plan back = plan_weight_switch(st_.weights, reached, u.from);
      failure = run_undo(back, completed, state_unknown);
      const int64_t moved = reached.tp_layers > u.from.tp_layers ? -completed : completed;
      st_.cursor = arena_cursor{reached.tp_layers + moved};
      if (!failure.empty()) {
        wreck_.undo_failed_unit = static_cast<int64_t>(i);
        break;
      }
    }
    st_.cursor = u.from;
  }
  undo_range.reset();
  rep_.undo_ms += ms_between(tu, clock_type::now());
  rep_.cursor = st_.cursor;
  if (!failure.empty()) {
    rep_.error += (rep_.error.empty() ? "" : "; ") + std::string("undo failed: ") + failure;
    mark_inconsistent(rep_.error);
    return;
  }
  end(switch_outcome::rolled_back);
}

void switch_transaction::mark_inconsistent(const std::string& why) {
  rep_.cursor = st_.cursor;
  st_.consistent = false;
  st_.inconsistency = why;
  end(switch_outcome::inconsistent);
}

}  // namespace moebius::detail
