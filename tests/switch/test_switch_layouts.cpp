// Attention and experts as two layouts (layout/parallel_layout.hpp): a switch of the experts
// alone moves no KV byte and leaves the tables as they were, in both styles, and puts the
// experts exactly where the independent reference loads them; a fault in it rolls back
// exactly; a switch of the attention alone moves no expert and runs stop-the-world only.
// Random worlds: P in {1, 2, 4}, random expert shapes and KV geometries (with a KV-parallel
// degree when the TP view allows one), EP sequences at 30-60% of the pool.

#include <random>
#include <string>

#include "moebius/error.hpp"
#include "moebius/switch/switcher.hpp"
#include "moebius/transport/host_transport.hpp"
#include "support/catch.hpp"
#include "support/reference.hpp"
#include "switch_world.hpp"

using namespace moebius;
using namespace moebius::testing;

namespace {

world random_world(std::mt19937_64& rng) {
  const int P = 1 << std::uniform_int_distribution<int>(0, 2)(rng);
  const double occupancy = std::uniform_real_distribution<double>(0.3, 0.6)(rng);
  // A KV-parallel degree makes the TP view hold what EP holds; without it TP may refuse.
  if (P > 1 && (rng() & 1)) return make_dcp_world(rng, P, occupancy, /*same_layers=*/true);
  return make_world(rng, P, occupancy, /*same_layers=*/true);
}

// Runs a switch of the experts alone to `experts` (stop the world, or progressive with random
// advances) and checks every claim about it; `w` holds the arenas and pools `sw` moves.
void switch_experts_alone(switcher& sw, world& w, parallel_mode experts, bool progressive,
                          std::mt19937_64& rng) {
  const parallel_layout from = sw.layout();
  const parallel_layout to{from.attention, experts};
  const kv_state tables_before = sw.kv_tables();
  const rank_images pools_before = w.pools;
  const switch_plan p = sw.plan(to);
  INFO(p);
  CHECK(p.moves_experts());
  CHECK_FALSE(p.moves_kv());
  REQUIRE(p.capacity.fits);
  CHECK(p.capacity.rounds == 0);
  REQUIRE(p.kv);
  CHECK(p.kv->copies.phases.empty());
  CHECK(p.kv->new_state == tables_before);
  REQUIRE(p.layer_capacity.fits);
  CHECK(sum(p.bytes_per_layer.kv_bytes_sent) == 0);
  CHECK((sum(p.bytes_per_layer.weight_bytes_sent) > 0 || w.kv.num_ranks == 1));

  switch_report r;
  if (!progressive) {
    r = sw.switch_to(p);
  } else {
    progressive_switch s = sw.begin(p);
    REQUIRE(s.open());
    const int64_t L = w.shape.num_layers;
    while (s.layers_remaining() > 0) {
      s.advance(std::uniform_int_distribution<int64_t>(1, L)(rng));
      s.wait();
      const switch_step_view v = s.view();
      CHECK_FALSE(v.moves_kv());
      for (int64_t l = 0; l < L; ++l) {
        // One set of tables for every layer; the attention stays where it rests.
        CHECK(&v.tables_of_layer(l) == &v.tables_of_layer(0));
        CHECK(v.tables_of_layer(l) == tables_before);
        CHECK(v.layout_of(l) == parallel_layout{from.attention, v.mode_of(l)});
      }
    }
    r = s.finish();
  }
  INFO(r);
  REQUIRE(r.outcome == switch_outcome::committed);
  CHECK(r.from == from);
  CHECK(r.to == to);
  CHECK(r.kv_rounds == 0);
  CHECK(sum(r.kv_bytes_sent) == 0);
  CHECK(sw.layout() == to);
  CHECK(sw.kv_tables() == tables_before);
  // No KV byte written: every byte of every pool, free pages included.
  CHECK(w.pools == pools_before);
  // The experts where the reference loads them at the new cursor (every byte of every
  // occupied slot; the free slot may hold anything).
  CHECK(compare_to_reference(w.logical, w.weights, sw.cursor(), w.arenas,
                             padding_rule::end_slots_unknown) == "");
}

}  // namespace

