// The paper's metrics (paper_metrics.hpp) against values worked out by hand on small runs built
// here, floods found in generated arrivals, the simulated deployment's geometry against the
// deployment's capacities (sim_deployment.hpp), and the requests' CSV the figures are drawn from.
#include <algorithm>
#include <cmath>
#include <random>
#include <sstream>

#include "catch.hpp"
#include "deployment.hpp"
#include "paper_metrics.hpp"
#include "paper_traces.hpp"
#include "percentile.hpp"
#include "run_report.hpp"
#include "sim_deployment.hpp"
#include "test_seed.hpp"

using namespace mini_engine;
using moebius::parallel_mode;

namespace {

request open_request(int64_t id, double arrival, int64_t output) {
  request r;
  r.id = id;
  r.arrival_s = arrival;
  r.prompt = {1, 2};
  r.output_tokens = output;
  return r;
}

request_result result_of(const request& q, double first, double finish) {
  request_result r;
  r.id = q.id;
  r.arrival_s = q.arrival_s;
  r.admitted_s = q.arrival_s;
  r.first_token_s = first;
  r.finish_s = finish;
  r.output_tokens = q.output_tokens;
  r.admissions = 1;
  return r;
}

}  // namespace

TEST_CASE("floods are found in the arrivals of a paper-shaped bursty trace") {
  const uint64_t seed = testing::test_seed();
  INFO("seed " << seed);
  paper_bursty_options o;
  const std::vector<request> t = paper_bursty_trace(seed, o);
  const std::vector<arrival_period> f = find_floods(t);
  const std::vector<trace_period> truth = paper_bursty_periods(o);
  std::vector<trace_period> floods;
  for (const trace_period& p : truth)
    if (p.flood) floods.push_back(p);
  REQUIRE(f.size() == floods.size());
  for (size_t i = 0; i < f.size(); ++i) {
    // Whole seconds from the first arrival: within a second of the truth at each end.
    CHECK(std::abs(f[i].start_s - floods[i].start_s) <= 1.0);
    CHECK(std::abs(f[i].end_s - floods[i].end_s) <= 1.0);
  }
  // A steady trace has none; a rollout (closed loop) has none.
  std::vector<request> steady;
  for (int64_t i = 0; i < 600; ++i) steady.push_back(open_request(i, 0.1 * static_cast<double>(i), 3));
  CHECK(find_floods(steady).empty());
  paper_rollout_options r;
  r.steps = 2;
  r.prompts_per_step = 16;
  CHECK(find_floods(paper_rollout_trace(seed, r)).empty());
}

TEST_CASE("paper metrics of a small run, worked by hand") {
  // Quiet at 1/s for 10 s, a flood of 10 in [4, 5), ids by arrival.
  std::vector<request> trace;
  for (int64_t i = 0; i < 10; ++i) trace.push_back(open_request(i, static_cast<double>(i) + 0.5, 11));
  for (int64_t i = 0; i < 10; ++i) trace.push_back(open_request(10 + i, 4.0 + 0.05 * static_cast<double>(i), 1));
  const std::vector<arrival_period> f = find_floods(trace);
  REQUIRE(f.size() == 1);
  // Windows of 1 s from the first arrival (0.5 s): the flood and the quiet arrival at 3.5 s
  // share [3.5, 4.5).
  CHECK(f[0].start_s == Approx(3.5));
  CHECK(f[0].end_s == Approx(4.5));
  run_result r;
  r.end_s = 20;
  for (const request& q : trace) {
    // Quiet: TTFT 0.1 s, 10 more tokens over 0.5 s (TPOT 50 ms); flood: TTFT 3 s.
    const bool flood = q.id >= 10;
    const double first = q.arrival_s + (flood ? 3.0 : 0.1);
    r.requests.push_back(result_of(q, first, flood ? first : first + 0.5));
  }
  // Request 3 arrives at 3.5: in the flood's window, with quiet latencies.
  const paper_metrics m = paper_metrics_of(trace, r, f);
  CHECK(m.flood.requests == 11);
  CHECK(m.quiet.requests == 9);
  CHECK(m.flood.mean_ttft_ms == Approx((10 * 3000.0 + 100) / 11));
  CHECK(m.flood.p99_ttft_ms == Approx(3000));
  CHECK(m.quiet.mean_tpot_ms == Approx(50));
  CHECK(m.quiet.p99_tpot_ms == Approx(50));
  CHECK(m.all.mean_tpot_ms == Approx(50));  // single-token answers have no TPOT
  CHECK(m.tokens_per_s == Approx((10 * 11 + 10) / 20.0));
  // Interactive (450 ms, 40 ms): none (quiet TPOT 50 ms, flood TTFT 3 s); server (2 s, 200
  // ms): the 10 quiet ones.
  CHECK(m.goodput_rps[0] == Approx(0.0));
  CHECK(m.goodput_rps[1] == Approx(10 / 20.0));
  CHECK(m.rollout_step_s.empty());
  switch_record s;
  s.clock_ms = 30;
  r.switches = {s, s};
  r.switches[1].outcome = moebius::switch_outcome::rolled_back;
  const paper_metrics n = paper_metrics_of(trace, r, f);
  CHECK(n.switches == 1);
  CHECK(n.switch_total_ms == Approx(30));
  r.requests.pop_back();
  CHECK_THROWS_WITH(paper_metrics_of(trace, r, f), Catch::Matchers::Contains("19 results"));
}

