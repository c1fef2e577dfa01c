// The serving loop under faults, tight pools and bad requests (issue 22). Each case is one way
// a new user broke the loop through its public headers; each ran to an exception before its fix:
//   1. a progressive switch with a real verify hook (checksums of the experts and the KV) commits,
//      and a corrupted layer is still caught (rolled back);
//   2. forced switches into TP with H_kv < P on a tight pool (page size 1) never deadlock: the
//      switches that would leave running sequences unable to grow are refused;
//   3. a start-mode switch that rolls back leaves the run serving in the mode it is in;
//   4. a request with a token id outside the vocab fails alone, and the engine serves on;
//   5. output_tokens = INT64_MAX fails alone with a moebius::error's message naming it;
// and a run that throws part-way (a user callback) leaves the engine empty and ready; an
// inconsistent switch recovered in the run serves on in the switch's source mode.
// Every served request is compared token for token with a static run of the good requests.
#include <algorithm>
#include <cstdint>
#include <limits>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include <moebius/error.hpp>
#include <moebius/switch/checksum.hpp>
#include <moebius/transport/host_transport.hpp>

#include "catch.hpp"
#include "engine.hpp"
#include "host_runtime.hpp"
#include "model_config.hpp"
#include "paced_clock.hpp"
#include "same_tokens.hpp"
#include "small_trace.hpp"
#include "soak.hpp"
#include "weights.hpp"

using namespace mini_engine;
using moebius::parallel_mode;
using moebius::switch_outcome;
using testing::check_same_tokens;

namespace {

struct host_world {
  model_config c;
  model_weights weights;  // the host copy recovery reloads the experts from
  std::unique_ptr<host_runtime> rt;
  std::unique_ptr<moebius::host_transport> transport;
};

host_world make_host_world(const model_config& c, int P, int64_t ep_pages, uint64_t seed) {
  host_world w;
  w.c = c;
  validate(w.c, P);
  host_runtime_options o;
  o.num_ranks = P;
  o.num_ep_pages = ep_pages;
  w.weights = make_weights(w.c, seed);
  w.rt = std::make_unique<host_runtime>(w.weights, o);
  w.transport = std::make_unique<moebius::host_transport>(w.rt->memory());
  return w;
}

// engine_options::reload_experts from the host copy.
std::function<void(moebius::arena_cursor)> reload_from(host_world& w) {
  return [&w](moebius::arena_cursor c) { w.rt->place_experts(w.weights, c); };
}

model_config with_layers(int64_t layers) {
  model_config c = tiny();
  c.num_layers = layers;
  return c;
}


// The verify hook a user writes on the host runtime: every layer's experts where the cursor puts
// them, and every live K/V element the tables name (switch/checksum.hpp).
std::function<uint64_t(moebius::arena_cursor, const moebius::kv_state&)> checksum_hook(
    host_runtime& rt) {
  return [&rt](moebius::arena_cursor c, const moebius::kv_state& tables) {
    std::vector<std::span<const std::byte>> arenas, pools;
    for (const moebius::rank_memory& m : rt.memory()) {
      const moebius::memory_span& a = m.space(moebius::memory_space::arena);
      const moebius::memory_span& k = m.space(moebius::memory_space::kv_pool);
      arenas.emplace_back(a.data(), static_cast<size_t>(a.bytes));
      pools.emplace_back(k.data(), static_cast<size_t>(k.bytes));
    }
    uint64_t sum = moebius::kv_checksum(rt.kv(), tables, pools);
    for (int64_t l = 0; l < rt.arena().shape.num_layers; ++l)
      sum = sum * 1000003 + moebius::weight_checksum(rt.arena(), c, l, arenas);
    return sum;
  };
}

int64_t count(const run_result& r, switch_outcome o) {
  int64_t n = 0;
  for (const switch_record& s : r.switches) n += s.outcome == o;
  return n;
}

std::vector<int64_t> every_other_step(int64_t from, int64_t to, int64_t every) {
  std::vector<int64_t> s;
  for (int64_t i = from; i < to; i += every) s.push_back(i);
  return s;
}

}  // namespace

