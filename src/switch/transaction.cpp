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

void append(plan& to, const plan& from) {
  to.phases.insert(to.phases.end(), from.phases.begin(), from.phases.end());
}

// `layer0` (a plan over layer 0's KV tensors with staging at arena offset 0) moved to `layer`
// with staging at `staging_offset`. Both views of a pool layout share its layer stride
// (derive_tp_strides keeps every stride outside a page), so one shift serves both directions.
plan shift_kv_plan(const plan& layer0, const kv_pool_layout& layout, int64_t layer,
                   int64_t staging_offset) {
  const int64_t pool_shift = layer * layout.ep.layer;
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

}  // namespace

int64_t switch_transaction::unit::weight_phases() const {
  return std::abs(to.tp_layers - from.tp_layers);
}

switch_transaction::switch_transaction(switch_state& st, const switch_plan& p, style how,
                                       const switch_report& rep, clock_type::time_point t0)
    : st_(st),
      target_(p.to),
      target_dcp_(p.to_dcp),
      start_(p.start),
      goal_(p.goal),
      how_(how),
      rep_(rep),
      t0_(t0) {}

std::unique_ptr<switch_transaction> switch_transaction::open(switch_state& st,
                                                             const switch_plan& p, style how,
                                                             switch_report& rep,
                                                             clock_type::time_point t0) {
  std::unique_ptr<switch_transaction> txn(new switch_transaction(st, p, how, rep, t0));
  if (!txn->take_plan(p)) {
    rep = std::move(txn->rep_);
    rep.total_ms = p.plan_ms + ms_between(t0, clock_type::now());
    return nullptr;
  }
  rep.outcome = switch_outcome::in_progress;
  txn->rep_.outcome = switch_outcome::in_progress;
  // Bytes may move from here on: a plan made before is stale.
  st.move_on(std::string("a switch to ") + to_string(p.to) + " began");
  return txn;
}

bool switch_transaction::take_plan(const switch_plan& p) {
  // This style's KV plan (see the top): all layers' in one migration, or layer 0's.
  const kv_capacity_report& capacity = how_ == style::whole ? p.capacity : p.layer_capacity;
  const std::shared_ptr<const kv_migration>& kv = how_ == style::whole ? p.kv : p.layer_kv;
  rep_.capacity = capacity;
  if (!kv) {
    rep_.capacity_ms = p.plan_ms;
    rep_.outcome = switch_outcome::refused_capacity;
    rep_.error = capacity.reason.empty()
                     ? "KV migration " + switch_direction(p.from, p.to, p.from_dcp, p.to_dcp) +
                           " impossible"
                     : capacity.reason;
    return false;
  }
  const arena_geometry& wg = st_.weights;
  rep_.plan_ms = p.plan_ms;
  rep_.kv_stats = kv->stats;
  target_tables_ = kv->new_state;
  kv_ = std::shared_ptr<const plan>(kv, &kv->copies);  // shares the plan's migration
  weights_ = p.weights;
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
    rep_.weight_bytes_sent = traffic_of(*weights_).bytes_sent;
    rep_.kv_bytes_sent = traffic_of(*kv_).bytes_sent;
  } else {
    bytes_per_layer_ = p.bytes_per_layer;
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

  // The verify hook reads the ranks' memory back; it may throw (a CUDA error). Before the first
  // byte moves that costs nothing; after, it is a failure like any other.
  if (st_.options.verify) {
    checksum_before_ = checksum(start_, st_.kv, rep_.error);
    if (!rep_.error.empty()) {
      rep_.outcome = switch_outcome::rolled_back;  // nothing moved
      return false;
    }
  }
  if (st_.options.verify_layer) {
    for (int64_t l = 0; l < wg.shape.num_layers && rep_.error.empty(); ++l) {
      layer_before_.push_back(
          layer_checksum(l, arena_geometry::mode_of(start_, l), st_.kv, rep_.error));
    }
    if (!rep_.error.empty()) {
      rep_.outcome = switch_outcome::rolled_back;  // nothing moved
      return false;
    }
  }
  return true;
}

