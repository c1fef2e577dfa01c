// What SGLang's prefill-first steps cost a mode's decodes (prefill_stalls.hpp): the held and
// lost shares of a mode's recent steps against hand-computed means, the factor and its cap,
// the estimate for the mode not serving on the steady trace's worked example, and the EP step's
// slowdown by a prefill on one rank against hand-computed curves. The gate taking it in a run:
// test_serving_layouts ("the gate prices the decodes SGLang's prefills hold").
#include <algorithm>
#include <cmath>
#include <moebius/error.hpp>
#include <random>
#include <vector>

#include "catch.hpp"
#include "prefill_stalls.hpp"
#include "test_seed.hpp"

using namespace mini_engine;

TEST_CASE("prefill stalls: one kind of step gives its own shares; two kinds their exponential "
          "means") {
  SECTION("nothing seen: no share") {
    const prefill_stalls s;
    CHECK_FALSE(s.seen());
    CHECK(s.held_share() == 0);
    CHECK(s.lost_share() == 0);
  }
  SECTION("a TP step holding a quarter of its decodes, repeated") {
    prefill_stalls s;
    for (int k = 0; k < 100; ++k) s.add(60, 6, 2);
    CHECK(s.seen());
    CHECK(s.held_share() == Approx(0.25));
    CHECK(s.lost_share() == Approx(0.25));
  }
  SECTION("an EP step in which one rank of 8 prefills: an eighth of the time lost") {
    prefill_stalls s;
    for (int k = 0; k < 10; ++k) s.add(80, 7 * 16, 16);
    CHECK(s.held_share() == Approx(0.125));
    CHECK(s.lost_share() == Approx(0.125));
  }
  SECTION("a prefill-only step (100 ms, 8 held), then a decode step (50 ms, 8 made)") {
    // recent_mean, weight w: after x1 then x2 its unbiased mean is (x1 (1 - w) + x2) /
    // ((1 - w) + 1), the same weights in every mean, so each share is a ratio of
    // x1 (1 - w) + x2: lost 100 (1 - w) + 0 against time 100 (1 - w) + 50; held 8 (1 - w)
    // against slots 8 (1 - w) + 8.
    prefill_stalls s;
    s.add(100, 0, 8);
    s.add(50, 8, 0);
    const double w = prefill_stalls::k_weight;
    CHECK(s.lost_share() == Approx(100 * (1 - w) / (100 * (1 - w) + 50)));
    CHECK(s.held_share() == Approx((1 - w) / (2 - w)));
  }
  SECTION("a step with nothing to decode or hold (a rollout's first prefills) loses nothing") {
    prefill_stalls s;
    s.add(120, 0, 0);
    CHECK(s.held_share() == 0);
    CHECK(s.lost_share() == 0);
    s.add(40, 4, 4);
    CHECK(s.lost_share() > 0);
  }
  SECTION("every slot held, over steps of random lengths: a share of exactly 1, never above") {
    std::mt19937_64 rng(testing::test_seed());
    std::uniform_real_distribution<double> ms(0.1, 500);
    std::uniform_int_distribution<int64_t> held(1, 4096);
    prefill_stalls s;
    for (int k = 0; k < 5000; ++k) {
      s.add(ms(rng), 0, held(rng));
      REQUIRE(s.lost_share() <= 1);
      REQUIRE(s.held_share() <= 1);
    }
    CHECK(s.lost_share() == Approx(1));
    CHECK(stall_factor(s.lost_share()) == Approx(10));
  }
  SECTION("bad steps are refused by name") {
    prefill_stalls s;
    REQUIRE_THROWS_WITH(s.add(-1, 1, 0), Catch::Contains("step_ms"));
    REQUIRE_THROWS_WITH(s.add(NAN, 1, 0), Catch::Contains("step_ms"));
    REQUIRE_THROWS_WITH(s.add(1, -1, 0), Catch::Contains("decode_tokens"));
    REQUIRE_THROWS_WITH(s.add(1, 0, -2), Catch::Contains("decodes_held"));
    CHECK_FALSE(s.seen());
  }
}

TEST_CASE("prefill stalls: the factor is 1 / (1 - lost), capped at a 90% share") {
  CHECK(stall_factor(0) == 1);
  CHECK(stall_factor(0.5) == Approx(2));
  CHECK(stall_factor(0.513) == Approx(1 / 0.487));
  CHECK(stall_factor(0.9) == Approx(10));
  CHECK(stall_factor(1) == Approx(10));
  REQUIRE_THROWS_WITH(stall_factor(-0.1), Catch::Contains("lost_share"));
  REQUIRE_THROWS_WITH(stall_factor(1.5), Catch::Contains("lost_share"));
}

