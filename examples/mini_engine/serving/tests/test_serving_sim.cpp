// The simulated runtime (sim_runtime.hpp) behind the real serving loop gives, on a trace the
// host runtime serves, the host runtime's event log on the same priced clock: every step (its
// start, mode, batch, prefill and decode tokens, context, running and waiting counts, KV pages,
// priced time, switch and cursor), every switch (direction, outcome, priced time, steps, gate
// reasoning) and every request's admission, first token and finish, in static runs, forced
// switches both ways (stop-the-world and progressive) and policy runs with the cost gate. The
// host runtime computes every token and moves every byte (host_transport); the simulated one
// computes nothing and moves nothing (dry_run_transport), so the equal logs show that the
// serving loop's decisions never depend on what a runtime computes; with known admission under
// each engine preset (engine_preset.hpp) too, preempting or retracting. And a step the tables
// do not hold is refused by the simulated runtime, as a runtime must (hybrid steps included).
#include <cstdlib>
#include <random>
#include <sstream>
#include <string>

#include <moebius/transport/dry_run_transport.hpp>

#include "catch.hpp"
#include "engine.hpp"
#include "kv_pages.hpp"
#include "sim_runtime.hpp"
#include "small_trace.hpp"
#include "test_seed.hpp"
#include "world.hpp"

using namespace mini_engine;
using moebius::parallel_mode;

namespace {

// The event log of a run: everything but measured host times, tokens and error texts, one
// line per step, switch and request (a difference is printed as the first line that differs).
std::vector<std::string> event_log(const run_result& r) {
  std::vector<std::string> log;
  for (const step_record& s : r.steps) {
    std::ostringstream o;
    o.precision(17);
    o << "step " << s.step << " t " << s.start_s << " " << moebius::to_string(s.mode) << " seq "
      << s.sequences << " dec " << s.decode_tokens << " pre " << s.prefill_tokens << " ctx "
      << s.context_tokens << " run " << s.running << " wait " << s.waiting << " stall "
      << s.stalled << " preempt " << s.preempted << " pages " << s.kv_used_pages << " ms " << s.step_ms << " sw "
      << s.switched << " " << s.switch_ms << " in " << s.in_switch << " layers " << s.layers
      << " cursor " << s.cursor << " copy " << s.copy_ms << " written " << s.kv_written_tokens
      << " reserved " << s.kv_reserved_tokens << " ratio " << s.new_token_ratio << " eager "
      << s.eager;
    log.push_back(o.str());
  }
  for (const switch_record& s : r.switches) {
    std::ostringstream o;
    o.precision(17);
    o << "switch at " << s.step << " t " << s.start_s << " " << moebius::to_string(s.from) << "->"
      << moebius::to_string(s.to) << " " << moebius::to_string(s.outcome) << " ms " << s.clock_ms
      << " running " << s.running << " prefilling " << s.prefilling << " progressive "
      << s.progressive << " steps " << s.steps << " per step " << s.layers_per_step
      << " tokens " << s.tokens << " gate " << s.gate.evaluated << " " << s.gate.gain_ms << " "
      << s.gate.cost_ms;
    log.push_back(o.str());
  }
  for (const request_result& q : r.requests) {
    std::ostringstream o;
    o.precision(17);
    o << "request " << q.id << " arrival " << q.arrival_s << " admitted " << q.admitted_s
      << " first " << q.first_token_s << " finish " << q.finish_s << " out " << q.output_tokens
      << " generated " << q.generated.size() << " admissions " << q.admissions << " preemptions "
      << q.preemptions << " stalls " << q.stalls;
    log.push_back(o.str());
  }
  std::ostringstream o;
  o.precision(17);
  o << "end " << r.end_s << " stalls " << r.stalls << " preemptions " << r.preemptions << " failed " << r.failed_requests
    << " refusals " << r.gate_refusals;
  log.push_back(o.str());
  return log;
}

void check_same_log(const run_result& host, const run_result& sim) {
  const std::vector<std::string> a = event_log(host), b = event_log(sim);
  CAPTURE(host.name);
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
    if (a[i] != b[i]) {
      INFO("line " << i << "\n host: " << a[i] << "\n sim:  " << b[i]);
      FAIL_CHECK("the event logs differ");
      if (std::getenv("SIM_DIFF_ALL") == nullptr) return;
    }
  }
  CHECK(a.size() == b.size());
}

