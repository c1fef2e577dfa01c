// TP(dcp a) -> TP(dcp b) (kv/dcp_change.hpp) over random geometries (H_kv < P and latent, HND
// and NHD, every engine preset and random engine arrays, P up to 12 so that dcp pairs that do
// not divide each other occur), for every allowed pair (a, b), whole and per layer, up to full
// occupancy, checked against a model written from the interleave rule alone: logical page i of
// a sequence is on the ranks x of a head slice (x = r % R, R = ranks per slice) with
// i % dcp == x % dcp (kv_reference.hpp reads the pools the same way). Faults at every phase
// roll back every byte that holds a token (free pages and the slots past a sequence's last
// token may hold anything, as rollback.hpp says).

#include <algorithm>
#include <map>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "kv_cases.hpp"
#include "kv_layout_model.hpp"
#include "kv_memory.hpp"
#include "kv_reference.hpp"
#include "moebius/error.hpp"
#include "moebius/kv/dcp_change.hpp"
#include "moebius/plan/rollback.hpp"
#include "moebius/transport/host_transport.hpp"
#include "support/catch.hpp"

using namespace moebius;
using namespace moebius::testing;

namespace {

// The model (kv_reference.hpp: ref_dcp_moves, ref_tp_page_bytes, check_reference) is written
// from the rule and shares nothing with the library's arithmetic.

std::vector<int64_t> divisors(int64_t n) {
  std::vector<int64_t> out;
  for (int64_t d = 1; d <= n; ++d)
    if (n % d == 0) out.push_back(d);
  return out;
}

int64_t one_of(std::mt19937_64& rng, const std::vector<int64_t>& v) {
  return v[static_cast<size_t>(uni(rng, 0, static_cast<int64_t>(v.size()) - 1))];
}

// A geometry whose TP view replicates (H_kv < P, or latent), P in {2, 4, 6, 8, 12}, pool about
// `budget` bytes a rank.
kv_geometry random_replicated_geometry(std::mt19937_64& rng, int64_t budget) {
  static constexpr int64_t ranks[] = {2, 4, 6, 8, 12};
  kv_geometry g = random_kv_geometry(rng, budget);  // then its P and H_kv redrawn
  g.num_ranks = static_cast<int>(pick_one(rng, ranks));
  std::vector<int64_t> heads{0};  // latent, and every H_kv < P that divides P
  for (int64_t h : divisors(g.num_ranks))
    if (h < g.num_ranks) heads.push_back(h);
  g.num_kv_heads = one_of(rng, heads);
  g.num_ep_pages = 1;
  g.num_ep_pages = std::clamp<int64_t>(budget / g.pool_bytes(), 2, 512);
  validate(g);
  return g;
}

// A state at dcp a whose busiest rank at dcp b needs about `target_fill` of its pages (the
// source fill scaled by b's share over a's: dcp a -> b multiplies a rank's pages by about a/b).
kv_case random_case(std::mt19937_64& rng, const kv_geometry& ga, int64_t b, double target_fill) {
  const double fill = std::min(1.0, target_fill * static_cast<double>(b) /
                                        static_cast<double>(ga.dcp));
  return random_kv_case(rng, ga, parallel_mode::tp, fill,
                        pick_one(rng, {int64_t{3}, int64_t{40}, int64_t{4096}}));
}

struct counts {
  int64_t planned = 0, refused = 0, two_rounds = 0, no_copy = 0, near_full = 0, faults = 0;
};

// Plans a -> b for `c` over `m`, checks it against the model, runs it with a fault at every
// phase (rolled back exactly), then whole; `c` and `m` end at dcp b when it planned.
void change_and_check(kv_case& c, memory& m, int64_t b, std::mt19937_64& rng, counts& n) {
  const kv_geometry& g = c.g;
  const int64_t a = g.dcp;
  const int64_t N = g.num_ep_pages * ref_split(g);  // TP pages a rank
  const std::vector<ref_rank_moves> moves = ref_dcp_moves(g, c.state, c.content, a, b);
  int64_t need = 0, received = 0, kept = 0;
  bool waits = false;  // a rank receives more than it has free: a second round
  for (int r = 0; r < g.num_ranks; ++r) {
    const ref_rank_moves& mv = moves[static_cast<size_t>(r)];
    need = std::max(need, mv.kept + mv.received);
    received += mv.received;
    kept += mv.kept;
    const auto free = c.state.ranks[static_cast<size_t>(r)].free_pages.size();
    waits |= mv.received > static_cast<int64_t>(free);
  }
  const kv_migration_attempt at = try_plan_kv_dcp_change(g, m.layout, c.state, b);
  INFO("dcp " << a << " -> " << b << " need " << need << " of " << N << ": "
              << at.capacity.reason);
  REQUIRE(at.capacity.pages_needed == need);
  REQUIRE(at.capacity.pages_available == N);
  if (need > N) {  // the target cannot hold it: refused by the check, and nothing moves
    REQUIRE_FALSE(at.capacity.holds);
    REQUIRE_FALSE(at.migration);
    CHECK_THAT(at.capacity.reason, Catch::Matchers::Contains("TP rank"));
    try {
      (void)plan_kv_dcp_change(g, m.layout, c.state, b);
      FAIL("expected errc::capacity");
    } catch (const moebius::error& e) {
      CHECK(e.code() == errc::capacity);
    }
    ++n.refused;
    return;
  }
  // Whatever the target holds plans, at any occupancy, in at most two rounds, never staged.
  REQUIRE(at.capacity.fits);
  REQUIRE(at.migration);
  const kv_migration& mig = *at.migration;
  INFO(mig.stats);
  const kv_geometry gb = with_dcp(g, b);
  REQUIRE(mig.new_state.mode == parallel_mode::tp);
  REQUIRE_NOTHROW(validate(gb, mig.new_state));
  require_same_sequences(c.state, mig.new_state);
  REQUIRE(find_phase_hazard(mig.copies) == "");
  CHECK(mig.stats.pages_moved == received);
  CHECK(mig.stats.pages_in_place == kept);
  CHECK(mig.stats.pages_staged == 0);
  CHECK(mig.stats.bytes_copied == received * ref_tp_page_bytes(g));
  CHECK(mig.stats.rounds == (received == 0 ? 0 : waits ? 2 : 1));
  REQUIRE(static_cast<int64_t>(mig.copies.phases.size()) == mig.stats.rounds);
  // Every byte moves between ranks (a rank never copies to itself) and is counted per rank.
  CHECK(traffic_of(mig.copies).total_bytes_sent() == mig.stats.bytes_copied);
  n.two_rounds += mig.stats.rounds == 2;
  n.no_copy += received == 0;
  n.near_full += need * 10 >= N * 9;

  host_transport tr(m.spans());
  const pools before = m.kv;
  const auto tokenless = tokenless_bytes(g, c.state, m.layout.pool_bytes, m.where());
  for (size_t k = 0; k < mig.copies.phases.size(); ++k) {
    const auto& ops = mig.copies.phases[k].ops;
    if (ops.empty()) continue;
    const int64_t op = uni(rng, 0, static_cast<int64_t>(ops.size()) - 1);
    tr.inject_fault(fault_point{static_cast<int64_t>(k), op});
    REQUIRE_THROWS_AS(tr.execute(mig.copies), moebius::error);
    REQUIRE(tr.completed_phases() == static_cast<int64_t>(k));
    tr.execute(rollback_plan(mig.copies, tr.completed_phases()));
    REQUIRE(outside_diff(before, m.kv, tokenless) == "");
    REQUIRE(check_reference(g, c.state, c.content, m.kv, m.where()) == "");
    ++n.faults;
  }
  // A whole run rolled back whole, then the run that stays.
  tr.execute(mig.copies);
  tr.execute(rollback_plan(mig.copies, static_cast<int64_t>(mig.copies.phases.size())));
  REQUIRE(outside_diff(before, m.kv, tokenless) == "");
  tr.execute(mig.copies);
  REQUIRE(check_reference(gb, mig.new_state, c.content, m.kv, m.where()) == "");
  c.g = gb;
  c.state = mig.new_state;
  ++n.planned;
}

}  // namespace

