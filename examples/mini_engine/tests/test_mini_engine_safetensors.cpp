// safetensors: the test writes tiny Qwen3-MoE checkpoints (F32 and BF16, one file and two
// shards) with its own writer, loads them, and checks every tensor and the runtime's
// logits against the reference computed from the same tensors; broken files and missing or
// misshapen tensors give errors that name them.

#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <moebius/error.hpp>
#include <random>
#include <string>
#include <vector>

#include "catch.hpp"
#include "driver.hpp"
#include "host_runtime.hpp"
#include "numerics.hpp"
#include "reference.hpp"
#include "checkpoint.hpp"
#include "safetensors.hpp"
#include "weights.hpp"

using namespace mini_engine;
using moebius::errc;

namespace {

struct named_tensor {
  std::string name;
  std::vector<int64_t> shape;
  std::vector<float> values;
};

// Writes `tensors` in the safetensors format as F32 or BF16, with a metadata entry and
// (to exercise the parser) escapes and spaces in the header.
void write_safetensors(const std::string& path, const std::vector<named_tensor>& tensors,
                       bool bf16) {
  std::string header = "{\"__metadata__\": {\"format\": \"pt\", \"note\": \"a \\\"tiny\\\" one\"}";
  std::vector<unsigned char> data;
  for (const auto& t : tensors) {
    const int64_t begin = static_cast<int64_t>(data.size());
    for (float v : t.values) {
      if (bf16) {
        const uint16_t u = to_bf16(v);
        data.push_back(static_cast<unsigned char>(u & 0xff));
        data.push_back(static_cast<unsigned char>(u >> 8));
      } else {
        unsigned char b[4];
        std::memcpy(b, &v, 4);
        data.insert(data.end(), b, b + 4);
      }
    }
    header += ", \"" + t.name + "\": {\"dtype\": \"" + (bf16 ? "BF16" : "F32") + "\", \"shape\": [";
    for (size_t i = 0; i < t.shape.size(); ++i)
      header += (i ? ", " : "") + std::to_string(t.shape[i]);
    header += "], \"data_offsets\": [" + std::to_string(begin) + ", " +
              std::to_string(data.size()) + "]}";
  }
  header += "}";
  while (header.size() % 8) header += ' ';
  std::ofstream out(path, std::ios::binary);
  uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out.put(static_cast<char>((n >> (8 * i)) & 0xff));
  out.write(header.data(), static_cast<std::streamsize>(header.size()));
  out.write(reinterpret_cast<const char*>(data.data()), static_cast<std::streamsize>(data.size()));
}

// The weights as Hugging Face Qwen3-MoE tensors.
std::vector<named_tensor> hf_tensors(const model_weights& w) {
  const model_config& c = w.config;
  const int64_t H = c.hidden, I = c.intermediate, D = c.head_dim;
  std::vector<named_tensor> t = {{"model.embed_tokens.weight", {c.vocab, H}, w.embed},
                                 {"model.norm.weight", {H}, w.norm},
                                 {"lm_head.weight", {c.vocab, H}, w.lm_head}};
  for (int64_t i = 0; i < c.num_layers; ++i) {
    const auto& l = w.layers[static_cast<size_t>(i)];
    const std::string p = "model.layers." + std::to_string(i) + ".";
    t.push_back({p + "input_layernorm.weight", {H}, l.input_layernorm});
    t.push_back({p + "self_attn.q_proj.weight", {c.q_dim(), H}, l.q_proj});
    t.push_back({p + "self_attn.k_proj.weight", {c.kv_dim(), H}, l.k_proj});
    t.push_back({p + "self_attn.v_proj.weight", {c.kv_dim(), H}, l.v_proj});
    t.push_back({p + "self_attn.o_proj.weight", {H, c.q_dim()}, l.o_proj});
    t.push_back({p + "self_attn.q_norm.weight", {D}, l.q_norm});
    t.push_back({p + "self_attn.k_norm.weight", {D}, l.k_norm});
    t.push_back({p + "post_attention_layernorm.weight", {H}, l.post_attention_layernorm});
    t.push_back({p + "mlp.gate.weight", {c.num_experts, H}, l.router});
    for (int64_t e = 0; e < c.num_experts; ++e) {
      const std::string q = p + "mlp.experts." + std::to_string(e) + ".";
      auto rows = [&](const std::vector<float>& v, int64_t first, int64_t n) {
        return std::vector<float>(v.begin() + first, v.begin() + first + n);
      };
      t.push_back({q + "gate_proj.weight", {I, H}, rows(l.w13, e * 2 * I * H, I * H)});
      t.push_back({q + "up_proj.weight", {I, H}, rows(l.w13, (e * 2 + 1) * I * H, I * H)});
      t.push_back({q + "down_proj.weight", {H, I}, rows(l.w2, e * H * I, H * I)});
    }
  }
  return t;
}

std::string temp_path(const std::string& name) {
  return (std::filesystem::temp_directory_path() /
          ("mini_engine_" + std::to_string(::getpid()) + "_" + name))
      .string();
}

template <class F>
std::string error_text(F&& f) {
  try {
    f();
  } catch (const moebius::error& e) {
    CHECK(e.code() == errc::invalid_argument);
    return e.what();
  }
  return "(no error)";
}

bool same_weights(const model_weights& a, const model_weights& b) {
  if (a.embed != b.embed || a.norm != b.norm || a.lm_head != b.lm_head) return false;
  for (size_t i = 0; i < a.layers.size(); ++i) {
    const auto &x = a.layers[i], &y = b.layers[i];
    if (x.input_layernorm != y.input_layernorm || x.q_proj != y.q_proj || x.k_proj != y.k_proj ||
        x.v_proj != y.v_proj || x.o_proj != y.o_proj || x.q_norm != y.q_norm ||
        x.k_norm != y.k_norm || x.post_attention_layernorm != y.post_attention_layernorm ||
        x.router != y.router || x.w13 != y.w13 || x.w2 != y.w2 || x.w13_scale != y.w13_scale ||
        x.w2_scale != y.w2_scale)
      return false;
  }
  return true;
}

}  // namespace

