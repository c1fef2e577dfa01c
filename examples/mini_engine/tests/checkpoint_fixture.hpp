#pragma once

// What the checkpoint tests share (test_mini_engine_checkpoint*.cpp): Hugging Face Qwen3-MoE
// checkpoint directories written by the test itself (config.json in the published and the
// transformers 5 spellings, one model.safetensors or shards with an index), the error a bad
// one gives, and a sink that counts what reaches it.

#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <moebius/error.hpp>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "catch.hpp"
#include "checkpoint.hpp"
#include "model_config.hpp"
#include "numerics.hpp"
#include "weights.hpp"

namespace mini_engine::testing {

using nlohmann::json;
namespace fs = std::filesystem;

struct raw_tensor {
  std::string name, dtype;
  std::vector<int64_t> shape;
  std::vector<unsigned char> bytes;
};

inline raw_tensor encode(const std::string& name, std::vector<int64_t> shape,
                         const std::vector<float>& v, const std::string& dt) {
  raw_tensor t{name, dt, std::move(shape), {}};
  for (float x : v) {
    if (dt == "F32") {
      unsigned char b[4];
      std::memcpy(b, &x, 4);
      t.bytes.insert(t.bytes.end(), b, b + 4);
    } else {  // BF16
      const uint16_t u = to_bf16(x);
      t.bytes.push_back(static_cast<unsigned char>(u & 0xff));
      t.bytes.push_back(static_cast<unsigned char>(u >> 8));
    }
  }
  return t;
}

// Writes a safetensors file; `offsets` (when given) replaces each tensor's data_offsets.
inline void write_st(const std::string& path, const std::vector<raw_tensor>& ts,
                     const std::vector<std::pair<int64_t, int64_t>>& offsets = {}) {
  json h = json::object();
  h["__metadata__"] = {{"format", "pt"}};
  std::vector<unsigned char> data;
  for (size_t i = 0; i < ts.size(); ++i) {
    const int64_t b = static_cast<int64_t>(data.size());
    data.insert(data.end(), ts[i].bytes.begin(), ts[i].bytes.end());
    const int64_t e = static_cast<int64_t>(data.size());
    h[ts[i].name] = {{"dtype", ts[i].dtype},
                     {"shape", ts[i].shape},
                     {"data_offsets", offsets.empty() ? std::vector<int64_t>{b, e}
                                                      : std::vector<int64_t>{offsets[i].first,
                                                                             offsets[i].second}}};
  }
  std::string header = h.dump();
  while (header.size() % 8) header += ' ';
  std::ofstream out(path, std::ios::binary);
  const uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out.put(static_cast<char>((n >> (8 * i)) & 0xff));
  out.write(header.data(), static_cast<std::streamsize>(header.size()));
  out.write(reinterpret_cast<const char*>(data.data()), static_cast<std::streamsize>(data.size()));
}

// The weights as Hugging Face tensors in `dt` (F32 or BF16).
inline std::vector<raw_tensor> hf_tensors(const model_weights& w, const std::string& dt) {
  const model_config& c = w.config;
  const int64_t H = c.hidden, I = c.intermediate, D = c.head_dim;
  std::vector<raw_tensor> t = {encode("model.embed_tokens.weight", {c.vocab, H}, w.embed, dt),
                               encode("model.norm.weight", {H}, w.norm, dt),
                               encode("lm_head.weight", {c.vocab, H}, w.lm_head, dt)};
  for (int64_t i = 0; i < c.num_layers; ++i) {
    const auto& l = w.layers[static_cast<size_t>(i)];
    const std::string p = "model.layers." + std::to_string(i) + ".";
    t.push_back(encode(p + "input_layernorm.weight", {H}, l.input_layernorm, dt));
    t.push_back(encode(p + "self_attn.q_proj.weight", {c.q_dim(), H}, l.q_proj, dt));
    t.push_back(encode(p + "self_attn.k_proj.weight", {c.kv_dim(), H}, l.k_proj, dt));
    t.push_back(encode(p + "self_attn.v_proj.weight", {c.kv_dim(), H}, l.v_proj, dt));
    t.push_back(encode(p + "self_attn.o_proj.weight", {H, c.q_dim()}, l.o_proj, dt));
    t.push_back(encode(p + "self_attn.q_norm.weight", {D}, l.q_norm, dt));
    t.push_back(encode(p + "self_attn.k_norm.weight", {D}, l.k_norm, dt));
    t.push_back(encode(p + "post_attention_layernorm.weight", {H}, l.post_attention_layernorm, dt));
    t.push_back(encode(p + "mlp.gate.weight", {c.num_experts, H}, l.router, dt));
    for (int64_t e = 0; e < c.num_experts; ++e) {
      const std::string q = p + "mlp.experts." + std::to_string(e) + ".";
      auto rows = [&](const std::vector<float>& v, int64_t first, int64_t n) {
        return std::vector<float>(v.begin() + first, v.begin() + first + n);
      };
      t.push_back(encode(q + "gate_proj.weight", {I, H}, rows(l.w13, e * 2 * I * H, I * H), dt));
      t.push_back(encode(q + "up_proj.weight", {I, H}, rows(l.w13, (e * 2 + 1) * I * H, I * H), dt));
      t.push_back(encode(q + "down_proj.weight", {H, I}, rows(l.w2, e * H * I, H * I), dt));
    }
  }
  return t;
}

// config.json for `c`: the published spelling (num_experts, rope_theta, torch_dtype) or
// transformers 5's (num_local_experts, rope_parameters, dtype).
inline json config_json(const model_config& c, const std::string& dt, bool published) {
  json j = {{"architectures", {"Qwen3MoeForCausalLM"}},
            {"model_type", "qwen3_moe"},
            {"num_hidden_layers", c.num_layers},
            {"hidden_size", c.hidden},
            {"intermediate_size", 4 * c.hidden},
            {"num_attention_heads", c.num_q_heads},
            {"num_key_value_heads", c.num_kv_heads},
            {"head_dim", c.head_dim},
            {"num_experts_per_tok", c.top_k},
            {"moe_intermediate_size", c.intermediate},
            {"vocab_size", c.vocab},
            {"rms_norm_eps", c.rms_eps},
            {"norm_topk_prob", c.norm_topk_prob},
            {"tie_word_embeddings", false},
            {"mlp_only_layers", json::array()},
            {"decoder_sparse_step", 1},
            {"use_sliding_window", false},
            {"sliding_window", nullptr},
            {"attention_bias", false},
            {"hidden_act", "silu"}};
  if (published) {
    j["num_experts"] = c.num_experts;
    j["rope_theta"] = c.rope_theta;
    j["rope_scaling"] = nullptr;
    j["torch_dtype"] = dt;
  } else {
    j["num_local_experts"] = c.num_experts;
    j["rope_parameters"] = {{"rope_theta", c.rope_theta}, {"rope_type", "default"}};
    j["dtype"] = dt;
  }
  return j;
}

inline std::string temp_dir(const std::string& name) {
  const fs::path p = fs::temp_directory_path() /
                     ("mini_engine_ck_" + std::to_string(::getpid()) + "_" + name);
  fs::remove_all(p);
  fs::create_directories(p);
  return p.string();
}

// A checkpoint directory: config.json and `shards` shard files (1: model.safetensors; more:
// model-0000k-of-0000n.safetensors with an index).
inline void write_dir(const std::string& dir, const json& config, const std::vector<raw_tensor>& ts,
                      int shards) {
  std::ofstream(dir + "/config.json") << config.dump(2);
  if (shards == 1) {
    write_st(dir + "/model.safetensors", ts);
    return;
  }
  json index = {{"metadata", {{"total_size", 0}}}, {"weight_map", json::object()}};
  const size_t per = (ts.size() + static_cast<size_t>(shards) - 1) / static_cast<size_t>(shards);
  for (int s = 0; s < shards; ++s) {
    char name[64];
    std::snprintf(name, sizeof name, "model-%05d-of-%05d.safetensors", s + 1, shards);
    const size_t b = std::min(ts.size(), static_cast<size_t>(s) * per),
                 e = std::min(ts.size(), b + per);
    write_st(dir + "/" + name, {ts.begin() + static_cast<ptrdiff_t>(b),
                                ts.begin() + static_cast<ptrdiff_t>(e)});
    for (size_t i = b; i < e; ++i) index["weight_map"][ts[i].name] = name;
  }
  std::ofstream(dir + "/model.safetensors.index.json") << index.dump(2);
}

template <class F>
std::string error_text(F&& f) {
  try {
    f();
  } catch (const moebius::error& e) {
    CHECK(e.code() == moebius::errc::invalid_argument);
    return e.what();
  }
  return "(no error)";
}

// Counts what reaches it: a load that fails before streaming delivers nothing.
struct counting_sink final : weight_sink {
  int64_t puts = 0;
  void put(hf_tensor, int64_t, int64_t, const tensor_source&) override { ++puts; }
};

}  // namespace mini_engine::testing
