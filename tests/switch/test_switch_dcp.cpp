// The switcher over a KV geometry with a decode-context-parallel TP view (issue 40): EP <-> TP
// with dcp > 1, stop-the-world and progressive, commits with the layout-independent checksum
// unchanged (kv_checksum follows the DCP shares), rolls back from a fault in any KV round with
// every byte as before (test_switch_dry_run.cpp runs such worlds over dry_run_transport too).
// A change of the dcp alone (switcher::plan_dcp, TP(dcp a) -> TP(dcp b)) for every allowed pair:
// each head slice's logical pages hold what they held (read from the pools through the tables
// by the interleave rule, kv_reference.hpp), the bytes sent are the rule's, the experts stay,
// a fault in any KV round rolls back every byte that holds a token, a progressive begin and a
// bad dcp are refused by name.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <random>
#include <vector>

#include "moebius/switch/progressive.hpp"
#include "moebius/switch/switcher.hpp"
#include "moebius/transport/host_transport.hpp"
#include "support/catch.hpp"
#include "support/random.hpp"
#include "kv/kv_cases.hpp"
#include "kv/kv_reference.hpp"
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

namespace {

int64_t one_of(std::mt19937_64& rng, const std::vector<int64_t>& v) {
  return v[static_cast<size_t>(uniform(rng, 0, static_cast<int64_t>(v.size()) - 1))];
}

std::vector<int64_t> allowed_dcps(const kv_geometry& g) {
  std::vector<int64_t> out;
  for (int64_t d = 1; d <= ref_replicas(g); ++d)
    if (ref_replicas(g) % d == 0) out.push_back(d);
  return out;
}

// A world whose KV geometry replicates in TP (H_kv < P, or latent; P in {2, 4, 6, 8}) at dcp
// `a`, with TP tables (shared prefixes, mid-prefill cursors) filling about `fill` of the busiest
// rank: the switcher starts in TP attention with EP experts.
struct dcp_world {
  world w;
  kv_case c;
};
// `c` becomes the world's KV: its geometry and tables, its tokens written through the
// reference (replicas of a head hold the same bytes).
void use_tables(dcp_world& d, kv_case c) {
  d.c = std::move(c);
  d.w.kv = d.c.g;
  d.w.tables = d.c.state;
  fill_reference(d.c.g, d.c.state, d.c.content, d.w.pools);
}

dcp_world make_tp_world(std::mt19937_64& rng, double fill, bool same_layers = false) {
  static constexpr int ranks[] = {2, 4, 6, 8};
  const int P = ranks[std::uniform_int_distribution<int>(0, 3)(rng)];
  std::vector<int64_t> heads{0};
  for (int64_t h = 1; h < P; ++h)
    if (P % h == 0) heads.push_back(h);
  const expert_shape shape = random_shape(rng, P, false);
  const kv_geometry kv = make_kv_geometry(
      same_layers ? shape.num_layers : uniform(rng, 1, 3), one_of(rng, heads), uniform(rng, 1, 4),
      uniform(rng, 1, 8), uniform(rng, 8, 40), P, dtype::bf16,
      uniform(rng, 0, 1) ? kv_layout::nhd : kv_layout::hnd);
  const kv_geometry ga = with_dcp(kv, one_of(rng, allowed_dcps(kv)));
  dcp_world d{make_world(rng, make_arena_geometry(shape, P), kv, 0.0), {}};
  use_tables(d, random_kv_case(rng, ga, parallel_mode::tp, fill, 64));
  return d;
}

// The independent count of what a change to dcp b sends: every page a rank receives, whole.
int64_t rule_bytes(const kv_geometry& g, const kv_state& s, const content_map& c, int64_t b) {
  int64_t received = 0;
  for (const ref_rank_moves& m : ref_dcp_moves(g, s, c, g.dcp, b)) received += m.received;
  return received * ref_tp_page_bytes(g);
}

int64_t rule_need(const kv_geometry& g, const kv_state& s, const content_map& c, int64_t b) {
  int64_t need = 0;
  for (const ref_rank_moves& m : ref_dcp_moves(g, s, c, g.dcp, b))
    need = std::max(need, m.kept + m.received);
  return need;
}

}  // namespace

