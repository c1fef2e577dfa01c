// The serving loop after inconsistent switches (issue 22): a barrier timeout or a failed undo
// injected into forced switches is recovered in the run (engine_options::reload_experts), the
// sequences whose KV was lost are recomputed or failed (lost_kv_policy), without reload_experts
// the engine stays inconsistent until engine::recover, and a switch recovered in the run serves
// on in its source mode. The other faults: test_serving_faults.cpp; what the two share:
// fault_fixture.hpp.
// Every served request is compared token for token with a static run.
#include <algorithm>
#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include <moebius/error.hpp>
#include <moebius/transport/host_transport.hpp>

#include "catch.hpp"
#include "engine.hpp"
#include "fault_fixture.hpp"
#include "paced_clock.hpp"
#include "same_tokens.hpp"
#include "small_trace.hpp"
#include "soak.hpp"

using namespace mini_engine;
using moebius::parallel_mode;
using moebius::switch_outcome;
using testing::check_same_tokens;
using testing::count;
using testing::every_other_step;
using testing::host_world;
using testing::make_host_world;
using testing::with_layers;

namespace {

// engine_options::reload_experts from the host copy.
std::function<void(moebius::arena_cursor)> reload_from(host_world& w) {
  return [&w](moebius::arena_cursor c) { w.rt->place_experts(w.weights, c); };
}

}  // namespace

// Forced switches (both styles), a barrier timeout (errc::timeout: no undo is trusted) or a
// fault whose undo fails injected into about half of them at a random stage and phase: every
// inconsistent switch is recovered in the run, the sequences whose KV was lost are recomputed,
// and every request gets the static run's tokens.
TEST_CASE("inconsistent switches are recovered in the run; lost sequences resume",
          "[cpu][faults][recovery]") {
  for (const switch_style style : {switch_style::stop_the_world, switch_style::progressive}) {
    for (uint64_t seed = 1; seed <= 2; ++seed) {
      host_world w = make_host_world(with_layers(3), 2, 96, 40 + seed);
      CAPTURE(static_cast<int>(style), seed);
      const std::vector<request> reqs =
          testing::small_trace(40 + seed, static_cast<int32_t>(w.c.vocab), 12);
      const testing::paced_clock clock(1);
      engine e(*w.rt, *w.transport, w.rt->arena(), w.rt->kv(), clock, moebius::arena_cursor{0});
      engine_options o = testing::small_trace_options();
      const run_result ep = e.run(reqs, o, "static EP");
      o.how = switching::forced;
      o.style = style;
      o.forced_steps = every_other_step(2, static_cast<int64_t>(ep.steps.size()) + 40, 4);
      o.reload_experts = reload_from(w);
      std::mt19937_64 rng(seed);
      auto inject = [&](moebius::switcher& sw, int64_t phases) {
        if (!std::bernoulli_distribution(0.5)(rng)) return;
        const int64_t at = std::uniform_int_distribution<int64_t>(0, std::max<int64_t>(0, phases - 1))(rng);
        const auto stage = std::bernoulli_distribution(0.5)(rng) ? moebius::switch_fault::stage::kv
                                                                 : moebius::switch_fault::stage::weights;
        if (std::bernoulli_distribution(0.5)(rng)) {
          sw.inject_fault(moebius::switch_fault{stage, moebius::fault_point{at, 0, moebius::errc::timeout}});
        } else {
          sw.inject_fault(moebius::switch_fault{stage, moebius::fault_point{at, 0}});
          sw.inject_fault(moebius::switch_fault{moebius::switch_fault::stage::undo, moebius::fault_point{0, 0}});
        }
      };
      if (style == switch_style::stop_the_world) {
        o.test_hooks.before_switch = [&](moebius::switcher& sw, int64_t) { inject(sw, 2); };
      } else {
        o.test_hooks.before_advance = [&](moebius::switcher& sw, const moebius::progressive_switch& s, int64_t) {
          const moebius::switch_report& r = s.report();
          inject(sw, 1 + r.kv_rounds / std::max<int64_t>(1, r.weight_phases));
        };
      }
      run_result got;
      REQUIRE_NOTHROW(got = e.run(reqs, o, "faults"));
      check_same_tokens(got, ep);
      int64_t recovered = 0, lost = 0, resumes = 0;
      for (const switch_record& s : got.switches) {
        CAPTURE(s.step, s.error);
        if (s.outcome == switch_outcome::inconsistent) {
          CHECK(s.recovered);
          ++recovered;
          lost += s.lost_sequences;
        }
      }
      for (const request_result& q : got.requests) resumes += q.resumes;
      CHECK(recovered >= 2);
      CHECK(lost >= 1);
      CHECK(resumes == lost);
      CHECK(count(got, switch_outcome::committed) >= 2);
      CHECK(e.get_switcher().consistent());
    }
  }
}

