#pragma once

// A switch planned once (switcher::plan): the capacity verdict with its numbers, what each layer
// sends (the pacing input), the EP placement used, and the weight and KV plans the transaction
// runs, stamped with the switcher state it was planned on. An engine plans once per decision and
// hands the same plan to its capacity check, its cost estimate, its pacing and to
// switcher::switch_to(plan) / begin(plan), which run exactly it (no planning of their own):
//
//   const switch_plan p = sw.plan(parallel_mode::tp);     // moves nothing (TP attention and
//                                                         // experts; or any parallel_layout)
//   if (!p.capacity.fits) ...                             // the capacity check (sw.check)
//   pacing.bytes_per_layer = p.bytes_per_layer.busiest(); // the pacing (sw.layer_bytes_of)
//   progressive_switch s = sw.begin(p);                   // or sw.switch_to(p)
//
// A plan is valid for the state it was made on only: every mutable_kv_tables() call, every
// switch that ran (committed, rolled back or inconsistent) and every recover() moves the
// switcher's state generation on, and switch_to/begin then refuse the plan (errc::invalid_argument,
// "stale", with what moved the state on; switcher::why_stale says it without throwing).
//
// Two KV plans, because the two switch styles cut the KV differently (switcher.hpp):
// switch_to moves all layers' KV in one migration staged in the target's free slot (`kv`,
// verdict `capacity`); a progressive switch moves one layer at a time, layer 0's migration
// shifted to each layer (`layer_kv`, verdict `layer_capacity`). Both place sequences alike
// (`ep_placement`) and evolve the same page states; only the staging room differs (a slot holds
// more one-layer pieces), so `layer_capacity` may fit where `capacity` does not.

#include <cstdint>
#include <iosfwd>
#include <memory>

#include "moebius/kv/kv_migration.hpp"
#include "moebius/kv/placement.hpp"
#include "moebius/layout/arena_geometry.hpp"
#include "moebius/layout/parallel_layout.hpp"
#include "moebius/plan/plan.hpp"
#include "moebius/switch/pacing.hpp"

namespace moebius {

// What a plan holds (switcher::plan): both halves, or the stop-the-world half alone for a caller
// that only runs or checks stop-the-world switches (planning the per-layer KV migration too costs
// a stop-the-world switch ~1.5 ms of host time at 90% occupancy on one H200).
enum class plan_scope : uint8_t {
  both,            // the all-layers KV plan and the one-layer plan a progressive switch runs
  stop_the_world,  // the all-layers plan only: layer_kv null, layer_capacity "not planned"
};

constexpr bool is_valid(plan_scope s) {
  return s == plan_scope::both || s == plan_scope::stop_the_world;
}

constexpr const char* to_string(plan_scope s) {
  switch (s) {
    case plan_scope::both: return "both";
    case plan_scope::stop_the_world: return "stop_the_world";
  }
  return "unknown";
}

// The switcher state a plan was made on.
struct switch_plan_origin {
  uint64_t switcher_id = 0;  // which switcher (each has its own)
  uint64_t generation = 0;   // its state generation then (see above)
};

// Made by switcher::plan; read it, copy it, print it; edit nothing (switch_to and begin trust
// it once its origin matches). Copies share the plans (immutable).
struct switch_plan {
  switch_plan_origin origin;
  parallel_layout from;      // the layout the switcher was in
  parallel_layout to;        // the target
  // The TP view's KV-parallel degree (kv_geometry::dcp) before and after: equal unless the plan
  // changes it (switcher::plan_dcp: the layout stays, the KV alone moves).
  int64_t from_dcp = 1, to_dcp = 1;
  arena_cursor start, goal;  // where the arena rests now, and in `to` (0: EP experts, L: TP)
  // Stop the world (switch_to): the capacity verdict of all layers' KV in one migration. This is
  // switcher::check(to).
  kv_capacity_report capacity;
  // Progressive (begin): the verdict of one layer's migration. Not planned (reason says why)
  // for a switch of the attention alone, a dcp change included: a progressive switch advances
  // layer by layer with the experts.
  kv_capacity_report layer_capacity;
  // What each layer sends per rank (switcher::layer_bytes_of(to)); empty when layer_capacity
  // refused.
  layer_bytes bytes_per_layer;
  // TP -> EP with switcher_options::ep_placement: the owners the hook gave, used by both KV
  // plans; empty otherwise (longest-first inside the planner).
  kv_placement ep_placement;
  // Every layer's weights from `start` to `goal`, one phase per layer in the order the layers
  // move (EP->TP ascending, TP->EP descending): a progressive switch's i-th layer runs phase i.
  std::shared_ptr<const plan> weights;
  std::shared_ptr<const kv_migration> kv;        // null when capacity refused
  std::shared_ptr<const kv_migration> layer_kv;  // layer 0, staging at arena offset 0; null when
                                                 // layer_capacity refused
  double plan_ms = 0;  // host time it took

  bool already_there() const { return from == to && start == goal && from_dcp == to_dcp; }
  // Whether the KV's view changes (the attention's layout, or the TP attention's dcp; the
  // migration is the identity otherwise, 0 rounds: a dcp change under EP attention moves nothing)
  // and whether the experts move (the cursor).
  bool moves_kv() const {
    return from.attention != to.attention ||
           (to.attention == parallel_mode::tp && from_dcp != to_dcp);
  }
  bool changes_dcp() const { return from_dcp != to_dcp; }
  bool moves_experts() const { return !(start == goal); }
};

// One line: direction, origin, both verdicts, rounds and the busiest rank's bytes per layer.
std::ostream& operator<<(std::ostream& os, const switch_plan& p);

}  // namespace moebius