TEST_CASE("switcher dcp change: TP(dcp a) -> TP(dcp b) keeps every head slice's pages, moves "
          "the rule's bytes and no expert", "[switch][dcp][dcp_change]") {
  const uint64_t seed = test_seed();
  std::mt19937_64 rng(seed + 2);
  int64_t committed = 0, refused = 0, no_copy = 0, verified = 0;
  for (int iter = 0; iter < 24; ++iter) {
    dcp_world d = make_tp_world(rng, std::uniform_real_distribution<double>(0.1, 1.0)(rng));
    world& w = d.w;
    INFO("seed " << seed << " iter " << iter << " " << w.kv << " occupancy " << d.c.occupancy);
    host_transport host(w.memory);
    // The verify hook reads the tables at the dcp they are in: the switcher's before the move,
    // the plan's target after it (switcher.hpp).
    const switcher* self = nullptr;
    int64_t after_dcp = 0;
    switcher_options opt;
    opt.verify = [&](arena_cursor, const kv_state& s) {
      const int64_t at = &s == &self->kv_tables() ? self->dcp() : after_dcp;
      return kv_checksum(with_dcp(w.kv, at), s, w.pool_spans());
    };
    switcher sw(w.weights, w.kv, host, w.tables, arena_cursor{0}, opt);
    self = &sw;
    const parallel_layout tep{parallel_mode::tp, parallel_mode::ep};
    REQUIRE(sw.layout() == tep);
    std::vector<int64_t> targets = allowed_dcps(w.kv);
    std::shuffle(targets.begin(), targets.end(), rng);
    for (const int64_t b : targets) {
      const kv_geometry ga = with_dcp(w.kv, sw.dcp());
      const kv_state before = sw.kv_tables();
      const rank_images arenas = w.arenas, pools = w.pools;
      std::string err;
      const slice_pages held = ref_slice_pages(ga, before, w.pools, err);
      REQUIRE(err == "");
      const switch_plan p = sw.plan_dcp(b);
      INFO(p);
      CHECK(p.from == tep);
      CHECK(p.to == tep);
      CHECK(p.from_dcp == ga.dcp);
      CHECK(p.to_dcp == b);
      CHECK_FALSE(p.moves_experts());
      CHECK(p.weights->phases.empty());
      CHECK(p.already_there() == (b == ga.dcp));
      CHECK(p.moves_kv() == (b != ga.dcp));
      CHECK_FALSE(p.layer_capacity.fits);
      CHECK(p.capacity.holds == (rule_need(ga, before, d.c.content, b) <= ga.num_tp_pages()));
      after_dcp = b;
      const switch_report r = sw.switch_to(p);
      INFO(r);
      if (b == ga.dcp) {
        CHECK(r.outcome == switch_outcome::already_there);
        continue;
      }
      if (!p.capacity.fits) {
        CHECK(r.outcome == switch_outcome::refused_capacity);
        CHECK_THAT(r.error, Catch::Contains("TP rank"));
        CHECK(sw.dcp() == ga.dcp);
        CHECK(sw.kv_tables() == before);
        CHECK(w.pools == pools);
        ++refused;
        continue;
      }
      REQUIRE(r.outcome == switch_outcome::committed);
      ++committed;
      verified += r.verified;
      CHECK(r.verified);
      CHECK(r.from_dcp == ga.dcp);
      CHECK(r.to_dcp == b);
      CHECK(r.weight_phases == 0);
      CHECK(sum(r.weight_bytes_sent) == 0);
      CHECK(r.kv_rounds <= 2);
      CHECK(r.kv_stats.pages_staged == 0);
      // Bytes per direction: what the rule says each rank receives, and nothing more.
      const int64_t bytes = rule_bytes(ga, before, d.c.content, b);
      CHECK(sum(r.kv_bytes_sent) == bytes);
      no_copy += bytes == 0;
      CHECK(sw.dcp() == b);
      CHECK(sw.layout() == tep);
      CHECK(sw.cursor() == arena_cursor{0});
      // Nothing staged and no expert moved: every arena byte, the free slot's too.
      CHECK(w.arenas == arenas);
      const kv_geometry gb = with_dcp(w.kv, b);
      REQUIRE_NOTHROW(validate(gb, sw.kv_tables()));
      CHECK(sw.kv_tables().ranks[0].sequences.size() == before.ranks[0].sequences.size());
      // Each head slice's logical pages: the same bytes, now on the ranks of dcp b.
      CHECK(ref_slice_pages(gb, sw.kv_tables(), w.pools, err) == held);
      CHECK(err == "");
    }
  }
  INFO("committed " << committed << " refused " << refused << " without a copy " << no_copy);
  CHECK(committed >= 24);
  CHECK(refused >= 2);
  CHECK(no_copy >= 8);
  CHECK(verified == committed);
}

