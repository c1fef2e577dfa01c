#pragma once

// moebius_demo --runtime sim --nodes 2: the paper's deployment past one node, PRICED (a what-if:
// nothing here was measured on two nodes). The simulated runtime serves each trace on one node
// as usual (the paper's design: static TP, static EP, ours, the paper's policy); this report
// then prices the same runs on two nodes (serving/node_repricing.hpp: each step and switch
// repriced, two copies of the trace, one a node) and prints what one switch costs and whether
// switching still pays.
//
// Why inside the demo rather than a program of its own: the repricing needs the one-node runs'
// step and switch records, which only the demo's harness produces (its traces, calibration,
// policy and pools); a separate program would rebuild all of it.

#include <memory>
#include <vector>

#include "node_repricing.hpp"
#include "options.hpp"
#include "runs.hpp"
#include "step_clock.hpp"

namespace mini_engine::demo {

// The models the what-if prices with: one node of 8 (its steps, each TP replica's, its
// switches as the simulated runtime priced them) and EP over o.nodes nodes of 8; the
// collectives as --collectives asks (cited by default: at 16 ranks DeepEP's across nodes).
struct nodes_models {
  node_grid grid;
  std::unique_ptr<h200_step_model> one_node, nodes;
  // The simulated runtime's clock (its measured one-node curves), for the anchored pricing.
  const step_clock* curves = nullptr;
  // Anchored on the curves (serving/node_repricing.hpp), or the roofline alone.
  node_pricing pricing(bool anchored) const {
    return {grid, one_node.get(), nodes.get(), anchored ? curves : nullptr};
  }
};
nodes_models make_nodes_models(const options& o, const step_clock& curves);

// Once, before the traces: the capacities of both deployments, the switch's mapping and its
// price on o.nodes nodes against one node's, and what prices the steps.
void print_nodes_preamble(const options& o, const nodes_models& m);

// One trace: its runs repriced both ways, anchored on the measured one-node curves and by the
// roofline alone (rollout: total time; interactive: busy time and the decode-token-weighted
// step), the free-switch bounds, and each way's verdict in numbers.
void print_nodes_trace(const std::vector<run_outcome>& runs, bool rollout, const nodes_models& m);

}  // namespace mini_engine::demo
