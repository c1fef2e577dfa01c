#include "node_deployment.hpp"

#include <cstdio>
#include <ostream>
#include <string>

#include <moebius/error.hpp>

namespace mini_engine {

using moebius::errc;

namespace {

// `one` (a layout of one node) as N copies, one a node, each with its own sequences.
layout_capacity replicated(layout_capacity one, int num_nodes) {
  one.replicas = num_nodes;
  one.tokens *= num_nodes;
  one.max_running *= num_nodes;
  return one;
}

// `rank` (one rank's share of an EP layout) spread over `num_ranks` ranks.
layout_capacity spread(layout_capacity rank, int num_ranks, int64_t max_running) {
  rank.tokens = rank.tokens / rank.num_ranks * num_ranks;
  rank.num_ranks = num_ranks;
  rank.max_running = max_running;
  return rank;
}

}  // namespace

node_deployment make_node_deployment(const model_config& model, const node_grid& grid,
                                     const deployment_options& per_node) {
  MOEBIUS_CHECK(grid.num_nodes >= 1 && grid.ranks_per_node >= 1, errc::invalid_argument,
                "node deployment: num_nodes and ranks_per_node must be >= 1 (num_nodes=",
                grid.num_nodes, ", ranks_per_node=", grid.ranks_per_node, ")");
  MOEBIUS_CHECK(per_node.num_ranks == grid.ranks_per_node, errc::invalid_argument,
                "node deployment: the per-node options' num_ranks (", per_node.num_ranks,
                ") must be ranks_per_node (", grid.ranks_per_node, ")");
  node_deployment d;
  d.grid = grid;
  d.per_node = per_node;
  deployment_options all = per_node;
  all.num_ranks = grid.num_ranks();
  all.max_running = per_node.max_running * grid.num_nodes;
  d.static_ep = make_deployment(model, deployment_kind::static_ep, all).ep;
  d.static_tp = replicated(make_deployment(model, deployment_kind::static_tp, per_node).tp,
                           grid.num_nodes);
  const deployment sw = make_deployment(model, deployment_kind::switching, per_node);
  d.switching_ep = spread(sw.ep, grid.num_ranks(), all.max_running);
  d.switching_tp = replicated(sw.tp, grid.num_nodes);
  return d;
}

std::ostream& operator<<(std::ostream& os, const node_deployment& d) {
  const struct {
    const char* design;
    const layout_capacity* l;
  } rows[] = {{"static", &d.static_ep},
              {"static", &d.static_tp},
              {"switching", &d.switching_ep},
              {"switching", &d.switching_tp}};
  char buf[400];
  for (const auto& r : rows) {
    const layout_capacity& l = *r.l;
    const std::string name =
        l.replicas > 1 ? name_of(l.config) + std::to_string(l.num_ranks) + " x " +
                             std::to_string(l.replicas)
                       : name_of(l.config) + std::to_string(l.num_ranks);
    std::snprintf(buf, sizeof buf,
                  "  %s %s: %.1f GB of weights and %.1f GB of KV a rank, %.1f KB a token: "
                  "%.2fM tokens, sequences of 4k / 16k / 32k: %lld / %lld / %lld\n",
                  r.design, name.c_str(), static_cast<double>(l.weight_bytes) / 1e9,
                  static_cast<double>(l.kv_pool_bytes) / 1e9,
                  static_cast<double>(l.kv_bytes_per_token) / 1e3,
                  static_cast<double>(l.tokens) / 1e6,
                  static_cast<long long>(l.sequences(4096)),
                  static_cast<long long>(l.sequences(16384)),
                  static_cast<long long>(l.sequences(32768)));
    os << buf;
  }
  return os;
}

}  // namespace mini_engine
