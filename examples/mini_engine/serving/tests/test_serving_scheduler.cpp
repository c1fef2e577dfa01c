// Scheduler invariants, with the model replaced by a token rule (no runtime): no request is
// lost, duplicated or restarted; page tables always describe exactly the tokens written and
// validate; admission never over-commits the pool (no stall in a run without switches);
// prompts longer than the budget are prefilled in chunks; at the end every page is free.
#include <algorithm>
#include <limits>
#include <map>
#include <random>
#include <string>

#include <moebius/error.hpp>
#include <moebius/kv/page_table.hpp>

#include "catch.hpp"
#include "kv_pages.hpp"
#include "scheduler.hpp"
#include "scheduler_drive.hpp"

using namespace mini_engine;
using moebius::parallel_mode;

using testing::drive;
using testing::rule;

TEST_CASE("scheduler: every request once, in order, within capacity; nothing leaks") {
  for (const parallel_mode m : {parallel_mode::ep, parallel_mode::tp}) {
    for (uint64_t seed = 1; seed <= 6; ++seed) {
      std::mt19937_64 rng(seed);
      const int P = std::uniform_int_distribution<int>(0, 1)(rng) ? 2 : 4;
      const int64_t pages = std::uniform_int_distribution<int64_t>(8, 24)(rng);
      const auto g = moebius::make_kv_geometry(2, 2, 8, 4, pages, P, moebius::dtype::fp32);
      bursty_options t;
      t.duration_s = 6;
      t.quiet_s = 2;
      t.burst_s = 1;
      t.burst_rate = 30;
      t.prompt_min = 1;
      t.prompt_max = 20;
      t.output_min = 1;
      t.output_max = 12;
      t.vocab = 97;
      std::vector<request> reqs = bursty_trace(seed, t);
      REQUIRE(reqs.size() > 10);
      scheduler_options o;
      o.max_step_tokens = std::uniform_int_distribution<int64_t>(4, 24)(rng);
      o.max_running = std::uniform_int_distribution<int64_t>(1, o.max_step_tokens)(rng);
      CAPTURE(m, seed, P, pages, o.max_step_tokens, o.max_running);
      int64_t chunked = 0;
      const auto res = drive(g, m, reqs, o, &chunked);
      REQUIRE(res.size() == reqs.size());
      if (o.max_step_tokens < 20) CHECK(chunked > 0);
      std::sort(reqs.begin(), reqs.end(), [](auto& a, auto& b) { return a.id < b.id; });
      for (size_t i = 0; i < res.size(); ++i) {
        const request_result& r = res[i];
        CHECK(r.id == reqs[i].id);
        CHECK(r.admissions == 1);
        CHECK(r.finished());
        CHECK(r.stalls == 0);
        REQUIRE(static_cast<int64_t>(r.generated.size()) == reqs[i].output_tokens);
        for (int64_t k = 0; k < r.output_tokens; ++k) {
          CHECK(r.generated[static_cast<size_t>(k)] == rule(r.id, k));
        }
        CHECK(r.admitted_s >= r.arrival_s);
        CHECK(r.first_token_s > r.admitted_s);
        CHECK(r.finish_s >= r.first_token_s);
        // On this clock of 1 per step: TTFT from the arrival (queueing counts), at least one
        // step per prefill chunk after admission; a decoding sequence samples every step
        // (decode first, no stall), so TPOT is 1 exactly (0 for a single-token answer).
        CHECK(r.ttft_s() == r.first_token_s - r.arrival_s);
        CHECK(r.first_token_s - r.admitted_s + 1e-9 >=
              static_cast<double>((r.prompt_tokens + o.max_step_tokens - 1) / o.max_step_tokens));
        CHECK(r.tpot_s() == Approx(r.output_tokens >= 2 ? 1.0 : 0.0).margin(1e-9));
      }
      // First come, first served: admission order follows arrival order.
      for (size_t i = 0; i < res.size(); ++i) {
        for (size_t j = 0; j < res.size(); ++j) {
          if (res[i].arrival_s < res[j].arrival_s) CHECK(res[i].admitted_s <= res[j].admitted_s);
        }
      }
    }
  }
}

