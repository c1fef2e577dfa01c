// Switch cost model: hand-computed predictions, the paper's anchor, the workload of a real
// weight plan, and least-squares recovery of a synthetic bandwidth and fixed overhead.

#include <algorithm>
#include <cmath>
#include <random>
#include <sstream>
#include <string>

#include "moebius/error.hpp"
#include "moebius/layout/arena_geometry.hpp"
#include "moebius/plan/weight_plan.hpp"
#include "moebius/policy/cost_model.hpp"
#include "policy_seed.hpp"
#include "support/catch.hpp"

using namespace moebius;
using moebius::testing::policy_test_seed;

TEST_CASE("cost_model: paper anchor, 50 GB at 330 GB/s", "[cost_model]") {
  link_params l;
  l.bandwidth = link_rate::gb_per_s(330);
  l.barrier_us = 0;
  l.launch_us = 0;
  const cost_model m(l);
  switch_workload w;
  w.num_ranks = 8;
  w.weight_bytes_per_rank = 50'000'000'000;
  CHECK(m.predict(w).total_ms() == Catch::Approx(151.515151).epsilon(1e-6));

  // Qwen3-235B at P=8: 7/8 of 94 slots of 603,979,776 B leave each rank.
  const arena_geometry g = make_arena_geometry(qwen3_235b_a22b(), 8);
  const switch_workload q = weight_switch_workload(g, 94);
  CHECK(q.weight_bytes_per_rank == 49'677'336'576);
  CHECK(q.weight_phases == 94);
  CHECK(q.kv_bytes_per_rank == 0);
  // 49.68 GB / 330 GB/s = 150.54 ms; + 94 · (10 + 5) us with the default link.
  const switch_cost c = cost_model{}.predict(q);
  CHECK(c.weight_ms == Catch::Approx(49'677'336'576.0 / 330e6));
  CHECK(c.barrier_ms == Catch::Approx(0.94));
  CHECK(c.launch_ms == Catch::Approx(0.47));
  CHECK(c.total_ms() == Catch::Approx(150.537 + 1.41).epsilon(1e-4));
  CHECK(weight_switch_workload(g, 10).weight_bytes_per_rank == int64_t{10} * 528'482'304);
}

TEST_CASE("cost_model: workload of a built plan equals the analytic one", "[cost_model]") {
  const arena_geometry g = make_arena_geometry(qwen3_235b_a22b(), 8);
  const plan ep_to_tp = plan_weight_switch(g, {0}, {94});
  const plan tp_to_ep = plan_weight_switch(g, {94}, {0});
  for (const plan* p : {&ep_to_tp, &tp_to_ep}) {
    const switch_workload w = workload_of(*p);
    CHECK(w.num_ranks == 8);
    CHECK(w.weight_bytes_per_rank == weight_switch_workload(g, 94).weight_bytes_per_rank);
    CHECK(w.weight_phases == 94);
    CHECK(w.kv_rounds == 0);
  }
  const plan half = plan_weight_switch(g, {0}, {40});
  CHECK(workload_of(half).weight_bytes_per_rank ==
        weight_switch_workload(g, 40).weight_bytes_per_rank);

  // KV phases count as rounds, local copies are not traffic.
  plan kv;
  kv.num_ranks = 2;
  copy_op op;
  op.row_bytes = 1000;
  op.src_pitch = op.dst_pitch = 1000;
  op.src_space = op.dst_space = memory_space::kv_pool;
  op.src_rank = 0;
  op.dst_rank = 1;
  copy_op local = op;
  local.dst_rank = 0;
  local.row_bytes = 7777;
  kv.phases.push_back({"kv round 0", {op, op, local}});
  kv.phases.push_back({"kv round 1", {op}});
  const switch_workload kw = workload_of(kv);
  CHECK(kw.kv_bytes_per_rank == 3000);
  CHECK(kw.weight_bytes_per_rank == 0);
  CHECK(kw.kv_rounds == 2);
  CHECK(kw.weight_phases == 0);
}

TEST_CASE("cost_model: hand-computed breakdown", "[cost_model]") {
  link_params l;
  l.bandwidth = link_rate::gb_per_s(400);
  l.kv_bandwidth = link_rate::gb_per_s(200);
  l.barrier_us = 10;
  l.launch_us = 5;
  l.fixed_ms = 2;
  const cost_model m(l);
  switch_workload w;
  w.num_ranks = 8;
  w.weight_bytes_per_rank = 4'000'000'000;  // 10 ms at 400 GB/s
  w.kv_bytes_per_rank = 1'000'000'000;      // 5 ms at 200 GB/s
  w.weight_phases = 10;
  w.kv_rounds = 3;
  const switch_cost c = m.predict(w);
  CHECK(c.weight_ms == Catch::Approx(10.0));
  CHECK(c.kv_ms == Catch::Approx(5.0));
  CHECK(c.barrier_ms == Catch::Approx(0.13));
  CHECK(c.launch_ms == Catch::Approx(0.065));
  CHECK(c.fixed_ms == Catch::Approx(2.0));
  CHECK(c.total_ms() == Catch::Approx(17.195));
  std::ostringstream os;
  os << c;
  CHECK_THAT(os.str(), Catch::StartsWith("total 17.195 ms = weights 10 + kv 5"));
}

TEST_CASE("cost_model: fit recovers a synthetic bandwidth and fixed overhead", "[cost_model]") {
  std::mt19937_64 rng(policy_test_seed() + 20);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  for (int trial = 0; trial < 20; ++trial) {
    link_params truth;
    truth.bandwidth = link_rate::gb_per_s(100 + 300 * u(rng));
    truth.kv_bandwidth =
        link_rate{trial % 2 ? 0.0 : truth.bandwidth.bytes_per_s * (0.5 + 0.5 * u(rng))};
    truth.barrier_us = 10;
    truth.launch_us = 5;
    truth.fixed_ms = 0.1 + 5 * u(rng);
    const cost_model oracle(truth);

    link_params start = truth;  // known barrier/launch and bw ratio, wrong bw and fixed
    start.bandwidth = link_rate::gb_per_s(330);
    if (truth.kv_bandwidth.bytes_per_s > 0) {
      start.kv_bandwidth = link_rate::gb_per_s(330 * truth.kv_bandwidth.bytes_per_s /
                                               truth.bandwidth.bytes_per_s);
    }
    start.fixed_ms = 0;
    cost_model exact(start), noisy(start);
    std::normal_distribution<double> noise(0.0, 0.005);
    for (int i = 0; i < 12; ++i) {
      switch_workload w;
      w.num_ranks = 8;
      w.weight_bytes_per_rank = static_cast<int64_t>(1e8 + 5e10 * u(rng));
      w.kv_bytes_per_rank = static_cast<int64_t>(2e10 * u(rng));
      w.weight_phases = 1 + static_cast<int64_t>(93 * u(rng));
      w.kv_rounds = static_cast<int64_t>(4 * u(rng));
      const double t = oracle.predict(w).total_ms();
      REQUIRE(exact.update({w, t}).ok);
      noisy.update({w, t * (1 + noise(rng))});
    }
    INFO("truth " << truth << ", fitted " << exact.link());
    CHECK(exact.link().bandwidth.gb_per_s() ==
          Catch::Approx(truth.bandwidth.gb_per_s()).epsilon(1e-6));
    CHECK(exact.link().effective_kv_bandwidth().gb_per_s() ==
          Catch::Approx(truth.effective_kv_bandwidth().gb_per_s()).epsilon(1e-6));
    CHECK(exact.link().fixed_ms == Catch::Approx(truth.fixed_ms).margin(1e-6));
    const cost_fit_result fr = noisy.refit();
    INFO("noisy fit " << noisy.link());
    if (fr.ok) {
      CHECK(noisy.link().bandwidth.gb_per_s() ==
            Catch::Approx(truth.bandwidth.gb_per_s()).epsilon(0.03));
    } else {
      CHECK(std::string(fr.why).find("negative fixed") != std::string::npos);  // fixed ~ 0
    }
  }
}

TEST_CASE("cost_model: degenerate fits keep the link", "[cost_model]") {
  link_params l;
  l.barrier_us = 0;
  l.launch_us = 0;
  cost_model m(l);
  CHECK_FALSE(m.refit().ok);  // no measurements
  switch_workload small, big;
  small.weight_bytes_per_rank = 1'000'000'000;
  big.weight_bytes_per_rank = 10'000'000'000;
  // One byte count: bandwidth only (fixed 0 kept): 1 GB in 5 ms -> 200 GB/s.
  REQUIRE(m.update({small, 5.0}).ok);
  CHECK(m.link().bandwidth.gb_per_s() == Catch::Approx(200.0));
  CHECK(m.link().fixed_ms == 0.0);
  // More bytes in less time: no positive bandwidth fits; the link stays.
  const cost_fit_result r = m.update({big, 1.0});
  CHECK_FALSE(r.ok);
  CHECK_THAT(std::string(r.why), Catch::Contains("non-positive bandwidth"));
  CHECK(m.link().bandwidth.gb_per_s() == Catch::Approx(200.0));
  std::ostringstream os;
  m.report(os);
  CHECK_THAT(os.str(), Catch::Contains("10000000000"));
  CHECK_THROWS_AS(m.update({big, -1.0}), moebius::error);
  link_params bad;
  bad.bandwidth = link_rate{0};
  CHECK_THROWS_AS(cost_model(bad), moebius::error);
  switch_workload neg;
  neg.kv_rounds = -1;
  CHECK_THROWS_AS(cost_model{}.predict(neg), moebius::error);
  const arena_geometry g = make_arena_geometry(qwen3_235b_a22b(), 8);
  CHECK_THROWS_AS(weight_switch_workload(g, 95), moebius::error);
}

TEST_CASE("cost_model: copies across nodes beside copies within, by hand", "[cost_model]") {
  std::mt19937_64 rng(policy_test_seed() + 31);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  for (int trial = 0; trial < 50; ++trial) {
    link_params l;
    l.bandwidth = link_rate::gb_per_s(100 + 400 * u(rng));
    l.internode = link_rate::gb_per_s(10 + 90 * u(rng));
    l.barrier_us = 10 * u(rng);
    l.internode_barrier_us = trial % 5 == 0 ? 0.0 : 5 + 30 * u(rng);
    l.launch_us = 5 * u(rng);
    l.fixed_ms = 4 * u(rng);
    switch_workload w;
    w.num_ranks = 16;
    w.weight_bytes_per_rank = static_cast<int64_t>(3e10 * u(rng));
    w.kv_bytes_per_rank = static_cast<int64_t>(1e10 * u(rng));
    w.internode_bytes_per_rank = 1 + static_cast<int64_t>(3e10 * u(rng));
    w.weight_phases = 1 + static_cast<int64_t>(93 * u(rng));
    w.kv_rounds = static_cast<int64_t>(4 * u(rng));
    const switch_cost c = cost_model(l).predict(w);
    // By hand: the longer of the two links' copies, every barrier across the nodes.
    const double within = static_cast<double>(w.weight_bytes_per_rank) / l.bandwidth.bytes_per_s +
                          static_cast<double>(w.kv_bytes_per_rank) / l.bandwidth.bytes_per_s;
    const double across = static_cast<double>(w.internode_bytes_per_rank) / l.internode.bytes_per_s;
    const double barrier = l.internode_barrier_us > 0 ? l.internode_barrier_us : l.barrier_us;
    const double syncs = static_cast<double>(w.weight_phases + w.kv_rounds);
    const double expect_ms = std::max(within, across) * 1e3 +
                             syncs * (barrier + l.launch_us) * 1e-3 + l.fixed_ms;
    INFO("link " << l << ", cost " << c);
    CHECK(c.total_ms() == Catch::Approx(expect_ms).epsilon(1e-12));
    CHECK(c.internode_ms == Catch::Approx(std::max(0.0, across - within) * 1e3).margin(1e-9));
    CHECK(c.barrier_ms == Catch::Approx(syncs * barrier * 1e-3).margin(1e-12));
    // Nothing across: the one-node price, whatever the internode link.
    switch_workload one_node = w;
    one_node.internode_bytes_per_rank = 0;
    link_params no_nic = l;
    no_nic.internode = link_rate{};
    CHECK(cost_model(l).predict(one_node).total_ms() ==
          Catch::Approx(cost_model(no_nic).predict(one_node).total_ms()).epsilon(1e-15));
    CHECK(cost_model(l).predict(one_node).internode_ms == 0);
  }
}

TEST_CASE("cost_model: EP16 -> TP8 x 2 of Qwen3-235B over NDR InfiniBand", "[cost_model]") {
  // Each rank's 8 experts a layer (8 x 37,748,736 B) go whole to the other node and 7/8 of
  // them to its own node's 7 peers, every one of 94 layers.
  link_params l;
  l.bandwidth = link_rate::gb_per_s(395);
  l.internode = link_rate::gb_per_s(50);
  l.barrier_us = 10;
  l.internode_barrier_us = 19.9;
  l.launch_us = 5;
  l.fixed_ms = 3.9;
  switch_workload w;
  w.num_ranks = 16;
  w.weight_bytes_per_rank = 94 * int64_t{264'241'152};
  w.internode_bytes_per_rank = 94 * int64_t{301'989'888};
  w.weight_phases = 94;
  const switch_cost c = cost_model(l).predict(w);
  CHECK(w.internode_bytes_per_rank == 28'387'049'472);
  // 28,387,049,472 B / 50 GB/s = 567.74 ms; within: 62.88 ms, run beside it.
  CHECK(c.weight_ms == Catch::Approx(62.8827).epsilon(1e-5));
  CHECK(c.weight_ms + c.internode_ms == Catch::Approx(567.741).epsilon(1e-5));
  CHECK(c.barrier_ms == Catch::Approx(94 * 19.9e-3));
  CHECK(c.total_ms() == Catch::Approx(567.741 + 94 * 24.9e-3 + 3.9).epsilon(1e-5));
  std::ostringstream os;
  os << c << " " << l;
  CHECK_THAT(os.str(), Catch::Contains("+ internode 504.8"));
  CHECK_THAT(os.str(), Catch::Contains("internode 50 GB/s, barrier 19.9 us"));
}

TEST_CASE("cost_model: refuses what it cannot price across nodes", "[cost_model]") {
  switch_workload w;
  w.num_ranks = 16;
  w.internode_bytes_per_rank = 1'000'000;
  // No internode rate: the bytes that cross have no link.
  CHECK_THROWS_WITH(cost_model{}.predict(w), Catch::Contains("internode_bytes=1000000"));
  link_params l;
  l.internode = link_rate::gb_per_s(50);
  cost_model m(l);
  CHECK(m.predict(w).total_ms() > 0);
  // The fit is of the in-node link: a measurement that crossed nodes is refused, untouched.
  CHECK_THROWS_WITH(m.update({w, 10.0}), Catch::Contains("cross nodes"));
  CHECK(m.measurements().empty());
  w.internode_bytes_per_rank = -1;
  CHECK_THROWS_WITH(m.predict(w), Catch::Contains("internode_bytes=-1"));
  for (const double bad : {-1.0, std::nan(""), HUGE_VAL}) {
    link_params b;
    b.internode = link_rate{bad * 1e9};
    CHECK_THROWS_WITH(cost_model(b), Catch::Contains("internode bandwidth"));
    link_params c;
    c.internode_barrier_us = bad;
    CHECK_THROWS_WITH(cost_model(c), Catch::Contains("internode_barrier_us"));
  }
}
