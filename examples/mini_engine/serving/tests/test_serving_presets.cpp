// The engine presets (engine_preset.hpp) against their engines' documented behaviour, each rule
// on a run worked out by hand: vLLM preempting the newest running sequence; SGLang's admission
// (a new request charged prompt + min(max_new_tokens, clip) in full, a running one its
// remaining estimate x new_token_ratio, the batch then full until one finishes), prefill before
// decode, the ratio's decay and its reset when idle, retraction (who, and the ratio after it),
// DP attention (a chunk and a ratio per rank, one rank prefilling beside another's decodes) and
// the CUDA-graph hook; then both presets on random traces: every request served with the
// oracle's tokens. The clock is 1 a step: a token sampled in step k is stamped k + 1.
#include <random>
#include <string>
#include <vector>

#include <moebius/error.hpp>

#include "catch.hpp"
#include "kv_pages.hpp"
#include "scheduler.hpp"
#include "scheduler_drive.hpp"
#include "test_seed.hpp"

using namespace mini_engine;
using moebius::parallel_mode;
using testing::drive;
using testing::rule;

namespace {

request make_request(int64_t id, int64_t prompt, int64_t output, int64_t max_new, double arrival) {
  request r;
  r.id = id;
  r.prompt.assign(static_cast<size_t>(prompt), static_cast<int32_t>(1 + id));
  r.output_tokens = output;
  r.max_new_tokens = max_new;
  r.arrival_s = arrival;
  return r;
}

// Known admission under `engine`'s rules, `step_tokens` a step, `running` at once.
scheduler_options preset_options(engine_preset engine, int64_t step_tokens, int64_t running) {
  scheduler_options o;
  o.max_step_tokens = step_tokens;
  o.max_running = running;
  o.admission = admission_policy::known;
  o.engine = engine;
  return o;
}

scheduler_options sglang_options(int64_t step_tokens, int64_t running) {
  return preset_options(engine_preset::sglang, step_tokens, running);
}

void check_tokens(const std::vector<request_result>& res) {
  for (const request_result& r : res) {
    CAPTURE(r.id);
    CHECK(r.finished());
    CHECK(r.admissions == 1 + r.preemptions);
    REQUIRE(static_cast<int64_t>(r.generated.size()) == r.output_tokens);
    for (int64_t k = 0; k < r.output_tokens; ++k)
      CHECK(r.generated[static_cast<size_t>(k)] == rule(r.id, k));
  }
}

}  // namespace

TEST_CASE("presets: vllm is what known admission always did, and sglang's constants are its own") {
  const scheduler_options o;
  CHECK(o.engine == engine_preset::vllm);
  CHECK(o.watermark == 0.01);
  CHECK(std::string(to_string(engine_preset::sglang)) == "sglang");
  const sglang_rules r;
  CHECK(r.init_new_token_ratio == 0.7);
  CHECK(r.min_new_token_ratio_factor == 0.14);
  CHECK(r.new_token_ratio_decay_steps == 600);
  CHECK(r.retract_decode_steps == 20);
  CHECK(r.clip_max_new_tokens == 4096);
  CHECK(r.cuda_graph_max_bs == 512);
  // The ratio's course: 0.7 down to 0.098 over 600 steps; under DP attention x 0.3.
  const new_token_ratio_course tp = ratio_course(r, false), dp = ratio_course(r, true);
  CHECK(tp.init == Approx(0.7));
  CHECK(tp.floor == Approx(0.098));
  CHECK(tp.decay == Approx(0.602 / 600));
  CHECK(dp.init == Approx(0.21));
  CHECK(dp.floor == Approx(0.0294));
  CHECK(dp.decay == Approx(0.1806 / 600));
  // SGLang's rules on the oracle's reservations are refused; so are bad constants.
  scheduler_options bad = sglang_options(8, 4);
  bad.admission = admission_policy::oracle;
  const auto g = moebius::make_kv_geometry(1, 1, 8, 4, 8, 1, moebius::dtype::fp32);
  CHECK_THROWS_WITH(scheduler(g, {}, bad), Catch::Matchers::Contains("engine sglang needs admission known"));
  bad = sglang_options(8, 4);
  bad.sglang.retract_decode_steps = 0;
  CHECK_THROWS_WITH(scheduler(g, {}, bad), Catch::Matchers::Contains("retract_decode_steps (0)"));
  const auto four = moebius::make_kv_geometry(1, 4, 8, 4, 8, 4, moebius::dtype::fp32);
  CHECK_THROWS_WITH(scheduler(four, {}, sglang_options(8, 3)),
                    Catch::Matchers::Contains("max_running (3) >= the ranks"));
  bad = sglang_options(8, 4);
  bad.default_max_new_tokens = 0;
  CHECK_THROWS_WITH(scheduler(g, {}, bad), Catch::Matchers::Contains("default_max_new_tokens"));
}

