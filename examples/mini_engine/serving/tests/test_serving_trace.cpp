// Traces: the generators are reproducible and have the shape they promise; the file format
// round-trips and the reader rejects every malformed line, naming it.
#include <algorithm>
#include <sstream>
#include <string>

#include <moebius/error.hpp>

#include "catch.hpp"
#include "trace.hpp"

using namespace mini_engine;

namespace {

std::string read_error(const std::string& text) {
  std::istringstream in(text);
  try {
    read_trace(in, 1, 100, "t.txt");
  } catch (const moebius::error& e) {
    CHECK(e.code() == moebius::errc::invalid_argument);
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("bursty trace: reproducible, sorted, within its ranges, bursts denser than quiet") {
  bursty_options o;
  o.duration_s = 30;
  o.quiet_s = 4;
  o.quiet_rate = 1;
  o.burst_s = 2;
  o.burst_rate = 24;
  const auto a = bursty_trace(7, o), b = bursty_trace(7, o), c = bursty_trace(8, o);
  REQUIRE(a.size() > 20);
  REQUIRE(a.size() == b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    CHECK(a[i].id == static_cast<int64_t>(i));
    CHECK(a[i].arrival_s == b[i].arrival_s);
    CHECK(a[i].prompt == b[i].prompt);
    CHECK(a[i].output_tokens == b[i].output_tokens);
    CHECK(static_cast<int64_t>(a[i].prompt.size()) >= o.prompt_min);
    CHECK(static_cast<int64_t>(a[i].prompt.size()) <= o.prompt_max);
    CHECK(a[i].output_tokens >= o.output_min);
    CHECK(a[i].output_tokens <= o.output_max);
    CHECK(a[i].arrival_s >= 0);
    CHECK(a[i].arrival_s < o.duration_s);
    for (int32_t t : a[i].prompt) CHECK((t >= 0 && t < o.vocab));
    if (i > 0) CHECK(a[i - 1].arrival_s <= a[i].arrival_s);
  }
  bool differs = a.size() != c.size();
  for (size_t i = 0; !differs && i < a.size(); ++i) differs = a[i].arrival_s != c[i].arrival_s;
  CHECK(differs);
  // Quiet periods are [0,4), [6,10), ...; bursts [4,6), [10,12), ...
  int64_t in_burst = 0, in_quiet = 0;
  for (const request& r : a) {
    const double phase = r.arrival_s - 6.0 * static_cast<int64_t>(r.arrival_s / 6.0);
    (phase >= 4.0 ? in_burst : in_quiet) += 1;
  }
  const double burst_density = static_cast<double>(in_burst) / (5 * 2.0);
  const double quiet_density = static_cast<double>(in_quiet) / (5 * 4.0);
  CHECK(burst_density > 5 * quiet_density);
}

TEST_CASE("rollout trace: one batch at t=0 decaying into a long tail") {
  rollout_options o;
  o.batch = 400;
  const auto a = rollout_trace(3, o);
  REQUIRE(a.size() == 400);
  std::vector<int64_t> out;
  for (const request& r : a) {
    CHECK(r.arrival_s == 0);
    CHECK(r.output_tokens >= 1);
    CHECK(r.output_tokens <= o.output_max);
    out.push_back(r.output_tokens);
  }
  std::sort(out.begin(), out.end());
  const int64_t median = out[out.size() / 2];
  CHECK(median > 30);
  CHECK(median < 70);
  CHECK(out.back() > 3 * median);  // the long tail
  CHECK(out[out.size() * 9 / 10] > 2 * median / 1);
}

TEST_CASE("trace file: write then read gives the same requests") {
  const auto a = bursty_trace(11);
  std::stringstream s;
  write_trace(s, a);
  const auto b = read_trace(s, 11, 1024);
  REQUIRE(a.size() == b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    CHECK(b[i].id == a[i].id);
    CHECK(std::abs(b[i].arrival_s - a[i].arrival_s) < 1e-6);
    CHECK(b[i].prompt == a[i].prompt);  // drawn from (seed, id) alone
    CHECK(b[i].output_tokens == a[i].output_tokens);
  }
}

TEST_CASE("trace file: comments, blank lines, unsorted arrivals") {
  std::istringstream in("# header\n\n  2.5 3 4   # late\n0 1 1\n\t1e-1 2 9\n");
  const auto r = read_trace(in, 5, 50);
  REQUIRE(r.size() == 3);
  CHECK(r[0].arrival_s == 0);
  CHECK(r[0].id == 1);
  CHECK(r[1].arrival_s == 0.1);
  CHECK(r[1].output_tokens == 9);
  CHECK(r[2].id == 0);
  CHECK(r[2].prompt.size() == 3);
}

TEST_CASE("trace file: every malformed line is an error naming the line and field") {
  using Catch::Matchers::Contains;
  CHECK_THAT(read_error("0 1 1\n0.5 12x 3\n"), Contains("t.txt:2") && Contains("prompt_tokens") &&
                                                   Contains("'12x' is not an integer"));
  CHECK_THAT(read_error("0 2.9 3\n"), Contains("t.txt:1") && Contains("prompt_tokens"));
  CHECK_THAT(read_error("0 4 4x\n"), Contains("output_tokens"));
  CHECK_THAT(read_error("0 0 3\n"), Contains("prompt_tokens: 0 is outside"));
  CHECK_THAT(read_error("0 3 -1\n"), Contains("output_tokens: -1 is outside"));
  CHECK_THAT(read_error("0 3 99999999999\n"), Contains("output_tokens"));
  CHECK_THAT(read_error("0 3 99999999999999999999999\n"), Contains("not an integer"));
  CHECK_THAT(read_error("-1 3 3\n"), Contains("arrival_s"));
  CHECK_THAT(read_error("nan 3 3\n"), Contains("arrival_s"));
  CHECK_THAT(read_error("inf 3 3\n"), Contains("arrival_s"));
  CHECK_THAT(read_error("1s 3 3\n"), Contains("arrival_s: '1s' is not a number"));
  CHECK_THAT(read_error("\n\n1 3\n"), Contains("t.txt:3") && Contains("got 2"));
  CHECK_THAT(read_error("1 3 3 3\n"), Contains("got 4"));
  CHECK_THAT(read_error("1 +3 3\n"), Contains("not an integer"));
}

TEST_CASE("trace options are validated") {
  bursty_options b;
  b.burst_s = 0;
  CHECK_THROWS_AS(bursty_trace(1, b), moebius::error);
  b = {};
  b.prompt_min = 10;
  b.prompt_max = 5;
  CHECK_THROWS_AS(bursty_trace(1, b), moebius::error);
  rollout_options r;
  r.output_sigma = -1;
  CHECK_THROWS_AS(rollout_trace(1, r), moebius::error);
  CHECK_THROWS_AS(read_trace_file("/nonexistent/trace.txt", 1, 10), moebius::error);
}
