// The serving loop with the policy: calibration from the clock gives the thresholds, the
// policy switches at bursts, every request finishes; the CSV and the summary are consistent;
// the H200 step model has the regime it documents; the summary's TTFT, TPOT and throughput are
// the values a hand model of the loop gives.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "catch.hpp"
#include "test_seed.hpp"
#include "engine.hpp"
#include "small_trace.hpp"
#include "world.hpp"

using namespace mini_engine;
using moebius::parallel_mode;

namespace {

// A step costs a + b x (tokens it feeds) + c x (tokens it attends, summed over its items), so
// that a request's TTFT depends on its prompt and its TPOT on its prompt and output.
constexpr double k_step_a = 2e-3, k_step_b = 0.5e-3, k_step_c = 0.0625e-3;
constexpr int64_t k_chunk = 8;  // max_step_tokens: prompts prefill in chunks of 8

class linear_clock final : public step_clock {
 public:
  double step_s(const step_cost& c, double) const override {
    return k_step_a + k_step_b * static_cast<double>(c.new_tokens) +
           k_step_c * static_cast<double>(c.context_tokens);
  }
  double switch_s(const moebius::switch_report&) const override { return 0.0; }
  const char* name() const override { return "linear"; }
  bool needs_measurement() const override { return false; }
};

// A request served alone on linear_clock from `start` (its arrival, or the previous request's
// finish when it queued behind it), by hand. Prefill chunk k feeds min(8, p - 8k) tokens
// and attends 8k + that; the last chunk samples the first token. Decode step j (j = 2..n) feeds
// token j-1 at position p + j - 2, attends p + j - 1 tokens and samples token j. So
//   TTFT = start - arrival + sum over chunks of (a + b chunk + c (8k + chunk)),
//   TPOT = (finish - first token) / (n - 1) = a + b + c (p + n/2)   (mean of p + j - 1, j=2..n).
struct hand_request {
  double arrival = 0, start = 0, first = 0, finish = 0;
  int64_t prompt = 0, output = 0, steps = 0;
};

hand_request by_hand(double arrival, double start, int64_t p, int64_t n) {
  hand_request h{arrival, start, start, 0, p, n, 0};
  for (int64_t k = 0; k * k_chunk < p; ++k) {
    const int64_t chunk = std::min(k_chunk, p - k * k_chunk);
    h.first += k_step_a + k_step_b * static_cast<double>(chunk) +
               k_step_c * static_cast<double>(k * k_chunk + chunk);
    ++h.steps;
  }
  h.finish = h.first;
  for (int64_t j = 2; j <= n; ++j) {
    h.finish += k_step_a + k_step_b + k_step_c * static_cast<double>(p + j - 1);
    ++h.steps;
  }
  return h;
}

// The 99th percentile by nearest rank: the smallest sample with at least 99% of the samples at
// or below it (with 100 samples, the second largest; with 200, the third largest).
double p99_nearest_rank(std::vector<double> x) {
  std::sort(x.begin(), x.end());
  const size_t n = x.size();
  for (size_t i = 0; i < n; ++i)
    if ((i + 1) * 100 >= 99 * n) return x[i];
  return 0;
}

// Whether the three largest samples differ: a percentile off by a rank then shows.
bool top_distinct(std::vector<double> x) {
  std::sort(x.rbegin(), x.rend());
  return x.size() >= 3 && x[0] - x[1] > 1e-6 && x[1] - x[2] > 1e-6;
}

}  // namespace

