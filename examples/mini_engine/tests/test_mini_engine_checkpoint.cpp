// Checkpoint directories: the test writes Hugging Face Qwen3-MoE directories itself
// (config.json in the published and the transformers 5 spellings, one model.safetensors or
// shards with an index; F32, BF16 and FP8 E4M3 with block scales), loads them straight into
// the host runtime and checks the result against runtimes built from the same weights in
// memory (bitwise) or the reference. config.json alone: test_mini_engine_checkpoint_config.cpp;
// bad directories: test_mini_engine_checkpoint_errors.cpp; what the three share:
// checkpoint_fixture.hpp.

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <moebius/error.hpp>
#include <moebius/layout/weight_view.hpp>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "catch.hpp"
#include "checkpoint.hpp"
#include "checkpoint_fixture.hpp"
#include "driver.hpp"
#include "host_runtime.hpp"
#include "numerics.hpp"
#include "reference.hpp"

using namespace mini_engine;
using mini_engine::testing::config_json;
using mini_engine::testing::counting_sink;
using mini_engine::testing::encode;
using mini_engine::testing::error_text;
using mini_engine::testing::hf_tensors;
using mini_engine::testing::raw_tensor;
using mini_engine::testing::temp_dir;
using mini_engine::testing::write_dir;
using moebius::dtype;
using moebius::parallel_mode;
using nlohmann::json;
namespace fs = std::filesystem;

namespace {

const std::byte* arena_of(const moebius::rank_memory& m) {
  return static_cast<const std::byte*>(m.space(moebius::memory_space::arena).base);
}
int64_t arena_bytes(const moebius::rank_memory& m) {
  return m.space(moebius::memory_space::arena).bytes;
}

std::vector<std::vector<float>> logits_of(host_runtime& rt, parallel_mode mode,
                                          const std::vector<std::vector<int32_t>>& prompts) {
  mini_engine::testing::static_state st(rt, mode);
  const auto runs = mini_engine::testing::drive(rt, st.driver, prompts, 3, 4);
  std::vector<std::vector<float>> out;
  for (const auto& r : runs) out.insert(out.end(), r.logits.begin(), r.logits.end());
  return out;
}

// Checkpoint files mapped into this process now (/proc/self/maps).
int64_t mapped_files_under(const std::string& dir) {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  std::vector<std::string> seen;
  while (std::getline(maps, line))
    if (const auto at = line.find(dir); at != std::string::npos) {
      const std::string f = line.substr(at);
      if (std::find(seen.begin(), seen.end(), f) == seen.end()) seen.push_back(f);
    }
  return static_cast<int64_t>(seen.size());
}

}  // namespace

