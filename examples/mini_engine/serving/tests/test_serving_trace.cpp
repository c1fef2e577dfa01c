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

using trace_reader = std::vector<request> (*)(std::istream&, uint64_t, int32_t,
                                               const std::string&);

// The invalid_argument error `read` (read_trace or read_trace_jsonl) gives for `text`, or "".
std::string error_of(trace_reader read, const std::string& text, const std::string& name) {
  std::istringstream in(text);
  try {
    read(in, 1, 100, name);
  } catch (const moebius::error& e) {
    CHECK(e.code() == moebius::errc::invalid_argument);
    return e.what();
  }
  return "";
}

std::string read_error(const std::string& text) {
  return error_of(&read_trace, text, "t.txt");
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

namespace {

std::string jsonl_error(const std::string& text) {
  return error_of(&read_trace_jsonl, text, "t.jsonl");
}

}  // namespace

TEST_CASE("JSONL trace: write then read gives the same requests; text and JSONL agree") {
  production_options o;
  o.duration_s = 5;
  const auto a = production_trace(21, o);
  REQUIRE(a.size() > 20);
  std::stringstream j, t;
  write_trace_jsonl(j, a);
  write_trace(t, a);
  const auto b = read_trace_jsonl(j, 21, 1024);
  const auto c = read_trace(t, 21, 1024);
  REQUIRE(b.size() == a.size());
  REQUIRE(c.size() == a.size());
  for (size_t i = 0; i < a.size(); ++i) {
    CHECK(b[i].id == a[i].id);
    CHECK(std::abs(b[i].arrival_s - a[i].arrival_s) < 1e-6);
    CHECK(b[i].prompt == a[i].prompt);
    CHECK(b[i].output_tokens == a[i].output_tokens);
    CHECK(c[i].arrival_s == b[i].arrival_s);
  }
}

TEST_CASE("JSONL trace: members in any order, blank lines, unsorted arrivals, whitespace") {
  std::istringstream in(
      "{\"output_tokens\": 4, \"prompt_tokens\": 3, \"arrival_s\": 2.5}\n"
      "\n"
      "  {\"arrival_s\":0,\"prompt_tokens\":1,\"output_tokens\":1}  \r\n"
      "{ \"arrival_s\" : 1e-1 , \"prompt_tokens\" : 2 , \"output_tokens\" : 9 }\n");
  const auto r = read_trace_jsonl(in, 5, 50);
  REQUIRE(r.size() == 3);
  CHECK(r[0].arrival_s == 0);
  CHECK(r[0].id == 1);
  CHECK(r[1].arrival_s == 0.1);
  CHECK(r[1].output_tokens == 9);
  CHECK(r[2].id == 0);
  CHECK(r[2].prompt.size() == 3);
  CHECK(r[2].output_tokens == 4);
}

TEST_CASE("JSONL trace: every malformed line is an error naming the line and member") {
  using Catch::Matchers::Contains;
  const std::string ok = "{\"arrival_s\": 0, \"prompt_tokens\": 1, \"output_tokens\": 1}\n";
  CHECK_THAT(jsonl_error(ok + "{\"arrival_s\": 0.5, \"prompt_tokens\": 1.5, \"output_tokens\": 3}\n"),
             Contains("t.jsonl:2") && Contains("prompt_tokens: 1.5 is not an integer"));
  CHECK_THAT(jsonl_error("{\"arrival_s\": 0, \"prompt_tokens\": 2e3, \"output_tokens\": 3}\n"),
             Contains("prompt_tokens: 2e3 is not an integer"));
  CHECK_THAT(jsonl_error("{\"arrival_s\": 0, \"prompt_tokens\": 2, \"output_tokens\": -3}\n"),
             Contains("output_tokens: -3 is outside"));
  CHECK_THAT(jsonl_error("{\"arrival_s\": 0, \"prompt_tokens\": 2, \"output_tokens\": 0}\n"),
             Contains("output_tokens: 0 is outside"));
  CHECK_THAT(jsonl_error("{\"arrival_s\": 0, \"prompt_tokens\": 99999999999, \"output_tokens\": 1}\n"),
             Contains("prompt_tokens: 99999999999 is outside"));
  CHECK_THAT(jsonl_error("{\"arrival_s\": 0, \"prompt_tokens\": 99999999999999999999999, "
                         "\"output_tokens\": 1}\n"),
             Contains("prompt_tokens") && Contains("not an integer"));
  CHECK_THAT(jsonl_error("{\"arrival_s\": -1, \"prompt_tokens\": 2, \"output_tokens\": 1}\n"),
             Contains("arrival_s: -1 must be finite and >= 0"));
  CHECK_THAT(jsonl_error("{\"arrival_s\": 1e999, \"prompt_tokens\": 2, \"output_tokens\": 1}\n"),
             Contains("arrival_s") && Contains("overflow parsing '1e999'"));
  CHECK_THAT(jsonl_error("{\"arrival_s\": NaN, \"prompt_tokens\": 2, \"output_tokens\": 1}\n"),
             Contains("arrival_s: not a JSON number") && Contains("invalid literal"));
  CHECK_THAT(jsonl_error("{\"arrival_s\": \"0\", \"prompt_tokens\": 2, \"output_tokens\": 1}\n"),
             Contains("arrival_s") && Contains("is not a JSON number"));
  CHECK_THAT(jsonl_error("{\"arrival_s\": 0, \"prompt_tokens\": 2}\n"),
             Contains("t.jsonl:1") && Contains("output_tokens: missing"));
  CHECK_THAT(jsonl_error("{\"arrival_s\": 0, \"arrival_s\": 1, \"prompt_tokens\": 2, "
                         "\"output_tokens\": 1}\n"),
             Contains("arrival_s: appears twice"));
  CHECK_THAT(jsonl_error("{\"arrival_s\": 0, \"prompt\": 2, \"output_tokens\": 1}\n"),
             Contains("unknown member \"prompt\""));
  CHECK_THAT(jsonl_error("{\"arrival_s\": 0, \"prompt_tokens\": 2, \"output_tokens\": 1} x\n"),
             Contains("unexpected text after the object"));
  CHECK_THAT(jsonl_error("{\"arrival_s\": 0, \"prompt_tokens\": 2, \"output_tokens\": 1\n"),
             Contains("after the value of \"output_tokens\"") && Contains("expected '}'"));
  CHECK_THAT(jsonl_error("0 2 1\n"), Contains("expected a JSON object"));
  CHECK_THAT(jsonl_error("{\"arrival_s\": 01, \"prompt_tokens\": 2, \"output_tokens\": 1}\n"),
             Contains("after the value of \"arrival_s\""));  // a leading zero ends the number
  CHECK_THAT(jsonl_error("{\"arrival_s\": 1., \"prompt_tokens\": 2, \"output_tokens\": 1}\n"),
             Contains("expected digit after '.'"));
  CHECK_THAT(jsonl_error("{\"arrival_s\": null, \"prompt_tokens\": 2, \"output_tokens\": 1}\n"),
             Contains("'null' is not a JSON number"));
}

TEST_CASE("steady and production traces: reproducible, sorted, shaped as documented") {
  steady_options s;
  s.duration_s = 50;
  s.rate = 40;
  const auto a = steady_trace(4, s), a2 = steady_trace(4, s);
  REQUIRE(a.size() == a2.size());
  // Poisson: 2000 expected, sd ~45.
  CHECK(a.size() > 1800);
  CHECK(a.size() < 2200);
  for (size_t i = 0; i < a.size(); ++i) {
    CHECK(a[i].arrival_s == a2[i].arrival_s);
    CHECK(a[i].arrival_s < s.duration_s);
    if (i > 0) CHECK(a[i - 1].arrival_s <= a[i].arrival_s);
  }

  production_options p;
  p.duration_s = 200;
  const auto b = production_trace(6, p);
  REQUIRE(b.size() > 2000);
  std::vector<int64_t> prompts, outputs;
  for (size_t i = 0; i < b.size(); ++i) {
    prompts.push_back(static_cast<int64_t>(b[i].prompt.size()));
    outputs.push_back(b[i].output_tokens);
    if (i > 0) CHECK(b[i - 1].arrival_s <= b[i].arrival_s);
  }
  std::sort(prompts.begin(), prompts.end());
  std::sort(outputs.begin(), outputs.end());
  // Medians: 1020 / 32 = 31.9 prompt tokens and 129 output tokens (log-normal, within 10%).
  CHECK(prompts[prompts.size() / 2] >= 29);
  CHECK(prompts[prompts.size() / 2] <= 35);
  CHECK(outputs[outputs.size() / 2] >= 116);
  CHECK(outputs[outputs.size() / 2] <= 142);
  // Long-tailed: the 95th percentile is several times the median (sigma 1: e^1.645 = 5.2x).
  CHECK(outputs[outputs.size() * 95 / 100] > 4 * outputs[outputs.size() / 2]);
  // Mean rate 20/s over 200 s; rates redrawn every 2 s: far more spread than Poisson.
  CHECK(b.size() > 3000);
  CHECK(b.size() < 5000);
  std::vector<int64_t> per_period(100, 0);
  for (const request& r : b) ++per_period[static_cast<size_t>(r.arrival_s / 2.0)];
  double mean = 0, var = 0;
  for (int64_t n : per_period) mean += static_cast<double>(n) / 100.0;
  for (int64_t n : per_period) var += (static_cast<double>(n) - mean) * (static_cast<double>(n) - mean) / 99.0;
  CHECK(var > 4 * mean);  // a Poisson count has var == mean
  steady_options bad;
  bad.rate = -1;
  CHECK_THROWS_AS(steady_trace(1, bad), moebius::error);
  production_options badp;
  badp.rate_period_s = 0;
  CHECK_THROWS_AS(production_trace(1, badp), moebius::error);
}

TEST_CASE("JSONL trace: rollout_step is optional, round-trips, orders the steps, and is checked") {
  using Catch::Matchers::Contains;
  // Two steps, written out of order: step 1 first, step 0 with arrivals out of order.
  const std::string text =
      "{\"arrival_s\": 0, \"prompt_tokens\": 3, \"output_tokens\": 7, \"rollout_step\": 1}\n"
      "{\"rollout_step\": 0, \"arrival_s\": 0.5, \"prompt_tokens\": 2, \"output_tokens\": 5}\n"
      "{\"arrival_s\": 0, \"prompt_tokens\": 4, \"output_tokens\": 6, \"rollout_step\": 0}\n";
  std::istringstream in(text);
  const auto r = read_trace_jsonl(in, 3, 50);
  REQUIRE(r.size() == 3);
  // Sorted by (step, arrival); ids in file order.
  CHECK(r[0].id == 2);
  CHECK(r[0].rollout_step == 0);
  CHECK(r[1].id == 1);
  CHECK(r[1].rollout_step == 0);
  CHECK(r[1].arrival_s == 0.5);
  CHECK(r[2].id == 0);
  CHECK(r[2].rollout_step == 1);
  CHECK(r[2].output_tokens == 7);
  // Written and read back: the same requests, the step kept.
  std::stringstream j;
  write_trace_jsonl(j, r);
  CHECK_THAT(j.str(), Contains("\"rollout_step\": 1}"));
  const auto back = read_trace_jsonl(j, 3, 50);
  REQUIRE(back.size() == 3);
  for (size_t i = 0; i < 3; ++i) {
    CHECK(back[i].rollout_step == r[i].rollout_step);
    CHECK(back[i].arrival_s == r[i].arrival_s);
    CHECK(back[i].output_tokens == r[i].output_tokens);
    CHECK(back[i].prompt.size() == r[i].prompt.size());
  }
  // Open-loop requests carry no step and write none.
  std::istringstream open("{\"arrival_s\": 0, \"prompt_tokens\": 3, \"output_tokens\": 7}\n");
  const auto o = read_trace_jsonl(open, 3, 50);
  CHECK(o.at(0).rollout_step == -1);
  std::ostringstream w;
  write_trace_jsonl(w, o);
  CHECK(w.str().find("rollout_step") == std::string::npos);
  // Bad steps, and a file that mixes both kinds.
  const std::string head = "{\"arrival_s\": 0, \"prompt_tokens\": 3, \"output_tokens\": 7, ";
  CHECK_THAT(jsonl_error(head + "\"rollout_step\": -1}\n"),
             Contains("rollout_step: -1 is outside [0, 1048576]"));
  CHECK_THAT(jsonl_error(head + "\"rollout_step\": 1.5}\n"),
             Contains("rollout_step: 1.5 is not an integer"));
  CHECK_THAT(jsonl_error(head + "\"rollout_step\": \"2\"}\n"),
             Contains("rollout_step: '\"2\"' is not a JSON number"));
  CHECK_THAT(jsonl_error(head + "\"rollout_step\": 0}\n" +
                         "{\"arrival_s\": 0, \"prompt_tokens\": 3, \"output_tokens\": 7}\n"),
             Contains("1 of 2 requests have a rollout_step"));
}

TEST_CASE("JSONL trace: max_new_tokens is optional, round-trips, and is never below the output") {
  using Catch::Matchers::Contains;
  const std::string text =
      "{\"arrival_s\": 0, \"prompt_tokens\": 3, \"output_tokens\": 7, \"max_new_tokens\": 7}\n"
      "{\"max_new_tokens\": 4096, \"arrival_s\": 0.5, \"prompt_tokens\": 2, \"output_tokens\": 5}\n"
      "{\"arrival_s\": 1, \"prompt_tokens\": 4, \"output_tokens\": 6}\n";
  std::istringstream in(text);
  const auto r = read_trace_jsonl(in, 3, 50);
  REQUIRE(r.size() == 3);
  CHECK(r[0].max_new_tokens == 7);
  CHECK(r[1].max_new_tokens == 4096);
  CHECK(r[2].max_new_tokens == 0);  // none given
  CHECK(max_new_tokens_of(r[2], k_default_max_new_tokens) == 4096);
  CHECK(max_new_tokens_of(r[2], 2) == 6);  // raised to the output
  std::stringstream j;
  write_trace_jsonl(j, r);
  CHECK_THAT(j.str(), Contains("\"output_tokens\": 7, \"max_new_tokens\": 7}"));
  const auto back = read_trace_jsonl(j, 3, 50);
  REQUIRE(back.size() == 3);
  for (size_t i = 0; i < 3; ++i) CHECK(back[i].max_new_tokens == r[i].max_new_tokens);
  const std::string head = "{\"arrival_s\": 0, \"prompt_tokens\": 3, \"output_tokens\": 7, ";
  CHECK_THAT(jsonl_error(head + "\"max_new_tokens\": 6}\n"),
             Contains(":1: max_new_tokens: 6 is below output_tokens 7"));
  CHECK_THAT(jsonl_error(head + "\"max_new_tokens\": 0}\n"), Contains("max_new_tokens: 0 is outside [1, 1048576]"));
  CHECK_THAT(jsonl_error(head + "\"max_new_tokens\": 7.5}\n"),
             Contains("max_new_tokens: 7.5 is not an integer"));
  CHECK_THAT(jsonl_error(head + "\"max_new_tokens\": 7, \"max_new_tokens\": 8}\n"),
             Contains("max_new_tokens: appears twice"));
}