TEST_CASE("a verified progressive switch commits", "[cpu][faults]") {
  for (const int P : {2, 4}) {
    const int64_t L = 4;
    host_world w = make_host_world(with_layers(L), P, 96, 7);
    CAPTURE(P);
    const std::vector<request> reqs = testing::small_trace(7, static_cast<int32_t>(w.c.vocab), 12);
    const testing::paced_clock clock(1);
    engine e(*w.rt, *w.transport, w.rt->arena(), w.rt->kv(), clock, moebius::arena_cursor{0});
    engine_options o = testing::small_trace_options();
    const run_result ep = e.run(reqs, o, "static EP");

    o.how = switching::forced;
    o.style = switch_style::progressive;
    o.forced_steps = every_other_step(2, static_cast<int64_t>(ep.steps.size()), 9);
    o.verify = checksum_hook(*w.rt);
    run_result sw;
    REQUIRE_NOTHROW(sw = e.run(reqs, o, "verified progressive"));
    check_same_tokens(sw, ep);
    for (const switch_record& s : sw.switches) {
      CAPTURE(s.step, s.error);
      CHECK(s.outcome == switch_outcome::committed);
    }
    CHECK(count(sw, switch_outcome::committed) >= 4);
  }
}

TEST_CASE("a per-layer verify checks each layer as it moves and catches a corrupted one",
          "[cpu][faults]") {
  const int64_t L = 4;
  host_world w = make_host_world(with_layers(L), 2, 96, 17);
  const std::vector<request> reqs = testing::small_trace(17, static_cast<int32_t>(w.c.vocab), 12);
  const testing::paced_clock clock(1);
  engine e(*w.rt, *w.transport, w.rt->arena(), w.rt->kv(), clock, moebius::arena_cursor{0});
  engine_options o = testing::small_trace_options();
  const run_result ep = e.run(reqs, o, "static EP");
  o.how = switching::forced;
  o.style = switch_style::progressive;
  o.forced_steps = every_other_step(2, static_cast<int64_t>(ep.steps.size()), 9);
  host_runtime& rt = *w.rt;
  int64_t calls = 0;
  o.verify_layer = [&rt, &calls, L](int64_t layer, parallel_mode m, const moebius::kv_state& t) {
    ++calls;
    std::vector<std::span<const std::byte>> arenas, pools;
    for (const moebius::rank_memory& mem : rt.memory()) {
      const moebius::memory_span& a = mem.space(moebius::memory_space::arena);
      const moebius::memory_span& k = mem.space(moebius::memory_space::kv_pool);
      arenas.emplace_back(a.data(), static_cast<size_t>(a.bytes));
      pools.emplace_back(k.data(), static_cast<size_t>(k.bytes));
    }
    const moebius::arena_cursor at{m == parallel_mode::tp ? L : 0};
    return moebius::weight_checksum(rt.arena(), at, layer, arenas) * 31 +
           moebius::kv_layer_checksum(rt.kv(), t, layer, pools);
  };
  const run_result clean = e.run(reqs, o, "verified per layer");
  check_same_tokens(clean, ep);
  CHECK(count(clean, switch_outcome::committed) >= 4);
  CHECK(count(clean, switch_outcome::rolled_back) == 0);
  CHECK(calls >= 2 * L * count(clean, switch_outcome::committed));

  // Flip one written K element of the layer the first switch moves last, before it moves: that
  // layer's check fails at the advance that moved it, and the switch rolls back.
  bool corrupted = false;
  o.test_hooks.before_advance = [&](moebius::switcher&, const moebius::progressive_switch& s, int64_t) {
    if (corrupted || s.layers_remaining() != L) return;
    const moebius::switch_step_view v = s.view();
    const moebius::kv_state& t = v.tables(v.source());
    const int64_t layer = v.target() == parallel_mode::tp ? L - 1 : 0;
    for (int r = 0; r < static_cast<int>(t.ranks.size()) && !corrupted; ++r) {
      if (t.ranks[static_cast<size_t>(r)].sequences.empty()) continue;
      const moebius::kv_sequence& q = t.ranks[static_cast<size_t>(r)].sequences[0];
      const moebius::memory_span pool = rt.memory()[static_cast<size_t>(r)].space(
          moebius::memory_space::kv_pool);
      const int64_t off = rt.kv().offset(t.mode, layer, moebius::kv_tensor::k, q.pages[0], 0, 0, 0);
      pool.data()[off] ^= std::byte{0x40};
      corrupted = true;
    }
  };
  const run_result bad = e.run(reqs, o, "one layer corrupted");
  REQUIRE(corrupted);
  REQUIRE(!bad.switches.empty());
  CHECK(bad.switches[0].outcome == switch_outcome::rolled_back);
  CHECK_THAT(bad.switches[0].error, Catch::Matchers::Contains(
                                        "verify: layer " + std::to_string(L - 1) + "'s checksum"));
  CHECK(count(bad, switch_outcome::committed) >= 3);  // the later ones still commit
}

