// The switcher end to end on the host transport: committed switches match the independent
// reference, and a fault at any weight phase, KV round or verify step leaves the arena, the
// live KV pages and the tables byte-identical to before.
#include <algorithm>
#include <cstring>
#include <random>
#include <span>
#include <sstream>
#include <stdexcept>
#include <utility>
#include <vector>

#include "moebius/kv/kv_geometry.hpp"
#include "moebius/kv/page_table.hpp"
#include "moebius/layout/arena_geometry.hpp"
#include "moebius/switch/checksum.hpp"
#include "moebius/switch/switcher.hpp"
#include "moebius/transport/host_transport.hpp"
#include "support/catch.hpp"
#include "support/reference.hpp"

#include "forwarding_transport.hpp"
#include "switch_world.hpp"

namespace {

using namespace moebius;
using namespace moebius::testing;

}  // namespace

TEST_CASE("switcher commits EP->TP->EP and matches the reference", "[switch]") {
  const uint64_t seed = testing::test_seed();
  std::mt19937_64 rng(seed);
  for (int iter = 0; iter < 12; ++iter) {
    const int P = std::vector<int>{1, 2, 4, 8}[static_cast<size_t>(iter % 4)];
    world w = make_world(rng, P, 0.3);
    INFO("seed " << seed << " iter " << iter << " P=" << P << " " << w.shape << " " << w.kv);
    host_transport t(w.memory);
    int flips = 0;
    parallel_mode selector = parallel_mode::ep;
    switcher_options opt;
    opt.on_commit = [&](parallel_layout l) { selector = l.attention; ++flips; };
    opt.verify = [&](arena_cursor c, const kv_state& s) { return state_checksum(w, c, s); };
    const uint64_t kv_before = kv_checksum(w.kv, w.tables, w.pool_spans());
    switcher sw(w.weights, w.kv, t, w.tables, arena_cursor{0}, opt);

    const switch_report to_tp = sw.switch_to(parallel_mode::tp);
    INFO(to_tp);
    if (to_tp.outcome == switch_outcome::refused_capacity) {
      CHECK(flips == 0);
      continue;  // H_kv < P halves TP capacity; nothing moved (checked in the fault test)
    }
    REQUIRE(to_tp.outcome == switch_outcome::committed);
    CHECK(to_tp.verified);
    CHECK(selector == parallel_mode::tp);
    CHECK(sw.mode() == parallel_mode::tp);
    CHECK(sw.cursor().tp_layers == w.shape.num_layers);
    CHECK(testing::compare_to_reference(w.logical, w.weights, sw.cursor(), w.arenas,
                              testing::padding_rule::end_slots_unknown) == "");
    CHECK(kv_checksum(w.kv, sw.kv_tables(), w.pool_spans()) == kv_before);
    CHECK(sw.switch_to(parallel_mode::tp).outcome == switch_outcome::already_there);

    const switch_report to_ep = sw.switch_to(parallel_mode::ep);
    INFO(to_ep);
    REQUIRE(to_ep.outcome == switch_outcome::committed);
    CHECK(selector == parallel_mode::ep);
    CHECK(flips == 2);
    CHECK(testing::compare_to_reference(w.logical, w.weights, arena_cursor{0}, w.arenas,
                              testing::padding_rule::end_slots_unknown) == "");
    CHECK(kv_checksum(w.kv, sw.kv_tables(), w.pool_spans()) == kv_before);
  }
}

