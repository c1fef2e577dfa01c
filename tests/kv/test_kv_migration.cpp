// EP->TP->EP migrations of random KV states through host_transport, checked element by element
// against the naive reference (kv_reference.hpp).

#include <algorithm>
#include <cstring>
#include <iostream>
#include <random>
#include <set>

#include "kv_cases.hpp"
#include "kv_layout_model.hpp"
#include "kv_memory.hpp"
#include "kv_reference.hpp"
#include "moebius/kv/kv_migration.hpp"
#include "moebius/plan/rollback.hpp"
#include "moebius/transport/host_transport.hpp"
#include "support/catch.hpp"

using namespace moebius;
using namespace moebius::testing;

namespace {

struct step_result {
  bool ran = false;
  kv_capacity_report rep;
};

// A staging region of `slots` slots of either direction at a random offset.
kv_staging random_staging(std::mt19937_64& rng, const kv_geometry& g, int64_t slots) {
  return {memory_space::arena, uni(rng, 0, 64),
          slots * std::max(kv_staging_slot_bytes(g, parallel_mode::tp),
                           kv_staging_slot_bytes(g, parallel_mode::ep))};
}

// One draw of the layout property tests: a state of 1 to 4096 sequences in `mode`, staging of
// 0, 1 or 4 slots, the pool in `model`'s array filled through the model.
struct trial {
  kv_case c;
  kv_migration_options opt;
  memory m;
  int64_t slots = 0;
};
trial draw_trial(std::mt19937_64& rng, const kv_geometry& g, parallel_mode mode, double occupancy,
                 const layout_model& model) {
  trial t;
  t.c = random_kv_case(rng, g, mode, occupancy,
                       pick_one(rng, {int64_t{1}, int64_t{7}, int64_t{100}, int64_t{4096}}));
  t.slots = pick_one(rng, {int64_t{0}, int64_t{1}, int64_t{4}});
  t.opt.staging = random_staging(rng, g, t.slots);
  t.m = make_memory(rng, t.c, t.opt.staging.bytes, &model);
  return t;
}

// Checks capacity, plans, checks hazards, executes, checks every element. Returns the report.
step_result migrate_and_check(kv_case& c, memory& m, parallel_mode target,
                              const kv_migration_options& opt) {
  step_result out;
  out.rep = check_kv_capacity(c.g, m.layout, c.state, target, opt);
  // The layout changes addresses only: the present layout's verdict and rounds are the same.
  // (The planner's choices depend on the layout only through kv_slices_in_place.)
  if (kv_slices_in_place(c.g, m.layout) == kv_slices_in_place(c.g, present_kv_layout(c.g))) {
    const kv_capacity_report present = check_kv_capacity(c.g, c.state, target, opt);
    REQUIRE(present.fits == out.rep.fits);
    REQUIRE(present.rounds == out.rep.rounds);
  }
  if (!out.rep.fits) {
    INFO(out.rep.reason);
    CHECK(!out.rep.reason.empty());
    const pools before = m.kv;
    REQUIRE_THROWS_AS(plan_kv_migration(c.g, m.layout, c.state, target, opt), moebius::error);
    try {
      (void)plan_kv_migration(c.g, m.layout, c.state, target, opt);
    } catch (const moebius::error& e) {
      CHECK(e.code() == errc::capacity);
    }
    REQUIRE(m.kv == before);
    return out;
  }
  kv_migration mig = plan_kv_migration(c.g, m.layout, c.state, target, opt);
  INFO(m.layout);
  INFO(c.g << " " << to_string(c.state.mode) << "->" << to_string(target) << " " << mig.stats);
  REQUIRE(mig.stats.rounds == out.rep.rounds);
  REQUIRE(static_cast<int64_t>(mig.copies.phases.size()) == mig.stats.rounds);
  REQUIRE(mig.new_state.mode == target);
  REQUIRE_NOTHROW(validate(c.g, mig.new_state));  // no page leaked or double-owned
  REQUIRE(find_phase_hazard(mig.copies) == "");
  require_same_sequences(c.state, mig.new_state);
  // Shared pages move once (EP->TP: one piece per receiver per distinct page; TP->EP: one EP
  // page per distinct page per owner, i.e. duplicated once per owner, never per sequence).
  const kv_state& ep_side = target == parallel_mode::tp ? c.state : mig.new_state;
  int64_t distinct = 0;
  for (int r = 0; r < c.g.num_ranks; ++r) distinct += used_pages(c.g, ep_side, r);
  REQUIRE(mig.stats.pages_moved == distinct);
  if (target == parallel_mode::tp && c.g.dcp == 1 && m.layout.preset == kv_preset::present &&
      c.g.layout == kv_layout::hnd && mig.stats.pages_staged == 0)
    REQUIRE(mig.copies.num_ops() == distinct * (c.g.num_ranks - 1));
  host_transport tr(m.spans());
  // A phase with ops to fault in (pick one from the state's shape, so it varies).
  int64_t k = -1;
  for (size_t i = 0; i < mig.copies.phases.size(); ++i) {
    const size_t j = (i + c.state.ranks[0].free_pages.size()) % mig.copies.phases.size();
    if (!mig.copies.phases[j].ops.empty()) {
      k = static_cast<int64_t>(j);
      break;
    }
  }
  if (k >= 0) {
    // A fault part-way, then rollback_plan: every byte of the old tables is back.
    const auto& ops = mig.copies.phases[static_cast<size_t>(k)].ops;
    tr.inject_fault(fault_point{k, static_cast<int64_t>(ops.size() / 2)});
    REQUIRE_THROWS_AS(tr.execute(mig.copies), moebius::error);
    REQUIRE(tr.completed_phases() == k);
    tr.execute(rollback_plan(mig.copies, tr.completed_phases()));
    REQUIRE(check_reference(c.g, c.state, c.content, m.kv, m.where()) == "");
    // And a full run, then a full rollback, then the run again.
    tr.execute(mig.copies);
    tr.execute(rollback_plan(mig.copies, static_cast<int64_t>(mig.copies.phases.size())));
    REQUIRE(check_reference(c.g, c.state, c.content, m.kv, m.where()) == "");
  }
  tr.execute(mig.copies);
  REQUIRE(check_reference(c.g, mig.new_state, c.content, m.kv, m.where()) == "");
  c.state = std::move(mig.new_state);
  out.ran = true;
  return out;
}

}  // namespace