TEST_CASE("h200 step model: TP faster at batch 1, EP at large batch and long context") {
  priced_model m;
  m.num_kv_heads = 2;  // H_kv < P: TP replicates KV heads
  const h200_step_model clock(m, h200_params{}, 4, 1024);
  CHECK(clock.decode_step_s(parallel_mode::tp, 1, 256) <
        clock.decode_step_s(parallel_mode::ep, 1, 256));
  CHECK(clock.decode_step_s(parallel_mode::ep, 256, 512) <
        clock.decode_step_s(parallel_mode::tp, 256, 512));
  for (const parallel_mode mode : {parallel_mode::ep, parallel_mode::tp}) {
    double last = 0;
    for (int64_t b = 1; b <= 512; b *= 2) {
      const double t = clock.decode_step_s(mode, b, 256);
      CHECK(t > last);
      last = t;
    }
  }
  moebius::switch_report r;
  r.outcome = moebius::switch_outcome::committed;
  r.kv_bytes_sent = {0, 0, 0, 0};
  // Qwen3-30B-A3B experts at P=4: 48 layers x 128 x 3 x 2048 x 768 x 2 B / 4 x 3/4 leave
  // each rank = 10.87 GB, at the fitted 395 GB/s per GPU 27.5 ms, + 48 phases x (10 + 5) us
  // + 3.9 ms fixed = 32.1 ms.
  const double bytes = 48.0 * 128 * 3 * 2048 * 768 * 2 / 4 * 3 / 4;
  CHECK(clock.switch_s(r) == Approx(bytes / 395e9 + 48 * 15e-6 + 3.9e-3).epsilon(1e-6));
  // A change of the dcp alone (TP -> TP, dcp 2 -> 1) moves no expert byte: the fixed part.
  r.from = r.to = moebius::parallel_mode::tp;
  r.from_dcp = 2;
  r.to_dcp = 1;
  CHECK(clock.switch_s(r) == Approx(3.9e-3).epsilon(1e-6));
  r.to_dcp = 2;  // the same layout and dcp (a report built by hand): the experts priced
  CHECK(clock.switch_s(r) == Approx(bytes / 395e9 + 48 * 15e-6 + 3.9e-3).epsilon(1e-6));
}

TEST_CASE("engine with the policy: calibrated thresholds, switches at bursts, all served") {
  testing::world w = testing::make_world(4, 800, 5);
  priced_model m;
  m.num_kv_heads = w.kv.num_kv_heads;
  const h200_step_model clock(m, h200_params{}, 4, kv_bytes_per_token(w.kv));
  engine e(*w.rt, *w.transport, w.arena, w.kv, clock, moebius::arena_cursor{0});

  const std::vector<int64_t> batches = {1, 2, 4, 8, 16, 32, 64, 128};
  const moebius::calibration_result cal = calibrate_engine(e, batches, 300);
  INFO(cal);
  REQUIRE(cal.has_thresholds);
  CHECK(cal.t_high > 1);
  CHECK(cal.t_high < 128);

  engine_options o;
  o.how = switching::policy;
  o.policy = moebius::apply_calibration(cal, moebius::interactive_config(cal.t_high));
  o.policy.cooldown_s = 0.02;
  o.policy.down_window = 4;
  o.start_mode = parallel_mode::tp;
  o.gate.enabled = false;  // the rules alone (test_serving_gate.cpp tests the gate)
  o.scheduler.max_running = 160;
  o.scheduler.max_step_tokens = 512;
  o.validate_every_step = true;
  std::vector<progress_info> progress;  // .run points into the run: checked while it runs
  int64_t bad_names = 0;
  o.progress_every_steps = 50;
  o.on_progress = [&](const progress_info& p) {
    progress.push_back(p);
    bad_names += *p.run != "switching";
  };

  const std::vector<request> reqs = testing::burst_trace(9, w.vocab);
  const run_result r = e.run(reqs, o, "switching");
  // One progress call after each served step whose index is a multiple of 50, saying where
  // that step left the run.
  std::vector<const step_record*> every_50;
  for (const step_record& rec : r.steps)
    if (rec.step % 50 == 0) every_50.push_back(&rec);
  REQUIRE(progress.size() == every_50.size());
  REQUIRE(progress.size() >= 2);
  CHECK(bad_names == 0);
  for (size_t i = 0; i < progress.size(); ++i) {
    const progress_info& p = progress[i];
    const step_record& rec = *every_50[i];
    CAPTURE(rec.step);
    CHECK(p.step == rec.step);
    CHECK(p.total == static_cast<int64_t>(reqs.size()));
    CHECK(p.mode == rec.mode);
    CHECK(p.now_s == Approx(rec.start_s + rec.step_ms * 1e-3).epsilon(1e-12));
    int64_t finished = 0, running = 0;  // after the step: admitted by its start, not finished
    for (const request_result& q : r.requests) {
      finished += q.finish_s <= p.now_s;
      running += q.admitted_s <= rec.start_s && q.finish_s > p.now_s;
    }
    CHECK(p.finished == finished);
    CHECK(p.running == running);
  }
  CHECK(r.clock.starts_with("modelled H200"));
  int64_t committed = 0;
  for (const switch_record& s : r.switches) committed += s.outcome == moebius::switch_outcome::committed;
  CHECK(committed >= 2);
  for (const request_result& q : r.requests) {
    CHECK(q.finished());
    CHECK(q.admissions == 1);
  }

  const run_summary s = summarize(r);
  CHECK(s.requests == static_cast<int64_t>(reqs.size()));
  CHECK(s.switches == committed);
  int64_t out_tokens = 0;
  for (const request& q : reqs) out_tokens += q.output_tokens;
  CHECK(s.output_tokens == out_tokens);
  // The metrics from the requests' times (the hand-model case below checks those times).
  std::vector<double> ttft, tpot;
  double first_arrival = r.end_s, last_finish = 0;
  for (const request_result& q : r.requests) {
    ttft.push_back((q.first_token_s - q.arrival_s) * 1e3);
    if (q.output_tokens >= 2)
      tpot.push_back((q.finish_s - q.first_token_s) / static_cast<double>(q.output_tokens - 1) *
                     1e3);
    first_arrival = std::min(first_arrival, q.arrival_s);
    last_finish = std::max(last_finish, q.finish_s);
  }
  REQUIRE(tpot.size() >= 100);
  double ttft_sum = 0, tpot_sum = 0;
  for (const double x : ttft) ttft_sum += x;
  for (const double x : tpot) tpot_sum += x;
  CHECK(r.end_s == last_finish);
  CHECK(s.mean_ttft_ms == Approx(ttft_sum / static_cast<double>(ttft.size())).epsilon(1e-9));
  CHECK(s.p99_ttft_ms == Approx(p99_nearest_rank(ttft)).epsilon(1e-9));
  CHECK(s.mean_tpot_ms == Approx(tpot_sum / static_cast<double>(tpot.size())).epsilon(1e-9));
  CHECK(s.p99_tpot_ms == Approx(p99_nearest_rank(tpot)).epsilon(1e-9));
  CHECK(s.tokens_per_s ==
        Approx(static_cast<double>(out_tokens) / (last_finish - first_arrival)).epsilon(1e-9));
  double switch_ms = 0;
  for (const switch_record& sr : r.switches)
    if (sr.outcome == moebius::switch_outcome::committed) switch_ms += sr.clock_ms;
  CHECK(s.switch_total_ms == Approx(switch_ms).epsilon(1e-9));
  CHECK(s.switch_mean_ms == Approx(switch_ms / static_cast<double>(committed)).epsilon(1e-9));

  std::ostringstream csv;
  write_steps_csv(csv, r);
  const std::string text = csv.str();
  CHECK(static_cast<size_t>(std::count(text.begin(), text.end(), '\n')) == r.steps.size() + 1);
  CHECK(text.rfind("run,step,start_s,mode", 0) == 0);
}

