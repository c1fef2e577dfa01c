// The proof that a switch is correct (DESIGN.md §7): serving runs that switch the experts
// and the KV cache between EP and TP through moebius::switcher at random steps produce the
// same greedy tokens and the same logits, bit for bit, as runs that never switch. With a
// KV-parallel TP view (dcp > 1) the TP steps merge partial attentions, which reorders sums
// in double (host_runtime.hpp): the switched run gives the static runs' tokens (up to a near
// tie) and their logits within 1e-5, bits not promised.

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <moebius/switch/progressive.hpp>
#include <moebius/switch/switcher.hpp>
#include <moebius/transport/host_transport.hpp>
#include <optional>
#include <random>
#include <sstream>
#include <vector>

#include "catch.hpp"
#include "driver.hpp"
#include "host_runtime.hpp"
#include "kv_pages.hpp"
#include "model_config.hpp"
#include "random_model.hpp"
#include "weights.hpp"

using namespace mini_engine;
using mini_engine::testing::drive;
using mini_engine::testing::pick;
using mini_engine::testing::random_config;
using mini_engine::testing::driver_state;
using mini_engine::testing::static_state;
using moebius::dtype;
using moebius::parallel_mode;

namespace {

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// The static runs of `prompts` in EP (cursor 0, EP tables) and in TP (cursor L, TP tables over
// options.dcp), in that order.
std::vector<std::vector<mini_engine::testing::sequence_run>> static_ep_and_tp_runs(
    const model_weights& w, host_runtime_options o, const std::vector<std::vector<int32_t>>& prompts,
    int64_t chunk, int64_t decode) {
  std::vector<std::vector<mini_engine::testing::sequence_run>> runs;
  for (parallel_mode m : {parallel_mode::ep, parallel_mode::tp}) {
    o.cursor = moebius::arena_cursor{m == parallel_mode::tp ? w.config.num_layers : 0};
    host_runtime rt(w, o);
    static_state st(rt, m);
    runs.push_back(drive(rt, st.driver, prompts, chunk, decode));
  }
  return runs;
}

}  // namespace

TEST_CASE("switching at random steps gives the tokens and logits of a static run", "[switch]") {
  std::mt19937_64 rng(4242);
  const dtype expert_types[] = {dtype::fp32, dtype::bf16, dtype::fp8_e4m3};
  int64_t switches = 0;
  for (int P : {1, 2, 4})
    for (dtype experts : expert_types)
      for (parallel_mode start : {parallel_mode::ep, parallel_mode::tp}) {
        const dtype kv = (rng() & 1) ? dtype::fp32 : dtype::bf16;
        const model_config c = random_config(rng, P, experts, kv);
        const model_weights w = make_weights(c, rng());
        const auto prompts = mini_engine::testing::random_prompts(rng, 5, 12, c.vocab);
        const int64_t chunk = pick(rng, {2, 5, 64});
        const int64_t decode = 8;
        const moebius::arena_cursor start_cursor{start == parallel_mode::tp ? c.num_layers : 0};
        std::ostringstream what;
        what << c << " P=" << P << " from " << moebius::to_string(start) << " chunk " << chunk;
        INFO(what.str());

        host_runtime_options o;
        o.num_ranks = P;
        o.num_ep_pages = 96;
        o.cursor = start_cursor;

        // The static run, and a second static run in the other mode.
        host_runtime static_rt(w, o);
        static_state st(static_rt, start);
        const auto expected = drive(static_rt, st.driver, prompts, chunk, decode);

        // The switched run: tables and cursor belong to the switcher.
        host_runtime rt(w, o);
        moebius::host_transport transport(rt.memory());
        moebius::switcher sw(rt.arena(), rt.kv(), transport, make_empty_kv_state(rt.kv(), start),
                             start_cursor);
        driver_state ds;
        ds.tables = [&]() -> moebius::kv_state& { return sw.mutable_kv_tables(); };
        ds.cursor = [&] { return sw.cursor(); };
        std::vector<int64_t> switched_at;
        ds.before_step = [&](int64_t step) {
          if (step == 0 || (rng() % 3) != 0) return;
          const parallel_mode to =
              sw.mode() == parallel_mode::ep ? parallel_mode::tp : parallel_mode::ep;
          const moebius::switch_report r = sw.switch_to(to);
          INFO(r);
          REQUIRE(r.outcome == moebius::switch_outcome::committed);
          REQUIRE(sw.cursor().tp_layers == (to == parallel_mode::tp ? c.num_layers : 0));
          switched_at.push_back(step);
        };
        const auto got = drive(rt, ds, prompts, chunk, decode);
        switches += static_cast<int64_t>(switched_at.size());
        INFO("switched before steps " << ::Catch::Detail::stringify(switched_at));
        for (size_t i = 0; i < prompts.size(); ++i) {
          REQUIRE(got[i].generated == expected[i].generated);
          for (size_t s = 0; s < got[i].logits.size(); ++s)
            REQUIRE(same_bits(got[i].logits[s], expected[i].logits[s]));
        }
      }
  CHECK(switches > 20);  // the runs did switch, many times
}