TEST_CASE("presets: a request's max_new_tokens below its output is refused by name; a default fills "
          "one left out") {
  const auto g = moebius::make_kv_geometry(1, 1, 8, 4, 32, 1, moebius::dtype::fp32);
  request r = make_request(3, 4, 5, 2, 0);
  CHECK_THROWS_WITH(validate_request(g, r, 0),
                    Catch::Matchers::Contains("request 3: max_new_tokens 2 is below its output_tokens 5"));
  r.max_new_tokens = 5;
  CHECK_NOTHROW(validate_request(g, r, 0));
  r.max_new_tokens = 0;  // none given: the default, or the output when that is longer
  CHECK(max_new_tokens_of(r, 4096) == 4096);
  CHECK(max_new_tokens_of(r, 3) == 5);
  r.max_new_tokens = 7;
  CHECK(max_new_tokens_of(r, 4096) == 7);
  // In a run it fails alone.
  const std::vector<request_result> res =
      drive(g, parallel_mode::tp, {make_request(0, 4, 3, 0, 0), make_request(1, 4, 5, 2, 0)},
            sglang_options(16, 4));
  CHECK(res[0].finished());
  CHECK_THAT(res[1].error, Catch::Matchers::Contains("request 1: max_new_tokens 2"));
}

TEST_CASE("vllm: a sequence short of a page preempts the newest, then itself; the older resumes first") {
  // One rank of 3 pages of 4 tokens; A, B, C (in that order): prompt 4 (a page), 3 output
  // tokens (6 tokens, 2 pages at their largest). Watermark 0.
  //   step 0: all three admitted on their prompts (a page each: the pool is full), prefilled;
  //   step 1: A needs its 2nd page: the newest not in the batch, C, is preempted; B then needs
  //           one: the newest left is B itself: preempted. The queue's head: B, then C (each
  //           preemption goes to the head: the last preempted, the older, is first);
  //   step 2: A decodes its 3rd token and finishes; B (5 tokens known, 2 pages) waits: A
  //           holds 2 of the 3;
  //   step 3: B re-admitted: a prefill of its 5 tokens samples its 2nd; C waits;
  //   step 4: B finishes; step 5: C re-admitted; step 6: C finishes.
  const auto g = moebius::make_kv_geometry(1, 1, 8, 4, 3, 1, moebius::dtype::fp32);
  std::vector<request> reqs;
  for (int64_t i = 0; i < 3; ++i) reqs.push_back(make_request(i, 4, 3, 0, 0));
  scheduler_options o = preset_options(engine_preset::vllm, 16, 3);
  o.watermark = 0;
  std::vector<step_batch> log;
  const std::vector<request_result> res = drive(g, parallel_mode::ep, reqs, o, nullptr, &log);
  check_tokens(res);
  REQUIRE(log.size() == 7);
  CHECK(log[0].admitted == 3);
  CHECK(log[1].preempted == 2);
  CHECK(log[1].admitted == 0);
  CHECK(log[1].decode_tokens == 1);
  CHECK(res[0].preemptions == 0);
  CHECK(res[0].finish_s == 3);
  CHECK(res[1].preemptions == 1);
  CHECK(res[1].finish_s == 5);
  CHECK(res[2].preemptions == 1);
  CHECK(res[2].finish_s == 7);
  CHECK(log[3].admitted == 1);
  CHECK(log[3].prefill_tokens == 5);
  CHECK(log[3].admission_blocked);  // C: 2 pages, 1 left beside B's reservation
}

