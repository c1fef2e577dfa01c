#pragma once

// The paper's deployment past one node (a what-if, priced: nothing here was measured on more
// than one node): a model on N nodes of 8 GPUs, served either in EP over all 8N GPUs or in TP
// within each node (N TP replicas, each serving its own sequences: TP's all-reduces never leave
// a node), statically or switching between the two (replica_switch.hpp: which ranks exchange
// what). What each holds a rank and in all, from the one-node accounting (deployment.hpp):
//
//   static EP      EP over 8N ranks, its own weights: E/8N whole experts a rank, the whole
//                  attention and the dense weights (make_deployment at P = 8N)
//   static TP      a one-node static TP deployment in each node: N x its tokens
//   switching      one footprint for both layouts: the arena holds the larger layout's experts,
//                  a TP replica's I/8 slice of every expert (E/8 experts' bytes a rank, twice
//                  EP16's E/16 whole ones at N = 2) and its spare slot, beside the whole
//                  attention and dense weights: one node's switching footprint a rank. Its EP
//                  holds 8N x one rank's pool, its TP replicas N x one node's TP view.
//   running        N x the per-node limit (the paper's 2,048 a node)
//
//   Qwen3-235B-A22B, 2 nodes of 8 H200s at 0.85: static EP16 44.4 GB of weights a rank (one
//   node's EP8: 72.8), 6.96M tokens (3.0x one node's 2.30M); static TP8 x 2 2.88M; switching
//   EP16 4.55M, TP8 x 2 2.28M (73.4 GB of weights a rank in either).

#include <iosfwd>

#include "deployment.hpp"
#include "model_config.hpp"
#include "replica_switch.hpp"

namespace mini_engine {

struct node_deployment {
  node_grid grid;
  deployment_options per_node;  // each node's options (its P: ranks_per_node)
  // Static: EP over every rank; TP within each node (replicas = num_nodes).
  layout_capacity static_ep, static_tp;
  // The switching design's two layouts on one footprint.
  layout_capacity switching_ep, switching_tp;
};

// Throws errc::invalid_argument unless the grid has >= 1 node of >= 1 rank, per_node's
// num_ranks equals ranks_per_node, and the model splits over ranks_per_node and over every
// rank (validate; make_deployment's checks on `per_node`).
node_deployment make_node_deployment(const model_config& model, const node_grid& grid,
                                     const deployment_options& per_node = {});

// One line per layout: "static EP16: 45.2 GB of weights and 82.9 GB of KV a rank, ...".
std::ostream& operator<<(std::ostream& os, const node_deployment& d);

}  // namespace mini_engine