TEST_CASE("scheduler: a request larger than a rank is refused up front") {
  const auto g = moebius::make_kv_geometry(2, 2, 8, 4, 4, 2, moebius::dtype::fp32);
  scheduler_options refuse;
  refuse.bad_requests = bad_request_policy::refuse_run;
  std::vector<request> reqs(1);
  reqs[0].prompt.assign(14, 1);
  reqs[0].output_tokens = 4;  // 17 tokens: 5 pages of 4 > 4
  CHECK_THROWS_WITH(scheduler(g, reqs, refuse), Catch::Matchers::Contains("could never be admitted"));
  {
    const scheduler fail(g, reqs);  // the default: the request fails alone
    CHECK(fail.done());
    CHECK(fail.num_failed() == 1);
    REQUIRE(fail.results().size() == 1);
    CHECK_THAT(fail.results()[0].error, Catch::Matchers::Contains("request 0 needs 5 KV pages"));
  }
  reqs[0].output_tokens = 3;  // 16 tokens: 4 pages
  CHECK_NOTHROW(scheduler(g, reqs, refuse));
  reqs.push_back(reqs[0]);
  CHECK_THROWS_WITH(scheduler(g, reqs), Catch::Matchers::Contains("appears twice"));
  scheduler_options o;
  o.max_running = 10;
  o.max_step_tokens = 5;
  reqs.pop_back();
  CHECK_THROWS_AS(scheduler(g, reqs, o), moebius::error);
}

TEST_CASE("scheduler: each bad request fails alone with an error naming it") {
  // Every rule of validate_request, broken by one request among good ones.
  const auto g = moebius::make_kv_geometry(2, 2, 8, 4, 64, 2, moebius::dtype::fp32);
  scheduler_options o;
  o.vocab = 100;
  std::vector<request> reqs;
  auto add = [&](int64_t id, std::vector<int32_t> prompt, int64_t out, double arrival = 0) {
    request r;
    r.id = id;
    r.prompt = std::move(prompt);
    r.output_tokens = out;
    r.arrival_s = arrival;
    reqs.push_back(r);
  };
  add(0, {1, 2, 3}, 4);
  add(1, {}, 4);                                             // no prompt
  add(2, {1}, 0);                                            // no output
  add(3, {1}, 2, std::numeric_limits<double>::quiet_NaN());  // arrival
  add(4, {1, 2}, std::numeric_limits<int64_t>::max());       // overflow
  add(5, {1, 100}, 2);                                       // = vocab
  add(6, {-1, 2}, 2);                                        // negative
  add(7, {1}, 1000);                                         // larger than a rank
  add(8, {4, 5}, 3);
  const std::vector<std::string> want = {
      "",
      "request 1: needs a prompt",
      "request 2: needs output_tokens >= 1",
      "request 3: needs a finite arrival",
      "request 4: prompt 2 + output_tokens 9223372036854775807 does not fit in 64 bits",
      "request 5: prompt token 1 is 100, outside the vocab [0, 100)",
      "request 6: prompt token 0 is -1, outside the vocab [0, 100)",
      "request 7 needs 250 KV pages",
      ""};
  const auto res = drive(g, parallel_mode::ep, reqs, o);
  REQUIRE(res.size() == want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    CAPTURE(i, res[i].error);
    CHECK(res[i].id == static_cast<int64_t>(i));
    if (want[i].empty()) {
      CHECK(res[i].finished());
      CHECK(res[i].error.empty());
      CHECK(static_cast<int64_t>(res[i].generated.size()) == res[i].output_tokens);
    } else {
      CHECK(res[i].failed());
      CHECK_FALSE(res[i].finished());
      CHECK(res[i].admissions == 0);
      CHECK(res[i].generated.empty());
      CHECK_THAT(res[i].error, Catch::Matchers::Contains(want[i]));
    }
  }
  o.bad_requests = bad_request_policy::refuse_run;
  CHECK_THROWS_WITH(scheduler(g, reqs, o), Catch::Matchers::Contains("request 1: needs a prompt"));
}

