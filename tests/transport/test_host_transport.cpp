// host_transport runs weight-switch plans on host "ranks"; after every switch the arena must
// equal, byte for byte, what a static load at the new cursor writes (support/reference.hpp).
// Faults, bad plans and aliased memories must leave the arena as it was or rollback-able.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "moebius/error.hpp"
#include "moebius/plan/weight_plan.hpp"
#include "moebius/transport/host_transport.hpp"
#include "support/catch.hpp"
#include "support/random.hpp"
#include "support/reference.hpp"

using namespace moebius;
using moebius::testing::test_seed;

namespace {

host_transport make_transport(testing::rank_images& images) {
  std::vector<rank_memory> ranks(images.size());
  for (size_t r = 0; r < images.size(); ++r) {
    ranks[r].spaces[static_cast<int>(memory_space::arena)] = std::span<std::byte>(images[r]);
  }
  return host_transport(std::move(ranks));
}

struct setup {
  int P;
  arena_geometry g;
  testing::logical_weights w;
};

setup random_setup(std::mt19937_64& rng) {
  const int P = testing::pick(rng, {1, 2, 3, 4, 8});
  const expert_shape s = testing::random_shape(rng, P, testing::coin(rng));
  const arena_geometry g = testing::random_geometry(rng, s, P);
  return {P, g, testing::random_weights(s, rng)};
}

// Runs from -> to on `images` (which rest at `from`) after scribbling over the free slot, and
// checks the result against the reference at `to`.
void switch_and_check(const setup& su, testing::rank_images& images, arena_cursor from,
                      arena_cursor to, std::mt19937_64& rng) {
  testing::scribble_slot(su.g, arena_geometry::free_slot(from), images, rng);
  host_transport t = make_transport(images);
  const plan p = plan_weight_switch(su.g, from, to);
  t.execute(p);
  CHECK(t.completed_phases() == static_cast<int64_t>(p.phases.size()));
  INFO("switch " << from.tp_layers << " -> " << to.tp_layers);
  REQUIRE(testing::compare_to_reference(su.w, su.g, to, images) == "");
}

// Every byte of every slot except `free_slot` is equal.
std::string diff_outside_slot(const arena_geometry& g, int64_t free_slot,
                              const testing::rank_images& a, const testing::rank_images& b) {
  for (size_t r = 0; r < a.size(); ++r) {
    for (int64_t slot = 0; slot < g.num_slots(); ++slot) {
      if (slot == free_slot) continue;
      const auto* pa = a[r].data() + slot * g.slot_bytes;
      const auto* pb = b[r].data() + slot * g.slot_bytes;
      if (std::memcmp(pa, pb, static_cast<size_t>(g.slot_bytes)) != 0) {
        return "rank " + std::to_string(r) + " slot " + std::to_string(slot) + " differs";
      }
    }
  }
  return "";
}

}  // namespace

TEST_CASE("the reference detects a corrupted byte", "[transport][reference]") {
  std::mt19937_64 rng(test_seed());
  for (int iter = 0; iter < 20; ++iter) {
    const setup su = random_setup(rng);
    const arena_cursor c = testing::random_cursor(rng, su.g);
    testing::rank_images images;
    testing::load_reference(su.w, su.g, c, images);
    REQUIRE(testing::compare_to_reference(su.w, su.g, c, images) == "");
    // Flip one byte in an occupied slot (tensor or padding): the comparison must see it.
    int64_t slot = testing::uniform(rng, 0, su.g.shape.num_layers - 1);
    if (slot >= c.tp_layers) ++slot;
    const int64_t off = slot * su.g.slot_bytes + testing::uniform(rng, 0, su.g.slot_bytes - 1);
    auto& rank = images[static_cast<size_t>(testing::uniform(rng, 0, su.P - 1))];
    rank[static_cast<size_t>(off)] ^= std::byte{0x10};
    CHECK(testing::compare_to_reference(su.w, su.g, c, images) != "");
    rank[static_cast<size_t>(off)] ^= std::byte{0x10};
    // The free slot is not compared.
    testing::scribble_slot(su.g, c.tp_layers, images, rng);
    CHECK(testing::compare_to_reference(su.w, su.g, c, images) == "");
    // A different cursor is a different layout (unless nothing is at stake).
    if (su.g.shape.num_layers > 0 && c.tp_layers > 0) {
      CHECK(testing::compare_to_reference(su.w, su.g, {c.tp_layers - 1}, images) != "");
    }
  }
}

