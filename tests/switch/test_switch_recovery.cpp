// Recovery after an `inconsistent` switch (switcher::recover): without a restart, the switcher
// comes back consistent in the mode asked for, with the experts reloaded from the caller's source
// of truth (here the independent reference), and the KV either kept byte for byte (every layer
// intact: the failure was in the weights) or lost as a whole (a layer's KV bytes unknown), named
// sequence by sequence. Faults: a barrier timeout (errc::timeout: no undo is trusted) and an
// undo that fails, at weights and KV stages, both switch styles.
#include <algorithm>
#include <cstring>
#include <random>
#include <stdexcept>
#include <vector>

#include "moebius/kv/kv_geometry.hpp"
#include "moebius/switch/switcher.hpp"
#include "moebius/transport/host_transport.hpp"
#include "support/catch.hpp"
#include "support/reference.hpp"
#include "switch_world.hpp"

namespace {

using namespace moebius;
using namespace moebius::testing;

// The caller's source of truth: the reference weights written where `c` puts them, into the
// arenas the transport already holds (same addresses).
std::function<void(arena_cursor)> reload_from_reference(world& w) {
  return [&w](arena_cursor c) {
    rank_images fresh;
    load_reference(w.logical, w.weights, c, fresh);
    for (size_t r = 0; r < fresh.size(); ++r)
      std::memcpy(w.arenas[r].data(), fresh[r].data(), fresh[r].size());
  };
}

// Back to the start of a case: the reference experts in EP and the pool bytes `pools` (same
// addresses: the transport holds them).
void reset(world& w, const rank_images& pools) {
  reload_from_reference(w)(arena_cursor{0});
  for (size_t r = 0; r < pools.size(); ++r)
    std::memcpy(w.pools[r].data(), pools[r].data(), pools[r].size());
}

std::vector<int64_t> live_ids(const kv_state& s) {
  std::vector<int64_t> ids;
  for (const kv_rank_state& r : s.ranks)
    for (const kv_sequence& q : r.sequences) ids.push_back(q.seq_id);
  std::sort(ids.begin(), ids.end());
  ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
  return ids;
}

parallel_mode other(parallel_mode m) {
  return m == parallel_mode::ep ? parallel_mode::tp : parallel_mode::ep;
}

arena_cursor resting(const world& w, parallel_mode m) {
  return arena_cursor{m == parallel_mode::tp ? w.shape.num_layers : 0};
}

// Recovers `sw` in `mode` and checks the result: consistent, the reference experts at the
// resting cursor, and either every sequence kept with its K/V (checksum as before) or every
// one lost and the tables empty. Then a switch both ways commits and keeps what is left.
void recover_and_check(world& w, host_transport& t, switcher& sw, parallel_mode mode,
                       uint64_t kv_before, const std::vector<int64_t>& ids, bool expect_kept) {
  REQUIRE_FALSE(sw.consistent());
  CHECK(sw.switch_to(other(sw.mode())).outcome == switch_outcome::inconsistent);  // refused
  recovery_request q;
  q.mode = mode;
  q.reload_experts = reload_from_reference(w);
  const recovery_report r = sw.recover(q);
  INFO(r.error);
  REQUIRE(r.recovered);
  CHECK(sw.consistent());
  CHECK(sw.mode() == mode);
  CHECK(sw.cursor() == resting(w, mode));
  CHECK(r.cursor == resting(w, mode));
  CHECK(compare_to_reference(w.logical, w.weights, sw.cursor(), w.arenas,
                              testing::padding_rule::end_slots_unknown) == "");
  validate(w.kv, sw.kv_tables());
  if (expect_kept) {
    CHECK(r.kept == ids);
    CHECK(r.lost.empty());
    CHECK(live_ids(sw.kv_tables()) == ids);
    CHECK(kv_checksum(w.kv, sw.kv_tables(), w.pool_spans()) == kv_before);
  } else {
    CHECK(r.kept.empty());
    CHECK(r.lost == ids);
    CHECK(live_ids(sw.kv_tables()).empty());
  }
  const uint64_t kv_now = kv_checksum(w.kv, sw.kv_tables(), w.pool_spans());
  for (const parallel_mode m : {other(mode), mode}) {
    const switch_report s = sw.switch_to(m);
    INFO(s);
    REQUIRE(s.outcome == switch_outcome::committed);
    CHECK(compare_to_reference(w.logical, w.weights, sw.cursor(), w.arenas,
                              testing::padding_rule::end_slots_unknown) == "");
    CHECK(kv_checksum(w.kv, sw.kv_tables(), w.pool_spans()) == kv_now);
  }
  (void)t;
}

}  // namespace