TEST_CASE("forced switches into TP with H_kv < P on a tight pool never deadlock",
          "[cpu][faults]") {
  // P=2, H_kv=1: a TP rank holds every sequence (one head, replicated), so TP holds half of what
  // EP holds; page size 1 makes every token a page. 40 pages a rank: six running sequences of up
  // to 26 tokens fit EP, not TP.
  model_config c = tiny();
  c.num_kv_heads = 1;
  c.page_size = 1;
  for (const switch_style style : {switch_style::stop_the_world, switch_style::progressive}) {
    host_world w = make_host_world(c, 2, 40, 3);
    const std::vector<request> reqs = testing::small_trace(3, static_cast<int32_t>(c.vocab), 12);
    const testing::paced_clock clock(1);
    engine e(*w.rt, *w.transport, w.rt->arena(), w.rt->kv(), clock, moebius::arena_cursor{0});
    engine_options o = testing::small_trace_options();
    const run_result ep = e.run(reqs, o, "static EP");
    o.how = switching::forced;
    o.style = style;
    o.forced_steps = every_other_step(1, static_cast<int64_t>(ep.steps.size()) + 40, 3);
    run_result sw;
    REQUIRE_NOTHROW(sw = e.run(reqs, o, "forced"));
    check_same_tokens(sw, ep);
    CHECK(count(sw, switch_outcome::refused_capacity) >= 1);
    CHECK(count(sw, switch_outcome::committed) >= 2);
    for (const switch_record& s : sw.switches) {
      if (s.outcome != switch_outcome::refused_capacity) continue;
      CHECK_THAT(s.error, Catch::Matchers::Contains("each at its largest, do not fit TP (40 pages "
                                                    "a rank, every sequence on every rank: H_kv=1 "
                                                    "< P=2): after the switch some could not grow"));
    }
  }
}

TEST_CASE("a start-mode switch that rolls back serves in the mode it is in", "[cpu][faults]") {
  host_world w = make_host_world(tiny(), 2, 96, 5);
  const std::vector<request> reqs = testing::small_trace(5, static_cast<int32_t>(w.c.vocab), 10);
  const testing::paced_clock clock;
  engine e(*w.rt, *w.transport, w.rt->arena(), w.rt->kv(), clock, moebius::arena_cursor{0});
  engine_options o = testing::small_trace_options();
  const run_result ep = e.run(reqs, o, "static EP");
  o.start_mode = parallel_mode::tp;
  w.transport->inject_fault(moebius::fault_point{0, 0});  // the first plan: the start switch
  run_result r;
  REQUIRE_NOTHROW(r = e.run(reqs, o, "start in TP, rolled back"));
  check_same_tokens(r, ep);
  CHECK(e.mode() == parallel_mode::ep);
  REQUIRE(r.switches.size() == 1);  // the start-mode switch alone (no switching)
  CHECK(r.switches[0].outcome == switch_outcome::rolled_back);
  // And the next run gets there.
  const run_result tp = e.run(reqs, o, "start in TP");
  check_same_tokens(tp, ep);
  CHECK(e.mode() == parallel_mode::tp);
}