TEST_CASE("EP -> TP -> EP matches a static load at every end", "[transport]") {
  std::mt19937_64 rng(test_seed());
  for (int iter = 0; iter < 300; ++iter) {
    const setup su = random_setup(rng);
    INFO("iteration " << iter << ": " << su.g);
    const arena_cursor ep{0}, tp{su.g.shape.num_layers};
    testing::rank_images images;
    testing::load_reference(su.w, su.g, ep, images);
    switch_and_check(su, images, ep, tp, rng);
    switch_and_check(su, images, tp, ep, rng);
  }
}

TEST_CASE("partial switches between random cursors, and back", "[transport]") {
  std::mt19937_64 rng(test_seed());
  for (int iter = 0; iter < 250; ++iter) {
    const setup su = random_setup(rng);
    const arena_cursor a = testing::random_cursor(rng, su.g);
    const arena_cursor b = testing::random_cursor(rng, su.g);
    const arena_cursor c = testing::random_cursor(rng, su.g);
    INFO("iteration " << iter << ": " << su.g << ", cursors " << a.tp_layers << " -> "
                      << b.tp_layers << " -> " << c.tp_layers << " -> " << a.tp_layers);
    testing::rank_images images;
    testing::load_reference(su.w, su.g, a, images);
    switch_and_check(su, images, a, b, rng);
    switch_and_check(su, images, b, c, rng);
    switch_and_check(su, images, c, a, rng);
  }
}

TEST_CASE("a weight switch leaves every rank's KV pool untouched", "[transport]") {
  std::mt19937_64 rng(test_seed());
  for (int iter = 0; iter < 20; ++iter) {
    const setup su = random_setup(rng);
    testing::rank_images arena;
    testing::load_reference(su.w, su.g, {0}, arena);
    std::vector<std::vector<std::byte>> kv(static_cast<size_t>(su.P));
    for (auto& pool : kv) {
      pool.resize(static_cast<size_t>(testing::uniform(rng, 1, 4096)));
      for (auto& b : pool) b = static_cast<std::byte>(rng() & 0xFF);
    }
    const auto kv_before = kv;
    std::vector<rank_memory> ranks(static_cast<size_t>(su.P));
    for (size_t r = 0; r < ranks.size(); ++r) {
      ranks[r].spaces[static_cast<int>(memory_space::arena)] = std::span<std::byte>(arena[r]);
      ranks[r].spaces[static_cast<int>(memory_space::kv_pool)] = std::span<std::byte>(kv[r]);
    }
    host_transport t(std::move(ranks));
    const arena_cursor tp{su.g.shape.num_layers};
    t.execute(plan_weight_switch(su.g, {0}, tp));
    REQUIRE(testing::compare_to_reference(su.w, su.g, tp, arena) == "");
    t.execute(plan_weight_switch(su.g, tp, {0}));
    REQUIRE(testing::compare_to_reference(su.w, su.g, {0}, arena) == "");
    REQUIRE(kv == kv_before);
  }
}

