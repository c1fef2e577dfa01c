// Against Hugging Face transformers: every checkpoint under tests/fixtures/hf/ was written by
// transformers' own save_pretrained (make_hf_fixtures.py: fp32 and bf16, top-k renormalised
// or not, one file or shards with an index, tied embeddings) beside transformers' greedy
// tokens and logits. Each loads from its directory (config.json as transformers wrote it)
// straight into the host runtime, which must give transformers' logits at every position
// (teacher-forced: the runtime is fed transformers' tokens one per step) and its greedy
// tokens (a free-running greedy decode), at P = 1, 2, 4, in EP and TP, and through a switch
// at every step. A second case runs every other static layout (TP attention with EP experts,
// EP attention with TP experts, and TP attention over each KV-parallel degree the model allows
// at P = 2, 4, 8, with either experts, and switching EP <-> TP(dcp) before every step) to the
// same tolerance: the LSE merge of dcp > 1 reorders the softmax's sums in double
// (host_runtime.hpp), ~1e-16 relative, far inside it.
//
// Tolerance: |ours - theirs| <= 1e-4 * max(1, |theirs|) on every logit. transformers computes
// in fp32 (each dot product of H <= 64 terms rounds ~sqrt(H) * 2^-24 ~ 5e-7 relative, and
// the errors compound through softmax attention, the router, L <= 3 layers and the LM head);
// the runtime accumulates in double and rounds to float at fixed points. Measured: max
// difference ~1e-5 on these fixtures (printed below), so 1e-4 leaves 10x room and still
// fails on any real mistake: a wrong norm_topk_prob moves logits by ~1e-1, a wrong RoPE theta
// or eps by >1e-3, one expert row misplaced by ~1e-2. Greedy tokens must be equal: the
// fixtures keep only prompts whose every top-2 gap is >= 2e-3, 20x the tolerance.

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <moebius/switch/switcher.hpp>
#include <moebius/transport/host_transport.hpp>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "catch.hpp"
#include "checkpoint.hpp"
#include "driver.hpp"
#include "hf_fixtures.hpp"
#include "host_runtime.hpp"
#include "kv_pages.hpp"
#include "layouts.hpp"
#include "safetensors.hpp"

using namespace mini_engine;
using mini_engine::testing::driver_state;
using moebius::parallel_mode;

namespace {

struct fixture {
  std::string dir;
  std::vector<int32_t> prompt, generated;
  std::vector<float> logits;  // [T, V] at every position of prompt + generated
};

std::vector<fixture> fixtures() {
  std::vector<fixture> out;
  const std::filesystem::path root = mini_engine::testing::hf_fixtures_root();
  if (!std::filesystem::is_directory(root)) return out;
  for (const auto& d : std::filesystem::directory_iterator(root)) {
    if (!std::filesystem::exists(d.path() / "expected.json")) continue;
    fixture f;
    f.dir = d.path().string();
    std::ifstream in(d.path() / "expected.json");
    const nlohmann::json j = nlohmann::json::parse(in);
    f.prompt = j.at("prompt").get<std::vector<int32_t>>();
    f.generated = j.at("generated").get<std::vector<int32_t>>();
    const safetensors_file lf((d.path() / "logits.safetensors").string());
    f.logits = lf.read("logits", lf.find("logits")->shape);
    out.push_back(std::move(f));
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.dir < b.dir; });
  return out;
}

// Feeds `tokens` one per step (every step samples), so the runtime's logits at position p
// are the ones after tokens [0, p]. `before_step` may switch.
std::vector<std::vector<float>> forced_logits(host_runtime& rt, driver_state& st,
                                              const std::vector<int32_t>& tokens) {
  std::vector<std::vector<float>> out;
  for (size_t p = 0; p < tokens.size(); ++p) {
    st.before_step(static_cast<int64_t>(p));
    reserve_tokens(rt.kv(), st.tables(), 7, static_cast<int64_t>(p) + 1, rt.num_ranks() - 1);
    step_item it;
    it.seq_id = 7;
    it.tokens = std::span<const int32_t>(tokens).subspan(p, 1);
    it.start_position = static_cast<int64_t>(p);
    it.sample = true;
    std::vector<std::vector<float>> logits;
    const moebius::kv_state& tables = st.tables();
    rt.step(step_layout{&tables, st.cursor()}, std::span<const step_item>(&it, 1), &logits);
    out.push_back(std::move(logits.at(0)));
  }
  return out;
}