TEST_CASE("KV EP->TP->EP round trips keep every token of every head", "[kv][migration]") {
  std::mt19937_64 rng(kv_test_seed());
  static constexpr double occupancies[] = {0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0};
  static constexpr int64_t max_seqs[] = {0, 1, 7, 100, 4096};
  int64_t round_trips = 0;
  for (int iter = 0; iter < 120; ++iter) {
    const kv_geometry g = random_kv_geometry(rng, uni(rng, 1, 8) * 16384);
    const double occ = pick_one(rng, occupancies);
    kv_case c = random_kv_case(rng, g, parallel_mode::ep, occ, pick_one(rng, max_seqs));
    kv_migration_options opt;
    const int64_t slots = pick_one(rng, {int64_t{0}, int64_t{0}, int64_t{1}, int64_t{4}, int64_t{64}});
    opt.staging = random_staging(rng, g, slots);
    memory m = make_memory(rng, c, opt.staging.bytes);
    INFO("iter " << iter << " " << g << " occupancy " << c.occupancy << " seqs "
                 << c.content.size() << " staging slots " << slots);
    REQUIRE(check_reference(g, c.state, c.content, m.kv) == "");
    const step_result to_tp = migrate_and_check(c, m, parallel_mode::tp, opt);
    // EP->TP fits whenever the TP view holds the KV at up to 90% of its pages. NHD must copy
    // the owner's own slice out before its EP page frees, so it needs a staging slot
    // (kv_migration.hpp): a free page on every rank is not enough, since other ranks' pieces
    // may fill a rank's free pages before its own slices leave (seed 15944162787897394137,
    // iteration 46: NHD, P=8, H_kv=4, 26% occupancy, stuck after 3 rounds).
    const bool headroom = to_tp.rep.pages_needed * 10 <= to_tp.rep.pages_available * 9;
    if (to_tp.rep.holds && headroom && (g.layout == kv_layout::hnd || slots > 0)) {
      INFO(to_tp.rep.reason);
      REQUIRE(to_tp.rep.fits);
    } else if (to_tp.rep.holds && !to_tp.rep.fits) {
      // Refused with its reason: stuck, naming the ranks, and what would unblock it.
      CHECK_THAT(to_tp.rep.reason, Catch::Matchers::Contains("is stuck after") &&
                                       Catch::Matchers::Contains("lend a staging region"));
    }
    // Without replication (P | H_kv) TP holds everything EP holds.
    if (!g.latent() && g.num_kv_heads >= g.num_ranks) REQUIRE(to_tp.rep.holds);
    if (!to_tp.ran) continue;
    const step_result back = migrate_and_check(c, m, parallel_mode::ep, opt);
    if (back.ran) ++round_trips;
  }
  INFO("round trips " << round_trips);
  CHECK(round_trips > 20);
}

TEST_CASE("KV TP->EP from fragmented TP states (compaction, staging)", "[kv][migration]") {
  std::mt19937_64 rng(kv_test_seed() + 1);
  static constexpr double occupancies[] = {0.0, 0.25, 0.5, 0.75, 0.9, 1.0};
  int64_t ran = 0, compacted = 0, holds = 0;
  for (int iter = 0; iter < 80; ++iter) {
    const kv_geometry g = random_kv_geometry(rng, uni(rng, 1, 8) * 16384);
    const double occ = pick_one(rng, occupancies);
    // TP holds H_kv/P of EP with replication; keep TP occupancy within what EP can hold.
    kv_case c = random_kv_case(rng, g, parallel_mode::tp, occ, 4096);
    kv_migration_options opt;
    const int64_t slots = pick_one(rng, {int64_t{0}, int64_t{1}, int64_t{8}});
    opt.staging = {memory_space::arena, 0, slots * kv_staging_slot_bytes(g, parallel_mode::ep)};
    memory m = make_memory(rng, c, opt.staging.bytes);
    INFO("iter " << iter << " " << g << " occupancy " << c.occupancy << " seqs "
                 << c.content.size() << " staging slots " << slots);
    const step_result r = migrate_and_check(c, m, parallel_mode::ep, opt);
    if (r.ran) {
      ++ran;
      const step_result again = migrate_and_check(c, m, parallel_mode::tp, opt);
      (void)again;
    }
    // Whenever the EP view holds every sequence (placement fits), the rounds find a way at up
    // to 90% occupancy (compaction), with or without staging.
    // With a staging slot, or with 10% headroom on every owner of a not-tiny pool, the rounds
    // (compaction) find a way whenever the EP view holds every sequence.
    const bool headroom = r.rep.pages_needed * 10 <= r.rep.pages_available * 9 &&
                          r.rep.pages_available >= 20;
    // A nearly full pool moves about one page per round, staging slots or not (seed 147299290,
    // iter 45: 3413 pages a rank at 100%, 8 slots, 5121 rounds), so a large pool may need more
    // than max_rounds: there the same check without the cap must find the way.
    const bool round_capped = r.rep.reason.find("max_rounds") != std::string::npos;
    if (r.rep.holds && (slots > 0 || headroom)) {
      INFO(r.rep.reason);
      if (round_capped) {
        REQUIRE(c.occupancy >= 0.9);
        kv_migration_options uncapped = opt;
        uncapped.max_rounds = int64_t{1} << 20;
        CHECK(check_kv_capacity(g, c.state, parallel_mode::ep, uncapped).fits);
      } else {
        CHECK(r.rep.fits);
      }
      ++holds;
    }
  }
  CHECK(ran > 20);
  INFO("holds " << holds << " ran " << ran);
  CHECK(ran >= holds);
  (void)compacted;
}

// Regression (MOEBIUS_TEST_SEED=1707007438, iter 7 of the test above): TP->EP with replicated
// heads (H_kv=4 on P=8) at full occupancy, one staging slot. A replica's TP page that was read
// and freed kept its (rank, logical page) -> TP page entry; a later round moved another page's
// piece aside into the reused page, and when the first page's slice had its last read, the
// planner took that piece for the first page's unread replica: it listed a restore of the
// wrong bytes into it and freed it. The forward plan was right; rolling back any prefix that
// contains that round was not. Every prefix of every plan must roll back exactly (seed 9 of
// this generator failed after phase 5, seeds 24 and 43 too).
TEST_CASE("KV TP->EP with replicas rolls back after every round (full pool, one slot)",
          "[kv][migration][rollback]") {
  const kv_geometry g = make_kv_geometry(1, 4, 1, 16, 16, 8, dtype::fp8_e5m2);
  int64_t planned = 0;
  for (uint64_t seed = 0; seed < 64; ++seed) {
    std::mt19937_64 rng(seed);
    kv_case c = random_kv_case(rng, g, parallel_mode::tp, 1.0, 4096);
    kv_migration_options opt;
    opt.staging = {memory_space::arena, 0, kv_staging_slot_bytes(g, parallel_mode::ep)};
    if (!check_kv_capacity(g, c.state, parallel_mode::ep, opt).fits) continue;
    const kv_migration mig = plan_kv_migration(g, c.state, parallel_mode::ep, opt);
    ++planned;
    INFO("seed " << seed << " occupancy " << c.occupancy << " " << mig.stats);
    REQUIRE(find_phase_hazard(mig.copies) == "");
    const memory start = make_memory(rng, c, opt.staging.bytes);
    for (int64_t k = 0; k <= static_cast<int64_t>(mig.copies.phases.size()); ++k) {
      INFO("rollback after " << k << " of " << mig.copies.phases.size() << " rounds");
      memory m = start;
      host_transport tr(m.spans());
      plan prefix = mig.copies;
      prefix.phases.resize(static_cast<size_t>(k));
      tr.execute(prefix);
      if (k == static_cast<int64_t>(mig.copies.phases.size()))
        REQUIRE(check_reference(g, mig.new_state, c.content, m.kv) == "");
      tr.execute(rollback_plan(mig.copies, k));
      REQUIRE(check_reference(g, c.state, c.content, m.kv) == "");
    }
  }
  CHECK(planned > 16);
}

