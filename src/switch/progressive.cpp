// The progressive switch (switcher.hpp): the arena cursor advances a few layers per decode
// step, each layer's weights and then that layer's KV together.
//
// Why per-layer KV plans are valid. A page id names the same page in every layer, so the KV
// migration's page-state evolution (which page is free in which round) is the same for every
// layer. The migration is therefore planned once, for a one-layer geometry (layer 0's tensors,
// staging at offset 0), and shifted to layer l: pool offsets by l's tensor offset, staging
// offsets to the arena slot that is free right after l's weights moved (EP->TP: layer l goes
// from slot l+1 to slot l, so slot l+1 comes free; TP->EP: from slot l to l+1, slot l comes
// free). Each shifted plan only touches layer l's KV and the free slot, and drains its staging
// before the next layer's weights write that slot.
//
// Undo. Phases ran in the order W(l0), KV(l0) rounds, W(l1), KV(l1) rounds, ...; the undo
// runs the exact reverse (rollback_plan of each layer's KV rounds, then the one-layer weight
// plan back), so each layer's staging slot is free again when its KV undo needs it.

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "moebius/error.hpp"
#include "moebius/plan/rollback.hpp"
#include "moebius/plan/weight_plan.hpp"
#include "moebius/switch/switcher.hpp"
#include "progress.hpp"

namespace moebius {
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

}  // namespace

switcher::~switcher() = default;

int64_t switcher::layers_remaining() const {
  return progress_ ? progress_->num_layers - progress_->layers_enqueued : 0;
}

const kv_state& switcher::tables_for(parallel_mode m) const {
  if (progress_ && m == progress_->target) return progress_->target_tables;
  MOEBIUS_CHECK(m == kv_.mode, errc::invalid_argument, "tables_for(", to_string(m),
                "): no switch is in progress and the tables are in ", to_string(kv_.mode));
  return kv_;
}

switch_report switcher::begin(parallel_mode target) {
  MOEBIUS_CHECK(target == parallel_mode::ep || target == parallel_mode::tp,
                errc::invalid_argument, "begin: target mode ", static_cast<int>(target),
                " is neither EP nor TP");
  MOEBIUS_CHECK(!progress_, errc::invalid_argument,
                "begin: a progressive switch is already in progress");
  MOEBIUS_CHECK(kv_geometry_.num_layers == weights_.shape.num_layers, errc::invalid_argument,
                "begin: a progressive switch moves each layer's weights and KV together, so the "
                "KV cache needs one layer per MoE layer (KV layers ", kv_geometry_.num_layers,
                ", MoE layers ", weights_.shape.num_layers, ")");
  const auto t0 = clock_type::now();
  switch_report& rep = progress_report_;
  const std::optional<arena_cursor> opened = open_report(rep, target);
  if (!opened) return rep;
  const arena_cursor goal = *opened;

  // Capacity and plans: the KV of one layer (every layer migrates alike), staged in the free
  // slot; the planner refuses (errc::capacity) when the target cannot hold the live KV.
  auto p = std::make_unique<progress>();
  p->target = target;
  p->start = cursor_;
  p->goal = goal;
  p->t0 = t0;
  p->num_layers = std::abs(goal.tp_layers - cursor_.tp_layers);
  kv_geometry one_layer = kv_geometry_;
  one_layer.num_layers = 1;
  kv_migration_options opt;
  opt.max_rounds = options_.max_kv_rounds;
  if (options_.stage_kv_in_free_slot) {
    opt.staging.space = memory_space::arena;
    opt.staging.offset = 0;
    opt.staging.bytes = weights_.slot_bytes;
  }
  kv_migration kv;
  try {
    kv = plan_kv_migration(one_layer, kv_, target, opt);
  } catch (const error& e) {
    if (e.code() != errc::capacity) throw;
    rep.capacity = check_kv_capacity(one_layer, kv_, target, opt);
    rep.outcome = switch_outcome::refused_capacity;
    rep.error = rep.capacity.reason.empty() ? e.what() : rep.capacity.reason;
    rep.total_ms = ms_between(t0, clock_type::now());
    return rep;
  }
  p->target_tables = std::move(kv.new_state);
  p->kv_rounds = static_cast<int64_t>(kv.copies.phases.size());
  p->kv_layer0 = std::move(kv.copies);
  rep.capacity.fits = rep.capacity.holds = true;
  rep.capacity.rounds = p->kv_rounds;
  rep.capacity.pages_available = kv_geometry_.num_pages(target);
  rep.weight_phases = p->num_layers;
  rep.kv_rounds = p->kv_rounds * p->num_layers;
  rep.kv_stats = kv.stats;
  rep.plan_ms = ms_between(t0, clock_type::now());
  if (options_.verify) {
    try {
      p->checksum_before = options_.verify(cursor_, kv_);
    } catch (const std::exception& e) {
      rep.outcome = switch_outcome::rolled_back;  // nothing moved
      rep.error = std::string("verify hook failed: ") + e.what();
      return rep;
    }
  }
  progress_ = std::move(p);
  rep.outcome = switch_outcome::in_progress;
  return rep;
}