TEST_CASE("sglang: admission charges a new request in full and a running one x new_token_ratio; "
          "the batch stays full until one finishes; prefill before decode; the ratio decays, "
          "then resets when idle") {
  // TP, one rank of 12 pages of 4 tokens (48). A: prompt 8, 4 output tokens, max_new_tokens 16,
  // at 0; B: prompt 8, 4 tokens, max_new 18, at 0.5; C: prompt 8, 2 tokens, max_new 16, at 0.5.
  //   step 0: idle: ratio 0.7. A admitted (8 tokens: 2 pages), prefilled;
  //   step 1: A charged 0.7 x min(16 - 1, 4096) = 10.5 against 40 free tokens: 29.5 left. B
  //           needs 8 + 18 = 26 < 29.5: admitted, charged 18 beyond its 8 written (charging A
  //           its full 15 would leave 25 and refuse it). C needs 24 >= 3.5: refused, the batch
  //           is full. A prefill step: A does not decode;
  //   steps 2-4: decodes (no prefill tried: full, C waits with admission blocked); the ratio
  //           0.7 - k x 0.602 / 600; A and B
  //           finish in step 4 (at 5);
  //   step 5: idle again: ratio 0.7; C admitted; step 6: C finishes.
  const auto g = moebius::make_kv_geometry(1, 1, 8, 4, 12, 1, moebius::dtype::fp32);
  const std::vector<request> reqs = {make_request(0, 8, 4, 16, 0), make_request(1, 8, 4, 18, 0.5),
                                     make_request(2, 8, 2, 16, 0.5)};
  std::vector<step_batch> log;
  const std::vector<request_result> res =
      drive(g, parallel_mode::tp, reqs, sglang_options(64, 8), nullptr, &log);
  check_tokens(res);
  REQUIRE(log.size() == 7);
  const double d = 0.602 / 600;
  CHECK(log[0].admitted == 1);
  CHECK(log[0].new_token_ratio == Approx(0.7));
  CHECK(log[1].admitted == 1);
  CHECK(log[1].admission_blocked);
  CHECK(log[1].prefill_tokens == 8);
  CHECK(log[1].decode_tokens == 0);
  CHECK(log[1].decodes_held == 1);  // A, decoding since step 0, sits B's prefill out
  CHECK(log[0].decodes_held == 0);
  CHECK(log[1].new_token_ratio == Approx(0.7));
  // After step 1: A 8 written + 0.7 x 15 (it had 1 token then), B 8 written + 0.7 x 18.
  CHECK(log[1].kv_written_tokens == 16);
  CHECK(log[1].kv_reserved_tokens == static_cast<int64_t>(8 + 10.5 + 8 + 12.6));
  for (int k = 2; k <= 4; ++k) {
    CAPTURE(k);
    CHECK(log[static_cast<size_t>(k)].decode_tokens == 2);
    CHECK(log[static_cast<size_t>(k)].decodes_held == 0);
    CHECK(log[static_cast<size_t>(k)].admitted == 0);
    CHECK(log[static_cast<size_t>(k)].admission_blocked);  // C waits: the batch is still full
    CHECK(log[static_cast<size_t>(k)].new_token_ratio == Approx(0.7 - (k - 1) * d));
  }
  CHECK(log[5].new_token_ratio == Approx(0.7));
  CHECK(log[5].admitted == 1);
  CHECK(res[0].first_token_s == 1);
  CHECK(res[0].finish_s == 5);  // 4 tokens over 5 steps: one lost to B's prefill
  CHECK(res[1].admitted_s == 1);
  CHECK(res[1].finish_s == 5);
  CHECK(res[2].admitted_s == 5);
  CHECK(res[2].finish_s == 7);
  for (const request_result& r : res) CHECK(r.preemptions == 0);
}

