// THE switching test (DESIGN.md §7): a serving run that switches between EP and TP at random
// steps (many switches, both directions, some while a prompt is half prefilled) produces
// exactly the same greedy tokens per request as a static run, with no request lost,
// duplicated or restarted and no KV page leaked. Runs on `runtime&` (tests/world.hpp: the
// model's host_runtime when it is in the build, else the token-hash fake).
#include <algorithm>
#include <random>

#include "catch.hpp"
#include "engine.hpp"
#include "small_trace.hpp"
#include "test_seed.hpp"
#include "world.hpp"

using namespace mini_engine;
using moebius::parallel_mode;

namespace {

// A clock of one unit per step, whatever the mode: step indices are reproducible.
class unit_clock final : public step_clock {
 public:
  double step_s(const step_cost&, double) const override { return 0.01; }
  double switch_s(const moebius::switch_report&) const override { return 0.0; }
  const char* name() const override { return "unit"; }
  bool needs_measurement() const override { return false; }
};

}  // namespace

TEST_CASE("switching at random steps gives the static run's tokens") {
  for (const int P : {2, 4}) {
    for (uint64_t seed = 1; seed <= 3; ++seed) {
      testing::world w = testing::make_world(P, 96, seed);
      CAPTURE(w.name, P, seed);
      const std::vector<request> reqs = testing::small_trace(seed, w.vocab, 10);
      REQUIRE(reqs.size() > 12);
      const unit_clock clock;
      engine e(*w.rt, *w.transport, w.arena, w.kv, clock, moebius::arena_cursor{0});

      engine_options o = testing::small_trace_options();
      const run_result ep = e.run(reqs, o, "static EP");
      o.start_mode = parallel_mode::tp;
      const run_result tp = e.run(reqs, o, "static TP");
      REQUIRE(ep.switches.empty());
      REQUIRE(tp.switches.empty());

      // Switch before ~30% of the steps, from either mode.
      std::mt19937_64 rng(seed * 1000 + static_cast<uint64_t>(P));
      o.how = switching::forced;
      for (int64_t s = 1; s < static_cast<int64_t>(ep.steps.size()) + 40; ++s) {
        if (std::bernoulli_distribution(0.3)(rng)) o.forced_steps.push_back(s);
      }
      o.start_mode = seed % 2 ? parallel_mode::ep : parallel_mode::tp;
      const run_result sw = e.run(reqs, o, "switching");

      int64_t to_tp = 0, to_ep = 0, mid_prefill = 0;
      for (const switch_record& s : sw.switches) {
        CHECK(s.outcome == moebius::switch_outcome::committed);
        (s.to == parallel_mode::tp ? to_tp : to_ep) += 1;
        mid_prefill += s.prefilling > 0;
      }
      CHECK(to_tp >= 5);
      CHECK(to_ep >= 5);
      CHECK(mid_prefill >= 2);

      REQUIRE(sw.requests.size() == reqs.size());
      REQUIRE(ep.requests.size() == reqs.size());
      for (size_t i = 0; i < reqs.size(); ++i) {
        const request_result& a = ep.requests[i];
        CAPTURE(a.id);
        CHECK(a.admissions == 1);
        CHECK(sw.requests[i].admissions == 1);
        REQUIRE(static_cast<int64_t>(a.generated.size()) == a.output_tokens);
        CHECK(tp.requests[i].generated == a.generated);
        CHECK(sw.requests[i].generated == a.generated);
      }
      CHECK(e.get_switcher().kv_tables().ranks.size() == static_cast<size_t>(P));
    }
  }
}