TEST_CASE("an injected fault stops at a resting cursor and rolls back exactly", "[transport][fault]") {
  std::mt19937_64 rng(test_seed());
  int faults = 0;
  for (int iter = 0; iter < 250; ++iter) {
    const setup su = random_setup(rng);
    const arena_cursor a = testing::random_cursor(rng, su.g);
    arena_cursor b = testing::random_cursor(rng, su.g);
    if (b == a) b = arena_cursor{a.tp_layers == 0 ? su.g.shape.num_layers : 0};
    INFO("iteration " << iter << ": " << su.g << ", " << a.tp_layers << " -> " << b.tp_layers);
    testing::rank_images images;
    testing::load_reference(su.w, su.g, a, images);
    testing::scribble_slot(su.g, a.tp_layers, images, rng);
    const testing::rank_images original = images;
    const plan p = plan_weight_switch(su.g, a, b);
    const int64_t phase = testing::uniform(rng, 0, static_cast<int64_t>(p.phases.size()) - 1);
    const int64_t op = testing::uniform(
        rng, 0, static_cast<int64_t>(p.phases[static_cast<size_t>(phase)].ops.size()) - 1);
    INFO("fault before op " << op << " of phase " << phase);
    host_transport t = make_transport(images);
    t.inject_fault(fault_point{phase, op});
    try {
      t.execute(p);
      FAIL("the injected fault did not fire");
    } catch (const moebius::error& e) {
      CHECK(e.code() == errc::injected_fault);
      ++faults;
    }
    REQUIRE(t.completed_phases() == phase);
    // The arena rests at the cursor the completed phases reached.
    const arena_cursor reached{b.tp_layers > a.tp_layers ? a.tp_layers + phase
                                                         : a.tp_layers - phase};
    REQUIRE(testing::compare_to_reference(su.w, su.g, reached, images) == "");
    // Roll back: the plan from there to the start restores every byte outside the free slot.
    t.execute(plan_weight_switch(su.g, reached, a));
    REQUIRE(testing::compare_to_reference(su.w, su.g, a, images) == "");
    REQUIRE(diff_outside_slot(su.g, a.tp_layers, original, images) == "");
    // The fault was one-shot: the same plan now runs to the end.
    t.execute(p);
    CHECK(t.completed_phases() == static_cast<int64_t>(p.phases.size()));
    REQUIRE(testing::compare_to_reference(su.w, su.g, b, images) == "");
  }
  CHECK(faults == 250);
}

TEST_CASE("a disarmed fault does not fire", "[transport][fault]") {
  std::mt19937_64 rng(test_seed());
  const setup su = random_setup(rng);
  testing::rank_images images;
  testing::load_reference(su.w, su.g, {0}, images);
  host_transport t = make_transport(images);
  t.inject_fault(fault_point{0, 0});
  t.inject_fault(std::nullopt);
  t.execute(plan_weight_switch(su.g, {0}, {su.g.shape.num_layers}));
  CHECK(testing::compare_to_reference(su.w, su.g, {su.g.shape.num_layers}, images) == "");
}

TEST_CASE("a bad plan throws and moves nothing", "[transport][validate]") {
  std::mt19937_64 rng(test_seed());
  for (int iter = 0; iter < 30; ++iter) {
    setup su = random_setup(rng);
    const int64_t L = su.g.shape.num_layers;
    testing::rank_images images;
    testing::load_reference(su.w, su.g, {0}, images);
    const testing::rank_images before = images;
    host_transport t = make_transport(images);
    plan p = plan_weight_switch(su.g, {0}, {L});
    // Corrupt one op of the last phase: the phases before it must not run either.
    auto& ops = p.phases.back().ops;
    copy_op& victim = ops[static_cast<size_t>(testing::uniform(rng, 0, static_cast<int64_t>(ops.size()) - 1))];
    const int kind = static_cast<int>(testing::uniform(rng, 0, 3));
    errc want = errc::out_of_range;
    switch (kind) {
      case 0: victim.dst_offset = su.g.total_bytes() - victim.row_bytes + 1; break;
      case 1: victim.src_offset = -8; break;
      case 2: victim.dst_rank = su.P; want = errc::invalid_argument; break;
      default: victim.rows = 0; want = errc::invalid_argument; break;
    }
    INFO("iteration " << iter << ", corruption " << kind << ": " << victim);
    try {
      t.execute(p);
      FAIL("no throw");
    } catch (const moebius::error& e) {
      CHECK(e.code() == want);
    }
    CHECK(t.completed_phases() == 0);
    REQUIRE(images == before);
    CHECK_THROWS_AS(t.validate(p), moebius::error);
  }
}

