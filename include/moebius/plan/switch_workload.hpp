#pragma once

// What one switch moves, in the terms a cost model needs: the busiest rank's bytes and the
// number of barriers. It sits with the plans (a plan's traffic determines it) so that the
// switcher can report it and the policy, one layer above, can consume it: the switcher never
// includes policy headers (DESIGN.md §2).
//
//   Qwen3-235B at P=8, all 94 layers EP->TP, no KV:
//     {num_ranks 8, weight_bytes_per_rank 49,677,336,576, kv 0, weight_phases 94, kv_rounds 0}
//
// A deployment over several nodes splits what leaves a rank by the link it takes: the weight
// and KV bytes stay within the rank's node (NVLink), internode_bytes_per_rank go to ranks of
// other nodes (the rank's NIC). A plan knows no nodes: workload_of() leaves them 0.

#include <cstdint>

#include "moebius/plan/plan.hpp"

namespace moebius {

struct switch_workload {
  int num_ranks = 1;
  int64_t weight_bytes_per_rank = 0;  // expert bytes leaving the busiest rank
  int64_t kv_bytes_per_rank = 0;      // KV bytes leaving the busiest rank
  int64_t weight_phases = 0;          // one per layer switched
  int64_t kv_rounds = 0;              // KV migration rounds (each ends in a barrier)
  // Bytes (weights and KV) leaving the busiest rank for ranks of other nodes; not counted in
  // weight_bytes_per_rank or kv_bytes_per_rank, which are then the bytes within its node.
  int64_t internode_bytes_per_rank = 0;

  friend bool operator==(const switch_workload&, const switch_workload&) = default;
};

// The workload of a built plan: max over ranks of bytes sent to other ranks, split by
// destination memory space (arena -> weights, kv_pool -> KV); phases whose ops write the
// KV pool count as KV rounds, the others as weight phases. Throws errc::invalid_argument for
// a plan without ranks, an op whose source rank is out of range or whose dst_space names no
// space; errc::overflow when a rank's byte count does not fit 64 bits.
//   workload_of(plan_weight_switch(qwen3 at P=8, {0}, {94})) -> the example above
switch_workload workload_of(const plan& p);

}  // namespace moebius