TEST_CASE("p99 by nearest rank, the same in the paper's metrics and the run summary") {
  // The one definition (percentile.hpp): the ceil(0.99 n)-th smallest sample.
  CHECK(p99({}) == 0);
  CHECK(p99({7}) == 7);
  std::vector<double> hundred, two_hundred;
  for (int i = 1; i <= 100; ++i) hundred.push_back(i);
  for (int i = 1; i <= 200; ++i) two_hundred.push_back(i);
  std::shuffle(hundred.begin(), hundred.end(), std::mt19937_64(testing::test_seed()));
  std::shuffle(two_hundred.begin(), two_hundred.end(), std::mt19937_64(testing::test_seed() + 1));
  CHECK(p99(hundred) == 99);        // the second largest
  CHECK(p99(two_hundred) == 198);   // the third largest
  CHECK(nearest_rank(two_hundred, 50) == 100);
  CHECK(nearest_rank(two_hundred, 100) == 200);
  // A run of 200 requests, all quiet: request i (0-based) waits i + 1 ms for its first token,
  // and the first 100 of them take (i + 1) ms a token over 11 tokens after it; the rest answer
  // in one token. TTFT p99: 198 ms (one rank low would be 197, one high 199); TPOT p99 over the
  // 100: 99 ms.
  std::vector<request> trace;
  run_result r;
  r.end_s = 10;
  for (int64_t i = 0; i < 200; ++i) {
    trace.push_back(open_request(i, 0.01 * static_cast<double>(i), i < 100 ? 12 : 1));
    const double first = trace.back().arrival_s + 1e-3 * static_cast<double>(i + 1);
    const double finish = i < 100 ? first + 11 * 1e-3 * static_cast<double>(i + 1) : first;
    r.requests.push_back(result_of(trace.back(), first, finish));
  }
  const paper_metrics m = paper_metrics_of(trace, r, {});
  CHECK(m.all.requests == 200);
  CHECK(m.all.p99_ttft_ms == Approx(198));
  CHECK(m.all.p99_tpot_ms == Approx(99));
  CHECK(m.quiet.p99_ttft_ms == Approx(198));
  for (request_result& q : r.requests) q.generated.assign(static_cast<size_t>(q.output_tokens), 0);
  const run_summary s = summarize(r);
  CHECK(s.p99_ttft_ms == Approx(198));
  CHECK(s.p99_tpot_ms == Approx(99));
}

TEST_CASE("rollout step times and the per-step oracle, worked by hand") {
  // Two steps of two requests; step 1 starts when step 0's last request finished.
  std::vector<request> trace;
  for (int64_t i = 0; i < 4; ++i) {
    request q = open_request(i, 0, 5);
    q.rollout_step = i / 2;
    trace.push_back(q);
  }
  auto run = [&](double s0_end, double s1_len) {
    run_result r;
    r.requests.push_back(result_of(trace[0], 1, s0_end - 2));
    r.requests.push_back(result_of(trace[1], 1, s0_end));
    request q2 = trace[2], q3 = trace[3];
    q2.arrival_s = q3.arrival_s = s0_end;
    r.requests.push_back(result_of(q2, s0_end + 1, s0_end + s1_len));
    r.requests.push_back(result_of(q3, s0_end + 1, s0_end + s1_len - 3));
    r.end_s = s0_end + s1_len;
    return paper_metrics_of(trace, r, {});
  };
  const paper_metrics tp = run(10, 30), ep = run(20, 15);
  REQUIRE(tp.rollout_step_s.size() == 2);
  CHECK(tp.rollout_step_s[0] == Approx(10));
  CHECK(tp.rollout_step_s[1] == Approx(30));
  CHECK(tp.rollout_total_s == Approx(40));
  CHECK(ep.rollout_total_s == Approx(35));
  CHECK(per_step_oracle_s(tp, ep) == Approx(10 + 15));
}