TEST_CASE("switcher dcp change: a fault in any KV round rolls back every byte that holds a token",
          "[switch][dcp][dcp_change][fault]") {
  const uint64_t seed = test_seed();
  std::mt19937_64 rng(seed + 3);
  int64_t faulted = 0;
  for (int iter = 0; iter < 24; ++iter) {
    // At the largest dcp, filled so that dcp 1 holds it: every other dcp copies.
    dcp_world d = make_tp_world(rng, 0.1);
    const int64_t top = ref_replicas(d.w.kv);
    const double fill =
        std::uniform_real_distribution<double>(0.1, 0.9)(rng) / static_cast<double>(top);
    use_tables(d, random_kv_case(rng, with_dcp(d.w.kv, top), parallel_mode::tp, fill, 64));
    world& w = d.w;
    INFO("seed " << seed << " iter " << iter << " " << w.kv);
    host_transport host(w.memory);
    switcher sw(w.weights, w.kv, host, w.tables, arena_cursor{0});
    const kv_state before = sw.kv_tables();
    const rank_images arenas = w.arenas, pools = w.pools;
    const auto tokenless = tokenless_bytes(w.kv, before, w.kv.pool_bytes());
    for (const int64_t b : allowed_dcps(w.kv)) {
      const switch_plan p = sw.plan_dcp(b);
      if (!p.kv) continue;
      for (size_t k = 0; k < p.kv->copies.phases.size(); ++k) {
        const auto& ops = p.kv->copies.phases[k].ops;
        if (ops.empty()) continue;
        INFO("to dcp " << b << ", fault in round " << k);
        const int64_t op = uniform(rng, 0, static_cast<int64_t>(ops.size()) - 1);
        sw.inject_fault(
            switch_fault{switch_fault::stage::kv, fault_point{static_cast<int64_t>(k), op}});
        const switch_report r = sw.switch_to(sw.plan_dcp(b));
        INFO(r);
        REQUIRE(r.outcome == switch_outcome::rolled_back);
        CHECK(r.kv_rounds_completed == static_cast<int64_t>(k));
        CHECK(sw.dcp() == w.kv.dcp);
        CHECK(sw.kv_tables() == before);
        CHECK(outside_diff(pools, w.pools, tokenless) == "");
        CHECK(w.arenas == arenas);
        ++faulted;
      }
    }
    // And it still switches, there and back, every head slice's pages as they were.
    const int64_t b = one_of(rng, allowed_dcps(w.kv));
    const switch_report there = sw.switch_dcp(b);
    INFO(there);
    if (there.outcome != switch_outcome::committed) continue;
    const switch_report back = sw.switch_dcp(w.kv.dcp);
    INFO(back);
    REQUIRE(back.outcome == switch_outcome::committed);  // it held these pages before
    std::string err;
    CHECK(ref_slice_pages(w.kv, sw.kv_tables(), w.pools, err) ==
          ref_slice_pages(w.kv, before, pools, err));
    CHECK(err == "");
  }
  INFO("seed " << seed);
  CHECK(faulted >= 16);  // 30 seeds show 25 or more
}