TEST_CASE("prefill stalls: the mode not serving, from the one serving, its schedulers counted") {
  SECTION("the steady trace from static TP (1 scheduler) to EP's 8") {
    // a_s = -ln(0.257) = 1.358679; a_u = 0.169835; q_u = 1 - exp(-a_u) = 0.156196;
    // lost_u = 0.513 x 0.156196 / 0.743 = 0.107845.
    CHECK(unseen_lost_share(0.743, 0.513, 1, 8) == Approx(0.107845).epsilon(1e-5));
  }
  SECTION("back from 8 schedulers to 1: the same arrivals a group a step, one group") {
    const double q_u = 1 - std::exp(std::log(1 - 0.156196) * 8);  // 0.743
    CHECK(unseen_lost_share(0.156196, 0.107845, 8, 1) == Approx(0.107845 * q_u / 0.156196));
    CHECK(unseen_lost_share(0.156196, 0.107845, 8, 1) == Approx(0.513).epsilon(1e-4));
  }
  SECTION("equal schedulers (TP attention in both modes), nothing held, or everything") {
    CHECK(unseen_lost_share(0.6, 0.4, 1, 1) == 0.4);
    CHECK(unseen_lost_share(0, 0, 1, 8) == 0);
    CHECK(unseen_lost_share(1, 0.7, 8, 1) == 0.7);
  }
  SECTION("never above a whole share, on random inputs") {
    std::mt19937_64 rng(testing::test_seed());
    std::uniform_real_distribution<double> share(0, 1);
    std::uniform_int_distribution<int64_t> groups(1, 64);
    for (int k = 0; k < 1000; ++k) {
      const double q = share(rng), lost = share(rng);
      const int64_t gs = groups(rng), gu = groups(rng);
      const double u = unseen_lost_share(q, lost, gs, gu);
      CAPTURE(q, lost, gs, gu);
      CHECK(u >= 0);
      CHECK(u <= 1);
      // More schedulers share the arrivals: each holds less.
      if (gu > gs) CHECK(u <= lost + 1e-12);
      if (gu < gs) CHECK(u >= std::min(1.0, lost) - 1e-12);
    }
  }
  SECTION("bad inputs are refused by name") {
    REQUIRE_THROWS_WITH(unseen_lost_share(1.2, 0.1, 1, 8), Catch::Contains("shares"));
    REQUIRE_THROWS_WITH(unseen_lost_share(0.2, -0.1, 1, 8), Catch::Contains("shares"));
    REQUIRE_THROWS_WITH(unseen_lost_share(0.2, 0.1, 0, 8), Catch::Contains("group counts"));
  }
}

TEST_CASE("prefill stalls: an EP step runs a chunk on one rank, as far as the rank's chunk goes") {
  const std::vector<moebius::latency_sample> line = {{1, 10.01}, {1001, 20.01}};  // 10 + 0.01 x
  const moebius::latency_curve ep =
      moebius::latency_curve::fit(line, moebius::curve_fit::least_squares_line);
  SECTION("the header's worked example") {
    // sglang: 8,192 / 8 = 1,024 a rank; 10 + 0.01 (100 + 8 x 1,024) = 92.92 against 31.
    CHECK(ep_prefill_slowdown(ep, 100, 2000, 8, 1024) == Approx(92.92 / 31));
    // vLLM's one budget: the whole 2,000 on one rank, 10 + 0.01 x 16,100 = 171.
    CHECK(ep_prefill_slowdown(ep, 100, 2000, 8, 8192) == Approx(171.0 / 31));
    // Under a rank's chunk the whole prefill is on one rank: 10 + 0.01 x 4,100 = 51 against 16.
    CHECK(ep_prefill_slowdown(ep, 100, 500, 8, 1024) == Approx(51.0 / 16));
  }
  SECTION("no prefill, or one rank: as TP's") {
    CHECK(ep_prefill_slowdown(ep, 100, 0, 8, 1024) == Approx(1));
    CHECK(ep_prefill_slowdown(ep, 100, 2000, 1, 1024) == Approx(1));
    // A chunk under pf / ranks: spread evenly, never thinner.
    CHECK(ep_prefill_slowdown(ep, 100, 2000, 8, 100) == Approx(1));
  }
  SECTION("on random inputs: at least 1 on a rising curve, and growing with the chunk") {
    std::mt19937_64 rng(testing::test_seed());
    std::uniform_real_distribution<double> rows(1, 4096), prefill(0, 16384);
    std::uniform_int_distribution<int64_t> ranks(1, 16), chunk(1, 16384);
    for (int k = 0; k < 1000; ++k) {
      const double b = rows(rng), pf = prefill(rng);
      const int64_t p = ranks(rng), c = chunk(rng);
      CAPTURE(b, pf, p, c);
      const double s = ep_prefill_slowdown(ep, b, pf, p, c);
      // Independent: the busiest rank's rows, counted rank by rank as the chunks fill them.
      double left = pf, busiest = 0;
      for (int64_t r = 0; r < p && left > 0; ++r) {
        const double take = std::min(left, static_cast<double>(c));
        busiest = std::max(busiest, take);
        left -= take;
      }
      if (left > 0) busiest = pf / static_cast<double>(p);  // past every chunk: spread evenly
      CHECK(s ==
            Approx((10 + 0.01 * (b + static_cast<double>(p) * busiest)) / (10 + 0.01 * (b + pf))));
      CHECK(s >= 1 - 1e-12);
      CHECK(ep_prefill_slowdown(ep, b, pf, p, c + 1) >= s - 1e-12);
    }
  }
  SECTION("bad inputs are refused by name") {
    REQUIRE_THROWS_WITH(ep_prefill_slowdown(ep, 0.5, 10, 8, 1024), Catch::Contains("b >= 1"));
    REQUIRE_THROWS_WITH(ep_prefill_slowdown(ep, 10, -1, 8, 1024), Catch::Contains("pf >= 0"));
    REQUIRE_THROWS_WITH(ep_prefill_slowdown(ep, 10, 10, 0, 1024), Catch::Contains("ranks >= 1"));
    REQUIRE_THROWS_WITH(ep_prefill_slowdown(ep, 10, 10, 8, 0), Catch::Contains("rank_chunk"));
  }
}
