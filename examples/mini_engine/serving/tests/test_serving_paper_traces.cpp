// The paper-shaped traces have the shape their sources give, whatever the seed: request counts,
// flood periods and rates, length means and medians, the share cut at the cap, rollout steps.
// Expected values are computed here from the cited figures with closed forms (Poisson counts,
// log-normal moments), not by the generators' code; tolerances are 5 standard deviations of
// the sampled statistic. And the statistics a trace prints are checked against a hand count.
#include <cmath>
#include <moebius/error.hpp>
#include <random>
#include <sstream>

#include "catch.hpp"
#include "test_seed.hpp"
#include "paper_traces.hpp"
#include "trace_stats.hpp"

using namespace mini_engine;

namespace {

double phi(double z) {
  return 0.5 * std::erfc(-z / std::sqrt(2.0));
}

}  // namespace

TEST_CASE("paper bursty trace: the paper's totals, two floods at 80 and 120/s, LMSYS lengths") {
  const uint64_t seed = testing::test_seed();
  const paper_bursty_options o;
  // The flood length from the paper's totals, by hand: 5 (375 - 2t) + 200 t = 3107.
  const double flood = (3107.0 - 5 * 375.0) / (80 + 120 - 10.0);
  CHECK(paper_flood_length_s(o) == Approx(flood).epsilon(1e-12));
  CHECK(flood == Approx(6.484).epsilon(1e-3));
  const std::vector<trace_period> p = paper_bursty_periods(o);
  REQUIRE(p.size() == 5);
  const double edge = (375 - 300 - 2 * flood) / 2;
  const double starts[5] = {0, edge, edge + flood, edge + flood + 300, edge + 2 * flood + 300};
  const double rates[5] = {5, 80, 5, 120, 5};
  for (size_t i = 0; i < 5; ++i) {
    CHECK(p[i].start_s == Approx(starts[i]).margin(1e-9));
    CHECK(p[i].end_s == Approx(i + 1 < 5 ? starts[i + 1] : 375.0).margin(1e-9));
    CHECK(p[i].rate == rates[i]);
    CHECK(p[i].flood == (i == 1 || i == 3));
  }

  const std::vector<request> t = paper_bursty_trace(seed, o);
  // Poisson counts: the whole trace and each flood within 5 sd of its mean.
  const double n = static_cast<double>(t.size());
  CHECK(std::abs(n - 3107) < 5 * std::sqrt(3107.0));
  int64_t in_flood[2] = {0, 0};
  for (const request& r : t) {
    if (r.arrival_s >= starts[1] && r.arrival_s < starts[2]) ++in_flood[0];
    if (r.arrival_s >= starts[3] && r.arrival_s < starts[4]) ++in_flood[1];
  }
  for (int f = 0; f < 2; ++f) {
    const double mean = (f == 0 ? 80 : 120) * flood;
    CHECK(std::abs(static_cast<double>(in_flood[f]) - mean) < 5 * std::sqrt(mean));
  }
  // Sorted, ids in order, lengths within their clamps.
  for (size_t i = 0; i < t.size(); ++i) {
    CHECK(t[i].id == static_cast<int64_t>(i));
    CHECK(t[i].rollout_step == -1);
    if (i > 0) CHECK(t[i - 1].arrival_s <= t[i].arrival_s);
    CHECK(t[i].prompt.size() >= 1);
    CHECK(static_cast<int64_t>(t[i].prompt.size()) <= o.prompt_max);
    CHECK(t[i].output_tokens >= 1);
    CHECK(t[i].output_tokens <= o.output_max);
  }
  // Log-normal (sigma 1) lengths: the sample mean within 5 sd of the cited mean (sd of the
  // mean: mean sqrt(e^{sigma^2} - 1) / sqrt(n)); the median at mean e^{-sigma^2/2} within 5 sd
  // of a sample median (mean e^{-1/2} sigma sqrt(2 pi) / (2 sqrt(n))).
  const trace_statistics s = statistics_of(t);
  for (const auto& [got, want] : {std::pair{s.prompt, 69.5}, std::pair{s.output, 214.5}}) {
    CHECK(std::abs(got.mean - want) < 5 * want * std::sqrt(std::exp(1.0) - 1) / std::sqrt(n));
    const double median = want * std::exp(-0.5);
    CHECK(std::abs(static_cast<double>(got.p50) - median) <
          5 * median * std::sqrt(2 * M_PI) / (2 * std::sqrt(n)) + 1);
  }
  // The floods set the peak: at least 120/s less 5 sd in some second.
  CHECK(s.peak_rate > 120 - 5 * std::sqrt(120.0));
  // Same seed, same trace.
  const std::vector<request> again = paper_bursty_trace(seed, o);
  REQUIRE(again.size() == t.size());
  for (size_t i = 0; i < t.size(); ++i) {
    CHECK(again[i].arrival_s == t[i].arrival_s);
    CHECK(again[i].prompt == t[i].prompt);
    CHECK(again[i].output_tokens == t[i].output_tokens);
  }
}