TEST_CASE("plans for another rank count or larger memory are rejected", "[transport][validate]") {
  std::mt19937_64 rng(test_seed());
  expert_shape s = testing::random_shape(rng, 2, false);
  const arena_geometry g = testing::random_geometry(rng, s, 2);
  const testing::logical_weights w = testing::random_weights(s, rng);
  testing::rank_images images;
  testing::load_reference(w, g, {s.num_layers}, images);
  const testing::rank_images before = images;
  {
    // A plan for 3 ranks on a 2-rank transport.
    testing::rank_images three(3, std::vector<std::byte>(images[0].size()));
    host_transport t = make_transport(images);
    const arena_geometry g3 = make_arena_geometry(testing::random_shape(rng, 3, false), 3, 1, 1);
    try {
      t.execute(plan_weight_switch(g3, {0}, {1}));
      FAIL("no throw");
    } catch (const moebius::error& e) {
      CHECK(e.code() == errc::invalid_argument);
      CHECK(std::string(e.what()).find("3 ranks") != std::string::npos);
    }
  }
  {
    // Rank 1's memory lacks the last slot: TP->EP writes it, so nothing may move.
    std::vector<rank_memory> ranks(2);
    ranks[0].spaces[0] = std::span<std::byte>(images[0]);
    ranks[1].spaces[0] = std::span<std::byte>(images[1]).first(
        static_cast<size_t>(g.total_bytes() - g.slot_bytes));
    host_transport t(std::move(ranks));
    try {
      t.execute(plan_weight_switch(g, {s.num_layers}, {0}));
      FAIL("no throw");
    } catch (const moebius::error& e) {
      CHECK(e.code() == errc::out_of_range);
    }
    CHECK(t.completed_phases() == 0);
  }
  CHECK(images == before);
}

TEST_CASE("overlapping rank memories are rejected", "[transport][validate]") {
  std::vector<std::byte> buffer(4096);
  std::span<std::byte> all(buffer);
  auto make = [](std::span<std::byte> a0, std::span<std::byte> k0, std::span<std::byte> a1,
                 std::span<std::byte> k1) {
    std::vector<rank_memory> r(2);
    r[0].spaces[0] = a0;
    r[0].spaces[1] = k0;
    r[1].spaces[0] = a1;
    r[1].spaces[1] = k1;
    return r;
  };
  auto rejects = [](std::vector<rank_memory> r) {
    try {
      host_transport t(std::move(r));
      return false;
    } catch (const moebius::error& e) {
      CHECK(e.code() == errc::invalid_argument);
      CHECK(std::string(e.what()).find("overlap") != std::string::npos);
      return true;
    }
  };
  // Same memory for both ranks.
  CHECK(rejects(make(all.first(1024), {}, all.first(1024), {})));
  // Off by one byte.
  CHECK(rejects(make(all.first(1024), {}, all.subspan(1023, 1024), {})));
  // One rank's arena inside another rank's KV pool.
  CHECK(rejects(make(all.first(1024), all.subspan(2048, 1024), all.subspan(2500, 16), {})));
  // Arena and KV pool of one rank alias.
  CHECK(rejects(make(all.first(1024), all.subspan(512, 1024), all.subspan(3000, 16), {})));
  // Adjacent spans are fine; empty spaces are ignored.
  CHECK_NOTHROW(host_transport(make(all.first(1024), all.subspan(1024, 1024),
                                    all.subspan(2048, 1024), {})));
  CHECK_NOTHROW(host_transport(make(all.first(1024), {}, all.subspan(1024, 1024), {})));
  // No ranks at all.
  try {
    host_transport t(std::vector<rank_memory>{});
    FAIL("no throw");
  } catch (const moebius::error& e) {
    CHECK(e.code() == errc::invalid_argument);
  }
}