TEST_CASE("a request with a token outside the vocab fails alone", "[cpu][faults]") {
  host_world w = make_host_world(tiny(), 2, 96, 9);
  const int32_t V = static_cast<int32_t>(w.c.vocab);
  const std::vector<request> good = testing::small_trace(9, V, 10);
  const testing::paced_clock clock;
  engine e(*w.rt, *w.transport, w.rt->arena(), w.rt->kv(), clock, moebius::arena_cursor{0});
  engine_options o = testing::small_trace_options();
  const run_result want = e.run(good, o, "good only");

  std::vector<request> mixed = good;
  request at_vocab = good[3], negative = good[5];
  at_vocab.id = 1000;
  at_vocab.prompt.back() = V;
  negative.id = 1001;
  negative.prompt.front() = -1;
  mixed.push_back(at_vocab);
  mixed.push_back(negative);
  run_result got;
  try {
    got = e.run(mixed, o, "with bad requests");
  } catch (const std::exception& ex) {
    FAIL_CHECK("the run threw: " << ex.what());
  }
  // The engine serves the next run whatever happened to this one.
  run_result again;
  REQUIRE_NOTHROW(again = e.run(good, o, "good again"));
  check_same_tokens(again, want);

  REQUIRE(got.requests.size() == mixed.size());
  for (const request_result& q : got.requests) {
    CAPTURE(q.id);
    if (q.id >= 1000) {
      CHECK_FALSE(q.finished());
      CHECK(q.generated.empty());
      CHECK(q.admissions == 0);
      CHECK(q.failed());
      CHECK_THAT(q.error, Catch::Matchers::Contains("request " + std::to_string(q.id) +
                                                    ": prompt token"));
      CHECK_THAT(q.error, Catch::Matchers::Contains("outside the vocab [0, 256)"));
    } else {
      CHECK_FALSE(q.failed());
    }
  }
  got.requests.resize(good.size());  // ids 1000, 1001 sort last
  check_same_tokens(got, want);
}

TEST_CASE("output_tokens = INT64_MAX fails alone with a clear error", "[cpu][faults]") {
  host_world w = make_host_world(tiny(), 2, 96, 11);
  const std::vector<request> good = testing::small_trace(11, static_cast<int32_t>(w.c.vocab), 8);
  const testing::paced_clock clock;
  engine e(*w.rt, *w.transport, w.rt->arena(), w.rt->kv(), clock, moebius::arena_cursor{0});
  engine_options o = testing::small_trace_options();
  const run_result want = e.run(good, o, "good only");
  std::vector<request> mixed = good;
  request huge = good[0];
  huge.id = 5000;
  huge.output_tokens = std::numeric_limits<int64_t>::max();
  mixed.push_back(huge);
  run_result got;
  try {
    got = e.run(mixed, o, "with INT64_MAX");
  } catch (const std::exception& ex) {
    FAIL_CHECK("the run threw: " << ex.what());
  }
  run_result again;
  REQUIRE_NOTHROW(again = e.run(good, o, "good again"));
  check_same_tokens(again, want);
  REQUIRE(got.requests.size() == mixed.size());
  CHECK_FALSE(got.requests.back().finished());
  CHECK_THAT(got.requests.back().error,
             Catch::Matchers::Contains("moebius overflow: request 5000: prompt"));
  CHECK_THAT(got.requests.back().error, Catch::Matchers::Contains("does not fit in 64 bits"));
  got.requests.pop_back();
  check_same_tokens(got, want);

  // Or the whole run refused, with that error, before anything is admitted.
  o.scheduler.bad_requests = bad_request_policy::refuse_run;
  try {
    e.run(mixed, o, "refused");
    FAIL("the run was not refused");
  } catch (const moebius::error& ex) {
    CHECK(ex.code() == moebius::errc::overflow);
    CHECK_THAT(ex.what(), Catch::Matchers::Contains("request 5000"));
  }
  o.scheduler.bad_requests = bad_request_policy::fail_request;
  REQUIRE_NOTHROW(again = e.run(good, o, "good after the refusal"));
  check_same_tokens(again, want);
}

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

TEST_CASE("a run that throws part-way leaves the engine empty and ready", "[cpu][faults]") {
  host_world w = make_host_world(with_layers(3), 2, 96, 13);
  const std::vector<request> reqs = testing::small_trace(13, static_cast<int32_t>(w.c.vocab), 10);
  const testing::paced_clock clock(1);
  engine e(*w.rt, *w.transport, w.rt->arena(), w.rt->kv(), clock, moebius::arena_cursor{0});
  engine_options o = testing::small_trace_options();
  const run_result want = e.run(reqs, o, "static EP");
  for (const switch_style style : {switch_style::stop_the_world, switch_style::progressive}) {
    engine_options bad = o;
    bad.how = switching::forced;
    bad.style = style;
    bad.forced_steps = every_other_step(3, 200, 5);
    bad.progress_every_steps = 1;
    // Throws in the middle of a switch (progressive) or between steps.
    bad.on_progress = [](const progress_info& p) {
      if (p.step == 21) throw std::runtime_error("user callback failed");
    };
    CHECK_THROWS_WITH(e.run(reqs, bad, "throws"), "user callback failed");
    run_result again;
    REQUIRE_NOTHROW(again = e.run(reqs, o, "again"));
    check_same_tokens(again, want);
  }
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