TEST_CASE("KV dcp change: every (a, b) pair in every layout puts every byte where the rule says",
          "[kv][dcp_change]") {
  std::mt19937_64 rng(kv_test_seed() + 70);
  static constexpr double fills[] = {0.2, 0.6, 0.9, 0.97, 1.0};
  counts n;
  int64_t pairs = 0, latent = 0, non_nested = 0;
  std::set<std::string> presets_seen;
  for (int iter = 0; iter < 90; ++iter) {
    const kv_preset preset = all_presets[iter % 5];
    kv_geometry g = random_replicated_geometry(rng, uni(rng, 1, 3) * 8192);
    const layout_model model = engine_model(rng, preset, g);
    const std::vector<int64_t> allowed = divisors(ref_replicas(g));
    for (int64_t a : allowed)
      for (int64_t b : allowed) {
        if (a == b) continue;
        const kv_geometry ga = with_dcp(g, a);
        kv_case c = random_case(rng, ga, b, pick_one(rng, fills));
        memory m = make_memory(rng, c, 0, &model);
        INFO("iter " << iter << " " << to_string(preset) << " order " << model.order << " " << ga
                     << " occupancy " << c.occupancy);
        REQUIRE(check_reference(ga, c.state, c.content, m.kv, m.where()) == "");
        change_and_check(c, m, b, rng, n);
        ++pairs;
        latent += g.latent();
        non_nested += a % b != 0 && b % a != 0;
        presets_seen.insert(to_string(preset));
        // And back, from wherever the first change left the pages.
        if (c.g.dcp == b) change_and_check(c, m, a, rng, n);
      }
  }
  INFO("pairs " << pairs << " latent " << latent << " non-nested " << non_nested << " planned "
                << n.planned << " refused " << n.refused << " two rounds " << n.two_rounds
                << " no copy " << n.no_copy << " near full " << n.near_full << " faults "
                << n.faults);
  CHECK(pairs > 300);  // seeds show 570-650 pairs, 160-280 latent, 30-50 not nested
  CHECK(latent > 60);
  CHECK(non_nested > 10);
  CHECK(n.planned > 600);
  CHECK(n.refused > 10);
  CHECK(n.two_rounds > 8);
  CHECK(n.no_copy > 200);
  CHECK(n.near_full > 60);
  CHECK(n.faults > 250);
  CHECK(presets_seen.size() == 5);
}