TEST_CASE("sglang: a refused request waits for a running one to finish, however far the ratio "
          "decays meanwhile") {
  // TP, one rank of 6,000 pages of 1 token. A: prompt 10, 400 tokens, max_new 4096, at 0; B:
  // prompt 10, 2 tokens, max_new 4096, at 0.5.
  //   step 1: A (1 generated) is charged 0.7 x 4095 = 2866.5 against 5,990 free: B needs
  //           10 + 4096 = 4106 > 3123.5: refused, the batch full;
  //   step 300: A has 300 generated and 309 tokens written; the ratio 0.7 - 299 x 0.602 / 600
  //           = 0.4: room 5691 - 0.4 x 3796 = 4172.6 >= 4106, yet no prefill is tried
  //           (batch_is_full) until A finishes (its 400th token in step 399);
  //   step 400: B admitted into the idle pool; step 401: B's 2nd token.
  const auto g = moebius::make_kv_geometry(1, 1, 8, 1, 6000, 1, moebius::dtype::fp32);
  const std::vector<request> reqs = {make_request(0, 10, 400, 4096, 0),
                                     make_request(1, 10, 2, 4096, 0.5)};
  std::vector<step_batch> log;
  const std::vector<request_result> res =
      drive(g, parallel_mode::tp, reqs, sglang_options(64, 8), nullptr, &log);
  check_tokens(res);
  REQUIRE(log.size() == 402);
  CHECK(log[1].admission_blocked);
  CHECK(log[1].admitted == 0);
  CHECK(log[300].new_token_ratio == Approx(0.7 - 300 * 0.602 / 600));  // after step 300's decode
  CHECK(log[300].admitted == 0);
  CHECK(log[300].admission_blocked);
  CHECK(res[0].finish_s == 400);
  CHECK(res[1].admitted_s == 400);
  CHECK(res[1].finish_s == 402);
}

TEST_CASE("sglang: a decode short of pages retracts the request with the fewest tokens generated, "
          "raises the ratio, and recomputes it later") {
  // TP, one rank of 100 pages of 1 token; initial ratio 0.1 (SGLANG_INIT_NEW_TOKEN_RATIO):
  // floor 0.014, decay 0.086 / 600 = d a step. A: prompt 10, 80 tokens, max_new 80, at 0; B:
  // prompt 12, 60 tokens, max_new 60, at 3.5.
  //   step 0: A prefilled (90 free); steps 1-3: A decodes (87 free, 4 generated, ratio 0.1 - 3d);
  //   step 4: A charged (0.1 - 3d) x 76 = 7.57: 79.43 left; B needs 12 + 60 = 72: admitted,
  //           prefilled (75 free);
  //   steps 5..: both decode, 2 tokens a step. Step 42 (the 38th decode) finds 1 free token
  //           for 2: retraction. A has 41 generated, B 38: B (the fewest) is retracted, freeing
  //           its 49 tokens (50 free >= 20 x 1 left). Ratio: min(1, (41 + 20 x 1) / 80) = 0.7625;
  //   step 43: B (50 tokens, 22 to go) needs 50 + 22 = 72; A is charged 0.7625 x 38 = 28.98
  //           against 49 free: refused, full; A decodes (ratio 0.7625 - d);
  //   step 80: A's 80th token (finishes at 81); step 81: idle (ratio 0.1 again): B re-admitted,
  //           a prefill of its 50 tokens samples its 39th; steps 82-102: its 40th..60th.
  const auto g = moebius::make_kv_geometry(1, 1, 8, 1, 100, 1, moebius::dtype::fp32);
  const std::vector<request> reqs = {make_request(0, 10, 80, 80, 0), make_request(1, 12, 60, 60, 3.5)};
  scheduler_options o = sglang_options(64, 8);
  o.sglang.init_new_token_ratio = 0.1;
  std::vector<step_batch> log;
  const std::vector<request_result> res = drive(g, parallel_mode::tp, reqs, o, nullptr, &log);
  check_tokens(res);
  const double d = 0.086 / 600;
  REQUIRE(log.size() == 103);
  CHECK(log[4].admitted == 1);
  CHECK(log[4].prefill_tokens == 12);
  CHECK(log[4].new_token_ratio == Approx(0.1 - 3 * d));
  for (size_t k = 5; k < 42; ++k) CHECK(log[k].preempted == 0);
  CHECK(log[42].preempted == 1);
  CHECK(log[42].decode_tokens == 1);
  CHECK(log[42].new_token_ratio == Approx(0.7625));
  CHECK(log[43].admission_blocked);
  CHECK(log[43].new_token_ratio == Approx(0.7625 - d));
  CHECK(log[80].new_token_ratio == Approx(0.7625 - 38 * d));
  CHECK(log[81].new_token_ratio == Approx(0.1));
  CHECK(log[81].admitted == 1);
  CHECK(log[81].prefill_tokens == 50);
  CHECK(res[0].preemptions == 0);
  CHECK(res[0].finish_s == 81);
  CHECK(res[1].preemptions == 1);
  CHECK(res[1].admissions == 2);
  CHECK(res[1].admitted_s == 4);
  CHECK(res[1].first_token_s == 5);
  CHECK(res[1].finish_s == 103);
}

