// Bad checkpoint directories: every bad input gives an error naming the file and the tensor
// (or the config field) before anything is loaded, and a runtime from a checkpoint that fails
// never exists. Loading good ones: test_mini_engine_checkpoint.cpp; what they share:
// checkpoint_fixture.hpp.

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <moebius/error.hpp>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "catch.hpp"
#include "checkpoint.hpp"
#include "checkpoint_fixture.hpp"
#include "host_runtime.hpp"

using namespace mini_engine;
using mini_engine::testing::config_json;
using mini_engine::testing::counting_sink;
using mini_engine::testing::encode;
using mini_engine::testing::error_text;
using mini_engine::testing::hf_tensors;
using mini_engine::testing::raw_tensor;
using mini_engine::testing::temp_dir;
using mini_engine::testing::write_dir;
using mini_engine::testing::write_st;
using nlohmann::json;
namespace fs = std::filesystem;

TEST_CASE("checkpoint: bad directories give errors naming the file and the tensor, before "
          "anything loads",
          "[checkpoint]") {
  const model_config c = tiny();
  const model_weights w = make_weights(c, 5);
  const auto tensors = hf_tensors(w, "F32");
  const json cfg = config_json(c, "float32", false);
  auto expect = [&](const std::string& dir, std::initializer_list<std::string> parts) {
    const std::string what = error_text([&] {
      const hf_checkpoint ck(dir);
      counting_sink s;
      ck.load(ck.config().model, s);
    });
    INFO(what);
    for (const std::string& p : parts) CHECK(what.find(p) != std::string::npos);
    fs::remove_all(dir);
  };

  SECTION("no config.json") {
    const std::string d = temp_dir("noconfig");
    write_st(d + "/model.safetensors", tensors);
    expect(d, {d, "no config.json"});
  }
  SECTION("config.json that is not JSON") {
    const std::string d = temp_dir("notjson");
    write_st(d + "/model.safetensors", tensors);
    std::ofstream(d + "/config.json") << "model_type = qwen3_moe\n";
    expect(d, {d + "/config.json", "not JSON"});
  }
  SECTION("an unsupported config field") {
    const std::string d = temp_dir("badfield");
    json j = cfg;
    j["decoder_sparse_step"] = 2;
    write_dir(d, j, tensors, 1);
    expect(d, {d + "/config.json", "decoder_sparse_step 2"});
  }
  SECTION("a missing shard") {
    const std::string d = temp_dir("noshard");
    write_dir(d, cfg, tensors, 3);
    fs::remove(d + "/model-00002-of-00003.safetensors");
    expect(d, {"model.safetensors.index.json", "model-00002-of-00003.safetensors",
               "does not exist", "for tensor model.layers."});
  }
  SECTION("an index naming a tensor no shard has") {
    const std::string d = temp_dir("ghost");
    write_dir(d, cfg, tensors, 2);
    json index = json::parse(std::ifstream(d + "/model.safetensors.index.json"));
    index["weight_map"]["model.layers.1.mlp.experts.9.up_proj.weight"] =
        "model-00001-of-00002.safetensors";
    std::ofstream(d + "/model.safetensors.index.json") << index.dump();
    expect(d, {"model.safetensors.index.json", "model.layers.1.mlp.experts.9.up_proj.weight",
               "model-00001-of-00002.safetensors", "which has no such tensor"});
  }
  SECTION("an index putting a tensor in the wrong shard") {
    const std::string d = temp_dir("wrongshard");
    write_dir(d, cfg, tensors, 2);
    json index = json::parse(std::ifstream(d + "/model.safetensors.index.json"));
    index["weight_map"]["model.embed_tokens.weight"] = "model-00002-of-00002.safetensors";
    std::ofstream(d + "/model.safetensors.index.json") << index.dump();
    expect(d, {"model.embed_tokens.weight", "model-00002-of-00002.safetensors",
               "which has no such tensor"});
  }
  SECTION("a truncated shard") {
    const std::string d = temp_dir("trunc");
    write_dir(d, cfg, tensors, 2);
    const std::string f = d + "/model-00002-of-00002.safetensors";
    fs::resize_file(f, fs::file_size(f) - 5);
    // The last tensor in the file is the one that runs past the end.
    expect(d, {f, tensors.back().name, "run past the end", "truncated"});
  }
  SECTION("offsets that overlap") {
    const std::string d = temp_dir("overlap");
    std::vector<std::pair<int64_t, int64_t>> off;
    int64_t at = 0;
    for (const auto& t : tensors) {
      const auto n = static_cast<int64_t>(t.bytes.size());
      off.push_back({at, at + n});
      at += n;
    }
    off[5].first -= 4;  // starts inside tensor 4 (and ends 4 bytes early: same size)
    off[5].second -= 4;
    std::ofstream(d + "/config.json") << cfg.dump();
    write_st(d + "/model.safetensors", tensors, off);
    expect(d, {d + "/model.safetensors", tensors[5].name, "overlaps tensor", tensors[4].name});
  }
  SECTION("offsets past the data") {
    const std::string d = temp_dir("pastend");
    std::vector<std::pair<int64_t, int64_t>> off;
    int64_t at = 0;
    for (const auto& t : tensors) {
      const auto n = static_cast<int64_t>(t.bytes.size());
      off.push_back({at, at + n});
      at += n;
    }
    off[2] = {at, at + static_cast<int64_t>(tensors[2].bytes.size())};  // beyond the last
    std::ofstream(d + "/config.json") << cfg.dump();
    write_st(d + "/model.safetensors", tensors, off);
    expect(d, {d + "/model.safetensors", tensors[2].name, "run past the end"});
  }
  SECTION("a byte range that is not shape x dtype") {
    const std::string d = temp_dir("size");
    auto ts = tensors;
    ts[3].bytes.resize(ts[3].bytes.size() - 4);
    write_dir(d, cfg, ts, 1);
    expect(d, {ts[3].name, "holds", "needs"});
  }
  SECTION("a tensor of the wrong shape") {
    const std::string d = temp_dir("shape");
    auto ts = tensors;
    for (auto& t : ts)
      if (t.name == "model.layers.0.self_attn.k_proj.weight") t.shape = {c.hidden, c.kv_dim()};
    write_dir(d, cfg, ts, 2);
    expect(d, {"model-0000", "model.layers.0.self_attn.k_proj.weight",
               "has shape [64, 32], the model needs [32, 64]"});
  }
  SECTION("a tensor of a dtype the loader does not read") {
    const std::string d = temp_dir("dtype");
    auto ts = tensors;
    for (auto& t : ts)
      if (t.name == "model.layers.1.mlp.gate.weight") t.dtype = "I32";
    write_dir(d, cfg, ts, 1);
    expect(d, {d + "/model.safetensors", "model.layers.1.mlp.gate.weight", "is I32"});
  }
  SECTION("a missing tensor") {
    const std::string d = temp_dir("missing");
    auto ts = tensors;
    std::erase_if(ts, [](const raw_tensor& t) {
      return t.name == "model.layers.1.mlp.experts.3.up_proj.weight";
    });
    write_dir(d, cfg, ts, 3);
    expect(d, {"model.layers.1.mlp.experts.3.up_proj.weight", "is missing",
               "model.safetensors.index.json"});
  }
  SECTION("a tensor the engine would ignore (a bias)") {
    const std::string d = temp_dir("bias");
    auto ts = tensors;
    ts.push_back(encode("model.layers.0.self_attn.q_proj.bias", {c.q_dim()},
                        std::vector<float>(static_cast<size_t>(c.q_dim()), 0.5f), "F32"));
    write_dir(d, cfg, ts, 1);
    expect(d, {"model.layers.0.self_attn.q_proj.bias", "not one this Qwen3-MoE engine reads"});
  }
  SECTION(
      "a tensor outside the layers the engine would ignore (a final norm's or lm_head's bias)") {
    for (const std::string name : {"model.norm.bias", "lm_head.bias"}) {
      const std::string d = temp_dir("topbias");
      auto ts = tensors;
      const int64_t n = name == "lm_head.bias" ? c.vocab : c.hidden;
      ts.push_back(encode(name, {n}, std::vector<float>(static_cast<size_t>(n), 0.25f), "F32"));
      write_dir(d, cfg, ts, 2);
      expect(d, {name, "not one this Qwen3-MoE engine reads"});
    }
  }
  SECTION("an F8_E4M3 tensor without its scales") {
    const std::string d = temp_dir("noscale");
    auto ts = tensors;
    json j = cfg;
    j["quantization_config"] = {{"quant_method", "fp8"}, {"weight_block_size", {8, 8}}};
    for (auto& t : ts)
      if (t.name == "model.layers.0.mlp.experts.0.down_proj.weight") {
        t.dtype = "F8_E4M3";
        t.bytes.resize(t.bytes.size() / 4);
      }
    write_dir(d, j, ts, 1);
    expect(d, {"model.layers.0.mlp.experts.0.down_proj.weight", "without its block scales",
               "down_proj.weight_scale_inv"});
  }
  SECTION("a runtime from a checkpoint that fails never exists") {
    const std::string d = temp_dir("noruntime");
    write_dir(d, cfg, tensors, 2);
    fs::resize_file(d + "/model-00001-of-00002.safetensors", 100);
    bool built = false;
    CHECK_THROWS_AS(
        [&] {
          const hf_checkpoint ck(d);
          host_runtime_options o;
          host_runtime rt(ck.config().model, o, [&](weight_sink& s) { ck.load(ck.config().model, s); });
          built = true;
        }(),
        moebius::error);
    CHECK(!built);
    fs::remove_all(d);
  }
}
