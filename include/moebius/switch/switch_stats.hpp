#pragma once

// A per-switch stats record an engine can export as metrics (Prometheus, OpenTelemetry, its own
// logs): for each stage of a switch the bytes it moves and the host time it took, derived from
// the switch_report. The same stages carry NVTX ranges ("moebius/switch/<stage>") so that a
// profile and the metrics line up.
//
//   switch_report r = sw.switch_to(parallel_mode::tp);
//   for_each_metric(r, [&](std::string_view name, double v) { registry.gauge(name).set(v); });
//   // moebius_switch_weights_bytes 4.2e9, moebius_switch_weights_ms 11.3, ...

#include <cstdint>
#include <functional>
#include <string_view>
#include <vector>

#include "moebius/switch/switcher.hpp"

namespace moebius {

enum class switch_stage : uint8_t { capacity, plan, weights, kv, verify, undo };
inline constexpr int num_switch_stages = 6;

constexpr const char* to_string(switch_stage s) {
  switch (s) {
    case switch_stage::capacity: return "capacity";
    case switch_stage::plan: return "plan";
    case switch_stage::weights: return "weights";
    case switch_stage::kv: return "kv";
    case switch_stage::verify: return "verify";
    case switch_stage::undo: return "undo";
  }
  return "unknown";
}

struct switch_stage_stats {
  // Bytes the stage's plan sends between ranks, summed over ranks (weights and kv; 0 for the
  // stages that move nothing). For a failed switch: what the plan would have moved.
  int64_t bytes = 0;
  double ms = 0;  // host wall time of the stage (0 when it did not run)
};

struct switch_stats {
  switch_stage_stats stages[num_switch_stages] = {};
  double total_ms = 0;

  const switch_stage_stats& operator[](switch_stage s) const {
    return stages[static_cast<int>(s)];
  }
};

switch_stats stats_of(const switch_report& r);

// Calls fn(name, value) once per metric, in this order:
//   moebius_switch_<stage>_bytes, moebius_switch_<stage>_ms  for stage in capacity, plan,
//                                                            weights, kv, verify, undo
//   moebius_switch_total_ms, moebius_switch_weight_phases, moebius_switch_kv_rounds,
//   moebius_switch_committed (1 or 0), moebius_switch_rolled_back (1 or 0),
//   moebius_switch_inconsistent (1 or 0),
//   moebius_switch_weight_phases_completed, moebius_switch_kv_rounds_completed,
//   moebius_switch_kv_pages_moved, moebius_switch_refused_capacity (1 or 0),
//   moebius_switch_already_there (1 or 0), moebius_switch_verified (1 or 0)
// Names are string literals (they outlive the call).
void for_each_metric(const switch_report& r,
                     const std::function<void(std::string_view name, double value)>& fn);

// The same metrics as a flat list in that order (names are literals), for an exporter that
// wants them at once (the Python module's dict).
struct switch_metric {
  std::string_view name;
  double value = 0;
};
std::vector<switch_metric> metrics_of(const switch_report& r);

}  // namespace moebius