TEST_CASE("scheduler: admission waits for KV capacity, then admits") {
  // One rank of 4 pages of 4 tokens; each request needs 3 pages at its largest: one at a time.
  const auto g = moebius::make_kv_geometry(1, 1, 8, 4, 4, 1, moebius::dtype::fp32);
  std::vector<request> reqs(3);
  for (int i = 0; i < 3; ++i) {
    reqs[static_cast<size_t>(i)].id = i;
    reqs[static_cast<size_t>(i)].prompt.assign(4, 1);
    reqs[static_cast<size_t>(i)].output_tokens = 6;
  }
  const auto res = drive(g, parallel_mode::ep, reqs, scheduler_options{});
  CHECK(res[1].admitted_s >= res[0].finish_s);
  CHECK(res[2].admitted_s >= res[1].finish_s);
}

TEST_CASE("scheduler: known admission preempts the newest and recomputes it, worked by hand") {
  // One rank of 3 pages of 4 tokens; two requests of prompt 4 and 6 output tokens (9 tokens,
  // 3 pages at their largest: the oracle would admit one at a time).
  //   step 0: both admitted on what is known (4 tokens, a page each), both prefill and sample;
  //   step 1: A decodes into its 2nd page (the last free one); B finds none: B is the newest,
  //           so B is preempted (its page freed); nothing is admitted in this step;
  //   steps 2-4: A decodes; B (5 tokens known, 2 pages) waits: A reserves 2 of the 3;
  //   step 5: A takes its 3rd page and samples its 6th token: finished, released;
  //   step 6: B re-admitted: a prefill of its 5 tokens samples its 2nd token;
  //   steps 7-10: B decodes its 3rd..6th.
  const auto g = moebius::make_kv_geometry(1, 1, 8, 4, 3, 1, moebius::dtype::fp32);
  std::vector<request> reqs(2);
  for (int i = 0; i < 2; ++i) {
    reqs[static_cast<size_t>(i)].id = i;
    reqs[static_cast<size_t>(i)].prompt.assign(4, 1 + i);
    reqs[static_cast<size_t>(i)].output_tokens = 6;
  }
  scheduler_options o;
  o.max_step_tokens = 8;
  o.max_running = 2;
  o.admission = admission_policy::known;
  o.watermark = 0;
  const auto res = drive(g, parallel_mode::ep, reqs, o);
  // The clock is 1 a step: a token sampled in step k is stamped k + 1.
  CHECK(res[0].admissions == 1);
  CHECK(res[0].preemptions == 0);
  CHECK(res[0].first_token_s == 1);
  CHECK(res[0].finish_s == 6);
  CHECK(res[1].admissions == 2);
  CHECK(res[1].preemptions == 1);
  CHECK(res[1].admitted_s == 0);  // its first admission
  CHECK(res[1].first_token_s == 1);
  CHECK(res[1].finish_s == 11);
  for (const request_result& r : res) {
    REQUIRE(r.generated.size() == 6);
    for (int64_t k = 0; k < 6; ++k) CHECK(r.generated[static_cast<size_t>(k)] == rule(r.id, k));
  }
  // The oracle admission serves them one after the other, never preempting.
  o.admission = admission_policy::oracle;
  const auto one_by_one = drive(g, parallel_mode::ep, reqs, o);
  CHECK(one_by_one[0].finish_s == 6);
  CHECK(one_by_one[1].admitted_s == 6);
  CHECK(one_by_one[1].preemptions == 0);
  o.watermark = 1;
  CHECK_THROWS_WITH(scheduler(g, reqs, o), Catch::Matchers::Contains("watermark must be in [0, 1)"));
}