// One world served twice: by its host runtime over a host transport, and by the simulated
// runtime over a dry-run transport, both on the same priced clock.
struct host_and_sim {
  host_and_sim(int P, int64_t ep_pages, uint64_t seed)
      : w(testing::make_world(P, ep_pages, seed)),
        sim(w.arena, w.kv, w.vocab),
        dry(P, sim.spaces()),
        clock(model_of(w.kv), h200_params{}, P, kv_bytes_per_token(w.kv)),
        host(*w.rt, *w.transport, w.arena, w.kv, clock, moebius::arena_cursor{0}),
        simulated(sim, dry, w.arena, w.kv, clock, moebius::arena_cursor{0}) {}
  static priced_model model_of(const moebius::kv_geometry& kv) {
    priced_model m;
    m.num_kv_heads = kv.num_kv_heads;
    return m;
  }
  testing::world w;
  sim_runtime sim;
  moebius::dry_run_transport dry;
  h200_step_model clock;
  engine host, simulated;
};

// Static EP and TP, then stop-the-world and progressive switches forced at random steps from 3
// below `last_step` (drawn from `rng`).
std::vector<std::pair<std::string, engine_options>> static_and_forced_runs(
    const engine_options& base, std::mt19937_64& rng, int64_t last_step) {
  std::vector<std::pair<std::string, engine_options>> runs;
  runs.push_back({"static EP", base});
  runs.push_back({"static TP", base});
  runs.back().second.start_mode = parallel_mode::tp;
  engine_options forced = base;
  forced.how = switching::forced;
  for (int64_t s = 3; s < last_step; s += 1 + static_cast<int64_t>(rng() % 12))
    forced.forced_steps.push_back(s);
  runs.push_back({"forced stop-the-world", forced});
  runs.push_back({"forced progressive", forced});
  runs.back().second.style = switch_style::progressive;
  return runs;
}

}  // namespace

TEST_CASE("the simulated runtime gives the host runtime's event log") {
  const uint64_t seed = testing::test_seed();
  std::mt19937_64 rng(seed);
  for (int round = 0; round < 4; ++round) {
    const int P = round % 2 ? 4 : 2;
    host_and_sim pair(P, 400, seed + static_cast<uint64_t>(round));
    const testing::world& w = pair.w;
    engine& host = pair.host;
    engine& simulated = pair.simulated;
    const uint64_t trace_seed = rng();
    INFO("seed " << seed << " round " << round << " P " << P << " trace seed " << trace_seed
                 << " runtime " << w.name);
    const std::vector<request> reqs = round < 2 ? testing::small_trace(trace_seed, w.vocab, 12)
                                                : testing::burst_trace(trace_seed, w.vocab);

    engine_options base = testing::small_trace_options();
    base.scheduler.max_running = round < 2 ? 6 : 48;
    base.scheduler.max_step_tokens = round < 2 ? 8 : 128;
    std::vector<std::pair<std::string, engine_options>> runs = static_and_forced_runs(base, rng, 400);
    const std::vector<int64_t> batches = {1, 2, 4, 8, 16, 32, 64};
    const moebius::calibration_result cal = calibrate_engine(host, batches, 40);
    if (cal.has_thresholds) {
      engine_options pol = base;
      pol.how = switching::policy;
      pol.policy = moebius::apply_calibration(cal, moebius::interactive_config(cal.t_high));
      pol.policy.cooldown_s = 0.02;
      pol.policy.down_window = 4;
      pol.start_mode = parallel_mode::tp;
      runs.push_back({"policy", pol});
      runs.push_back({"policy progressive", pol});
      runs.back().second.style = switch_style::progressive;
    }
    int64_t switches = 0;
    for (const auto& [name, o] : runs) {
      const run_result a = host.run(reqs, o, name);
      const run_result b = simulated.run(reqs, o, name);
      check_same_log(a, b);
      for (const switch_record& s : a.switches)
        switches += s.outcome == moebius::switch_outcome::committed;
      // The host runtime's tokens are a model's; the simulated ones are not, but as many.
      for (size_t i = 0; i < a.requests.size(); ++i)
        CHECK(a.requests[i].generated.size() == b.requests[i].generated.size());
    }
    CHECK(switches >= 4);
  }
}