TEST_CASE("the simulated deployment holds the deployment's KV capacity") {
  for (const deployment_kind k :
       {deployment_kind::static_tp, deployment_kind::static_ep, deployment_kind::switching}) {
    const deployment d = make_deployment(qwen3_235b_a22b(), k);
    const sim_geometry g = make_sim_geometry(d);
    CAPTURE(to_string(k));
    const int64_t page = g.kv.page_size;
    const int64_t tp_tokens = g.kv.num_tp_pages() * page;
    const int64_t ep_tokens = g.kv.num_ep_pages * page * g.kv.num_ranks;
    // Within a page a rank (the pools are cut to whole pages).
    if (k != deployment_kind::static_tp) {
      CHECK(ep_tokens <= d.ep.tokens);
      CHECK(ep_tokens > d.ep.tokens - page * g.kv.num_ranks);
    }
    if (k != deployment_kind::static_ep) {
      CHECK(tp_tokens <= d.tp.tokens);
      CHECK(tp_tokens > d.tp.tokens - 4 * page * 2);  // EP pages hold H_kv / (H_kv/P or 1) TP pages
    }
    // The arena's slot stages 64 EP pages of every tensor.
    CHECK(g.arena.slot_bytes >= 64 * g.kv.num_tensors() * g.kv.ep_page_bytes());
    CHECK(g.kv_bytes_per_token == 2 * g.kv.num_layers * 4 * 128 * 2);
    CHECK(g.arena.shape.num_layers == g.kv.num_layers);
  }
  sim_options bad;
  bad.page_size = 0;
  CHECK_THROWS_WITH(make_sim_geometry(make_deployment(qwen3_235b_a22b(), deployment_kind::switching), bad),
                    Catch::Matchers::Contains("page_size"));
}

TEST_CASE("the requests' CSV, line by line") {
  run_result r;
  r.name = "static EP";
  request_result a = result_of(open_request(7, 0.25, 3), 0.5, 0.75);
  a.prompt_tokens = 2;
  a.preemptions = 1;
  request_result b;  // failed before admission
  b.id = 9;
  b.arrival_s = 1;
  b.prompt_tokens = 4;
  b.output_tokens = 5;
  b.error = "request 9: no";
  r.requests = {a, b};
  std::ostringstream with, without;
  write_requests_csv(with, r);
  write_requests_csv(without, r, false);
  const std::string body =
      "static EP,7,0.250000,0.250000,0.500000,0.750000,2,3,1,0\n"
      "static EP,9,1.000000,-1.000000,-1.000000,-1.000000,4,5,0,1\n";
  CHECK(without.str() == body);
  CHECK(with.str() ==
        "run,id,arrival_s,admitted_s,first_token_s,finish_s,prompt_tokens,output_tokens,"
        "preemptions,failed\n" + body);
  // A name with a comma or a quote is one quoted field (RFC 4180), in both CSVs.
  r.name = "GPU, \"measured\"";
  r.requests.resize(1);
  step_record s;
  s.step = 3;
  s.sequences = 2;
  s.config = k_tep_dcp2;  // the policy's mode EP, priced as TEP-DCP2: the config column
  s.decodes_held = 5;     // the last column
  r.steps = {s};
  std::ostringstream quoted, steps;
  write_requests_csv(quoted, r, false);
  write_steps_csv(steps, r);
  CHECK(quoted.str() == "\"GPU, \"\"measured\"\"\",7,0.250000,0.250000,0.500000,0.750000,2,3,1,0\n");
  CHECK(steps.str().substr(steps.str().find('\n') + 1) ==
        "\"GPU, \"\"measured\"\"\",3,0.000000,EP,2,0,0,0,0,0,0,0,0,0.0000,0.0000,0,0.0000,"
        "TEP-DCP2,5\n");
}


namespace {

// Either mode priced at 10 ms + 0.1 ms a sequence + 1 us a context token; records what it was
// asked.
class linear_clock final : public step_clock {
 public:
  mutable std::vector<step_cost> asked;
  double step_s(const step_cost& c, double) const override {
    asked.push_back(c);
    return (10 + 0.1 * static_cast<double>(c.num_sequences) +
            1e-3 * static_cast<double>(c.context_tokens)) * 1e-3;
  }
  double switch_s(const moebius::switch_report&) const override { return 0; }
  const char* name() const override { return "linear"; }
  bool needs_measurement() const override { return false; }
};

}  // namespace

