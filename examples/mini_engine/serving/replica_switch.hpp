#pragma once

// The switch between EP over every rank of several nodes and TP within each node, one TP
// replica a node serving its own sequences (a what-if: the paper's deployment past one node;
// nothing here was measured on two nodes). Which ranks exchange what, per layer, and the
// switch's workload for moebius::cost_model, the bytes that cross nodes apart.
//
// Ranks: node n, local index j, global rank n x R + j (R ranks a node, N nodes, P = N R).
//   EP over all ranks   global rank g holds experts g E/P .. (g+1) E/P - 1, whole.
//   TP replicas         every rank (n, j) holds slice j (of R) of every expert's intermediate
//                       dimension: each node holds every expert once.
//   EP -> TP            each expert's owner sends slice j to rank (n, j) of every node n (its
//                       own slice stays): per rank and layer, its E/P experts x (R-1)/R within
//                       its node and E/P experts whole to each other node. No placement does
//                       with less across: each node must receive every expert it lacks.
//   TP -> EP            expert e's new owner takes slice j from rank j of its own node (every
//                       node holds every slice): nothing crosses; per rank and layer, its E/P
//                       experts x (R-1)/R within its node, as on one node of R.
//   KV                  a sequence is served after the switch by its EP owner's node (TP
//                       replica of that node; back again by the rank of that node that the
//                       placement picks): its KV never leaves the node, and each rank moves
//                       what it would on one node of R at the same sequences a rank.
//   Qwen3-235B (37,748,736 B an expert, E 128), 2 nodes of 8, a layer, every rank:
//     EP16 -> TP8 x 2: 264,241,152 B within, 301,989,888 B across
//     TP8 x 2 -> EP16: 264,241,152 B within, 0 across

#include <cstdint>
#include <vector>

#include <moebius/plan/switch_workload.hpp>

namespace mini_engine {

// N nodes of R ranks.
struct node_grid {
  int num_nodes = 2;
  int ranks_per_node = 8;

  int num_ranks() const { return num_nodes * ranks_per_node; }
  int node_of(int rank) const { return rank / ranks_per_node; }
};

enum class replica_switch : uint8_t {
  ep_to_tp,  // EP over every rank -> TP within each node
  tp_to_ep,  // back
};
const char* to_string(replica_switch d);

// What one rank sends in one layer's switch.
struct rank_traffic {
  int64_t within_node = 0;   // to the other ranks of its node
  int64_t across_nodes = 0;  // to ranks of other nodes
  friend bool operator==(const rank_traffic&, const rank_traffic&) = default;
};

// Per rank, one layer's expert bytes sent, found by walking every (expert, slice) the target
// layout needs and where the source layout holds it (the map above); `expert_bytes`: one
// whole expert's weights (3 x H x I x bytes). Throws errc::invalid_argument unless
// num_nodes, ranks_per_node >= 1, P | E, ranks_per_node | expert_bytes and expert_bytes >= 0.
std::vector<rank_traffic> replica_switch_traffic(const node_grid& g, int64_t num_experts,
                                                 int64_t expert_bytes, replica_switch d);

// The workload of a whole switch over `num_layers` layers (one phase each): the busiest
// rank's bytes within its node (expert weights) and across nodes, plus `kv_bytes_per_rank`
// of KV within its node (KV never crosses: see above).
//   Qwen3-235B, EP16 -> TP8 x 2, no KV: {16, 24,838,668,288 B within, 0 KV, 94 phases,
//   0 rounds, 28,387,049,472 B across}.
moebius::switch_workload replica_switch_workload(const node_grid& g, int64_t num_experts,
                                                 int64_t expert_bytes, int64_t num_layers,
                                                 replica_switch d, int64_t kv_bytes_per_rank);

}  // namespace mini_engine