TEST_CASE("sglang: retraction breaks a tie in tokens generated by the longer prompt, and the "
          "estimate is clipped") {
  // TP, one rank of 60 pages of 1 token; the estimate clipped at 4 tokens
  // (SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION). A: prompt 14, 30 tokens, max_new 30; B: prompt 10,
  // 30 tokens, max_new 60 (clamped to 60 - 2 - 10 = 48, what the pool holds), both at 0.
  //   step 0: A needs 14 + 4 = 18, B 10 + 4 = 14: both admitted (24 written, 36 free);
  //   steps 1..18: both decode; step 19 finds 0 free for 2: both have 19 generated, so the
  //           longer prompt goes first: A (the older) is retracted; ratio min(1, (19 + 20) / 48)
  //           = 0.8125;
  //   step 20: A (33 tokens, 11 to go: clipped to 4) needs 37; B is charged 0.8125 x 4 = 3.25
  //           against 31 free: refused; B finishes in step 29; step 30: A re-admitted (a
  //           prefill of 33 samples its 20th token); step 40: its 30th.
  const auto g = moebius::make_kv_geometry(1, 1, 8, 1, 60, 1, moebius::dtype::fp32);
  const std::vector<request> reqs = {make_request(0, 14, 30, 30, 0), make_request(1, 10, 30, 60, 0)};
  scheduler_options o = sglang_options(64, 8);
  o.sglang.clip_max_new_tokens = 4;
  std::vector<step_batch> log;
  const std::vector<request_result> res = drive(g, parallel_mode::tp, reqs, o, nullptr, &log);
  check_tokens(res);
  REQUIRE(log.size() == 41);
  CHECK(log[0].admitted == 2);
  CHECK(log[19].preempted == 1);
  CHECK(log[19].new_token_ratio == Approx(0.8125));
  CHECK(log[20].admission_blocked);
  CHECK(log[30].admitted == 1);
  CHECK(log[30].prefill_tokens == 33);
  CHECK(res[0].preemptions == 1);
  CHECK(res[1].preemptions == 0);
  CHECK(res[1].finish_s == 30);
  CHECK(res[0].finish_s == 41);
}

