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

#include "kv/kv_reference.hpp"
#include "moebius/kv/kv_geometry.hpp"
#include "moebius/kv/kv_migration.hpp"
#include "moebius/plan/rollback.hpp"
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
// `after_recover` (optional) checks more right after the recovery. Returns the recovery's report.
recovery_report recover_and_check(world& w, host_transport& t, switcher& sw, parallel_mode mode,
                       uint64_t kv_before, const std::vector<int64_t>& ids, bool expect_kept,
                       const std::function<void()>& after_recover = {}) {
  REQUIRE_FALSE(sw.consistent());
  CHECK(sw.switch_to(other(sw.mode())).outcome == switch_outcome::inconsistent);  // refused
  recovery_request q;
  q.layout = mode;
  q.reload_experts = reload_from_reference(w);
  const recovery_report r = sw.recover(q);
  INFO(r.error);
  REQUIRE(r.recovered);
  CHECK(r.layout == parallel_layout(mode));
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
  if (after_recover) after_recover();
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
  return r;
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
  failing.layout = parallel_mode::tp;
  failing.reload_experts = [](arena_cursor) { throw std::runtime_error("checkpoint missing"); };
  const recovery_report r = sw.recover(failing);
  CHECK_FALSE(r.recovered);
  CHECK(r.error.find("checkpoint missing") != std::string::npos);
  CHECK_FALSE(sw.consistent());
  q.layout = parallel_mode::ep;  // the first attempt rebuilt the KV in TP
  CHECK_THROWS_WITH(sw.recover(q), Catch::Matchers::Contains("recover in TP"));
  q.layout = parallel_mode::tp;
  const recovery_report ok = sw.recover(q);
  CHECK(ok.recovered);
  CHECK(sw.consistent());
  CHECK(sw.mode() == parallel_mode::tp);
  CHECK(compare_to_reference(w.logical, w.weights, sw.cursor(), w.arenas,
                              testing::padding_rule::end_slots_unknown) == "");
}