TEST_CASE("recover after a stop-the-world switch left the switcher inconsistent",
          "[switch][recovery]") {
  const uint64_t seed = test_seed();
  std::mt19937_64 rng(seed);
  int cases = 0;
  for (int iter = 0; iter < 6; ++iter) {
    const int P = std::vector<int>{2, 4, 8}[static_cast<size_t>(iter % 3)];
    world w = make_world(rng, P, 0.3);
    INFO("seed " << seed << " iter " << iter << " " << w.shape << " " << w.kv);
    host_transport t(w.memory);
    const kv_state tables = w.tables;
    const rank_images pools = w.pools;
    const uint64_t kv_before = kv_checksum(w.kv, tables, w.pool_spans());
    const std::vector<int64_t> ids = live_ids(tables);
    REQUIRE(!ids.empty());
    const int64_t L = w.shape.num_layers;
    const parallel_mode mode = iter % 2 ? parallel_mode::tp : parallel_mode::ep;

    // 1. A barrier timeout in the weights: the KV never moved, every sequence is kept.
    {
      switcher sw(w.weights, w.kv, t, tables, arena_cursor{0});
      const int64_t k = std::uniform_int_distribution<int64_t>(0, L - 1)(rng);
      sw.inject_fault(switch_fault{switch_fault::stage::weights, fault_point{k, 0, errc::timeout}});
      const switch_report r = sw.switch_to(parallel_mode::tp);
      if (r.outcome == switch_outcome::refused_capacity) continue;
      INFO(r);
      REQUIRE(r.outcome == switch_outcome::inconsistent);
      recover_and_check(w, t, sw, mode, kv_before, ids, true);
      ++cases;
    }
    // 2. A weights fault whose undo fails (L >= 2: the undo has weights to move back).
    if (L >= 2) {
      reset(w, pools);
      switcher sw(w.weights, w.kv, t, tables, arena_cursor{0});
      sw.inject_fault(switch_fault{switch_fault::stage::weights, fault_point{L - 1, 0}});
      sw.inject_fault(switch_fault{switch_fault::stage::undo, fault_point{0, 0}});
      const switch_report r = sw.switch_to(parallel_mode::tp);
      INFO(r);
      REQUIRE(r.outcome == switch_outcome::inconsistent);
      CHECK(r.error.find("undo failed") != std::string::npos);
      recover_and_check(w, t, sw, mode, kv_before, ids, true);
      ++cases;
    }
    // 3. A barrier timeout in a KV round: that KV is unknown, every sequence is lost.
    {
      reset(w, pools);
      switcher sw(w.weights, w.kv, t, tables, arena_cursor{0});
      sw.inject_fault(switch_fault{switch_fault::stage::kv, fault_point{0, 0, errc::timeout}});
      const switch_report r = sw.switch_to(parallel_mode::tp);
      INFO(r);
      REQUIRE(r.outcome == switch_outcome::inconsistent);
      recover_and_check(w, t, sw, mode, kv_before, ids, false);
      ++cases;
    }
    // 4. A fault in the last KV round whose undo fails. With earlier rounds done their undo is
    // what failed: lost. With one round, none completed: a failed round wrote only free pages,
    // the undo moved no KV, and the weights' undo failed: kept.
    {
      reset(w, pools);
      switcher probe(w.weights, w.kv, t, tables, arena_cursor{0});
      const int64_t rounds = probe.check(parallel_mode::tp).rounds;
      REQUIRE(rounds >= 1);
      switcher sw(w.weights, w.kv, t, tables, arena_cursor{0});
      sw.inject_fault(switch_fault{switch_fault::stage::kv, fault_point{rounds - 1, 1}});
      sw.inject_fault(switch_fault{switch_fault::stage::undo, fault_point{0, 0}});
      const switch_report r = sw.switch_to(parallel_mode::tp);
      INFO(r);
      if (r.outcome == switch_outcome::inconsistent) {
        CHECK(r.kv_rounds_completed == rounds - 1);
        recover_and_check(w, t, sw, mode, kv_before, ids, rounds == 1);
        ++cases;
      }
    }
  }
  CHECK(cases >= 10);
}

