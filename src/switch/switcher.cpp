#include "moebius/switch/switcher.hpp"

#include <atomic>
#include <utility>

#include "moebius/detail/enum_check.hpp"
#include "moebius/detail/nvtx.hpp"
#include "moebius/error.hpp"
#include "moebius/switch/switch_observer.hpp"
#include "switch_state.hpp"
#include "transaction.hpp"

namespace moebius {
namespace {

using detail::clock_type;
using detail::switch_transaction;

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

// Opens `rep` for running `p` and says whether to run it: not when the report is already
// final, refused because the switcher is inconsistent, or already_there.
bool open_report(const detail::switch_state& st, const switch_plan& p, switch_report& rep) {
  rep = switch_report{};
  rep.from = st.layout();
  rep.to = p.to;
  rep.from_dcp = p.from_dcp;
  rep.to_dcp = p.to_dcp;
  rep.cursor = st.cursor;
  if (!st.consistent) {
    rep.outcome = switch_outcome::inconsistent;
    rep.error = "refused: the switcher is inconsistent since an earlier failure (" +
                st.inconsistency + "); reload the experts and the KV pool first";
    return false;
  }
  validate(st.kv_geom, st.kv);
  if (p.already_there()) {
    rep.outcome = switch_outcome::already_there;
    return false;
  }
  return true;
}

uint64_t next_switcher_id() {
  static std::atomic<uint64_t> next{1};
  return next.fetch_add(1, std::memory_order_relaxed);
}

}  // namespace

namespace detail {

switch_state::switch_state(const arena_geometry& w, const kv_geometry& kv_g, transport& t,
                           kv_state kv_tables, arena_cursor c, switcher_options o)
    : weights(w),
      kv_geom(kv_g),
      kv_layout(o.kv_layout ? *o.kv_layout : present_kv_layout(kv_g)),
      mover(t),
      options(std::move(o)),
      id(next_switcher_id()),
      kv(std::move(kv_tables)),
      cursor(c) {}

switch_state::~switch_state() = default;

kv_migration_options switch_state::kv_options(arena_cursor weights_at,
                                              const kv_placement* placement) const {
  kv_migration_options opt;
  opt.max_rounds = options.max_kv_rounds;
  opt.placement = placement;
  if (options.stage_kv_in_free_slot) {
    opt.staging.space = memory_space::arena;
    opt.staging.offset = weights.slot_offset(arena_geometry::free_slot(weights_at));
    opt.staging.bytes = weights.slot_bytes;
  }
  return opt;
}

}  // namespace detail

switcher::switcher(const arena_geometry& weights, const kv_geometry& kv, transport& t,
                   kv_state kv_tables, arena_cursor cursor, switcher_options options)
    : state_(std::make_unique<detail::switch_state>(weights, kv, t, std::move(kv_tables), cursor,
                                                    std::move(options))) {
  const detail::switch_state& st = *state_;
  validate(st.weights, st.cursor);
  validate(st.kv_geom);
  validate(st.kv_geom, st.kv);
  validate(st.kv_geom, st.kv_layout);
  MOEBIUS_CHECK(st.weights.num_ranks == t.num_ranks() && st.kv_geom.num_ranks == t.num_ranks(),
                errc::invalid_argument, "switcher: rank counts differ (weights P=",
                st.weights.num_ranks, ", kv P=", st.kv_geom.num_ranks,
                ", transport P=", t.num_ranks(), ")");
  MOEBIUS_CHECK(st.cursor == st.resting(parallel_mode::ep) ||
                    st.cursor == st.resting(parallel_mode::tp),
                errc::invalid_argument, "switcher: the arena must rest in one layout (cursor 0: "
                "EP experts, or ", st.resting(parallel_mode::tp).tp_layers,
                ": TP experts); cursor tp_layers=", st.cursor.tp_layers, " is mid-switch");
}

switcher::~switcher() = default;

parallel_layout switcher::layout() const { return state_->layout(); }
parallel_mode switcher::mode() const { return state_->kv.mode; }
arena_cursor switcher::cursor() const { return state_->cursor; }
const kv_pool_layout& switcher::kv_layout() const { return state_->kv_layout; }
int64_t switcher::dcp() const { return state_->kv_geom.dcp; }
const kv_state& switcher::kv_tables() const { return state_->kv; }
bool switcher::in_progress() const { return state_->open != nullptr; }
bool switcher::consistent() const { return state_->consistent; }
const switch_report& switcher::last_report() const { return state_->last_report; }

void switcher::inject_fault(std::optional<switch_fault> fault) {
  if (fault) state_->faults.push_back(*fault);
  else state_->faults.clear();
}

kv_state& switcher::mutable_kv_tables() {
  MOEBIUS_CHECK(state_->open == nullptr, errc::invalid_argument,
                "mutable_kv_tables: a progressive switch is open and its tables are frozen until "
                "finish() or abort(); read them through the session's view()");
  state_->move_on("mutable_kv_tables() handed the KV tables out");
  return state_->kv;
}

std::string switcher::why_stale(const switch_plan& p) const {
  const detail::switch_state& st = *state_;
  if (p.origin.switcher_id != st.id) {
    return "it was planned on another switcher (id " + std::to_string(p.origin.switcher_id) +
           ", this one " + std::to_string(st.id) + ")";
  }
  if (p.origin.generation != st.generation) {
    return "it was planned at state generation " + std::to_string(p.origin.generation) +
           ", the switcher is at " + std::to_string(st.generation) + " (last: " + st.change +
           ")";
  }
  if (!is_valid(p.to) || p.from != st.layout() || !(p.start == st.cursor) ||
      !(p.goal == st.resting(p.to.experts)) || p.from_dcp != st.kv_geom.dcp) {
    return std::string("it does not match the switcher: it moves ") + to_string(p.from) +
           " (dcp " + std::to_string(p.from_dcp) + ") at cursor " +
           std::to_string(p.start.tp_layers) + " to cursor " + std::to_string(p.goal.tp_layers) +
           ", the switcher is in " + to_string(st.layout()) + " (dcp " +
           std::to_string(st.kv_geom.dcp) + ") at cursor " + std::to_string(st.cursor.tp_layers);
  }
  return "";
}

kv_capacity_report switcher::check(parallel_layout target) const {
  detail::check_layout(target, "switcher::check target");
  return plan(target, plan_scope::stop_the_world).capacity;
}

layer_bytes switcher::layer_bytes_of(parallel_layout target) const {
  detail::check_layout(target, "switcher::layer_bytes_of target");
  switch_plan p = plan(target);
  MOEBIUS_CHECK(p.layer_kv != nullptr, errc::capacity, "KV migration ", to_string(p.from), "->",
                to_string(p.to), " impossible: ", p.layer_capacity.reason);
  return std::move(p.bytes_per_layer);
}

switch_report switcher::switch_to(parallel_layout target) {
  detail::check_layout(target, "switcher::switch_to target");
  MOEBIUS_CHECK(state_->open == nullptr, errc::invalid_argument,
                "switch_to: a progressive switch is in progress; finish() or abort() it first");
  return switch_to(plan(target, plan_scope::stop_the_world));
}

switch_report switcher::switch_dcp(int64_t dcp) {
  MOEBIUS_CHECK(state_->open == nullptr, errc::invalid_argument,
                "switch_dcp: a progressive switch is in progress; finish() or abort() it first");
  return switch_to(plan_dcp(dcp));
}

switch_report switcher::switch_to(const switch_plan& p) {
  detail::switch_state& st = *state_;
  const disarm_on_exit disarm{st.faults};
  MOEBIUS_CHECK(st.open == nullptr, errc::invalid_argument,
                "switch_to: a progressive switch is in progress; finish() or abort() it first");
  // verify_layer pairs layer l's experts with layer l's K/V: a KV layer without an MoE layer
  // would go unchecked while the report says verified.
  MOEBIUS_CHECK(!st.options.verify_layer || st.kv_geom.num_layers == st.weights.shape.num_layers,
                errc::invalid_argument,
                "switch_to: switcher_options::verify_layer checks each layer's experts and K/V "
                "together, so the KV cache needs one layer per MoE layer (KV layers ",
                st.kv_geom.num_layers, ", MoE layers ", st.weights.shape.num_layers, ")");
  const std::string stale = why_stale(p);
  MOEBIUS_CHECK(stale.empty(), errc::invalid_argument, "switch_to: the plan is stale: ", stale,
                "; plan again (switcher::plan)");
  const auto t0 = clock_type::now();
  const detail::nvtx_range switch_range("moebius/switch");
  switch_report rep;
  if (!open_report(st, p, rep)) {
    rep.total_ms = detail::ms_between(t0, clock_type::now());
    return ended(st.last_report, rep);
  }
  // One transaction, the whole switch as one unit: begin + advance(all) + finish.
  std::unique_ptr<switch_transaction> txn =
      switch_transaction::open(st, p, switch_transaction::style::whole, rep, t0);
  if (!txn) return ended(st.last_report, rep);
  txn->finish();
  const switch_report& r = ended(st.last_report, txn->report());
  if (r.outcome == switch_outcome::inconsistent) st.wreck = std::move(txn);
  return r;
}

recovery_report switcher::recover(const recovery_request& request) {
  detail::switch_state& st = *state_;
  detail::check_layout(request.layout, "switcher::recover layout");
  MOEBIUS_CHECK(st.open == nullptr, errc::invalid_argument,
                "recover: a progressive switch is open; it ends before the switcher can be "
                "inconsistent");
  MOEBIUS_CHECK(!st.consistent && st.wreck != nullptr, errc::invalid_argument,
                "recover: the switcher is consistent (layout ", to_string(layout()),
                "); there is nothing to recover");
  MOEBIUS_CHECK(static_cast<bool>(request.reload_experts), errc::invalid_argument,
                "recover: needs reload_experts: after an inconsistent switch no byte of the arena "
                "is trusted, so the experts come from the caller's source of truth");
  recovery_report r = st.wreck->recover(request);
  st.move_on(std::string("recover() ran in ") + to_string(request.layout));
  if (r.recovered) st.wreck.reset();
  return r;
}

progressive_switch switcher::begin(parallel_layout target) {
  detail::check_layout(target, "switcher::begin target");
  MOEBIUS_CHECK(state_->open == nullptr, errc::invalid_argument,
                "begin: a progressive switch is already in progress");
  return begin(plan(target));
}

progressive_switch switcher::begin(const switch_plan& p) {
  detail::switch_state& st = *state_;
  MOEBIUS_CHECK(st.open == nullptr, errc::invalid_argument,
                "begin: a progressive switch is already in progress");
  MOEBIUS_CHECK(st.kv_geom.num_layers == st.weights.shape.num_layers, errc::invalid_argument,
                "begin: a progressive switch moves each layer's weights and KV together, so the "
                "KV cache needs one layer per MoE layer (KV layers ", st.kv_geom.num_layers,
                ", MoE layers ", st.weights.shape.num_layers, ")");
  // Each layer's KV plan is layer 0's shifted by one layer stride (transaction.cpp), which
  // needs the same stride in both views.
  MOEBIUS_CHECK(st.kv_layout.ep.layer == st.kv_layout.tp.layer, errc::invalid_argument,
                "begin: the KV layout's layers interleave inside a page (layer stride EP ",
                st.kv_layout.ep.layer, ", TP ", st.kv_layout.tp.layer,
                "), so one layer's KV cannot move on its own; switch with switch_to()");
  const std::string stale = why_stale(p);
  MOEBIUS_CHECK(stale.empty(), errc::invalid_argument, "begin: the plan is stale: ", stale,
                "; plan again (switcher::plan)");
  MOEBIUS_CHECK(p.moves_experts() || p.already_there() || !st.consistent, errc::invalid_argument,
                "begin: ", switch_direction(p.from, p.to, p.from_dcp, p.to_dcp),
                p.changes_dcp() ? " changes the KV-parallel degree alone"
                                : " switches the attention alone",
                "; a progressive switch advances layer by layer with the experts, so this one "
                "runs stop-the-world (switch_to)");
  const auto t0 = clock_type::now();
  switch_report rep;
  std::unique_ptr<switch_transaction> txn;
  if (open_report(st, p, rep)) {
    txn = switch_transaction::open(st, p, switch_transaction::style::per_layer, rep, t0);
  }
  if (!txn) {
    st.faults.clear();
    st.last_report = rep;
    notify_switch_observer(st.last_report, switch_style::progressive);
  }
  st.open = txn.get();
  return progressive_switch(st, std::move(txn), std::move(rep));
}

}  // namespace moebius