TEST_CASE("lost sequences can fail instead; without reload_experts, engine::recover",
          "[cpu][faults][recovery]") {
  host_world w = make_host_world(with_layers(2), 2, 96, 50);
  const std::vector<request> reqs = testing::small_trace(50, static_cast<int32_t>(w.c.vocab), 12);
  const testing::paced_clock clock(1);
  engine e(*w.rt, *w.transport, w.rt->arena(), w.rt->kv(), clock, moebius::arena_cursor{0});
  engine_options o = testing::small_trace_options();
  const run_result ep = e.run(reqs, o, "static EP");
  o.how = switching::forced;
  o.forced_steps = {6};
  // A timeout in the KV: every live sequence loses its KV.
  o.test_hooks.before_switch = [](moebius::switcher& sw, int64_t) {
    sw.inject_fault(moebius::switch_fault{moebius::switch_fault::stage::kv,
                                          moebius::fault_point{0, 0, moebius::errc::timeout}});
  };
  o.reload_experts = reload_from(w);
  o.lost_kv = lost_kv_policy::fail;
  const run_result got = e.run(reqs, o, "lost sequences fail");
  REQUIRE(got.switches.size() == 1);
  CHECK(got.switches[0].outcome == switch_outcome::inconsistent);
  CHECK(got.switches[0].recovered);
  const int64_t lost = got.switches[0].lost_sequences;
  CHECK(lost >= 1);
  CHECK(lost == got.switches[0].running);  // a KV timeout: every live sequence's KV is lost
  CHECK(got.failed_requests == lost);
  REQUIRE(got.requests.size() == ep.requests.size());
  for (size_t i = 0; i < got.requests.size(); ++i) {
    const request_result& q = got.requests[i];
    CAPTURE(q.id);
    if (q.failed()) {
      CHECK_THAT(q.error, Catch::Matchers::Contains("request " + std::to_string(q.id) +
                                                    ": its KV cache was lost"));
      CHECK_FALSE(q.finished());
      // What it produced before the loss is the static run's prefix.
      const std::vector<int32_t>& all = ep.requests[i].generated;
      REQUIRE(q.generated.size() <= all.size());
      CHECK(std::equal(q.generated.begin(), q.generated.end(), all.begin()));
    } else {
      CHECK(q.generated == ep.requests[i].generated);
    }
  }

  // No reload_experts: the run throws, the engine stays inconsistent until engine::recover.
  o.reload_experts = nullptr;
  CHECK_THROWS_WITH(e.run(reqs, o, "no way back"),
                    Catch::Matchers::Contains("set engine_options::reload_experts"));
  CHECK_FALSE(e.get_switcher().consistent());
  CHECK_THROWS_WITH(e.run(reqs, testing::small_trace_options(), "refused"),
                    Catch::Matchers::Contains("inconsistent"));
  CHECK_FALSE(e.get_switcher().consistent());
  e.recover(reload_from(w), parallel_mode::ep);
  CHECK(e.get_switcher().consistent());
  const run_result again = e.run(reqs, testing::small_trace_options(), "after engine::recover");
  check_same_tokens(again, ep);
}