TEST_CASE("experts alone: no KV byte moves, the experts land where the reference puts them",
          "[switch][layout]") {
  std::mt19937_64 rng(test_seed());
  for (int iter = 0; iter < 24; ++iter) {
    world w = random_world(rng);
    INFO("iter " << iter << " " << w.shape << " " << w.kv);
    host_transport t(w.memory);
    switcher sw(w.weights, w.kv, t, w.tables, arena_cursor{0});
    REQUIRE(sw.layout() == parallel_layout(parallel_mode::ep));
    // Half the worlds first move the attention alone to TP (stop the world), when TP holds it.
    if ((rng() & 1) && sw.check(parallel_layout{parallel_mode::tp, parallel_mode::ep}).fits) {
      const rank_images arenas_before = w.arenas;
      const uint64_t kv_before = kv_checksum(w.kv, sw.kv_tables(), w.pool_spans());
      const switch_report a = sw.switch_to(parallel_layout{parallel_mode::tp, parallel_mode::ep});
      INFO(a);
      REQUIRE(a.outcome == switch_outcome::committed);
      CHECK(a.weight_phases == 0);
      CHECK(sum(a.weight_bytes_sent) == 0);
      CHECK(sw.cursor() == arena_cursor{0});
      CHECK(sw.kv_tables().mode == parallel_mode::tp);
      // Every sequence's K/V, read through the new tables, is what it was.
      CHECK(kv_checksum(w.kv, sw.kv_tables(), w.pool_spans()) == kv_before);
      // The experts stay: every occupied slot byte for byte (KV staged in the free slot).
      CHECK(arena_diff(w, arenas_before, w.arenas, arena_geometry::free_slot(sw.cursor())) == "");
    }
    const bool progressive = rng() & 1;
    switch_experts_alone(sw, w, parallel_mode::tp, progressive, rng);
    switch_experts_alone(sw, w, parallel_mode::ep, !progressive, rng);
  }
}

TEST_CASE("experts alone: a fault at any phase rolls back exactly", "[switch][layout]") {
  std::mt19937_64 rng(test_seed() + 1);
  for (int iter = 0; iter < 12; ++iter) {
    world w = random_world(rng);
    INFO("iter " << iter << " " << w.shape << " " << w.kv);
    host_transport t(w.memory);
    switcher sw(w.weights, w.kv, t, w.tables, arena_cursor{0});
    if (!sw.check(parallel_layout{parallel_mode::tp, parallel_mode::ep}).fits) continue;
    REQUIRE(sw.switch_to(parallel_layout{parallel_mode::tp, parallel_mode::ep}).outcome ==
            switch_outcome::committed);
    const rank_images arenas = w.arenas, pools = w.pools;
    const kv_state tables = sw.kv_tables();
    const bool progressive = rng() & 1;
    const int64_t L = w.shape.num_layers;
    const int64_t phase = std::uniform_int_distribution<int64_t>(0, L - 1)(rng);
    sw.inject_fault(switch_fault{switch_fault::stage::weights, fault_point{phase, 0}});
    // One advance of every layer: the fault's phase is then the layer it hits (one weight
    // phase a layer, no KV round), as in the stop-the-world weight plan.
    const switch_report r = run_switch(sw, parallel_mode::tp, progressive, L);
    INFO(r);
    REQUIRE(r.outcome == switch_outcome::rolled_back);
    CHECK(sw.layout() == parallel_layout{parallel_mode::tp, parallel_mode::ep});
    CHECK(sw.cursor() == arena_cursor{0});
    CHECK(sw.kv_tables() == tables);
    CHECK(w.pools == pools);
    CHECK(arena_diff(w, arenas, w.arenas, arena_geometry::free_slot(arena_cursor{0})) == "");
    // And the switcher still switches.
    CHECK(sw.switch_to(parallel_mode::tp).outcome == switch_outcome::committed);
  }
}

TEST_CASE("attention alone: stop the world only; a progressive begin is refused by name",
          "[switch][layout]") {
  std::mt19937_64 rng(test_seed() + 2);
  world w = make_dcp_world(rng, 2, 0.4, /*same_layers=*/true);
  host_transport t(w.memory);
  switcher sw(w.weights, w.kv, t, w.tables, arena_cursor{0});
  const parallel_layout tep{parallel_mode::tp, parallel_mode::ep};
  const switch_plan p = sw.plan(tep);
  CHECK(p.moves_kv());
  CHECK_FALSE(p.moves_experts());
  CHECK_FALSE(p.layer_capacity.fits);
  CHECK_THAT(p.layer_capacity.reason, Catch::Contains("switch_to"));
  CHECK(p.weights->phases.empty());
  try {
    (void)sw.begin(p);
    FAIL("expected an error");
  } catch (const moebius::error& e) {
    CHECK(e.code() == errc::invalid_argument);
    CHECK_THAT(std::string(e.what()), Catch::Contains("stop-the-world"));
  }
  CHECK_FALSE(sw.in_progress());
  CHECK(sw.switch_to(p).outcome == switch_outcome::committed);
  CHECK(sw.layout() == tep);
  CHECK(std::string(to_string(sw.layout())) == "TP attention, EP experts");
}

TEST_CASE("parallel_layout: a mode names its uniform layout", "[layout]") {
  static_assert(parallel_layout(parallel_mode::tp) ==
                parallel_layout{parallel_mode::tp, parallel_mode::tp});
  static_assert(parallel_layout{parallel_mode::tp, parallel_mode::ep}.attention == parallel_mode::tp);
  static_assert(!parallel_layout{parallel_mode::ep, parallel_mode::tp}.uniform());
  CHECK(std::string(to_string(parallel_layout(parallel_mode::ep))) == "EP");
  CHECK(std::string(to_string(parallel_layout{parallel_mode::ep, parallel_mode::tp})) ==
        "DP attention, TP experts");
  CHECK_FALSE(is_valid(parallel_layout{static_cast<parallel_mode>(5), parallel_mode::ep}));
}