TEST_CASE("engine: a measured clock calibrates by running the runtime") {
  testing::world w = testing::make_world(2, 64, 3);
  const measured_clock clock;
  engine e(*w.rt, *w.transport, w.arena, w.kv, clock, moebius::arena_cursor{0});
  const double t = e.decode_step_s(parallel_mode::tp, 4, 8);
  CHECK(t > 0);
  CHECK(e.mode() == parallel_mode::tp);
  for (const auto& r : e.get_switcher().kv_tables().ranks) CHECK(r.sequences.empty());
}

// The summary's metrics against a hand model of the loop. 200 good requests arrive about 0.4 s
// apart and are served one at a time (max_running 1: a request that arrives while another runs
// waits for its finish, which its TTFT counts; one that arrives later finds the engine idle),
// with random prompts of 1-100 tokens; 100 of them answer with one token (a TTFT and no TPOT),
// 100 with 2-30. A bad request (a token outside the vocab) arrives first and fails: it has no
// TTFT and is outside the throughput's window. From the hand model's per-request times
// (by_hand, written apart from the engine's request_result::ttft_s/tpot_s and summarize):
//   TTFT = first token - arrival, mean and p99 (nearest rank) over the 200 requests;
//   TPOT = (finish - first token) / (output - 1) over the 100 with output >= 2, mean and p99;
//   tokens/s = output tokens / (last finish - first good arrival): the idle gaps count, the
//   time before the first good arrival does not.
// With 100 and 200 samples and the three largest distinct, nearest rank differs from the
// largest sample, a rank off by one and an interpolated percentile.
TEST_CASE("summary metrics: TTFT, TPOT (mean, p99) and tokens/s equal a hand model's") {
  const uint64_t seed = testing::test_seed();
  testing::world w = testing::make_world(2, 64, seed);
  const linear_clock clock;
  engine e(*w.rt, *w.transport, w.arena, w.kv, clock, moebius::arena_cursor{0});

  std::mt19937_64 rng(seed);
  std::vector<request> reqs;
  std::vector<hand_request> want;
  std::vector<double> ttft, tpot;
  int64_t queued = 0;  // requests that waited for the one before
  do {
    queued = 0;
    reqs.clear();
    want.clear();
    ttft.clear();
    tpot.clear();
    request bad;
    bad.id = 0;
    bad.arrival_s = 0.25;
    bad.prompt = {1, w.vocab, 2};
    bad.output_tokens = 4;
    reqs.push_back(bad);
    std::vector<int64_t> outputs(200, 1);
    for (size_t i = 100; i < outputs.size(); ++i)
      outputs[i] = std::uniform_int_distribution<int64_t>(2, 30)(rng);
    std::shuffle(outputs.begin(), outputs.end(), rng);
    for (int64_t i = 1; i <= 200; ++i) {
      request q;
      q.id = i;
      q.arrival_s =
          0.4 * static_cast<double>(i) + std::uniform_real_distribution<double>(0, 0.2)(rng);
      const int64_t p = std::uniform_int_distribution<int64_t>(1, 100)(rng);
      for (int64_t t = 0; t < p; ++t)
        q.prompt.push_back(std::uniform_int_distribution<int32_t>(0, w.vocab - 1)(rng));
      q.output_tokens = outputs[static_cast<size_t>(i - 1)];
      reqs.push_back(q);
      const double start = want.empty() ? q.arrival_s : std::max(q.arrival_s, want.back().finish);
      const hand_request h = by_hand(q.arrival_s, start, p, q.output_tokens);
      queued += start > q.arrival_s;
      want.push_back(h);
      ttft.push_back((h.first - h.arrival) * 1e3);
      if (h.output >= 2)
        tpot.push_back((h.finish - h.first) / static_cast<double>(h.output - 1) * 1e3);
    }
  } while (!top_distinct(ttft) || !top_distinct(tpot) || queued < 10 || queued > 190);
  REQUIRE(ttft.size() == 200);
  REQUIRE(tpot.size() == 100);

  engine_options o;
  o.scheduler.max_step_tokens = k_chunk;
  o.scheduler.max_running = 1;
  const run_result r = e.run(reqs, o, "metrics");

  // The loop served each request as the hand model says.
  REQUIRE(r.requests.size() == 201);
  CHECK(r.requests[0].failed());
  CHECK(r.failed_requests == 1);
  int64_t out_tokens = 0, steps = 0;
  double last_finish = 0, idle_s = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const request_result& q = r.requests[i + 1];
    const hand_request& h = want[i];
    CAPTURE(q.id, h.prompt, h.output);
    REQUIRE(q.id == static_cast<int64_t>(i) + 1);
    CHECK(q.arrival_s == h.arrival);
    CHECK(q.admitted_s == Approx(h.start).epsilon(1e-12));
    CHECK(q.first_token_s == Approx(h.first).epsilon(1e-12));
    CHECK(q.finish_s == Approx(h.finish).epsilon(1e-12));
    CHECK(static_cast<int64_t>(q.generated.size()) == h.output);
    out_tokens += h.output;
    steps += h.steps;
    if (i > 0) idle_s += std::max(0.0, h.arrival - want[i - 1].finish);
    last_finish = std::max(last_finish, h.finish);
  }
  REQUIRE(idle_s > 1);  // the window holds idle time: busy time alone is another figure
  CHECK(static_cast<int64_t>(r.steps.size()) == steps);
  CHECK(r.end_s == Approx(last_finish).epsilon(1e-12));

  double ttft_sum = 0, tpot_sum = 0;
  for (const double x : ttft) ttft_sum += x;
  for (const double x : tpot) tpot_sum += x;
  const double window = last_finish - want.front().arrival;  // request 1 is the first good one

  const run_summary s = summarize(r);
  CHECK(s.requests == 201);
  CHECK(s.output_tokens == out_tokens);
  CHECK(s.steps == steps);
  CHECK(s.duration_s == Approx(last_finish).epsilon(1e-12));
  CHECK(s.mean_ttft_ms == Approx(ttft_sum / 200).epsilon(1e-9));
  CHECK(s.p99_ttft_ms == Approx(p99_nearest_rank(ttft)).epsilon(1e-9));
  CHECK(s.mean_tpot_ms == Approx(tpot_sum / 100).epsilon(1e-9));
  CHECK(s.p99_tpot_ms == Approx(p99_nearest_rank(tpot)).epsilon(1e-9));
  CHECK(s.tokens_per_s == Approx(static_cast<double>(out_tokens) / window).epsilon(1e-9));
  CHECK(s.switches == 0);
  CHECK(s.switch_total_ms == 0);
}