TEST_CASE("a fault at any weight phase, KV round or verify leaves everything as before",
          "[switch][fault]") {
  const uint64_t seed = testing::test_seed();
  std::mt19937_64 rng(seed);
  int faults_tested = 0;
  for (int iter = 0; iter < 8; ++iter) {
    const int P = std::vector<int>{2, 4, 8, 3}[static_cast<size_t>(iter % 4)];
    world w = make_world(rng, P == 3 ? 2 : P, 0.45);
    host_transport t(w.memory);
    INFO("seed " << seed << " iter " << iter << " " << w.shape << " " << w.kv);

    for (parallel_mode target : {parallel_mode::tp, parallel_mode::ep}) {
      // Reach the starting mode of this direction first.
      int flips = 0;
      switcher_options opt;
      opt.on_commit = [&](parallel_layout) { ++flips; };
      switcher sw(w.weights, w.kv, t, w.tables, arena_cursor{0}, opt);
      if (target == parallel_mode::ep) {
        if (sw.switch_to(parallel_mode::tp).outcome != switch_outcome::committed) break;
      }
      // What must survive every failed attempt (re-taken after an attempt that committed).
      kv_state tables_before = sw.kv_tables();
      const arena_cursor cursor_before = sw.cursor();
      const int64_t free_slot = arena_geometry::free_slot(cursor_before);
      rank_images arenas_before = w.arenas;
      auto live_before = live_kv_bytes(w, tables_before);
      int flips_before = flips;

      // The plan sizes, from a dry capacity check and a switch that will be undone by a fault
      // on its last phase... simpler: count phases from a report of a faulted run.
      switch_fault probe{switch_fault::stage::weights, fault_point{0, 0}};
      sw.inject_fault(probe);
      const switch_report first = sw.switch_to(target);
      if (first.outcome == switch_outcome::refused_capacity) {
        CHECK(w.arenas == arenas_before);  // nothing moved
        break;
      }
      REQUIRE(first.outcome == switch_outcome::rolled_back);
      const int64_t weight_phases = first.weight_phases, kv_rounds = first.kv_rounds;
      {  // The rollback argument needs each round to write only bytes free before it.
        kv_migration_options kv_opt;
        kv_opt.staging = {memory_space::arena,
                          w.weights.slot_offset(arena_geometry::free_slot(
                              arena_cursor{target == parallel_mode::tp ? w.shape.num_layers : 0})),
                          w.weights.slot_bytes};
        const kv_migration mig = plan_kv_migration(w.kv, tables_before, target, kv_opt);
        CHECK(find_phase_hazard(mig.copies) == "");
      }

      std::vector<switch_fault> faults;
      for (int64_t k = 0; k < weight_phases; ++k) {
        faults.push_back({switch_fault::stage::weights, fault_point{k, 0}});
        faults.push_back({switch_fault::stage::weights, fault_point{k, 1 + static_cast<int64_t>(rng() % 4)}});
      }
      for (int64_t r = 0; r < kv_rounds; ++r) {
        faults.push_back({switch_fault::stage::kv, fault_point{r, 0}});
        faults.push_back({switch_fault::stage::kv, fault_point{r, 1 + static_cast<int64_t>(rng() % 8)}});
      }
      for (const switch_fault& f : faults) {
        // Scribble the free slot: the undo must not depend on what it held.
        testing::scribble_slot(w.weights, free_slot, w.arenas, rng);
        sw.inject_fault(f);
        const switch_report rep = sw.switch_to(target);
        INFO(rep);
        ++faults_tested;
        // A fault past the last op of a phase never fires: then the switch commits; undo it
        // with the opposite switch and carry on.
        if (rep.outcome == switch_outcome::committed) {
          REQUIRE(sw.switch_to(target == parallel_mode::tp ? parallel_mode::ep : parallel_mode::tp)
                      .outcome == switch_outcome::committed);
          REQUIRE(sw.cursor() == cursor_before);
          tables_before = sw.kv_tables();  // same sequences, new page ids
          arenas_before = w.arenas;
          live_before = live_kv_bytes(w, tables_before);
          flips_before = flips;
          continue;
        }
        REQUIRE(rep.outcome == switch_outcome::rolled_back);
        CHECK(rep.error.find("injected") != std::string::npos);
        CHECK(sw.cursor() == cursor_before);
        CHECK(sw.mode() == tables_before.mode);
        CHECK(sw.kv_tables() == tables_before);
        CHECK(flips == flips_before);
        // Every tensor of every occupied slot and every live KV page byte-identical.
        CHECK(arena_diff(w, w.arenas, arenas_before, free_slot) == "");
        CHECK(live_kv_bytes(w, sw.kv_tables()) == live_before);
        if (live_kv_bytes(w, sw.kv_tables()) != live_before) {
          const auto now = live_kv_bytes(w, sw.kv_tables());
          for (size_t r = 0; r < now.size(); ++r) {
            size_t i = 0;
            while (i < now[r].size() && now[r][i] == live_before[r][i]) ++i;
            if (i < now[r].size()) { UNSCOPED_INFO("rank " << r << " first diff at live byte " << i << " of " << now[r].size() << " page_bytes " << w.kv.page_bytes(tables_before.mode) << " tensors " << w.kv.num_tensors()); }
          }
          std::ostringstream os;
          kv_migration_options kv_opt;
          kv_opt.staging = {memory_space::arena, w.weights.slot_offset(arena_geometry::free_slot(arena_cursor{target == parallel_mode::tp ? w.shape.num_layers : 0})), w.weights.slot_bytes};
          print(os, plan_kv_migration(w.kv, tables_before, target, kv_opt).copies, true);
          for (int r = 0; r < w.kv.num_ranks; ++r) { os << "rank " << r << ":"; for (auto& sq : tables_before.ranks[r].sequences) { os << " s" << sq.seq_id << "["; for (auto pg : sq.pages) os << pg << ","; os << "]"; } os << "\n"; }
          FAIL(os.str());
        }
      }
    }
  }
  CHECK(faults_tested > 0);
}