int64_t switcher::advance(int64_t layers, std::span<const stream_handle> streams) {
  MOEBIUS_CHECK(progress_, errc::invalid_argument, "advance: no progressive switch in progress");
  MOEBIUS_CHECK(progress_->outstanding == 0, errc::invalid_argument,
                "advance: the previous advance is still outstanding; poll() until it is done");
  MOEBIUS_CHECK(layers >= 1, errc::invalid_argument, "advance: layers must be >= 1 (got ",
                layers, ")");
  progress& p = *progress_;
  const int64_t n = std::min(layers, p.num_layers - p.layers_enqueued);
  if (n == 0) return 0;
  plan work;
  work.num_ranks = weights_.num_ranks;
  for (int64_t i = p.layers_enqueued; i < p.layers_enqueued + n; ++i) {
    const arena_cursor after = p.cursor_after(i + 1);
    append(work, plan_weight_switch(weights_, p.cursor_after(i), after));
    append(work, shift_kv_plan(p.kv_layer0, kv_geometry_, p.layer(i),
                               weights_.slot_offset(arena_geometry::free_slot(after))));
  }
  // An advance is weights and KV together: a weights or a KV fault arms it.
  arm_fault([](switch_fault::stage s) { return s != switch_fault::stage::undo; });
  transport_.enqueue(work, streams);  // a bad plan throws here and nothing started
  p.layers_enqueued += n;
  p.outstanding = n;
  return n;
}

bool switcher::poll() {
  if (!progress_ || progress_->outstanding == 0) return true;
  if (!transport_.poll()) return false;
  wait_advance();
  return true;
}

void switcher::wait_advance() {
  progress& p = *progress_;
  if (p.outstanding == 0) return;
  std::string failure;
  bool state_unknown = false;
  try {
    transport_.wait();
  } catch (const error& e) {
    failure = e.what();
    state_unknown = e.code() == errc::timeout || e.code() == errc::cuda || e.code() == errc::nccl;
  } catch (const std::exception& e) {
    failure = std::string("moebius: ") + e.what();
  }
  transport_.inject_fault(std::nullopt);
  const int64_t per_layer = 1 + p.kv_rounds;
  if (failure.empty()) {
    p.layers_done += p.outstanding;
    p.outstanding = 0;
    cursor_ = p.cursor_after(p.layers_done);
    progress_report_.cursor = cursor_;
    progress_report_.weight_phases_completed = p.layers_done;
    progress_report_.kv_rounds_completed = p.layers_done * p.kv_rounds;
    return;
  }
  const int64_t completed = transport_.completed_phases();
  const int64_t full = completed / per_layer;
  const int64_t partial = completed % per_layer;
  p.layers_done += full;
  p.outstanding = 0;
  cursor_ = p.cursor_after(p.layers_done + (partial > 0 ? 1 : 0));
  progress_report_.error = failure;
  if (state_unknown) {
    progress_report_.cursor = cursor_;
    progress_report_.outcome = switch_outcome::inconsistent;
    progress_report_.error += "; not undone: after a barrier timeout or a device error a rank "
                              "may have written past the reached phase";
    consistent_ = false;
    inconsistency_ = progress_report_.error;
    end_progress();
    return;
  }
  undo_progress(p.layers_done, partial);
}

