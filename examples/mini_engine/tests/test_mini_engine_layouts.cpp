// Attention and experts laid out independently, served: every static layout (attention EP or
// TP, experts EP or TP) gives the same greedy tokens and logits, and a run that switches its
// experts alone while it serves (progressive: hybrid steps with layers of both expert layouts
// under one attention layout; or stop the world) gives the static run's tokens and logits,
// bit for bit, with no KV round.

#include <cstdint>
#include <cstring>
#include <optional>
#include <moebius/switch/switcher.hpp>
#include <moebius/transport/host_transport.hpp>
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
using mini_engine::testing::pick;
using mini_engine::testing::random_config;
using moebius::dtype;
using moebius::parallel_layout;
using moebius::parallel_mode;

namespace {

struct run_result {
  std::vector<std::vector<int32_t>> tokens;             // per sequence, generated
  std::vector<std::vector<std::vector<float>>> logits;  // per sequence, per generated token
};

// Serves `prompts` (each prefilled whole in the first step, then `decode` decode steps) with
// every sequence's pages reserved up front, so that the tables never change while serving
// (a progressive switch freezes them). `layout_of_step(s)` gives the step layout of step s
// (called once per step, before it).
template <class LayoutOfStep>
run_result serve(host_runtime& rt, moebius::kv_state& tables,
                 const std::vector<std::vector<int32_t>>& prompts, int64_t decode,
                 LayoutOfStep&& layout_of_step) {
  const int P = rt.num_ranks();
  std::vector<std::vector<int32_t>> seq = prompts;
  for (size_t i = 0; i < prompts.size(); ++i)
    reserve_tokens(rt.kv(), tables, static_cast<int64_t>(100 + i),
                   static_cast<int64_t>(prompts[i].size()) + decode, static_cast<int>(i % P));
  run_result out;
  out.tokens.resize(prompts.size());
  out.logits.resize(prompts.size());
  std::vector<int64_t> done(prompts.size(), 0);
  for (int64_t s = 0; s <= decode; ++s) {
    std::vector<step_item> items;
    for (size_t i = 0; i < seq.size(); ++i) {
      step_item it;
      it.seq_id = static_cast<int64_t>(100 + i);
      it.start_position = done[i];
      it.tokens = std::span<const int32_t>(seq[i]).subspan(static_cast<size_t>(done[i]));
      it.sample = true;
      items.push_back(it);
    }
    std::vector<std::vector<float>> logits;
    const std::vector<int32_t> next = rt.step(layout_of_step(s), items, &logits);
    for (size_t i = 0; i < seq.size(); ++i) {
      done[i] = static_cast<int64_t>(seq[i].size());
      seq[i].push_back(next[i]);
      out.tokens[i].push_back(next[i]);
      out.logits[i].push_back(logits[i]);
    }
  }
  return out;
}

bool same_bits(const run_result& a, const run_result& b) {
  if (a.tokens != b.tokens) return false;
  for (size_t i = 0; i < a.logits.size(); ++i)
    for (size_t t = 0; t < a.logits[i].size(); ++t)
      if (std::memcmp(a.logits[i][t].data(), b.logits[i][t].data(),
                      a.logits[i][t].size() * sizeof(float)) != 0)
        return false;
  return true;
}

moebius::arena_cursor resting(const model_config& c, parallel_mode experts) {
  return moebius::arena_cursor{experts == parallel_mode::tp ? c.num_layers : 0};
}

}  // namespace

TEST_CASE("every static layout serves the same tokens; switching the experts alone keeps them",
          "[layouts]") {
  std::mt19937_64 rng(4040);
  const dtype expert_types[] = {dtype::fp32, dtype::bf16, dtype::fp8_e4m3};
  int64_t hybrid_steps = 0;
  for (int P : {1, 2, 4})
    for (dtype experts : expert_types) {
      const model_config c =
          random_config(rng, P, experts, (rng() & 1) ? dtype::fp32 : dtype::bf16);
      const model_weights w = make_weights(c, rng());
      const auto prompts = mini_engine::testing::random_prompts(rng, 4, 9, c.vocab);
      const int64_t decode = 6;
      std::ostringstream what;
      what << c << " P=" << P;
      INFO(what.str());
      host_runtime_options o;
      o.num_ranks = P;
      o.num_ep_pages = 64;

      // The four static layouts.
      std::vector<run_result> statics;
      for (parallel_mode attention : {parallel_mode::ep, parallel_mode::tp})
        for (parallel_mode ex : {parallel_mode::ep, parallel_mode::tp}) {
          o.cursor = resting(c, ex);
          host_runtime rt(w, o);
          moebius::kv_state tables = make_empty_kv_state(rt.kv(), attention);
          statics.push_back(serve(rt, tables, prompts, decode, [&](int64_t) {
            return step_layout{&tables, o.cursor};
          }));
          INFO("layout " << moebius::to_string(parallel_layout{attention, ex}));
          CHECK(same_bits(statics.back(), statics.front()));
        }

      // Under each attention layout: the experts switch EP -> TP progressively, a random
      // number of layers per step, then back stop-the-world.
      for (parallel_mode attention : {parallel_mode::ep, parallel_mode::tp}) {
        o.cursor = resting(c, parallel_mode::ep);
        host_runtime rt(w, o);
        moebius::host_transport transport(rt.memory());
        moebius::switcher sw(rt.arena(), rt.kv(), transport,
                             make_empty_kv_state(rt.kv(), attention), o.cursor);
        std::optional<moebius::progressive_switch> session;
        const int64_t begin_at = pick(rng, {0, 1, 2});
        const int64_t back_at = decode;  // the last step runs after the switch back
        auto layout_of_step = [&](int64_t s) -> step_layout {
          if (s == begin_at) {
            session.emplace(sw.begin(parallel_layout{attention, parallel_mode::tp}));
            REQUIRE(session->open());
          }
          if (session && session->open()) {
            if (session->layers_remaining() > 0) {
              session->advance(pick(rng, {1, 2}));
              session->wait();
            } else {
              const moebius::switch_report r = session->finish();
              INFO(r);
              REQUIRE(r.outcome == moebius::switch_outcome::committed);
              CHECK(r.kv_rounds == 0);
              for (const int64_t b : r.kv_bytes_sent) CHECK(b == 0);
            }
          }
          if (s == back_at) {
            const moebius::switch_report r = sw.switch_to(parallel_layout{attention, parallel_mode::ep});
            INFO(r);
            REQUIRE(r.outcome == moebius::switch_outcome::committed);
          }
          if (session && session->open()) {
            const step_layout l = step_layout::during(session->view());
            CHECK_FALSE(l.hybrid());  // the KV does not move: one set of tables
            if (l.cursor.tp_layers > 0 && l.cursor.tp_layers < c.num_layers) ++hybrid_steps;
            return l;
          }
          return step_layout{&sw.kv_tables(), sw.cursor()};
        };
        // The tables the steps write through are the switcher's (reserved before serving).
        moebius::kv_state& live = sw.mutable_kv_tables();
        run_result got = serve(rt, live, prompts, decode, layout_of_step);
        CHECK(same_bits(got, statics.front()));
        CHECK(sw.layout() == parallel_layout{attention, parallel_mode::ep});
      }
    }
  CHECK(hybrid_steps > 0);  // steps ran with layers of both expert layouts
}