TEST_CASE("a switch at every step, both directions, matches both static runs", "[switch]") {
  std::mt19937_64 rng(99);
  const int P = 2;
  const model_config c = random_config(rng, P, dtype::fp32, dtype::fp32);
  const model_weights w = make_weights(c, 5);
  const auto prompts = mini_engine::testing::random_prompts(rng, 3, 10, c.vocab);
  host_runtime_options o;
  o.num_ranks = P;
  o.num_ep_pages = 96;

  std::vector<std::vector<mini_engine::testing::sequence_run>> statics;
  for (parallel_mode m : {parallel_mode::ep, parallel_mode::tp}) {
    o.cursor = moebius::arena_cursor{m == parallel_mode::tp ? c.num_layers : 0};
    host_runtime rt(w, o);
    static_state st(rt, m);
    statics.push_back(drive(rt, st.driver, prompts, 3, 6));
  }
  o.cursor = moebius::arena_cursor{0};
  host_runtime rt(w, o);
  moebius::host_transport transport(rt.memory());
  moebius::switcher sw(rt.arena(), rt.kv(), transport,
                       make_empty_kv_state(rt.kv(), parallel_mode::ep), o.cursor);
  driver_state ds;
  ds.tables = [&]() -> moebius::kv_state& { return sw.mutable_kv_tables(); };
  ds.cursor = [&] { return sw.cursor(); };
  ds.before_step = [&](int64_t step) {
    if (step == 0) return;
    const auto r =
        sw.switch_to(sw.mode() == parallel_mode::ep ? parallel_mode::tp : parallel_mode::ep);
    REQUIRE(r.outcome == moebius::switch_outcome::committed);
  };
  const auto got = drive(rt, ds, prompts, 3, 6);
  for (size_t i = 0; i < prompts.size(); ++i) {
    CHECK(got[i].generated == statics[0][i].generated);
    CHECK(got[i].generated == statics[1][i].generated);
  }
}