TEST_CASE("KV dcp change: per-layer plans shifted to each layer do what the whole plan does",
          "[kv][dcp_change]") {
  std::mt19937_64 rng(kv_test_seed() + 71);
  int64_t ran = 0, faulted = 0;
  for (int iter = 0; iter < 60; ++iter) {
    const kv_preset preset = all_presets[iter % 5];
    kv_geometry g = random_replicated_geometry(rng, uni(rng, 1, 3) * 8192);
    g.num_layers = uni(rng, 2, 3);
    g.num_ep_pages = std::clamp<int64_t>(g.num_ep_pages / g.num_layers, 2, 256);
    const layout_model model = engine_model(rng, preset, g);
    validate(g);
    const std::vector<int64_t> allowed = divisors(ref_replicas(g));
    const int64_t a = one_of(rng, allowed), b = one_of(rng, allowed);
    if (a == b) continue;
    const kv_geometry ga = with_dcp(g, a);
    const kv_pool_layout layout = model.layout(ga);
    // Layers that interleave inside a page have another stride in TP: no layer moves alone.
    if (layout.ep.layer != layout.tp.layer) continue;
    kv_geometry one = ga;
    one.num_layers = 1;
    kv_case c = random_case(rng, ga, b, pick_one(rng, {0.5, 0.95}));
    INFO("iter " << iter << " " << to_string(preset) << " order " << model.order << " " << ga
                 << " -> dcp " << b);
    const kv_migration_attempt whole = try_plan_kv_dcp_change(ga, layout, c.state, b);
    const kv_migration_attempt layer = try_plan_kv_dcp_change(one, layout, c.state, b);
    REQUIRE(whole.capacity.fits == layer.capacity.fits);
    if (!whole.migration) continue;
    REQUIRE(whole.migration->new_state == layer.migration->new_state);
    REQUIRE(whole.migration->stats.rounds == layer.migration->stats.rounds);
    memory m = make_memory(rng, c, 0, &model);
    const pools before = m.kv;
    const auto tokenless = tokenless_bytes(ga, c.state, m.layout.pool_bytes, m.where());
    host_transport tr(m.spans());
    // A fault in a random layer's plan: that layer's completed rounds, then every earlier
    // layer, are undone; every byte is back.
    const int64_t bad = uni(rng, 0, g.num_layers - 1);
    const plan& per = layer.migration->copies;
    if (!per.phases.empty() && !per.phases[0].ops.empty()) {
      for (int64_t l = 0; l < bad; ++l) tr.execute(shifted_to_layer(per, layout, l));
      const plan p = shifted_to_layer(per, layout, bad);
      const int64_t k = uni(rng, 0, static_cast<int64_t>(p.phases.size()) - 1);
      if (!p.phases[static_cast<size_t>(k)].ops.empty()) {
        tr.inject_fault(fault_point{k, 0});
        REQUIRE_THROWS_AS(tr.execute(p), moebius::error);
        tr.execute(rollback_plan(p, tr.completed_phases()));
        for (int64_t l = bad - 1; l >= 0; --l) {
          const plan q = shifted_to_layer(per, layout, l);
          tr.execute(rollback_plan(q, static_cast<int64_t>(q.phases.size())));
        }
        REQUIRE(outside_diff(before, m.kv, tokenless) == "");
        ++faulted;
      } else {
        for (int64_t l = bad - 1; l >= 0; --l) {
          const plan q = shifted_to_layer(per, layout, l);
          tr.execute(rollback_plan(q, static_cast<int64_t>(q.phases.size())));
        }
      }
    }
    for (int64_t l = 0; l < g.num_layers; ++l) tr.execute(shifted_to_layer(per, layout, l));
    REQUIRE(check_reference(with_dcp(g, b), whole.migration->new_state, c.content, m.kv,
                            m.where()) == "");
    ++ran;
  }
  CHECK(ran > 15);
  CHECK(faulted > 5);
}