// The same property beyond two replicas per head: H_kv = 1, 2 on P = 8 (8 and 4 replicas)
// and on P = 4 (4 and 2), beside Qwen3's H_kv = 4 on P = 8. Each owner reads a slice from one
// replica; the others are dropped (first round) or freed with the slice's last read, and each
// is re-created on rollback from a replica that is read. A restore taken from a replica that
// is itself dropped (e.g. "the other one of its pair", right only with two replicas) brings
// back bytes a later round overwrote. Every prefix of every plan must roll back exactly.
TEST_CASE("KV TP->EP with 2, 4 and 8 replicas per head rolls back after every round",
          "[kv][migration][rollback][replicas]") {
  std::mt19937_64 rng(kv_test_seed() + 15);
  struct shape {
    int64_t heads;
    int ranks;
  };
  static constexpr shape shapes[] = {{1, 8}, {2, 8}, {4, 8}, {1, 4}, {2, 4}};
  for (const shape& sh : shapes) {
    int64_t planned = 0, multi_round = 0;
    for (int iter = 0; iter < 100 && (planned < 8 || (sh.heads > 1 && multi_round < 4)); ++iter) {
      const kv_geometry g = make_kv_geometry(
          uni(rng, 1, 2), sh.heads, pick_one(rng, {int64_t{1}, int64_t{2}}),
          pick_one(rng, {int64_t{1}, int64_t{4}, int64_t{16}}), uni(rng, 4, 16), sh.ranks,
          dtype::fp8_e5m2, uni(rng, 0, 1) ? kv_layout::hnd : kv_layout::nhd);
      REQUIRE(g.tp_replicas() == sh.ranks / sh.heads);
      kv_case c = random_kv_case(rng, g, parallel_mode::tp, pick_one(rng, {0.5, 0.9, 1.0}), 4096);
      kv_migration_options opt;
      opt.staging = {memory_space::arena, 0,
                     uni(rng, 0, 2) * kv_staging_slot_bytes(g, parallel_mode::ep)};
      if (!check_kv_capacity(g, c.state, parallel_mode::ep, opt).fits) continue;
      const kv_migration mig = plan_kv_migration(g, c.state, parallel_mode::ep, opt);
      ++planned;
      if (mig.stats.rounds >= 2) ++multi_round;
      INFO("H_kv " << sh.heads << " P " << sh.ranks << " iter " << iter << " " << g
                   << " occupancy " << c.occupancy << " " << mig.stats);
      REQUIRE(find_phase_hazard(mig.copies) == "");
      const memory start = make_memory(rng, c, opt.staging.bytes);
      REQUIRE(check_reference(g, c.state, c.content, start.kv) == "");
      for (int64_t k = 0; k <= static_cast<int64_t>(mig.copies.phases.size()); ++k) {
        INFO("rollback after " << k << " of " << mig.copies.phases.size() << " rounds");
        memory m = start;
        host_transport tr(m.spans());
        plan prefix = mig.copies;
        prefix.phases.resize(static_cast<size_t>(k));
        tr.execute(prefix);
        if (k == static_cast<int64_t>(mig.copies.phases.size()))
          REQUIRE(check_reference(g, mig.new_state, c.content, m.kv) == "");
        tr.execute(rollback_plan(mig.copies, k));
        // Every replica of every head, on every rank, back byte for byte.
        REQUIRE(check_reference(g, c.state, c.content, m.kv) == "");
      }
    }
    INFO("H_kv " << sh.heads << " P " << sh.ranks << ": " << planned << " planned, "
                 << multi_round << " in two or more rounds");
    CHECK(planned >= 8);
    // H_kv = 1: a TP page is the whole EP page, every owner keeps its own replica in place
    // (one round, the others dropped and restored on rollback).
    if (sh.heads > 1) CHECK(multi_round >= 4);
  }
}

TEST_CASE("KV switches succeed at 90% occupancy", "[kv][rounds]") {
  std::mt19937_64 rng(kv_test_seed() + 5);
  static constexpr int ranks[] = {2, 4, 8};
  static constexpr int64_t heads[] = {8, 32};
  static constexpr int64_t sizes[] = {1, 16};
  for (int iter = 0; iter < 16; ++iter) {
    const kv_layout layout = iter % 2 ? kv_layout::nhd : kv_layout::hnd;
    const kv_geometry g = make_kv_geometry(2, pick_one(rng, heads), 2, pick_one(rng, sizes),
                                           uni(rng, 40, 200), pick_one(rng, ranks), dtype::bf16,
                                           layout);
    kv_case c = random_kv_case(rng, g, parallel_mode::ep, 0.9, 4096, 4 * g.page_size);
    INFO(g << " occupancy " << c.occupancy);
    REQUIRE(c.occupancy >= 0.88);
    REQUIRE(c.occupancy <= 0.93);
    kv_migration_options opt;
    // NHD copies the owner's slice out before its page frees: one staging slot covers a rank
    // that happens to be full.
    if (layout == kv_layout::nhd)
      opt.staging = {memory_space::arena, 0, kv_staging_slot_bytes(g, parallel_mode::ep)};
    memory m = make_memory(rng, c, opt.staging.bytes);
    const step_result to_tp = migrate_and_check(c, m, parallel_mode::tp, opt);
    INFO(to_tp.rep.reason);
    REQUIRE(to_tp.ran);
    const step_result back = migrate_and_check(c, m, parallel_mode::ep, opt);
    INFO(back.rep.reason << " needed " << back.rep.pages_needed << " of "
                         << back.rep.pages_available);
    if (back.rep.holds && opt.staging.bytes > 0) CHECK(back.ran);
  }
}

TEST_CASE("KV capacity check: Qwen3 replication halves what TP holds", "[kv][capacity]") {
  // H_kv=4 on P=8: each head on 2 ranks, so TP holds at most 50% of the EP pool.
  const kv_geometry g = make_kv_geometry(2, 4, 2, 16, 64, 8, dtype::bf16);
  std::mt19937_64 rng(kv_test_seed() + 2);
  kv_case lo = random_kv_case(rng, g, parallel_mode::ep, 0.45, 4096);
  const kv_capacity_report a = check_kv_capacity(g, lo.state, parallel_mode::tp);
  INFO(a.reason << " occupancy " << lo.occupancy);
  // Up to 50% of the EP pool it holds. (Just above, it may still hold: seed
  // 15040159445931164224 draws 0.504 and holds; the exact bound near 50% is not asserted.)
  if (lo.occupancy <= 0.5) CHECK(a.holds);
  if (lo.occupancy <= 0.45) CHECK(a.fits);
  kv_case hi = random_kv_case(rng, g, parallel_mode::ep, 0.7, 4096);
  const kv_capacity_report b = check_kv_capacity(g, hi.state, parallel_mode::tp);
  INFO(b.reason << " occupancy " << hi.occupancy);
  if (hi.occupancy > 0.5) {
    CHECK_FALSE(b.holds);
    CHECK_FALSE(b.fits);
    CHECK(b.pages_needed > b.pages_available);
  }
}

