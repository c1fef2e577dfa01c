// host_transport: the transport conformance suite (transport_conformance.hpp) on host "ranks",
// P in {1, 2, 3, 4, 8}; then what only host memory can show: the independent reference itself
// catches a corrupted byte, ranks of unequal size, aliased memories, streams that are not null.

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "moebius/error.hpp"
#include "moebius/plan/weight_plan.hpp"
#include "moebius/transport/host_transport.hpp"
#include "support/catch.hpp"
#include "support/random.hpp"
#include "support/reference.hpp"
#include "transport/transport_conformance.hpp"

using namespace moebius;
using moebius::testing::test_seed;

namespace {

// host_transport over P host ranks: it runs each plan inside enqueue(), so it holds no streams.
class host_fixture final : public testing::transport_fixture {
 public:
  explicit host_fixture(int num_ranks) : num_ranks_(num_ranks) {}
  std::string name() const override { return "host P=" + std::to_string(num_ranks_); }
  int num_ranks() const override { return num_ranks_; }
  int rounds() const override { return 12; }  // memcpy is cheap: more random shapes
  std::unique_ptr<testing::fixture_memory> allocate(const testing::space_sizes& bytes) override {
    return std::make_unique<testing::host_memory>(num_ranks_, bytes);
  }
  std::unique_ptr<transport> make(const testing::fixture_memory& memory,
                                  std::span<const plan>) override {
    return std::make_unique<host_transport>(memory.ranks());
  }

 private:
  int num_ranks_;
};

testing::fixture_list host_fixtures() {
  testing::fixture_list f;
  for (const int P : {1, 2, 3, 4, 8}) f.push_back(std::make_unique<host_fixture>(P));
  return f;
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

}  // namespace

MOEBIUS_TRANSPORT_CONFORMANCE("host_transport", "[transport][host_transport]", host_fixtures)

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

TEST_CASE("a plan must fit the smallest rank's memory", "[transport][validate]") {
  std::mt19937_64 rng(test_seed());
  expert_shape s = testing::random_shape(rng, 2, false);
  const arena_geometry g = testing::random_geometry(rng, s, 2);
  const testing::logical_weights w = testing::random_weights(s, rng);
  testing::rank_images images;
  testing::load_reference(w, g, {s.num_layers}, images);
  const testing::rank_images before = images;
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

TEST_CASE("host memory has no streams: a non-null stream is refused", "[transport][validate]") {
  std::vector<std::byte> buffer(256, std::byte{1});
  std::vector<rank_memory> ranks(1);
  ranks[0].spaces[0] = std::span<std::byte>(buffer);
  host_transport t(std::move(ranks));
  plan p;
  p.num_ranks = 1;
  p.phases.push_back({"copy", {copy_op{0, 128, 1, 64, 64, 64, 0, 0}}});
  int not_a_stream = 0;
  const stream_handle streams[] = {&not_a_stream};
  try {
    t.enqueue(p, streams);
    FAIL("no throw");
  } catch (const moebius::error& e) {
    CHECK(e.code() == errc::invalid_argument);
  }
  CHECK(buffer == std::vector<std::byte>(256, std::byte{1}));
}