TEST_CASE("changing the TP view's dcp while serving (2 <-> 1) gives the static runs' tokens") {
  const int P = 4;  // tiny(): 2 KV heads, so each head slice on two ranks: dcp 1 or 2
  for (uint64_t seed = 1; seed <= 3; ++seed) {
    testing::world w = testing::make_world(P, 96, seed, 2);
    CAPTURE(w.name, seed);
    const std::vector<request> reqs = testing::small_trace(seed, w.vocab, 10);
    const unit_clock clock;
    engine e(*w.rt, *w.transport, w.arena, w.kv, clock, moebius::arena_cursor{0});
    engine_options o = testing::small_trace_options();
    o.layouts.ep = o.layouts.tp = parallel_mode::tp;  // dcp only: one layout, two dcp
    o.layouts.ep_dcp = 2;
    o.layouts.tp_dcp = 1;
    o.validate_every_step = true;
    o.start_mode = parallel_mode::ep;
    const run_result dcp2 = e.run(reqs, o, "static TP-DCP2");
    CHECK(e.get_switcher().dcp() == 2);
    o.start_mode = parallel_mode::tp;
    const run_result dcp1 = e.run(reqs, o, "static TP");
    CHECK(e.get_switcher().dcp() == 1);
    REQUIRE(dcp2.switches.empty());
    REQUIRE(dcp1.switches.size() <= 1);  // to dcp 1 before the first step (no live KV)

    std::mt19937_64 rng(seed * 77);
    o.how = switching::forced;
    for (int64_t s = 1; s < static_cast<int64_t>(dcp1.steps.size()) + 40; ++s)
      if (std::bernoulli_distribution(0.3)(rng)) o.forced_steps.push_back(s);
    o.start_mode = seed % 2 ? parallel_mode::ep : parallel_mode::tp;
    const run_result sw = e.run(reqs, o, "switching dcp");
    int64_t to_1 = 0, to_2 = 0;
    for (const switch_record& s : sw.switches) {
      CHECK(s.outcome == moebius::switch_outcome::committed);
      CHECK(s.from == moebius::parallel_layout{parallel_mode::tp});
      CHECK(s.to == moebius::parallel_layout{parallel_mode::tp});
      (s.to_dcp == 1 ? to_1 : to_2) += 1;
    }
    CHECK(to_1 >= 3);
    CHECK(to_2 >= 3);
    // Each step at the dcp of the last switch committed before it (the start's included).
    int64_t dcp = o.start_mode == parallel_mode::ep ? 2 : 1;
    size_t next = 0;
    for (const step_record& st : sw.steps) {
      while (next < sw.switches.size() && sw.switches[next].step <= st.step) {
        if (sw.switches[next].outcome == moebius::switch_outcome::committed)
          dcp = sw.switches[next].to_dcp;
        ++next;
      }
      CHECK(st.config.dcp == dcp);
    }
    REQUIRE(sw.requests.size() == reqs.size());
    for (size_t i = 0; i < reqs.size(); ++i) {
      CAPTURE(dcp1.requests[i].id);
      REQUIRE(static_cast<int64_t>(dcp1.requests[i].generated.size()) ==
              dcp1.requests[i].output_tokens);
      CHECK(dcp2.requests[i].generated == dcp1.requests[i].generated);
      CHECK(sw.requests[i].generated == dcp1.requests[i].generated);
      CHECK(sw.requests[i].admissions == 1);
    }
  }
}

TEST_CASE("forced switches at serving times: one before the first step at or after each") {
  const int P = 2;
  const uint64_t seed = testing::test_seed();
  testing::world w = testing::make_world(P, 96, seed);
  const std::vector<request> reqs = testing::small_trace(seed, w.vocab, 10);
  const unit_clock clock;
  engine e(*w.rt, *w.transport, w.arena, w.kv, clock, moebius::arena_cursor{0});
  engine_options o = testing::small_trace_options();
  const run_result ep = e.run(reqs, o, "static EP");
  REQUIRE(ep.steps.size() > 20);
  // Random times within the run, some two within one step: before the start of its 10th step
  // from the end, so that each of the 9 (one a step) still finds a step after it.
  std::mt19937_64 rng(seed);
  const double last = ep.steps[ep.steps.size() - 10].start_s;
  std::uniform_real_distribution<double> at(0, last);
  o.how = switching::forced;
  o.forced_steps = {1, 2, 3};  // ignored: the times are given
  for (int i = 0; i < 8; ++i) o.forced_at_s.push_back(at(rng));
  o.forced_at_s.push_back(o.forced_at_s.back());
  std::sort(o.forced_at_s.begin(), o.forced_at_s.end());
  const run_result sw = e.run(reqs, o, "switching at times");
  // Every time one switch (the run's clock is the static run's: switches cost 0, steps 0.01 s).
  REQUIRE(sw.switches.size() == o.forced_at_s.size());
  for (size_t i = 0; i < sw.switches.size(); ++i) {
    const switch_record& s = sw.switches[i];
    CAPTURE(i, s.step, s.start_s, o.forced_at_s[i]);
    CHECK(s.outcome == moebius::switch_outcome::committed);
    CHECK(s.to == (i % 2 == 0 ? parallel_mode::tp : parallel_mode::ep));
    CHECK(s.start_s >= o.forced_at_s[i]);
    // The step before started before the time, unless it took the time before this one.
    for (const step_record& r : sw.steps) {
      if (r.step != s.step - 1) continue;
      CHECK((r.start_s < o.forced_at_s[i] || (i > 0 && sw.switches[i - 1].step == r.step)));
    }
  }
  // The tokens are the static run's.
  REQUIRE(sw.requests.size() == ep.requests.size());
  for (size_t i = 0; i < ep.requests.size(); ++i) CHECK(sw.requests[i].generated == ep.requests[i].generated);
  // Times that fall are refused by index.
  o.forced_at_s = {0.5, 0.25};
  CHECK_THROWS_WITH(e.run(reqs, o, "bad"),
                    Catch::Contains("forced_at_s[1] = 0.25 must be finite, >= 0 and not below"));
}
