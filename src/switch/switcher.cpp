#include "moebius/switch/switcher.hpp"

#include <algorithm>
#include <chrono>
#include <optional>
#include <ostream>
#include <utility>

#include "moebius/detail/enum_check.hpp"
#include "moebius/detail/nvtx.hpp"
#include "moebius/error.hpp"
#include "moebius/plan/rollback.hpp"
#include "moebius/plan/weight_plan.hpp"
#include "progress.hpp"

namespace moebius {
namespace {

double ms_between(clock_type::time_point a, clock_type::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

arena_cursor resting_cursor(const arena_geometry& g, parallel_mode m) {
  return arena_cursor{m == parallel_mode::tp ? g.shape.num_layers : 0};
}

}  // namespace

const char* to_string(switch_outcome o) {
  switch (o) {
    case switch_outcome::committed: return "committed";
    case switch_outcome::already_there: return "already_there";
    case switch_outcome::refused_capacity: return "refused_capacity";
    case switch_outcome::rolled_back: return "rolled_back";
    case switch_outcome::inconsistent: return "inconsistent";
    case switch_outcome::in_progress: return "in_progress";
  }
  return "unknown";
}

switcher::switcher(const arena_geometry& weights, const kv_geometry& kv, transport& t,
                   kv_state kv_tables, arena_cursor cursor, switcher_options options)
    : weights_(weights),
      kv_geometry_(kv),
      transport_(t),
      kv_(std::move(kv_tables)),
      cursor_(cursor),
      options_(std::move(options)) {
  validate(weights_, cursor_);
  validate(kv_geometry_);
  validate(kv_geometry_, kv_);
  MOEBIUS_CHECK(weights_.num_ranks == t.num_ranks() && kv_geometry_.num_ranks == t.num_ranks(),
                errc::invalid_argument, "switcher: rank counts differ (weights P=",
                weights_.num_ranks, ", kv P=", kv_geometry_.num_ranks,
                ", transport P=", t.num_ranks(), ")");
  MOEBIUS_CHECK(cursor_ == resting_cursor(weights_, kv_.mode), errc::invalid_argument,
                "switcher: the arena cursor must match the KV mode (cursor tp_layers=",
                cursor_.tp_layers, ", KV mode ", to_string(kv_.mode), " needs ",
                resting_cursor(weights_, kv_.mode).tp_layers, ")");
}

kv_migration_options switcher::kv_options(arena_cursor weights_at) const {
  kv_migration_options opt;
  opt.max_rounds = options_.max_kv_rounds;
  if (options_.stage_kv_in_free_slot) {
    opt.staging.space = memory_space::arena;
    opt.staging.offset = weights_.slot_offset(arena_geometry::free_slot(weights_at));
    opt.staging.bytes = weights_.slot_bytes;
  }
  return opt;
}

kv_capacity_report switcher::check(parallel_mode target) const {
  detail::check_enum(target, "switcher::check target (parallel_mode)");
  return check_kv_capacity(kv_geometry_, kv_, target,
                           kv_options(resting_cursor(weights_, target)));
}

void switcher::arm_fault(const std::function<bool(switch_fault::stage)>& matches) {
  for (auto it = faults_.begin(); it != faults_.end(); ++it) {
    if (matches(it->where)) {
      transport_.inject_fault(it->at);
      faults_.erase(it);
      return;
    }
  }
}

std::string switcher::run(const plan& p, switch_fault::stage stage, int64_t& completed,
                          bool& state_unknown) {
  completed = 0;
  arm_fault([stage](switch_fault::stage s) { return s == stage; });
  std::string failure;
  try {
    transport_.execute(p);
  } catch (const error& e) {
    failure = e.what();
    // A barrier timed out (a slow peer may still pass it and write past the reached phase),
    // or the device or the communicator failed: the bytes after completed_phases() are
    // unknown and no undo can be trusted. Injected faults and rejected plans are exact.
    state_unknown = state_unknown || e.code() == errc::timeout || e.code() == errc::cuda ||
                e.code() == errc::nccl;
  } catch (const std::exception& e) {
    failure = std::string("moebius: ") + e.what();
  }
  transport_.inject_fault(std::nullopt);  // an armed fault that was not reached dies here
  completed = failure.empty() ? static_cast<int64_t>(p.phases.size())
                              : transport_.completed_phases();
  return failure;
}

std::optional<arena_cursor> switcher::open_report(switch_report& rep,
                                                  parallel_mode target) const {
  rep = switch_report{};
  rep.from = mode();
  rep.to = target;
  rep.cursor = cursor_;
  if (!consistent_) {
    rep.outcome = switch_outcome::inconsistent;
    rep.error = "refused: the switcher is inconsistent since an earlier failure (" +
                inconsistency_ + "); reload the experts and the KV pool first";
    return std::nullopt;
  }
  validate(kv_geometry_, kv_);
  const arena_cursor goal = resting_cursor(weights_, target);
  if (kv_.mode == target && cursor_ == goal) {
    rep.outcome = switch_outcome::already_there;
    return std::nullopt;
  }
  return goal;
}

switch_report switcher::switch_to(parallel_mode target) {
  // Armed faults are for this call only, reached or not.
  struct disarm_on_exit {
    std::vector<switch_fault>& faults;
    ~disarm_on_exit() { faults.clear(); }
  } disarm{faults_};
  detail::check_enum(target, "switcher::switch_to target (parallel_mode)");
  MOEBIUS_CHECK(!progress_, errc::invalid_argument,
                "switch_to: a progressive switch is in progress; finish() or abort() it first");
  const auto t0 = clock_type::now();
  const detail::nvtx_range switch_range("moebius/switch");
  switch_report rep;
  const std::optional<arena_cursor> opened = open_report(rep, target);
  if (!opened) {
    rep.total_ms = ms_between(t0, clock_type::now());
    return rep;
  }
  const arena_cursor start = cursor_;
  const arena_cursor goal = *opened;

  // 1. Capacity and plans, before any byte moves. The KV planner is the capacity check (it
  // builds nothing and throws errc::capacity when the target cannot hold the live KV), so a
  // switch plans its KV once; only a refusal pays for the detailed report.
  auto t = clock_type::now();
  const kv_migration_options kv_opt = kv_options(goal);
  kv_migration kv;
  std::optional<detail::nvtx_range> plan_range(std::in_place, "moebius/switch/plan");
  try {
    kv = plan_kv_migration(kv_geometry_, kv_, target, kv_opt);
  } catch (const error& e) {
    if (e.code() != errc::capacity) throw;
    plan_range.reset();
    const detail::nvtx_range capacity_range("moebius/switch/capacity");
    rep.capacity = check_kv_capacity(kv_geometry_, kv_, target, kv_opt);
    rep.capacity_ms = ms_between(t, clock_type::now());
    rep.outcome = switch_outcome::refused_capacity;
    rep.error = rep.capacity.reason.empty() ? e.what() : rep.capacity.reason;
    rep.total_ms = ms_between(t0, clock_type::now());
    return rep;
  }
  rep.capacity.fits = rep.capacity.holds = true;
  rep.capacity.rounds = kv.stats.rounds;
  rep.capacity.pages_available = kv_geometry_.num_pages(target);
  const plan weights = plan_weight_switch(weights_, start, goal);
  plan_range.reset();
  rep.plan_ms = ms_between(t, clock_type::now());
  rep.weight_phases = static_cast<int64_t>(weights.phases.size());
  rep.kv_rounds = static_cast<int64_t>(kv.copies.phases.size());
  rep.weight_bytes_sent = traffic_of(weights).bytes_sent;
  rep.kv_bytes_sent = traffic_of(kv.copies).bytes_sent;
  rep.kv_stats = kv.stats;

  // The verify hook reads the ranks' memory back; it may throw (a CUDA error). Before the
  // first byte moves that costs nothing; after, it is a failure like any other.
  auto checksum = [&](arena_cursor c, const kv_state& tables, std::string& failure) {
    const auto tv = clock_type::now();
    const detail::nvtx_range verify_range("moebius/switch/verify");
    uint64_t sum = 0;
    try {
      sum = options_.verify(c, tables);
    } catch (const std::exception& e) {
      failure = std::string("verify hook failed: ") + e.what();
    }
    rep.verify_ms += ms_between(tv, clock_type::now());
    return sum;
  };
  uint64_t checksum_before = 0;
  if (options_.verify) {
    checksum_before = checksum(start, kv_, rep.error);
    if (!rep.error.empty()) {
      rep.outcome = switch_outcome::rolled_back;  // nothing moved
      rep.total_ms = ms_between(t0, clock_type::now());
      return rep;
    }
  }
  bool state_unknown = false;  // a failure after which no undo can be trusted

  // Undoes `kv_done` KV rounds, then the weights from where they rest back to `start`.
  auto undo = [&](int64_t kv_done, arena_cursor weights_at) {
    if (state_unknown) {
      // No undo over bytes in an unknown state: report where the arena was known to rest.
      cursor_ = weights_at;
      rep.cursor = cursor_;
      rep.outcome = switch_outcome::inconsistent;
      rep.error += "; not undone: after a barrier timeout or a device error a rank may have "
                   "written past the reached phase";
      consistent_ = false;
      inconsistency_ = rep.error;
      rep.total_ms = ms_between(t0, clock_type::now());
      return rep;
    }
    const auto tu = clock_type::now();
    std::optional<detail::nvtx_range> undo_range(std::in_place, "moebius/switch/undo");
    int64_t done = 0;
    std::string failure;
    if (kv_done > 0) {
      failure = run(rollback_plan(kv.copies, kv_done), switch_fault::stage::undo, done, state_unknown);
    }
    if (failure.empty() && !(weights_at == start)) {
      const plan back = plan_weight_switch(weights_, weights_at, start);
      failure = run(back, switch_fault::stage::undo, done, state_unknown);
      const int64_t moved = weights_at.tp_layers > start.tp_layers ? -done : done;
      weights_at = arena_cursor{weights_at.tp_layers + moved};
    }
    undo_range.reset();
    rep.undo_ms = ms_between(tu, clock_type::now());
    cursor_ = weights_at;
    rep.cursor = cursor_;
    if (failure.empty()) {
      rep.outcome = switch_outcome::rolled_back;
    } else {
      rep.outcome = switch_outcome::inconsistent;
      rep.error += "; undo failed: " + failure;
      consistent_ = false;
      inconsistency_ = rep.error;
    }
    rep.total_ms = ms_between(t0, clock_type::now());
    return rep;
  };

  // 3. Expert weights, layer by layer through the arena cursor.
  t = clock_type::now();
  {
    const detail::nvtx_range weights_range("moebius/switch/weights");
    rep.error =
        run(weights, switch_fault::stage::weights, rep.weight_phases_completed, state_unknown);
  }
  rep.weights_ms = ms_between(t, clock_type::now());
  if (!rep.error.empty()) {
    const int64_t k = rep.weight_phases_completed;
    return undo(0, arena_cursor{goal.tp_layers > start.tp_layers ? start.tp_layers + k
                                                                  : start.tp_layers - k});
  }

  // 4. KV pages, in rounds.
  t = clock_type::now();
  {
    const detail::nvtx_range kv_range("moebius/switch/kv");
    rep.error = run(kv.copies, switch_fault::stage::kv, rep.kv_rounds_completed, state_unknown);
  }
  rep.kv_ms = ms_between(t, clock_type::now());
  if (!rep.error.empty()) return undo(rep.kv_rounds_completed, goal);

  // 5. Verify end to end, then commit: new tables, cursor, selector.
  if (options_.verify) {
    const uint64_t after = checksum(goal, kv.new_state, rep.error);
    if (rep.error.empty() && after != checksum_before) {
      rep.error = "verify: checksum after the switch differs from before";
    }
    if (!rep.error.empty()) return undo(rep.kv_rounds, goal);
    rep.verified = true;
  }
  kv_ = kv.new_state;
  cursor_ = goal;
  rep.cursor = goal;
  rep.outcome = switch_outcome::committed;
  if (options_.on_commit) options_.on_commit(target);
  rep.total_ms = ms_between(t0, clock_type::now());
  return rep;
}

switch_workload workload_of(const switch_report& r) {
  switch_workload w;
  w.num_ranks = static_cast<int>(std::max(r.weight_bytes_sent.size(), r.kv_bytes_sent.size()));
  w.num_ranks = std::max(w.num_ranks, 1);
  for (int64_t b : r.weight_bytes_sent) w.weight_bytes_per_rank = std::max(w.weight_bytes_per_rank, b);
  for (int64_t b : r.kv_bytes_sent) w.kv_bytes_per_rank = std::max(w.kv_bytes_per_rank, b);
  w.weight_phases = r.weight_phases;
  w.kv_rounds = r.kv_rounds;
  return w;
}

std::ostream& operator<<(std::ostream& os, const switch_report& r) {
  int64_t wmax = 0, kmax = 0;
  for (int64_t b : r.weight_bytes_sent) wmax = std::max(wmax, b);
  for (int64_t b : r.kv_bytes_sent) kmax = std::max(kmax, b);
  os << "switch " << to_string(r.from) << "->" << to_string(r.to) << ": "
     << to_string(r.outcome) << ", cursor " << r.cursor.tp_layers << "; weights "
     << r.weight_phases_completed << '/' << r.weight_phases << " phases, " << wmax
     << " B max sent per rank, " << r.weights_ms << " ms; KV " << r.kv_rounds_completed << '/'
     << r.kv_rounds << " rounds, " << kmax << " B max sent per rank, " << r.kv_ms
     << " ms; capacity " << r.capacity_ms << " ms, plans " << r.plan_ms << " ms, undo "
     << r.undo_ms << " ms, total " << r.total_ms << " ms";
  if (r.verified) os << "; verified";
  if (!r.error.empty()) os << "; error: " << r.error;
  return os;
}

}  // namespace moebius