TEST_CASE("free-switch bound: every step of a run at the faster of its time and the other mode's") {
  std::mt19937_64 rng(mini_engine::testing::test_seed());
  run_result ep;
  double expected = 0;
  const int n = std::uniform_int_distribution<int>(1, 200)(rng);
  linear_clock clock;
  for (int i = 0; i < n; ++i) {
    step_record r;
    r.step = i;
    // EP steps (static EP's trajectory) and TP steps (static TP's) alike.
    r.mode = std::bernoulli_distribution(0.5)(rng) ? moebius::parallel_mode::ep
                                                    : moebius::parallel_mode::tp;
    r.config = r.mode;
    r.sequences = std::uniform_int_distribution<int64_t>(1, 2048)(rng);
    r.decode_tokens = r.sequences - 1;
    r.prefill_tokens = std::uniform_int_distribution<int64_t>(0, 8192)(rng);
    r.context_tokens = std::uniform_int_distribution<int64_t>(r.sequences, 4'000'000)(rng);
    r.step_ms = std::uniform_real_distribution<double>(5, 500)(rng);
    const double other_ms = 10 + 0.1 * static_cast<double>(r.sequences) +
                            1e-3 * static_cast<double>(r.context_tokens);
    expected += std::min(r.step_ms, other_ms) * 1e-3;
    ep.steps.push_back(r);
  }
  CHECK(free_switch_bound_s(ep, clock, 8) == Approx(expected).epsilon(1e-12));
  REQUIRE(clock.asked.size() == static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) {
    const step_cost& c = clock.asked[static_cast<size_t>(i)];
    const step_record& r = ep.steps[static_cast<size_t>(i)];
    CHECK(c.mode != r.mode);
    CHECK(c.num_ranks == 8);
    CHECK(c.num_sequences == r.sequences);
    CHECK(c.new_tokens == r.decode_tokens + r.prefill_tokens);
    CHECK(c.context_tokens == r.context_tokens);
    CHECK(c.ranks.empty());
  }
}

TEST_CASE("free-switch bound of a design: every step at the faster of its two configurations") {
  // A clock that prices each configuration at its own rate: TP-DCP2 1.0, TEP-DCP2 1.5 or 0.5
  // (below and from 512 sequences) ms a sequence; anything else 10 ms a sequence.
  class rate_clock final : public step_clock {
   public:
    mutable int64_t asked = 0;
    double step_s(const step_cost& c, double) const override {
      ++asked;
      const double n = static_cast<double>(c.num_sequences);
      if (c.config() == k_tp_dcp2) return 1.0e-3 * n;
      if (c.config() == k_tep_dcp2) return (c.num_sequences < 512 ? 1.5e-3 : 0.5e-3) * n;
      return 10e-3 * n;
    }
    double switch_s(const moebius::switch_report&) const override { return 0; }
    const char* name() const override { return "rate"; }
    bool needs_measurement() const override { return false; }
  } clock;
  std::mt19937_64 rng(mini_engine::testing::test_seed());
  run_result run;  // static TP-DCP2's trajectory: each step took its own time
  double expected = 0;
  const int n = std::uniform_int_distribution<int>(1, 200)(rng);
  for (int i = 0; i < n; ++i) {
    step_record r;
    r.step = i;
    r.mode = moebius::parallel_mode::tp;
    r.config = k_tp_dcp2;
    r.sequences = std::uniform_int_distribution<int64_t>(1, 2048)(rng);
    r.context_tokens = r.sequences * 100;
    r.step_ms = std::uniform_real_distribution<double>(0.2, 3.0)(rng) * static_cast<double>(r.sequences);
    const double tep_ms = (r.sequences < 512 ? 1.5 : 0.5) * static_cast<double>(r.sequences);
    expected += std::min(r.step_ms, tep_ms) * 1e-3;  // its own time, not TP-DCP2's price
    run.steps.push_back(r);
  }
  CHECK(free_switch_bound_s(run, clock, 8, k_tep_dcp2, k_tp_dcp2) == Approx(expected).epsilon(1e-12));
  CHECK(clock.asked == n);  // only TEP-DCP2 priced: each step's own configuration is measured
}
