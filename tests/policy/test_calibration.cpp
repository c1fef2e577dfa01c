// Calibration: recovers a known crossover from noisy synthetic latencies, derives T_h / T_l,
// reports curves that do not cross, and rejects bad samples.

#include <cmath>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "moebius/error.hpp"
#include "moebius/policy/calibration.hpp"
#include "policy_seed.hpp"
#include "support/catch.hpp"

using namespace moebius;
using moebius::testing::policy_test_seed;

namespace {

struct line {
  double a, s;
  double at(double b) const { return a + s * b; }
};

std::vector<latency_sample> sample(const line& l, const std::vector<double>& batches, int reps,
                                   double rel_noise, std::mt19937_64& rng) {
  std::normal_distribution<double> noise(0.0, 1.0);
  std::vector<latency_sample> out;
  for (int r = 0; r < reps; ++r) {
    for (double b : batches) {
      const double v = l.at(b);
      out.push_back({b, v * (1.0 + rel_noise * noise(rng))});
    }
  }
  return out;
}

std::vector<double> powers_of_two(double lo, double hi) {
  std::vector<double> v;
  for (double b = lo; b <= hi; b *= 2) v.push_back(b);
  return v;
}

std::string what_of(auto&& f) {
  try {
    f();
  } catch (const moebius::error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("calibration: worked example from the header", "[calibration]") {
  const line ep{20, 0.05}, tp{10, 0.1};
  std::vector<latency_sample> e, t;
  for (double b : {1.0, 64.0, 512.0}) {
    e.push_back({b, ep.at(b)});
    t.push_back({b, tp.at(b)});
  }
  for (curve_fit fit : {curve_fit::least_squares_line, curve_fit::piecewise_linear}) {
    calibration_options o;
    o.fit = fit;
    const calibration_result r = calibrate(e, t, o);
    INFO(r);
    REQUIRE(r.cross.status == crossover_status::found);
    CHECK(r.cross.batch == Catch::Approx(200.0).epsilon(1e-12));
    CHECK(r.cross.num_crossings == 1);
    REQUIRE(r.has_thresholds);
    CHECK(r.t_high == 250);
    CHECK(r.t_low == 200);
    const switch_policy_config c = apply_calibration(r, interactive_config(256));
    CHECK(c.t_high == 250);
    CHECK(c.t_low == 200);
    CHECK(c.cooldown_s == 5.0);  // the rest of the base config is kept
  }
  // Line fit of two points is exact.
  const latency_curve c = latency_curve::fit(std::vector<latency_sample>{{1, 10}, {3, 14}},
                                             curve_fit::least_squares_line);
  CHECK(c.intercept() == Catch::Approx(8.0));
  CHECK(c.slope() == Catch::Approx(2.0));
}

TEST_CASE("calibration: recovers a known crossover from noisy samples", "[calibration]") {
  std::mt19937_64 rng(policy_test_seed() + 10);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  const std::vector<double> batches = powers_of_two(1, 1024);
  for (int trial = 0; trial < 100; ++trial) {
    // TP: lower fixed cost, steeper; EP: gap ms more fixed cost, flatter. B* = gap / ds.
    const double b_star = 32 + u(rng) * 368;
    const double a_tp = 10 + 20 * u(rng);
    const double gap = 5 + 10 * u(rng);
    const double s_ep = 0.01 + 0.04 * u(rng);
    const double s_tp = s_ep + gap / b_star;
    const line ep{a_tp + gap, s_ep}, tp{a_tp, s_tp};
    const auto e = sample(ep, batches, 3, 0.005, rng);
    const auto t = sample(tp, batches, 3, 0.005, rng);
    const calibration_result r = calibrate(e, t);
    INFO("trial " << trial << " true B*=" << b_star << ": " << r);
    REQUIRE(r.cross.status == crossover_status::found);
    CHECK(r.cross.batch == Catch::Approx(b_star).epsilon(0.10));
    CHECK(r.t_high == static_cast<int64_t>(std::ceil(r.cross.batch * 1.25 - 1e-9)));
    CHECK(r.t_low == std::llround(0.8 * static_cast<double>(r.t_high)));
    // Piecewise without noise lands exactly on the true crossing.
    calibration_options pw;
    pw.fit = curve_fit::piecewise_linear;
    const calibration_result exact =
        calibrate(sample(ep, batches, 1, 0.0, rng), sample(tp, batches, 1, 0.0, rng), pw);
    CHECK(exact.cross.batch == Catch::Approx(b_star).epsilon(1e-9));
  }
}

TEST_CASE("calibration: piecewise curves that touch at small batch cross for good later",
          "[calibration]") {
  // TP 10 + 0.1·b; EP 1 ms over it at batch 8 and 0.5 ms under at 16 (a near-tie), over it
  // again from 32, and 20 + 0.05·b from 128: tp - ep changes sign three times, and B* is the
  // last upward crossing, at 200 (where 10 + 0.1·b = 20 + 0.05·b).
  const std::vector<latency_sample> tp = {{1, 10.1}, {8, 10.8}, {16, 11.6}, {32, 13.2},
                                          {128, 22.8}, {512, 61.2}};
  const std::vector<latency_sample> ep = {{1, 20.05}, {8, 11.8}, {16, 11.1}, {32, 21.6},
                                          {128, 26.4}, {512, 45.6}};
  calibration_options pw;
  pw.fit = curve_fit::piecewise_linear;
  const calibration_result r = calibrate(ep, tp, pw);
  INFO(r);
  REQUIRE(r.cross.status == crossover_status::found);
  CHECK(r.cross.num_crossings == 3);
  // Between 128 and 512 both are linear: 22.8 + 0.1(b-128) = 26.4 + 0.05(b-128) -> b = 200.
  CHECK(r.cross.batch == Catch::Approx(200).epsilon(1e-9));
}

TEST_CASE("calibration: curves that meet and stay equal do not cross", "[calibration]") {
  // A configuration priced as another once their difference vanishes (the experts' term once
  // every expert is read): TP faster up to 256, the same from there on. EP never gains.
  const std::vector<latency_sample> tp = {{1, 10}, {64, 20}, {256, 40}, {1024, 90}, {2048, 160}};
  const std::vector<latency_sample> ep = {{1, 11}, {64, 21}, {256, 40}, {1024, 90}, {2048, 160}};
  calibration_options pw;
  pw.fit = curve_fit::piecewise_linear;
  const calibration_result r = calibrate(ep, tp, pw);
  INFO(r);
  CHECK(r.cross.status == crossover_status::tp_always_faster);
  CHECK(r.cross.num_crossings == 0);
  CHECK_FALSE(r.has_thresholds);
  // Equal from 256, EP faster from 2048 on: the crossing where the tie began (the segment
  // leaving TP's last lead reaches 0 at 256).
  std::vector<latency_sample> ep_later = ep;
  ep_later.back().ms = 150;
  const calibration_result later = calibrate(ep_later, tp, pw);
  INFO(later);
  REQUIRE(later.cross.status == crossover_status::found);
  CHECK(later.cross.num_crossings == 1);
  CHECK(later.cross.batch == Catch::Approx(256));
}

TEST_CASE("calibration: piecewise curve with a kink", "[calibration]") {
  // TP flat at 30 ms up to 128 then +0.25 ms per sequence; EP 40 ms flat. Crossing where
  // 30 + 0.25 (b - 128) = 40: b = 168, between the knots 128 and 256.
  std::vector<latency_sample> e, t;
  for (double b : {1.0, 32.0, 128.0, 256.0, 512.0}) {
    e.push_back({b, 40.0});
    t.push_back({b, b <= 128 ? 30.0 : 30.0 + 0.25 * (b - 128)});
  }
  calibration_options o;
  o.fit = curve_fit::piecewise_linear;
  const calibration_result r = calibrate(e, t, o);
  REQUIRE(r.cross.status == crossover_status::found);
  CHECK(r.cross.batch == Catch::Approx(168.0));
  CHECK(r.curves.tp.at(64) == Catch::Approx(30.0));
  CHECK(r.curves.tp.at(1024) == Catch::Approx(30.0 + 0.25 * 896));  // end segment extends
  std::ostringstream os;
  os << r;
  CHECK_THAT(os.str(), Catch::Contains("B*=168"));
}

TEST_CASE("calibration: curves that do not cross in range", "[calibration]") {
  const std::vector<double> batches = powers_of_two(1, 256);
  std::mt19937_64 rng(1);
  auto run = [&](line ep, line tp) {
    return calibrate(sample(ep, batches, 1, 0, rng), sample(tp, batches, 1, 0, rng));
  };
  // Lines cross at b = 2000: outside the measured range.
  const calibration_result tp_wins = run({30, 0.01}, {10, 0.02});
  CHECK(tp_wins.cross.status == crossover_status::tp_always_faster);
  CHECK_FALSE(tp_wins.has_thresholds);
  CHECK(tp_wins.cross.num_crossings == 0);
  CHECK_THAT(what_of([&] { apply_calibration(tp_wins, {}); }),
             Catch::Contains("status=tp_always_faster"));
  CHECK(run({10, 0.02}, {30, 0.01}).cross.status == crossover_status::ep_always_faster);
  // EP faster below, TP above: contradicts eq. 5.
  const calibration_result wrong = run({10, 0.2}, {30, 0.01});
  CHECK(wrong.cross.status == crossover_status::wrong_orientation);
  CHECK(wrong.cross.num_crossings == 1);
  CHECK_FALSE(wrong.has_thresholds);
}

TEST_CASE("calibration: bad input is rejected with the constraint named", "[calibration]") {
  const std::vector<latency_sample> ok{{1, 10}, {8, 12}};
  CHECK_THAT(what_of([&] { calibrate(std::vector<latency_sample>{{0, 10}, {8, 12}}, ok); }),
             Catch::Contains("finite batch > 0 and ms > 0"));
  CHECK_THAT(what_of([&] { calibrate(std::vector<latency_sample>{{1, NAN}, {8, 12}}, ok); }),
             Catch::Contains("finite batch > 0 and ms > 0"));
  CHECK_THAT(what_of([&] { calibrate(std::vector<latency_sample>{{4, 10}, {4, 12}}, ok); }),
             Catch::Contains(">= 2 distinct batch sizes"));
  CHECK_THAT(what_of([&] { calibrate(ok, std::vector<latency_sample>{{100, 10}, {200, 12}}); }),
             Catch::Contains("share a batch range"));
  calibration_options o;
  o.margin = -0.1;
  CHECK_THAT(what_of([&] { calibrate(ok, ok, o); }), Catch::Contains("margin must be"));
  o = {};
  o.low_ratio = 0;
  CHECK_THAT(what_of([&] { calibrate(ok, ok, o); }), Catch::Contains("low_ratio must lie"));
}