TEST_CASE("KV EP->TP at 100% occupancy needs staging; with it, it succeeds", "[kv][rounds]") {
  const kv_geometry g = make_kv_geometry(1, 8, 2, 16, 32, 4, dtype::fp16);
  std::vector<std::vector<kv_sequence>> t(4);
  int64_t id = 0;
  for (int r = 0; r < 4; ++r)
    for (int64_t p = 0; p < 32; p += 4) {
      kv_sequence q;
      q.seq_id = id++;
      q.pages = {p, p + 1, p + 2, p + 3};
      q.num_tokens = 3 * 16 + 5;
      q.last_page_len = 5;
      t[static_cast<size_t>(r)].push_back(q);
    }
  kv_case c;
  c.g = g;
  c.state = make_kv_state(g, parallel_mode::ep, t);
  for (const auto& ts : t)
    for (const auto& q : ts) c.content[q.seq_id] = {};
  const kv_capacity_report none = check_kv_capacity(g, c.state, parallel_mode::tp);
  CHECK(none.holds);
  CHECK_FALSE(none.fits);
  kv_migration_options opt;
  opt.staging = {memory_space::arena, 0, 8 * kv_staging_slot_bytes(g, parallel_mode::tp)};
  std::mt19937_64 rng(kv_test_seed() + 3);
  memory m = make_memory(rng, c, opt.staging.bytes);
  const step_result r = migrate_and_check(c, m, parallel_mode::tp, opt);
  INFO(r.rep.reason);
  REQUIRE(r.ran);
  CHECK(r.rep.rounds > 1);
  const step_result back = migrate_and_check(c, m, parallel_mode::ep, opt);
  INFO(back.rep.reason);
  CHECK(back.ran);
}

TEST_CASE("KV EP->TP keeps the owner's slice in place (HND)", "[kv][migration]") {
  const kv_geometry g = make_kv_geometry(2, 8, 4, 16, 16, 4, dtype::bf16);
  kv_sequence q;
  q.seq_id = 5;
  q.pages = {3, 7};
  q.num_tokens = 20;
  q.last_page_len = 4;
  q.prefill_cursor = 17;
  std::vector<std::vector<kv_sequence>> tables(4);
  tables[2].push_back(q);
  const kv_state s = make_kv_state(g, parallel_mode::ep, tables);
  const kv_migration mig = plan_kv_migration(g, s, parallel_mode::tp);
  // Rank 2 owns it: its TP pages are 3*4+2 and 7*4+2, and nothing is copied on rank 2.
  REQUIRE(mig.new_state.ranks[2].sequences.at(0).pages == std::vector<int64_t>{14, 30});
  CHECK(mig.new_state.ranks[2].sequences.at(0).prefill_cursor == 17);
  for (const plan_phase& ph : mig.copies.phases)
    for (const copy_op& op : ph.ops) CHECK(op.dst_rank != 2);
  CHECK(mig.stats.rounds == 1);
  CHECK(mig.copies.num_ops() == 2 * 3);  // 2 pages x 3 other ranks, one op each (HND)
  // And the way back with the same owner is entirely in place.
  kv_placement pl;
  pl.owner = {2};
  pl.load = {0, 0, 2, 0};
  pl.fits = true;
  kv_migration_options opt;
  opt.placement = &pl;
  const kv_migration back = plan_kv_migration(g, mig.new_state, parallel_mode::ep, opt);
  CHECK(back.stats.pages_in_place == 2);
  REQUIRE(back.new_state.ranks[2].sequences.at(0).pages == std::vector<int64_t>{3, 7});
}

TEST_CASE("KV migration worked example of kv_migration.hpp (Qwen3, H_kv=4 on P=8)",
          "[kv][migration]") {
  const kv_geometry g = make_kv_geometry(1, 4, 128, 16, 8, 8);
  kv_sequence q;
  q.seq_id = 1;
  q.pages = {3, 7};
  q.num_tokens = 20;
  q.last_page_len = 4;
  std::vector<std::vector<kv_sequence>> tables(8);
  tables[2].push_back(q);
  const kv_state s = make_kv_state(g, parallel_mode::ep, tables);
  const kv_migration mig = plan_kv_migration(g, s, parallel_mode::tp);
  CHECK(mig.stats.rounds == 1);
  CHECK(mig.copies.num_ops() == 14);
  REQUIRE(mig.new_state.ranks[2].sequences.at(0).pages == std::vector<int64_t>{13, 29});
  for (const copy_op& op : mig.copies.phases.at(0).ops) {
    CHECK(op.src_rank == 2);
    CHECK(op.dst_rank != 2);
    CHECK(op.row_bytes == g.tp_page_bytes());
    CHECK(op.rows == 2);  // K and V of the one layer
    // Ranks 2k and 2k+1 receive head k: EP page piece (src offset within the page) = head.
    CHECK((op.src_offset % g.ep_page_bytes()) / g.tp_page_bytes() == op.dst_rank / 2);
  }
}

TEST_CASE("KV invalid tables are rejected before anything moves", "[kv][validate]") {
  std::mt19937_64 rng(kv_test_seed() + 4);
  const kv_geometry g = make_kv_geometry(2, 4, 2, 16, 32, 2, dtype::bf16);
  kv_case c = random_kv_case(rng, g, parallel_mode::ep, 0.5, 50);
  REQUIRE(!c.content.empty());
  memory m = make_memory(rng, c, 0);
  const pools before = m.kv;
  auto first = [&]() -> kv_sequence& {
    for (auto& r : c.state.ranks)
      if (!r.sequences.empty()) return r.sequences[0];
    FAIL("no sequence");
    return c.state.ranks[0].sequences[0];
  };
  // `says`: what the message must name (the broken constraint).
  auto expect_reject = [&](kv_state bad, const char* what, const char* says) {
    INFO(what);
    try {
      (void)plan_kv_migration(g, bad, parallel_mode::tp);
      FAIL("accepted an invalid state: " << what);
    } catch (const moebius::error& e) {
      CHECK(e.code() == errc::invalid_argument);
      INFO(e.what());
      CHECK(std::string(e.what()).find(says) != std::string::npos);
    }
    REQUIRE(m.kv == before);
  };
  {
    kv_state bad = c.state;
    kv_sequence& q = first();
    const int64_t keep = q.pages[0];
    q.pages[0] = g.num_ep_pages;
    bad = c.state;
    q.pages[0] = keep;
    expect_reject(bad, "page id out of range", "outside [0, 32) (EP pages per rank)");
  }
  {
    kv_sequence& q = first();
    const kv_sequence keep = q;
    q.last_page_len = 0;
    q.num_tokens = (q.num_pages() - 1) * g.page_size;
    kv_state bad = c.state;
    q = keep;
    expect_reject(bad, "last page length 0",
                  "needs 1 <= last_page_len <= page_size (last_page_len=0, page_size=16)");
    q.last_page_len = g.page_size + 1;
    q.num_tokens = q.num_pages() * g.page_size + 1;
    bad = c.state;
    q = keep;
    expect_reject(bad, "last page length > page size",
                  "needs 1 <= last_page_len <= page_size (last_page_len=17, page_size=16)");
    q.num_tokens += g.page_size;
    bad = c.state;
    q = keep;
    expect_reject(bad, "sequence longer than its pages",
                  "needs num_tokens == (pages-1)*page_size + last_page_len");
  }
  {
    // A page used twice without being marked shared (on any rank with a sequence: a full
    // rank too, or a seed whose only free pages lie on a rank without sequences changes
    // nothing and the valid state is rightly accepted).
    kv_state bad = c.state;
    for (auto& r : bad.ranks) {
      if (r.sequences.empty()) continue;
      kv_sequence q = r.sequences[0];
      q.seq_id = 1 << 30;
      q.shared_prefix_pages = 0;
      q.num_tokens = q.num_pages() * g.page_size;
      q.last_page_len = g.page_size;
      r.sequences.push_back(q);
      break;
    }
    expect_reject(bad, "page used twice unshared", "is used twice");
  }
  {
    kv_state bad = c.state;
    for (auto& r : bad.ranks)
      if (!r.free_pages.empty()) {
        r.free_pages.pop_back();
        break;
      }
    expect_reject(bad, "leaked page", "is neither free nor in use (leaked)");
  }
  {
    kv_state bad = c.state;
    for (auto& r : bad.ranks)
      if (!r.sequences.empty()) {
        r.free_pages.push_back(r.sequences[0].pages[0]);
        std::sort(r.free_pages.begin(), r.free_pages.end());
        break;
      }
    expect_reject(bad, "page both free and used", "is both free and in use");
  }
  // Bad geometry: P must divide H_kv; H_kv must divide P.
  CHECK_THROWS_AS(make_kv_geometry(1, 6, 8, 16, 4, 4), moebius::error);
  CHECK_THROWS_AS(make_kv_geometry(1, 3, 8, 16, 4, 8), moebius::error);
  CHECK_THROWS_AS(make_kv_geometry(1, 4, 8, 0, 4, 4), moebius::error);
}

