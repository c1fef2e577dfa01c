#include "replica_switch.hpp"

#include <algorithm>

#include <moebius/error.hpp>

namespace mini_engine {

using moebius::errc;

const char* to_string(replica_switch d) {
  return d == replica_switch::ep_to_tp ? "EP over the nodes -> TP within each"
                                       : "TP within each node -> EP over the nodes";
}

std::vector<rank_traffic> replica_switch_traffic(const node_grid& g, int64_t num_experts,
                                                 int64_t expert_bytes, replica_switch d) {
  MOEBIUS_CHECK(g.num_nodes >= 1 && g.ranks_per_node >= 1, errc::invalid_argument,
                "replica switch: num_nodes and ranks_per_node must be >= 1 (num_nodes=",
                g.num_nodes, ", ranks_per_node=", g.ranks_per_node, ")");
  const int P = g.num_ranks(), R = g.ranks_per_node;
  MOEBIUS_CHECK(num_experts >= 1 && num_experts % P == 0, errc::invalid_argument,
                "replica switch: P = ", P, " must divide num_experts (", num_experts, ")");
  MOEBIUS_CHECK(expert_bytes >= 0 && expert_bytes % R == 0, errc::invalid_argument,
                "replica switch: expert_bytes (", expert_bytes,
                ") must be >= 0 and split into ranks_per_node = ", R, " slices");
  const int64_t slice = expert_bytes / R, per_rank = num_experts / P;
  std::vector<rank_traffic> out(static_cast<size_t>(P));
  auto send = [&](int from, int to) {
    if (from == to) return;  // stays on the rank
    rank_traffic& t = out[static_cast<size_t>(from)];
    (g.node_of(from) == g.node_of(to) ? t.within_node : t.across_nodes) += slice;
  };
  for (int64_t e = 0; e < num_experts; ++e) {
    const int owner = static_cast<int>(e / per_rank);  // its EP rank
    for (int j = 0; j < R; ++j) {
      if (d == replica_switch::ep_to_tp) {
        // Every node's rank j needs slice j; only the owner has it.
        for (int n = 0; n < g.num_nodes; ++n) send(owner, n * R + j);
      } else {
        // The owner needs every slice; its own node's rank j has slice j.
        send(g.node_of(owner) * R + j, owner);
      }
    }
  }
  return out;
}

moebius::switch_workload replica_switch_workload(const node_grid& g, int64_t num_experts,
                                                 int64_t expert_bytes, int64_t num_layers,
                                                 replica_switch d, int64_t kv_bytes_per_rank) {
  MOEBIUS_CHECK(num_layers >= 0 && kv_bytes_per_rank >= 0, errc::invalid_argument,
                "replica switch: num_layers (", num_layers, ") and kv_bytes_per_rank (",
                kv_bytes_per_rank, ") must be >= 0");
  const std::vector<rank_traffic> t = replica_switch_traffic(g, num_experts, expert_bytes, d);
  int64_t within = 0, across = 0;
  for (const rank_traffic& r : t) {
    within = std::max(within, r.within_node);
    across = std::max(across, r.across_nodes);
  }
  moebius::switch_workload w;
  w.num_ranks = g.num_ranks();
  w.weight_bytes_per_rank = within * num_layers;
  w.internode_bytes_per_rank = across * num_layers;
  w.kv_bytes_per_rank = kv_bytes_per_rank;
  w.weight_phases = num_layers;
  return w;
}

}  // namespace mini_engine
