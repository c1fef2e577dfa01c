// The serving loop with the policy: calibration from the clock gives the thresholds, the
// policy switches at bursts, every request finishes; the CSV and the summary are consistent;
// the H200 step model has the regime it documents.
#include <sstream>
#include <string>

#include "catch.hpp"
#include "engine.hpp"
#include "small_trace.hpp"
#include "world.hpp"

using namespace mini_engine;
using moebius::parallel_mode;

namespace {

int64_t kv_bytes_per_token(const moebius::kv_geometry& g) {
  return g.num_tensors() * g.heads_per_ep_page() * g.head_bytes();
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
  int64_t progress_calls = 0;
  o.progress_every_steps = 50;
  o.on_progress = [&](const progress_info&) { ++progress_calls; };

  const std::vector<request> reqs = testing::burst_trace(9, w.vocab);
  const run_result r = e.run(reqs, o, "switching");
  CHECK(progress_calls > 0);
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
  CHECK(s.p99_ttft_ms >= s.mean_ttft_ms);
  CHECK(s.mean_tpot_ms > 0);
  CHECK(s.tokens_per_s > 0);
  int64_t out_tokens = 0;
  for (const request& q : reqs) out_tokens += q.output_tokens;
  CHECK(s.output_tokens == out_tokens);

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