TEST_CASE("find_phase_hazard finds overlapping destinations and sources", "[kv][hazard]") {
  auto op = [](int sr, int64_t so, int dr, int64_t d, int64_t rows, int64_t rb, int64_t sp,
               int64_t dp) {
    copy_op c;
    c.src_rank = sr;
    c.dst_rank = dr;
    c.src_offset = so;
    c.dst_offset = d;
    c.rows = rows;
    c.row_bytes = rb;
    c.src_pitch = sp;
    c.dst_pitch = dp;
    c.src_space = c.dst_space = memory_space::kv_pool;
    return c;
  };
  plan p;
  p.num_ranks = 2;
  p.phases.push_back({"ok", {op(0, 0, 1, 0, 2, 8, 16, 16), op(0, 8, 1, 8, 2, 8, 16, 16)}, {}});
  CHECK(find_phase_hazard(p) == "");
  p.phases.push_back({"dst-dst", {op(0, 0, 1, 0, 1, 8, 8, 8), op(0, 100, 1, 4, 1, 8, 8, 8)}, {}});
  CHECK(find_phase_hazard(p).find("phase 1") != std::string::npos);
  p.phases.pop_back();
  p.phases.push_back({"dst-src", {op(0, 0, 1, 64, 1, 8, 8, 8), op(1, 60, 0, 64, 1, 8, 8, 8)}, {}});
  CHECK(find_phase_hazard(p).find("phase 1") != std::string::npos);
  p.phases.pop_back();
  // Strided rows interleave without touching: fine. Reading the same bytes twice: fine.
  p.phases.push_back({"strided", {op(0, 0, 1, 0, 4, 4, 8, 8), op(0, 0, 1, 4, 4, 4, 8, 8)}, {}});
  CHECK(find_phase_hazard(p) == "");
  // Another memory space at the same offset: fine.
  copy_op a = op(0, 0, 1, 0, 1, 8, 8, 8);
  copy_op b = a;
  b.dst_space = memory_space::arena;
  p.phases.push_back({"spaces", {a, b}, {}});
  CHECK(find_phase_hazard(p) == "");
}

// The same property test over the engines' own layouts: each preset and random engine-like
// arrays (kv_layout_model.hpp), pools filled and checked through the independent model.
TEST_CASE("KV EP->TP->EP round trips in engine layouts (presets, random strides)",
          "[kv][migration][layout]") {
  std::mt19937_64 rng(kv_test_seed() + 11);
  static constexpr double occupancies[] = {0.1, 0.25, 0.5, 0.9, 1.0};
  const auto& presets = all_presets;
  int64_t round_trips = 0;
  for (int iter = 0; iter < 100; ++iter) {
    const kv_preset preset = presets[iter % 5];
    kv_geometry g = random_kv_geometry(rng, uni(rng, 1, 4) * 16384);
    const layout_model model = engine_model(rng, preset, g);
    REQUIRE(model.layout(g).ep == (preset == kv_preset::custom ? model.layout(g).ep
                                                               : kv_preset_layout(preset, g).ep));
    trial t = draw_trial(rng, g, parallel_mode::ep, pick_one(rng, occupancies), model);
    kv_case& c = t.c;
    memory& m = t.m;
    const kv_migration_options& opt = t.opt;
    INFO("iter " << iter << " " << to_string(preset) << " order " << model.order << " " << g
                 << " occupancy " << c.occupancy << " staging slots " << t.slots);
    REQUIRE(check_reference(g, c.state, c.content, m.kv, m.where()) == "");
    const step_result to_tp = migrate_and_check(c, m, parallel_mode::tp, opt);
    if (!to_tp.ran) continue;
    if (migrate_and_check(c, m, parallel_mode::ep, opt).ran) ++round_trips;
  }
  INFO("round trips " << round_trips);
  CHECK(round_trips > 30);
}

TEST_CASE("KV switches at 90% occupancy in each preset layout", "[kv][rounds][layout]") {
  std::mt19937_64 rng(kv_test_seed() + 12);
  for (kv_preset preset : {kv_preset::vllm_flash_attn, kv_preset::vllm_flashinfer,
                           kv_preset::sglang_mha}) {
    for (int iter = 0; iter < 4; ++iter) {
      const kv_layout inner =
          preset == kv_preset::sglang_mha || iter % 2 ? kv_layout::nhd : kv_layout::hnd;
      const kv_geometry g = make_kv_geometry(2, pick_one(rng, {int64_t{8}, int64_t{4}}), 2,
                                             pick_one(rng, {int64_t{1}, int64_t{16}}),
                                             uni(rng, 40, 120), pick_one(rng, {2, 4, 8}),
                                             dtype::bf16, inner);
      const layout_model model = preset_model(preset, g);
      kv_case c = random_kv_case(rng, g, parallel_mode::ep, 0.9, 4096, 4 * g.page_size);
      kv_migration_options opt;
      // Pools whose slices do not stay in place copy the owner's slice out first: one
      // staging slot covers a rank that happens to be full.
      if (!kv_slices_in_place(g, kv_preset_layout(preset, g)))
        opt.staging = {memory_space::arena, 0, kv_staging_slot_bytes(g, parallel_mode::ep)};
      memory m = make_memory(rng, c, opt.staging.bytes, &model);
      INFO(to_string(preset) << " " << g << " occupancy " << c.occupancy);
      REQUIRE(c.occupancy >= 0.88);
      const step_result to_tp = migrate_and_check(c, m, parallel_mode::tp, opt);
      INFO(to_tp.rep.reason);
      if (to_tp.rep.holds) REQUIRE(to_tp.ran);
      if (!to_tp.ran) continue;
      const step_result back = migrate_and_check(c, m, parallel_mode::ep, opt);
      INFO(back.rep.reason);
      if (back.rep.holds && opt.staging.bytes > 0) CHECK(back.ran);
    }
  }
}

