// The switcher over a KV geometry with a decode-context-parallel TP view (issue 40): EP <-> TP
// with dcp > 1, stop-the-world and progressive, commits with the layout-independent checksum
// unchanged (kv_checksum follows the DCP shares), rolls back from a fault in any KV round with
// every byte as before (test_switch_dry_run.cpp runs such worlds over dry_run_transport too).
// Switching between two dcp values (a target that is
// a (mode, dcp) pair) is not part of the switcher yet.
#include <cstdint>
#include <random>
#include <vector>

#include "moebius/switch/progressive.hpp"
#include "moebius/switch/switcher.hpp"
#include "moebius/transport/host_transport.hpp"
#include "support/catch.hpp"
#include "support/random.hpp"
#include "switch_world.hpp"

using namespace moebius;
using namespace moebius::testing;

TEST_CASE("switcher with dcp: EP <-> TP(dcp) commits with the checksum unchanged",
          "[switch][dcp]") {
  const uint64_t seed = test_seed();
  std::mt19937_64 rng(seed);
  int committed = 0;
  for (int round = 0; round < 24; ++round) {
    const int P = std::vector<int>{2, 4, 8}[static_cast<size_t>(round % 3)];
    const bool progressive = round % 2 == 1;
    world w = make_dcp_world(rng, P, std::uniform_real_distribution<double>(0.1, 0.8)(rng),
                             progressive);
    INFO("seed " << seed << " round " << round << " " << w.shape << " " << w.kv
                 << (progressive ? " progressive" : " stop-the-world"));
    host_transport host(w.memory);
    switcher_options opt;
    if (!progressive)
      opt.verify = [&](arena_cursor c, const kv_state& s) { return state_checksum(w, c, s); };
    const uint64_t kv_before = kv_checksum(w.kv, w.tables, w.pool_spans());
    switcher sw(w.weights, w.kv, host, w.tables, arena_cursor{0}, opt);
    const int64_t per_advance = uniform(rng, 1, w.shape.num_layers);
    for (const parallel_mode m : {parallel_mode::tp, parallel_mode::ep, parallel_mode::tp}) {
      const switch_report a = run_switch(sw, m, progressive, per_advance);
      INFO(a);
      if (a.outcome != switch_outcome::committed) continue;
      ++committed;
      CHECK(sw.mode() == m);
      if (!progressive) CHECK(a.verified);
      // The tables are the DCP view's (validate() checks each rank's share) and the K/V is
      // the same, wherever its shares now lie.
      REQUIRE_NOTHROW(validate(w.kv, sw.kv_tables()));
      CHECK(kv_checksum(w.kv, sw.kv_tables(), w.pool_spans()) == kv_before);
    }
  }
  INFO("seed " << seed);
  CHECK(committed >= 24);
}

TEST_CASE("switcher with dcp: a fault in any KV round leaves every byte as before",
          "[switch][dcp][fault]") {
  const uint64_t seed = test_seed();
  std::mt19937_64 rng(seed + 1);
  int faulted = 0;
  for (int round = 0; round < 12; ++round) {
    const int P = std::vector<int>{2, 4, 8}[static_cast<size_t>(round % 3)];
    world w = make_dcp_world(rng, P, std::uniform_real_distribution<double>(0.1, 0.6)(rng), false);
    INFO("seed " << seed << " round " << round << " " << w.kv);
    host_transport host(w.memory);
    switcher sw(w.weights, w.kv, host, w.tables, arena_cursor{0});
    // To TP first (a fault there too), then back to EP with a fault in a KV round.
    for (const parallel_mode m : {parallel_mode::tp, parallel_mode::ep}) {
      const uint64_t before = state_checksum(w, sw.cursor(), sw.kv_tables());
      const kv_state tables = sw.kv_tables();
      sw.inject_fault(switch_fault{switch_fault::stage::kv, fault_point{0, 0}});
      const switch_report failed = sw.switch_to(m);
      INFO(failed);
      if (failed.outcome == switch_outcome::refused_capacity) break;
      if (failed.outcome == switch_outcome::committed) continue;  // no KV round to fault
      if (failed.outcome == switch_outcome::rolled_back) {
        ++faulted;
        CHECK(sw.kv_tables() == tables);
        CHECK(state_checksum(w, sw.cursor(), sw.kv_tables()) == before);
      }
      sw.inject_fault(std::nullopt);
      const switch_report ok = sw.switch_to(m);
      INFO(ok);
      REQUIRE(ok.outcome == switch_outcome::committed);
      CHECK(state_checksum(w, sw.cursor(), sw.kv_tables()) == before);
    }
  }
  CHECK(faulted >= 6);
}