// engine_options::reload_experts: an inconsistent switch is recovered in the mode it started
// from (engine::recover_in_run, recovery_request::mode = the switch's `from`), so the run serves
// on exactly as before the switch: the engine's mode, the switcher's resting cursor (0 in EP, L
// in TP) and every step after the switch are in the source mode. Both directions (EP -> TP and
// TP -> EP failing), both styles; the fault (a barrier timeout: inconsistent) at a random step,
// and for a progressive switch in a random one of its advances.
TEST_CASE("an inconsistent switch recovered in the run serves on in its source mode",
          "[cpu][faults][recovery]") {
  const uint64_t seed = testing::soak_seed();
  std::mt19937_64 rng(seed);
  const int64_t L = 3;
  for (const switch_style style : {switch_style::stop_the_world, switch_style::progressive}) {
    for (const parallel_mode source : {parallel_mode::ep, parallel_mode::tp}) {
      const parallel_mode target =
          source == parallel_mode::ep ? parallel_mode::tp : parallel_mode::ep;
      const uint64_t world_seed = rng();
      CAPTURE(static_cast<int>(style), moebius::to_string(source), world_seed);
      host_world w = make_host_world(with_layers(L), 2, 96, world_seed);
      const std::vector<request> reqs =
          testing::small_trace(world_seed, static_cast<int32_t>(w.c.vocab), 12);
      const testing::paced_clock clock(1);
      engine e(*w.rt, *w.transport, w.rt->arena(), w.rt->kv(), clock, moebius::arena_cursor{0});
      engine_options o = testing::small_trace_options();
      o.start_mode = source;
      const run_result want = e.run(reqs, o, "static");
      const int64_t at = std::uniform_int_distribution<int64_t>(3, 12)(rng);
      const int64_t advance = std::uniform_int_distribution<int64_t>(0, L - 1)(rng);
      CAPTURE(at, advance);
      o.how = switching::forced;
      o.style = style;
      o.forced_steps = {at};
      o.reload_experts = reload_from(w);
      // In the weights (a step may run with no KV live to move); an advance carries both.
      const moebius::switch_fault timeout{moebius::switch_fault::stage::weights,
                                          moebius::fault_point{0, 0, moebius::errc::timeout}};
      if (style == switch_style::stop_the_world) {
        o.test_hooks.before_switch = [&](moebius::switcher& sw, int64_t) { sw.inject_fault(timeout); };
      } else {
        int64_t advances = 0;
        o.test_hooks.before_advance = [&, advances](moebius::switcher& sw, const moebius::progressive_switch&,
                                         int64_t) mutable {
          if (advances++ == advance) sw.inject_fault(timeout);
        };
      }
      run_result got;
      REQUIRE_NOTHROW(got = e.run(reqs, o, "recovered"));
      check_same_tokens(got, want);
      REQUIRE(got.switches.size() == 1);
      const switch_record& s = got.switches[0];
      CAPTURE(s.error);
      CHECK(s.step == at);
      CHECK(s.from == source);
      CHECK(s.to == target);
      CHECK(s.progressive == (style == switch_style::progressive));
      REQUIRE(s.outcome == switch_outcome::inconsistent);
      CHECK(s.recovered);
      CHECK(e.get_switcher().consistent());
      CHECK(e.mode() == source);
      CHECK(e.get_switcher().cursor().tp_layers == (source == parallel_mode::tp ? L : 0));
      // Every step, before, during (a progressive switch's steps read the source's tables) and
      // after the switch, ran in the source mode, at its resting cursor once the switch ended.
      int64_t after = 0;
      for (const step_record& rec : got.steps) {
        CAPTURE(rec.step);
        CHECK(rec.mode == source);
        if (rec.step >= at && !rec.in_switch) {
          CHECK(rec.cursor == (source == parallel_mode::tp ? L : 0));
          ++after;
        }
      }
      CHECK(after >= 5);
      // And the engine serves the next run from there.
      engine_options again_o = testing::small_trace_options();
      again_o.start_mode = source;
      check_same_tokens(e.run(reqs, again_o, "again"), want);
    }
  }
}