TEST_CASE("checkpoint: a directory streams into the host runtime as its weights would",
          "[checkpoint]") {
  std::mt19937_64 rng(2121);
  for (std::string dt : {"F32", "BF16"})
    for (int shards : {1, 3})
      for (bool published : {true, false}) {
        model_config c = tiny();
        c.norm_topk_prob = (rng() & 1) != 0;
        c.expert_dtype = dt == "F32" ? dtype::fp32 : dtype::bf16;
        model_weights w = make_weights(c, rng());
        if (dt == "BF16") {  // what the checkpoint holds: every tensor rounded to bf16
          auto r = [](std::vector<float>& v) {
            for (float& x : v) x = round_bf16(x);
          };
          r(w.embed), r(w.norm), r(w.lm_head);
          for (auto& l : w.layers)
            for (auto* v : {&l.input_layernorm, &l.q_proj, &l.k_proj, &l.v_proj, &l.o_proj,
                            &l.q_norm, &l.k_norm, &l.post_attention_layernorm, &l.router})
              r(*v);
        }
        const std::string dir = temp_dir(dt + std::to_string(shards) + (published ? "p" : "t"));
        write_dir(dir, config_json(c, dt == "F32" ? "float32" : "bfloat16", published),
                  hf_tensors(w, dt), shards);
        INFO(dir << " " << c);
        const hf_checkpoint ck(dir);
        model_config m = ck.config().model;
        CHECK(m.expert_dtype == c.expert_dtype);
        CHECK(m.norm_topk_prob == c.norm_topk_prob);
        m.fp8_block = c.fp8_block;
        m.page_size = c.page_size;
        CHECK(ck.num_shards() == shards);

        // Progress once per shard, one shard mapped at a time while its tensors arrive.
        std::vector<load_progress> seen;
        struct watching_sink final : weight_sink {
          std::string dir;
          int64_t most_mapped = 0, puts = 0;
          void put(hf_tensor, int64_t, int64_t, const tensor_source&) override {
            most_mapped = std::max(most_mapped, mapped_files_under(dir));
            ++puts;
          }
        } watch;
        watch.dir = dir;
        ck.load(m, watch, [&](const load_progress& p) { seen.push_back(p); });
        CHECK(watch.most_mapped == 1);
        CHECK(mapped_files_under(dir) == 0);
        REQUIRE(static_cast<int>(seen.size()) == shards);
        CHECK(seen.back().bytes_done == ck.bytes());
        CHECK(progress_line(seen.back()).find("shard " + std::to_string(shards) + "/") == 0);

        for (int P : {1, 2, 4})
          for (parallel_mode mode : {parallel_mode::ep, parallel_mode::tp}) {
            host_runtime_options o;
            o.num_ranks = P;
            o.num_ep_pages = 32;
            o.cursor = moebius::arena_cursor{mode == parallel_mode::tp ? c.num_layers : 0};
            host_runtime streamed(m, o, [&](weight_sink& s) { ck.load(m, s); });
            host_runtime direct(w, o);
            // The same bytes in every rank's arena, and the same logits bit for bit.
            const auto a = streamed.memory(), b = direct.memory();
            for (int r = 0; r < P; ++r)
              REQUIRE(std::memcmp(arena_of(a[static_cast<size_t>(r)]),
                                  arena_of(b[static_cast<size_t>(r)]),
                                  static_cast<size_t>(arena_bytes(a[static_cast<size_t>(r)]))) == 0);
            const std::vector<std::vector<int32_t>> prompts = {{1, 2, 3, 4, 5}, {200, 7, 9}};
            REQUIRE(logits_of(streamed, mode, prompts) == logits_of(direct, mode, prompts));
          }
        // And as logical weights: every tensor exact.
        const model_weights loaded = load_weights(ck, m);
        CHECK(loaded.embed == w.embed);
        CHECK(loaded.layers[1].w2 == w.layers[1].w2);
        CHECK(loaded.layers[0].q_proj == w.layers[0].q_proj);
        fs::remove_all(dir);
      }
}

TEST_CASE("checkpoint: norm_topk_prob false weighs experts by their softmax probability",
          "[checkpoint]") {
  model_config c = tiny();
  c.norm_topk_prob = false;
  const model_weights w = make_weights(c, 77);
  model_weights renorm = w;
  renorm.config.norm_topk_prob = true;
  const std::vector<int32_t> seq = {3, 1, 4, 1, 5, 9, 2, 6};
  const auto ref = reference_logits(w, seq);
  const auto other = reference_logits(renorm, seq);
  double apart = 0;
  for (size_t v = 0; v < ref.back().size(); ++v)
    apart = std::max(apart, std::fabs(ref.back()[v] - other.back()[v]));
  CHECK(apart > 1e-2);  // the flag matters on this model
  for (int P : {1, 2})
    for (parallel_mode mode : {parallel_mode::ep, parallel_mode::tp}) {
      host_runtime_options o;
      o.num_ranks = P;
      o.cursor = moebius::arena_cursor{mode == parallel_mode::tp ? c.num_layers : 0};
      host_runtime rt(w, o);
      mini_engine::testing::static_state st(rt, mode);
      const auto runs = mini_engine::testing::drive(rt, st.driver, {seq}, 8, 1);
      for (size_t v = 0; v < ref.back().size(); ++v)
        REQUIRE(std::fabs(runs[0].logits[0][v] - ref.back()[v]) <=
                1e-4 * std::max(1.0, std::fabs(ref.back()[v])));
    }
}