// Every logit of `ours` ([positions][V]) within 1e-4 relative (to max(1, |theirs|)) of the
// fixture's; REQUIREs it (a NaN fails too) and returns the worst relative difference.
double compare_to_fixture(const std::vector<std::vector<float>>& ours, const fixture& f,
                          size_t positions, int64_t V) {
  double worst = 0;
  for (size_t p = 0; p < positions; ++p)
    for (int64_t v = 0; v < V; ++v) {
      const double theirs = f.logits[p * static_cast<size_t>(V) + static_cast<size_t>(v)];
      const double d = std::fabs(ours[p][static_cast<size_t>(v)] - theirs);
      worst = std::max(worst, d / std::max(1.0, std::fabs(theirs)));
      if (!(d <= 1e-4 * std::max(1.0, std::fabs(theirs)))) {  // NaN fails too
        INFO("position " << p << " token " << v << ": ours " << ours[p][static_cast<size_t>(v)]
                         << ", transformers " << theirs);
        REQUIRE(d <= 1e-4 * std::max(1.0, std::fabs(theirs)));
      }
    }
  return worst;
}

}  // namespace

TEST_CASE("checkpoints transformers wrote: the host runtime gives transformers' logits",
          "[hf]") {
  const auto all = fixtures();
  REQUIRE(all.size() >= 5);  // the committed fixtures (make_hf_fixtures.py)
  double worst = 0;
  for (const fixture& f : all) {
    const hf_checkpoint ck(f.dir);
    const model_config m = ck.config().model;
    std::vector<int32_t> tokens = f.prompt;
    tokens.insert(tokens.end(), f.generated.begin(), f.generated.end());
    const int64_t V = m.vocab;
    REQUIRE(static_cast<int64_t>(f.logits.size()) == static_cast<int64_t>(tokens.size()) * V);
    for (int P : {1, 2, 4}) {
      for (int how = 0; how < 3; ++how) {  // static EP, static TP, a switch before every step
        INFO(f.dir << " P=" << P << (how == 0 ? " EP" : how == 1 ? " TP" : " switching"));
        host_runtime_options o;
        o.num_ranks = P;
        o.num_ep_pages = 16;
        o.cursor = moebius::arena_cursor{how == 1 ? m.num_layers : 0};
        host_runtime rt(m, o, [&](weight_sink& s) { ck.load(m, s); });
        const parallel_mode start = how == 1 ? parallel_mode::tp : parallel_mode::ep;
        moebius::host_transport transport(rt.memory());
        moebius::switcher sw(rt.arena(), rt.kv(), transport, make_empty_kv_state(rt.kv(), start),
                             o.cursor);
        driver_state st;
        st.tables = [&]() -> moebius::kv_state& { return sw.mutable_kv_tables(); };
        st.cursor = [&] { return sw.cursor(); };
        int64_t switches = 0;
        if (how == 2)
          st.before_step = [&](int64_t step) {
            if (step == 0) return;
            const auto r = sw.switch_to(sw.mode() == parallel_mode::ep ? parallel_mode::tp
                                                                       : parallel_mode::ep);
            REQUIRE(r.outcome == moebius::switch_outcome::committed);
            ++switches;
          };
        const auto ours = forced_logits(rt, st, tokens);
        worst = std::max(worst, compare_to_fixture(ours, f, tokens.size(), V));
        if (how == 2) CHECK(switches == static_cast<int64_t>(tokens.size()) - 1);

        // Free-running greedy decode: transformers' tokens.
        if (how != 2) {
          host_runtime grt(m, o, [&](weight_sink& s) { ck.load(m, s); });
          mini_engine::testing::static_state gs(grt, start);
          const auto runs = mini_engine::testing::drive(grt, gs.driver, {f.prompt}, 4,
                                                        static_cast<int64_t>(f.generated.size()) - 1);
          CHECK(runs[0].generated == f.generated);
        }
      }
    }
  }
  std::printf("hf fixtures: %zu checkpoints, largest logit difference from transformers %.3g "
              "(relative to max(1, |logit|))\n",
              all.size(), worst);
}

