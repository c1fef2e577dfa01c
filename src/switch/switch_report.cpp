#include "moebius/switch/switch_report.hpp"

#include <algorithm>
#include <ostream>
#include <string>

namespace moebius {

const char* to_string(switch_outcome o) {
  switch (o) {
    case switch_outcome::committed: return "committed";
    case switch_outcome::already_there: return "already_there";
    case switch_outcome::refused_capacity: return "refused_capacity";
    case switch_outcome::rolled_back: return "rolled_back";
    case switch_outcome::inconsistent: return "inconsistent";
    case switch_outcome::in_progress: return "in_progress";
  }
  return "unknown";
}

std::string switch_direction(parallel_layout from, parallel_layout to, int64_t from_dcp,
                             int64_t to_dcp) {
  std::string s = std::string(to_string(from)) + "->" + to_string(to);
  if (from_dcp != to_dcp)
    s += " (dcp " + std::to_string(from_dcp) + "->" + std::to_string(to_dcp) + ")";
  return s;
}

std::ostream& operator<<(std::ostream& os, const switch_report& r) {
  os << "switch " << switch_direction(r.from, r.to, r.from_dcp, r.to_dcp) << ": "
     << to_string(r.outcome) << ", cursor " << r.cursor.tp_layers << "; weights "
     << r.weight_phases_completed << '/' << r.weight_phases << " phases, "
     << r.workload.weight_bytes_per_rank << " B max sent per rank, " << r.weights_ms
     << " ms; KV " << r.kv_rounds_completed << '/' << r.kv_rounds << " rounds, "
     << r.workload.kv_bytes_per_rank << " B max sent per rank, " << r.kv_ms
     << " ms; capacity " << r.capacity_ms << " ms, plans " << r.plan_ms << " ms, undo "
     << r.undo_ms << " ms, total " << r.total_ms << " ms";
  if (r.verified) os << "; verified";
  if (!r.error.empty()) os << "; error: " << r.error;
  return os;
}

}  // namespace moebius
