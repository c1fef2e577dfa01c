#include "transaction.hpp"

#include <algorithm>
#include <cstdlib>
#include <optional>
#include <utility>

#include "moebius/detail/nvtx.hpp"
#include "moebius/error.hpp"
#include "moebius/plan/rollback.hpp"
#include "moebius/plan/weight_plan.hpp"
#include "moebius/switch/overlap.hpp"

namespace moebius::detail {
namespace {

double ms_between(clock_type::time_point a, clock_type::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

void append(plan& to, const plan& from) {
  to.phases.insert(to.phases.end(), from.phases.begin(), from.phases.end());
}

// `layer0` (a plan over layer 0's KV tensors with staging at arena offset 0) moved to `layer`
// with staging at `staging_offset`.
plan shift_kv_plan(const plan& layer0, const kv_geometry& g, int64_t layer,
                   int64_t staging_offset) {
  const int64_t pool_shift = g.tensor_offset(layer, kv_tensor::k);
  plan out = layer0;
  auto shift = [&](copy_op& op) {
    op.src_offset += op.src_space == memory_space::kv_pool ? pool_shift : staging_offset;
    op.dst_offset += op.dst_space == memory_space::kv_pool ? pool_shift : staging_offset;
  };
  for (plan_phase& ph : out.phases) {
    ph.label = "layer " + std::to_string(layer) + " KV " + ph.label;
    for (copy_op& op : ph.ops) shift(op);
    for (copy_op& op : ph.restores) shift(op);
  }
  return out;
}

std::vector<int64_t> scaled(std::vector<int64_t> v, int64_t by) {
  for (int64_t& x : v) x *= by;
  return v;
}

int64_t busiest(const std::vector<int64_t>& v) {
  return v.empty() ? 0 : *std::max_element(v.begin(), v.end());
}

// A plan's failure as the transaction needs it: its text, and whether an undo can be trusted.
// A barrier timed out (a slow peer may still pass it and write past the reached phase), or the
// device or the communicator failed: the bytes after completed_phases() are unknown. Injected
// faults and rejected plans are exact.
struct failure_info {
  std::string text;
  bool state_unknown = false;
};

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

}  // namespace

int64_t switch_transaction::unit::weight_phases() const {
  return std::abs(to.tp_layers - from.tp_layers);
}

switch_transaction::switch_transaction(switcher& sw, parallel_mode target, arena_cursor goal,
                                       style how, const switch_report& rep,
                                       clock_type::time_point t0)
    : sw_(sw), target_(target), start_(sw.cursor_), goal_(goal), how_(how), rep_(rep), t0_(t0) {}

std::unique_ptr<switch_transaction> switch_transaction::open(switcher& sw, parallel_mode target,
                                                             arena_cursor goal, style how,
                                                             switch_report& rep,
                                                             clock_type::time_point t0) {
  std::unique_ptr<switch_transaction> txn(new switch_transaction(sw, target, goal, how, rep, t0));
  if (!txn->plan_switch()) {
    rep = std::move(txn->rep_);
    rep.total_ms = ms_between(t0, clock_type::now());
    return nullptr;
  }
  rep.outcome = switch_outcome::in_progress;
  txn->rep_.outcome = switch_outcome::in_progress;
  return txn;
}

bool switch_transaction::plan_switch() {
  // The KV planner is the capacity check (it builds nothing and throws errc::capacity when the
  // target cannot hold the live KV), so a switch plans its KV once; only a refusal pays for the
  // detailed report.
  const auto t = clock_type::now();
  const arena_geometry& wg = sw_.weights_;
  kv_geometry kv_geom = sw_.kv_geometry_;
  kv_placement placement;  // the ep_placement hook's owners, while planning
  // Per layer: layer 0's KV, staging at offset 0 (see the top). Either way the ep_placement
  // hook runs once.
  if (how_ == style::per_layer) kv_geom.num_layers = 1;
  kv_migration_options kv_opt = how_ == style::per_layer
                                    ? sw_.one_layer_kv_options(target_, placement)
                                    : sw_.kv_options(goal_, target_, placement);
  kv_migration kv;
  std::optional<nvtx_range> plan_range(std::in_place, "moebius/switch/plan");
  try {
    kv = plan_kv_migration(kv_geom, sw_.kv_, target_, kv_opt);
  } catch (const error& e) {
    if (e.code() != errc::capacity) throw;
    plan_range.reset();
    const nvtx_range capacity_range("moebius/switch/capacity");
    rep_.capacity = check_kv_capacity(kv_geom, sw_.kv_, target_, kv_opt);
    rep_.capacity_ms = ms_between(t, clock_type::now());
    rep_.outcome = switch_outcome::refused_capacity;
    rep_.error = rep_.capacity.reason.empty() ? e.what() : rep_.capacity.reason;
    return false;
  }
  rep_.capacity.fits = rep_.capacity.holds = true;
  rep_.capacity.rounds = kv.stats.rounds;
  rep_.capacity.pages_available = sw_.kv_geometry_.num_pages(target_);
  rep_.kv_stats = kv.stats;
  target_tables_ = std::move(kv.new_state);
  kv_ = std::make_shared<const plan>(std::move(kv.copies));
  const int64_t rounds = static_cast<int64_t>(kv_->phases.size());

  const int64_t num_layers = std::abs(goal_.tp_layers - start_.tp_layers);
  const int sign = goal_.tp_layers > start_.tp_layers ? 1 : -1;
  if (how_ == style::whole) {
    units_.push_back(unit{start_, goal_, 0, rounds});
  } else {
    for (int64_t i = 0; i < num_layers; ++i) {
      const arena_cursor from{start_.tp_layers + sign * i};
      const arena_cursor to{from.tp_layers + sign};
      units_.push_back(unit{from, to, i * (1 + rounds), rounds});
    }
  }

  // What moves: in all, and for a progressive switch per layer (the pacing input: every layer
  // moves alike, so the whole is L times one layer).
  if (how_ == style::whole) {
    whole_weights_ = std::make_shared<const plan>(weight_plan_of(units_[0]));
    rep_.weight_bytes_sent = traffic_of(*whole_weights_).bytes_sent;
    rep_.kv_bytes_sent = traffic_of(*kv_).bytes_sent;
  } else {
    bytes_per_layer_.weight_bytes_sent = traffic_of(weight_plan_of(units_[0])).bytes_sent;
    bytes_per_layer_.weight_bytes_sent.resize(static_cast<size_t>(wg.num_ranks), 0);
    bytes_per_layer_.kv_bytes_sent = traffic_of(*kv_).bytes_sent;
    bytes_per_layer_.kv_bytes_sent.resize(static_cast<size_t>(wg.num_ranks), 0);
    rep_.weight_bytes_sent = scaled(bytes_per_layer_.weight_bytes_sent, num_layers);
    rep_.kv_bytes_sent = scaled(bytes_per_layer_.kv_bytes_sent, num_layers);
  }
  rep_.weight_phases = num_layers;
  rep_.kv_rounds = how_ == style::whole ? rounds : rounds * num_layers;
  rep_.workload.num_ranks = std::max(wg.num_ranks, 1);
  rep_.workload.weight_bytes_per_rank = busiest(rep_.weight_bytes_sent);
  rep_.workload.kv_bytes_per_rank = busiest(rep_.kv_bytes_sent);
  rep_.workload.weight_phases = rep_.weight_phases;
  rep_.workload.kv_rounds = rep_.kv_rounds;
  plan_range.reset();
  rep_.plan_ms = ms_between(t, clock_type::now());

  // The verify hook reads the ranks' memory back; it may throw (a CUDA error). Before the first
  // byte moves that costs nothing; after, it is a failure like any other.
  if (sw_.options_.verify) {
    checksum_before_ = checksum(start_, sw_.kv_, rep_.error);
    if (!rep_.error.empty()) {
      rep_.outcome = switch_outcome::rolled_back;  // nothing moved
      return false;
    }
  }
  if (sw_.options_.verify_layer) {
    for (int64_t l = 0; l < wg.shape.num_layers && rep_.error.empty(); ++l) {
      layer_before_.push_back(
          layer_checksum(l, arena_geometry::mode_of(start_, l), sw_.kv_, rep_.error));
    }
    if (!rep_.error.empty()) {
      rep_.outcome = switch_outcome::rolled_back;  // nothing moved
      return false;
    }
  }
  return true;
}

int64_t switch_transaction::layer_of(const unit& u) const {
  return u.to.tp_layers > u.from.tp_layers ? u.from.tp_layers : u.to.tp_layers;
}

bool switch_transaction::verify_moved_layers() {
  if (!sw_.options_.verify_layer) return true;
  // Layers whose weights and KV have all moved: every unit completed so far (whole: its one
  // unit holds every layer, checked at finish).
  std::string failure;
  for (; units_verified_ < units_.size() && failure.empty(); ++units_verified_) {
    const unit& u = units_[units_verified_];
    if (phases_done_ < u.first_phase + u.phases()) break;
    std::vector<int64_t> layers;
    if (how_ == style::per_layer) {
      layers.push_back(layer_of(u));
    } else {
      for (int64_t l = 0; l < sw_.weights_.shape.num_layers; ++l) layers.push_back(l);
    }
    for (const int64_t l : layers) {
      const uint64_t after = layer_checksum(l, target_, target_tables_, failure);
      if (!failure.empty()) break;
      if (after != layer_before_[static_cast<size_t>(l)]) {
        failure = "verify: layer " + std::to_string(l) +
                  "'s checksum after it moved differs from before the switch";
        break;
      }
    }
  }
  if (failure.empty()) return true;
  fail(failure, false);
  return false;
}

arena_cursor switch_transaction::cursor_at(int64_t phases) const {
  arena_cursor c = start_;
  for (const unit& u : units_) {
    const int64_t in_unit = phases - u.first_phase;
    if (in_unit <= 0) break;
    const int64_t moved = std::min(in_unit, u.weight_phases());
    c = arena_cursor{u.from.tp_layers + (u.to.tp_layers > u.from.tp_layers ? moved : -moved)};
  }
  return c;
}

plan switch_transaction::weight_plan_of(const unit& u) const {
  return plan_weight_switch(sw_.weights_, u.from, u.to);
}

std::shared_ptr<const plan> switch_transaction::kv_plan_of(size_t u) const {
  if (how_ == style::whole) return kv_;
  const unit& un = units_[u];
  // The layer this unit moves: EP->TP layer `from` (into slot from), TP->EP layer `to`.
  const int64_t layer = un.to.tp_layers > un.from.tp_layers ? un.from.tp_layers : un.to.tp_layers;
  return std::make_shared<const plan>(shift_kv_plan(
      *kv_, sw_.kv_geometry_, layer, sw_.weights_.slot_offset(arena_geometry::free_slot(un.to))));
}

switch_step_view switch_transaction::view() const {
  switch_step_view v;
  v.cursor_ = sw_.cursor_;
  v.source_ = &sw_.kv_;
  v.target_ = &target_tables_;
  return v;
}

void switch_transaction::arm(switch_fault::stage stage) {
  std::vector<switch_fault>& faults = sw_.faults_;
  for (auto it = faults.begin(); it != faults.end(); ++it) {
    // An advance carries weights and KV together: a weights or a KV fault arms it.
    const bool matches = how_ == style::per_layer && stage != switch_fault::stage::undo
                             ? it->where != switch_fault::stage::undo
                             : it->where == stage;
    if (matches) {
      sw_.transport_.inject_fault(it->at);
      faults.erase(it);
      return;
    }
  }
}

const layer_completion& switch_transaction::enqueue(int64_t units,
                                                    std::span<const stream_handle> streams,
                                                    const step_layer_events* beside) {
  const int64_t n = std::min(units, units_remaining());
  const size_t num_local = sw_.transport_.local_ranks().size();
  if (beside != nullptr) {
    MOEBIUS_CHECK(how_ == style::per_layer && beside->num_layers() == sw_.weights_.shape.num_layers &&
                      beside->num_local() == num_local,
                  errc::invalid_argument, "advance: the step's layer events cover ",
                  beside->num_layers(), " layers and ", beside->num_local(),
                  " local ranks; the switch has ", sw_.weights_.shape.num_layers, " layers and ",
                  num_local, " local ranks");
  }
  streams_.assign(streams.begin(), streams.end());
  completion_ = layer_completion{};
  if (n == 0) return completion_;
  const size_t first = static_cast<size_t>(units_enqueued_);
  if (how_ == style::whole) {
    // Weights first, then KV: two plans, each timed as its stage.
    segment w{whole_weights_, switch_fault::stage::weights, true, units_[first].first_phase, {},
              {}};
    segment k{kv_plan_of(first), switch_fault::stage::kv, true,
              units_[first].first_phase + units_[first].weight_phases(), {}, {}};
    units_enqueued_ += 1;
    queued_.push_back(std::move(k));
    start(std::move(w), /*rethrow=*/false);
    return completion_;
  }
  // One plan for the n layers, a phase mark after each layer's last phase.
  plan work;
  work.num_ranks = sw_.weights_.num_ranks;
  segment s{nullptr, switch_fault::stage::weights, false, units_[first].first_phase, {}, {}};
  std::vector<int64_t> mark_of_layer;  // index into s.marks, -1: nothing to wait for
  std::vector<int64_t> layers;
  for (size_t u = first; u < first + static_cast<size_t>(n); ++u) {
    const unit& un = units_[u];
    layers.push_back(un.to.tp_layers > un.from.tp_layers ? un.from.tp_layers : un.to.tp_layers);
  }
  // Beside a step: each layer's copies start once that step is past what they overwrite.
  const std::vector<int64_t> waits =
      beside ? copy_waits(sw_.weights_.shape.num_layers, sw_.cursor_, layers)
             : std::vector<int64_t>(layers.size(), -1);
  for (size_t u = first; u < first + static_cast<size_t>(n); ++u) {
    const size_t before = work.phases.size();
    if (const int64_t w = waits[u - first]; w >= 0) {
      transport::phase_wait pw;
      pw.phase = static_cast<int64_t>(before);
      for (size_t i = 0; i < num_local; ++i) pw.events.push_back(beside->get(w, i));
      s.waits.push_back(std::move(pw));
    }
    append(work, weight_plan_of(units_[u]));
    append(work, *kv_plan_of(u));
    if (work.phases.size() > before) s.marks.push_back(static_cast<int64_t>(work.phases.size()) - 1);
    mark_of_layer.push_back(static_cast<int64_t>(s.marks.size()) - 1);
  }
  completion_.layers_ = layers;
  s.work = std::make_shared<const plan>(std::move(work));
  // A plan the transport rejects throws out of here, and nothing was enqueued.
  start(std::move(s), /*rethrow=*/true);
  units_enqueued_ += n;
  // One event per layer and local rank: the mark after the layer's last phase.
  completion_.num_local_ = num_local;
  for (const int64_t m : mark_of_layer) {
    for (size_t i = 0; i < num_local; ++i) {
      completion_.events_.push_back(m >= 0 ? sw_.transport_.phase_event(static_cast<size_t>(m), i)
                                           : nullptr);
    }
  }
  return completion_;
}

void switch_transaction::start(segment s, bool rethrow) {
  arm(s.stage);
  current_ = std::make_unique<segment>(std::move(s));
  current_started_ = clock_type::now();
  start_failure_ = nullptr;
  try {
    sw_.transport_.mark_phases(current_->marks);
    sw_.transport_.wait_before_phases(current_->waits);
    sw_.transport_.enqueue(*current_->work, streams_);
  } catch (...) {
    // transport::enqueue throws only before anything started (a rejected plan, a bad stream
    // count). The first plan of an advance hands that to the caller; a plan that follows work
    // already done (switch_to's KV after its weights) fails the switch like a transport error.
    if (rethrow) {
      sw_.transport_.inject_fault(std::nullopt);
      current_.reset();
      throw;
    }
    start_failure_ = std::current_exception();
  }
}

bool switch_transaction::collect() {
  std::exception_ptr failure = std::exchange(start_failure_, nullptr);
  if (!failure) {
    try {
      sw_.transport_.wait();
    } catch (...) {
      failure = std::current_exception();
    }
  }
  sw_.transport_.inject_fault(std::nullopt);  // an armed fault that was not reached dies here
  const std::unique_ptr<segment> s = std::move(current_);
  if (s->timed) {
    const double ms = ms_between(current_started_, clock_type::now());
    (s->stage == switch_fault::stage::kv ? rep_.kv_ms : rep_.weights_ms) += ms;
  }
  if (!failure) {
    settle(s->first_phase + static_cast<int64_t>(s->work->phases.size()));
    // A progressive switch checks each layer as soon as it has moved.
    return how_ == style::whole || verify_moved_layers();
  }
  const int64_t completed = sw_.transport_.completed_phases();
  settle(s->first_phase + completed);
  queued_.clear();
  const failure_info f = classify(failure);
  if (f.state_unknown) {  // what ran past the reached phase of this plan is unknown
    unknown_first_ = s->first_phase + completed;
    unknown_end_ = s->first_phase + static_cast<int64_t>(s->work->phases.size());
  }
  fail(f.text, f.state_unknown);
  return false;
}

void switch_transaction::settle(int64_t phases) {
  phases_done_ = phases;
  int64_t weights = 0, kv = 0;
  for (const unit& u : units_) {
    const int64_t in_unit = std::clamp<int64_t>(phases - u.first_phase, 0, u.phases());
    weights += std::min(in_unit, u.weight_phases());
    kv += std::max<int64_t>(0, in_unit - u.weight_phases());
  }
  rep_.weight_phases_completed = weights;
  rep_.kv_rounds_completed = kv;
  // Where the weights rest. An advance completes whole layers (weights and KV), so a progressive
  // switch's cursor only passes layers that can be read in the new mode.
  sw_.cursor_ = cursor_at(phases);
  rep_.cursor = sw_.cursor_;
}

progress_state switch_transaction::poll() {
  while (!ended_ && current_) {
    if (!start_failure_ && !sw_.transport_.poll()) return progress_state::in_flight;
    if (!collect()) return progress_state::ended;
    if (!queued_.empty()) {
      segment next = std::move(queued_.front());
      queued_.pop_front();
      start(std::move(next), /*rethrow=*/false);
    }
  }
  return ended_ ? progress_state::ended : progress_state::ready;
}

void switch_transaction::wait() {
  while (!ended_ && current_) {
    {
      const nvtx_range range(current_->stage == switch_fault::stage::kv && current_->timed
                                 ? "moebius/switch/kv"
                                 : "moebius/switch/weights");
      if (!collect()) return;
    }
    if (!queued_.empty()) {
      segment next = std::move(queued_.front());
      queued_.pop_front();
      start(std::move(next), /*rethrow=*/false);
    }
  }
}

void switch_transaction::finish() {
  wait();
  if (ended_) return;
  if (units_remaining() > 0) {
    enqueue(units_remaining(), {});
    wait();
    if (ended_) return;
  }
  if (!verify_moved_layers()) return;  // whole: every layer; per_layer: checked already
  if (sw_.options_.verify) {
    std::string failure;
    const uint64_t after = checksum(goal_, target_tables_, failure);
    if (failure.empty() && after != checksum_before_) {
      failure = "verify: checksum after the switch differs from before";
    }
    if (!failure.empty()) {
      fail(failure, false);
      return;
    }
  }
  rep_.verified = sw_.options_.verify || sw_.options_.verify_layer;
  sw_.kv_ = std::move(target_tables_);
  sw_.cursor_ = goal_;
  rep_.cursor = goal_;
  end(switch_outcome::committed);
  if (sw_.options_.on_commit) sw_.options_.on_commit(target_);
}

void switch_transaction::abort(const std::string& why) {
  wait();
  if (ended_) return;  // the advance failed and was rolled back already
  fail(why, false);
}

uint64_t switch_transaction::layer_checksum(int64_t layer, parallel_mode mode,
                                           const kv_state& tables, std::string& failure) {
  const auto tv = clock_type::now();
  const nvtx_range verify_range("moebius/switch/verify");
  uint64_t sum = 0;
  try {
    sum = sw_.options_.verify_layer(layer, mode, tables);
  } catch (const std::exception& e) {
    failure = "verify hook failed on layer " + std::to_string(layer) + ": " + e.what();
  }
  rep_.verify_ms += ms_between(tv, clock_type::now());
  return sum;
}

uint64_t switch_transaction::checksum(arena_cursor c, const kv_state& tables,
                                      std::string& failure) {
  const auto tv = clock_type::now();
  const nvtx_range verify_range("moebius/switch/verify");
  uint64_t sum = 0;
  try {
    sum = sw_.options_.verify(c, tables);
  } catch (const std::exception& e) {
    failure = std::string("verify hook failed: ") + e.what();
  }
  rep_.verify_ms += ms_between(tv, clock_type::now());
  return sum;
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
    sw_.transport_.execute(p);
  } catch (...) {
    const failure_info f = classify(std::current_exception());
    failure = f.text;
    state_unknown = f.state_unknown;
  }
  sw_.transport_.inject_fault(std::nullopt);
  completed = failure.empty() ? static_cast<int64_t>(p.phases.size())
                              : sw_.transport_.completed_phases();
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
        undo_failed_unit_ = static_cast<int64_t>(i);
        undo_failed_in_kv_ = true;
        break;
      }
    }
    const arena_cursor reached = cursor_at(u.first_phase + std::min(done, u.weight_phases()));
    if (!(reached == u.from)) {
      const plan back = plan_weight_switch(sw_.weights_, reached, u.from);
      failure = run_undo(back, completed, state_unknown);
      const int64_t moved = reached.tp_layers > u.from.tp_layers ? -completed : completed;
      sw_.cursor_ = arena_cursor{reached.tp_layers + moved};
      if (!failure.empty()) {
        undo_failed_unit_ = static_cast<int64_t>(i);
        break;
      }
    }
    sw_.cursor_ = u.from;
  }
  undo_range.reset();
  rep_.undo_ms += ms_between(tu, clock_type::now());
  rep_.cursor = sw_.cursor_;
  if (!failure.empty()) {
    rep_.error += (rep_.error.empty() ? "" : "; ") + std::string("undo failed: ") + failure;
    mark_inconsistent(rep_.error);
    return;
  }
  end(switch_outcome::rolled_back);
}

