#pragma once

// A one-node run repriced as if N nodes served it (a what-if, priced: nothing here was measured
// on more than one node). Serving 16 ranks in the simulated runtime would need TP replicas the
// engine does not have; instead each step and switch a run recorded on one node of R ranks is
// priced again on N nodes serving N copies of its trace, each node's copy as the one node
// served it:
//
//   an EP step of B sequences, T tokens, C context tokens  ->  one EP step over all N R ranks
//       of N B, N T, N C (each rank the share it had on one node), priced by the roofline at
//       P = N R over N nodes (h200_step_model: its dispatch and combine across the nodes);
//   a TP step                                              ->  the same step on each node's
//       TP replica, side by side: one replica's, priced by the roofline at P = R on one node;
//   a committed switch EP -> TP (TP -> EP)                 ->  replica_switch's workload at N
//       nodes through moebius::cost_model over the link across nodes, with the KV bytes a rank
//       moved on one node (recovered from the switch's one-node price less its weights'; its
//       rounds' barriers folded into those bytes); a refused switch costs 0 on both.
//
// The steps are priced one of two ways:
//   roofline   both sides by the roofline (h200_step_model at P = N R over N nodes for EP, at
//              P = R for one node and each TP replica): like with like, the roofline's own
//              level (which on one node sits below the measured curves);
//   anchored   on the clock the one-node run was priced on (the measured one-node curves): one
//              node's step as it was priced (another layout's as that clock prices it), a TP
//              replica's the same, and EP over N nodes that price plus the roofline's
//              difference between EP over N nodes at N B and EP on one node at B (what no curve
//              measured covers: half the experts a rank, dispatch and combine across nodes).
// The measured one-node curves do not cover P = N R: the roofline prices what changes.
// What stays the one-node run's: the sequence of steps (which ran in which mode, their batches,
// admissions and preemptions from one node's pools, the policy's decisions on one node's
// curves and switch price, when requests arrive against steps of another length). A static
// EP16 run with its larger pool would preempt less; a policy on two nodes' curves and price
// would switch elsewhere or not at all. Stop-the-world runs only: a progressive switch's steps
// are refused.

#include <cstdint>

#include <moebius/policy/cost_model.hpp>

#include "replica_switch.hpp"
#include "run_report.hpp"
#include "step_clock.hpp"

namespace mini_engine {

// The models a run is repriced with.
struct node_pricing {
  node_grid grid;
  // P = R on one node: one node's steps, and a TP replica's on N nodes; its switch_s prices
  // one node's switches (the recorded ones were priced so).
  const h200_step_model* one_node = nullptr;
  // P = N R over N nodes (hardware().num_nodes = N): EP's steps on N nodes, and the link its
  // switches cross (switch_link_across_nodes()).
  const h200_step_model* nodes = nullptr;
  // Anchored: the clock the one-node run was priced on (its measured curves); null: the
  // roofline on both sides.
  const step_clock* anchor = nullptr;
};

// One run, priced both ways.
struct repriced_run {
  double one_node_steps_s = 0, nodes_steps_s = 0;        // every step
  double one_node_switches_s = 0, nodes_switches_s = 0;  // every committed switch
  int64_t switches = 0;                                   // committed
  // Decode-token-weighted step time (a step of d decode tokens counts d times): the mean time
  // per output token of a running sequence, a TPOT without queueing.
  double one_node_token_step_s = 0, nodes_token_step_s = 0;
  int64_t decode_tokens = 0;

  double one_node_s() const { return one_node_steps_s + one_node_switches_s; }
  double nodes_s() const { return nodes_steps_s + nodes_switches_s; }
};

// Throws errc::invalid_argument when a model is missing, the models' P are not R and N R,
// the nodes model does not span N nodes, or `r` holds a progressive switch or a step of a
// configuration other than TP and EP.
repriced_run reprice_on_nodes(const run_result& r, const node_pricing& p);

// One step of `s`'s shape priced in `config` on one node (`nodes` false) or on N nodes (with an
// anchor, in its own configuration on one node: s.step_ms as recorded).
double step_on_s(const step_record& s, const configuration& config, const node_pricing& p,
                 bool nodes);

// One committed switch of `sw` (its one-node price sw.clock_ms) on N nodes, in seconds, and
// the workload priced.
double switch_on_nodes_s(const switch_record& sw, const node_pricing& p,
                         moebius::switch_workload* workload = nullptr);

// The bound a free switch at every step would reach, capacity ignored: every step of `r` in
// the faster of TP and EP, switches free; on one node and on N nodes.
struct free_switch_bounds {
  double one_node_s = 0, nodes_s = 0;
};
free_switch_bounds free_switch_bounds_on_nodes(const run_result& r, const node_pricing& p);

}  // namespace mini_engine
