// The KV planner's internal round scheduler (src/kv/round_scheduler.hpp), and the round count
// of TP->EP at high occupancy (a plan property: no timing).

#include <string>

#include "kv_bench_common.hpp"
#include "moebius/kv/kv_migration.hpp"
#include "round_scheduler.hpp"
#include "support/catch.hpp"

using namespace moebius;
using namespace moebius::kv_detail;

namespace {
const kv_geometry g = make_kv_geometry(1, 4, 2, 4, 8, 2);  // split 2: 16 TP pages per rank
const kv_staging no_staging{};
}  // namespace

TEST_CASE("round scheduler defers frees to the barrier", "[kv][scheduler]") {
  plan out;
  round_scheduler sch(g, present_kv_layout(g), no_staging, 0, 100, 100, "TEST", out);
  sch.mark_live(1, 7);
  REQUIRE(sch.free_pages(1) == 15);
  REQUIRE(sch.free_in_group(1, 3) == 1);
  REQUIRE(sch.begin_round({1, 1}));
  sch.fill(0, 4);
  sch.emit().whole(parallel_mode::tp, sch.emit().pool(parallel_mode::tp, 1, 7),
                   sch.emit().pool(parallel_mode::tp, 0, 4));
  sch.release(1, 7);
  CHECK(sch.state(1, 7) == page_state::leaving);  // not reusable within the round
  CHECK(sch.free_pages(1) == 15);
  CHECK(sch.take_page(1) == -1);
  CHECK_THROWS_AS(sch.fill(1, 7), moebius::error);
  REQUIRE(sch.end_round({0, 0}));
  CHECK(sch.rounds() == 1);
  CHECK(out.phases.size() == 1);
  CHECK(sch.state(1, 7) == page_state::free);
  CHECK(sch.free_in_group(1, 3) == 2);
  CHECK(sch.state(0, 4) == page_state::built);
  REQUIRE(sch.freed().size() == 1);
  CHECK(sch.freed()[0] == std::pair<int, int64_t>{1, 7});
  CHECK(sch.take_page(1) == 7);  // offered to rank 1's pool at the barrier
}

TEST_CASE("round scheduler: staging slots come back after the barrier", "[kv][scheduler]") {
  plan out;
  round_scheduler sch(g, present_kv_layout(g), no_staging, 2, 100, 100, "TEST", out);
  REQUIRE(sch.begin_round({1, 0}));
  const int64_t a = sch.take_slot(0), b = sch.take_slot(0);
  CHECK(a != b);
  CHECK(sch.take_slot(0) == -1);
  sch.release_slot(0, a);
  CHECK(sch.free_slots(0) == 0);
  REQUIRE(sch.end_round({1, 0}));
  CHECK(sch.free_slots(0) == 1);
}

TEST_CASE("round scheduler reports stuck and max_rounds with ranks and numbers",
          "[kv][scheduler]") {
  {
    plan out;
    round_scheduler sch(g, present_kv_layout(g), no_staging, 0, 64, 100, "TP->EP", out);
    for (int64_t t = 0; t < 16; ++t) sch.mark_live(1, t);
    REQUIRE(sch.begin_round({0, 5}));
    CHECK_FALSE(sch.end_round({0, 5}));  // nothing moved
    const std::string& f = sch.failure();
    INFO(f);
    CHECK(f.find("TP->EP is stuck after 0 rounds with 5 pieces waiting") != std::string::npos);
    CHECK(f.find("rank 1: 5 waiting, 0 free TP pages (0 whole EP pages)") != std::string::npos);
    CHECK(f.find("64 bytes per slot") != std::string::npos);
  }
  {
    plan out;
    round_scheduler sch(g, present_kv_layout(g), no_staging, 0, 64, 1, "EP->TP", out);
    sch.mark_live(0, 3);
    REQUIRE(sch.begin_round({0, 2}));
    sch.fill(1, 3);
    sch.emit().whole(parallel_mode::tp, sch.emit().pool(parallel_mode::tp, 0, 3),
                     sch.emit().pool(parallel_mode::tp, 1, 3));
    sch.release(0, 3);
    REQUIRE(sch.end_round({0, 2}));
    CHECK_FALSE(sch.begin_round({0, 2}));
    const std::string& f = sch.failure();
    INFO(f);
    CHECK(f.find("EP->TP needs more than max_rounds=1 rounds: 2 pieces still waiting") !=
          std::string::npos);
    CHECK(f.find("rank 1: 2 waiting") != std::string::npos);
  }
}

// Bound: each round every rank can land at most as many pieces as it has free TP pages (10% of
// its pool at 90% occupancy, i.e. 0.1 * split * E per rank for E EP pages), and it must land
// (1 - 1/split) of its 0.9 * split * E pieces from other ranks plus its own misplaced pieces
// (1 - 1/split of them): at most ~0.9 * split * E * (1 - 1/split) * (1 + 1/split) pieces, so
// about 9 * (1 - 1/split^2) rounds: 7 (P=2) to 8.5 (P=4), plus a tail of 2 for the last
// pieces blocked by waits. The bound allows 4 more for the randomness of the state.
TEST_CASE("KV TP->EP at 90% occupancy needs few rounds (GPU bench cases)", "[kv][rounds]") {
  for (int P : {2, 4, 8})
    for (bool nhd : {false, true}) {
      const int64_t page = nhd ? 1 : 16;
      // The GPU benchmark's page counts (the plan does not depend on the layer count).
      const kv_geometry kg = bench::qwen3_kv_geometry(page, bench::gpu_bench_ep_pages(page), P,
                                                      2, nhd ? kv_layout::nhd : kv_layout::hnd);
      const kv_state s = bench::random_kv_state(kg, parallel_mode::tp, 0.9, 91);
      const kv_migration m = bench::build_kv_plan(kg, s, 64);
      const int64_t split = kg.tp_pages_per_ep_page();
      const double ideal = 9.0 * (1.0 - 1.0 / static_cast<double>(split * split)) + 2.0;
      INFO("P=" << P << " " << to_string(kg.layout) << " " << m.stats << " ideal " << ideal);
      CHECK(m.stats.rounds <= static_cast<int64_t>(ideal) + 4);
      // Pieces stepping aside move twice; they stay below the pieces landed.
      CHECK(m.stats.pages_compacted <= m.stats.pages_moved * split);
    }
}