TEST_CASE("safetensors: a written checkpoint loads back and runs like the reference",
          "[safetensors]") {
  const model_config c = tiny();
  const model_weights w = make_weights(c, 31);
  const auto tensors = hf_tensors(w);

  SECTION("F32, one file: every tensor exact; runtime logits match the reference") {
    const std::string path = temp_path("f32.safetensors");
    write_safetensors(path, tensors, false);
    const safetensors_file f(path);
    CHECK(f.metadata().at("format") == "pt");
    CHECK(f.metadata().at("note") == "a \"tiny\" one");
    const model_weights loaded = load_qwen3_moe(c, {path});
    CHECK(same_weights(loaded, w));

    for (int P : {1, 2}) {
      host_runtime_options o;
      o.num_ranks = P;
      host_runtime rt(loaded, o);
      mini_engine::testing::static_state st(rt, moebius::parallel_mode::ep);
      const std::vector<std::vector<int32_t>> prompts = {{1, 2, 3, 4, 5}, {200, 7}};
      const auto runs = mini_engine::testing::drive(rt, st.driver, prompts, 8, 2);
      for (const auto& run : runs) {
        const auto ref = reference_logits(
            loaded, std::span<const int32_t>(run.tokens).first(run.tokens.size() - 1));
        for (size_t v = 0; v < ref.back().size(); ++v)
          REQUIRE(std::fabs(run.logits.back()[v] - ref.back()[v]) <=
                  1e-4 * std::max(1.0, std::fabs(ref.back()[v])) + 1e-4);
      }
    }
    std::filesystem::remove(path);
  }

  SECTION("BF16, two shards, bf16 experts: tensors are the bf16 roundings") {
    const std::string a = temp_path("shard1.safetensors"), b = temp_path("shard2.safetensors");
    const size_t half = tensors.size() / 2;
    write_safetensors(a, {tensors.begin(), tensors.begin() + static_cast<ptrdiff_t>(half)}, true);
    write_safetensors(b, {tensors.begin() + static_cast<ptrdiff_t>(half), tensors.end()}, true);
    model_config cb = c;
    cb.expert_dtype = moebius::dtype::bf16;
    const model_weights loaded = load_qwen3_moe(cb, {a, b});
    for (size_t i = 0; i < w.embed.size(); ++i) REQUIRE(loaded.embed[i] == round_bf16(w.embed[i]));
    for (size_t i = 0; i < w.layers[1].w2.size(); ++i)
      REQUIRE(loaded.layers[1].w2[i] == round_bf16(w.layers[1].w2[i]));
    for (size_t i = 0; i < w.layers[0].o_proj.size(); ++i)
      REQUIRE(loaded.layers[0].o_proj[i] == round_bf16(w.layers[0].o_proj[i]));
    std::filesystem::remove(a);
    std::filesystem::remove(b);
  }
}

TEST_CASE("safetensors: errors name the file, the tensor and the problem", "[safetensors]") {
  const model_config c = tiny();
  const model_weights w = make_weights(c, 32);
  auto tensors = hf_tensors(w);
  const std::string path = temp_path("bad.safetensors");

  SECTION("a missing tensor") {
    std::erase_if(tensors, [](const named_tensor& t) {
      return t.name == "model.layers.1.mlp.experts.3.up_proj.weight";
    });
    write_safetensors(path, tensors, false);
    const std::string what = error_text([&] { load_qwen3_moe(c, {path}); });
    CHECK(what.find("model.layers.1.mlp.experts.3.up_proj.weight is missing") != std::string::npos);
  }
  SECTION("a misshapen tensor") {
    for (auto& t : tensors)
      if (t.name == "model.layers.0.self_attn.k_proj.weight") t.shape = {c.hidden, c.kv_dim()};
    write_safetensors(path, tensors, false);
    const std::string what = error_text([&] { load_qwen3_moe(c, {path}); });
    INFO(what);
    CHECK(what.find("model.layers.0.self_attn.k_proj.weight has shape [64, 32], the model "
                    "needs [32, 64]") != std::string::npos);
  }
  SECTION("a truncated file") {
    write_safetensors(path, tensors, false);
    std::filesystem::resize_file(path, std::filesystem::file_size(path) - 5);
    const std::string what = error_text([&] { safetensors_file f(path); });
    CHECK(what.find("run past the end") != std::string::npos);
  }
  SECTION("a broken header") {
    std::ofstream out(path, std::ios::binary);
    const std::string header = "{\"x\": {\"dtype\": \"F32\", \"shape\": [1], ";
    const uint64_t n = header.size();
    for (int i = 0; i < 8; ++i) out.put(static_cast<char>((n >> (8 * i)) & 0xff));
    out << header;
    out.close();
    CHECK(error_text([&] { safetensors_file f(path); }).find("bad JSON header") !=
          std::string::npos);
  }
  SECTION("a header length beyond the file") {
    std::ofstream out(path, std::ios::binary);
    for (int i = 0; i < 8; ++i) out.put(static_cast<char>(i == 1 ? 1 : 0));  // 256
    out << "{}";
    out.close();
    CHECK(error_text([&] { safetensors_file f(path); }).find("exceeds") != std::string::npos);
  }
  SECTION("no file") {
    CHECK(error_text([&] { safetensors_file f(path + ".none"); }).find("cannot open") !=
          std::string::npos);
  }
  std::filesystem::remove(path);
}