TEST_CASE("checkpoint: FP8 E4M3 with block scales stays fp8 in the arena", "[checkpoint]") {
  // tiny(): H=64, I=32; blocks of 8 (the Qwen3 -FP8 releases use 128 at full size), so TP
  // slices at P=2 hold whole blocks. Experts and one dense projection fp8, scales arbitrary
  // (not powers of two), everything else BF16.
  model_config c = tiny();
  const int64_t b = 8, I = c.intermediate;
  std::mt19937_64 rng(88);
  const model_weights w = make_weights(c, 9);
  std::vector<raw_tensor> ts = hf_tensors(w, "BF16");
  std::uniform_real_distribution<float> scale_of(0.5f / 448, 3.0f / 448);
  auto fp8_tensor = [&](raw_tensor& t) {
    const int64_t rows = t.shape[0], cols = t.shape[1];
    const int64_t br = (rows + b - 1) / b, bc = (cols + b - 1) / b;
    t.dtype = "F8_E4M3";
    t.bytes.assign(static_cast<size_t>(rows * cols), 0);
    for (auto& code : t.bytes) {
      do code = static_cast<unsigned char>(rng() & 0xff);
      while ((code & 0x7f) == 0x7f);  // no NaN codes
    }
    std::vector<float> s(static_cast<size_t>(br * bc));
    for (float& x : s) x = scale_of(rng);
    return encode(t.name + "_scale_inv", {br, bc}, s, "F32");
  };
  std::vector<raw_tensor> scales;
  for (auto& t : ts)
    if (t.name.find("mlp.experts.") != std::string::npos ||
        t.name == "model.layers.0.self_attn.q_proj.weight")
      scales.push_back(fp8_tensor(t));
  ts.insert(ts.end(), scales.begin(), scales.end());
  const std::string dir = temp_dir("fp8");
  json cfg = config_json(c, "bfloat16", true);
  cfg["quantization_config"] = {{"quant_method", "fp8"}, {"fmt", "e4m3"},
                                {"activation_scheme", "dynamic"}, {"weight_block_size", {b, b}}};
  write_dir(dir, cfg, ts, 2);

  const hf_checkpoint ck(dir);
  model_config m = ck.config().model;
  REQUIRE(m.expert_dtype == dtype::fp8_e4m3);
  REQUIRE(m.fp8_block == b);
  m.page_size = c.page_size;
  model_config as_f32 = m;
  as_f32.expert_dtype = dtype::fp32;  // dequantised on load
  const std::vector<std::vector<int32_t>> prompts = {{5, 6, 7, 8}, {100, 3}};
  for (int P : {1, 2})
    for (parallel_mode mode : {parallel_mode::ep, parallel_mode::tp}) {
      INFO("P=" << P << " " << moebius::to_string(mode));
      host_runtime_options o;
      o.num_ranks = P;
      o.cursor = moebius::arena_cursor{mode == parallel_mode::tp ? c.num_layers : 0};
      host_runtime fp8(m, o, [&](weight_sink& s) { ck.load(m, s); });
      // Every code of every expert is the checkpoint's byte, at its home in the view.
      const auto mem = fp8.memory();
      for (const raw_tensor& t : ts) {
        if (t.dtype != "F8_E4M3" || t.name.find("mlp.experts.") == std::string::npos) continue;
        int64_t layer = 0, e = 0;
        char part[16] = {};
        REQUIRE(std::sscanf(t.name.c_str(), "model.layers.%ld.mlp.experts.%ld.%15[a-z]_proj",
                            &layer, &e, part) == 3);
        const std::string p = part;
        const auto tensor = p == "down" ? moebius::weight_tensor::w2 : moebius::weight_tensor::w13;
        const int64_t row0 = p == "up" ? I : 0;
        const auto& g = fp8.arena();
        const int64_t base = g.tensor_base(mode, layer, tensor);
        for (int64_t r = 0; r < t.shape[0]; ++r)
          for (int64_t q = 0; q < t.shape[1]; ++q) {
            const moebius::element_location at =
                mode == parallel_mode::ep
                    ? moebius::make_view<parallel_mode::ep>(g.shape, tensor, P).locate(e, row0 + r, q)
                    : moebius::make_view<parallel_mode::tp>(g.shape, tensor, P).locate(e, row0 + r, q);
            REQUIRE(static_cast<unsigned char>(
                        arena_of(mem[static_cast<size_t>(at.rank)])[base + at.offset]) ==
                    t.bytes[static_cast<size_t>(r * t.shape[1] + q)]);
          }
      }
      host_runtime f32(as_f32, o, [&](weight_sink& s) { ck.load(as_f32, s); });
      const auto a = logits_of(fp8, mode, prompts), d = logits_of(f32, mode, prompts);
      // fp8 in the arena computes code * scale exactly in double; fp32 holds it rounded to
      // float (2^-24 relative): the logits agree to well within 1e-5.
      for (size_t i = 0; i < a.size(); ++i)
        for (size_t v = 0; v < a[i].size(); ++v)
          REQUIRE(std::fabs(a[i][v] - d[i][v]) <= 1e-5 * std::max(1.0f, std::fabs(d[i][v])));
    }
  // bf16 experts of an fp8 checkpoint: dequantised and rounded; fp8 of another block: refused.
  model_config wrong = m;
  wrong.fp8_block = 16;
  counting_sink none;
  CHECK(error_text([&] { ck.load(wrong, none); }).find("fp8_e4m3 experts of block 16") !=
        std::string::npos);
  CHECK(none.puts == 0);
  fs::remove_all(dir);
}

