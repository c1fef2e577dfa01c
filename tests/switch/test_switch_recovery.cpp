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
  // Each kind of fault runs `want` times with each recovery mode, and every P at least once,
  // whatever the seed: a world whose switch the capacity check refuses (replicated KV heads
  // need more TP pages than EP) is replaced by a fresh one instead of skipping its cases.
  enum kind : int { weights_timeout, weights_undo, kv_timeout, kv_last_round_undo, num_kinds };
  static constexpr const char* kind_names[] = {"weights timeout", "weights undo fails",
                                               "KV timeout", "last KV round's undo fails"};
  constexpr int want = 2, max_draws = 200;
  int ran[num_kinds][2] = {};  // [kind][recovery mode: 0 EP, 1 TP]
  bool p_ran[3] = {};          // P = 2, 4, 8
  auto short_of = [&](int k) { return std::min(ran[k][0], ran[k][1]) < want; };
  auto unfinished = [&] {
    bool any = !(p_ran[0] && p_ran[1] && p_ran[2]);
    for (int k = 0; k < num_kinds; ++k) any = any || short_of(k);
    return any;
  };
  int draws = 0;
  for (; draws < max_draws && unfinished(); ++draws) {
    const int P = std::vector<int>{2, 4, 8}[static_cast<size_t>(draws % 3)];
    world w = make_world(rng, P, 0.3);
    INFO("seed " << seed << " draw " << draws << " " << w.shape << " " << w.kv);
    host_transport t(w.memory);
    const kv_state tables = w.tables;
    const rank_images pools = w.pools;
    const uint64_t kv_before = kv_checksum(w.kv, tables, w.pool_spans());
    const std::vector<int64_t> ids = live_ids(tables);
    REQUIRE(!ids.empty());
    const int64_t L = w.shape.num_layers;
    const kv_capacity_report cap = switcher(w.weights, w.kv, t, tables, arena_cursor{0})
                                       .check(parallel_mode::tp);
    if (!cap.fits) continue;  // refused for capacity: nothing to recover from; draw again
    const int64_t rounds = cap.rounds;
    REQUIRE(rounds >= 1);
    p_ran[P == 2 ? 0 : P == 4 ? 1 : 2] = true;

    for (int k = 0; k < num_kinds; ++k) {
      if (!short_of(k)) continue;
      if (k == weights_undo && L < 2) continue;  // the undo needs weights to move back
      const int m = ran[k][0] <= ran[k][1] ? 0 : 1;
      const parallel_mode mode = m ? parallel_mode::tp : parallel_mode::ep;
      INFO(kind_names[k] << ", recovered in " << to_string(mode));
      reset(w, pools);
      switcher sw(w.weights, w.kv, t, tables, arena_cursor{0});
      bool expect_kept = true;
      switch (k) {
        case weights_timeout: {  // the KV never moved: every sequence is kept
          const int64_t at = std::uniform_int_distribution<int64_t>(0, L - 1)(rng);
          sw.inject_fault(
              switch_fault{switch_fault::stage::weights, fault_point{at, 0, errc::timeout}});
          break;
        }
        case weights_undo:  // a weights fault whose undo fails: the KV never moved
          sw.inject_fault(switch_fault{switch_fault::stage::weights, fault_point{L - 1, 0}});
          sw.inject_fault(switch_fault{switch_fault::stage::undo, fault_point{0, 0}});
          break;
        case kv_timeout:  // a barrier timeout in a KV round: that KV is unknown, all lost
          sw.inject_fault(switch_fault{switch_fault::stage::kv, fault_point{0, 0, errc::timeout}});
          expect_kept = false;
          break;
        case kv_last_round_undo:
          // With earlier rounds done their undo is what failed: lost. With one round, none
          // completed: a failed round wrote only free pages, the undo moved no KV, and the
          // weights' undo failed: kept.
          sw.inject_fault(switch_fault{switch_fault::stage::kv, fault_point{rounds - 1, 1}});
          sw.inject_fault(switch_fault{switch_fault::stage::undo, fault_point{0, 0}});
          expect_kept = rounds == 1;
          break;
      }
      const switch_report r = sw.switch_to(parallel_mode::tp);
      INFO(r);
      // A fault on op 1 of a round with one op never fires: that world does not count.
      if (k == kv_last_round_undo && r.outcome == switch_outcome::committed) continue;
      REQUIRE(r.outcome == switch_outcome::inconsistent);
      if (k == weights_undo) CHECK(r.error.find("undo failed") != std::string::npos);
      if (k == kv_last_round_undo) CHECK(r.kv_rounds_completed == rounds - 1);
      recover_and_check(w, t, sw, mode, kv_before, ids, expect_kept);
      ++ran[k][m];
    }
  }
  INFO("seed " << seed << ": " << draws << " worlds drawn");
  REQUIRE(draws < max_draws);
  for (int k = 0; k < num_kinds; ++k) {
    INFO(kind_names[k]);
    CHECK(ran[k][0] == want);
    CHECK(ran[k][1] == want);
  }
}

TEST_CASE("recover after a progressive switch left the switcher inconsistent",
          "[switch][recovery][progressive]") {
  const uint64_t seed = test_seed();
  std::mt19937_64 rng(seed + 1);
  // Three recoveries in each mode, whatever the seed: a world whose switch is refused for
  // capacity is replaced by a fresh one.
  constexpr int want = 3, max_draws = 100;
  int ran[2] = {};  // [recovery mode: 0 EP, 1 TP]
  int iter = 0;
  for (; iter < max_draws && std::min(ran[0], ran[1]) < want; ++iter) {
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
    const int m = ran[0] <= ran[1] ? 0 : 1;
    recover_and_check(w, t, sw, m ? parallel_mode::tp : parallel_mode::ep, kv_before, ids, false);
    ++ran[m];
  }
  INFO("seed " << seed << ": " << iter << " worlds drawn");
  REQUIRE(iter < max_draws);
  CHECK(ran[0] == want);
  CHECK(ran[1] == want);
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
