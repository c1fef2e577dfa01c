// The paper's deployment past one node, priced (a what-if): the switch between EP over two
// nodes and TP within each (replica_switch.hpp) against its closed form and by hand, its price
// (bytes that cross nodes at the internode rate, plus the barriers across), the capacities
// (node_deployment.hpp) against one node's, the roofline's dispatch and combine across nodes
// (step_clock.hpp) by hand and its node count by sampling, a run repriced step by step
// (node_repricing.hpp) by hand, and refusals for bad parameters.
#include <algorithm>
#include <cmath>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <moebius/error.hpp>
#include <moebius/policy/cost_model.hpp>

#include "catch.hpp"
#include "collective_table.hpp"
#include "deployment.hpp"
#include "model_config.hpp"
#include "node_deployment.hpp"
#include "node_repricing.hpp"
#include "replica_switch.hpp"
#include "step_clock.hpp"
#include "test_seed.hpp"

using namespace mini_engine;
using moebius::parallel_mode;

namespace {

constexpr int64_t k_expert = 3 * int64_t{4096} * 1536 * 2;  // Qwen3-235B: 37,748,736 B

// Qwen3-235B priced at P over `nodes` nodes, collectives as asked.
h200_step_model model_at(int P, int nodes, collective_pricing c = collective_pricing::link) {
  priced_model m = qwen3_235b_a22b_priced();
  m.context_scale = 1;
  h200_params hw;
  hw.num_nodes = nodes;
  hw.collectives = c;
  return h200_step_model(m, hw, P, 192 * 1024, nullptr);
}

}  // namespace