TEST_CASE("KV plans in the present layout are unchanged by the layout overload",
          "[kv][migration][layout]") {
  std::mt19937_64 rng(kv_test_seed() + 13);
  for (int iter = 0; iter < 30; ++iter) {
    const kv_geometry g = random_kv_geometry(rng, uni(rng, 1, 4) * 16384);
    const kv_case c = random_kv_case(rng, g, parallel_mode::ep, 0.5, 100);
    const kv_pool_layout present = present_kv_layout(g);
    if (!check_kv_capacity(g, c.state, parallel_mode::tp).fits) continue;
    const kv_migration a = plan_kv_migration(g, c.state, parallel_mode::tp);
    const kv_migration b = plan_kv_migration(g, present, c.state, parallel_mode::tp);
    REQUIRE(a.copies == b.copies);
    // And a packed vLLM FlashAttention cache is the present pool: the same ops.
    REQUIRE(plan_kv_migration(g, vllm_flash_attn_layout(g), c.state, parallel_mode::tp).copies ==
            a.copies);
  }
}

TEST_CASE("KV round trips in per-layer NHD arrays with more layers than tokens in a page",
          "[kv][migration][layout]") {
  // Layers not evenly spaced against K|V (padded per-layer buffers) and page_size < layers: a
  // head slice is one op per (K|V, token) over the layers, not one per tensor; every byte of
  // every live page still lands (migrate_and_check), and the op count says which form it took.
  std::mt19937_64 rng(kv_test_seed() + 14);
  int64_t round_trips = 0;
  for (int iter = 0; iter < 12; ++iter) {
    const int64_t layers = uni(rng, 9, 24);
    const int P = pick_one(rng, {2, 4});
    const kv_geometry g =
        make_kv_geometry(layers, 8, pick_one(rng, {int64_t{2}, int64_t{4}}), 4, uni(rng, 12, 30),
                         P, dtype::bf16, kv_layout::nhd);
    layout_model model;
    model.order = "LKPTHD";
    model.pad[0] = dtype_bytes(g.type) * uni(rng, 1, 40);  // layer stride != 2 x K|V stride
    model.base = dtype_bytes(g.type) * 8 * uni(rng, 0, 3);
    kv_case c = random_kv_case(rng, g, parallel_mode::ep, pick_one(rng, {0.25, 0.5}), 64);
    memory m = make_memory(rng, c, 0, &model);
    INFO("iter " << iter << " " << g << " occupancy " << c.occupancy);
    if (!check_kv_capacity(g, m.layout, c.state, parallel_mode::tp).fits) continue;
    const kv_migration to_tp = plan_kv_migration(g, m.layout, c.state, parallel_mode::tp);
    // EP->TP moves every head slice of each page (NHD slices do not stay in place: the
    // owner's own goes to a TP page of its own): 2 x page_size ops each.
    REQUIRE_FALSE(kv_slices_in_place(g, m.layout));
    int64_t pieces = 0;
    for (int r = 0; r < P; ++r) pieces += used_pages(g, c.state, r) * P;
    CHECK(to_tp.copies.num_ops() == pieces * 2 * g.page_size);
    if (!migrate_and_check(c, m, parallel_mode::tp, {}).ran) continue;
    if (migrate_and_check(c, m, parallel_mode::ep, {}).ran) ++round_trips;
  }
  CHECK(round_trips > 6);
}

// ---- decode context parallel (dcp) ------------------------------------------------------------
// The model these check against is kv_reference.hpp (a sequence's logical page k*dcp + r%dcp on
// TP rank r, offsets from sizes alone) and kv_layout_model.hpp (engine arrays): neither calls the
// library's page arithmetic.

namespace {

// A geometry whose TP view has a random allowed dcp, > 1 whenever one is allowed.
kv_geometry random_dcp_geometry(std::mt19937_64& rng, int64_t budget) {
  for (;;) {
    kv_geometry g = random_kv_geometry(rng, budget);
    if (g.tp_replicas() == 1 && uni(rng, 0, 3) != 0) continue;  // mostly geometries with a choice
    g = random_dcp(rng, g);
    if (g.tp_replicas() > 1 && g.dcp == 1) g.dcp = g.tp_replicas();
    return g;
  }
}

}  // namespace

TEST_CASE("KV with dcp: round trips in every layout put every byte where the model says",
          "[kv][migration][dcp]") {
  std::mt19937_64 rng(kv_test_seed() + 40);
  static constexpr double occupancies[] = {0.1, 0.5, 0.9, 0.99, 1.0};
  const auto& presets = all_presets;
  int64_t round_trips = 0, split_trips = 0, tp_starts = 0;
  for (int iter = 0; iter < 160; ++iter) {
    const kv_preset preset = presets[iter % 5];
    kv_geometry g = random_dcp_geometry(rng, uni(rng, 1, 4) * 16384);
    const layout_model model = engine_model(rng, preset, g);
    const bool tp_start = uni(rng, 0, 3) == 0;
    trial t = draw_trial(rng, g, tp_start ? parallel_mode::tp : parallel_mode::ep,
                         pick_one(rng, occupancies), model);
    kv_case& c = t.c;
    memory& m = t.m;
    const kv_migration_options& opt = t.opt;
    INFO("iter " << iter << " " << to_string(preset) << " order " << model.order << " " << g
                 << " from " << to_string(c.state.mode) << " occupancy " << c.occupancy
                 << " staging slots " << t.slots);
    REQUIRE(check_reference(g, c.state, c.content, m.kv, m.where()) == "");
    const parallel_mode first = tp_start ? parallel_mode::ep : parallel_mode::tp;
    const parallel_mode second = tp_start ? parallel_mode::tp : parallel_mode::ep;
    int64_t live = 0;  // pages in use before the switch, all ranks
    for (int r = 0; r < g.num_ranks; ++r) live += used_pages(g, c.state, r);
    const step_result a = migrate_and_check(c, m, first, opt);
    if (!a.ran) continue;
    if (first == parallel_mode::tp && g.dcp == g.tp_replicas()) {
      // No replica left: the TP pages in use are the live EP pages' slices, each on one rank.
      int64_t tp_used = 0;
      for (int r = 0; r < g.num_ranks; ++r) tp_used += used_pages(g, c.state, r);
      CHECK(tp_used == live * g.tp_pages_per_ep_page());
    }
    tp_starts += tp_start;
    if (migrate_and_check(c, m, second, opt).ran) {
      ++round_trips;
      split_trips += g.dcp > 1;
    }
  }
  INFO("round trips " << round_trips << " with dcp > 1 " << split_trips << " from TP "
                      << tp_starts);
  CHECK(round_trips > 40);
  CHECK(split_trips > 25);
  CHECK(tp_starts > 5);
}

