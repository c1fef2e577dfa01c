#pragma once

// A reader of the safetensors format, and a loader of Hugging Face Qwen3-MoE checkpoints
// into the mini-engine's weights.
//
// Format: an 8-byte little-endian header length N, N bytes of JSON
//   {"<name>": {"dtype": "F32", "shape": [rows, cols], "data_offsets": [begin, end]}, ...,
//    "__metadata__": {"format": "pt"}}
// then the data section; offsets are relative to its start, tensors are row-major.

#include <cstddef>
#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "weights.hpp"

namespace mini_engine {

struct safetensors_entry {
  std::string name;
  std::string dtype;  // "F32", "BF16", ... as written
  std::vector<int64_t> shape;
  int64_t begin = 0, end = 0;  // byte range within the data section
};

class safetensors_file {
 public:
  // Reads and checks the whole file: throws moebius::error(errc::invalid_argument) naming
  // the file and the problem (unreadable, truncated, bad JSON, offsets outside the data or
  // not matching dtype x shape).
  explicit safetensors_file(const std::string& path);

  const std::string& path() const { return path_; }
  const std::vector<safetensors_entry>& entries() const { return entries_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const safetensors_entry* find(std::string_view name) const;

  // Tensor `name` as float, checked against `shape`. F32 and BF16 are read exactly; other
  // dtypes throw. Throws errc::invalid_argument naming the tensor when it is missing or has
  // another shape.
  std::vector<float> read(std::string_view name, std::span<const int64_t> shape) const;

 private:
  std::string path_;
  std::vector<std::byte> data_;  // the data section
  std::vector<safetensors_entry> entries_;
  std::map<std::string, std::string> metadata_;
};

// Loads a Qwen3-MoE checkpoint (one or more .safetensors shards; each tensor in one of
// them) into weights of `config`:
//   model.embed_tokens.weight, model.norm.weight, lm_head.weight,
//   model.layers.{i}.input_layernorm.weight, .post_attention_layernorm.weight,
//   model.layers.{i}.self_attn.{q,k,v,o}_proj.weight, .self_attn.{q,k}_norm.weight,
//   model.layers.{i}.mlp.gate.weight, model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight
// Experts are then rounded to config.expert_dtype (round_experts). Throws
// errc::invalid_argument naming the missing tensor, or the tensor with its expected and
// found shapes.
model_weights load_qwen3_moe(const model_config& config, const std::vector<std::string>& paths);

}  // namespace mini_engine