TEST_CASE("the replica switch of Qwen3-235B on two nodes of 8, by hand") {
  const node_grid g{2, 8};
  const std::vector<rank_traffic> out =
      replica_switch_traffic(g, 128, k_expert, replica_switch::ep_to_tp);
  REQUIRE(out.size() == 16);
  for (const rank_traffic& t : out) {
    // 8 experts a rank: 7 of 8 slices to its node's peers, all 8 to the other node's ranks.
    CHECK(t.within_node == 8 * 7 * (k_expert / 8));
    CHECK(t.within_node == 264'241'152);
    CHECK(t.across_nodes == 8 * k_expert);
    CHECK(t.across_nodes == 301'989'888);
  }
  for (const rank_traffic& t : replica_switch_traffic(g, 128, k_expert, replica_switch::tp_to_ep)) {
    CHECK(t.within_node == 264'241'152);
    CHECK(t.across_nodes == 0);  // every node holds every slice: nothing crosses
  }
  const moebius::switch_workload w =
      replica_switch_workload(g, 128, k_expert, 94, replica_switch::ep_to_tp, 1'000);
  CHECK(w.num_ranks == 16);
  CHECK(w.weight_bytes_per_rank == 24'838'668'288);
  CHECK(w.internode_bytes_per_rank == 28'387'049'472);
  CHECK(w.kv_bytes_per_rank == 1'000);
  CHECK(w.weight_phases == 94);
  CHECK(w.kv_rounds == 0);
  // One node of 8 (the paper's): the one-node workload, nothing across.
  const moebius::switch_workload one =
      replica_switch_workload({1, 8}, 128, k_expert, 94, replica_switch::ep_to_tp, 0);
  CHECK(one.weight_bytes_per_rank == 49'677'336'576);
  CHECK(one.internode_bytes_per_rank == 0);
}

TEST_CASE("the replica switch's traffic matches its closed form on random grids") {
  std::mt19937_64 rng(testing::test_seed());
  for (int trial = 0; trial < 200; ++trial) {
    const int N = 1 + static_cast<int>(rng() % 4), R = 1 + static_cast<int>(rng() % 8);
    const int P = N * R;
    const int64_t E = P * (1 + static_cast<int64_t>(rng() % 6));
    const int64_t expert = R * (1 + static_cast<int64_t>(rng() % 1000));
    const int64_t per_rank = E / P;
    INFO("N " << N << " R " << R << " E " << E << " expert " << expert);
    int64_t across_total = 0;
    for (const replica_switch d : {replica_switch::ep_to_tp, replica_switch::tp_to_ep}) {
      const std::vector<rank_traffic> t = replica_switch_traffic({N, R}, E, expert, d);
      REQUIRE(t.size() == static_cast<size_t>(P));
      for (const rank_traffic& r : t) {
        CHECK(r.within_node == per_rank * expert / R * (R - 1));
        CHECK(r.across_nodes ==
              (d == replica_switch::ep_to_tp ? per_rank * expert * (N - 1) : 0));
        across_total += r.across_nodes;
      }
    }
    // Each node receives every expert it lacks, once: E - E/N experts a node.
    CHECK(across_total == N * (E - E / N) * expert);
  }
}

TEST_CASE("a switch across nodes costs the bytes that cross at the internode rate") {
  const h200_params hw;
  const moebius::link_params l = hw.switch_link_across_nodes();
  CHECK(l.internode.gb_per_s() == 50);
  CHECK(l.internode_barrier_us == 19.9);
  CHECK(l.bandwidth.gb_per_s() == 395);
  const node_grid g{2, 8};
  const moebius::cost_model cm(l);
  // EP16 -> TP8 x 2: 28,387,049,472 B / 50 GB/s = 567.741 ms, beside 62.88 ms within; 94
  // barriers across (19.9 us) and launches (5 us); the fitted 3.9 ms a switch.
  const double to_tp = cm.predict(replica_switch_workload(g, 128, k_expert, 94,
                                                          replica_switch::ep_to_tp, 0))
                           .total_ms();
  CHECK(to_tp == Approx(28'387'049'472.0 / 50e6 + 94 * (19.9 + 5) * 1e-3 + 3.9).epsilon(1e-9));
  CHECK(to_tp == Approx(574.0).epsilon(1e-3));
  // With 20 GB of KV a rank within the node the NVLink side (113.5 ms) still hides under it.
  const double with_kv = cm.predict(replica_switch_workload(g, 128, k_expert, 94,
                                                            replica_switch::ep_to_tp,
                                                            20'000'000'000))
                             .total_ms();
  CHECK(with_kv == Approx(to_tp).epsilon(1e-12));
  // Back: nothing crosses: 24,838,668,288 B at 395 GB/s and one-node barriers (10 + 5 us).
  const double to_ep = cm.predict(replica_switch_workload(g, 128, k_expert, 94,
                                                          replica_switch::tp_to_ep, 0))
                           .total_ms();
  CHECK(to_ep == Approx(24'838'668'288.0 / 395e6 + 94 * 15e-3 + 3.9).epsilon(1e-9));
  // One node's switch of the same model: 49,677,336,576 B at 395 GB/s.
  const double one_node =
      cm.predict(replica_switch_workload({1, 8}, 128, k_expert, 94, replica_switch::ep_to_tp, 0))
          .total_ms();
  CHECK(one_node == Approx(49'677'336'576.0 / 395e6 + 94 * 15e-3 + 3.9).epsilon(1e-9));
  CHECK(to_tp / one_node == Approx(4.38).epsilon(0.005));
}

TEST_CASE("two nodes hold: EP16 and TP8 x 2 against one node") {
  const model_config q = qwen3_235b_a22b();
  const node_deployment d = make_node_deployment(q, {2, 8});
  const deployment tp = make_deployment(q, deployment_kind::static_tp);
  const deployment ep = make_deployment(q, deployment_kind::static_ep);
  const deployment sw = make_deployment(q, deployment_kind::switching);
  // TP replicas: one node's, twice, each its own sequences.
  CHECK(d.static_tp.tokens == 2 * tp.tp.tokens);
  CHECK(d.static_tp.replicas == 2);
  CHECK(d.static_tp.weight_bytes == tp.tp.weight_bytes);
  CHECK(d.static_tp.sequences(4096) == std::min<int64_t>(4096, 2 * tp.tp.sequences(4096)));
  CHECK(d.switching_tp.tokens == 2 * sw.tp.tokens);
  // Switching EP16: one node's switching footprint a rank (the arena holds TP8's slices), 16
  // such pools.
  CHECK(d.switching_ep.weight_bytes == sw.ep.weight_bytes);
  CHECK(d.switching_ep.tokens == 2 * sw.ep.tokens);
  CHECK(d.switching_ep.num_ranks == 16);
  // Static EP16: 8 whole experts a layer a rank instead of 16: 94 x 8 x 37,748,736 B fewer,
  // all of them KV.
  CHECK(ep.ep.weight_bytes - d.static_ep.weight_bytes == 94 * 8 * k_expert);
  CHECK(d.static_ep.kv_pool_bytes - ep.ep.kv_pool_bytes == Approx(94.0 * 8 * k_expert).margin(1));
  CHECK(d.static_ep.tokens > 2 * ep.ep.tokens);
  CHECK(d.static_ep.max_running == 4096);
  // What the header says, to the printed digit.
  CHECK(std::round(static_cast<double>(d.static_ep.tokens) / 1e4) == 696);
  CHECK(std::round(static_cast<double>(d.static_tp.tokens) / 1e4) == 288);
  CHECK(std::round(static_cast<double>(d.switching_ep.tokens) / 1e4) == 455);
  CHECK(std::round(static_cast<double>(d.static_ep.weight_bytes) / 1e8) == 444);
  CHECK(std::round(static_cast<double>(d.switching_tp.tokens) / 1e4) == 228);
  std::ostringstream os;
  os << d;
  CHECK_THAT(os.str(), Catch::Contains("static EP16:"));
  CHECK_THAT(os.str(), Catch::Contains("switching TP8 x 2:"));
}

TEST_CASE("dispatch and combine across two nodes on the link model, by hand") {
  const h200_step_model two = model_at(16, 2);
  // The other node one token's 8 of 128 experts touches: 1 - C(64,8)/C(128,8).
  CHECK(two.remote_nodes_per_token() == Approx(0.9969041357232079).epsilon(1e-12));
  CHECK(model_at(16, 1).remote_nodes_per_token() == 0);
  // 32 tokens a rank: within 32 x 8 x 14/16 rows of 8,192 B over 389 GB/s (4.717 us), across
  // 32 x 0.996904 rows over 50 GB/s (5.227 us), side by side, plus 19.9 us across.
  CHECK(two.ep_exchange_s(32) * 1e6 == Approx(25.12664875510049).epsilon(1e-9));
  // At every token count the NIC's share is the longer: 0.996904 rows at 50 GB/s take as long
  // as 7.76 rows at 389 GB/s, against the 7 rows within the node.
  for (const double t : {1.0, 64.0, 4096.0}) {
    const double within = t * 8 * 14.0 / 16 * 8192 / 389e9;
    const double across = t * 0.9969041357232079 * 8192 / 50e9;
    CHECK(two.ep_exchange_s(t) == Approx(19.9e-6 + std::max(within, across)).epsilon(1e-9));
  }
  // One node: the formula the roofline always had, 10 us + tokens x 8 x (P-1)/P rows at 389.
  const h200_step_model one = model_at(8, 1);
  CHECK(one.ep_exchange_s(32) == Approx(10e-6 + 32 * 8 * 7.0 / 8 * 8192 / 389e9).epsilon(1e-12));
}

TEST_CASE("the nodes a token's experts touch, against sampling") {
  std::mt19937_64 rng(testing::test_seed() + 1);
  for (const int nodes : {2, 4}) {
    const h200_step_model m = model_at(16, nodes);
    std::vector<int> experts(128);
    for (int e = 0; e < 128; ++e) experts[static_cast<size_t>(e)] = e;
    const int draws = 40'000;
    double other = 0;
    for (int i = 0; i < draws; ++i) {
      std::shuffle(experts.begin(), experts.end(), rng);  // the first 8: a token's experts
      std::set<int> touched;
      for (int k = 0; k < 8; ++k) touched.insert(experts[static_cast<size_t>(k)] / (128 / nodes));
      // The token lives on node 0 (any node: the experts are uniform).
      other += static_cast<double>(touched.size()) - (touched.count(0) ? 1 : 0);
    }
    INFO(nodes << " nodes");
    CHECK(other / draws == Approx(m.remote_nodes_per_token()).margin(0.02));
  }
}

TEST_CASE("the roofline at two nodes: EP's collectives cross, TP stays home") {
  const h200_step_model one = model_at(8, 1), two = model_at(16, 2);
  // An EP step of 512 sequences at 2,048 context on 16 ranks: 32 a rank, as 256 on 8.
  const double two_s = two.decode_step_s(k_ep, 512, 2048);
  const double one_s = one.decode_step_s(k_ep, 256, 2048);
  // The collectives differ by 188 x (25.127 - 14.717) us; the experts a rank reads: 8 whole
  // against 16 (touched at 256 / 512 tokens: all of them) over 4 TB/s.
  const double collectives = 188 * (two.ep_exchange_s(32) - one.ep_exchange_s(32));
  const double experts = two.experts_s(parallel_mode::ep, 512) - one.experts_s(parallel_mode::ep, 256);
  CHECK(experts == Approx(-94.0 * 8 * k_expert / 4e12).epsilon(1e-6));
  CHECK(two_s - one_s == Approx(collectives + experts).epsilon(1e-9));
  CHECK_THROWS_WITH(two.decode_step_s(k_tp, 64, 2048), Catch::Contains("TP attention stays"));
  // Cited: DeepEP across two nodes' dispatch and combine of the rank's 32 x 8 rows a layer.
  const h200_step_model cited = model_at(16, 2, collective_pricing::cited);
  const double rows = 32.0 * 8 * 4096 * 2;
  const double per_layer = collective_s(collective_kind::ep_dispatch, rows, 16) +
                           collective_s(collective_kind::ep_combine, rows, 16);
  CHECK(cited.decode_step_s(k_ep, 512, 2048) - two_s ==
        Approx(94 * per_layer - 188 * two.ep_exchange_s(32)).epsilon(1e-9));
  // Below the 128-token sizes: DeepEP's low-latency figures, 118 + 195 us a layer.
  CHECK(per_layer * 1e6 == Approx(118 + 195));
}

TEST_CASE("a one-node run repriced on two nodes, by hand") {
  const h200_step_model one = model_at(8, 1), two = model_at(16, 2);
  const node_pricing p{{2, 8}, &one, &two};
  run_result r;
  step_record ep_step;
  ep_step.config = k_ep;
  ep_step.sequences = 300;
  ep_step.decode_tokens = 300;
  ep_step.prefill_tokens = 100;
  ep_step.context_tokens = 600'000;
  step_record tp_step = ep_step;
  tp_step.config = k_tp;
  tp_step.mode = parallel_mode::tp;
  tp_step.sequences = tp_step.decode_tokens = 40;
  tp_step.prefill_tokens = 0;
  tp_step.context_tokens = 400'000;
  r.steps = {ep_step, tp_step};
  // A switch EP -> TP whose one-node price holds 10 ms of KV beyond its weights', one back
  // with none, and one refused.
  moebius::switch_report weights;
  weights.outcome = moebius::switch_outcome::committed;
  const double weights_ms = one.switch_s(weights) * 1e3;
  switch_record to_tp;
  to_tp.from = parallel_mode::ep;
  to_tp.to = parallel_mode::tp;
  to_tp.clock_ms = weights_ms + 10;
  switch_record to_ep = to_tp;
  to_ep.from = parallel_mode::tp;
  to_ep.to = parallel_mode::ep;
  to_ep.clock_ms = weights_ms;
  switch_record refused = to_ep;
  refused.outcome = moebius::switch_outcome::refused_capacity;
  refused.clock_ms = 0;
  r.switches = {to_tp, to_ep, refused};
  const repriced_run out = reprice_on_nodes(r, p);
  // Steps: EP on 16 ranks at twice everything; TP on one replica as on one node.
  step_cost ep2;
  ep2.set(k_ep);
  ep2.num_sequences = 600;
  ep2.new_tokens = 800;
  ep2.context_tokens = 1'200'000;
  step_cost tp1;
  tp1.set(k_tp);
  tp1.num_sequences = tp1.new_tokens = 40;
  tp1.context_tokens = 400'000;
  step_cost ep1 = ep2;
  ep1.num_sequences = 300;
  ep1.new_tokens = 400;
  ep1.context_tokens = 600'000;
  CHECK(out.nodes_steps_s == Approx(two.step_s(ep2, 0) + one.step_s(tp1, 0)).epsilon(1e-12));
  CHECK(out.one_node_steps_s == Approx(one.step_s(ep1, 0) + one.step_s(tp1, 0)).epsilon(1e-12));
  CHECK(out.decode_tokens == 340);
  CHECK(out.nodes_token_step_s ==
        Approx((two.step_s(ep2, 0) * 300 + one.step_s(tp1, 0) * 40) / 340).epsilon(1e-12));
  // Switches: the recorded one-node prices; on two nodes EP -> TP is bound by the NIC
  // (567.7 ms; the 10 ms of KV hide within), TP -> EP crosses nothing and carries the KV (none).
  CHECK(out.switches == 2);
  CHECK(out.one_node_switches_s == Approx((2 * weights_ms + 10) * 1e-3));
  const double across_ms = 28'387'049'472.0 / 50e6 + 94 * (19.9 + 5) * 1e-3 + 3.9;
  const double back_ms = 24'838'668'288.0 / 395e6 + 94 * 15e-3 + 3.9;
  moebius::switch_workload w;
  CHECK(switch_on_nodes_s(to_tp, p, &w) * 1e3 == Approx(across_ms).epsilon(1e-6));
  CHECK(w.kv_bytes_per_rank == Approx(10e-3 * 395e9).epsilon(1e-6));
  CHECK(switch_on_nodes_s(to_ep, p) * 1e3 == Approx(back_ms).epsilon(1e-6));
  CHECK(out.nodes_switches_s == Approx((across_ms + back_ms) * 1e-3).epsilon(1e-6));
  CHECK(out.nodes_s() == Approx(out.nodes_steps_s + out.nodes_switches_s));
  // The free-switch bound: each step in its faster layout.
  const free_switch_bounds b = free_switch_bounds_on_nodes(r, p);
  step_cost tp2 = ep2;
  tp2.set(k_tp);
  step_cost tp_of_tp = tp1, ep_of_tp = tp1;
  ep_of_tp.set(k_ep);
  step_cost ep_of_tp2 = ep_of_tp;
  ep_of_tp2.num_sequences *= 2;
  ep_of_tp2.new_tokens *= 2;
  ep_of_tp2.context_tokens *= 2;
  tp2.num_sequences = 300;
  tp2.new_tokens = 400;
  tp2.context_tokens = 600'000;
  CHECK(b.nodes_s == Approx(std::min(two.step_s(ep2, 0), one.step_s(tp2, 0)) +
                            std::min(two.step_s(ep_of_tp2, 0), one.step_s(tp_of_tp, 0)))
                         .epsilon(1e-12));
}

namespace {

// A clock standing for the measured one-node curves: a price nothing else computes.
class fake_curves final : public step_clock {
 public:
  double step_s(const step_cost& c, double) const override {
    return (c.mode == parallel_mode::ep ? 0.030 : 0.020) + 1e-5 * static_cast<double>(c.num_sequences) +
           1e-9 * static_cast<double>(c.context_tokens);
  }
  double switch_s(const moebius::switch_report&) const override { return 0; }
  const char* name() const override { return "fake curves"; }
  bool needs_measurement() const override { return false; }
};

}  // namespace

TEST_CASE("anchored on the one-node curves: the roofline prices only what two nodes change") {
  const h200_step_model one = model_at(8, 1), two = model_at(16, 2);
  const fake_curves curves;
  const node_pricing p{{2, 8}, &one, &two, &curves};
  step_record ep_step;
  ep_step.config = k_ep;
  ep_step.sequences = ep_step.decode_tokens = 200;
  ep_step.context_tokens = 300'000;
  ep_step.step_ms = 41.5;  // as the one-node run priced it
  step_record tp_step = ep_step;
  tp_step.config = k_tp;
  tp_step.mode = parallel_mode::tp;
  tp_step.step_ms = 37.25;
  auto cost = [](const configuration& c, int64_t copies, const step_record& s) {
    step_cost x;
    x.set(c);
    x.num_sequences = s.sequences * copies;
    x.new_tokens = s.decode_tokens * copies;
    x.context_tokens = s.context_tokens * copies;
    return x;
  };
  // Its own layout on one node: as recorded; on two nodes EP adds the roofline's difference.
  CHECK(step_on_s(ep_step, k_ep, p, false) == 41.5e-3);
  const double delta = two.step_s(cost(k_ep, 2, ep_step), 0) - one.step_s(cost(k_ep, 1, ep_step), 0);
  CHECK(step_on_s(ep_step, k_ep, p, true) == Approx(41.5e-3 + delta).epsilon(1e-12));
  CHECK(step_on_s(tp_step, k_tp, p, true) == 37.25e-3);
  // The other layout: the curves' price (the same shape), then the same difference for EP.
  CHECK(step_on_s(ep_step, k_tp, p, false) == Approx(0.020 + 2e-3 + 3e-4).epsilon(1e-12));
  CHECK(step_on_s(ep_step, k_tp, p, true) == Approx(0.020 + 2e-3 + 3e-4).epsilon(1e-12));
  CHECK(step_on_s(tp_step, k_ep, p, true) ==
        Approx(0.030 + 2e-3 + 3e-4 + delta).epsilon(1e-12));
  run_result r;
  r.steps = {ep_step, tp_step};
  const repriced_run out = reprice_on_nodes(r, p);
  CHECK(out.one_node_steps_s == Approx(78.75e-3));
  CHECK(out.nodes_steps_s == Approx(78.75e-3 + delta));
  const free_switch_bounds b = free_switch_bounds_on_nodes(r, p);
  CHECK(b.one_node_s == Approx(std::min(41.5e-3, 0.0223) + std::min(37.25e-3, 0.0323)));
}

TEST_CASE("bad parameters are refused, naming them") {
  priced_model m = qwen3_235b_a22b_priced();
  h200_params hw;
  hw.num_nodes = 0;
  CHECK_THROWS_WITH(h200_step_model(m, hw, 16, 1024, nullptr), Catch::Contains("num_nodes=0"));
  hw.num_nodes = 3;
  CHECK_THROWS_WITH(h200_step_model(m, hw, 16, 1024, nullptr),
                    Catch::Contains("num_nodes must be >= 1 and divide P (num_nodes=3, P=16)"));
  hw.num_nodes = 2;
  hw.internode = moebius::link_rate{};
  CHECK_THROWS_WITH(h200_step_model(m, hw, 16, 1024, nullptr), Catch::Contains("internode=0 GB/s"));
  hw.internode = moebius::link_rate::gb_per_s(50);
  hw.internode_collective_us = -1;
  CHECK_THROWS_WITH(h200_step_model(m, hw, 16, 1024, nullptr),
                    Catch::Contains("internode_collective_us=-1"));
  // One node ignores the internode fields.
  hw.num_nodes = 1;
  CHECK_NOTHROW(h200_step_model(m, hw, 8, 1024, nullptr));

  CHECK_THROWS_WITH(replica_switch_traffic({0, 8}, 128, k_expert, replica_switch::ep_to_tp),
                    Catch::Contains("num_nodes=0"));
  CHECK_THROWS_WITH(replica_switch_traffic({2, 8}, 120, k_expert, replica_switch::ep_to_tp),
                    Catch::Contains("P = 16 must divide num_experts (120)"));
  CHECK_THROWS_WITH(replica_switch_traffic({2, 8}, 128, 1001, replica_switch::ep_to_tp),
                    Catch::Contains("expert_bytes (1001)"));
  CHECK_THROWS_WITH(
      replica_switch_workload({2, 8}, 128, k_expert, 94, replica_switch::ep_to_tp, -5),
      Catch::Contains("kv_bytes_per_rank (-5)"));

  deployment_options o;
  o.num_ranks = 4;
  CHECK_THROWS_WITH(make_node_deployment(qwen3_235b_a22b(), {2, 8}, o),
                    Catch::Contains("num_ranks (4) must be ranks_per_node (8)"));
  CHECK_THROWS_WITH(make_node_deployment(qwen3_235b_a22b(), {0, 8}), Catch::Contains("num_nodes=0"));

  const h200_step_model one = model_at(8, 1), two = model_at(16, 2);
  CHECK_THROWS_WITH(reprice_on_nodes(run_result{}, node_pricing{{2, 8}, &one, nullptr}),
                    Catch::Contains("both models"));
  CHECK_THROWS_WITH(reprice_on_nodes(run_result{}, node_pricing{{2, 8}, &two, &one}),
                    Catch::Contains("need a one-node model of P = 8"));
  run_result progressive;
  switch_record sw;
  sw.from = parallel_mode::ep;
  sw.to = parallel_mode::tp;
  sw.progressive = true;
  progressive.switches = {sw};
  CHECK_THROWS_WITH(reprice_on_nodes(progressive, node_pricing{{2, 8}, &one, &two}),
                    Catch::Contains("progressive switch"));
  run_result dcp;
  step_record st;
  st.config = k_tp_dcp2;
  dcp.steps = {st};
  CHECK_THROWS_WITH(reprice_on_nodes(dcp, node_pricing{{2, 8}, &one, &two}),
                    Catch::Contains("is not repriced (TP or EP)"));
}