TEST_CASE("checkpoint: rotary tables and a tied lm_head are ignored, as transformers ignores them",
          "[checkpoint]") {
  const uint64_t seed = std::random_device{}();
  INFO("weights seed " << seed);
  const model_config c = tiny();
  const model_weights w = make_weights(c, seed);
  auto ts = hf_tensors(w, "F32");
  // Older transformers saved each layer's rotary table; newer ones one for the model.
  const std::vector<float> inv_freq(static_cast<size_t>(c.head_dim / 2), 0.125f);
  for (int64_t i = 0; i < c.num_layers; ++i)
    ts.push_back(encode("model.layers." + std::to_string(i) + ".self_attn.rotary_emb.inv_freq",
                        {c.head_dim / 2}, inv_freq, "F32"));
  ts.push_back(encode("model.rotary_emb.inv_freq", {c.head_dim / 2}, inv_freq, "F32"));
  SECTION("untied: the lm_head is the checkpoint's") {
    const std::string d = temp_dir("rotary");
    write_dir(d, config_json(c, "float32", false), ts, 2);
    const hf_checkpoint ck(d);
    const model_weights loaded = load_weights(ck, ck.config().model);
    CHECK(loaded.embed == w.embed);
    CHECK(loaded.lm_head == w.lm_head);
    CHECK(loaded.layers.back().q_norm == w.layers.back().q_norm);
    fs::remove_all(d);
  }
  SECTION("tied: an lm_head.weight in the files is ignored, the LM head is the embedding") {
    json j = config_json(c, "float32", false);
    j["tie_word_embeddings"] = true;
    const std::string d = temp_dir("tied");
    write_dir(d, j, ts, 1);  // ts still holds lm_head.weight, which differs from the embedding
    REQUIRE(w.lm_head != w.embed);
    const hf_checkpoint ck(d);
    const model_weights loaded = load_weights(ck, ck.config().model);
    CHECK(loaded.lm_head == w.embed);
    fs::remove_all(d);
  }
}