void switch_transaction::mark_inconsistent(const std::string& why) {
  rep_.cursor = sw_.cursor_;
  sw_.consistent_ = false;
  sw_.inconsistency_ = why;
  end(switch_outcome::inconsistent);
}

void switch_transaction::end(switch_outcome outcome) {
  rep_.outcome = outcome;
  rep_.total_ms = ms_between(t0_, clock_type::now());
  ended_ = true;
  current_.reset();
  queued_.clear();
  sw_.faults_.clear();  // armed faults are for this switch only, reached or not
}

switch_transaction::kv_at switch_transaction::kv_of_unit(size_t u) const {
  const unit& un = units_[u];
  if (undo_failed_unit_ >= 0 && static_cast<int64_t>(u) >= undo_failed_unit_) {
    // Undone (later units), or the unit whose undo failed: its KV is back in the source layout
    // unless the KV's own undo was what failed (then partly reversed: unknown).
    if (static_cast<int64_t>(u) > undo_failed_unit_) return kv_at::source;
    return undo_failed_in_kv_ ? kv_at::unknown : kv_at::source;
  }
  const int64_t kv_first = un.first_phase + un.weight_phases();
  const int64_t kv_end = un.first_phase + un.phases();
  if (unknown_first_ >= 0 && unknown_first_ < kv_end && kv_first < unknown_end_) {
    return kv_at::unknown;  // some of its KV rounds may have run past what was reported
  }
  if (phases_done_ >= kv_end) return kv_at::target;
  if (phases_done_ <= kv_first) return kv_at::source;
  return kv_at::unknown;  // partly moved and not undone
}

