// switcher::plan: a switch planned once (moebius/switch/switch_plan.hpp), and its printing.

#include "moebius/switch/switch_plan.hpp"

#include <ostream>
#include <string>

#include "moebius/detail/enum_check.hpp"
#include "moebius/detail/nvtx.hpp"
#include "moebius/kv/dcp_change.hpp"
#include "moebius/plan/weight_plan.hpp"
#include "moebius/switch/switcher.hpp"
#include "layer_traffic.hpp"
#include "switch_state.hpp"
#include "transaction.hpp"

namespace moebius {
namespace {

// One run of a KV planner: its verdict, and the migration when it fits.
std::shared_ptr<const kv_migration> kept(kv_migration_attempt a, kv_capacity_report& verdict) {
  verdict = std::move(a.capacity);
  if (!a.migration) return nullptr;
  return std::make_shared<const kv_migration>(std::move(*a.migration));
}

std::shared_ptr<const kv_migration> plan_kv(const kv_geometry& g, const kv_pool_layout& layout,
                                            const kv_state& tables, parallel_mode target,
                                            const kv_migration_options& opt,
                                            kv_capacity_report& verdict) {
  return kept(try_plan_kv_migration(g, layout, tables, target, opt), verdict);
}

// What every plan starts from: the switcher state it is made on, the layout and dcp now.
switch_plan plan_from(const detail::switch_state& st) {
  switch_plan p;
  p.origin = {st.id, st.generation};
  p.from = st.layout();
  p.from_dcp = p.to_dcp = st.kv_geom.dcp;
  p.start = st.cursor;
  return p;
}

}  // namespace

switch_plan switcher::plan(parallel_layout target, plan_scope scope) const {
  detail::check_layout(target, "switcher::plan target");
  detail::check_enum(scope, "switcher::plan scope (plan_scope)");
  const bool per_layer = scope == plan_scope::both;
  const detail::switch_state& st = *state_;
  const auto t0 = detail::clock_type::now();
  const detail::nvtx_range range("moebius/switch/plan");
  switch_plan p = plan_from(st);
  p.to = target;
  p.goal = st.resting(target.experts);
  // The KV follows the attention: a target whose attention is today's plans the identity
  // migration (0 rounds).
  const parallel_mode kv_target = target.attention;
  // TP -> EP: the hook's owners, asked once for both KV plans.
  const kv_placement* placement = nullptr;
  if (st.options.ep_placement && kv_target == parallel_mode::ep && st.kv.mode == parallel_mode::tp) {
    p.ep_placement = st.options.ep_placement(st.kv);
    placement = &p.ep_placement;
  }
  // Stop the world: every layer's KV in one migration, staged in the target's free slot.
  p.kv = plan_kv(st.kv_geom, st.kv_layout, st.kv, kv_target, st.kv_options(p.goal, placement),
                 p.capacity);
  // Progressive: layer 0's KV, staging at offset 0; each layer's plan is this one shifted to
  // its own free slot (src/switch/transaction.hpp).
  kv_geometry one_layer = st.kv_geom;
  one_layer.num_layers = 1;
  kv_migration_options layer_opt = st.kv_options(arena_cursor{0}, placement);
  layer_opt.staging.offset = 0;
  // Layer 0 of the same layout: every layer is layer 0 moved by the layout's layer stride,
  // which needs one stride in both views (layers that interleave inside a page have two).
  if (!per_layer) {
    p.layer_capacity.reason = "not planned (a stop-the-world switch needs no per-layer plan)";
  } else if (!p.moves_experts()) {
    p.layer_capacity.reason = "not planned: the experts stay, and a progressive switch advances "
                              "layer by layer with the experts (switch the attention alone with "
                              "switch_to)";
  } else if (st.kv_layout.ep.layer == st.kv_layout.tp.layer) {
    p.layer_kv =
        plan_kv(one_layer, st.kv_layout, st.kv, kv_target, layer_opt, p.layer_capacity);
  } else {
    p.layer_capacity.reason = "the KV layout's layers interleave inside a page (layer stride EP " +
                              std::to_string(st.kv_layout.ep.layer) + ", TP " +
                              std::to_string(st.kv_layout.tp.layer) +
                              "): no layer's KV moves on its own";
  }
  p.weights =
      std::make_shared<const moebius::plan>(plan_weight_switch(st.weights, p.start, p.goal));
  if (p.layer_kv) {
    p.bytes_per_layer = detail::layer_traffic(st.weights, target.experts,
                                              p.moves_kv() ? &p.layer_kv->copies : nullptr);
  }
  p.plan_ms = detail::ms_between(t0, detail::clock_type::now());
  return p;
}

switch_plan switcher::plan_dcp(int64_t dcp) const {
  const detail::switch_state& st = *state_;
  const auto t0 = detail::clock_type::now();
  const detail::nvtx_range range("moebius/switch/plan");
  switch_plan p = plan_from(st);
  p.to = p.from;
  p.to_dcp = dcp;
  p.goal = p.start;
  // Every layer's KV in one migration (the planner refuses a dcp the geometry does not allow).
  p.kv = kept(try_plan_kv_dcp_change(st.kv_geom, st.kv_layout, st.kv, dcp,
                                     st.kv_options(p.goal, nullptr)),
              p.capacity);
  p.layer_capacity.reason = "not planned: a dcp change moves the KV alone, and a progressive "
                            "switch advances layer by layer with the experts (switch_to)";
  p.weights =
      std::make_shared<const moebius::plan>(plan_weight_switch(st.weights, p.start, p.goal));
  p.plan_ms = detail::ms_between(t0, detail::clock_type::now());
  return p;
}

std::ostream& operator<<(std::ostream& os, const switch_plan& p) {
  os << "switch_plan{" << switch_direction(p.from, p.to, p.from_dcp, p.to_dcp) << " cursor "
     << p.start.tp_layers << "->" << p.goal.tp_layers << ", switcher " << p.origin.switcher_id
     << " generation " << p.origin.generation << "; stop the world: "
     << (p.capacity.fits ? "fits" : "refused");
  if (p.capacity.fits) os << " in " << p.capacity.rounds << " KV rounds";
  os << "; per layer: " << (p.layer_capacity.fits ? "fits" : "refused");
  if (p.layer_capacity.fits) {
    os << " in " << p.layer_capacity.rounds << " KV rounds, busiest rank "
       << p.bytes_per_layer.busiest() << " B a layer";
  }
  return os << "; " << p.plan_ms << " ms}";
}

}  // namespace moebius