TEST_CASE("sglang, DP attention: each rank its own chunk and ratio; one rank prefills beside "
          "another's decodes") {
  // EP over 2 ranks of 100 pages of 1 token; a step's 16 tokens give each rank a chunk of 8,
  // 4 running give each 2; the ratio starts at 0.7 x 0.3 = 0.21. A: prompt 6, 5 tokens; B:
  // prompt 20, 3 tokens; C: prompt 4, 2 tokens (max_new = output), all at 0.
  //   step 0: A to rank 0 (both empty: the first), 6 of its chunk; B to rank 1 (100 free
  //           against rank 0's 94 - 5 = 89), 8 of its 20; C to rank 0 (rank 1's chunk is
  //           spent), the 2 tokens left of rank 0's chunk;
  //   step 1: both ranks continue a prefill (C's last 2, B's next 8): A does not decode;
  //   step 2: rank 0 decodes A and C (its ratio 0.21 - 0.1806 / 600) while rank 1 prefills
  //           B's last 4 (its ratio stays 0.21); C finishes;
  //   steps 3-4: both ranks decode: B finishes in step 4, A in step 5.
  const auto g = moebius::make_kv_geometry(1, 2, 8, 1, 100, 2, moebius::dtype::fp32);
  const std::vector<request> reqs = {make_request(0, 6, 5, 5, 0), make_request(1, 20, 3, 3, 0),
                                     make_request(2, 4, 2, 2, 0)};
  scheduler s(g, reqs, sglang_options(16, 4));
  CHECK(sglang_options(16, 4).rank_prefill_chunk(2) == 8);
  CHECK(sglang_options(16, 4).rank_prefill_chunk(1) == 16);
  CHECK(sglang_options(16, 4).rank_prefill_chunk(32) == 1);  // at least a token
  REQUIRE_THROWS_WITH(sglang_options(16, 4).rank_prefill_chunk(0), Catch::Contains("ranks >= 1"));
  moebius::kv_state kv = make_empty_kv_state(g, parallel_mode::ep);
  growing_pages pages(g, kv);
  const step_batch b0 = s.next_step(pages, 0);
  CHECK(b0.admitted == 3);
  CHECK(b0.prefill_tokens == 16);
  CHECK(owner_of(kv, 0) == 0);
  CHECK(owner_of(kv, 1) == 1);
  CHECK(owner_of(kv, 2) == 0);
  CHECK(b0.new_token_ratio == Approx(0.21));
  s.finish_step(b0, std::vector<int32_t>{rule(0, 0), -1, -1}, pages, 1);
  const step_batch b1 = s.next_step(pages, 1);
  CHECK(b1.prefill_tokens == 10);
  CHECK(b1.decode_tokens == 0);
  CHECK(b1.decodes_held == 1);  // A, on rank 0, sits C's last chunk out
  CHECK(b0.decodes_held == 0);
  std::vector<int32_t> t1;
  for (const step_item& it : b1.items) t1.push_back(it.sample ? rule(it.seq_id, 0) : -1);
  s.finish_step(b1, t1, pages, 2);
  const step_batch b2 = s.next_step(pages, 2);
  CHECK(b2.decode_tokens == 2);
  CHECK(b2.prefill_tokens == 4);
  CHECK(b2.decodes_held == 0);  // rank 1's prefill holds none of rank 0's decodes
  CHECK(b2.new_token_ratio == Approx((0.21 - 0.1806 / 600 + 0.21) / 2));
  // The same run to its end.
  std::vector<step_batch> log;
  const std::vector<request_result> res = drive(g, parallel_mode::ep, reqs, sglang_options(16, 4),
                                                nullptr, &log);
  check_tokens(res);
  CHECK(res[2].finish_s == 3);
  CHECK(res[1].finish_s == 5);
  CHECK(res[0].finish_s == 6);
}

TEST_CASE("vllm with one engine core per DP rank: under EP each rank fills its own token "
          "budget and max_running / P; one budget otherwise") {
  // EP over 2 ranks of 16 pages of 4 tokens, a budget of 8 tokens, max_running 4; four prompts
  // of 8 tokens and 3 output tokens at 0.
  //   one budget: step 0 prefills request 0 (8 tokens, the whole budget), step 1 request 1
  //   beside request 0's decode (7 of 8 left: 7 tokens), ...;
  //   a budget per rank: step 0 prefills requests 0 and 1 on ranks 0 and 1 (8 each), step 1
  //   decodes both (1 each) and starts requests 2 and 3 (7 tokens each, one a rank); no rank
  //   ever holds more than max_running / P = 2.
  const auto g = moebius::make_kv_geometry(1, 1, 8, 4, 16, 2, moebius::dtype::fp32);
  std::vector<request> reqs;
  for (int64_t i = 0; i < 4; ++i) reqs.push_back(make_request(i, 8, 3, 16, 0));
  scheduler_options o = preset_options(engine_preset::vllm, 8, 4);
  CHECK(o.rank_prefill_chunk(2) == 8);  // one budget may put a whole chunk on one rank
  std::vector<step_batch> one, per_rank;
  check_tokens(drive(g, parallel_mode::ep, reqs, o, nullptr, &one));
  CHECK(one[0].prefill_tokens == 8);
  CHECK(one[0].admitted == 1);
  CHECK(one[1].prefill_tokens == 7);
  CHECK(one[1].decode_tokens == 1);
  o.vllm_dp_engines = true;
  CHECK(o.rank_prefill_chunk(2) == 8);  // a DP engine's budget of its own
  check_tokens(drive(g, parallel_mode::ep, reqs, o, nullptr, &per_rank));
  CHECK(per_rank[0].prefill_tokens == 16);
  CHECK(per_rank[0].admitted == 2);
  CHECK(per_rank[1].decode_tokens == 2);
  CHECK(per_rank[1].admitted == 2);
  CHECK(per_rank[1].prefill_tokens == 14);
  CHECK(per_rank.size() < one.size());
  // TP: one engine core, one budget, whatever the option.
  std::vector<step_batch> tp_one, tp_flag;
  o.vllm_dp_engines = false;
  check_tokens(drive(g, parallel_mode::tp, reqs, o, nullptr, &tp_one));
  o.vllm_dp_engines = true;
  check_tokens(drive(g, parallel_mode::tp, reqs, o, nullptr, &tp_flag));
  REQUIRE(tp_one.size() == tp_flag.size());
  for (size_t k = 0; k < tp_one.size(); ++k) {
    CHECK(tp_one[k].prefill_tokens == tp_flag[k].prefill_tokens);
    CHECK(tp_one[k].decode_tokens == tp_flag[k].decode_tokens);
  }
  // SGLang schedules per rank already: the option is vLLM's.
  scheduler_options bad = sglang_options(8, 4);
  bad.vllm_dp_engines = true;
  REQUIRE_THROWS_WITH(validate(bad), Catch::Contains("vllm_dp_engines"));
}

