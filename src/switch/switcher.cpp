#include "moebius/switch/switcher.hpp"

#include <utility>

#include "moebius/detail/enum_check.hpp"
#include "moebius/detail/nvtx.hpp"
#include "moebius/error.hpp"
#include "moebius/switch/switch_observer.hpp"
#include "transaction.hpp"

namespace moebius {
namespace {

using detail::clock_type;
using detail::switch_transaction;

arena_cursor resting_cursor(const arena_geometry& g, parallel_mode m) {
  return arena_cursor{m == parallel_mode::tp ? g.shape.num_layers : 0};
}

// Armed faults are for one switch only, reached or not.
struct disarm_on_exit {
  std::vector<switch_fault>& faults;
  ~disarm_on_exit() { faults.clear(); }
};

// A stop-the-world switch's report is final: keep it and tell the observer.
const switch_report& ended(switch_report& last, const switch_report& rep) {
  last = rep;
  notify_switch_observer(last, switch_style::whole);
  return last;
}

}  // namespace

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

switcher::~switcher() = default;

kv_state& switcher::mutable_kv_tables() {
  MOEBIUS_CHECK(open_ == nullptr, errc::invalid_argument,
                "mutable_kv_tables: a progressive switch is open and its tables are frozen until "
                "finish() or abort(); read them through the session's view()");
  return kv_;
}

kv_migration_options switcher::kv_options(arena_cursor weights_at, parallel_mode target,
                                          kv_placement& placement) const {
  kv_migration_options opt;
  opt.max_rounds = options_.max_kv_rounds;
  if (options_.ep_placement && target == parallel_mode::ep && kv_.mode == parallel_mode::tp) {
    placement = options_.ep_placement(kv_);
    opt.placement = &placement;
  }
  if (options_.stage_kv_in_free_slot) {
    opt.staging.space = memory_space::arena;
    opt.staging.offset = weights_.slot_offset(arena_geometry::free_slot(weights_at));
    opt.staging.bytes = weights_.slot_bytes;
  }
  return opt;
}

kv_migration_options switcher::one_layer_kv_options(parallel_mode target,
                                                     kv_placement& placement) const {
  // Planned for layer 0 with staging at offset 0; each layer's plan is shifted to its own free
  // slot (src/switch/transaction.hpp).
  kv_migration_options opt = kv_options(arena_cursor{0}, target, placement);
  opt.staging.offset = 0;
  return opt;
}

kv_capacity_report switcher::check(parallel_mode target) const {
  detail::check_enum(target, "switcher::check target (parallel_mode)");
  kv_placement placement;
  return check_kv_capacity(kv_geometry_, kv_, target,
                           kv_options(resting_cursor(weights_, target), target, placement));
}

layer_bytes switcher::layer_bytes_of(parallel_mode target) const {
  detail::check_enum(target, "switcher::layer_bytes_of target (parallel_mode)");
  kv_placement placement;
  return switch_layer_bytes(weights_, kv_geometry_, kv_, target,
                            one_layer_kv_options(target, placement));
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
  const disarm_on_exit disarm{faults_};
  detail::check_enum(target, "switcher::switch_to target (parallel_mode)");
  MOEBIUS_CHECK(open_ == nullptr, errc::invalid_argument,
                "switch_to: a progressive switch is in progress; finish() or abort() it first");
  // verify_layer pairs layer l's experts with layer l's K/V: a KV layer without an MoE layer
  // would go unchecked while the report says verified.
  MOEBIUS_CHECK(!options_.verify_layer || kv_geometry_.num_layers == weights_.shape.num_layers,
                errc::invalid_argument,
                "switch_to: switcher_options::verify_layer checks each layer's experts and K/V "
                "together, so the KV cache needs one layer per MoE layer (KV layers ",
                kv_geometry_.num_layers, ", MoE layers ", weights_.shape.num_layers, ")");
  const auto t0 = clock_type::now();
  const detail::nvtx_range switch_range("moebius/switch");
  switch_report rep;
  const std::optional<arena_cursor> goal = open_report(rep, target);
  if (!goal) {
    rep.total_ms = std::chrono::duration<double, std::milli>(clock_type::now() - t0).count();
    return ended(last_report_, rep);
  }
  // One transaction, the whole switch as one unit: begin + advance(all) + finish.
  std::unique_ptr<switch_transaction> txn =
      switch_transaction::open(*this, target, *goal, switch_transaction::style::whole, rep, t0);
  if (!txn) return ended(last_report_, rep);
  txn->finish();
  const switch_report& r = ended(last_report_, txn->report());
  if (r.outcome == switch_outcome::inconsistent) wreck_ = std::move(txn);
  return r;
}

recovery_report switcher::recover(const recovery_request& request) {
  detail::check_enum(request.mode, "switcher::recover mode (parallel_mode)");
  MOEBIUS_CHECK(open_ == nullptr, errc::invalid_argument,
                "recover: a progressive switch is open; it ends before the switcher can be "
                "inconsistent");
  MOEBIUS_CHECK(!consistent_ && wreck_ != nullptr, errc::invalid_argument,
                "recover: the switcher is consistent (mode ", to_string(mode()),
                "); there is nothing to recover");
  MOEBIUS_CHECK(static_cast<bool>(request.reload_experts), errc::invalid_argument,
                "recover: needs reload_experts: after an inconsistent switch no byte of the arena "
                "is trusted, so the experts come from the caller's source of truth");
  recovery_report r = wreck_->recover(request);
  if (r.recovered) wreck_.reset();
  return r;
}

progressive_switch switcher::begin(parallel_mode target) {
  detail::check_enum(target, "switcher::begin target (parallel_mode)");
  MOEBIUS_CHECK(open_ == nullptr, errc::invalid_argument,
                "begin: a progressive switch is already in progress");
  MOEBIUS_CHECK(kv_geometry_.num_layers == weights_.shape.num_layers, errc::invalid_argument,
                "begin: a progressive switch moves each layer's weights and KV together, so the "
                "KV cache needs one layer per MoE layer (KV layers ", kv_geometry_.num_layers,
                ", MoE layers ", weights_.shape.num_layers, ")");
  const auto t0 = clock_type::now();
  switch_report rep;
  const std::optional<arena_cursor> goal = open_report(rep, target);
  std::unique_ptr<switch_transaction> txn;
  if (goal) {
    txn = switch_transaction::open(*this, target, *goal, switch_transaction::style::per_layer,
                                   rep, t0);
  }
  if (!txn) {
    faults_.clear();
    last_report_ = rep;
    notify_switch_observer(last_report_, switch_style::progressive);
  }
  open_ = txn.get();
  return progressive_switch(*this, std::move(txn), std::move(rep));
}

}  // namespace moebius