TEST_CASE("KV with dcp: EP->TP(dcp = P/H_kv) at 90% occupancy: the check is the model's, and what holds runs",
          "[kv][rounds][dcp]") {
  std::mt19937_64 rng(kv_test_seed() + 41);
  static constexpr int ranks[] = {2, 4, 8};
  int64_t ran = 0;
  for (int iter = 0; iter < 32; ++iter) {
    const kv_layout layout = iter % 2 ? kv_layout::nhd : kv_layout::hnd;
    const int P = pick_one(rng, ranks);
    const int64_t H = iter % 4 < 2 ? 1 : (iter % 4 == 2 ? 0 : std::max(1, P / 2));  // incl. latent
    kv_geometry g = make_kv_geometry(2, H, 2, pick_one(rng, {int64_t{1}, int64_t{16}}),
                                     uni(rng, 40, 200), P, dtype::bf16, layout);
    g = with_dcp(g, g.tp_replicas());
    // The interleave puts every sequence's first page on DCP index 0, so index 0 holds up to
    // one page a sequence more than another (kv_geometry.hpp): with many short sequences at
    // 90% occupancy it may not hold, which the check must say.
    kv_case c = random_kv_case(rng, g, parallel_mode::ep, 0.9, 4096, 64 * g.page_size);
    INFO(g << " occupancy " << c.occupancy);
    kv_migration_options opt;
    opt.staging = {memory_space::arena, 0, kv_staging_slot_bytes(g, parallel_mode::ep)};
    memory m = make_memory(rng, c, opt.staging.bytes);
    // The model's need: logical page k of a sequence on DCP index k % dcp, each distinct EP
    // page once, one TP page per piece on the receiving rank.
    std::vector<std::set<std::pair<int, int64_t>>> need(static_cast<size_t>(g.dcp));
    for (int r = 0; r < g.num_ranks; ++r)
      for (const kv_sequence& q : c.state.ranks[static_cast<size_t>(r)].sequences)
        for (size_t k = 0; k < q.pages.size(); ++k)
          need[k % static_cast<size_t>(g.dcp)].emplace(r, q.pages[k]);
    size_t busiest = 0;
    for (const auto& n : need) busiest = std::max(busiest, n.size());
    const auto available = static_cast<size_t>(g.num_tp_pages());
    const step_result to_tp = migrate_and_check(c, m, parallel_mode::tp, opt);
    INFO(to_tp.rep.reason << " needed " << to_tp.rep.pages_needed << " of "
                          << to_tp.rep.pages_available << "; the model: " << busiest);
    REQUIRE(to_tp.rep.pages_needed == static_cast<int64_t>(busiest));
    REQUIRE(to_tp.rep.holds == (busiest <= available));
    // HND: whatever holds near full occupancy also runs (its slices free piece by piece).
    // NHD copies the owner's slice out and frees an EP page only when every piece left: near
    // full, ranks may wait on each other beyond one staging slot (as with dcp 1, kv_migration.hpp):
    // then the check must say so and name the way out.
    if (!to_tp.rep.holds) continue;
    if (layout == kv_layout::hnd) REQUIRE(to_tp.ran);
    if (!to_tp.ran) {
      CHECK_THAT(to_tp.rep.reason, Catch::Matchers::Contains("lend a staging region"));
      continue;
    }
    ++ran;
    const step_result back = migrate_and_check(c, m, parallel_mode::ep, opt);
    INFO(back.rep.reason);
    if (back.rep.holds) CHECK(back.ran);
  }
  CHECK(ran >= 4);  // the first-page bias and NHD's waits: seeds show 5-15 of 32 running
}

TEST_CASE("KV with dcp: per-layer plans shifted to each layer do what the whole plan does",
          "[kv][migration][dcp]") {
  std::mt19937_64 rng(kv_test_seed() + 42);
  static constexpr kv_preset presets[] = {kv_preset::present, kv_preset::vllm_flash_attn,
                                          kv_preset::vllm_flashinfer, kv_preset::sglang_mha};
  int64_t ran = 0;
  for (int iter = 0; iter < 40; ++iter) {
    const kv_preset preset = presets[iter % 4];
    kv_geometry g = random_dcp_geometry(rng, uni(rng, 1, 4) * 16384);
    g.num_layers = uni(rng, 2, 3);
    if (preset == kv_preset::sglang_mha) g.layout = kv_layout::nhd;
    g.num_ep_pages = std::clamp<int64_t>(g.num_ep_pages, 2, 256);
    validate(g);
    kv_geometry one = g;
    one.num_layers = 1;
    const layout_model model = preset_model(preset, g);
    const kv_pool_layout layout = model.layout(g);
    const bool tp_start = iter % 3 == 0;
    kv_case c = random_kv_case(rng, g, tp_start ? parallel_mode::tp : parallel_mode::ep, 0.5, 100);
    INFO("iter " << iter << " " << to_string(preset) << " " << g << " from "
                 << to_string(c.state.mode));
    const parallel_mode target = tp_start ? parallel_mode::ep : parallel_mode::tp;
    const kv_migration_attempt whole = try_plan_kv_migration(g, layout, c.state, target);
    const kv_migration_attempt layer = try_plan_kv_migration(one, layout, c.state, target);
    REQUIRE(whole.capacity.fits == layer.capacity.fits);
    if (!whole.migration) continue;
    // Without staging a plan's page decisions do not depend on the layer count.
    REQUIRE(whole.migration->new_state == layer.migration->new_state);
    memory m = make_memory(rng, c, 0, &model);
    host_transport tr(m.spans());
    for (int64_t l = 0; l < g.num_layers; ++l)
      tr.execute(shifted_to_layer(layer.migration->copies, layout, l));
    REQUIRE(check_reference(g, whole.migration->new_state, c.content, m.kv, m.where()) == "");
    ++ran;
  }
  CHECK(ran > 15);
}

// Qwen3-235B's heads (H_kv = 4, head_dim 128, bf16, page 16) on P = 8, 2 layers, EP filled to
// 30% (TP with dcp 1 holds half of EP), for each preset and order in turn from `rng`: each
// layout's EP->TP plan with dcp 1 and with dcp 2, 4 staging slots a rank.
template <class Each>
void qwen3_ep_to_tp_at_30_percent(std::mt19937_64& rng, Each each) {
  for (kv_preset preset : {kv_preset::present, kv_preset::vllm_flash_attn,
                           kv_preset::vllm_flashinfer}) {
    for (kv_layout order : {kv_layout::hnd, kv_layout::nhd}) {
      const kv_geometry g = make_kv_geometry(2, 4, 128, 16, 96, 8, dtype::bf16, order);
      const kv_geometry g2 = with_dcp(g, 2);
      const kv_case c = random_kv_case(rng, g, parallel_mode::ep, 0.3, 4096, 16 * 16);
      // Layouts that copy the owner's slice out (NHD, FlashInfer) may need a staging slot on a
      // full rank (kv_migration.hpp); staged pieces are copied twice, counted in both.
      kv_migration_options opt;
      opt.staging = {memory_space::arena, 0, 4 * kv_staging_slot_bytes(g, parallel_mode::tp)};
      INFO(to_string(preset) << " " << to_string(order));
      const kv_migration today = plan_kv_migration(g, kv_preset_layout(preset, g), c.state,
                                                   parallel_mode::tp, opt);
      const kv_migration split = plan_kv_migration(g2, kv_preset_layout(preset, g2), c.state,
                                                   parallel_mode::tp, opt);
      each(preset, order, today, split);
    }
  }
}

