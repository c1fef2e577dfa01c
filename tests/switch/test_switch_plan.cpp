// A switch planned once (switcher::plan, switch/switch_plan.hpp) on the host transport: running
// the plan is switch_to(target) byte for byte, its bytes per layer are what each advance of a
// progressive switch sends, and a stale plan (tables handed out, a switch in between, another
// switcher, another target) is refused by name and moves nothing.
#include <random>
#include <span>
#include <string>
#include <vector>

#include "moebius/error.hpp"
#include "moebius/kv/page_table.hpp"
#include "moebius/plan/plan.hpp"
#include "moebius/switch/switch_plan.hpp"
#include "moebius/switch/switcher.hpp"
#include "moebius/transport/host_transport.hpp"
#include "layout/error_matchers.hpp"
#include "support/catch.hpp"
#include "support/reference.hpp"

#include "forwarding_transport.hpp"
#include "switch_world.hpp"

namespace {

using namespace moebius;
using namespace moebius::testing;

// host_transport that keeps, per plan enqueued, the bytes each rank sent (traffic_of).
class counting_transport final : public forwarding_transport {
 public:
  using forwarding_transport::forwarding_transport;
  void enqueue(const plan& p, std::span<const stream_handle> streams) override {
    sent.push_back(traffic_of(p).bytes_sent);
    sent.back().resize(static_cast<size_t>(num_ranks()), 0);
    inner_.enqueue(p, streams);
  }

