// The cost gate on the host runtime (DESIGN.md §7, "a switch must pay for itself"): on the
// modelled H200 clock (Qwen3-30B-A3B priced at P = 4, where the TP and EP step curves lie within
// ~10% of each other around the crossover), short bursts make the calibrated policy's rules
// switch, and without the gate those switches cost more than they save: the ungated run loses
// to the best static layout. With the gate (the engine's default) the policy must not lose:
// tokens/s within 2% of the best static run and p99 TTFT no more than 2% above it. Everything
// is priced on a deterministic clock, so the comparisons are exact reruns, not timings.
//
// MINI_ENGINE_TEST_GATE_OFF=1 runs the "gated" run with the gate disabled: the test must then
// fail (this is how the test shows it can).
#include <algorithm>
#include <cstdlib>
#include <string>

#include "catch.hpp"
#include "engine.hpp"
#include "small_trace.hpp"
#include "world.hpp"

using namespace mini_engine;
using moebius::parallel_mode;

namespace {

bool gate_forced_off() {
  const char* v = std::getenv("MINI_ENGINE_TEST_GATE_OFF");
  return v != nullptr && std::string(v) == "1";
}

}  // namespace

TEST_CASE("cost gate: the gated policy never loses to the best static run; ungated, it does") {
  testing::world w = testing::make_world(4, 800, 5);
  priced_model m;
  m.num_kv_heads = w.kv.num_kv_heads;
  // Switches priced at the paper's 8x H200 rate (330 GB/s, no fixed cost), not the 2x H200 fit
  // the demo uses (395 GB/s + 3.9 ms): the scenario needs switches that cost more than the
  // bursts save, which at the fitted rate the ungated run still shows, by less than 1%.
  h200_params hw;
  hw.switch_link = moebius::link_params{};
  hw.switch_link.bandwidth = moebius::link_rate::gb_per_s(330);
  const h200_step_model clock(m, hw, 4, kv_bytes_per_token(w.kv));
  engine e(*w.rt, *w.transport, w.arena, w.kv, clock, moebius::arena_cursor{0});

  const std::vector<int64_t> batches = {1, 2, 4, 8, 16, 32, 64, 128};
  const moebius::calibration_result cal = calibrate_engine(e, batches, 300);
  INFO(cal);
  REQUIRE(cal.has_thresholds);

  const std::vector<request> reqs = testing::burst_trace(9, w.vocab);

  engine_options base;
  base.scheduler.max_running = 160;
  base.scheduler.max_step_tokens = 512;
  engine_options pol = base;
  pol.how = switching::policy;
  pol.policy = moebius::apply_calibration(cal, moebius::interactive_config(cal.t_high));
  pol.policy.cooldown_s = 0.02;
  pol.policy.down_window = 4;
  pol.start_mode = parallel_mode::tp;

  base.start_mode = parallel_mode::tp;
  const run_summary tp = summarize(e.run(reqs, base, "static TP"));
  base.start_mode = parallel_mode::ep;
  const run_summary ep = summarize(e.run(reqs, base, "static EP"));
  const run_summary& best = tp.tokens_per_s >= ep.tokens_per_s ? tp : ep;
  const double best_p99 = std::min(tp.p99_ttft_ms, ep.p99_ttft_ms);

  pol.gate.enabled = false;
  const run_result ungated_run = e.run(reqs, pol, "ungated");
  const run_summary ungated = summarize(ungated_run);
  pol.gate.enabled = !gate_forced_off();
  const run_result gated_run = e.run(reqs, pol, "gated");
  const run_summary gated = summarize(gated_run);

  INFO("static TP " << tp.tokens_per_s << " tok/s, p99 TTFT " << tp.p99_ttft_ms << " ms");
  INFO("static EP " << ep.tokens_per_s << " tok/s, p99 TTFT " << ep.p99_ttft_ms << " ms");
  INFO("ungated " << ungated.tokens_per_s << " tok/s, p99 TTFT " << ungated.p99_ttft_ms
                  << " ms, " << ungated.switches << " switches, " << ungated.switch_total_ms
                  << " ms switching");
  INFO("gated " << gated.tokens_per_s << " tok/s, p99 TTFT " << gated.p99_ttft_ms << " ms, "
                << gated.switches << " switches, " << gated_run.gate_refusals
                << " refused by the gate; last refusal: " << gated_run.last_refusal);
  // Every run serves every request.
  for (const run_summary* s : {&tp, &ep, &ungated, &gated}) CHECK(s->requests == static_cast<int64_t>(reqs.size()));

  // The trace is one where the rules switch and switching loses: this is what the gate is for.
  REQUIRE(ungated.switches >= 2);
  REQUIRE(ungated.tokens_per_s < best.tokens_per_s * 0.99);
  REQUIRE(ungated.p99_ttft_ms > best_p99 * 1.5);

  // The gated policy does not lose.
  CHECK(gated.tokens_per_s >= best.tokens_per_s * 0.98);
  CHECK(gated.p99_ttft_ms <= best_p99 * 1.02);
  // ... because the gate refused the switches that would not pay (each it let through did).
  CHECK(gated_run.gate_refusals > 0);
  for (const switch_record& s : gated_run.switches) {
    CHECK(s.gate.evaluated);
    CHECK(s.gate.gain_ms >= s.gate.cost_ms * (1 + pol.gate.margin));
  }
}