TEST_CASE("KV EP->TP with interleaved slices: a full rank's own pages always leave (seeds that "
          "were stuck)",
          "[kv][migration][staging]") {
  // With these seeds one rank was full (no free TP page) and every staging slot on it held
  // another rank's piece, waiting for that rank's pages, which could not leave (their own slice
  // needs a page of the same rank): "EP->TP is stuck". A rank's last slot is now kept for its
  // own pages' pieces.
  for (const uint64_t seed : {2813600689ull, 3888971983ull, 723966289ull}) {
    std::mt19937_64 rng(seed + 43);
    int planned = 0;
    qwen3_ep_to_tp_at_30_percent(rng, [&](kv_preset, kv_layout, const kv_migration& today,
                                          const kv_migration& split) {
      CHECK(today.stats.bytes_copied > 0);
      CHECK(split.stats.bytes_copied > 0);
      ++planned;
    });
    CHECK(planned == 6);
  }
}

TEST_CASE("KV with dcp 2: an EP->TP switch moves at most 0.55x the bytes of today's (Qwen3)",
          "[kv][migration][dcp]") {
  // 2 layers stand for 94 (bytes scale with L alike in both).
  std::mt19937_64 rng(kv_test_seed() + 43);
  qwen3_ep_to_tp_at_30_percent(rng, [](kv_preset preset, kv_layout order,
                                       const kv_migration& today, const kv_migration& split) {
    const double ratio = static_cast<double>(split.stats.bytes_copied) /
                         static_cast<double>(today.stats.bytes_copied);
    std::cout << "EP->TP(dcp 2) / EP->TP bytes, " << to_string(preset) << " "
              << to_string(order) << ": " << split.stats.bytes_copied << " / "
              << today.stats.bytes_copied << " = " << ratio << std::endl;
    INFO(to_string(preset) << " " << to_string(order) << " ratio " << ratio);
    CHECK(ratio <= 0.55);
    CHECK(ratio >= 0.45);
  });
}

TEST_CASE("KV capacity at the paper's deployment: TP(dcp 2) holds >= 0.99x EP's tokens",
          "[kv][capacity][dcp]") {
  // DESIGN.md §8: Qwen3-235B-A22B (L = 94, 4 KV heads, head_dim 128, bf16) on 8 H200s at memory
  // fraction 0.85 of 143,771 MiB; an EP rank's weights are 72.7 GB, the rest is its KV pool,
  // one pool per rank that both views read. Page size 16 (vLLM's and SGLang's default for
  // FlashAttention).
  const int64_t hbm = int64_t{143771} * 1024 * 1024;
  const auto budget = static_cast<int64_t>(0.85 * static_cast<double>(hbm)) - int64_t{72700000000};
  kv_geometry g = make_kv_geometry(94, 4, 128, 16, 1, 8);
  g.num_ep_pages = ep_pages_for_bytes(g, budget);
  validate(g);
  const kv_geometry g2 = with_dcp(g, 2);
  const auto ratio = [](int64_t a, int64_t b) { return static_cast<double>(a) / static_cast<double>(b); };
  const double tp1 = ratio(g.max_tokens(parallel_mode::tp), g.max_tokens(parallel_mode::ep));
  const double tp2 = ratio(g2.max_tokens(parallel_mode::tp), g2.max_tokens(parallel_mode::ep));
  std::cout << "paper deployment: KV pool " << g.pool_bytes() << " B a rank, EP view "
            << g.max_tokens(parallel_mode::ep) << " tokens, TP view " << g.max_tokens(parallel_mode::tp)
            << " (" << tp1 << "x), TP(dcp 2) " << g2.max_tokens(parallel_mode::tp) << " (" << tp2
            << "x)" << std::endl;
  CHECK(tp1 == 0.5);
  CHECK(tp2 >= 0.99);
  // A served state: the paper's 2,048 running requests fill 99% of the EP pages (rollout-like
  // lengths up to 32k tokens), and the capacity check (pages a share needs against its pool,
  // each sequence's odd page on DCP index 0 included) says TP(dcp 2) holds it all, TP does not.
  std::mt19937_64 rng(kv_test_seed() + 44);
  kv_geometry small = g;
  small.num_layers = 1;  // the tables do not depend on L; the check's rounds are planned on it
  // Filled to 99% of the EP pages (a draw overshoots by up to one sequence: draw again).
  kv_case c;
  for (int tries = 0; tries < 50 && !(c.occupancy >= 0.985 && c.occupancy <= 0.991); ++tries)
    c = random_kv_case(rng, small, parallel_mode::ep, 0.985, 2048);
  int64_t tokens = 0;
  for (const kv_rank_state& r : c.state.ranks)
    for (const kv_sequence& q : r.sequences) tokens += q.num_tokens;
  const double held = ratio(tokens, g.max_tokens(parallel_mode::ep));
  INFO("EP pages used " << c.occupancy << ", tokens " << held << " of the EP view");
  const kv_capacity_report one = check_kv_capacity(small, c.state, parallel_mode::tp);
  const kv_capacity_report two = check_kv_capacity(with_dcp(small, 2), c.state, parallel_mode::tp);
  std::cout << "paper deployment, " << c.content.size() << " sequences filling " << c.occupancy
            << " of the EP pages (" << held << " of its tokens): TP needs " << one.pages_needed
            << " of " << one.pages_available << " pages a rank, TP(dcp 2) "
            << two.pages_needed << " of " << two.pages_available << std::endl;
  REQUIRE(c.occupancy >= 0.985);
  REQUIRE(c.occupancy <= 0.991);
  CHECK_FALSE(one.holds);
  INFO(two.reason);
  CHECK(two.holds);
}

TEST_CASE("KV with dcp: a worked example (Qwen3, dcp 2, one 5-page sequence)", "[kv][migration][dcp]") {
  // Rank 2 owns pages {3, 7, 8, 9, 11}; with dcp 2, logical pages 0, 2, 4 (EP pages 3, 8, 11)
  // go to DCP index 0 (ranks 0, 2, 4, 6: one per head) and 1, 3 (7, 9) to index 1 (1, 3, 5, 7).
  const kv_geometry g = with_dcp(make_kv_geometry(1, 4, 8, 16, 16, 8), 2);
  kv_sequence q;
  q.seq_id = 1;
  q.pages = {3, 7, 8, 9, 11};
  q.num_tokens = 4 * 16 + 5;
  q.last_page_len = 5;
  std::vector<std::vector<kv_sequence>> tables(8);
  tables[2].push_back(q);
  const kv_state s = make_kv_state(g, parallel_mode::ep, tables);
  const kv_migration mig = plan_kv_migration(g, s, parallel_mode::tp);
  for (int r = 0; r < 8; ++r)
    CHECK(mig.new_state.ranks[static_cast<size_t>(r)].sequences.at(0).num_pages() == (r % 2 == 0 ? 3 : 2));
  // Rank 2 (head 1, DCP index 0) keeps its head of pages 3, 8, 11 in place: TP pages 3*4+1, ..
  CHECK(mig.new_state.ranks[2].sequences[0].pages == std::vector<int64_t>{13, 33, 45});
  CHECK(mig.stats.pages_in_place == 3);
  // 3 pages x 3 other heads + 2 pages x 4 heads = 17 slices (dcp 1: 5 x 7 = 35).
  CHECK(mig.copies.num_ops() == 17);
  CHECK(plan_kv_migration(make_kv_geometry(1, 4, 8, 16, 16, 8), s, parallel_mode::tp)
            .copies.num_ops() == 35);
}
