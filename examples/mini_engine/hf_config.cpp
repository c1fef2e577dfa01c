#include "hf_config.hpp"

#include <fstream>
#include <moebius/error.hpp>
#include <nlohmann/json.hpp>
#include <sstream>

namespace mini_engine {

using moebius::dtype;
using moebius::errc;
using nlohmann::json;

namespace {

class reader {
 public:
  reader(const json& j, const std::string& source) : j_(j), source_(source) {}

  template <class... Args>
  [[noreturn]] void fail(const Args&... args) const {
    moebius::detail::throw_error(errc::invalid_argument, __FILE__, __LINE__, "config.json ",
                                 source_, ": ", args...);
  }

  bool has(const char* key) const { return j_.contains(key) && !j_.at(key).is_null(); }
  // The first of the keys present (the two spellings of one field), or nullptr.
  const json* any(std::initializer_list<const char*> keys, const char** which = nullptr) const {
    for (const char* k : keys)
      if (has(k)) {
        if (which) *which = k;
        return &j_.at(k);
      }
    return nullptr;
  }

  int64_t integer(const char* key, const json& v) const {
    if (!v.is_number_integer()) fail(key, " must be an integer (got ", v.dump(), ")");
    return v.get<int64_t>();
  }
  int64_t required_int(std::initializer_list<const char*> keys) const {
    const char* which = nullptr;
    const json* v = any(keys, &which);
    if (!v) fail("missing field ", *keys.begin(), keys.size() > 1 ? " (or its other spelling)" : "");
    return integer(which, *v);
  }
  int64_t int_or(const char* key, int64_t fallback) const {
    return has(key) ? integer(key, j_.at(key)) : fallback;
  }
  double number(const char* key, const json& v) const {
    if (!v.is_number()) fail(key, " must be a number (got ", v.dump(), ")");
    return v.get<double>();
  }
  double number_or(const char* key, double fallback) const {
    return has(key) ? number(key, j_.at(key)) : fallback;
  }
  bool boolean_or(const char* key, bool fallback) const {
    if (!has(key)) return fallback;
    const json& v = j_.at(key);
    if (!v.is_boolean()) fail(key, " must be true or false (got ", v.dump(), ")");
    return v.get<bool>();
  }
  std::string string_or(const char* key, const std::string& fallback) const {
    if (!has(key)) return fallback;
    const json& v = j_.at(key);
    if (!v.is_string()) fail(key, " must be a string (got ", v.dump(), ")");
    return v.get<std::string>();
  }
  const json& at(const char* key) const { return j_.at(key); }

