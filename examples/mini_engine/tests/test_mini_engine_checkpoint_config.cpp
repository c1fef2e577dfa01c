// Checkpoint config.json: the published Qwen3-30B-A3B config, transformers' default for each
// optional key omitted (in the published and the transformers 5 spellings), and an error naming
// the field for every config the engine cannot run. Loading checkpoints:
// test_mini_engine_checkpoint.cpp; what they share: checkpoint_fixture.hpp.

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "catch.hpp"
#include "checkpoint_fixture.hpp"
#include "hf_config.hpp"
#include "model_config.hpp"

using namespace mini_engine;
using mini_engine::testing::config_json;
using mini_engine::testing::error_text;
using mini_engine::testing::temp_dir;
using moebius::dtype;
using nlohmann::json;
namespace fs = std::filesystem;

TEST_CASE("checkpoint: the published Qwen3-30B-A3B config.json", "[checkpoint]") {
  // As published with the model (num_experts, rope_theta, torch_dtype, sliding_window set
  // but off, max_window_layers): the engine's Qwen3-30B-A3B.
  const std::string text = R"({
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
    "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
    "intermediate_size": 6144, "max_position_embeddings": 40960, "max_window_layers": 48,
    "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 768,
    "norm_topk_prob": true, "num_attention_heads": 32, "num_experts": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4,
    "output_router_logits": false, "rms_norm_eps": 1e-06, "rope_scaling": null,
    "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": null,
    "tie_word_embeddings": false, "torch_dtype": "bfloat16", "transformers_version": "4.51.0",
    "use_cache": true, "use_sliding_window": false, "vocab_size": 151936})";
  const hf_config h = parse_hf_config(text, "Qwen3-30B-A3B/config.json");
  const model_config q = qwen3_30b_a3b();
  CHECK(h.model.num_layers == q.num_layers);
  CHECK(h.model.hidden == q.hidden);
  CHECK(h.model.num_q_heads == q.num_q_heads);
  CHECK(h.model.num_kv_heads == q.num_kv_heads);
  CHECK(h.model.head_dim == q.head_dim);
  CHECK(h.model.num_experts == q.num_experts);
  CHECK(h.model.top_k == q.top_k);
  CHECK(h.model.intermediate == q.intermediate);
  CHECK(h.model.vocab == q.vocab);
  CHECK(h.model.rope_theta == q.rope_theta);
  CHECK(h.model.rms_eps == q.rms_eps);
  CHECK(h.model.norm_topk_prob);
  CHECK(h.model.expert_dtype == dtype::bf16);
  CHECK(h.dtype == dtype::bf16);
  CHECK(!h.fp8);

  // The -FP8 release adds its quantization_config: fp8 experts of block 128.
  json fp8 = json::parse(text);
  fp8["quantization_config"] = {{"activation_scheme", "dynamic"}, {"fmt", "e4m3"},
                                {"quant_method", "fp8"}, {"weight_block_size", {128, 128}}};
  const hf_config f = parse_hf_config(fp8.dump(), "Qwen3-30B-A3B-FP8/config.json");
  CHECK(f.fp8);
  CHECK(f.model.expert_dtype == dtype::fp8_e4m3);
  CHECK(f.model.fp8_block == 128);
}