  std::vector<std::vector<int64_t>> sent;  // [plan enqueued][rank]
};

bool mentions(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

parallel_mode other(parallel_mode m) {
  return m == parallel_mode::ep ? parallel_mode::tp : parallel_mode::ep;
}

}  // namespace

TEST_CASE("a plan made once and run is switch_to(target), byte for byte", "[switch][plan]") {
  const uint64_t seed = testing::test_seed();
  std::mt19937_64 rng(seed);
  for (const int P : {1, 2, 4, 8, 1, 2, 4, 8}) {
    std::mt19937_64 twin = rng;  // the same draws for both worlds
    world a = make_world(rng, P, 0.3);
    world b = make_world(twin, P, 0.3);
    INFO("seed " << seed << " P=" << P << " " << a.shape << " " << a.kv);
    host_transport ta(a.memory), tb(b.memory);
    switcher planned(a.weights, a.kv, ta, a.tables, arena_cursor{0});
    switcher direct(b.weights, b.kv, tb, b.tables, arena_cursor{0});
    for (const parallel_mode target : {parallel_mode::tp, parallel_mode::ep}) {
      const switch_plan p = planned.plan(target);
      INFO(p);
      CHECK(p.capacity.fits == planned.check(target).fits);
      CHECK(p.capacity.rounds == planned.check(target).rounds);
      const switch_report ra = planned.switch_to(p);
      const switch_report rb = direct.switch_to(target);
      INFO(ra << "\n" << rb);
      CHECK(moves_diff(ra, rb) == "");
      CHECK(ra.cursor == rb.cursor);
      CHECK(ra.kv_stats.pages_moved == rb.kv_stats.pages_moved);
      CHECK(ra.kv_stats.bytes_copied == rb.kv_stats.bytes_copied);
      CHECK(planned.kv_tables() == direct.kv_tables());
      CHECK(a.arenas == b.arenas);
      CHECK(a.pools == b.pools);
      if (ra.outcome != switch_outcome::committed) break;  // refused: both stay in EP
      if (target == parallel_mode::tp) {
        CHECK(ra.weight_phases == static_cast<int64_t>(p.weights->phases.size()));
        CHECK(ra.kv_rounds == p.capacity.rounds);
      }
    }
  }
}

TEST_CASE("a plan's bytes per layer are what each advance sends", "[switch][plan][progressive]") {
  const uint64_t seed = testing::test_seed();
  std::mt19937_64 rng(seed);
  int layers_checked = 0;
  for (int iter = 0; iter < 8; ++iter) {
    const int P = std::vector<int>{2, 4, 8, 1}[static_cast<size_t>(iter % 4)];
    world w = make_world(rng, P, 0.3, /*same_layers=*/true);
    INFO("seed " << seed << " iter " << iter << " P=" << P << " " << w.shape << " " << w.kv);
    counting_transport t(w.memory);
    switcher sw(w.weights, w.kv, t, w.tables, arena_cursor{0});
    for (const parallel_mode target : {parallel_mode::tp, parallel_mode::ep}) {
      const switch_plan p = sw.plan(target);
      INFO(p);
      if (!p.layer_capacity.fits) {
        CHECK_THROWS_AS(sw.layer_bytes_of(target), moebius::error);
        break;
      }
      CHECK(sw.layer_bytes_of(target).weight_bytes_sent == p.bytes_per_layer.weight_bytes_sent);
      CHECK(sw.layer_bytes_of(target).kv_bytes_sent == p.bytes_per_layer.kv_bytes_sent);
      t.sent.clear();
      progressive_switch s = sw.begin(p);
      REQUIRE(s.open());
      CHECK(s.bytes_per_layer().busiest() == p.bytes_per_layer.busiest());
      while (s.layers_remaining() > 0) {
        s.advance(1);  // one layer a plan: its bytes are one layer's
        REQUIRE(s.wait() == progress_state::ready);
      }
      REQUIRE(s.finish().outcome == switch_outcome::committed);
      REQUIRE(static_cast<int64_t>(t.sent.size()) == w.shape.num_layers);
      for (const std::vector<int64_t>& layer : t.sent) {
        for (size_t r = 0; r < layer.size(); ++r) {
          CHECK(layer[r] == p.bytes_per_layer.weight_bytes_sent[r] +
                                p.bytes_per_layer.kv_bytes_sent[r]);
        }
        ++layers_checked;
      }
    }
  }
  CHECK(layers_checked > 0);
}

TEST_CASE("a stale plan is refused by name and moves nothing", "[switch][plan]") {
  const uint64_t seed = testing::test_seed();
  std::mt19937_64 rng(seed);
  for (int iter = 0; iter < 6; ++iter) {
    const int P = std::vector<int>{2, 4, 1}[static_cast<size_t>(iter % 3)];
    world w = make_world(rng, P, 0.3, /*same_layers=*/true);
    INFO("seed " << seed << " iter " << iter << " P=" << P << " " << w.shape << " " << w.kv);
    host_transport t(w.memory);
    switcher sw(w.weights, w.kv, t, w.tables, arena_cursor{0});
    const parallel_mode target = other(sw.mode());
    // Every refusal below must leave every byte, the tables and the cursor as they are now.
    const auto unchanged = [&, arenas = w.arenas, pools = w.pools, tables = sw.kv_tables(),
                            cursor = sw.cursor()]() {
      CHECK(w.arenas == arenas);
      CHECK(w.pools == pools);
      CHECK(sw.kv_tables() == tables);
      CHECK(sw.cursor() == cursor);
      CHECK(state_checksum(w, sw.cursor(), sw.kv_tables()) == state_checksum(w, cursor, tables));
    };

    SECTION("the tables were handed out") {
      const switch_plan p = sw.plan(target);
      CHECK(sw.why_stale(p).empty());
      (void)sw.mutable_kv_tables();
      const std::string why = sw.why_stale(p);
      INFO(why);
      CHECK(mentions(why, "mutable_kv_tables"));
      REQUIRE_MOEBIUS_ERROR(sw.switch_to(p), errc::invalid_argument, "stale: " + why);
      REQUIRE_MOEBIUS_ERROR(sw.begin(p), errc::invalid_argument, "stale");
      unchanged();
      // Planned again, it runs.
      const switch_report r = sw.switch_to(sw.plan(target));
      CHECK((r.outcome == switch_outcome::committed ||
             r.outcome == switch_outcome::refused_capacity));
    }
    SECTION("a switch ran in between") {
      const switch_plan p = sw.plan(target);
      const switch_report there = sw.switch_to(sw.plan(target));
      if (there.outcome != switch_outcome::committed) continue;  // capacity: nothing ran
      REQUIRE(sw.switch_to(other(target)).outcome == switch_outcome::committed);
      // Back in the mode the plan was made in, with the same tables: still stale.
      const auto arenas = w.arenas;
      const auto pools = w.pools;
      const kv_state tables = sw.kv_tables();
      CHECK(mentions(sw.why_stale(p), "a switch to"));
      REQUIRE_MOEBIUS_ERROR(sw.switch_to(p), errc::invalid_argument, "stale");
      REQUIRE_MOEBIUS_ERROR(sw.begin(p), errc::invalid_argument, "stale");
      CHECK(w.arenas == arenas);
      CHECK(w.pools == pools);
      CHECK(sw.kv_tables() == tables);
    }
    SECTION("a progressive switch ran in between") {
      const switch_plan p = sw.plan(target);
      progressive_switch s = sw.begin(sw.plan(target));
      if (!s.open()) continue;
      s.abort();  // rolled back: everything as before, and still the plan is stale
      unchanged();
      const std::string why = sw.why_stale(p);
      INFO(why);
      CHECK(mentions(why, "rolled_back"));
      REQUIRE_MOEBIUS_ERROR(sw.switch_to(p), errc::invalid_argument, "stale");
      unchanged();
    }
    SECTION("another switcher's plan") {
      host_transport t2(w.memory);
      const switcher twin(w.weights, w.kv, t2, w.tables, arena_cursor{0});
      const switch_plan p = twin.plan(target);
      REQUIRE_MOEBIUS_ERROR(sw.switch_to(p), errc::invalid_argument, "another switcher");
      unchanged();
    }
    SECTION("a plan edited to another target") {
      switch_plan p = sw.plan(target);
      p.to = sw.mode();  // claims another target than the one it was planned for
      REQUIRE_MOEBIUS_ERROR(sw.switch_to(p), errc::invalid_argument, "does not match");
      REQUIRE_MOEBIUS_ERROR(sw.begin(p), errc::invalid_argument, "does not match");
      unchanged();
    }
  }
}

TEST_CASE("a plan the capacity refused runs as a refusal and moves nothing", "[switch][plan]") {
  const uint64_t seed = testing::test_seed();
  std::mt19937_64 rng(seed);
  world w = make_world_tp_cannot_hold(rng, /*same_layers=*/true);
  host_transport t(w.memory);
  switcher sw(w.weights, w.kv, t, w.tables, arena_cursor{0});
  const rank_images arenas = w.arenas, pools = w.pools;
  const switch_plan p = sw.plan(parallel_mode::tp);
  INFO("seed " << seed << ": " << p);
  REQUIRE_FALSE(p.capacity.fits);
  CHECK_FALSE(p.capacity.reason.empty());
  CHECK(p.kv == nullptr);
  CHECK_FALSE(sw.check(parallel_mode::tp).fits);
  const switch_report rep = sw.switch_to(p);
  CHECK(rep.outcome == switch_outcome::refused_capacity);
  CHECK(rep.error == p.capacity.reason);
  CHECK(rep.capacity.pages_needed == p.capacity.pages_needed);
  if (!p.layer_capacity.fits) {
    progressive_switch s = sw.begin(p);
    CHECK_FALSE(s.open());
    CHECK(s.report().outcome == switch_outcome::refused_capacity);
  }
  CHECK(w.arenas == arenas);
  CHECK(w.pools == pools);
  CHECK(sw.mode() == parallel_mode::ep);
  // A refusal moved nothing and changed no state: the plan is still current.
  CHECK(sw.why_stale(p).empty());
}