void switcher::undo_progress(int64_t layers_done, int64_t partial_phases) {
  progress& p = *progress_;
  const auto tu = clock_type::now();
  // The exact reverse of what ran: the partial layer first (its completed KV rounds, then its
  // weights), then every completed layer, last first.
  plan back;
  back.num_ranks = weights_.num_ranks;
  auto undo_layer = [&](int64_t i, int64_t kv_rounds_done) {
    const arena_cursor after = p.cursor_after(i + 1);
    const plan kv = shift_kv_plan(p.kv_layer0, kv_geometry_, p.layer(i),
                                  weights_.slot_offset(arena_geometry::free_slot(after)));
    if (kv_rounds_done > 0) append(back, rollback_plan(kv, kv_rounds_done));
    append(back, plan_weight_switch(weights_, after, p.cursor_after(i)));
  };
  if (partial_phases > 0) undo_layer(layers_done, partial_phases - 1);
  for (int64_t i = layers_done - 1; i >= 0; --i) undo_layer(i, p.kv_rounds);

  int64_t done = 0;
  bool state_unknown = false;
  std::string failure = run(back, switch_fault::stage::undo, done, state_unknown);
  progress_report_.undo_ms += ms_between(tu, clock_type::now());
  if (failure.empty()) {
    cursor_ = p.start;
    progress_report_.outcome = switch_outcome::rolled_back;
  } else {
    // Where the arena rests is known only to the layer: report the start of the undo.
    progress_report_.outcome = switch_outcome::inconsistent;
    progress_report_.error += (progress_report_.error.empty() ? "" : "; ") +
                              std::string("undo failed: ") + failure;
    consistent_ = false;
    inconsistency_ = progress_report_.error;
  }
  progress_report_.cursor = cursor_;
  end_progress();
}

switch_report switcher::end_progress() {
  progress_report_.total_ms = ms_between(progress_->t0, clock_type::now());
  progress_.reset();
  faults_.clear();
  return progress_report_;
}

switch_report switcher::finish() {
  MOEBIUS_CHECK(progress_, errc::invalid_argument, "finish: no progressive switch in progress");
  wait_advance();
  if (!progress_) return progress_report_;  // the advance failed and was rolled back
  if (layers_remaining() > 0) {
    advance(layers_remaining());
    wait_advance();
    if (!progress_) return progress_report_;
  }
  progress& p = *progress_;
  if (options_.verify) {
    uint64_t after = 0;
    std::string failure;
    try {
      after = options_.verify(p.goal, p.target_tables);
    } catch (const std::exception& e) {
      failure = std::string("verify hook failed: ") + e.what();
    }
    if (failure.empty() && after != p.checksum_before) {
      failure = "verify: checksum after the switch differs from before";
    }
    if (!failure.empty()) {
      progress_report_.error = failure;
      undo_progress(p.layers_done, 0);
      return progress_report_;
    }
    progress_report_.verified = true;
  }
  kv_ = std::move(p.target_tables);
  cursor_ = p.goal;
  progress_report_.cursor = cursor_;
  progress_report_.outcome = switch_outcome::committed;
  const parallel_mode target = p.target;
  end_progress();
  if (options_.on_commit) options_.on_commit(target);
  return progress_report_;
}

switch_report switcher::abort() {
  MOEBIUS_CHECK(progress_, errc::invalid_argument, "abort: no progressive switch in progress");
  wait_advance();
  if (!progress_) return progress_report_;  // the advance failed and was rolled back already
  progress_report_.error = "aborted";
  undo_progress(progress_->layers_done, 0);
  return progress_report_;
}

}  // namespace moebius