TEST_CASE("known admission under each engine preset: the simulated runtime gives the host "
          "runtime's event log, and preemption or retraction leaves the greedy tokens unchanged") {
  const uint64_t seed = testing::test_seed();
  std::mt19937_64 rng(seed ^ 0x5eed);
  int64_t preemptions[2] = {0, 0};  // per preset
  for (int round = 0; round < 8; ++round) {
    const int P = round % 2 ? 4 : 2;
    const engine_preset preset = round % 4 < 2 ? engine_preset::vllm : engine_preset::sglang;
    // 12 pages of 4 tokens a rank: a request reaches 47 tokens, so sequences admitted on what
    // is known outgrow the pool and preempt (vllm) or retract (sglang, whose estimates are
    // discounted by its ratio: started low here so that they are outgrown).
    host_and_sim pair(P, 12, seed + 100 + static_cast<uint64_t>(round));
    const testing::world& w = pair.w;
    engine& host = pair.host;
    engine& simulated = pair.simulated;
    const uint64_t trace_seed = rng();
    INFO("seed " << seed << " round " << round << " P " << P << " preset " << to_string(preset)
                 << " trace seed " << trace_seed);
    std::vector<request> reqs = testing::burst_trace(trace_seed, w.vocab);
    // Half the requests give a max_new_tokens a little above their output; the rest none.
    for (request& r : reqs)
      if (rng() % 2) r.max_new_tokens = r.output_tokens + static_cast<int64_t>(rng() % 6);
    engine_options base = testing::small_trace_options();
    base.scheduler.max_running = 16;
    base.scheduler.max_step_tokens = 64;
    base.scheduler.admission = admission_policy::known;
    base.scheduler.engine = preset;
    base.scheduler.default_max_new_tokens = 24;
    base.scheduler.sglang.init_new_token_ratio = 0.2;
    const std::vector<std::pair<std::string, engine_options>> runs = static_and_forced_runs(base, rng, 300);
    for (const auto& [name, o] : runs) {
      const run_result a = host.run(reqs, o, name);
      const run_result b = simulated.run(reqs, o, name);
      check_same_log(a, b);
      preemptions[preset == engine_preset::sglang] += a.preemptions;
      // The same run with the oracle's reservations: the same greedy tokens, request by request.
      engine_options oracle = o;
      oracle.scheduler.admission = admission_policy::oracle;
      oracle.scheduler.engine = engine_preset::vllm;
      const run_result c = host.run(reqs, oracle, name + " (oracle)");
      REQUIRE(a.requests.size() == c.requests.size());
      for (size_t i = 0; i < a.requests.size(); ++i) {
        CAPTURE(name, a.requests[i].id);
        CHECK(a.requests[i].admissions == 1 + a.requests[i].preemptions);
        CHECK(a.requests[i].generated == c.requests[i].generated);
      }
    }
  }
  CHECK(preemptions[0] > 0);
  CHECK(preemptions[1] > 0);
}

TEST_CASE("the simulated runtime refuses a step its tables do not hold") {
  testing::world w = testing::make_world(2, 32, 1);
  sim_runtime sim(w.arena, w.kv, w.vocab);
  moebius::kv_state ep = moebius::make_kv_state(w.kv, parallel_mode::ep,
                                                {{}, {}});
  // Sequence 7 on rank 1 with 5 tokens.
  moebius::kv_sequence q;
  q.seq_id = 7;
  q.pages = {0, 1};
  q.num_tokens = w.kv.page_size + 1;
  q.last_page_len = 1;
  ep.ranks[1].sequences.push_back(q);
  std::erase(ep.ranks[1].free_pages, 0);
  std::erase(ep.ranks[1].free_pages, 1);
  moebius::validate(w.kv, ep);
  const std::vector<int32_t> one = {3};
  const step_layout at{&ep, moebius::arena_cursor{0}};
  step_item fits{7, one, q.num_tokens - 1, true};
  const std::vector<int32_t> t = sim.step(at, std::span(&fits, 1));
  REQUIRE(t.size() == 1);
  CHECK(t[0] == static_cast<int32_t>((7u * 31u + static_cast<uint64_t>(q.num_tokens)) %
                                     static_cast<uint64_t>(w.vocab)));
  step_item beyond{7, one, q.num_tokens, true};
  CHECK_THROWS_WITH(sim.step(at, std::span(&beyond, 1)), Catch::Matchers::Contains("holds"));
  step_item missing{8, one, 0, true};
  CHECK_THROWS_WITH(sim.step(at, std::span(&missing, 1)), Catch::Matchers::Contains("on 0 ranks"));
  // In TP every rank must hold it.
  moebius::kv_state tp = ep;
  tp.mode = parallel_mode::tp;
  CHECK_THROWS_WITH(sim.step(step_layout{&tp, moebius::arena_cursor{w.arena.shape.num_layers}},
                             std::span(&fits, 1)),
                    Catch::Matchers::Contains("on 1 ranks of the TP tables (2 expected)"));
  std::vector<std::vector<float>> logits;
  step_options with_logits;
  with_logits.logits = &logits;
  CHECK_THROWS_WITH(sim.finish(sim.enqueue(at, std::span(&fits, 1), with_logits)),
                    Catch::Matchers::Contains("no logits"));
}