// The undo of a unit whose KV moved in two or more rounds: a near-full pool makes the EP->TP
// migration take several rounds; every round completes, then the verify hook reports a
// different checksum (as corruption would), so the undo reverses every round.
//   undo fails in the KV: the fault hits a later phase of the KV undo, after its first phase
//     ran: the KV is partly reversed, every sequence is lost; the experts come back from the
//     reference byte for byte.
//   undo fails after the KV: the KV undo (every round) completes, the weights' undo fails:
//     every sequence is kept, and every live K/V byte is where the tables say and equals the
//     independent reference (kv_reference.hpp), in the EP layout or, recovered in TP, the TP one.
TEST_CASE("recover after the undo of a multi-round KV migration failed (near-full pool)",
          "[switch][recovery][rounds]") {
  const uint64_t seed = test_seed();
  std::mt19937_64 rng(seed + 3);
  enum kind : int { undo_fails_in_kv, undo_fails_after_kv, num_kinds };
  static constexpr const char* kind_names[] = {"the KV undo fails", "the weights' undo fails"};
  constexpr int want = 2, max_draws = 300, min_rounds = 3;
  int ran[num_kinds][2] = {};  // [kind][recovery mode: 0 EP, 1 TP]
  auto short_of = [&](int k) { return std::min(ran[k][0], ran[k][1]) < want; };
  int draws = 0, refused = 0, few_rounds = 0;
  for (; draws < max_draws && (short_of(undo_fails_in_kv) || short_of(undo_fails_after_kv));
       ++draws) {
    const int P = std::vector<int>{2, 4}[static_cast<size_t>(draws % 2)];
    // Small experts in 4 KiB slots, KV pages of about half a slot (the switch stages through
    // the free slot: about two pages, in either direction: the check after the recovery switches
    // both ways, and a TP->EP staging slot is larger than an EP->TP one), P | H_kv (TP holds what
    // EP holds), 90-100% of the pool in use: the migration takes several rounds.
    std::uniform_int_distribution<int64_t> pick(1, 4);
    expert_shape shape;
    shape.num_layers = pick(rng);
    shape.num_experts = P * (1 + pick(rng) % 2);
    shape.hidden = 2 * pick(rng);
    shape.intermediate = P * pick(rng);
    const int64_t layers = 1 + pick(rng) % 2, heads = P * (1 + pick(rng) % 2), page = pick(rng),
                  pages = 4 * (1 + pick(rng));
    const kv_layout inner = pick(rng) % 2 ? kv_layout::hnd : kv_layout::nhd;
    const kv_geometry unit_dim = make_kv_geometry(layers, heads, 1, page, pages, P);
    const int64_t per_dim = std::max(kv_staging_slot_bytes(unit_dim, parallel_mode::tp),
                                     kv_staging_slot_bytes(unit_dim, parallel_mode::ep));
    const arena_geometry weights = make_arena_geometry(shape, P, 256, 4096);
    const int64_t dim = std::max<int64_t>(1, weights.slot_bytes / (2 * per_dim));
    world w = make_world(rng, weights,
                         make_kv_geometry(layers, heads, dim, page, pages, P, dtype::bf16, inner),
                         std::uniform_real_distribution<double>(0.9, 1.0)(rng));
    INFO("seed " << seed << " draw " << draws << " " << w.shape << " " << w.kv);
    host_transport t(w.memory);
    const kv_state tables = w.tables;
    const std::vector<int64_t> ids = live_ids(tables);
    REQUIRE(!ids.empty());
    const kv_capacity_report cap = switcher(w.weights, w.kv, t, tables, arena_cursor{0})
                                       .check(parallel_mode::tp);
    if (!cap.fits) {
      ++refused;
      continue;
    }
    if (cap.rounds < min_rounds) {
      ++few_rounds;
      continue;
    }
    // The migration as the switcher plans it (staging in the arena slot free at the TP
    // resting cursor), and its undo: the KV undo fault goes to the last phase with ops, past
    // the first (an undo phase ran).
    const int64_t L = w.shape.num_layers;
    kv_migration_options opt;
    opt.staging = {memory_space::arena,
                   w.weights.slot_offset(arena_geometry::free_slot(arena_cursor{L})),
                   w.weights.slot_bytes};
    const kv_migration mig = plan_kv_migration(w.kv, tables, parallel_mode::tp, opt);
    REQUIRE(mig.stats.rounds == cap.rounds);
    const plan undo = rollback_plan(mig.copies, cap.rounds);
    int64_t undo_phase = -1;
    for (size_t k = 1; k < undo.phases.size(); ++k)
      if (!undo.phases[k].ops.empty()) undo_phase = static_cast<int64_t>(k);
    REQUIRE(undo_phase >= 1);
    const fault_point kv_undo_fault{
        undo_phase,
        static_cast<int64_t>(undo.phases[static_cast<size_t>(undo_phase)].ops.size() / 2)};

    // Every live page holds the independent reference; free pages keep their random bytes.
    content_map content;
    for (const int64_t id : ids) content[id] = seq_content{};
    fill_reference(w.kv, tables, content, w.pools);
    const rank_images pools = w.pools;
    const uint64_t kv_before = kv_checksum(w.kv, tables, w.pool_spans());

    for (int k = 0; k < num_kinds; ++k) {
      if (!short_of(k)) continue;
      const int m = ran[k][0] <= ran[k][1] ? 0 : 1;
      const parallel_mode mode = m ? parallel_mode::tp : parallel_mode::ep;
      INFO(kind_names[k] << ", " << cap.rounds << " rounds, recovered in " << to_string(mode));
      reset(w, pools);
      // The first switch's verify differs after the move; later switches verify honestly.
      int verify_calls = 0;
      bool corrupt = true;
      switcher_options sw_opt;
      sw_opt.verify = [&](arena_cursor c, const kv_state& s) {
        return corrupt ? static_cast<uint64_t>(++verify_calls) : state_checksum(w, c, s);
      };
      switcher sw(w.weights, w.kv, t, tables, arena_cursor{0}, sw_opt);
      if (k == undo_fails_in_kv) {
        sw.inject_fault(switch_fault{switch_fault::stage::undo, kv_undo_fault});
      } else {  // the KV undo runs whole (a fault it never reaches), the weights' undo fails
        sw.inject_fault(switch_fault{switch_fault::stage::undo, fault_point{int64_t{1} << 40, 0}});
        sw.inject_fault(switch_fault{switch_fault::stage::undo, fault_point{0, 0}});
      }
      const switch_report r = sw.switch_to(parallel_mode::tp);
      corrupt = false;
      INFO(r);
      ++ran[k][m];
      CHECK(r.outcome == switch_outcome::inconsistent);
      if (r.outcome != switch_outcome::inconsistent) continue;  // the other kind still runs
      CHECK(r.error.find("checksum") != std::string::npos);
      CHECK(r.error.find("undo failed") != std::string::npos);
      CHECK(r.kv_rounds_completed == cap.rounds);
      CHECK(sw.mode() == parallel_mode::ep);  // the tables of record are still the source's
      const bool kept = k == undo_fails_after_kv;
      const recovery_report rec =
          recover_and_check(w, t, sw, mode, kv_before, ids, kept, [&] {
            CHECK(sw.kv_tables().mode == mode);
            if (kept) CHECK(check_reference(w.kv, sw.kv_tables(), content, w.pools) == "");
            if (kept && mode == parallel_mode::ep) CHECK(sw.kv_tables() == tables);
          });
      // The KV was intact in EP: recovering in TP moves it there with the migration's plan.
      CHECK(rec.kv_plans_run == (kept && mode == parallel_mode::tp ? 1 : 0));
    }
  }
  INFO("seed " << seed << ": " << draws << " worlds drawn, " << refused << " refused, "
               << few_rounds << " with fewer than " << min_rounds << " rounds");
  REQUIRE(draws < max_draws);
  for (int k = 0; k < num_kinds; ++k) {
    INFO(kind_names[k]);
    CHECK(ran[k][0] == want);
    CHECK(ran[k][1] == want);
  }
}
