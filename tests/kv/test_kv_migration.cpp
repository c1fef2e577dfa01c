// EP->TP->EP migrations of random KV states through host_transport, checked element by element
// against the naive reference (kv_reference.hpp).

#include <algorithm>
#include <cstring>
#include <random>

#include "kv_cases.hpp"
#include "kv_layout_model.hpp"
#include "kv_reference.hpp"
#include "moebius/kv/kv_migration.hpp"
#include "moebius/plan/rollback.hpp"
#include "moebius/transport/host_transport.hpp"
#include "support/catch.hpp"

using namespace moebius;
using namespace moebius::testing;

namespace {

struct memory {
  pools kv;     // [P][pool_bytes]
  pools arena;  // [P][staging bytes]
  // The pool's layout and the model's offsets (present: the library default and ref_offset).
  kv_pool_layout layout;
  ref_offset_fn model;
  const ref_offset_fn* where() const { return model ? &model : nullptr; }

  std::vector<rank_memory> spans() {
    std::vector<rank_memory> out(kv.size());
    for (size_t r = 0; r < kv.size(); ++r) {
      out[r].spaces[static_cast<int>(memory_space::kv_pool)] = kv[r];
      out[r].spaces[static_cast<int>(memory_space::arena)] = arena[r];
    }
    return out;
  }
};

// Random bytes everywhere (a page a plan forgets to write then differs), then the reference.
// `model` (optional): the pool is that engine array instead of the present layout.
memory make_memory(std::mt19937_64& rng, const kv_case& c, int64_t staging_bytes,
                   const layout_model* model = nullptr) {
  memory m;
  m.layout = present_kv_layout(c.g);
  if (model) {
    m.layout = model->layout(c.g);
    m.model = [g = c.g, md = *model](parallel_mode mode, int64_t l, int64_t kv, int64_t p,
                                     int64_t h, int64_t t, int64_t d) {
      return md.offset(g, mode, l, kv, p, h, t, d);
    };
  }
  m.kv.assign(static_cast<size_t>(c.g.num_ranks),
              std::vector<std::byte>(static_cast<size_t>(m.layout.pool_bytes)));
  m.arena.assign(static_cast<size_t>(c.g.num_ranks),
                 std::vector<std::byte>(static_cast<size_t>(staging_bytes + 64)));
  for (auto* ps : {&m.kv, &m.arena})
    for (auto& p : *ps)
      for (auto& b : p) b = static_cast<std::byte>(rng() & 0xFF);
  fill_reference(c.g, c.state, c.content, m.kv, m.where());
  return m;
}

// Same sequences, tokens, sharing and cursors in both states (pages differ).
void require_same_sequences(const kv_state& a, const kv_state& b) {
  auto collect = [](const kv_state& s) {
    std::vector<kv_sequence> all;
    for (const kv_rank_state& r : s.ranks)
      for (kv_sequence q : r.sequences) {
        q.pages.clear();
        all.push_back(q);
      }
    std::sort(all.begin(), all.end(),
              [](const kv_sequence& x, const kv_sequence& y) { return x.seq_id < y.seq_id; });
    all.erase(std::unique(all.begin(), all.end()), all.end());  // TP: one per rank
    return all;
  };
  REQUIRE(collect(a) == collect(b));
}

struct step_result {
  bool ran = false;
  kv_capacity_report rep;
};

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
  if (target == parallel_mode::tp && m.layout.preset == kv_preset::present &&
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
    opt.staging = {memory_space::arena, uni(rng, 0, 64),
                   slots * std::max(kv_staging_slot_bytes(g, parallel_mode::tp),
                                    kv_staging_slot_bytes(g, parallel_mode::ep))};
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
  static constexpr kv_preset presets[] = {kv_preset::present, kv_preset::vllm_flash_attn,
                                          kv_preset::vllm_flashinfer, kv_preset::sglang_mha,
                                          kv_preset::custom};
  int64_t round_trips = 0;
  for (int iter = 0; iter < 100; ++iter) {
    const kv_preset preset = presets[iter % 5];
    kv_geometry g = random_kv_geometry(rng, uni(rng, 1, 4) * 16384);
    if (preset == kv_preset::sglang_mha) g.layout = kv_layout::nhd;
    const layout_model model =
        preset == kv_preset::custom ? random_layout_model(rng, g) : preset_model(preset, g);
    REQUIRE(model.layout(g).ep == (preset == kv_preset::custom ? model.layout(g).ep
                                                               : kv_preset_layout(preset, g).ep));
    kv_case c = random_kv_case(rng, g, parallel_mode::ep, pick_one(rng, occupancies),
                               pick_one(rng, {int64_t{1}, int64_t{7}, int64_t{100}, int64_t{4096}}));
    kv_migration_options opt;
    const int64_t slots = pick_one(rng, {int64_t{0}, int64_t{1}, int64_t{4}});
    opt.staging = {memory_space::arena, uni(rng, 0, 64),
                   slots * std::max(kv_staging_slot_bytes(g, parallel_mode::tp),
                                    kv_staging_slot_bytes(g, parallel_mode::ep))};
    memory m = make_memory(rng, c, opt.staging.bytes, &model);
    INFO("iter " << iter << " " << to_string(preset) << " order " << model.order << " " << g
                 << " occupancy " << c.occupancy << " staging slots " << slots);
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
