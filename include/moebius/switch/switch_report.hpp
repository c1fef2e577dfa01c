#pragma once

// What a switch did: its outcome, how far it got, what it moved and how long each stage took.
// Both switch styles report alike: switcher::switch_to() (stop the world) and a
// progressive_switch (moebius/switch/progressive.hpp).

#include <cstdint>
#include <iosfwd>
#include <string>
#include <vector>

#include "moebius/kv/kv_migration.hpp"
#include "moebius/layout/arena_geometry.hpp"
#include "moebius/layout/parallel_layout.hpp"
#include "moebius/plan/switch_workload.hpp"

namespace moebius {

enum class switch_outcome : uint8_t {
  committed,          // weights, KV and tables are in the target mode; the selector flipped
  already_there,      // the switcher was already in the target mode: nothing moved
  refused_capacity,   // the target mode cannot hold the live KV: nothing moved
  rolled_back,        // a failure; everything is back as before the call
  inconsistent,       // a failure and a failed undo: see switch_report::error and cursor
  in_progress,        // a progressive switch has begun and not yet ended
};

constexpr bool is_valid(switch_outcome o) {
  return static_cast<uint8_t>(o) <= static_cast<uint8_t>(switch_outcome::in_progress);
}

const char* to_string(switch_outcome o);

struct switch_report {
  parallel_layout from;  // the layout the switcher was in
  parallel_layout to;    // the target
  int64_t from_dcp = 1, to_dcp = 1;  // the TP view's dcp before and after (switch_plan)
  switch_outcome outcome = switch_outcome::already_there;
  std::string error;          // the failure (and the undo's failure), "" when none
  arena_cursor cursor;        // where the arena rests after the call

  int64_t weight_phases = 0;            // phases of the weight plan (one per layer)
  int64_t weight_phases_completed = 0;  // of them, completed before a failure (or all)
  int64_t kv_rounds = 0;                // rounds of the KV migration (all layers)
  int64_t kv_rounds_completed = 0;
  std::vector<int64_t> weight_bytes_sent;  // per rank, bytes leaving it for other ranks
  std::vector<int64_t> kv_bytes_sent;      // per rank
  // What the switch moves, in the cost model's terms (policy/cost_model.hpp, a layer above:
  // feed it from there with the measured time so that predictions follow the hardware).
  switch_workload workload;
  kv_migration_stats kv_stats;
  kv_capacity_report capacity;

  // Host wall time of each stage, in milliseconds (a stage that did not run is 0).
  // plan_ms: switcher::plan's time for the plan this switch ran (switch_plan::plan_ms, spent
  // before the call when a plan was passed in; total_ms counts it too); capacity_ms: that
  // time instead when the plan refused the switch (capacity). A progressive switch's advances
  // carry weights and KV together and are timed by the engine, not here: its weights_ms and
  // kv_ms are 0.
  double capacity_ms = 0, plan_ms = 0, weights_ms = 0, kv_ms = 0, verify_ms = 0, undo_ms = 0,
         total_ms = 0;
  bool verified = false;  // the verify hook ran and its checksums matched
};

std::ostream& operator<<(std::ostream& os, const switch_report& r);

// How plans and reports name a switch: "EP->TP", or with a dcp change "TP->TP (dcp 1->2)".
std::string switch_direction(parallel_layout from, parallel_layout to, int64_t from_dcp,
                             int64_t to_dcp);

}  // namespace moebius