TEST_CASE("EP -> TP(dcp) and back mid-generation gives the static runs' tokens", "[switch][dcp]") {
  std::mt19937_64 rng(5150);
  const dtype expert_types[] = {dtype::fp32, dtype::bf16, dtype::fp8_e4m3};
  int64_t switches = 0, runs = 0, near_ties = 0, differing = 0;
  double worst = 0;
  for (int P : {2, 4, 8})
    for (dtype experts : expert_types) {
      const dtype kv = (rng() & 1) ? dtype::fp32 : dtype::bf16;
      model_config c;
      do c = random_config(rng, P, experts, kv);
      while (c.num_kv_heads >= P);  // some dcp > 1 is allowed
      std::vector<int64_t> allowed;
      for (int64_t d = 2; d <= P / c.num_kv_heads; ++d)
        if ((P / c.num_kv_heads) % d == 0) allowed.push_back(d);
      const int64_t dcp =
          allowed[std::uniform_int_distribution<size_t>(0, allowed.size() - 1)(rng)];
      const model_weights w = make_weights(c, rng());
      const auto prompts = mini_engine::testing::random_prompts(rng, 5, 12, c.vocab);
      const int64_t chunk = pick(rng, {2, 5, 64});
      const int64_t decode = 8;
      std::ostringstream what;
      what << c << " P=" << P << " dcp " << dcp << " chunk " << chunk;
      INFO(what.str());

      host_runtime_options o;
      o.num_ranks = P;
      o.num_ep_pages = 96;
      o.dcp = dcp;
      // The static runs: EP (cursor 0) and TP(dcp) (cursor L).
      const auto statics = static_ep_and_tp_runs(w, o, prompts, chunk, decode);

      // Switched from EP: to TP(dcp) at a random step of the prefill or decode, back to EP at a
      // later one, and maybe again.
      int64_t steps = decode;
      for (const auto& p : prompts)
        steps = std::max(steps, decode + (static_cast<int64_t>(p.size()) + chunk - 1) / chunk);
      std::vector<int64_t> at;
      for (int64_t s = 1; s < steps; ++s)
        if (rng() % 3 == 0) at.push_back(s);
      if (at.size() < 2) at = {1, steps - 1};
      o.cursor = moebius::arena_cursor{0};
      host_runtime rt(w, o);
      mini_engine::testing::poison_kv(rt);
      moebius::host_transport transport(rt.memory());
      moebius::switcher sw(rt.arena(), rt.kv(), transport,
                           make_empty_kv_state(rt.kv(), parallel_mode::ep), o.cursor);
      driver_state ds;
      ds.tables = [&]() -> moebius::kv_state& { return sw.mutable_kv_tables(); };
      ds.cursor = [&] { return sw.cursor(); };
      int64_t here = 0;
      ds.before_step = [&](int64_t step) {
        if (std::find(at.begin(), at.end(), step) == at.end()) return;
        const parallel_mode to =
            sw.mode() == parallel_mode::ep ? parallel_mode::tp : parallel_mode::ep;
        const moebius::switch_report r = sw.switch_to(to);
        INFO(r);
        REQUIRE(r.outcome == moebius::switch_outcome::committed);
        REQUIRE(sw.cursor().tp_layers == (to == parallel_mode::tp ? c.num_layers : 0));
        REQUIRE_NOTHROW(moebius::validate(rt.kv(), sw.kv_tables()));  // the DCP shares
        ++here;
      };
      const auto got = drive(rt, ds, prompts, chunk, decode);
      INFO("switched before steps " << ::Catch::Detail::stringify(at));
      CHECK(here == static_cast<int64_t>(at.size()));
      switches += here;
      ++runs;
      for (const auto& expected : statics) {
        const auto a = mini_engine::testing::runs_agree(expected, got, 1e-5);
        INFO(a.why);
        REQUIRE(a.ok);
        near_ties += a.near_ties;
        differing += a.differing;
        worst = std::max(worst, a.max_rel);
      }
    }
  std::printf(
      "switch EP <-> TP(dcp): %lld runs, %lld switches, %lld near ties, largest logit "
      "difference from the static runs %.3g, %lld logits differ in bits\n",
      static_cast<long long>(runs), static_cast<long long>(switches),
      static_cast<long long>(near_ties), worst, static_cast<long long>(differing));
  CHECK(switches >= 2 * runs);
}

