// Checkpoint directories: the test writes Hugging Face Qwen3-MoE directories itself
// (config.json in the published and the transformers 5 spellings, one model.safetensors or
// shards with an index; F32, BF16 and FP8 E4M3 with block scales), loads them straight into
// the host runtime and checks the result against runtimes built from the same weights in
// memory (bitwise) or the reference; every bad input gives an error naming the file and the
// tensor (or the config field) before anything is loaded.

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <moebius/error.hpp>
#include <moebius/layout/weight_view.hpp>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "catch.hpp"
#include "checkpoint.hpp"
#include "driver.hpp"
#include "host_runtime.hpp"
#include "numerics.hpp"
#include "reference.hpp"

using namespace mini_engine;
using moebius::dtype;
using moebius::errc;
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

struct raw_tensor {
  std::string name, dtype;
  std::vector<int64_t> shape;
  std::vector<unsigned char> bytes;
};

raw_tensor encode(const std::string& name, std::vector<int64_t> shape,
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
void write_st(const std::string& path, const std::vector<raw_tensor>& ts,
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
std::vector<raw_tensor> hf_tensors(const model_weights& w, const std::string& dt) {
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
json config_json(const model_config& c, const std::string& dt, bool published) {
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

std::string temp_dir(const std::string& name) {
  const fs::path p = fs::temp_directory_path() /
                     ("mini_engine_ck_" + std::to_string(::getpid()) + "_" + name);
  fs::remove_all(p);
  fs::create_directories(p);
  return p.string();
}

// A checkpoint directory: config.json and `shards` shard files (1: model.safetensors; more:
// model-0000k-of-0000n.safetensors with an index).
void write_dir(const std::string& dir, const json& config, const std::vector<raw_tensor>& ts,
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
    CHECK(e.code() == errc::invalid_argument);
    return e.what();
  }
  return "(no error)";
}

// Counts what reaches it: a load that fails before streaming delivers nothing.
struct counting_sink final : weight_sink {
  int64_t puts = 0;
  void put(hf_tensor, int64_t, int64_t, const tensor_source&) override { ++puts; }
};

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
