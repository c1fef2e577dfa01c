// The busiest EP rank's expert load (expert_load.hpp): the Monte Carlo against an independent
// count (exact at one token), the uniform figures the pricing rests on, the emulated rank's
// counts by hand, and the shift's sign where the emulation reads too many or too few experts.
#include <cmath>

#include <moebius/error.hpp>

#include "catch.hpp"
#include "expert_load.hpp"

using namespace mini_engine;

namespace {

// Exact E[max over 8 ranks of the token's experts on each] for one token, top-8 of 128 (16 a
// rank): by enumerating the multivariate hypergeometric counts (c_0..c_7, sum 8, each <= 16).
double exact_one_token_busiest() {
  const auto choose = [](int n, int k) {
    double c = 1;
    for (int i = 1; i <= k; ++i) c = c * (n - k + i) / i;
    return c;
  };
  double expected = 0;
  // Recursion over ranks: accumulate the probability weight of each count vector.
  struct frame {
    int rank, left, most;
    double ways;
  };
  std::vector<frame> stack = {{0, 8, 0, 1}};
  while (!stack.empty()) {
    const frame f = stack.back();
    stack.pop_back();
    if (f.rank == 8) {
      if (f.left == 0) expected += f.ways * f.most;
      continue;
    }
    for (int c = 0; c <= std::min(16, f.left); ++c)
      stack.push_back({f.rank + 1, f.left - c, std::max(f.most, c), f.ways * choose(16, c)});
  }
  return expected / choose(128, 8);
}

}  // namespace

TEST_CASE("the busiest rank's experts: Monte Carlo against the exact count at one token",
          "[cpu][expert_load]") {
  const double exact = exact_one_token_busiest();
  CHECK(exact == Approx(2.53).epsilon(0.01));
  CHECK(busiest_rank_experts(1, 128, 8, 8) == Approx(exact).epsilon(0.02));
}

TEST_CASE("uniform routing: the busiest rank over the mean, as the pricing quotes it",
          "[cpu][expert_load]") {
  const struct {
    int64_t tokens;
    double ratio;
  } quoted[] = {{1, 2.53}, {8, 1.44}, {16, 1.25}, {32, 1.12}, {64, 1.02}};
  double last = 1e9;
  for (const auto& q : quoted) {
    const double ratio = busiest_rank_experts(q.tokens, 128, 8, 8) / mean_rank_experts(q.tokens, 128, 8, 8);
    INFO(q.tokens << " tokens");
    CHECK(ratio == Approx(q.ratio).epsilon(0.03));
    CHECK(ratio < last);  // the imbalance falls with the batch
    last = ratio;
  }
  // Every expert read: each rank reads its 16.
  CHECK(busiest_rank_experts(2048, 128, 8, 8) == 16);
  CHECK(busiest_rank_experts(0, 128, 8, 8) == 0);
  // The same arguments price alike (memoised, fixed seed).
  CHECK(busiest_rank_experts(8, 128, 8, 8) == busiest_rank_experts(8, 128, 8, 8));
}

TEST_CASE("a skewed router reads fewer distinct experts on the busiest rank", "[cpu][expert_load]") {
  // Popular experts take more of the picks, so fewer distinct experts are read in all: for the
  // weight reads priced here uniform routing is the heavier case once a step has a few tokens.
  for (const int64_t tokens : {8, 32, 128}) {
    INFO(tokens << " tokens");
    const double skewed = busiest_rank_experts(tokens, 128, 8, 8, routing_model{1.0});
    CHECK(skewed < busiest_rank_experts(tokens, 128, 8, 8));
    CHECK(skewed >= mean_rank_experts(1, 128, 8, 8));  // at least one token's share
  }
  // One token reads 8 distinct experts whatever the skew; the busiest rank holds at least 1.
  CHECK(busiest_rank_experts(1, 128, 8, 8, routing_model{1.0}) >= 1);
  CHECK(busiest_rank_experts(1, 128, 8, 8, routing_model{1.0}) <= 8);
}

TEST_CASE("the emulated rank's experts, by hand", "[cpu][expert_load]") {
  // EP: ceil(B/8) own tokens, top-8 of 16: one token reads 8; two 16 (1 - 1/4) = 12.
  CHECK(emulated_rank_experts(false, 1, 128, 8, 8) == Approx(8));
  CHECK(emulated_rank_experts(false, 8, 128, 8, 8) == Approx(8));
  CHECK(emulated_rank_experts(false, 16, 128, 8, 8) == Approx(12));
  // TEP: all B tokens, top-1 of 16: 16 (1 - (15/16)^B).
  CHECK(emulated_rank_experts(true, 1, 128, 8, 8) == Approx(1));
  CHECK(emulated_rank_experts(true, 4, 128, 8, 8) == Approx(16 * (1 - std::pow(15.0 / 16, 4))));
}

TEST_CASE("the shift: negative where the emulation read too many experts, positive where too few",
          "[cpu][expert_load]") {
  const double bytes = 3.0 * 4096 * 1536 * 2, hbm = 4e12;
  // EP at batch 1: 8 emulated against about 2.53: about -5.47 experts x 94 layers.
  const double ep1 = expert_load_shift_ms(false, 1, 128, 8, 8, 94, bytes, hbm);
  CHECK(ep1 == Approx((busiest_rank_experts(1, 128, 8, 8) - 8) * 94 * bytes / hbm * 1e3));
  CHECK(ep1 < -4);
  // EP at batch 8: still one own token (8 experts) against about 9.3 on the busiest: positive.
  CHECK(expert_load_shift_ms(false, 8, 128, 8, 8, 94, bytes, hbm) > 0);
  // TEP at batch 1: 1 emulated against 2.53: positive.
  CHECK(expert_load_shift_ms(true, 1, 128, 8, 8, 94, bytes, hbm) > 1);
  // Every expert read on both: nothing.
  CHECK(expert_load_shift_ms(false, 2048, 128, 8, 8, 94, bytes, hbm) == Approx(0).margin(1e-9));
  CHECK(expert_load_shift_ms(true, 2048, 128, 8, 8, 94, bytes, hbm) == Approx(0).margin(1e-6));
}

TEST_CASE("expert load: bad arguments are refused by name", "[cpu][expert_load]") {
  CHECK_THROWS_WITH(busiest_rank_experts(-1, 128, 8, 8), Catch::Contains("tokens -1"));
  CHECK_THROWS_WITH(busiest_rank_experts(4, 100, 8, 8), Catch::Contains("experts a multiple of ranks"));
  CHECK_THROWS_WITH(busiest_rank_experts(4, 128, 8, 200), Catch::Contains("top_k 200"));
  CHECK_THROWS_WITH(busiest_rank_experts(4, 128, 8, 8, routing_model{-1}), Catch::Contains("skew -1"));
  CHECK_THROWS_WITH(expert_load_shift_ms(false, 4, 128, 8, 8, 94, 1, 0), Catch::Contains("hbm 0"));
}