TEST_CASE("recover after a progressive switch left the switcher inconsistent",
          "[switch][recovery][progressive]") {
  const uint64_t seed = test_seed();
  std::mt19937_64 rng(seed + 1);
  int cases = 0;
  for (int iter = 0; iter < 10; ++iter) {
    const int P = std::vector<int>{2, 4}[static_cast<size_t>(iter % 2)];
    world w = make_world(rng, P, 0.25, true);
    INFO("seed " << seed << " iter " << iter << " " << w.shape << " " << w.kv);
    host_transport t(w.memory);
    const uint64_t kv_before = kv_checksum(w.kv, w.tables, w.pool_spans());
    const std::vector<int64_t> ids = live_ids(w.tables);
    switcher sw(w.weights, w.kv, t, w.tables, arena_cursor{0});
    progressive_switch s = sw.begin(parallel_mode::tp);
    if (!s.open()) continue;
    // A few layers move; then a barrier timeout in the next advance.
    const int64_t L = w.shape.num_layers;
    const int64_t before = std::uniform_int_distribution<int64_t>(0, L - 1)(rng);
    if (before > 0) {
      s.advance(before);
      REQUIRE(s.poll() == progress_state::ready);
    }
    sw.inject_fault(switch_fault{switch_fault::stage::weights, fault_point{0, 0, errc::timeout}});
    s.advance(1);
    REQUIRE(s.poll() == progress_state::ended);
    REQUIRE(s.report().outcome == switch_outcome::inconsistent);
    CHECK(s.report().cursor.tp_layers == before);
    // The advance's own layer may have moved its KV past the timeout: all lost.
    recover_and_check(w, t, sw, iter % 2 ? parallel_mode::tp : parallel_mode::ep, kv_before, ids,
                      false);
    ++cases;
  }
  CHECK(cases >= 6);
}

TEST_CASE("recover: refused when there is nothing to recover, retried when the reload fails",
          "[switch][recovery]") {
  std::mt19937_64 rng(test_seed() + 2);
  world w = make_world(rng, 2, 0.3);
  host_transport t(w.memory);
  switcher sw(w.weights, w.kv, t, w.tables, arena_cursor{0});
  recovery_request q;
  q.reload_experts = reload_from_reference(w);
  CHECK_THROWS_WITH(sw.recover(q), Catch::Matchers::Contains("nothing to recover"));
  sw.inject_fault(switch_fault{switch_fault::stage::weights, fault_point{0, 0, errc::timeout}});
  REQUIRE(sw.switch_to(parallel_mode::tp).outcome == switch_outcome::inconsistent);
  recovery_request none;
  CHECK_THROWS_WITH(sw.recover(none), Catch::Matchers::Contains("needs reload_experts"));
  recovery_request failing;
  failing.mode = parallel_mode::tp;
  failing.reload_experts = [](arena_cursor) { throw std::runtime_error("checkpoint missing"); };
  const recovery_report r = sw.recover(failing);
  CHECK_FALSE(r.recovered);
  CHECK(r.error.find("checkpoint missing") != std::string::npos);
  CHECK_FALSE(sw.consistent());
  q.mode = parallel_mode::ep;  // the first attempt rebuilt the KV in TP
  CHECK_THROWS_WITH(sw.recover(q), Catch::Matchers::Contains("recover in TP"));
  q.mode = parallel_mode::tp;
  const recovery_report ok = sw.recover(q);
  CHECK(ok.recovered);
  CHECK(sw.consistent());
  CHECK(sw.mode() == parallel_mode::tp);
  CHECK(compare_to_reference(w.logical, w.weights, sw.cursor(), w.arenas,
                              testing::padding_rule::end_slots_unknown) == "");
}