TEST_CASE("checkpoints transformers wrote: config.json as transformers 5 spells it", "[hf]") {
  for (const fixture& f : fixtures()) {
    const hf_config c = read_hf_config(f.dir + "/config.json");
    std::ifstream in(f.dir + "/config.json");
    const nlohmann::json j = nlohmann::json::parse(in);
    INFO(f.dir);
    CHECK(c.model.num_experts == j.at("num_local_experts").get<int64_t>());
    CHECK(c.model.rope_theta == j.at("rope_parameters").at("rope_theta").get<double>());
    CHECK(c.model.norm_topk_prob == j.at("norm_topk_prob").get<bool>());
    CHECK(c.model.head_dim == j.at("head_dim").get<int64_t>());
    CHECK(c.tie_word_embeddings == j.at("tie_word_embeddings").get<bool>());
    CHECK(c.dtype == (j.at("dtype") == "bfloat16" ? moebius::dtype::bf16 : moebius::dtype::fp32));
  }
}

TEST_CASE(
    "checkpoints transformers wrote: every attention/experts layout and KV-parallel "
    "degree gives transformers' logits",
    "[hf][dcp]") {
  const auto all = fixtures();
  REQUIRE(all.size() >= 5);
  double worst = 0;
  int64_t dcp_runs = 0;
  for (const fixture& f : all) {
    const hf_checkpoint ck(f.dir);
    model_config m = ck.config().model;
    m.page_size = 3;  // 17 tokens in 6 pages, the last partial: DCP shares of 1 to 3 pages
    std::vector<int32_t> tokens = f.prompt;
    tokens.insert(tokens.end(), f.generated.begin(), f.generated.end());
    const int64_t V = m.vocab;
    for (int P : {1, 2, 4, 8}) {
      try {
        validate(m, P);
      } catch (const moebius::error&) {
        continue;  // the model does not split over P
      }
      const auto layouts = mini_engine::testing::every_layout(m, P);
      // EP/EP and TP/TP (the first two) are the case above; TP(dcp) at cursor L also switching.
      for (size_t li = 2; li < layouts.size(); ++li)
        for (const bool switching : {false, true}) {
          const mini_engine::testing::layout_case& lay = layouts[li];
          if (switching && (lay.dcp == 1 || lay.cursor == 0)) continue;
          INFO(f.dir << " P=" << P << ": " << lay << (switching ? ", switching from EP" : ""));
          host_runtime_options o = lay.options(P, 16);
          if (switching) o.cursor = moebius::arena_cursor{0};
          host_runtime rt(m, o, [&](weight_sink& s) { ck.load(m, s); });
          mini_engine::testing::poison_kv(rt);
          // Static: the layout's own tables and cursor (a switcher needs them to agree). Switching:
          // the switcher's, EP <-> TP(dcp) before every step.
          mini_engine::testing::static_state fixed(rt, lay.attention, o.cursor);
          moebius::host_transport transport(rt.memory());
          std::optional<moebius::switcher> sw;
          driver_state st = fixed.driver;
          int64_t switches = 0;
          if (switching) {
            sw.emplace(rt.arena(), rt.kv(), transport,
                       make_empty_kv_state(rt.kv(), parallel_mode::ep), o.cursor);
            st.tables = [&]() -> moebius::kv_state& { return sw->mutable_kv_tables(); };
            st.cursor = [&] { return sw->cursor(); };
            st.before_step = [&](int64_t step) {
              if (step == 0) return;
              const auto r = sw->switch_to(sw->mode() == parallel_mode::ep ? parallel_mode::tp
                                                                           : parallel_mode::ep);
              INFO(r);
              REQUIRE(r.outcome == moebius::switch_outcome::committed);
              ++switches;
            };
          }
          const auto ours = forced_logits(rt, st, tokens);
          dcp_runs += lay.dcp > 1;
          worst = std::max(worst, compare_to_fixture(ours, f, tokens.size(), V));
          if (switching) {
            CHECK(switches == static_cast<int64_t>(tokens.size()) - 1);
            continue;
          }
          // Free-running greedy decode: transformers' tokens.
          host_runtime grt(m, o, [&](weight_sink& s) { ck.load(m, s); });
          mini_engine::testing::static_state gs(grt, lay.attention, o.cursor);
          const auto runs = mini_engine::testing::drive(
              grt, gs.driver, {f.prompt}, 4, static_cast<int64_t>(f.generated.size()) - 1);
          CHECK(runs[0].generated == f.generated);
        }
    }
  }
  std::printf(
      "hf fixtures, every layout: %lld runs with dcp > 1, largest logit difference from "
      "transformers %.3g\n",
      static_cast<long long>(dcp_runs), worst);
  CHECK(dcp_runs >= 12);
}
