#include "node_repricing.hpp"

#include <algorithm>

#include <moebius/error.hpp>

namespace mini_engine {

using moebius::errc;
using moebius::parallel_mode;

namespace {

void check(const node_pricing& p) {
  MOEBIUS_CHECK(p.one_node != nullptr && p.nodes != nullptr, errc::invalid_argument,
                "reprice on nodes: both models are needed (one node and N nodes)");
  MOEBIUS_CHECK(p.grid.num_nodes >= 1 && p.grid.ranks_per_node >= 1 &&
                    p.one_node->num_ranks() == p.grid.ranks_per_node &&
                    p.one_node->hardware().num_nodes == 1 &&
                    p.nodes->num_ranks() == p.grid.num_ranks() &&
                    p.nodes->hardware().num_nodes == p.grid.num_nodes,
                errc::invalid_argument, "reprice on nodes: ", p.grid.num_nodes, " nodes of ",
                p.grid.ranks_per_node, " need a one-node model of P = ", p.grid.ranks_per_node,
                " (has P = ", p.one_node->num_ranks(), " over ",
                p.one_node->hardware().num_nodes, " nodes) and one of P = ", p.grid.num_ranks(),
                " over ", p.grid.num_nodes, " nodes (has P = ", p.nodes->num_ranks(), " over ",
                p.nodes->hardware().num_nodes, ")");
}

bool is_paper_layout(const configuration& c) { return c == k_tp || c == k_ep; }

}  // namespace

double step_on_s(const step_record& s, const configuration& config, const node_pricing& p,
                 bool nodes) {
  check(p);
  MOEBIUS_CHECK(is_paper_layout(config), errc::invalid_argument, "reprice on nodes: ",
                name_of(config), " is not repriced (TP or EP)");
  const bool spread = nodes && config == k_ep;  // EP over every rank of the N nodes
  // The step's shape, `copies` times over, on `clock` at its P.
  auto priced = [&](const step_clock& clock, int num_ranks, int64_t copies) {
    step_cost c;
    c.set(config);
    c.num_ranks = num_ranks;
    c.num_sequences = s.sequences * copies;
    c.new_tokens = (s.decode_tokens + s.prefill_tokens) * copies;
    c.context_tokens = s.context_tokens * copies;
    return clock.step_s(c, 0);
  };
  const int R = p.grid.ranks_per_node, N = p.grid.num_nodes;
  if (p.anchor == nullptr)
    return spread ? priced(*p.nodes, p.grid.num_ranks(), N) : priced(*p.one_node, R, 1);
  const double one = s.config == config ? s.step_ms * 1e-3 : priced(*p.anchor, R, 1);
  if (!spread) return one;
  return one + priced(*p.nodes, p.grid.num_ranks(), N) - priced(*p.one_node, R, 1);
}

double switch_on_nodes_s(const switch_record& sw, const node_pricing& p,
                         moebius::switch_workload* workload) {
  check(p);
  if (sw.outcome != moebius::switch_outcome::committed) return 0;
  MOEBIUS_CHECK(!sw.progressive, errc::invalid_argument,
                "reprice on nodes: a progressive switch (step ", sw.step,
                ") is not repriced (stop-the-world runs only)");
  MOEBIUS_CHECK(sw.from.uniform() && sw.to.uniform() && sw.from.attention != sw.to.attention,
                errc::invalid_argument, "reprice on nodes: the switch at step ", sw.step,
                " is not between TP and EP");
  // The KV a rank moved on one node: the switch's price less its weights' alone (a committed
  // switch that moved no KV), at the rate the cost model prices KV.
  moebius::switch_report weights_only;
  weights_only.outcome = moebius::switch_outcome::committed;
  const double kv_s = std::max(0.0, sw.clock_ms * 1e-3 - p.one_node->switch_s(weights_only));
  const moebius::link_params link = p.nodes->hardware().switch_link_across_nodes();
  const auto kv_bytes =
      static_cast<int64_t>(kv_s * link.effective_kv_bandwidth().bytes_per_s);
  const priced_model& m = p.nodes->model();
  const int64_t expert_bytes = 3 * m.hidden * m.intermediate * m.weight_bytes;
  const replica_switch d =
      sw.to.attention == parallel_mode::tp ? replica_switch::ep_to_tp : replica_switch::tp_to_ep;
  const moebius::switch_workload w =
      replica_switch_workload(p.grid, m.num_experts, expert_bytes, m.num_layers, d, kv_bytes);
  if (workload != nullptr) *workload = w;
  return moebius::cost_model(link).predict(w).total_ms() * 1e-3;
}

repriced_run reprice_on_nodes(const run_result& r, const node_pricing& p) {
  check(p);
  repriced_run out;
  for (const step_record& s : r.steps) {
    MOEBIUS_CHECK(!s.in_switch, errc::invalid_argument, "reprice on nodes: step ", s.step,
                  " ran beside a progressive switch's copies (stop-the-world runs only)");
    const double one = step_on_s(s, s.config, p, false), nodes = step_on_s(s, s.config, p, true);
    out.one_node_steps_s += one;
    out.nodes_steps_s += nodes;
    out.decode_tokens += s.decode_tokens;
    out.one_node_token_step_s += one * static_cast<double>(s.decode_tokens);
    out.nodes_token_step_s += nodes * static_cast<double>(s.decode_tokens);
  }
  if (out.decode_tokens > 0) {
    out.one_node_token_step_s /= static_cast<double>(out.decode_tokens);
    out.nodes_token_step_s /= static_cast<double>(out.decode_tokens);
  }
  for (const switch_record& sw : r.switches) {
    if (sw.outcome != moebius::switch_outcome::committed) continue;
    ++out.switches;
    out.one_node_switches_s += sw.clock_ms * 1e-3;
    out.nodes_switches_s += switch_on_nodes_s(sw, p);
  }
  return out;
}

free_switch_bounds free_switch_bounds_on_nodes(const run_result& r, const node_pricing& p) {
  check(p);
  free_switch_bounds b;
  for (const step_record& s : r.steps) {
    b.one_node_s += std::min(step_on_s(s, k_tp, p, false), step_on_s(s, k_ep, p, false));
    b.nodes_s += std::min(step_on_s(s, k_tp, p, true), step_on_s(s, k_ep, p, true));
  }
  return b;
}

}  // namespace mini_engine