TEST_CASE("switcher dcp change: near full, down to dcp 1 and back; EP attention moves nothing",
          "[switch][dcp][dcp_change]") {
  std::mt19937_64 rng(test_seed() + 4);
  int64_t refused = 0;
  for (int iter = 0; iter < 8; ++iter) {
    // TP at dcp 1, 95-100% full: up to the largest dcp drops replicas, no copy, no round.
    dcp_world d = make_tp_world(rng, 0.3);
    world& w = d.w;
    use_tables(d, random_kv_case(rng, with_dcp(w.kv, 1), parallel_mode::tp,
                                 std::uniform_real_distribution<double>(0.95, 1.0)(rng), 4096));
    INFO(w.kv << " occupancy " << d.c.occupancy);
    host_transport host(w.memory);
    switcher sw(w.weights, w.kv, host, w.tables, arena_cursor{0});
    const rank_images pools = w.pools;
    const int64_t top = ref_replicas(w.kv);
    const switch_report up = sw.switch_dcp(top);
    INFO(up);
    REQUIRE(up.outcome == switch_outcome::committed);
    CHECK(up.kv_rounds == 0);
    CHECK(sum(up.kv_bytes_sent) == 0);
    CHECK(w.pools == pools);  // not a byte written: the tables alone change
    // Back to dcp 1: each rank holds again what it held, one round into the pages it freed.
    const switch_report down = sw.switch_dcp(1);
    INFO(down);
    REQUIRE(down.outcome == switch_outcome::committed);
    CHECK(down.kv_rounds == 1);
    std::string err;
    CHECK(ref_slice_pages(w.kv, sw.kv_tables(), w.pools, err) ==
          ref_slice_pages(w.kv, w.tables, pools, err));
    CHECK(err == "");
    // A TP view at the largest dcp filled past 1 / top cannot go to dcp 1: refused, unmoved.
    const kv_geometry g_top = with_dcp(w.kv, top);
    const kv_case full = random_kv_case(rng, g_top, parallel_mode::tp, 0.9, 4096);
    fill_reference(g_top, full.state, full.content, w.pools);
    switcher sw_top(w.weights, g_top, host, full.state, arena_cursor{0});
    const rank_images pools_top = w.pools;
    const switch_report refuse = sw_top.switch_dcp(1);
    INFO(refuse);
    // The rule's verdict (a small pool of long sequences may fill less than asked).
    if (rule_need(g_top, full.state, full.content, 1) <= g_top.num_tp_pages()) {
      CHECK(refuse.outcome == switch_outcome::committed);
      continue;
    }
    CHECK(refuse.outcome == switch_outcome::refused_capacity);
    CHECK(sw_top.kv_tables() == full.state);
    CHECK(w.pools == pools_top);
    ++refused;
  }
  CHECK(refused >= 6);
  // EP attention: the EP view does not depend on dcp; the next switch to TP uses the new one.
  int64_t to_tp = 0;
  for (int iter = 0; iter < 8; ++iter) {
    dcp_world d = make_tp_world(rng, 0.3);
    world& w = d.w;
    const kv_geometry g1 = with_dcp(w.kv, 1);
    w.tables = random_ep_tables(g1, 0.15, rng);
    host_transport host(w.memory);
    switcher sw(w.weights, g1, host, w.tables, arena_cursor{0});
    REQUIRE(sw.layout() == parallel_layout(parallel_mode::ep));
    const rank_images pools = w.pools;
    const int64_t b = ref_replicas(g1);
    const switch_plan p = sw.plan_dcp(b);
    CHECK_FALSE(p.moves_kv());
    const switch_report r = sw.switch_to(p);
    REQUIRE(r.outcome == switch_outcome::committed);
    CHECK(sw.dcp() == b);
    CHECK(sw.kv_tables() == w.tables);
    CHECK(w.pools == pools);
    // The switch to TP attention is planned at dcp b: its check is TP(dcp b)'s.
    const parallel_layout tep{parallel_mode::tp, parallel_mode::ep};
    const kv_capacity_report at_b =
        check_kv_capacity(with_dcp(g1, b), w.tables, parallel_mode::tp);
    CHECK(sw.check(tep).pages_needed == at_b.pages_needed);
    if (!at_b.fits) continue;  // every sequence starts on DCP index 0: short ones may not fit
    const switch_report tp = sw.switch_to(tep);
    INFO(tp);
    REQUIRE(tp.outcome == switch_outcome::committed);
    CHECK(tp.from_dcp == b);
    CHECK_NOTHROW(validate(with_dcp(g1, b), sw.kv_tables()));
    ++to_tp;
  }
  CHECK(to_tp >= 3);
}