 private:
  const json& j_;
  const std::string& source_;
};

}  // namespace

hf_config parse_hf_config(std::string_view text, const std::string& source) {
  json j;
  try {
    j = json::parse(text.begin(), text.end());
  } catch (const json::parse_error& e) {
    moebius::detail::throw_error(errc::invalid_argument, __FILE__, __LINE__, "config.json ",
                                 source, ": not JSON (", e.what(), ")");
  }
  if (!j.is_object())
    moebius::detail::throw_error(errc::invalid_argument, __FILE__, __LINE__, "config.json ",
                                 source, ": not a JSON object (got ", j.type_name(), ")");
  const reader r(j, source);

  // What the engine runs: every layer a Qwen3 MoE layer, full attention, plain RoPE.
  const std::string type = r.string_or("model_type", "");
  if (type != "qwen3_moe")
    r.fail("model_type '", type, "' is not supported (the engine runs qwen3_moe)");
  if (r.has("mlp_only_layers")) {
    const json& v = r.at("mlp_only_layers");
    if (!v.is_array() || !v.empty())
      r.fail("mlp_only_layers ", v.dump(), " is not supported (every layer must be an MoE layer)");
  }
  if (const int64_t step = r.int_or("decoder_sparse_step", 1); step != 1)
    r.fail("decoder_sparse_step ", step, " is not supported (every layer must be an MoE layer: 1)");
  if (r.boolean_or("use_sliding_window", false))
    r.fail("use_sliding_window true is not supported (full attention only)");
  if (r.has("layer_types")) {
    const json& v = r.at("layer_types");
    if (!v.is_array()) r.fail("layer_types must be an array (got ", v.dump(), ")");
    for (size_t i = 0; i < v.size(); ++i)
      if (v[i] != "full_attention")
        r.fail("layer_types[", i, "] ", v[i].dump(), " is not supported (full_attention only)");
  }
  if (r.boolean_or("attention_bias", false))
    r.fail("attention_bias true is not supported (the projections have no bias)");
  if (r.has("rope_scaling")) {
    const json& v = r.at("rope_scaling");
    // Only the plain type is accepted; a type that is not a string is refused like any other
    // (v.value() would throw nlohmann's error, which names neither file nor field).
    const auto is_default = [&](const char* key) {
      return v.contains(key) && v.at(key).is_string() && v.at(key).get<std::string>() == "default";
    };
    if (!(v.is_object() && (v.contains("rope_type") ? is_default("rope_type") : is_default("type"))))
      r.fail("rope_scaling ", v.dump(), " is not supported (plain RoPE only)");
  }
  if (const int64_t shared = r.int_or("shared_expert_intermediate_size", 0); shared > 0)
    r.fail("shared_expert_intermediate_size ", shared, " is not supported (no shared experts)");
  if (const std::string act = r.string_or("hidden_act", "silu"); act != "silu")
    r.fail("hidden_act '", act, "' is not supported (silu only)");

  hf_config out;
  model_config& c = out.model;
  c.num_layers = r.required_int({"num_hidden_layers"});
  c.hidden = r.required_int({"hidden_size"});
  c.num_q_heads = r.required_int({"num_attention_heads"});
  // Qwen3MoeConfig's default is 4 KV heads, not one per query head (no fallback to
  // num_attention_heads, unlike the older Llama-style configs).
  c.num_kv_heads = r.int_or("num_key_value_heads", 4);
  c.head_dim = r.int_or("head_dim", c.num_q_heads > 0 ? c.hidden / c.num_q_heads : 0);
  c.num_experts = r.required_int({"num_experts", "num_local_experts"});
  c.top_k = r.required_int({"num_experts_per_tok"});
  c.intermediate = r.required_int({"moe_intermediate_size"});
  c.vocab = r.required_int({"vocab_size"});
  c.rms_eps = r.number_or("rms_norm_eps", 1e-6);
  c.norm_topk_prob = r.boolean_or("norm_topk_prob", false);
  out.tie_word_embeddings = r.boolean_or("tie_word_embeddings", false);

  // RoPE: rope_theta at the top level (published configs), or in rope_parameters
  // (transformers 5), whose rope_type must be the plain one.
  c.rope_theta = 1e4;
  if (r.has("rope_parameters")) {
    const json& p = r.at("rope_parameters");
    if (!p.is_object()) r.fail("rope_parameters must be an object (got ", p.dump(), ")");
    const reader pr(p, source);
    if (const std::string t = pr.string_or("rope_type", "default"); t != "default")
      r.fail("rope_parameters.rope_type '", t, "' is not supported (plain RoPE only)");
    if (pr.has("rope_theta")) c.rope_theta = pr.number("rope_parameters.rope_theta", p.at("rope_theta"));
  }
  if (r.has("rope_theta")) c.rope_theta = r.number("rope_theta", r.at("rope_theta"));

  const char* dtype_key = nullptr;
  const json* dt = r.any({"dtype", "torch_dtype"}, &dtype_key);
  const std::string dts = dt ? (dt->is_string() ? dt->get<std::string>() : dt->dump()) : "bfloat16";
  if (dts == "bfloat16") out.dtype = dtype::bf16;
  else if (dts == "float32") out.dtype = dtype::fp32;
  else if (dts == "float16") out.dtype = dtype::fp16;
  else r.fail(dtype_key, " '", dts, "' is not supported (bfloat16, float16 or float32)");

  if (r.has("quantization_config")) {
    const json& q = r.at("quantization_config");
    if (!q.is_object()) r.fail("quantization_config must be an object (got ", q.dump(), ")");
    const reader qr(q, source);
    const std::string method = qr.string_or("quant_method", "");
    if (method != "fp8")
      r.fail("quantization_config.quant_method '", method, "' is not supported (fp8 only)");
    if (const std::string fmt = qr.string_or("fmt", "e4m3"); fmt != "e4m3")
      r.fail("quantization_config.fmt '", fmt, "' is not supported (e4m3 only)");
    if (!q.contains("weight_block_size") || !q.at("weight_block_size").is_array() ||
        q.at("weight_block_size").size() != 2 || !q.at("weight_block_size")[0].is_number_integer() ||
        q.at("weight_block_size")[0] != q.at("weight_block_size")[1])
      r.fail("quantization_config.weight_block_size ",
             q.contains("weight_block_size") ? q.at("weight_block_size").dump() : "(missing)",
             " is not supported (square blocks [b, b] only)");
    out.fp8 = true;
    out.fp8_block = q.at("weight_block_size")[0].get<int64_t>();
  }

  c.expert_dtype = out.fp8 ? dtype::fp8_e4m3 : out.dtype == dtype::bf16 ? dtype::bf16 : dtype::fp32;
  if (out.fp8) c.fp8_block = out.fp8_block;
  c.kv_dtype = dtype::fp32;
  c.page_size = 16;
  try {
    validate(c);
  } catch (const moebius::error& e) {
    r.fail("the model it describes cannot run: ", e.what());
  }
  return out;
}

hf_config read_hf_config(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  MOEBIUS_CHECK(in.good(), errc::invalid_argument, "config.json ", path, ": cannot open");
  std::ostringstream s;
  s << in.rdbuf();
  return parse_hf_config(s.str(), path);
}

}  // namespace mini_engine
