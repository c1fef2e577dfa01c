// Longest-first placement against a naive reference, capacity limits, share groups.

#include <algorithm>
#include <numeric>
#include <random>

#include "kv_cases.hpp"
#include "moebius/kv/placement.hpp"
#include "support/catch.hpp"

using namespace moebius;
using namespace moebius::testing;

namespace {

// Naive longest-first without sharing: O(n^2) selection of the next longest, then a scan.
std::vector<int> naive_place(std::vector<kv_demand> d, const std::vector<int64_t>& cap,
                             std::vector<int64_t>& load) {
  std::vector<int> owner(d.size(), -1);
  std::vector<bool> done(d.size(), false);
  load.assign(cap.size(), 0);
  for (size_t n = 0; n < d.size(); ++n) {
    size_t best = d.size();
    for (size_t i = 0; i < d.size(); ++i) {
      if (done[i]) continue;
      if (best == d.size() || d[i].own_pages > d[best].own_pages ||
          (d[i].own_pages == d[best].own_pages && d[i].seq_id < d[best].seq_id))
        best = i;
    }
    done[best] = true;
    int r_best = -1;
    for (size_t r = 0; r < cap.size(); ++r) {
      if (load[r] + d[best].own_pages > cap[r]) continue;
      if (r_best < 0 || load[r] < load[static_cast<size_t>(r_best)]) r_best = static_cast<int>(r);
    }
    if (r_best >= 0) {
      owner[best] = r_best;
      load[static_cast<size_t>(r_best)] += d[best].own_pages;
    }
  }
  return owner;
}

}  // namespace

TEST_CASE("place_longest_first matches the naive reference", "[kv][placement]") {
  std::mt19937_64 rng(kv_test_seed());
  for (int iter = 0; iter < 200; ++iter) {
    const int P = static_cast<int>(uni(rng, 1, 8));
    const auto n = static_cast<size_t>(uni(rng, 0, 300));
    std::vector<kv_demand> d(n);
    std::vector<int64_t> ids(n);
    std::iota(ids.begin(), ids.end(), int64_t{0});
    std::shuffle(ids.begin(), ids.end(), rng);
    int64_t total = 0;
    for (size_t i = 0; i < n; ++i) {
      d[i].seq_id = ids[i] * 3 + 1;
      d[i].own_pages = uni(rng, 0, 3) == 0 ? uni(rng, 1, 4) : uni(rng, 1, 200);
      total += d[i].own_pages;
    }
    std::vector<int64_t> cap(static_cast<size_t>(P));
    const int64_t lim = uni(rng, 0, 1) ? total : total / P + uni(rng, 0, 50);
    for (auto& c : cap) c = uni(rng, lim / 2, lim + 1);
    const kv_placement pl = place_longest_first(d, {}, cap);
    std::vector<int64_t> load;
    const std::vector<int> ref = naive_place(d, cap, load);
    REQUIRE(pl.owner == ref);
    REQUIRE(pl.load == load);
    REQUIRE(pl.fits == std::none_of(ref.begin(), ref.end(), [](int o) { return o < 0; }));
    for (int r = 0; r < P; ++r) REQUIRE(pl.load[static_cast<size_t>(r)] <= cap[static_cast<size_t>(r)]);
    if (total > 0) {
      const double mean = static_cast<double>(total) / P;
      if (pl.fits)
        REQUIRE(pl.imbalance == Catch::Approx(static_cast<double>(*std::max_element(load.begin(), load.end())) / mean));
    }
    // Deterministic: same answer for a shuffled input (owners follow their demand).
    std::vector<size_t> perm(n);
    std::iota(perm.begin(), perm.end(), size_t{0});
    std::shuffle(perm.begin(), perm.end(), rng);
    std::vector<kv_demand> d2(n);
    for (size_t i = 0; i < n; ++i) d2[i] = d[perm[i]];
    const kv_placement pl2 = place_longest_first(d2, {}, cap);
    for (size_t i = 0; i < n; ++i) REQUIRE(pl2.owner[i] == pl.owner[perm[i]]);
  }
}

TEST_CASE("place_longest_first keeps share groups together, splits only when it must",
          "[kv][placement]") {
  // Group 0: 10 shared pages + members of 5 and 6 own pages = 21 pages as one item.
  std::vector<kv_demand> d = {{1, 5, 0}, {2, 6, 0}, {3, 4, -1}};
  const std::vector<int64_t> groups = {10};
  {
    const std::vector<int64_t> cap = {30, 30};
    const kv_placement pl = place_longest_first(d, groups, cap);
    CHECK(pl.fits);
    CHECK(pl.owner[0] == pl.owner[1]);
    CHECK(pl.split_groups == 0);
    CHECK(pl.load[static_cast<size_t>(pl.owner[0])] == 21);
    CHECK(pl.owner[2] != pl.owner[0]);
  }
  {
    // Neither rank holds 21: the group splits and its 10 shared pages go to both owners once.
    const std::vector<int64_t> cap = {20, 20};
    const kv_placement pl = place_longest_first(d, groups, cap);
    CHECK(pl.split_groups == 1);
    CHECK(pl.owner[0] != pl.owner[1]);
    CHECK(pl.load[0] + pl.load[1] == 10 + 6 + 10 + 5 + 4);
    CHECK(pl.fits);
  }
  {
    const std::vector<int64_t> cap = {8, 8};
    const kv_placement pl = place_longest_first(d, groups, cap);
    CHECK_FALSE(pl.fits);
    CHECK(pl.load[0] <= 8);
    CHECK(pl.load[1] <= 8);
  }
  CHECK_THROWS_AS(place_longest_first(std::vector<kv_demand>{{1, 5, 3}}, groups,
                                      std::vector<int64_t>{4}),
                  moebius::error);
}

TEST_CASE("kv_demands_of finds share groups and counts shared pages once", "[kv][placement]") {
  std::mt19937_64 rng(kv_test_seed() + 7);
  for (int iter = 0; iter < 30; ++iter) {
    const kv_geometry g = random_kv_geometry(rng, 65536);
    const kv_case c = random_kv_case(rng, g, parallel_mode::tp, 0.6, 500);
    std::vector<kv_demand> d;
    std::vector<int64_t> groups;
    kv_demands_of(g, c.state, d, groups);
    REQUIRE(d.size() == c.state.ranks[0].sequences.size());
    // Sum of own pages + group pages = distinct pages in use on rank 0.
    int64_t sum = std::accumulate(groups.begin(), groups.end(), int64_t{0});
    for (const kv_demand& x : d) sum += x.own_pages;
    REQUIRE(sum == used_pages(g, c.state, 0));
  }
}