TEST_CASE(
    "a progressive EP -> TP(dcp) switch and back, layers moving between steps, gives the "
    "static runs' tokens",
    "[switch][dcp][progressive]") {
  // While the session is open each step is hybrid (step.hpp): layers below the cursor attend
  // over the TP(dcp) tables and run TP experts, the rest EP, with the activation hand-off
  // between. The tables are frozen meanwhile, so every sequence's final length is reserved
  // before the run.
  std::mt19937_64 rng(8080);
  int64_t sessions = 0, hybrid_steps = 0, runs = 0, near_ties = 0;
  for (int P : {2, 4, 8})
    for (int trial = 0; trial < 2; ++trial) {
      const dtype kv = (rng() & 1) ? dtype::fp32 : dtype::bf16;
      model_config c;
      do c = random_config(rng, P, trial == 0 ? dtype::fp32 : dtype::fp8_e4m3, kv);
      while (c.num_kv_heads >= P || c.num_layers < 2);  // dcp > 1, and a hybrid in between
      const int64_t dcp = P / c.num_kv_heads;           // the largest allowed
      const model_weights w = make_weights(c, rng());
      const auto prompts = mini_engine::testing::random_prompts(rng, 4, 12, c.vocab);
      const int64_t chunk = pick(rng, {2, 5});
      const int64_t decode = 10;
      const int64_t per_advance = std::uniform_int_distribution<int64_t>(1, c.num_layers - 1)(rng);
      std::ostringstream what;
      what << c << " P=" << P << " dcp " << dcp << " chunk " << chunk << ", " << per_advance
           << " layers per advance";
      INFO(what.str());

      host_runtime_options o;
      o.num_ranks = P;
      o.num_ep_pages = 96;
      o.dcp = dcp;
      const auto statics = static_ep_and_tp_runs(w, o, prompts, chunk, decode);

      o.cursor = moebius::arena_cursor{0};
      host_runtime rt(w, o);
      mini_engine::testing::poison_kv(rt);
      moebius::host_transport transport(rt.memory());
      moebius::switcher sw(rt.arena(), rt.kv(), transport,
                           make_empty_kv_state(rt.kv(), parallel_mode::ep), o.cursor);
      for (size_t i = 0; i < prompts.size(); ++i)  // every token the run will feed
        reserve_tokens(rt.kv(), sw.mutable_kv_tables(), static_cast<int64_t>(100 + i),
                       static_cast<int64_t>(prompts[i].size()) + decode, static_cast<int>(i % P));
      std::optional<moebius::progressive_switch> session;
      int64_t begun = 0;
      driver_state ds;
      ds.reserve = false;
      ds.tables = [&]() -> moebius::kv_state& { return sw.mutable_kv_tables(); };
      ds.cursor = [&] { return sw.cursor(); };
      ds.layout = [&] {
        return session ? step_layout::during(session->view())
                       : step_layout{&sw.kv_tables(), sw.cursor()};
      };
      // To TP from step 1, back to EP once there: each session moves per_advance layers before
      // each step, then commits before the step after its last layer.
      ds.before_step = [&](int64_t step) {
        if (session && session->layers_remaining() == 0) {
          const moebius::switch_report r = session->finish();
          INFO(r);
          REQUIRE(r.outcome == moebius::switch_outcome::committed);
          REQUIRE_NOTHROW(moebius::validate(rt.kv(), sw.kv_tables()));
          session.reset();
        }
        if (!session && step >= 1 && begun < 2) {
          ++begun;
          session.emplace(
              sw.begin(sw.mode() == parallel_mode::ep ? parallel_mode::tp : parallel_mode::ep));
          REQUIRE(session->open());
          ++sessions;
        }
        if (session) {
          session->advance(per_advance);
          REQUIRE(session->wait() == moebius::progress_state::ready);
          const int64_t cur = session->view().cursor().tp_layers;
          hybrid_steps += cur > 0 && cur < c.num_layers;
        }
      };
      const auto got = drive(rt, ds, prompts, chunk, decode);
      CHECK(begun == 2);
      CHECK(!session);  // both committed
      ++runs;
      for (const auto& expected : statics) {
        const auto a = mini_engine::testing::runs_agree(expected, got, 1e-5);
        INFO(a.why);
        REQUIRE(a.ok);
        near_ties += a.near_ties;
      }
    }
  std::printf(
      "progressive EP <-> TP(dcp): %lld runs, %lld sessions, %lld hybrid steps, %lld near "
      "ties\n",
      static_cast<long long>(runs), static_cast<long long>(sessions),
      static_cast<long long>(hybrid_steps), static_cast<long long>(near_ties));
  CHECK(sessions >= 2 * runs);
  CHECK(hybrid_steps >= runs);
}
