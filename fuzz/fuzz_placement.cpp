// Fuzzes longest-first placement with arbitrary demands, share groups and capacities. Any
// input must give a moebius::error or a placement within capacity whose loads are exactly
// what its owners imply (own pages, plus each group's shared pages once per owning rank).
#include <cmath>
#include <vector>

#include "fuzz_input.hpp"
#include "moebius/error.hpp"
#include "moebius/kv/placement.hpp"

using namespace moebius;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  fuzz::input in(data, size);
  const auto P = static_cast<size_t>(in.range(0, 8));
  const auto num_groups = static_cast<size_t>(in.range(0, 4));
  const auto num_demands = static_cast<size_t>(in.range(0, 64));
  std::vector<int64_t> capacity(P), groups(num_groups);
  for (int64_t& c : capacity) c = in.mostly(0, 64);
  for (int64_t& g : groups) g = in.mostly(0, 8);
  std::vector<kv_demand> demands(num_demands);
  for (kv_demand& d : demands) {
    d.seq_id = in.mostly(0, 100);
    d.own_pages = in.mostly(0, 16);
    d.share_group = in.range(-1, static_cast<int64_t>(num_groups));
  }
  kv_placement pl;
  try {
    pl = place_longest_first(demands, groups, capacity);
  } catch (const error&) {
    return 0;
  }
  MOEBIUS_FUZZ_REQUIRE(pl.owner.size() == demands.size() && pl.load.size() == P, "sizes");
  std::vector<__int128> load(P, 0);
  std::vector<std::vector<bool>> charged(num_groups, std::vector<bool>(P, false));
  bool all = true;
  for (size_t i = 0; i < demands.size(); ++i) {
    const int o = pl.owner[i];
    MOEBIUS_FUZZ_REQUIRE(o >= -1 && o < static_cast<int>(P), "owner in [-1, P)");
    if (o < 0) {
      all = false;
      continue;
    }
    load[static_cast<size_t>(o)] += demands[i].own_pages;
    const int64_t g = demands[i].share_group;
    if (g >= 0 && !charged[static_cast<size_t>(g)][static_cast<size_t>(o)]) {
      charged[static_cast<size_t>(g)][static_cast<size_t>(o)] = true;
      load[static_cast<size_t>(o)] += groups[static_cast<size_t>(g)];
    }
  }
  for (size_t r = 0; r < P; ++r) {
    MOEBIUS_FUZZ_REQUIRE(load[r] == pl.load[r], "load = what the owners imply");
    MOEBIUS_FUZZ_REQUIRE(pl.load[r] <= capacity[r], "load within capacity");
  }
  MOEBIUS_FUZZ_REQUIRE(pl.fits == all, "fits iff every demand has an owner");
  MOEBIUS_FUZZ_REQUIRE(std::isfinite(pl.imbalance) && pl.imbalance >= 0, "imbalance finite");
  return 0;
}