TEST_CASE("scheduler: known admission leaves a watermark free beside running sequences, by hand") {
  // One rank of 10 pages of 4 tokens, watermark 0.1: ceil(0.1 x 10) = 1 page.
  //   A: prompt 16 (4 pages), 8 output tokens, arrives at 0; B: prompt 20 (5 pages), 4 output
  //   tokens, arrives at 0.5. The clock is 1 a step.
  //   step 0: A admitted into the empty pool (no watermark beside nothing): 4 pages;
  //   step 1: A decodes its 17th token (5 pages); B needs 5 pages + the 1-page watermark = 6,
  //           5 are left: B waits (admission blocked). Without the watermark it would fit;
  //   steps 2-7: A holds 18..23 tokens (5-6 pages): B still waits; A finishes at 8;
  //   step 8: B admitted into the empty pool.
  const auto g = moebius::make_kv_geometry(1, 1, 8, 4, 10, 1, moebius::dtype::fp32);
  std::vector<request> reqs(2);
  reqs[0].id = 0;
  reqs[0].prompt.assign(16, 1);
  reqs[0].output_tokens = 8;
  reqs[1].id = 1;
  reqs[1].arrival_s = 0.5;
  reqs[1].prompt.assign(20, 2);
  reqs[1].output_tokens = 4;
  scheduler_options o;
  o.max_step_tokens = 32;
  o.max_running = 4;
  o.admission = admission_policy::known;
  o.watermark = 0.1;
  {
    // Step by step: the second step refuses B for the watermark's page alone.
    scheduler s(g, reqs, o);
    moebius::kv_state kv = make_empty_kv_state(g, parallel_mode::ep);
    growing_pages pages(g, kv);
    const step_batch b0 = s.next_step(pages, 0);
    CHECK(b0.admitted == 1);
    CHECK(b0.prefill_tokens == 16);
    s.finish_step(b0, std::vector<int32_t>{5}, pages, 1);
    const step_batch b1 = s.next_step(pages, 1);
    CHECK(b1.admitted == 0);
    CHECK(b1.admission_blocked);
    CHECK(b1.decode_tokens == 1);
    CHECK(free_pages(kv, 0) == 5);  // A's 5 pages: B's 5 would fit but for the watermark
  }
  auto res = drive(g, parallel_mode::ep, reqs, o);
  CHECK(res[0].admitted_s == 0);
  CHECK(res[0].finish_s == 8);
  CHECK(res[1].admitted_s == 8);
  CHECK(res[1].preemptions == 0);
  // No watermark: B is admitted beside A at once (and preempted later, when both grow).
  o.watermark = 0;
  res = drive(g, parallel_mode::ep, reqs, o);
  CHECK(res[1].admitted_s == 1);
  // A request needing the whole pool is admitted into an empty one whatever the watermark.
  o.watermark = 0.1;
  std::vector<request> whole(1);
  whole[0].prompt.assign(40, 3);
  whole[0].output_tokens = 1;
  res = drive(g, parallel_mode::ep, whole, o);
  CHECK(res[0].admitted_s == 0);
  CHECK(res[0].finish_s == 2);  // its prompt in two chunks (32 + 8 tokens)
}

TEST_CASE("scheduler: known admission gives the oracle's tokens, preempting instead of stalling") {
  int64_t preemptions = 0;
  for (const parallel_mode m : {parallel_mode::ep, parallel_mode::tp}) {
    for (uint64_t seed = 1; seed <= 8; ++seed) {
      std::mt19937_64 rng(seed * 7919);
      const int P = std::uniform_int_distribution<int>(0, 1)(rng) ? 2 : 4;
      const int64_t pages = std::uniform_int_distribution<int64_t>(8, 16)(rng);
      const auto g = moebius::make_kv_geometry(2, 2, 8, 4, pages, P, moebius::dtype::fp32);
      bursty_options t;
      t.duration_s = 4;
      t.quiet_s = 1;
      t.burst_s = 1;
      t.burst_rate = 40;
      t.prompt_min = 1;
      t.prompt_max = 12;
      t.output_min = 1;
      t.output_max = 20;
      t.vocab = 97;
      std::vector<request> reqs = bursty_trace(seed, t);
      scheduler_options o;
      o.max_step_tokens = std::uniform_int_distribution<int64_t>(8, 32)(rng);
      o.max_running = std::uniform_int_distribution<int64_t>(2, o.max_step_tokens)(rng);
      o.watermark = std::uniform_int_distribution<int>(0, 1)(rng) ? 0.0 : 0.1;
      CAPTURE(m, seed, P, pages, o.max_step_tokens, o.max_running, o.watermark);
      const auto oracle = drive(g, m, reqs, o);
      o.admission = admission_policy::known;
      const auto known = drive(g, m, reqs, o);  // checks no stall, tables, no leak
      REQUIRE(known.size() == oracle.size());
      for (size_t i = 0; i < known.size(); ++i) {
        CAPTURE(known[i].id);
        CHECK(known[i].finished());
        CHECK(known[i].admissions == 1 + known[i].preemptions);
        CHECK(known[i].generated == oracle[i].generated);
        preemptions += known[i].preemptions;
      }
    }
  }
  CHECK(preemptions > 0);
}