TEST_CASE("paper rollout trace: 9 closed-loop steps of 2048, the cut share at the cap, the mean") {
  const uint64_t seed = testing::test_seed();
  std::mt19937_64 rng(seed);
  // The default and a random point of the sweep (median 4k-10k, cut share 2-20%).
  for (int k = 0; k < 2; ++k) {
    paper_rollout_options o;
    if (k == 1) {
      o.steps = 3;
      o.output_median = std::uniform_real_distribution<double>(4000, 10000)(rng);
      o.cut_share = std::uniform_real_distribution<double>(0.02, 0.20)(rng);
    }
    CAPTURE(o.output_median, o.cut_share);
    const double sigma = paper_rollout_sigma(o);
    // The sigma puts cut_share of the log-normal at or over the cap.
    const double cap = static_cast<double>(o.output_cap);
    CHECK(1 - phi(std::log(cap / o.output_median) / sigma) ==
          Approx(o.cut_share).epsilon(1e-9));
    const std::vector<request> t = paper_rollout_trace(seed, o);
    REQUIRE(static_cast<int64_t>(t.size()) == o.steps * o.prompts_per_step);
    for (size_t i = 0; i < t.size(); ++i) {
      CHECK(t[i].id == static_cast<int64_t>(i));
      CHECK(t[i].rollout_step == static_cast<int64_t>(i) / o.prompts_per_step);
      CHECK(t[i].arrival_s == 0);
      CHECK(t[i].output_tokens >= 1);
      CHECK(t[i].output_tokens <= o.output_cap);
      CHECK(static_cast<int64_t>(t[i].prompt.size()) >= o.prompt_min);
      CHECK(static_cast<int64_t>(t[i].prompt.size()) <= o.prompt_max);
    }
    const trace_statistics s = statistics_of(t, o.output_cap);
    CHECK(s.rollout_steps == o.steps);
    const double n = static_cast<double>(t.size());
    // The cut share: a binomial proportion within 5 sd.
    CHECK(std::abs(s.cut_share - o.cut_share) < 5 * std::sqrt(o.cut_share * (1 - o.cut_share) / n));
    // The median within 5 sd of a sample median (median sigma sqrt(2 pi) / (2 sqrt(n))).
    CHECK(std::abs(static_cast<double>(s.output.p50) - o.output_median) <
          5 * o.output_median * sigma * std::sqrt(2 * M_PI) / (2 * std::sqrt(n)) + 1);
    // The capped mean E[min(X, cap)] in closed form; the sample mean within 5 sd (bounded by
    // the cap's spread: sd <= cap / 2 / sqrt(n) would be loose; the variance of min(X, cap)
    // is computed too).
    const double mu = std::log(o.output_median), s2 = sigma * sigma, lc = std::log(cap);
    const double m1 =
        std::exp(mu + s2 / 2) * phi((lc - mu - s2) / sigma) + cap * (1 - phi((lc - mu) / sigma));
    const double m2 = std::exp(2 * mu + 2 * s2) * phi((lc - mu - 2 * s2) / sigma) +
                      cap * cap * (1 - phi((lc - mu) / sigma));
    CHECK(std::abs(s.output.mean - m1) < 5 * std::sqrt((m2 - m1 * m1) / n) + 1);
    if (k == 0) CHECK(m1 == Approx(4470).margin(30));  // DeepMath-103K R1: ~4-4.6k
  }
}