TEST_CASE("switcher dcp change: refused by name (progressive, a bad dcp, a stale plan); "
          "recovered at the source dcp after an inconsistent end", "[switch][dcp][dcp_change]") {
  std::mt19937_64 rng(test_seed() + 5);
  dcp_world d;
  do {  // two ranks a head, at dcp 2 (begin() needs one KV layer per MoE layer to get as far)
    d = make_tp_world(rng, 0.3, /*same_layers=*/true);
  } while (ref_replicas(d.w.kv) != 2 || d.w.kv.dcp != 2);
  world& w = d.w;
  host_transport host(w.memory);
  switcher sw(w.weights, w.kv, host, w.tables, arena_cursor{0});
  const switch_plan p = sw.plan_dcp(1);
  try {
    (void)sw.begin(p);
    FAIL("expected an error");
  } catch (const moebius::error& e) {
    CHECK(e.code() == errc::invalid_argument);
    CHECK_THAT(std::string(e.what()), Catch::Contains("KV-parallel degree"));
    CHECK_THAT(std::string(e.what()), Catch::Contains("stop-the-world"));
  }
  for (const int64_t bad : {int64_t{0}, int64_t{3}, int64_t{4}}) {
    try {
      (void)sw.plan_dcp(bad);
      FAIL("expected an error");
    } catch (const moebius::error& e) {
      CHECK(e.code() == errc::invalid_argument);
      CHECK_THAT(std::string(e.what()), Catch::Contains("dcp=" + std::to_string(bad)));
    }
  }
  // A plan made before a dcp change committed is stale.
  const switch_plan old = sw.plan_dcp(1);
  REQUIRE(sw.switch_to(p).outcome == switch_outcome::committed);
  CHECK_FALSE(sw.why_stale(old).empty());
  CHECK_THROWS_AS(sw.switch_to(old), moebius::error);
  // A barrier timeout in the way back: no undo trusted, inconsistent; recover() comes back at
  // the source dcp (every sequence lost: their KV's bytes are unknown).
  const switch_plan back = sw.plan_dcp(2);
  REQUIRE(back.kv);
  if (back.kv->copies.phases.empty()) return;  // nothing to fault: nothing copied
  sw.inject_fault(switch_fault{switch_fault::stage::kv, fault_point{0, 0, errc::timeout}});
  const switch_report r = sw.switch_to(sw.plan_dcp(2));
  INFO(r);
  REQUIRE(r.outcome == switch_outcome::inconsistent);
  recovery_request req;
  req.layout = sw.layout();
  req.reload_experts = [&](arena_cursor c) {  // into the arenas the transport holds
    rank_images fresh;
    load_reference(w.logical, w.weights, c, fresh);
    for (size_t rank = 0; rank < fresh.size(); ++rank)
      std::memcpy(w.arenas[rank].data(), fresh[rank].data(), fresh[rank].size());
  };
  const recovery_report rec = sw.recover(req);
  INFO(rec.error);
  REQUIRE(rec.recovered);
  CHECK(sw.dcp() == 1);
  CHECK(rec.lost.size() == d.c.content.size());
  CHECK_NOTHROW(validate(with_dcp(w.kv, 1), sw.kv_tables()));
  CHECK(sw.switch_dcp(2).outcome == switch_outcome::committed);
  CHECK(sw.dcp() == 2);
}