TEST_CASE("sglang with mixed chunks: a prefill step carries the running decodes, its chunk and "
          "room less one token each, and does not decay the ratio") {
  // TP, one rank of 12 pages of 4 tokens (48), a chunk of 10. A: prompt 8, 4 tokens, max_new 16,
  // at 0; B: prompt 12, 3 tokens, max_new 8, at 0.5. With --enable-mixed-chunk:
  //   step 0: A admitted and prefilled (8 of the chunk's 10);
  //   step 1: A decodes: B's chunk 10 - 1 = 9 and its room 40 free - (1 + 0.7 x 15) = 28.5 >
  //           12 + 8: B admitted, 9 tokens, beside A's decode (ratio still 0.7). After it: A
  //           9 written + 10.5, B 9 written + 3 + 8 in full: 39.5 reserved;
  //   step 2: B's last 3 tokens beside A's decode: B samples its first token (at 3);
  //   steps 3-4: decodes (the ratio decays 0.602 / 600 each); A finishes at 4, B at 5.
  // Without it (the default) steps 1 and 2 are B's prefill alone (10, then 2) and A waits
  // through both: A finishes at 6.
  const auto g = moebius::make_kv_geometry(1, 1, 8, 4, 12, 1, moebius::dtype::fp32);
  const std::vector<request> reqs = {make_request(0, 8, 4, 16, 0), make_request(1, 12, 3, 8, 0.5)};
  const double d = 0.602 / 600;
  scheduler_options o = sglang_options(10, 8);
  o.sglang.enable_mixed_chunk = true;
  std::vector<step_batch> log;
  std::vector<request_result> res = drive(g, parallel_mode::tp, reqs, o, nullptr, &log);
  check_tokens(res);
  REQUIRE(log.size() == 5);
  CHECK(log[0].prefill_tokens == 8);
  CHECK(log[1].admitted == 1);
  CHECK(log[1].prefill_tokens == 9);
  CHECK(log[1].decode_tokens == 1);
  CHECK(log[1].new_token_ratio == Approx(0.7));
  CHECK(log[1].kv_written_tokens == 18);
  CHECK(log[1].kv_reserved_tokens == 39);
  CHECK(log[2].prefill_tokens == 3);
  CHECK(log[2].decode_tokens == 1);
  CHECK(log[2].new_token_ratio == Approx(0.7));
  CHECK(log[3].decode_tokens == 2);
  CHECK(log[3].new_token_ratio == Approx(0.7 - d));
  CHECK(log[4].new_token_ratio == Approx(0.7 - 2 * d));
  CHECK(res[0].finish_s == 4);
  CHECK(res[1].first_token_s == 3);
  CHECK(res[1].finish_s == 5);
  for (const step_batch& b : log) CHECK(b.decodes_held == 0);

  o.sglang.enable_mixed_chunk = false;
  log.clear();
  res = drive(g, parallel_mode::tp, reqs, o, nullptr, &log);
  check_tokens(res);
  CHECK(log[1].prefill_tokens == 10);
  CHECK(log[1].decode_tokens == 0);
  CHECK(log[2].prefill_tokens == 2);
  CHECK(log[2].decode_tokens == 0);
  CHECK(log[1].decodes_held == 1);
  CHECK(log[2].decodes_held == 1);
  CHECK(res[0].finish_s == 6);
}