TEST_CASE("the simulated runtime refuses a hybrid step either set of tables does not hold") {
  // A hybrid step (a progressive switch moving the KV) reads the TP tables in the layers below
  // the cursor and the EP tables in the rest: the sequence must be in both, each as its mode
  // holds it, with room for the step's tokens.
  testing::world w = testing::make_world(2, 32, 1);
  sim_runtime sim(w.arena, w.kv, w.vocab);
  const int64_t layers = w.arena.shape.num_layers;
  REQUIRE(layers >= 2);
  const moebius::arena_cursor mid{1};
  const int64_t tokens = w.kv.page_size + 1;
  moebius::kv_state tp = make_empty_kv_state(w.kv, parallel_mode::tp);
  moebius::kv_state ep = make_empty_kv_state(w.kv, parallel_mode::ep);
  reserve_tokens(w.kv, tp, 7, tokens, -1);
  reserve_tokens(w.kv, ep, 7, tokens, 1);
  const std::vector<int32_t> one = {3};
  step_item fits{7, one, tokens - 1, true};
  const std::vector<int32_t> t = sim.step(step_layout::hybrid_of(tp, ep, mid), std::span(&fits, 1));
  REQUIRE(t.size() == 1);
  CHECK(t[0] == static_cast<int32_t>((7u * 31u + static_cast<uint64_t>(tokens)) %
                                     static_cast<uint64_t>(w.vocab)));
  // The EP tables do not hold it, or hold a token fewer than the step writes.
  moebius::kv_state ep_without = make_empty_kv_state(w.kv, parallel_mode::ep);
  reserve_tokens(w.kv, ep_without, 8, tokens, 0);
  CHECK_THROWS_WITH(sim.step(step_layout::hybrid_of(tp, ep_without, mid), std::span(&fits, 1)),
                    Catch::Matchers::Contains("sequence 7 is on 0 ranks of the EP tables (1 expected)"));
  moebius::kv_state ep_short = make_empty_kv_state(w.kv, parallel_mode::ep);
  reserve_tokens(w.kv, ep_short, 7, tokens - 1, 0);
  CHECK_THROWS_WITH(sim.step(step_layout::hybrid_of(tp, ep_short, mid), std::span(&fits, 1)),
                    Catch::Matchers::Contains("on rank 0 (EP) holds " + std::to_string(tokens - 1)));
  // The TP tables do not hold it on every rank.
  moebius::kv_state tp_short = make_empty_kv_state(w.kv, parallel_mode::tp);
  reserve_tokens(w.kv, tp_short, 7, tokens - 1, -1);
  CHECK_THROWS_WITH(sim.step(step_layout::hybrid_of(tp_short, ep, mid), std::span(&fits, 1)),
                    Catch::Matchers::Contains("(TP) holds " + std::to_string(tokens - 1)));
  // Tables of the wrong modes, a cursor past the last layer.
  CHECK_THROWS_WITH(sim.step(step_layout::hybrid_of(ep, tp, mid), std::span(&fits, 1)),
                    Catch::Matchers::Contains("not TP and EP"));
  CHECK_THROWS_WITH(sim.step(step_layout::hybrid_of(tp, ep, moebius::arena_cursor{layers + 1}),
                             std::span(&fits, 1)),
                    Catch::Matchers::Contains("a hybrid step at cursor " + std::to_string(layers + 1)));
  // Every refusal ran nothing: the one step above is all the runtime counted.
  CHECK(sim.steps() == 1);
}