TEST_CASE("closed-loop rollout: step k arrives when step k - 1 has finished, as if served alone") {
  const uint64_t seed = testing::test_seed();
  testing::world w = testing::make_world(2, 64, seed);
  const linear_clock clock;
  engine e(*w.rt, *w.transport, w.arena, w.kv, clock, moebius::arena_cursor{0});
  std::mt19937_64 rng(seed);
  const int64_t num_steps = std::uniform_int_distribution<int64_t>(2, 4)(rng);
  engine_options o;
  o.scheduler.max_step_tokens = k_chunk;
  o.scheduler.max_running = std::uniform_int_distribution<int64_t>(1, 8)(rng);
  // Steps of 3-12 requests, arrivals 0-50 ms into their step, written in a shuffled order.
  std::vector<std::vector<request>> steps(static_cast<size_t>(num_steps));
  std::vector<request> all;
  int64_t id = 0;
  for (int64_t k = 0; k < num_steps; ++k) {
    const int64_t n = std::uniform_int_distribution<int64_t>(3, 12)(rng);
    for (int64_t i = 0; i < n; ++i) {
      request q;
      q.id = id++;
      q.arrival_s = std::uniform_real_distribution<double>(0, 0.05)(rng);
      q.rollout_step = 10 * k + 3;  // any increasing values: steps are taken in their order
      const int64_t p = std::uniform_int_distribution<int64_t>(1, 20)(rng);
      for (int64_t t = 0; t < p; ++t)
        q.prompt.push_back(std::uniform_int_distribution<int32_t>(0, w.vocab - 1)(rng));
      q.output_tokens = std::uniform_int_distribution<int64_t>(1, 12)(rng);
      steps[static_cast<size_t>(k)].push_back(q);
      all.push_back(q);
    }
  }
  std::shuffle(all.begin(), all.end(), rng);
  const run_result closed = e.run(all, o, "closed loop");
  REQUIRE(closed.requests.size() == all.size());
  CHECK(closed.failed_requests == 0);

  // The reference: each step served alone as an open-loop trace from t = 0; in the closed
  // loop the same step runs the same way from the moment the step before it finished.
  double start = 0;
  for (int64_t k = 0; k < num_steps; ++k) {
    std::vector<request> alone = steps[static_cast<size_t>(k)];
    for (request& q : alone) q.rollout_step = -1;
    const run_result ref = e.run(alone, o, "alone");
    double finish = 0;
    for (const request_result& a : ref.requests) {
      CAPTURE(k, a.id);
      const request_result& c = closed.requests[static_cast<size_t>(a.id)];
      REQUIRE(c.id == a.id);
      CHECK(c.arrival_s == Approx(start + a.arrival_s).epsilon(1e-12));
      CHECK(c.admitted_s >= start);
      CHECK(c.admitted_s == Approx(start + a.admitted_s).epsilon(1e-12));
      CHECK(c.first_token_s == Approx(start + a.first_token_s).epsilon(1e-12));
      CHECK(c.finish_s == Approx(start + a.finish_s).epsilon(1e-12));
      CHECK(c.generated == a.generated);
      finish = std::max(finish, c.finish_s);
    }
    start = finish;  // the next step arrives from here
  }
  CHECK(closed.end_s == Approx(start).epsilon(1e-12));

  // A trace that mixes closed-loop and open-loop requests is refused by name.
  std::vector<request> mixed = {steps[0][0], steps[0][1]};
  mixed[1].rollout_step = -1;
  CHECK_THROWS_WITH(e.run(mixed, o, "mixed"),
                    Catch::Matchers::Contains("1 of 2 requests have a rollout_step"));
}