void switch_transaction::rebuild_kv(parallel_mode mode) {
  const parallel_mode source = sw_.kv_.mode;
  std::vector<int64_t> live;  // every live sequence of the source tables
  for (const kv_rank_state& r : sw_.kv_.ranks)
    for (const kv_sequence& q : r.sequences) live.push_back(q.seq_id);
  std::sort(live.begin(), live.end());
  live.erase(std::unique(live.begin(), live.end()), live.end());

  // Every sequence needs every layer: one unknown layer loses them all.
  bool intact = true;
  for (size_t u = 0; u < units_.size() && intact; ++u)
    intact = units_[u].kv_rounds == 0 || kv_of_unit(u) != kv_at::unknown;
  if (intact) {
    // Move each layer intact in the other layout to `mode`: the unit's KV plan, or its exact
    // reverse. Each touches only its layer's KV and the arena slot it stages through (the
    // arena is reloaded afterwards).
    try {
      for (size_t u = 0; u < units_.size(); ++u) {
        if (units_[u].kv_rounds == 0) continue;
        const kv_at at = kv_of_unit(u);
        const bool in_source = at == kv_at::source;
        if (in_source == (mode == source)) continue;
        const std::shared_ptr<const plan> p = kv_plan_of(u);
        sw_.transport_.execute(in_source ? *p : rollback_plan(*p, units_[u].kv_rounds));
        ++plans_run_;
      }
    } catch (const std::exception&) {
      sw_.transport_.inject_fault(std::nullopt);
      intact = false;  // the move failed part-way: that layer is not intact any more
    }
  }
  if (intact) {
    settled_tables_ = mode == source ? sw_.kv_ : target_tables_;
    kept_ = live;
  } else {
    settled_tables_ = kv_state{};
    settled_tables_.mode = mode;
    settled_tables_.ranks.resize(static_cast<size_t>(sw_.kv_geometry_.num_ranks));
    for (kv_rank_state& r : settled_tables_.ranks) {
      for (int64_t p = 0; p < sw_.kv_geometry_.num_pages(mode); ++p) r.free_pages.push_back(p);
    }
    lost_ = live;
  }
  settled_mode_ = mode;
  kv_settled_ = true;
}