TEST_CASE("paper steady trace: Poisson at one rate over the whole length, LMSYS lengths") {
  const uint64_t seed = testing::test_seed();
  paper_steady_options o;
  o.rate = 14.9;
  const std::vector<request> t = paper_steady_trace(seed, o);
  const double n = static_cast<double>(t.size()), mean_n = 14.9 * 375;
  CHECK(std::abs(n - mean_n) < 5 * std::sqrt(mean_n));
  // Each fifth of the trace holds a fifth of the requests (a steady rate, no flood).
  int64_t fifth[5] = {0, 0, 0, 0, 0};
  for (size_t i = 0; i < t.size(); ++i) {
    CHECK(t[i].id == static_cast<int64_t>(i));
    CHECK(t[i].rollout_step == -1);
    CHECK(t[i].arrival_s >= 0);
    CHECK(t[i].arrival_s < 375);
    if (i > 0) CHECK(t[i - 1].arrival_s <= t[i].arrival_s);
    CHECK(t[i].output_tokens >= 1);
    CHECK(t[i].output_tokens <= o.output_max);
    ++fifth[std::min<int64_t>(4, static_cast<int64_t>(t[i].arrival_s / 75))];
  }
  for (const int64_t f : fifth) CHECK(std::abs(static_cast<double>(f) - mean_n / 5) < 5 * std::sqrt(mean_n / 5));
  const trace_statistics s = statistics_of(t);
  for (const auto& [got, want] : {std::pair{s.prompt, 69.5}, std::pair{s.output, 214.5}})
    CHECK(std::abs(got.mean - want) < 5 * want * std::sqrt(std::exp(1.0) - 1) / std::sqrt(n));
  const std::vector<request> again = paper_steady_trace(seed, o);
  REQUIRE(again.size() == t.size());
  for (size_t i = 0; i < t.size(); ++i) {
    CHECK(again[i].arrival_s == t[i].arrival_s);
    CHECK(again[i].prompt == t[i].prompt);
  }
}

