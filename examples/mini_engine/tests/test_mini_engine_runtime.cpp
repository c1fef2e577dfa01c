// The host runtime against the float64 reference, in EP and in TP over P in {1, 2, 4}, and
// EP against TP, for random small models.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <sstream>
#include <vector>

#include "catch.hpp"
#include "driver.hpp"
#include "host_runtime.hpp"
#include "kv_pages.hpp"
#include "model_config.hpp"
#include "random_model.hpp"
#include "reference.hpp"
#include "weights.hpp"

using namespace mini_engine;
using mini_engine::testing::drive;
using mini_engine::testing::pick;
using mini_engine::testing::random_config;
using mini_engine::testing::static_state;
using moebius::dtype;
using moebius::parallel_mode;

namespace {

double max_abs(const std::vector<double>& v) {
  double m = 0;
  for (double x : v) m = std::max(m, std::fabs(x));
  return m;
}

}  // namespace

TEST_CASE("host runtime matches the float64 reference in EP and TP", "[runtime]") {
  struct variant {
    dtype experts, kv;
    double tolerance;  // relative to the logits' scale
  };
  // Experts are rounded in the weights the reference reads, so every variant is compared at
  // float accuracy; bf16 KV is rounded by both, from a float and from a double.
  const variant variants[] = {{dtype::fp32, dtype::fp32, 1e-4},
                              {dtype::bf16, dtype::fp32, 1e-4},
                              {dtype::fp8_e4m3, dtype::fp32, 1e-4},
                              {dtype::fp32, dtype::bf16, 2e-2}};
  std::mt19937_64 rng(20240611);
  for (const variant& var : variants)
    for (int P : {1, 2, 4})
      for (int trial = 0; trial < 2; ++trial) {
        const model_config c = random_config(rng, P, var.experts, var.kv);
        const model_weights w = make_weights(c, rng());
        const auto prompts = mini_engine::testing::random_prompts(rng, 3, 9, c.vocab);
        const int64_t chunk = pick(rng, {1, 3, 16});
        for (parallel_mode mode : {parallel_mode::ep, parallel_mode::tp}) {
          std::ostringstream what;
          what << c << " P=" << P << " " << moebius::to_string(mode) << " chunk " << chunk;
          INFO(what.str());
          host_runtime_options o;
          o.num_ranks = P;
          o.num_ep_pages = 32;
          o.cursor = moebius::arena_cursor{mode == parallel_mode::tp ? c.num_layers : 0};
          host_runtime rt(w, o);
          static_state st(rt, mode);
          const auto runs = drive(rt, st.driver, prompts, chunk, 3);
          for (size_t i = 0; i < runs.size(); ++i) {
            REQUIRE(runs[i].generated.size() == 4);
            for (size_t s = 0; s < runs[i].generated.size(); ++s) {
              const size_t len = prompts[i].size() + s;  // tokens seen by that sample
              const auto ref =
                  reference_logits(w, std::span<const int32_t>(runs[i].tokens).first(len)).back();
              const double scale = std::max(1.0, max_abs(ref));
              const auto& got = runs[i].logits[s];
              REQUIRE(got.size() == ref.size());
              double err = 0;
              for (size_t v = 0; v < ref.size(); ++v)
                err = std::max(err, std::fabs(static_cast<double>(got[v]) - ref[v]));
              INFO("sequence " << i << " sample " << s << " max error " << err << " scale "
                               << scale);
              CHECK(err <= var.tolerance * scale);
            }
          }
        }
      }
}

TEST_CASE("EP and TP logits agree, also with a hybrid cursor", "[runtime]") {
  std::mt19937_64 rng(77);
  for (int P : {2, 4})
    for (int trial = 0; trial < 3; ++trial) {
      const model_config c = random_config(rng, P, dtype::fp32, dtype::fp32);
      const model_weights w = make_weights(c, rng());
      const auto prompts = mini_engine::testing::random_prompts(rng, 4, 7, c.vocab);
      std::vector<std::vector<mini_engine::testing::sequence_run>> results;
      // EP, TP, and hybrids: the experts half TP, half EP under TP and under EP attention.
      const std::pair<int64_t, parallel_mode> layouts[] = {
          {0, parallel_mode::ep},
          {c.num_layers, parallel_mode::tp},
          {c.num_layers / 2, parallel_mode::tp},
          {(c.num_layers + 1) / 2, parallel_mode::ep}};
      for (const auto& [cursor, mode] : layouts) {
        host_runtime_options o;
        o.num_ranks = P;
        o.cursor = moebius::arena_cursor{cursor};
        host_runtime rt(w, o);
        static_state st(rt, mode);
        st.cursor = moebius::arena_cursor{cursor};
        results.push_back(drive(rt, st.driver, prompts, 4, 4));
      }
      INFO(c << " P=" << P);
      for (size_t m = 1; m < results.size(); ++m)
        for (size_t i = 0; i < prompts.size(); ++i) {
          CHECK(results[m][i].generated == results[0][i].generated);
          for (size_t s = 0; s < results[0][i].logits.size(); ++s)
            for (size_t v = 0; v < results[0][i].logits[s].size(); ++v)
              REQUIRE(std::fabs(results[m][i].logits[s][v] - results[0][i].logits[s][v]) <=
                      1e-5f * std::max(1.0f, std::fabs(results[0][i].logits[s][v])));
        }
    }
}

TEST_CASE("a refused step throws and writes nothing", "[runtime]") {
  const model_weights w = make_weights(tiny(), 3);
  host_runtime_options o;
  o.num_ranks = 2;
  o.num_ep_pages = 8;
  host_runtime rt(w, o);
  for (parallel_mode mode : {parallel_mode::ep, parallel_mode::tp}) {
    static_state st(rt, mode);
    reserve_tokens(rt.kv(), st.tables, 1, 3, 1);
    const std::vector<int32_t> four = {1, 2, 3, 4}, bad = {1, 9999};
    auto snapshot = [&] {
      std::vector<std::vector<std::byte>> bytes;
      for (const auto& m : rt.memory())
        for (const auto& sp : m.spaces) bytes.emplace_back(sp.data(), sp.data() + sp.bytes);
      return bytes;
    };
    const auto before = snapshot();
    auto refused = [&](step_item it) {
      try {
        rt.step(step_layout{&st.tables, st.cursor}, std::span<const step_item>(&it, 1));
      } catch (const moebius::error& e) {
        return e.code() == moebius::errc::invalid_argument;
      }
      return false;
    };
    CHECK(refused(step_item{.seq_id = 1, .tokens = four, .start_position = 0, .sample = true}));
    CHECK(refused(step_item{.seq_id = 2, .tokens = std::span(four).first(1), .sample = true}));
    CHECK(refused(step_item{.seq_id = 1, .tokens = bad, .sample = true}));
    CHECK(refused(step_item{.seq_id = 1, .tokens = {}, .sample = true}));
    CHECK(snapshot() == before);
    // The same tables with room: accepted.
    CHECK(rt.step(step_layout{&st.tables, st.cursor},
                  std::vector<step_item>{
                      {.seq_id = 1, .tokens = std::span(four).first(3), .sample = true}})[0] >= 0);
  }
}