TEST_CASE("a verify mismatch rolls the switch back", "[switch][fault]") {
  const uint64_t seed = testing::test_seed();
  std::mt19937_64 rng(seed);
  world w = make_world(rng, 2, 0.3);
  host_transport t(w.memory);
  int calls = 0;
  switcher_options opt;
  // The second call (after the move) reports different contents, as corruption would.
  opt.verify = [&](arena_cursor, const kv_state&) { return static_cast<uint64_t>(++calls); };
  switcher sw(w.weights, w.kv, t, w.tables, arena_cursor{0}, opt);
  const rank_images before = w.arenas;
  const auto live_before = live_kv_bytes(w, sw.kv_tables());
  const switch_report rep = sw.switch_to(parallel_mode::tp);
  INFO("seed " << seed << ": " << rep);
  REQUIRE(rep.outcome == switch_outcome::rolled_back);
  CHECK(rep.error.find("checksum") != std::string::npos);
  CHECK(sw.mode() == parallel_mode::ep);
  CHECK(sw.cursor().tp_layers == 0);
  CHECK(testing::compare_to_reference(w.logical, w.weights, arena_cursor{0}, w.arenas,
                              testing::padding_rule::end_slots_unknown) == "");
  CHECK(live_kv_bytes(w, sw.kv_tables()) == live_before);
}

TEST_CASE("verify_layer needs one KV layer per MoE layer", "[switch][validate]") {
  std::mt19937_64 rng(testing::test_seed());
  world w;
  do {
    w = make_world(rng, 2, 0.3);
  } while (w.kv.num_layers == w.shape.num_layers);
  host_transport t(w.memory);
  switcher_options opt;
  int calls = 0;
  opt.verify_layer = [&](int64_t, parallel_mode, const kv_state&) {
    ++calls;
    return uint64_t{0};
  };
  switcher sw(w.weights, w.kv, t, w.tables, arena_cursor{0}, opt);
  const rank_images arenas = w.arenas, pools = w.pools;
  try {
    (void)sw.switch_to(parallel_mode::tp);
    FAIL("a switch checked layer by layer over unpaired KV layers ran");
  } catch (const moebius::error& e) {
    CHECK(e.code() == errc::invalid_argument);
    CHECK(std::string(e.what()).find("one layer per MoE layer") != std::string::npos);
  }
  CHECK(calls == 0);
  CHECK(w.arenas == arenas);
  CHECK(w.pools == pools);
  CHECK(sw.mode() == parallel_mode::ep);
}

TEST_CASE("a refused switch moves nothing", "[switch]") {
  const uint64_t seed = testing::test_seed();
  std::mt19937_64 rng(seed);
  world w = make_world_tp_cannot_hold(rng);
  host_transport t(w.memory);
  switcher sw(w.weights, w.kv, t, w.tables, arena_cursor{0});
  const rank_images arenas = w.arenas, pools = w.pools;
  const switch_report rep = sw.switch_to(parallel_mode::tp);
  INFO("seed " << seed << ": " << rep);
  CHECK(rep.outcome == switch_outcome::refused_capacity);
  CHECK_FALSE(rep.error.empty());
  CHECK(w.arenas == arenas);
  CHECK(w.pools == pools);
  CHECK(sw.mode() == parallel_mode::ep);
}

TEST_CASE("the switcher rests in any of the four layouts and refuses a mid-switch cursor",
          "[switch]") {
  std::mt19937_64 rng(testing::test_seed());
  world w = make_world(rng, 2, 0.2);
  host_transport t(w.memory);
  // EP tables with the experts at rest in TP: data-parallel attention, TP experts.
  const switcher sw(w.weights, w.kv, t, w.tables, arena_cursor{w.shape.num_layers});
  CHECK(sw.layout() == parallel_layout{parallel_mode::ep, parallel_mode::tp});
  CHECK(sw.mode() == parallel_mode::ep);
  CHECK(std::string(to_string(sw.layout())) == "DP attention, TP experts");
  for (int64_t c = 1; c < w.shape.num_layers; ++c) {
    try {
      switcher mid(w.weights, w.kv, t, w.tables, arena_cursor{c});
      FAIL("expected an error for cursor " << c);
    } catch (const moebius::error& e) {
      CHECK(e.code() == errc::invalid_argument);
      CHECK(std::string(e.what()).find("mid-switch") != std::string::npos);
    }
  }
}


