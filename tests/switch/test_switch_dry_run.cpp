// A switcher over dry_run_transport (the simulated runtime's) ends every switch in the state a
// switcher over host_transport ends it in, from the same world: the same outcome, cursor and
// page tables, stop-the-world and progressive, both ways; and the dry run counted exactly the
// bytes the switch reports sending. Every fourth world's TP view splits each head's tokens
// (dcp > 1).
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "moebius/switch/progressive.hpp"
#include "moebius/switch/switcher.hpp"
#include "moebius/transport/dry_run_transport.hpp"
#include "moebius/transport/host_transport.hpp"
#include "support/catch.hpp"
#include "support/random.hpp"
#include "switch_world.hpp"

using namespace moebius;
using namespace moebius::testing;

TEST_CASE("a switcher over dry_run_transport ends each switch as over host_transport",
          "[switch][dry_run]") {
  const uint64_t seed = test_seed();
  std::mt19937_64 rng(seed);
  int committed = 0;
  for (int round = 0; round < 32; ++round) {
    const int P = std::vector<int>{2, 4, 8}[static_cast<size_t>(round % 3)];
    const bool progressive = round % 2 == 1;
    const double occupancy = std::uniform_real_distribution<double>(0.1, 0.8)(rng);
    world w = round % 4 == 3 ? make_dcp_world(rng, P, occupancy, progressive)
                             : make_world(rng, P, occupancy, progressive);
    INFO("seed " << seed << " round " << round << " " << w.shape << " " << w.kv
                 << (progressive ? " progressive" : " stop-the-world"));
    host_transport host(w.memory);
    dry_run_transport dry(P, {w.weights.total_bytes(), w.kv.pool_bytes()});
    switcher real(w.weights, w.kv, host, w.tables, arena_cursor{0});
    switcher sim(w.weights, w.kv, dry, w.tables, arena_cursor{0});
    const int64_t per_advance = uniform(rng, 1, w.shape.num_layers);
    int64_t reported = 0;
    for (const parallel_mode m : {parallel_mode::tp, parallel_mode::ep, parallel_mode::tp}) {
      const switch_report a = run_switch(real, m, progressive, per_advance);
      const switch_report b = run_switch(sim, m, progressive, per_advance);
      INFO(a << "\n" << b);
      REQUIRE(moves_diff(a, b) == "");
      CHECK(sim.cursor() == real.cursor());
      CHECK(sim.mode() == real.mode());
      CHECK(sim.kv_tables() == real.kv_tables());
      reported += sum(b.weight_bytes_sent) + sum(b.kv_bytes_sent);
      if (a.outcome == switch_outcome::committed) ++committed;
    }
    CHECK(sum(dry.traffic().bytes_sent) == reported);
  }
  INFO("seed " << seed);
  CHECK(committed >= 24);  // most switches fit; the rest were refused alike
}