TEST_CASE("paper production trace: Splitwise's conversation medians unscaled, a swinging rate") {
  const uint64_t seed = testing::test_seed();
  paper_production_options o;
  o.mean_rate = 40;  // about what the demo's Little's-law rate comes to
  REQUIRE(o.duration_s == 375);
  REQUIRE(o.prompt_median == 1020);  // Splitwise §III, conversation
  REQUIRE(o.output_median == 129);
  const std::vector<request> t = paper_production_trace(seed, o);
  const double n = static_cast<double>(t.size()), T = 375, period = 2, sigma = 0.6;
  // The count: Poisson given the rates, each 2 s period's rate log-normal with mean 40 and
  // sigma 0.6 of the log: Var N = 40 T + (T / period) period^2 40^2 (e^{sigma^2} - 1).
  const double mean_n = 40 * T;
  const double var_n = mean_n + (T / period) * period * period * 1600 * std::expm1(sigma * sigma);
  CHECK(std::abs(n - mean_n) < 5 * std::sqrt(var_n));
  // The swing: the log of each period's count spreads by sigma (a rate that did not swing would
  // give ~0.11 here, Poisson alone), plus ~1/count of Poisson noise.
  std::vector<double> per_period(static_cast<size_t>(T / period), 0);
  for (size_t i = 0; i < t.size(); ++i) {
    CHECK(t[i].id == static_cast<int64_t>(i));
    CHECK(t[i].rollout_step == -1);
    CHECK(t[i].max_new_tokens == 0);
    CHECK(t[i].arrival_s >= 0);
    CHECK(t[i].arrival_s < T);
    if (i > 0) CHECK(t[i - 1].arrival_s <= t[i].arrival_s);
    CHECK(t[i].output_tokens >= 1);
    CHECK(t[i].output_tokens <= 4096);
    CHECK(!t[i].prompt.empty());
    CHECK(static_cast<int64_t>(t[i].prompt.size()) <= 8192);
    per_period[std::min(per_period.size() - 1, static_cast<size_t>(t[i].arrival_s / period))] += 1;
  }
  double mean_log = 0, var_log = 0;
  for (double& c : per_period) c = std::log(std::max(c, 1.0)), mean_log += c;
  mean_log /= static_cast<double>(per_period.size());
  for (const double c : per_period) var_log += (c - mean_log) * (c - mean_log);
  const double sd_log = std::sqrt(var_log / static_cast<double>(per_period.size() - 1));
  const double want_sd = std::sqrt(sigma * sigma + std::exp(sigma * sigma) / (40 * period));
  CHECK(std::abs(sd_log - want_sd) < 5 * want_sd / std::sqrt(2.0 * static_cast<double>(per_period.size())));
  // Medians within 5 standard deviations of a sample median of a log-normal with sigma 1
  // (median x sigma x sqrt(2 pi) / (2 sqrt n), about 5% at ~15k requests).
  const trace_statistics s = statistics_of(t);
  for (const auto& [got, want] : {std::pair{s.prompt.p50, 1020.0}, std::pair{s.output.p50, 129.0}})
    CHECK(std::abs(static_cast<double>(got) - want) <
          5 * want * std::sqrt(2 * M_PI) / (2 * std::sqrt(n)) + 1);
  // Prompts unscaled and clamped at 8192: the share at the clamp is P(Z > ln(8192 / 1020)).
  const double at_clamp_want = 1 - phi(std::log(8192.0 / 1020));
  double at_clamp = 0;
  for (const request& r : t) at_clamp += r.prompt.size() == 8192 ? 1 : 0;
  at_clamp /= n;
  CHECK(std::abs(at_clamp - at_clamp_want) < 5 * std::sqrt(at_clamp_want / n));
  CHECK(at_clamp_want == Approx(0.0186).margin(0.001));
  // The mean output the demo's rate reads: a log-normal's (median 129, sigma 1) cut at 4096,
  // E[min(X, c)] by the closed form; the sample's mean within 5 standard deviations of it.
  const double mu = std::log(129.0), lc = std::log(4096.0);
  const double m1 = std::exp(mu + 0.5) * phi(lc - mu - 1) + 4096 * (1 - phi(lc - mu));
  const double m2 = std::exp(2 * mu + 2) * phi(lc - mu - 2) + 4096.0 * 4096 * (1 - phi(lc - mu));
  CHECK(paper_production_output_mean(o) == Approx(m1).epsilon(1e-9));
  CHECK(m1 == Approx(129 * std::exp(0.5)).epsilon(0.002));  // the cut is 0.03% of draws
  CHECK(std::abs(s.output.mean - m1) < 5 * std::sqrt((m2 - m1 * m1) / n) + 0.5);
  // The same seed, the same trace; another seed, another.
  const std::vector<request> again = paper_production_trace(seed, o);
  REQUIRE(again.size() == t.size());
  for (size_t i = 0; i < t.size(); ++i) {
    CHECK(again[i].arrival_s == t[i].arrival_s);
    CHECK(again[i].output_tokens == t[i].output_tokens);
    CHECK(again[i].prompt == t[i].prompt);
  }
  const std::vector<request> other = paper_production_trace(seed + 1, o);
  CHECK((other.size() != t.size() || other.front().arrival_s != t.front().arrival_s));
}