TEST_CASE("a verify hook that throws is a failure, before or after the move", "[switch][fault]") {
  const uint64_t seed = testing::test_seed();
  std::mt19937_64 rng(seed);
  for (int throw_on_call : {1, 2}) {
    world w = make_world(rng, 2, 0.3);
    host_transport t(w.memory);
    int calls = 0;
    switcher_options opt;
    opt.verify = [&](arena_cursor c, const kv_state& s) -> uint64_t {
      if (++calls == throw_on_call) throw std::runtime_error("device read-back failed");
      return state_checksum(w, c, s);
    };
    switcher sw(w.weights, w.kv, t, w.tables, arena_cursor{0}, opt);
    const rank_images before = w.arenas;
    const auto live_before = live_kv_bytes(w, sw.kv_tables());
    const switch_report rep = sw.switch_to(parallel_mode::tp);
    INFO("seed " << seed << " throw on call " << throw_on_call << ": " << rep);
    REQUIRE(rep.outcome == switch_outcome::rolled_back);
    CHECK(rep.error.find("device read-back failed") != std::string::npos);
    CHECK(sw.consistent());
    CHECK(sw.mode() == parallel_mode::ep);
    CHECK(sw.cursor().tp_layers == 0);
    CHECK(arena_diff(w, w.arenas, before, 0) == "");
    CHECK(live_kv_bytes(w, sw.kv_tables()) == live_before);
  }
}

TEST_CASE("a failed undo leaves the switcher inconsistent and it refuses to switch again",
          "[switch][fault]") {
  const uint64_t seed = testing::test_seed();
  std::mt19937_64 rng(seed);
  world w;
  do {
    w = make_world(rng, 2, 0.3);
  } while (w.shape.num_layers < 2);
  host_transport t(w.memory);
  switcher sw(w.weights, w.kv, t, w.tables, arena_cursor{0});
  sw.inject_fault(switch_fault{switch_fault::stage::weights, fault_point{1, 0}});
  sw.inject_fault(switch_fault{switch_fault::stage::undo, fault_point{0, 0}});
  const switch_report rep = sw.switch_to(parallel_mode::tp);
  INFO("seed " << seed << ": " << rep);
  REQUIRE(rep.outcome == switch_outcome::inconsistent);
  CHECK(rep.error.find("undo failed") != std::string::npos);
  CHECK(rep.cursor.tp_layers == 1);  // layer 0 went to TP, its undo never ran
  CHECK_FALSE(sw.consistent());
  const rank_images after = w.arenas;
  const switch_report again = sw.switch_to(parallel_mode::ep);
  CHECK(again.outcome == switch_outcome::inconsistent);
  CHECK(again.error.find("refused") != std::string::npos);
  CHECK(w.arenas == after);  // nothing moved
}

namespace {
// host_transport whose phase `k` ends in a barrier timeout, as a stalled peer would cause.
class timing_out_transport final : public forwarding_transport {
 public:
  timing_out_transport(std::vector<rank_memory> ranks, int64_t k)
      : forwarding_transport(std::move(ranks)), k_(k) {}
  void enqueue(const plan& p, std::span<const stream_handle> streams) override {
    ++executes_;
    times_out_ = static_cast<int64_t>(p.phases.size()) > k_;
    if (times_out_) inner_.inject_fault(fault_point{k_, 0});
    inner_.enqueue(p, streams);
  }
  void wait() override {
    try {
      inner_.wait();
    } catch (const moebius::error&) {
      if (!times_out_) throw;
      MOEBIUS_FAIL(errc::timeout, "rank 0 timed out at the barrier closing phase ", k_);
    }
  }
  void inject_fault(std::optional<fault_point>) override {}
  int executes() const { return executes_; }

 private:
  int64_t k_;
  int executes_ = 0;
  bool times_out_ = false;
};
}  // namespace

