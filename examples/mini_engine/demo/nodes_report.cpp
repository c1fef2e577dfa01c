#include "nodes_report.hpp"

#include <algorithm>
#include <cstdio>
#include <stdexcept>
#include <string>

#include <moebius/policy/cost_model.hpp>

#include "deployment.hpp"
#include "model_config.hpp"
#include "node_deployment.hpp"
#include "sim_deployment.hpp"

namespace mini_engine::demo {

namespace {

// What the two sides give for one run.
struct priced_row {
  run_kind kind;
  repriced_run r;
};

double better_static(const std::vector<priced_row>& rows, double (*total)(const repriced_run&)) {
  double best = 0;
  for (const priced_row& p : rows)
    if (p.kind == run_kind::static_tp || p.kind == run_kind::static_ep)
      best = best == 0 ? total(p.r) : std::min(best, total(p.r));
  return best;
}

double one_total(const repriced_run& r) { return r.one_node_s(); }
double nodes_total(const repriced_run& r) { return r.nodes_s(); }
double one_token_step(const repriced_run& r) { return r.one_node_token_step_s; }
double nodes_token_step(const repriced_run& r) { return r.nodes_token_step_s; }

const priced_row& row_of(const std::vector<priced_row>& rows, run_kind k) {
  for (const priced_row& p : rows)
    if (p.kind == k) return p;
  throw std::logic_error(std::string("nodes report: no run ") + label_of(k));
}

// The weights-only switch on one node and both ways on N, in ms.
struct switch_prices {
  double one_node_ms = 0, to_tp_ms = 0, to_ep_ms = 0;
  moebius::switch_workload to_tp, to_ep;
};

switch_prices switch_prices_of(const nodes_models& m) {
  switch_prices s;
  moebius::switch_report weights;
  weights.outcome = moebius::switch_outcome::committed;
  s.one_node_ms = m.one_node->switch_s(weights) * 1e3;
  switch_record sw;
  sw.clock_ms = s.one_node_ms;  // no KV beyond the weights
  sw.from = moebius::parallel_mode::ep;
  sw.to = moebius::parallel_mode::tp;
  s.to_tp_ms = switch_on_nodes_s(sw, m.pricing(false), &s.to_tp) * 1e3;
  std::swap(sw.from, sw.to);
  s.to_ep_ms = switch_on_nodes_s(sw, m.pricing(false), &s.to_ep) * 1e3;
  return s;
}

// The expert bytes leaving a rank in one node's switch (either way).
int64_t one_node_weights_per_rank(const priced_model& pm) {
  return replica_switch_workload({1, 8}, pm.num_experts,
                                 3 * pm.hidden * pm.intermediate * pm.weight_bytes,
                                 pm.num_layers, replica_switch::ep_to_tp, 0)
      .weight_bytes_per_rank;
}

std::string capacities(const layout_capacity& ep, const layout_capacity& tp, const char* ep_name,
                       const char* tp_name) {
  char buf[200];
  std::snprintf(buf, sizeof buf, "%s %.2fM (%lld of 4k), %s %.2fM (%lld of 4k)", ep_name,
                static_cast<double>(ep.tokens) / 1e6, static_cast<long long>(ep.sequences(4096)),
                tp_name, static_cast<double>(tp.tokens) / 1e6,
                static_cast<long long>(tp.sequences(4096)));
  return buf;
}

}  // namespace

nodes_models make_nodes_models(const options& o, const step_clock& curves) {
  nodes_models m;
  m.curves = &curves;
  m.grid = node_grid{o.nodes, 8};
  priced_model pm = qwen3_235b_a22b_priced();
  pm.context_scale = 1;  // the simulated runtime's contexts are the trace's own
  const int64_t kv_per_token =
      make_sim_geometry(make_deployment(qwen3_235b_a22b(), deployment_kind::switching))
          .kv_bytes_per_token;
  h200_params one;
  one.collectives = o.collectives;
  h200_params across = one;
  across.num_nodes = o.nodes;
  m.one_node = std::make_unique<h200_step_model>(pm, one, m.grid.ranks_per_node, kv_per_token,
                                                 nullptr);
  m.nodes = std::make_unique<h200_step_model>(pm, across, m.grid.num_ranks(), kv_per_token,
                                              nullptr);
  return m;
}

void print_nodes_preamble(const options& o, const nodes_models& m) {
  const int N = m.grid.num_nodes, P = m.grid.num_ranks();
  std::printf("\n%d nodes, PRICED (a what-if, nothing measured on more than one node): "
              "Qwen3-235B-A22B on %d x 8 H200s, EP%d over all of them or TP8 within each node "
              "(%d replicas, each serving its own sequences)\n",
              N, N, P, N);
  const model_config q = qwen3_235b_a22b();
  const node_deployment d = make_node_deployment(q, m.grid);
  const deployment tp = make_deployment(q, deployment_kind::static_tp);
  const deployment ep = make_deployment(q, deployment_kind::static_ep);
  const deployment sw = make_deployment(q, deployment_kind::switching);
  const std::string epN = "EP" + std::to_string(P), tpN = "TP8 x " + std::to_string(N);
  std::printf("  KV tokens, one node: static %s; switching %s\n",
              capacities(ep.ep, tp.tp, "EP8", "TP8").c_str(),
              capacities(sw.ep, sw.tp, "EP8", "TP8").c_str());
  std::printf("  KV tokens, %d nodes: static %s; switching %s (the switching footprint holds a "
              "TP8 replica's expert slices, twice EP%d's own experts: its EP%d holds %d x one "
              "node's switching EP, not static EP%d's %.2fM)\n",
              N, capacities(d.static_ep, d.static_tp, epN.c_str(), tpN.c_str()).c_str(),
              capacities(d.switching_ep, d.switching_tp, epN.c_str(), tpN.c_str()).c_str(), P, P,
              N, P, static_cast<double>(d.static_ep.tokens) / 1e6);
  const switch_prices s = switch_prices_of(m);
  const double gb = 1e9;
  std::printf("  one switch, weights alone (moebius::cost_model): one node %.1f ms either way "
              "(%.1f GB a rank at %.0f GB/s); %d nodes %s -> %s %.1f ms (%.1f GB a rank across "
              "nodes at %.0f GB/s, beside %.1f GB within; %.1fx one node's), %s -> %s %.1f ms "
              "(%.1f GB within, nothing crosses)\n",
              s.one_node_ms,
              static_cast<double>(one_node_weights_per_rank(m.one_node->model())) / gb,
              m.one_node->hardware().switch_link.bandwidth.gb_per_s(), N, epN.c_str(),
              tpN.c_str(), s.to_tp_ms, static_cast<double>(s.to_tp.internode_bytes_per_rank) / gb,
              m.nodes->hardware().internode.gb_per_s(),
              static_cast<double>(s.to_tp.weight_bytes_per_rank) / gb, s.to_tp_ms / s.one_node_ms,
              tpN.c_str(), epN.c_str(), s.to_ep_ms,
              static_cast<double>(s.to_ep.weight_bytes_per_rank) / gb);
  std::printf("  who sends what: %s rank g holds experts 8g..8g+7 whole; TP8 rank j of each node "
              "slice j of every expert; to TP, each expert's owner sends slice j to rank j of "
              "every node; to EP, the owner takes slice j from rank j of its own node; a "
              "sequence stays on its node, so KV never crosses (serving/replica_switch.hpp)\n",
              epN.c_str());
  std::printf("  steps: the measured one-node curves do not cover P = %d; the roofline "
              "(h200_step_model) prices %s at P = %d over %d nodes (dispatch and combine across "
              "the nodes: %s) and EP8 and TP8 at P = 8, two ways: anchored (a TP8 replica's "
              "step as the curves price it, %s's the curves' EP8 step plus the roofline's %s - "
              "EP8) and the roofline alone on both sides\n",
              P, epN.c_str(), P, N,
              o.collectives == collective_pricing::cited
                  ? "DeepEP's cited EP16 figures, collective_table.hpp"
                  : "the link model, NVLink within and 50 GB/s a GPU across",
              epN.c_str(), epN.c_str());
  std::printf("  runs: the one-node runs below, each step and switch repriced on %d nodes "
              "serving %d copies of the trace (serving/node_repricing.hpp); kept from one "
              "node: the steps' order, batches and modes, admissions and preemptions, the "
              "policy's decisions\n",
              N, N);
}

namespace {

// One pricing's table, bound and verdict.
void print_priced(const std::vector<run_outcome>& runs, bool rollout, const nodes_models& m,
                  bool anchored) {
  const node_pricing p = m.pricing(anchored);
  std::vector<priced_row> rows;
  for (const run_outcome& r : runs) rows.push_back({r.kind, reprice_on_nodes(r.result, p)});
  const int N = m.grid.num_nodes;
  std::printf("  %d nodes, PRICED, %s:\n", N,
              anchored ? "anchored on the measured one-node curves (one node: the runs as "
                         "priced above; EP16: their EP steps plus the roofline's EP16 - EP8)"
                       : "the roofline alone on both sides");
  const std::string nodes = std::to_string(N) + " nodes";
  if (rollout) {
    std::printf("  %-17s %12s %8s %17s   %12s %8s %17s\n", "run", "one node", "x best",
                "switches (total)", nodes.c_str(), "x best", "switches (total)");
  } else {
    std::printf("  %-17s %10s %9s %8s %11s   %10s %9s %8s %11s\n", "run", "token-step", "busy",
                "x best", "switches", "token-step", "busy", "x best", "switches");
  }
  const double best1 = better_static(rows, rollout ? one_total : one_token_step);
  const double bestN = better_static(rows, rollout ? nodes_total : nodes_token_step);
  for (const priced_row& row : rows) {
    const repriced_run& r = row.r;
    if (rollout) {
      std::printf("  %-17s %10.1f s %7.3fx %5lld (%7.1f s)   %10.1f s %7.3fx %5lld (%7.1f s)\n",
                  label_of(row.kind), r.one_node_s(), best1 / r.one_node_s(),
                  static_cast<long long>(r.switches), r.one_node_switches_s, r.nodes_s(),
                  bestN / r.nodes_s(), static_cast<long long>(r.switches), r.nodes_switches_s);
    } else {
      std::printf("  %-17s %7.1f ms %7.1f s %7.3fx %3lld (%4.2f s)   %7.1f ms %7.1f s %7.3fx "
                  "%3lld (%4.2f s)\n",
                  label_of(row.kind), r.one_node_token_step_s * 1e3, r.one_node_s(),
                  best1 / r.one_node_token_step_s, static_cast<long long>(r.switches),
                  r.one_node_switches_s, r.nodes_token_step_s * 1e3, r.nodes_s(),
                  bestN / r.nodes_token_step_s, static_cast<long long>(r.switches),
                  r.nodes_switches_s);
    }
  }
  const repriced_run& ours = row_of(rows, run_kind::switching).r;
  const char* how = anchored ? "anchored" : "roofline";
  if (rollout) {
    const free_switch_bounds b =
        free_switch_bounds_on_nodes(run_of(runs, run_kind::static_ep).result, p);
    std::printf("  %-17s %10.1f s %7.3fx %17s   %10.1f s %7.3fx\n", "free switch bound",
                b.one_node_s, best1 / b.one_node_s, "", b.nodes_s, bestN / b.nodes_s);
    std::printf("  verdict (%d nodes, priced, %s): ours %.3fx the better static layout (one "
                "node %.3fx); its %lld switches take %.1f s (one node %.1f s); a free switch at "
                "every step, capacity ignored, would reach %.3fx (one node %.3fx)\n",
                N, how, bestN / ours.nodes_s(), best1 / ours.one_node_s(),
                static_cast<long long>(ours.switches), ours.nodes_switches_s,
                ours.one_node_switches_s, bestN / b.nodes_s, best1 / b.one_node_s);
  } else {
    const repriced_run& paper = row_of(rows, run_kind::paper_policy).r;
    std::printf("  verdict (%d nodes, priced, %s): ours %.3fx the better static layout's "
                "token-step (one node %.3fx) with %lld switches; the paper's policy %.3fx (one "
                "node %.3fx), its %lld switches %.2f s of busy time (one node %.2f s)\n",
                N, how, bestN / ours.nodes_token_step_s, best1 / ours.one_node_token_step_s,
                static_cast<long long>(ours.switches), bestN / paper.nodes_token_step_s,
                best1 / paper.one_node_token_step_s, static_cast<long long>(paper.switches),
                paper.nodes_switches_s, paper.one_node_switches_s);
  }
}

}  // namespace

void print_nodes_trace(const std::vector<run_outcome>& runs, bool rollout, const nodes_models& m) {
  print_priced(runs, rollout, m, true);
  print_priced(runs, rollout, m, false);
  if (!rollout)
    std::printf("  (token-step: each step's time weighted by its decode tokens, a TPOT without "
                "queueing; busy: steps and switches, without the idle time between arrivals; x "
                "best on the token-step)\n");
}

}  // namespace mini_engine::demo