TEST_CASE("checkpoint: each optional config.json key omitted takes transformers' default",
          "[checkpoint]") {
  // transformers' defaults for Qwen3-MoE, written here as literals from its source, not read
  // from hf_config.cpp:
  //   src/transformers/models/qwen3_moe/configuration_qwen3_moe.py (Qwen3MoeConfig, 4.51 to
  //   5.x): num_key_value_heads 4, rms_norm_eps 1e-6, tie_word_embeddings False,
  //   norm_topk_prob False, rope_theta 10000.0 (4.x: the rope_theta argument; 5.x:
  //   rope_parameters None and the inherited default_theta, which Qwen3MoeConfig does not
  //   override), mlp_only_layers [] (None -> []), decoder_sparse_step 1,
  //   use_sliding_window False, attention_bias False, hidden_act "silu", rope_scaling None;
  //   Qwen3MoeConfig has no head_dim field: src/transformers/models/qwen3_moe/
  //   modeling_qwen3_moe.py reads getattr(config, "head_dim", hidden_size //
  //   num_attention_heads).
  constexpr int64_t kv_heads_default = 4;
  constexpr double rms_eps_default = 1e-6;
  constexpr double rope_theta_default = 10000.0;
  constexpr bool norm_topk_prob_default = false;
  constexpr bool tie_word_embeddings_default = false;

  uint64_t seed = std::random_device{}();
  if (const char* env = std::getenv("MOEBIUS_TEST_SEED")) seed = std::strtoull(env, nullptr, 10);
  INFO("MOEBIUS_TEST_SEED=" << seed);
  std::mt19937_64 rng(seed);
  auto uni = [&](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  const std::string dir = temp_dir("defaults");
  const auto parse = [&](const json& j) {
    std::ofstream(dir + "/config.json") << j.dump(2);
    return read_hf_config(dir + "/config.json");
  };

  for (int trial = 0; trial < 6; ++trial)
    for (const bool published : {true, false}) {
      // Hq a multiple of the default Hkv of 4, H / Hq even: the defaults make a model that runs.
      // Every optional key that changes the model is given a value other than its default.
      const int64_t heads = 4 * uni(1, 4), hidden = heads * 2 * uni(2, 8);
      const int64_t head_dim = hidden / heads + 2 * uni(1, 4), kv_heads = 2;
      const double rms_eps = 1e-5, rope_theta = 1e6;
      json base = {{"architectures", {"Qwen3MoeForCausalLM"}},
                   {"model_type", "qwen3_moe"},
                   {"num_hidden_layers", uni(1, 4)},
                   {"hidden_size", hidden},
                   {"num_attention_heads", heads},
                   {"num_key_value_heads", kv_heads},
                   {"head_dim", head_dim},
                   {"num_experts_per_tok", 2},
                   {"moe_intermediate_size", 8 * uni(1, 8)},
                   {"vocab_size", uni(16, 512)},
                   {"rms_norm_eps", rms_eps},
                   {"norm_topk_prob", true},
                   {"tie_word_embeddings", true},
                   {"mlp_only_layers", json::array()},
                   {"decoder_sparse_step", 1},
                   {"use_sliding_window", false},
                   {"sliding_window", nullptr},
                   {"attention_bias", false},
                   {"hidden_act", "silu"}};
      const int64_t experts = 2 * uni(2, 16);
      if (published) {
        base["num_experts"] = experts;
        base["rope_theta"] = rope_theta;
        base["rope_scaling"] = nullptr;
        base["torch_dtype"] = "float32";
      } else {
        base["num_local_experts"] = experts;
        base["rope_parameters"] = {{"rope_theta", rope_theta}, {"rope_type", "default"}};
        base["dtype"] = "float32";
      }
      INFO("trial " << trial << (published ? " published" : " transformers 5")
                    << " spelling: " << base.dump());
      const hf_config full = parse(base);
      REQUIRE(full.model.num_kv_heads == kv_heads);
      REQUIRE(full.model.head_dim == head_dim);
      REQUIRE(full.model.rms_eps == rms_eps);
      REQUIRE(full.model.rope_theta == rope_theta);
      REQUIRE(full.model.norm_topk_prob);
      REQUIRE(full.tie_word_embeddings);

      // What omitting each key changes: one field, to the default; the rest stays as given.
      struct omission {
        std::vector<std::string> keys;  // erased together (a field's spellings)
        std::function<void(hf_config&)> to_default;
      };
      const auto nothing = [](hf_config&) {};
      std::vector<omission> omissions = {
          {{"num_key_value_heads"}, [](hf_config& h) { h.model.num_kv_heads = kv_heads_default; }},
          {{"head_dim"}, [&](hf_config& h) { h.model.head_dim = hidden / heads; }},
          {{"rms_norm_eps"}, [](hf_config& h) { h.model.rms_eps = rms_eps_default; }},
          {{"norm_topk_prob"},
           [](hf_config& h) { h.model.norm_topk_prob = norm_topk_prob_default; }},
          {{"tie_word_embeddings"},
           [](hf_config& h) { h.tie_word_embeddings = tie_word_embeddings_default; }},
          {{published ? "rope_theta" : "rope_parameters"},
           [](hf_config& h) { h.model.rope_theta = rope_theta_default; }},
          {{"mlp_only_layers"}, nothing},
          {{"decoder_sparse_step"}, nothing},
          {{"use_sliding_window"}, nothing},
          {{"sliding_window"}, nothing},
          {{"attention_bias"}, nothing},
          {{"hidden_act"}, nothing},
      };
      if (published) omissions.push_back({{"rope_scaling"}, nothing});
      const auto check_same = [](const hf_config& got, const hf_config& want) {
        CHECK(got.model.num_layers == want.model.num_layers);
        CHECK(got.model.hidden == want.model.hidden);
        CHECK(got.model.num_q_heads == want.model.num_q_heads);
        CHECK(got.model.num_kv_heads == want.model.num_kv_heads);
        CHECK(got.model.head_dim == want.model.head_dim);
        CHECK(got.model.num_experts == want.model.num_experts);
        CHECK(got.model.top_k == want.model.top_k);
        CHECK(got.model.intermediate == want.model.intermediate);
        CHECK(got.model.vocab == want.model.vocab);
        CHECK(got.model.rope_theta == want.model.rope_theta);
        CHECK(got.model.rms_eps == want.model.rms_eps);
        CHECK(got.model.norm_topk_prob == want.model.norm_topk_prob);
        CHECK(got.model.expert_dtype == want.model.expert_dtype);
        CHECK(got.tie_word_embeddings == want.tie_word_embeddings);
        CHECK(got.dtype == want.dtype);
        CHECK(got.fp8 == want.fp8);
      };

      json all = base;
      hf_config all_want = full;
      for (const omission& o : omissions) {
        json j = base;
        for (const std::string& k : o.keys) {
          j.erase(k);
          all.erase(k);
        }
        INFO("omitted: " << o.keys.front());
        hf_config want = full;
        o.to_default(want);
        o.to_default(all_want);
        check_same(parse(j), want);
      }
      INFO("all omitted: " << all.dump());
      const hf_config none = parse(all);
      check_same(none, all_want);
      // The defaults, spelled out once more against the literals.
      CHECK(none.model.num_kv_heads == 4);
      CHECK(none.model.head_dim == hidden / heads);
      CHECK(none.model.rms_eps == 1e-6);
      CHECK(none.model.rope_theta == 10000.0);
      CHECK(!none.model.norm_topk_prob);
      CHECK(!none.tie_word_embeddings);
      if (!published) {  // transformers 5 spelling: rope_parameters without its rope_theta
        json j = base;
        j["rope_parameters"].erase("rope_theta");
        CHECK(parse(j).model.rope_theta == 10000.0);
      }
    }
  fs::remove_all(dir);
}

TEST_CASE("checkpoint: a config the engine cannot run names the field", "[checkpoint]") {
  const json base = config_json(tiny(), "float32", false);
  const std::vector<std::pair<std::string, json>> bad = {
      {"model_type", "qwen2_moe"},
      {"mlp_only_layers", {1}},
      {"decoder_sparse_step", 2},
      {"use_sliding_window", true},
      {"attention_bias", true},
      {"rope_scaling", {{"rope_type", "yarn"}, {"factor", 4.0}}},
      {"rope_scaling", {{"rope_type", 3}}},  // not a string: still this error, not nlohmann's
      {"rope_scaling", {{"type", "default"}, {"rope_type", "dynamic"}}},
      {"shared_expert_intermediate_size", 128},
      {"hidden_act", "gelu"},
      {"dtype", "float64"},
      {"num_hidden_layers", "two"},
      {"quantization_config", {{"quant_method", "gptq"}}},
  };
  for (const auto& [field, value] : bad) {
    json j = base;
    j[field] = value;
    const std::string what = error_text([&] { parse_hf_config(j.dump(), "x/config.json"); });
    INFO(what);
    CHECK(what.find("config.json x/config.json") != std::string::npos);
    CHECK(what.find(field) != std::string::npos);
  }
  json j = base;
  j["rope_parameters"]["rope_type"] = "linear";
  CHECK(error_text([&] { parse_hf_config(j.dump(), "x"); }).find("rope_parameters.rope_type") !=
        std::string::npos);
  j = base;
  j.erase("vocab_size");
  CHECK(error_text([&] { parse_hf_config(j.dump(), "x"); }).find("missing field vocab_size") !=
        std::string::npos);
  j = base;
  j["num_local_experts"] = 6;  // top-2 of 6 is fine, but P=4 cannot split it: the model runs
  CHECK(parse_hf_config(j.dump(), "x").model.num_experts == 6);
  CHECK(error_text([&] { parse_hf_config("{\"model_type\": \"qwen3_moe\",", "y/config.json"); })
            .find("config.json y/config.json: not JSON") != std::string::npos);
  CHECK(error_text([&] { parse_hf_config("[1, 2]", "z"); }).find("not a JSON object") !=
        std::string::npos);
}
