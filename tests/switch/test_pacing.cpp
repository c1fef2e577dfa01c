// Pacing of a progressive switch: the worked example of pacing.hpp on the real Qwen3-30B-A3B
// arena geometry, layers_per_step against a brute-force search over random parameters, and
// the per-layer bytes against the whole switch's plans (L layers move L times one layer).
#include <algorithm>
#include <cmath>
#include <random>

#include "moebius/error.hpp"
#include "moebius/plan/plan.hpp"
#include "moebius/plan/weight_plan.hpp"
#include "moebius/switch/pacing.hpp"
#include "support/catch.hpp"
#include "switch_world.hpp"

namespace {

using namespace moebius;

expert_shape qwen3_30b_a3b() {
  expert_shape s;
  s.num_layers = 48;
  s.num_experts = 128;
  s.hidden = 2048;
  s.intermediate = 768;
  return s;
}

}  // namespace

TEST_CASE("pacing: the worked example (Qwen3-30B-A3B, P=2, 389 GB/s x 55%, 10 ms)", "[cpu]") {
  const arena_geometry g = make_arena_geometry(qwen3_30b_a3b(), 2);
  kv_geometry kv = make_kv_geometry(48, 4, 128, 16, 64, 2);
  kv_state empty = make_kv_state(kv, parallel_mode::ep, {{}, {}});
  for (parallel_mode target : {parallel_mode::tp, parallel_mode::ep}) {
    if (target == parallel_mode::ep) empty = make_kv_state(kv, parallel_mode::tp, {{}, {}});
    const layer_bytes b = switch_layer_bytes(g, kv, empty, target);
    CHECK(b.weight_bytes_sent == std::vector<int64_t>{301'989'888, 301'989'888});
    CHECK(b.kv_bytes_sent == std::vector<int64_t>{0, 0});
    CHECK(b.busiest() == 301'989'888);
    pacing_params p;
    p.step_s = 0.010;
    p.link = link_rate::gb_per_s(389);
    p.link_fraction = 0.55;
    p.bytes_per_layer = b.busiest();
    CHECK(layers_per_step(p) == 7);
    CHECK(std::abs(copy_seconds(p, 7) - 9.88e-3) < 0.01e-3);
    CHECK(layers_per_step(p, 5) == 5);  // capped by what is left
  }
}

TEST_CASE("pacing: layers_per_step is the most layers whose bytes fit the step, at least 1",
          "[cpu]") {
  std::mt19937_64 rng(0x9ac1);
  for (int trial = 0; trial < 2000; ++trial) {
    pacing_params p;
    p.step_s = std::uniform_real_distribution<double>(1e-4, 0.05)(rng);
    p.link = link_rate{std::uniform_real_distribution<double>(1e9, 900e9)(rng)};
    p.link_fraction = std::uniform_real_distribution<double>(0.01, 1.0)(rng);
    p.bytes_per_layer = std::uniform_int_distribution<int64_t>(1, int64_t{2} << 30)(rng);
    const int64_t cap = std::uniform_int_distribution<int64_t>(1, 200)(rng);
    // Brute force: count layers while the next one still fits in the budget.
    const double budget = p.step_s * p.link.bytes_per_s * p.link_fraction;
    int64_t n = 0;
    while (n < cap && static_cast<double>(n + 1) * static_cast<double>(p.bytes_per_layer) <= budget)
      ++n;
    n = std::max<int64_t>(n, 1);
    INFO("trial " << trial << " budget " << budget << " bytes " << p.bytes_per_layer);
    REQUIRE(layers_per_step(p, cap) == n);
    // The paced copies fit the step unless a single layer is already too big.
    if (static_cast<double>(p.bytes_per_layer) <= budget)
      REQUIRE(copy_seconds(p, n) <= p.step_s * (1 + 1e-12));
  }
  pacing_params zero{0.01, link_rate::gb_per_s(389), 0.5, 0};
  CHECK(layers_per_step(zero, 48) == 48);
}

TEST_CASE("pacing: bad parameters throw invalid_argument", "[cpu]") {
  const pacing_params good{0.01, link_rate::gb_per_s(389), 0.55, 1000};
  auto throws = [](pacing_params p, int64_t cap = 10) {
    try {
      layers_per_step(p, cap);
    } catch (const error& e) {
      return e.code() == errc::invalid_argument;
    }
    return false;
  };
  CHECK_FALSE(throws(good));
  pacing_params p = good;
  p.step_s = 0;
  CHECK(throws(p));
  p = good;
  p.link = link_rate{-1};
  CHECK(throws(p));
  p = good;
  p.link_fraction = 0;
  CHECK(throws(p));
  p.link_fraction = 1.5;
  CHECK(throws(p));
  p = good;
  p.bytes_per_layer = -1;
  CHECK(throws(p));
  CHECK(throws(good, 0));
}

TEST_CASE("pacing: L layers of switch_layer_bytes are the whole switch's bytes", "[cpu]") {
  std::mt19937_64 rng(0x5eed7);
  for (int trial = 0; trial < 40; ++trial) {
    const int P = std::array<int, 3>{2, 4, 8}[static_cast<size_t>(trial % 3)];
    testing::world w = testing::make_world(rng, P, 0.8 / P, /*same_layers=*/true);
    const int64_t L = w.shape.num_layers;
    INFO("trial " << trial << " P " << P << " L " << L);
    // EP -> TP from the world's EP tables, and TP -> EP from the tables the migration makes.
    const layer_bytes to_tp = switch_layer_bytes(w.weights, w.kv, w.tables, parallel_mode::tp);
    const plan_traffic wt = traffic_of(plan_weight_switch(w.weights, {0}, {L}));
    const kv_migration kt = plan_kv_migration(w.kv, w.tables, parallel_mode::tp);
    const plan_traffic kvt = traffic_of(kt.copies);
    for (int r = 0; r < P; ++r) {
      REQUIRE(to_tp.weight_bytes_sent[static_cast<size_t>(r)] * L ==
              wt.bytes_sent[static_cast<size_t>(r)]);
      REQUIRE(to_tp.kv_bytes_sent[static_cast<size_t>(r)] * L ==
              kvt.bytes_sent[static_cast<size_t>(r)]);
    }
    int64_t busiest = 0;
    for (int r = 0; r < P; ++r)
      busiest = std::max(busiest, (wt.bytes_sent[static_cast<size_t>(r)] +
                                   kvt.bytes_sent[static_cast<size_t>(r)]) / L);
    CHECK(to_tp.busiest() == busiest);
    const layer_bytes to_ep = switch_layer_bytes(w.weights, w.kv, kt.new_state, parallel_mode::ep);
    const plan_traffic we = traffic_of(plan_weight_switch(w.weights, {L}, {0}));
    for (int r = 0; r < P; ++r)
      REQUIRE(to_ep.weight_bytes_sent[static_cast<size_t>(r)] * L ==
              we.bytes_sent[static_cast<size_t>(r)]);
  }
}