TEST_CASE("KV dcp change: the worked example of dcp_change.hpp (Qwen3, one 5-page sequence)",
          "[kv][dcp_change]") {
  const kv_geometry g1 = make_kv_geometry(94, 4, 128, 16, 64, 8);
  // dcp 2: rank x of a slice (x = r % 2) lists logical pages x, x + 2, ..: 3 pages on even ranks.
  const kv_geometry g2 = with_dcp(g1, 2);
  std::vector<std::vector<kv_sequence>> tables(8);
  for (int r = 0; r < 8; ++r) {
    kv_sequence q{7, 5 * 16, 16, 0, 0, {}};
    for (int64_t i = r % 2; i < 5; i += 2) q.pages.push_back(10 + i);
    tables[static_cast<size_t>(r)].push_back(q);
  }
  const kv_state s2 = make_kv_state(g2, parallel_mode::tp, tables);
  const kv_migration to1 = plan_kv_dcp_change(g2, s2, 1);
  CHECK(to1.stats.rounds == 1);
  CHECK(to1.copies.num_ops() == 20);  // 2 + 3 pages per slice, 4 slices
  CHECK(to1.stats.pages_moved == 20);
  CHECK(to1.stats.pages_in_place == 20);
  for (int r = 0; r < 8; ++r) {
    const auto& pages = to1.new_state.ranks[static_cast<size_t>(r)].sequences[0].pages;
    REQUIRE(pages.size() == 5);
    for (int64_t i = r % 2; i < 5; i += 2) CHECK(pages[static_cast<size_t>(i)] == 10 + i);  // kept
  }
  for (const plan_phase& ph : to1.copies.phases)
    for (const copy_op& op : ph.ops) CHECK(op.src_rank / 2 == op.dst_rank / 2);  // one slice
  const kv_migration back = plan_kv_dcp_change(g1, to1.new_state, 2);
  CHECK(back.stats.rounds == 0);
  CHECK(back.copies.phases.empty());
  CHECK(back.stats.bytes_copied == 0);
  CHECK(back.new_state == s2);  // each rank kept its share, ids and all
}

