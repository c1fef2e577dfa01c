// kv_checksum: equal across EP and TP views of the same KV, and every TP replica of a
// replicated head (H_kv < P) is covered: a corrupted non-first replica changes the sum.

#include <optional>
#include <random>

#include "kv/kv_cases.hpp"
#include "kv/kv_reference.hpp"
#include "moebius/kv/kv_migration.hpp"
#include "moebius/switch/checksum.hpp"
#include "moebius/transport/host_transport.hpp"
#include "support/catch.hpp"

using namespace moebius;
using namespace moebius::testing;

namespace {

std::vector<std::span<const std::byte>> spans(const pools& p) {
  std::vector<std::span<const std::byte>> out;
  for (const auto& v : p) out.emplace_back(v);
  return out;
}

}  // namespace

TEST_CASE("kv_checksum covers every TP replica of a replicated head", "[switch][checksum]") {
  std::mt19937_64 rng(kv_test_seed() + 11);
  for (kv_layout layout : {kv_layout::hnd, kv_layout::nhd}) {
    // H_kv=2 on P=4: heads 0 and 1 each live on 2 TP ranks (0,1 and 2,3).
    const kv_geometry g = make_kv_geometry(2, 2, 4, 4, 16, 4, dtype::bf16, layout);
    // A random EP state that can migrate without staging (TP holds half of EP here, and a
    // rank whose sequences fill its TP pages with nothing free to move aside is stuck: the
    // planner says errc::capacity; that is the planner's business, tested in tests/kv).
    kv_case c;
    std::optional<kv_migration> planned;
    for (int attempt = 0; attempt < 100 && !planned; ++attempt) {
      c = random_kv_case(rng, g, parallel_mode::ep, 0.3, 20);
      try {
        planned = plan_kv_migration(g, c.state, parallel_mode::tp);
      } catch (const error& e) {
        REQUIRE(e.code() == errc::capacity);
      }
    }
    REQUIRE(planned.has_value());
    REQUIRE(!c.content.empty());
    pools kv(4, std::vector<std::byte>(static_cast<size_t>(g.pool_bytes()), std::byte{0}));
    fill_reference(g, c.state, c.content, kv);
    const uint64_t ep_sum = kv_checksum(g, c.state, spans(kv));

    const kv_migration& mig = *planned;
    std::vector<rank_memory> mem(4);
    for (size_t r = 0; r < 4; ++r) mem[r].spaces[static_cast<int>(memory_space::kv_pool)] = kv[r];
    host_transport(mem).execute(mig.copies);
    const kv_state& tp = mig.new_state;
    REQUIRE(kv_checksum(g, tp, spans(kv)) == ep_sum);

    // One byte of the first live page of each rank's first sequence, flipped in turn: every
    // rank (first replica or not) must change the checksum.
    for (int r = 0; r < 4; ++r) {
      INFO("layout " << to_string(layout) << " rank " << r);
      const kv_sequence& q = tp.ranks[static_cast<size_t>(r)].sequences.at(0);
      const int64_t off = g.offset(parallel_mode::tp, 1, kv_tensor::v, q.pages.at(0), 0, 0, 1);
      std::byte& b = kv[static_cast<size_t>(r)][static_cast<size_t>(off)];
      b ^= std::byte{0x5a};
      CHECK(kv_checksum(g, tp, spans(kv)) != ep_sum);
      b ^= std::byte{0x5a};
      CHECK(kv_checksum(g, tp, spans(kv)) == ep_sum);
    }
    // A free page does not count.
    if (!tp.ranks[1].free_pages.empty()) {
      const int64_t off = g.offset(parallel_mode::tp, 0, kv_tensor::k, tp.ranks[1].free_pages[0], 0, 0, 0);
      kv[1][static_cast<size_t>(off)] ^= std::byte{1};
      CHECK(kv_checksum(g, tp, spans(kv)) == ep_sum);
    }
  }
}