recovery_report switch_transaction::recover(const recovery_request& request) {
  const auto t0 = clock_type::now();
  MOEBIUS_CHECK(!kv_settled_ || settled_mode_ == request.mode, errc::invalid_argument,
                "recover: an earlier attempt rebuilt the KV in ", to_string(settled_mode_),
                "; recover in ", to_string(settled_mode_), " (asked ", to_string(request.mode), ")");
  const nvtx_range range("moebius/switch/recover");
  sw_.faults_.clear();
  sw_.transport_.inject_fault(std::nullopt);
  if (!kv_settled_) rebuild_kv(request.mode);
  recovery_report r;
  r.mode = request.mode;
  r.kept = kept_;
  r.lost = lost_;
  r.kv_plans_run = plans_run_;
  const arena_cursor resting{request.mode == parallel_mode::tp ? sw_.weights_.shape.num_layers : 0};
  try {
    request.reload_experts(resting);
  } catch (const std::exception& e) {
    r.error = std::string("recover: reload_experts failed: ") + e.what();
    r.cursor = sw_.cursor_;
    r.total_ms = ms_between(t0, clock_type::now());
    return r;
  }
  validate(sw_.kv_geometry_, settled_tables_);
  sw_.kv_ = std::move(settled_tables_);
  sw_.cursor_ = resting;
  sw_.consistent_ = true;
  sw_.inconsistency_.clear();
  r.recovered = true;
  r.cursor = resting;
  r.total_ms = ms_between(t0, clock_type::now());
  return r;
}

}  // namespace moebius::detail