TEST_CASE("KV dcp change: identities, and bad input refused by name", "[kv][dcp_change]") {
  std::mt19937_64 rng(kv_test_seed() + 72);
  const kv_geometry g = with_dcp(make_kv_geometry(2, 1, 4, 4, 16, 4), 2);  // R = 4
  const kv_case c = random_kv_case(rng, g, parallel_mode::tp, 0.4, 8);
  SECTION("same dcp and EP states: no phase, the tables as they are") {
    const kv_migration same = plan_kv_dcp_change(g, c.state, 2);
    CHECK(same.copies.phases.empty());
    CHECK(same.new_state == c.state);
    const kv_case ep = random_kv_case(rng, g, parallel_mode::ep, 0.4, 8);
    const kv_migration e = plan_kv_dcp_change(g, ep.state, 4);
    CHECK(e.copies.phases.empty());
    CHECK(e.new_state == ep.state);
  }
  SECTION("a dcp the geometry does not allow") {
    for (const int64_t bad : {int64_t{0}, int64_t{3}, int64_t{8}}) {
      try {
        (void)plan_kv_dcp_change(g, c.state, bad);
        FAIL("expected errc::invalid_argument");
      } catch (const moebius::error& e) {
        CHECK(e.code() == errc::invalid_argument);
        CHECK_THAT(std::string(e.what()),
                   Catch::Matchers::Contains("dcp=" + std::to_string(bad)));
      }
    }
  }
  SECTION("a shared page at logical pages the two dcp values place apart") {
    // dcp 1 over P = 2, H_kv = 1: sequences 1 and 2 share pages {0, 1} in opposite orders.
    const kv_geometry g1 = make_kv_geometry(1, 1, 4, 4, 8, 2);
    std::vector<std::vector<kv_sequence>> t(2);
    for (auto& rank : t) {
      rank.push_back(kv_sequence{1, 8, 4, 2, 0, {0, 1}});
      rank.push_back(kv_sequence{2, 8, 4, 2, 0, {1, 0}});
    }
    const kv_state s = make_kv_state(g1, parallel_mode::tp, t);
    try {
      (void)plan_kv_dcp_change(g1, s, 2);
      FAIL("expected errc::invalid_argument");
    } catch (const moebius::error& e) {
      CHECK(e.code() == errc::invalid_argument);
      CHECK_THAT(std::string(e.what()),
                 Catch::Matchers::Contains("shared prefix pages must sit at one logical index"));
    }
  }
  SECTION("a staging region in the pool, unused or not, and max_rounds 0") {
    kv_migration_options opt;
    opt.staging = {memory_space::kv_pool, 0, 64};
    CHECK_THROWS_AS(plan_kv_dcp_change(g, c.state, 1, opt), moebius::error);
    opt = {};
    opt.max_rounds = 0;
    CHECK_THROWS_AS(plan_kv_dcp_change(g, c.state, 1, opt), moebius::error);
  }
}

TEST_CASE("KV dcp change: bytes per direction against going through EP (Qwen3)",
          "[kv][dcp_change]") {
  // Qwen3-235B's heads (H_kv = 4, head_dim 128, bf16, page 16) on P = 8; 2 layers stand for 94
  // (bytes scale with L alike in every plan). EP at 40%: TP(dcp 2) holds it at ~40%, TP(dcp 1)
  // at ~80%. dcp 2 -> 1 copies each rank its partner's share: the live TP pages of one rank;
  // TP(dcp 2) -> EP -> TP(dcp 1) gathers every page and scatters it again.
  std::mt19937_64 rng(kv_test_seed() + 73);
  for (kv_layout order : {kv_layout::hnd, kv_layout::nhd}) {
    const kv_geometry g1 = make_kv_geometry(2, 4, 128, 16, 96, 8, dtype::bf16, order);
    const kv_geometry g2 = with_dcp(g1, 2);
    const kv_case c = random_kv_case(rng, g1, parallel_mode::ep, 0.4, 4096, 16 * 16);
    kv_migration_options opt;
    opt.staging = {memory_space::arena, 0, 4 * kv_staging_slot_bytes(g1, parallel_mode::ep)};
    const kv_migration tp2 = plan_kv_migration(g2, c.state, parallel_mode::tp, opt);
    const kv_migration down = plan_kv_dcp_change(g2, tp2.new_state, 1);
    const kv_migration up = plan_kv_dcp_change(g1, down.new_state, 2);
    const kv_migration to_ep = plan_kv_migration(g2, tp2.new_state, parallel_mode::ep, opt);
    const kv_migration to_tp1 = plan_kv_migration(g1, to_ep.new_state, parallel_mode::tp, opt);
    const int64_t via_ep = to_ep.stats.bytes_copied + to_tp1.stats.bytes_copied;
    int64_t live = 0;  // TP pages in use at dcp 2, all ranks
    for (int r = 0; r < g2.num_ranks; ++r) live += used_pages(g2, tp2.new_state, r);
    const double ratio =
        static_cast<double>(down.stats.bytes_copied) / static_cast<double>(via_ep);
    std::cout << "dcp 2 -> 1 / via EP bytes, " << to_string(order) << ": "
              << down.stats.bytes_copied << " / " << via_ep << " = " << ratio
              << "; dcp 1 -> 2: " << up.stats.bytes_copied << " bytes, " << up.stats.rounds
              << " rounds" << std::endl;
    INFO(to_string(order) << " ratio " << ratio);
    // Every live TP page is copied once, to its partner (a shared page once).
    CHECK(down.stats.bytes_copied == live * ref_tp_page_bytes(g1));
    CHECK(down.stats.rounds == 1);
    CHECK(up.stats.bytes_copied == 0);
    CHECK(up.stats.rounds == 0);
    CHECK(ratio < 0.4);  // seeds show 0.35 (HND), 0.32 (NHD)
  }
}