TEST_CASE("paper traces: options that make no sense are refused by name") {
  using Catch::Matchers::Contains;
  paper_bursty_options b;
  b.flood_rates[1] = 4;  // under the quiet rate
  CHECK_THROWS_WITH(paper_bursty_trace(1, b), Contains("flood rate"));
  b = {};
  b.target_requests = 100;  // fewer than the quiet rate alone brings
  CHECK_THROWS_WITH(paper_bursty_trace(1, b), Contains("no flood length fits"));
  paper_rollout_options r;
  r.output_median = 40000;
  CHECK_THROWS_WITH(paper_rollout_trace(1, r), Contains("output_median"));
  r = {};
  r.cut_share = 0;
  CHECK_THROWS_WITH(paper_rollout_trace(1, r), Contains("cut_share"));
  paper_steady_options s;
  s.rate = 0;
  CHECK_THROWS_WITH(paper_steady_trace(1, s), Contains("rate"));
  s = {};
  s.duration_s = -1;
  CHECK_THROWS_WITH(paper_steady_trace(1, s), Contains("duration_s"));
  const auto refused = [](auto&& change, const char* field) {
    paper_production_options p;
    change(p);
    CHECK_THROWS_WITH(paper_production_trace(1, p), Contains(field));
    CHECK_THROWS_WITH(paper_production_output_mean(p), Contains(field));
  };
  refused([](paper_production_options& p) { p.duration_s = std::nan(""); }, "duration_s");
  refused([](paper_production_options& p) { p.mean_rate = 0; }, "mean_rate");
  refused([](paper_production_options& p) { p.rate_sigma = -0.1; }, "rate_sigma");
  refused([](paper_production_options& p) { p.rate_period_s = 0; }, "rate_period_s");
  refused([](paper_production_options& p) { p.prompt_median = 0.5; }, "prompt_median");
  refused([](paper_production_options& p) { p.output_median = 0; }, "output_median");
  refused([](paper_production_options& p) { p.output_sigma = INFINITY; }, "output_sigma");
  refused([](paper_production_options& p) { p.prompt_max = 0; }, "prompt_max");
}

TEST_CASE("trace statistics: percentiles, cut share, rates and steps of a hand-made trace") {
  // Outputs 1..10 (one cut at a cap of 10), prompts 10 x i, arrivals 0, 0.1, ..., 0.9 and one
  // late at 5.0 (the 10th); steps 0 and 1.
  std::vector<request> t;
  for (int i = 1; i <= 10; ++i) {
    request r;
    r.id = i - 1;
    r.arrival_s = i < 10 ? 0.1 * (i - 1) : 5.0;
    r.prompt.assign(static_cast<size_t>(10 * i), 0);
    r.output_tokens = i;
    r.rollout_step = i <= 5 ? 0 : 1;
    t.push_back(r);
  }
  const trace_statistics s = statistics_of(t, 10, 1.0);
  CHECK(s.requests == 10);
  CHECK(s.output.mean == 5.5);
  CHECK(s.output.p50 == 5);   // ceil(0.5 * 10) = 5th smallest
  CHECK(s.output.p90 == 9);   // 9th
  CHECK(s.output.p99 == 10);  // ceil(9.9) = 10th
  CHECK(s.output.max == 10);
  CHECK(s.prompt.mean == 55);
  CHECK(s.prompt.p50 == 50);
  CHECK(s.cut_share == 0.1);
  CHECK(s.span_s == 5.0);
  CHECK(s.mean_rate == 2.0);
  CHECK(s.peak_rate == 9.0);  // 0.0 .. 0.8 within one second
  CHECK(s.rollout_steps == 2);
  std::ostringstream os;
  os << s;
  CHECK_THAT(os.str(), Catch::Matchers::Contains("10 requests in 2 rollout steps") &&
                           Catch::Matchers::Contains("10% cut at the cap"));
}
