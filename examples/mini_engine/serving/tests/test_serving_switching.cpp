// THE switching test (DESIGN.md §7): a serving run that switches between EP and TP at random
// steps (many switches, both directions, some while a prompt is half prefilled) produces
// exactly the same greedy tokens per request as a static run, with no request lost,
// duplicated or restarted and no KV page leaked. Runs on `runtime&` (tests/world.hpp: the
// model's host_runtime when it is in the build, else the token-hash fake).
#include <random>

#include "catch.hpp"
#include "engine.hpp"
#include "small_trace.hpp"
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