bool switch_transaction::verify_moved_layers() {
  if (!st_.options.verify_layer) return true;
  // Layers whose weights and KV have all moved: every unit completed so far (whole: its one
  // unit holds every layer, checked at finish).
  std::string failure;
  for (; units_verified_ < units_.size() && failure.empty(); ++units_verified_) {
    const unit& u = units_[units_verified_];
    if (phases_done_ < u.first_phase + u.phases()) break;
    std::vector<int64_t> layers;
    if (how_ == style::per_layer) {
      layers.push_back(u.layer());
    } else {
      for (int64_t l = 0; l < st_.weights.shape.num_layers; ++l) layers.push_back(l);
    }
    for (const int64_t l : layers) {
      const uint64_t after = layer_checksum(l, target_.experts, target_tables_, failure);
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

std::shared_ptr<const plan> switch_transaction::weight_plan_of(size_t u) const {
  if (how_ == style::whole) return weights_;
  // Unit u moves the switch's u-th layer: phase u of the plan (switch_plan::weights).
  auto one = std::make_shared<plan>();
  one->num_ranks = weights_->num_ranks;
  one->phases.push_back(weights_->phases[u]);
  return one;
}

std::shared_ptr<const plan> switch_transaction::kv_plan_of(size_t u) const {
  if (how_ == style::whole) return kv_;
  const unit& un = units_[u];
  return std::make_shared<const plan>(shift_kv_plan(
      *kv_, st_.kv_layout, un.layer(), st_.weights.slot_offset(arena_geometry::free_slot(un.to))));
}

switch_step_view switch_transaction::view() const {
  switch_step_view v;
  v.cursor_ = st_.cursor;
  v.source_ = &st_.kv;
  v.target_ = &target_tables_;
  return v;
}

void switch_transaction::arm(switch_fault::stage stage) {
  std::vector<switch_fault>& faults = st_.faults;
  for (auto it = faults.begin(); it != faults.end(); ++it) {
    // An advance carries weights and KV together: a weights or a KV fault arms it.
    const bool matches = how_ == style::per_layer && stage != switch_fault::stage::undo
                             ? it->where != switch_fault::stage::undo
                             : it->where == stage;
    if (matches) {
      st_.mover.inject_fault(it->at);
      faults.erase(it);
      return;
    }
  }
}

const layer_completion& switch_transaction::enqueue(int64_t units,
                                                    std::span<const stream_handle> streams,
                                                    const step_layer_events* beside) {
  const int64_t n = std::min(units, units_remaining());
  const size_t num_local = st_.mover.local_ranks().size();
  if (beside != nullptr) {
    MOEBIUS_CHECK(how_ == style::per_layer && beside->num_layers() == st_.weights.shape.num_layers &&
                      beside->num_local() == num_local,
                  errc::invalid_argument, "advance: the step's layer events cover ",
                  beside->num_layers(), " layers and ", beside->num_local(),
                  " local ranks; the switch has ", st_.weights.shape.num_layers, " layers and ",
                  num_local, " local ranks");
  }
  streams_.assign(streams.begin(), streams.end());
  completion_ = layer_completion{};
  if (n == 0) return completion_;
  const size_t first = static_cast<size_t>(units_enqueued_);
  if (how_ == style::whole) {
    // Weights first, then KV: two plans, each timed as its stage.
    segment w{weights_, switch_fault::stage::weights, true, units_[first].first_phase, {},
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
  work.num_ranks = st_.weights.num_ranks;
  segment s{nullptr, switch_fault::stage::weights, false, units_[first].first_phase, {}, {}};
  std::vector<int64_t> mark_of_layer;  // index into s.marks, -1: nothing to wait for
  std::vector<int64_t> layers;
  for (size_t u = first; u < first + static_cast<size_t>(n); ++u) layers.push_back(units_[u].layer());
  // Beside a step: each layer's copies start once that step is past what they overwrite.
  const std::vector<int64_t> waits =
      beside ? copy_waits(st_.weights.shape.num_layers, st_.cursor, layers)
             : std::vector<int64_t>(layers.size(), -1);
  for (size_t u = first; u < first + static_cast<size_t>(n); ++u) {
    const size_t before = work.phases.size();
    if (const int64_t w = waits[u - first]; w >= 0) {
      transport::phase_wait pw;
      pw.phase = static_cast<int64_t>(before);
      for (size_t i = 0; i < num_local; ++i) pw.events.push_back(beside->get(w, i));
      s.waits.push_back(std::move(pw));
    }
    append(work, *weight_plan_of(u));
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
      completion_.events_.push_back(m >= 0 ? st_.mover.phase_event(static_cast<size_t>(m), i)
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
    st_.mover.mark_phases(current_->marks);
    st_.mover.wait_before_phases(current_->waits);
    st_.mover.enqueue(*current_->work, streams_);
  } catch (...) {
    // transport::enqueue throws only before anything started (a rejected plan, a bad stream
    // count). The first plan of an advance hands that to the caller; a plan that follows work
    // already done (switch_to's KV after its weights) fails the switch like a transport error.
    if (rethrow) {
      st_.mover.inject_fault(std::nullopt);
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
      st_.mover.wait();
    } catch (...) {
      failure = std::current_exception();
    }
  }
  st_.mover.inject_fault(std::nullopt);  // an armed fault that was not reached dies here
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
  const int64_t completed = st_.mover.completed_phases();
  settle(s->first_phase + completed);
  queued_.clear();
  const failure_info f = classify(failure);
  if (f.state_unknown) {  // what ran past the reached phase of this plan is unknown
    wreck_.unknown_first = s->first_phase + completed;
    wreck_.unknown_end = s->first_phase + static_cast<int64_t>(s->work->phases.size());
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
  st_.cursor = cursor_at(phases);
  rep_.cursor = st_.cursor;
}

progress_state switch_transaction::poll() {
  while (!ended_ && current_) {
    if (!start_failure_ && !st_.mover.poll()) return progress_state::in_flight;
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
  if (st_.options.verify) {
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
  rep_.verified = st_.options.verify || st_.options.verify_layer;
  st_.kv = std::move(target_tables_);
  st_.kv_geom = with_dcp(st_.kv_geom, target_dcp_);  // the tables' dcp (a dcp change's)
  st_.cursor = goal_;
  rep_.cursor = goal_;
  end(switch_outcome::committed);
  if (st_.options.on_commit) st_.options.on_commit(target_);
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
    sum = st_.options.verify_layer(layer, mode, tables);
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
    sum = st_.options.verify(c, tables);
  } catch (const std::exception& e) {
    failure = std::string("verify hook failed: ") + e.what();
  }
  rep_.verify_ms += ms_between(tv, clock_type::now());
  return sum;
}

void switch_transaction::end(switch_outcome outcome) {
  rep_.outcome = outcome;
  rep_.total_ms = rep_.plan_ms + ms_between(t0_, clock_type::now());
  ended_ = true;
  current_.reset();
  queued_.clear();
  st_.faults.clear();  // armed faults are for this switch only, reached or not
  st_.move_on(std::string("a switch to ") + to_string(target_) + " ended " + to_string(outcome));
}

}  // namespace moebius::detail