TEST_CASE("after a barrier timeout the switcher does not undo over unknown bytes",
          "[switch][fault]") {
  const uint64_t seed = testing::test_seed();
  std::mt19937_64 rng(seed);
  world w;
  do {
    w = make_world(rng, 2, 0.3);
  } while (w.shape.num_layers < 2);
  timing_out_transport t(w.memory, 1);
  switcher sw(w.weights, w.kv, t, w.tables, arena_cursor{0});
  const switch_report rep = sw.switch_to(parallel_mode::tp);
  INFO("seed " << seed << ": " << rep);
  REQUIRE(rep.outcome == switch_outcome::inconsistent);
  CHECK(rep.error.find("timed out") != std::string::npos);
  CHECK(rep.error.find("not undone") != std::string::npos);
  CHECK(rep.cursor.tp_layers == 1);
  CHECK(t.executes() == 1);  // no undo plan ran
  CHECK_FALSE(sw.consistent());
}

TEST_CASE("TP->EP places sequences where the ep_placement hook says", "[switch]") {
  const uint64_t seed = testing::test_seed();
  std::mt19937_64 rng(seed + 7);
  int checked = 0;
  for (int iter = 0; iter < 8; ++iter) {
    const int P = std::vector<int>{2, 4}[static_cast<size_t>(iter % 2)];
    world w = make_world(rng, P, 0.2);
    INFO("seed " << seed << " iter " << iter << " " << w.kv);
    if (w.tables.ranks[0].sequences.empty()) continue;  // nothing to place
    host_transport t(w.memory);
    // Every sequence on the rank after the one longest-first would pick: here, all on the last
    // rank that has room, by the hook's own capacity arithmetic.
    int calls = 0;
    bool refuse = false;
    switcher_options opt;
    opt.ep_placement = [&](const kv_state& tables) {
      ++calls;
      std::vector<kv_demand> demands;
      std::vector<int64_t> groups;
      kv_demands_of(w.kv, tables, demands, groups);
      std::vector<int64_t> cap(static_cast<size_t>(P), w.kv.num_ep_pages);
      if (refuse) cap.assign(static_cast<size_t>(P), 0);  // a placement that cannot fit
      kv_placement pl = place_longest_first(demands, groups, cap);
      // Rotate the owners by one rank where the rotated owner still has room.
      std::vector<int64_t> load(static_cast<size_t>(P), 0);
      for (size_t i = 0; i < demands.size() && pl.fits; ++i) {
        const int o = (pl.owner[i] + 1) % P;
        if (load[static_cast<size_t>(o)] + demands[i].own_pages <= w.kv.num_ep_pages) pl.owner[i] = o;
        load[static_cast<size_t>(pl.owner[i])] += demands[i].own_pages;
      }
      return pl;
    };
    const uint64_t kv_before = kv_checksum(w.kv, w.tables, w.pool_spans());
    switcher sw(w.weights, w.kv, t, w.tables, arena_cursor{0}, opt);
    if (sw.switch_to(parallel_mode::tp).outcome != switch_outcome::committed) continue;
    CHECK(calls == 0);  // EP->TP places nothing
    const kv_state tp = sw.kv_tables();
    std::vector<kv_demand> demands;
    std::vector<int64_t> groups;
    kv_demands_of(w.kv, tp, demands, groups);
    const kv_placement want = opt.ep_placement(tp);
    calls = 0;
    CHECK(sw.check(parallel_mode::ep).fits);
    const switch_report r = sw.switch_to(parallel_mode::ep);
    INFO(r);
    REQUIRE(r.outcome == switch_outcome::committed);
    CHECK(calls == 2);  // once for check(), once for the switch (it plans its KV once)
    for (size_t i = 0; i < demands.size(); ++i) {
      bool found = false;
      for (int rank = 0; rank < P; ++rank)
        for (const kv_sequence& q : sw.kv_tables().ranks[static_cast<size_t>(rank)].sequences)
          if (q.seq_id == demands[i].seq_id) {
            CHECK(rank == want.owner[i]);
            found = true;
          }
      CHECK(found);
    }
    CHECK(kv_checksum(w.kv, sw.kv_tables(), w.pool_spans()) == kv_before);
    // A hook whose placement does not fit refuses the switch, moving nothing.
    REQUIRE(sw.switch_to(parallel_mode::tp).outcome == switch_outcome::committed);
    refuse = true;
    const rank_images arenas = w.arenas;
    CHECK_FALSE(sw.check(parallel_mode::ep).fits);
    CHECK(sw.switch_to(parallel_mode::ep).outcome == switch_outcome::refused_capacity);
    CHECK(w.arenas == arenas);
    ++checked;
  }
  CHECK(checked >= 4);
}