TEST_CASE("sglang: a decode batch above the CUDA-graph limit is marked eager") {
  const auto g = moebius::make_kv_geometry(1, 1, 8, 4, 32, 1, moebius::dtype::fp32);
  std::vector<request> reqs;
  for (int64_t i = 0; i < 3; ++i) reqs.push_back(make_request(i, 2, 3, 3, 0));
  for (const int64_t limit : {2, 3}) {
    scheduler_options o = sglang_options(16, 4);
    o.sglang.cuda_graph_max_bs = limit;
    std::vector<step_batch> log;
    check_tokens(drive(g, parallel_mode::tp, reqs, o, nullptr, &log));
    REQUIRE(log.size() == 3);
    CHECK_FALSE(log[0].eager);  // a prefill
    CHECK(log[1].decode_tokens == 3);
    CHECK(log[1].eager == (limit == 2));
  }
}

TEST_CASE("presets on random traces: every request served once more per preemption, with the "
          "oracle's tokens") {
  const uint64_t seed = testing::test_seed();
  int64_t retractions = 0, preemptions = 0;
  for (const parallel_mode m : {parallel_mode::ep, parallel_mode::tp}) {
    // Eight rounds, then more (up to 64) while the trace has not yet made SGLang retract or
    // vLLM preempt: whether a random trace presses the pages that hard is up to the seed.
    for (uint64_t round = 0; round < 8 || (round < 64 && (retractions == 0 || preemptions == 0));
         ++round) {
      std::mt19937_64 rng(seed + round * 7919 + (m == parallel_mode::tp ? 1 : 0));
      const int P = std::uniform_int_distribution<int>(0, 1)(rng) ? 2 : 4;
      const int64_t pages = std::uniform_int_distribution<int64_t>(10, 24)(rng);
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
      std::vector<request> reqs = bursty_trace(rng(), t);
      // Half the requests give a max_new_tokens a little above their output, the rest none.
      for (request& r : reqs)
        if (rng() % 2) r.max_new_tokens = r.output_tokens + static_cast<int64_t>(rng() % 8);
      scheduler_options o;
      o.max_step_tokens = std::uniform_int_distribution<int64_t>(8, 32)(rng);
      o.max_running = std::uniform_int_distribution<int64_t>(P, o.max_step_tokens)(rng);
      o.default_max_new_tokens = std::uniform_int_distribution<int64_t>(1, 64)(rng);
      CAPTURE(seed, round, m, P, pages, o.max_step_tokens, o.max_running, o.default_max_new_tokens);
      const std::vector<request_result> oracle = drive(g, m, reqs, o);
      o.admission = admission_policy::known;
      for (const engine_preset e : {engine_preset::vllm, engine_preset::sglang}) {
        o.engine = e;
        // A low initial ratio over-admits, so that SGLang retracts: every other round has it,
        // so that no seed leaves retraction untested. Mixed chunks half the time.
        o.sglang.init_new_token_ratio = round % 2 ? 0.7 : 0.05;
        o.sglang.enable_mixed_chunk = rng() % 2 == 0;
        o.vllm_dp_engines = e == engine_preset::vllm && rng() % 2 == 0;
        CAPTURE(to_string(e), o.sglang.init_new_token_ratio, o.sglang.enable_mixed_chunk,
                o.vllm_dp_engines);
        const std::vector<request_result> res = drive(g, m, reqs, o);
        REQUIRE(res.size() == oracle.size());
        for (size_t i = 0; i < res.size(); ++i) {
          CAPTURE(res[i].id);
          CHECK(res[i].finished());
          CHECK(res[i].admissions == 1 + res[i].preemptions);
          CHECK(res[i].generated == oracle[i].generated);
          (e == engine_preset::sglang ? retractions : preemptions) += res[i].preemptions;
        }
      }
    }
  }
  CHECK(retractions > 0);
  CHECK(preemptions > 0);
}
