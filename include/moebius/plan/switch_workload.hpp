#pragma once

// What one switch moves, in the terms a cost model needs: the busiest rank's bytes and the
// number of barriers. It sits with the plans (a plan's traffic determines it) so that the
// switcher can report it and the policy, one layer above, can consume it: the switcher never
// includes policy headers (DESIGN.md §2).
//
//   Qwen3-235B at P=8, all 94 layers EP->TP, no KV:
//     {num_ranks 8, weight_bytes_per_rank 49,677,336,576, kv 0, weight_phases 94, kv_rounds 0}

#include <cstdint>

namespace moebius {

struct switch_workload {
  int num_ranks = 1;
  int64_t weight_bytes_per_rank = 0;  // expert bytes leaving the busiest rank
  int64_t kv_bytes_per_rank = 0;      // KV bytes leaving the busiest rank
  int64_t weight_phases = 0;          // one per layer switched
  int64_t kv_rounds = 0;              // KV migration rounds (each ends in a barrier)

  friend bool operator==(const switch_workload&, const switch_workload&) = default;
};

}  // namespace moebius
