#include "checkpoint.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <moebius/error.hpp>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "read_ahead.hpp"

namespace mini_engine {

using moebius::dtype;
using moebius::errc;
using nlohmann::json;

struct hf_checkpoint::tensor_ref {
  std::string name;
  hf_tensor kind = hf_tensor::embed;
  int64_t layer = -1, expert = -1;
  int64_t rows = 1, cols = 0;  // the model's shape as a matrix
  int shard = 0;
  const safetensors_entry* entry = nullptr;
  dtype type = dtype::fp32;
  int scale_shard = -1;  // F8_E4M3: where its weight_scale_inv lies
  const safetensors_entry* scale = nullptr;
};

namespace {

// What the model reads: name -> (kind, layer, expert, shape).
struct expected_tensor {
  hf_tensor kind;
  int64_t layer, expert;
  std::vector<int64_t> shape;
};

std::map<std::string, expected_tensor> expected_tensors(const hf_config& hc) {
  const model_config& c = hc.model;
  const int64_t H = c.hidden, I = c.intermediate, D = c.head_dim;
  std::map<std::string, expected_tensor> m;
  m["model.embed_tokens.weight"] = {hf_tensor::embed, -1, -1, {c.vocab, H}};
  m["model.norm.weight"] = {hf_tensor::norm, -1, -1, {H}};
  if (!hc.tie_word_embeddings) m["lm_head.weight"] = {hf_tensor::lm_head, -1, -1, {c.vocab, H}};
  for (int64_t i = 0; i < c.num_layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    auto add = [&](const std::string& n, hf_tensor k, std::vector<int64_t> s, int64_t e = -1) {
      m[p + n] = {k, i, e, std::move(s)};
    };
    add("input_layernorm.weight", hf_tensor::input_layernorm, {H});
    add("post_attention_layernorm.weight", hf_tensor::post_attention_layernorm, {H});
    add("self_attn.q_proj.weight", hf_tensor::q_proj, {c.q_dim(), H});
    add("self_attn.k_proj.weight", hf_tensor::k_proj, {c.kv_dim(), H});
    add("self_attn.v_proj.weight", hf_tensor::v_proj, {c.kv_dim(), H});
    add("self_attn.o_proj.weight", hf_tensor::o_proj, {H, c.q_dim()});
    add("self_attn.q_norm.weight", hf_tensor::q_norm, {D});
    add("self_attn.k_norm.weight", hf_tensor::k_norm, {D});
    add("mlp.gate.weight", hf_tensor::router, {c.num_experts, H});
    for (int64_t e = 0; e < c.num_experts; ++e) {
      const std::string q = "mlp.experts." + std::to_string(e) + ".";
      add(q + "gate_proj.weight", hf_tensor::gate_proj, {I, H}, e);
      add(q + "up_proj.weight", hf_tensor::up_proj, {I, H}, e);
      add(q + "down_proj.weight", hf_tensor::down_proj, {H, I}, e);
    }
  }
  return m;
}

bool source_dtype(const std::string& s, dtype* out) {
  if (s == "F32") *out = dtype::fp32;
  else if (s == "BF16") *out = dtype::bf16;
  else if (s == "F16") *out = dtype::fp16;
  else if (s == "F8_E4M3") *out = dtype::fp8_e4m3;
  else return false;
  return true;
}

std::string file_name(const std::string& path) {
  return std::filesystem::path(path).filename().string();
}

}  // namespace

namespace {
// Bytes in the unit that keeps 3-4 significant digits: "3.96 GB", "423.9 kB".
std::string human_bytes(double b) {
  char buf[32];
  if (b >= 1e9) std::snprintf(buf, sizeof buf, "%.2f GB", b / 1e9);
  else if (b >= 1e6) std::snprintf(buf, sizeof buf, "%.1f MB", b / 1e6);
  else std::snprintf(buf, sizeof buf, "%.1f kB", b / 1e3);
  return buf;
}
}  // namespace

std::string progress_line(const load_progress& p) {
  const double rate = p.shard_s > 0 ? static_cast<double>(p.shard_bytes) / p.shard_s : 0;
  const double overall = p.elapsed_s > 0 ? static_cast<double>(p.bytes_done) / p.elapsed_s : 0;
  const double left = static_cast<double>(p.bytes_total - p.bytes_done);
  char buf[512];
  std::snprintf(buf, sizeof buf, "shard %lld/%lld %s: %s in %.2f s (%s/s); %s of %s, ETA %.1f s",
                static_cast<long long>(p.shard + 1), static_cast<long long>(p.num_shards),
                file_name(p.path).c_str(), human_bytes(static_cast<double>(p.shard_bytes)).c_str(),
                p.shard_s, human_bytes(rate).c_str(),
                human_bytes(static_cast<double>(p.bytes_done)).c_str(),
                human_bytes(static_cast<double>(p.bytes_total)).c_str(),
                overall > 0 ? left / overall : 0.0);
  return buf;
}

hf_checkpoint::~hf_checkpoint() = default;
hf_checkpoint::hf_checkpoint(hf_checkpoint&&) noexcept = default;
hf_checkpoint& hf_checkpoint::operator=(hf_checkpoint&&) noexcept = default;

hf_checkpoint::hf_checkpoint(const std::string& dir) : source_(dir) {
  namespace fs = std::filesystem;
  MOEBIUS_CHECK(fs::is_directory(dir), errc::invalid_argument, "checkpoint ", dir,
                ": not a directory");
  const fs::path root(dir);
  const std::string config_path = (root / "config.json").string();
  MOEBIUS_CHECK(fs::exists(config_path), errc::invalid_argument, "checkpoint ", dir,
                ": no config.json");
  config_ = read_hf_config(config_path);

  const std::string index_path = (root / "model.safetensors.index.json").string();
  if (!fs::exists(index_path)) {
    const std::string single = (root / "model.safetensors").string();
    MOEBIUS_CHECK(fs::exists(single), errc::invalid_argument, "checkpoint ", dir,
                  ": neither model.safetensors.index.json nor model.safetensors");
    shards_.push_back(std::make_unique<safetensors_file>(single));
    resolve("", nullptr);
    return;
  }
  std::ifstream in(index_path, std::ios::binary);
  MOEBIUS_CHECK(in.good(), errc::invalid_argument, "index ", index_path, ": cannot open");
  json index;
  try {
    index = json::parse(in);
  } catch (const json::parse_error& e) {
    MOEBIUS_FAIL(errc::invalid_argument, "index ", index_path, ": not JSON (", e.what(), ")");
  }
  MOEBIUS_CHECK(index.is_object() && index.contains("weight_map") &&
                    index["weight_map"].is_object(),
                errc::invalid_argument, "index ", index_path,
                ": has no weight_map object {tensor: shard file}");
  std::vector<std::pair<std::string, std::string>> weight_map;
  std::map<std::string, int> shard_of_file;
  for (const auto& [name, file] : index["weight_map"].items()) {
    MOEBIUS_CHECK(file.is_string(), errc::invalid_argument, "index ", index_path,
                  ": the shard of tensor ", name, " is not a file name");
    const std::string f = file.get<std::string>();
    MOEBIUS_CHECK(!f.empty() && f.find('/') == std::string::npos && f != "." && f != "..",
                  errc::invalid_argument, "index ", index_path, ": tensor ", name,
                  " names shard '", f, "', not a file in the checkpoint's directory");
    weight_map.emplace_back(name, f);
    shard_of_file.emplace(f, 0);
  }
  // Shards in name order (model-00001-of-000NN first): the order a load reads them.
  for (auto& [f, idx] : shard_of_file) {
    const std::string path = (root / f).string();
    if (!fs::exists(path)) {
      std::string for_tensor;
      for (const auto& [name, file] : weight_map)
        if (file == f) {
          for_tensor = name;
          break;
        }
      MOEBIUS_FAIL(errc::invalid_argument, "index ", index_path, " names shard ", f,
                   " (for tensor ", for_tensor, " and others), which does not exist");
    }
    idx = static_cast<int>(shards_.size());
    shards_.push_back(std::make_unique<safetensors_file>(path));
  }
  // Every tensor the index names must be in the shard it names.
  for (const auto& [name, f] : weight_map)
    MOEBIUS_CHECK(shards_[static_cast<size_t>(shard_of_file.at(f))]->find(name) != nullptr,
                  errc::invalid_argument, "index ", index_path, " puts tensor ", name,
                  " in shard ", f, ", which has no such tensor");
  resolve(index_path, &weight_map);
}

hf_checkpoint::hf_checkpoint(const hf_config& config, const std::vector<std::string>& paths)
    : config_(config), source_(paths.empty() ? std::string("(no shards)") : paths.front()) {
  MOEBIUS_CHECK(!paths.empty(), errc::invalid_argument, "checkpoint: no shard files given");
  validate(config_.model);
  for (const auto& p : paths) shards_.push_back(std::make_unique<safetensors_file>(p));
  resolve("", nullptr);
}

void hf_checkpoint::resolve(const std::string& index_path,
                            const std::vector<std::pair<std::string, std::string>>* weight_map) {
  // Where each tensor lies: the index's shard, or the one shard holding it.
  std::map<std::string, int> where;
  if (weight_map) {
    std::map<std::string, int> shard_index;
    for (size_t s = 0; s < shards_.size(); ++s) shard_index[file_name(shards_[s]->path())] = static_cast<int>(s);
    for (const auto& [name, f] : *weight_map) where[name] = shard_index.at(f);
  } else {
    for (size_t s = 0; s < shards_.size(); ++s)
      for (const auto& e : shards_[s]->entries()) {
        const auto [it, fresh] = where.emplace(e.name, static_cast<int>(s));
        MOEBIUS_CHECK(fresh, errc::invalid_argument, "checkpoint ", source_, ": tensor ", e.name,
                      " is in both ", shards_[static_cast<size_t>(it->second)]->path(), " and ",
                      shards_[s]->path());
      }
  }
  const std::string listing =
      weight_map ? "index " + index_path
                 : std::to_string(shards_.size()) + " shard file(s) from " + shards_[0]->path();

  const auto expected = expected_tensors(config_);
  std::set<std::string> used;
  for (const auto& [name, x] : expected) {
    const auto it = where.find(name);
    MOEBIUS_CHECK(it != where.end(), errc::invalid_argument, "checkpoint ", source_, ": tensor ",
                  name, " is missing from the checkpoint (", listing, ")");
    const safetensors_file& f = *shards_[static_cast<size_t>(it->second)];
    const safetensors_entry* e = f.find(name);
    MOEBIUS_CHECK(e->shape == x.shape, errc::invalid_argument, "checkpoint ", f.path(),
                  ": tensor ", name, " has shape ", shape_text(e->shape), ", the model needs ",
                  shape_text(x.shape));
    tensor_ref t;
    t.name = name;
    t.kind = x.kind;
    t.layer = x.layer;
    t.expert = x.expert;
    t.rows = x.shape.size() == 2 ? x.shape[0] : 1;
    t.cols = x.shape.back();
    t.shard = it->second;
    t.entry = e;
    MOEBIUS_CHECK(source_dtype(e->dtype, &t.type), errc::invalid_argument, "checkpoint ",
                  f.path(), ": tensor ", name, " is ", e->dtype,
                  "; the loader reads F32, BF16, F16 and F8_E4M3");
    if (t.type == dtype::fp8_e4m3) {
      MOEBIUS_CHECK(config_.fp8, errc::invalid_argument, "checkpoint ", f.path(), ": tensor ",
                    name, " is F8_E4M3 but config.json has no fp8 quantization_config "
                    "(weight_block_size)");
      const std::string sname = name + "_scale_inv";
      const auto sit = where.find(sname);
      MOEBIUS_CHECK(sit != where.end(), errc::invalid_argument, "checkpoint ", f.path(),
                    ": tensor ", name, " is F8_E4M3 without its block scales ", sname);
      const safetensors_file& sf = *shards_[static_cast<size_t>(sit->second)];
      const safetensors_entry* se = sf.find(sname);
      const int64_t b = config_.fp8_block;
      const std::vector<int64_t> want = {(t.rows + b - 1) / b, (t.cols + b - 1) / b};
      MOEBIUS_CHECK(x.shape.size() == 2 && se->shape == want, errc::invalid_argument,
                    "checkpoint ", sf.path(), ": tensor ", sname, " has shape ",
                    shape_text(se->shape), ", ", name, " in blocks of ", b, " needs ",
                    shape_text(want));
      MOEBIUS_CHECK(se->dtype == "F32" || se->dtype == "BF16", errc::invalid_argument,
                    "checkpoint ", sf.path(), ": tensor ", sname, " is ", se->dtype,
                    "; block scales must be F32 or BF16");
      t.scale_shard = sit->second;
      t.scale = se;
      used.insert(sname);
    }
    used.insert(name);
    bytes_ += e->end - e->begin + (t.scale ? t.scale->end - t.scale->begin : 0);
    tensors_.push_back(std::move(t));
  }
  // A tensor the model does not read is a feature the engine would silently drop (a bias, a
  // shared expert, a dense MLP, a final norm's bias): refuse it. Only what transformers itself
  // recomputes or ties is ignored: rotary tables (`*.rotary_emb.inv_freq`, which older
  // transformers saved) and the lm_head of a model whose embeddings are tied.
  const bool tied = config_.tie_word_embeddings;
  auto ignorable = [tied](const std::string& name) {
    return name.ends_with(".rotary_emb.inv_freq") || (tied && name == "lm_head.weight");
  };
  for (const auto& [name, s] : where)
    MOEBIUS_CHECK(used.count(name) || ignorable(name), errc::invalid_argument, "checkpoint ",
                  shards_[static_cast<size_t>(s)]->path(), ": tensor ", name,
                  " is not one this Qwen3-MoE engine reads (it would be ignored: a bias, a "
                  "shared expert, a dense MLP or more layers than config.json's ",
                  config_.model.num_layers, "?)");
  std::sort(tensors_.begin(), tensors_.end(), [](const tensor_ref& a, const tensor_ref& b) {
    return a.shard != b.shard ? a.shard < b.shard : a.entry->begin < b.entry->begin;
  });
}

void hf_checkpoint::check(const model_config& m) const {
  validate(m);
  const model_config& c = config_.model;
  auto same = [&](const char* field, auto mine, auto theirs) {
    MOEBIUS_CHECK(mine == theirs, errc::invalid_argument, "checkpoint ", source_,
                  ": model_config ", field, " = ", mine, ", the checkpoint's is ", theirs);
  };
  same("num_layers", m.num_layers, c.num_layers);
  same("hidden", m.hidden, c.hidden);
  same("num_q_heads", m.num_q_heads, c.num_q_heads);
  same("num_kv_heads", m.num_kv_heads, c.num_kv_heads);
  same("head_dim", m.head_dim, c.head_dim);
  same("num_experts", m.num_experts, c.num_experts);
  same("top_k", m.top_k, c.top_k);
  same("intermediate", m.intermediate, c.intermediate);
  same("vocab", m.vocab, c.vocab);
  same("rope_theta", m.rope_theta, c.rope_theta);
  same("rms_eps", m.rms_eps, c.rms_eps);
  same("norm_topk_prob", m.norm_topk_prob, c.norm_topk_prob);
  if (!m.fp8_experts()) return;
  for (const tensor_ref& t : tensors_)
    if (is_expert(t.kind))
      MOEBIUS_CHECK(t.type == dtype::fp8_e4m3 && config_.fp8_block == m.fp8_block,
                    errc::invalid_argument, "checkpoint ", shards_[static_cast<size_t>(t.shard)]->path(),
                    ": tensor ", t.name, " is ", t.entry->dtype,
                    config_.fp8 ? " in blocks of " + std::to_string(config_.fp8_block) : std::string(),
                    "; fp8_e4m3 experts of block ", m.fp8_block,
                    " need F8_E4M3 tensors of that block (load bf16 or fp32 experts instead)");
}

void hf_checkpoint::load(const model_config& model, weight_sink& sink,
                         const std::function<void(const load_progress&)>& progress) const {
  check(model);
  using clock = std::chrono::steady_clock;
  const auto t0 = clock::now();
  // FP8 block scales first, as float (small: one per block of 128 x 128 elements), so that a
  // weight and its scales may lie in different shards.
  std::map<const safetensors_entry*, std::vector<float>> scales;
  for (size_t s = 0; s < shards_.size(); ++s) {
    bool any = false;
    for (const tensor_ref& t : tensors_) any = any || t.scale_shard == static_cast<int>(s);
    if (!any) continue;
    const auto m = shards_[s]->map();
    for (const tensor_ref& t : tensors_) {
      if (t.scale_shard != static_cast<int>(s)) continue;
      std::vector<float>& v = scales[t.scale];
      v.resize(static_cast<size_t>(t.scale->numel()));
      tensor_source src;
      src.name = t.scale->name;
      source_dtype(t.scale->dtype, &src.dtype);
      src.cols = t.scale->numel();
      src.data = m.data() + t.scale->begin;
      src.read_all(v.data());
    }
  }
  load_progress p;
  p.num_shards = num_shards();
  p.bytes_total = bytes_;
  for (size_t s = 0; s < shards_.size(); ++s) {
    const auto ts = clock::now();
    int64_t shard_bytes = 0;
    {
      const auto m = shards_[s]->map();
      // The disk reads ahead while the sink converts and uploads (read_ahead.hpp).
      file_read_ahead ahead(shards_[s]->path(), read_ahead_bytes_);
      for (const tensor_ref& t : tensors_) {
        if (t.shard != static_cast<int>(s)) continue;
        ahead.consumed(t.entry->begin);  // data offsets trail file offsets by the header
        tensor_source src;
        src.name = t.name;
        src.dtype = t.type;
        src.rows = t.rows;
        src.cols = t.cols;
        src.data = m.data() + t.entry->begin;
        if (t.scale) {
          src.scales = scales.at(t.scale).data();
          src.block = config_.fp8_block;
          src.scale_cols = (t.cols + src.block - 1) / src.block;
        }
        sink.put(t.kind, t.layer, t.expert, src);
        if (t.kind == hf_tensor::embed && config_.tie_word_embeddings)
          sink.put(hf_tensor::lm_head, -1, -1, src);
        shard_bytes += t.entry->end - t.entry->begin + (t.scale ? t.scale->end - t.scale->begin : 0);
      }
    }  // unmapped here: one shard at a time
    p.shard = static_cast<int64_t>(s);
    p.path = shards_[s]->path();
    p.shard_bytes = shard_bytes;
    p.bytes_done += shard_bytes;
    p.shard_s = std::chrono::duration<double>(clock::now() - ts).count();
    p.elapsed_s = std::chrono::duration<double>(clock::now() - t0).count();
    if (progress) progress(p);
  }
}

namespace {

// Into model_weights: every tensor decoded to float.
class weights_sink final : public weight_sink {
 public:
  explicit weights_sink(model_weights& w) : w_(w) {}
  void put(hf_tensor t, int64_t layer, int64_t e, const tensor_source& src) override {
    const model_config& c = w_.config;
    const int64_t H = c.hidden, I = c.intermediate;
    auto into = [&](std::vector<float>& v, int64_t offset = 0) {
      src.read_all(v.data() + offset);
    };
    if (t == hf_tensor::embed) return into(w_.embed);
    if (t == hf_tensor::lm_head) return into(w_.lm_head);
    if (t == hf_tensor::norm) return into(w_.norm);
    layer_weights& l = w_.layers[static_cast<size_t>(layer)];
    switch (t) {
      case hf_tensor::input_layernorm: return into(l.input_layernorm);
      case hf_tensor::post_attention_layernorm: return into(l.post_attention_layernorm);
      case hf_tensor::q_proj: return into(l.q_proj);
      case hf_tensor::k_proj: return into(l.k_proj);
      case hf_tensor::v_proj: return into(l.v_proj);
      case hf_tensor::o_proj: return into(l.o_proj);
      case hf_tensor::q_norm: return into(l.q_norm);
      case hf_tensor::k_norm: return into(l.k_norm);
      case hf_tensor::router: return into(l.router);
      case hf_tensor::gate_proj: return into(l.w13, e * 2 * I * H);
      case hf_tensor::up_proj: return into(l.w13, (e * 2 + 1) * I * H);
      case hf_tensor::down_proj: return into(l.w2, e * H * I);
      default: return;
    }
  }

 private:
  model_weights& w_;
};

}  // namespace

model_weights load_weights(const hf_checkpoint& checkpoint, const model_config& model) {
  model_config as_float = model;
  if (as_float.fp8_experts()) as_float.expert_dtype = dtype::fp32;  // floats, rounded below
  checkpoint.check(as_float);
  model_weights w = make_empty_weights(as_float);
  weights_sink sink(w);
  checkpoint.load(as_float, sink);
  w.config = model;
  round_experts(w);
  validate(w);
  return w;
}

model_weights load_qwen3_moe(const model_config& config, const std::vector<std::string>& paths) {
  hf_config hc;
  hc.model = config;
  return load_weights(hf_checkpoint(hc, paths), config);
}

}  // namespace mini_engine
