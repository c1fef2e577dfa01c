#pragma once

// Internal to the KV migration planners: the two directions behind plan_kv_migration() (and
// the outcome plan_kv_dcp_change() shares with them).

#include <cstdint>
#include <string>

#include "moebius/kv/kv_migration.hpp"

namespace moebius::kv_detail {

// A plan, or why there is none.
struct outcome {
  kv_migration result;
  bool ok = true;
  bool holds = true;          // the target view can hold everything (ignoring scheduling)
  int64_t pages_needed = 0;
  int64_t pages_available = 0;
  std::string reason;
};

// The capacity report of an outcome (what check_kv_capacity returns), and the attempt (that
// report, and the migration when it fits).
kv_capacity_report capacity_of(const outcome& o);
kv_migration_attempt attempt_of(outcome o);

// Staging slots per rank for migrating to `target`. Throws errc::invalid_argument for a bad
// region.
int64_t staging_slots(const kv_geometry& g, const kv_migration_options& opt, parallel_mode target);

// Both expect a validated EP (resp. TP) state and a layout validated for g; every address comes
// from the layout.
outcome plan_ep_to_tp(const kv_geometry& g, const kv_pool_layout& layout, const kv_state& s,
                      const kv_migration_options& opt);
outcome plan_tp_to_ep(const kv_geometry& g, const kv_pool_layout& layout, const kv_state& s,
                      const kv_migration_options& opt);

}  // namespace moebius::kv_detail
