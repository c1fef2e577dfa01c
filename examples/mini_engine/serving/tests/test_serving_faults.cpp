// The serving loop under faults, tight pools and bad requests (issue 22). Each case is one way
// a new user broke the loop through its public headers; each ran to an exception before its fix:
//   1. a progressive switch with a real verify hook (checksums of the experts and the KV) commits,
//      and a corrupted layer is still caught (rolled back);
//   2. forced switches into TP with H_kv < P on a tight pool (page size 1) never deadlock: the
//      switches that would leave running sequences unable to grow are refused;
//   3. a start-mode switch that rolls back leaves the run serving in the mode it is in;
//   4. a request with a token id outside the vocab fails alone, and the engine serves on;
//   5. output_tokens = INT64_MAX fails alone with a moebius::error's message naming it;
// and a run that throws part-way (a user callback) leaves the engine empty and ready.
// Inconsistent switches recovered in the run: test_serving_faults_recovery.cpp; what the two
// share: fault_fixture.hpp.
// Every served request is compared token for token with a static run of the good requests.
#include <cstdint>
#include <functional>
#include <limits>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include <moebius/error.hpp>
#include <moebius/switch/checksum.hpp>
#include <moebius/transport/host_transport.hpp>

#include "catch.hpp"
#include "engine.hpp"
#include "fault_fixture.hpp"
#include "host_runtime.hpp"
#include "model_config.hpp"
#include "paced_clock.hpp"
#include "same_tokens.hpp"
#include "small_trace.hpp"

using namespace mini_engine;
using moebius::parallel_mode;
using moebius::switch_outcome;
using testing::check_same_tokens;
using testing::count;
using testing::checksum_hook;
using testing::every_other_step;
using testing::host_world;
using testing::make_host_world;
using testing::with_layers;

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
