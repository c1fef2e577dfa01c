#pragma once

// A Hugging Face Qwen3-MoE `config.json`, read into the mini-engine's model_config.
//
// Both spellings the field names come in are read: the published Qwen3 configs
// (`num_experts`, `rope_theta`, `torch_dtype`) and transformers 5's `save_pretrained`
// (`num_local_experts`, `rope_parameters: {rope_theta, rope_type}`, `dtype`). Fields that are
// absent take transformers' Qwen3MoeConfig defaults (num_key_value_heads 4, head_dim =
// hidden / heads, rms_norm_eps 1e-6, rope_theta 1e4, norm_topk_prob false,
// tie_word_embeddings false). A config the engine cannot run is refused with the field and its
// value named:
//   model_type other than qwen3_moe, mlp_only_layers not empty, decoder_sparse_step != 1,
//   use_sliding_window true, attention_bias true, rope scaling (rope_scaling set, or a
//   rope_type other than "default"), shared experts (shared_expert_intermediate_size > 0),
//   hidden_act other than silu, a quantization other than fp8 e4m3 with square blocks.

#include <cstdint>
#include <moebius/layout/dtype.hpp>
#include <string>
#include <string_view>

#include "model_config.hpp"

namespace mini_engine {

struct hf_config {
  // The model as the engine runs it: expert_dtype follows the checkpoint (fp32 for F32 and
  // F16 checkpoints, exact; bf16 for BF16; fp8_e4m3 with fp8_block = the quantization's block
  // for FP8), kv_dtype fp32, page_size 16. A caller may change the dtypes and page size
  // before loading (e.g. bf16 experts from an FP8 checkpoint: dequantised on load).
  model_config model;
  moebius::dtype dtype = moebius::dtype::bf16;  // torch_dtype / dtype: the tensors' dtype
  bool tie_word_embeddings = false;  // true: no lm_head.weight, the LM head is the embedding
  bool fp8 = false;                  // quantization_config: fp8 e4m3 with block scales
  int64_t fp8_block = 0;             // its weight_block_size (square), 0 without
};

// Parses `text` (the contents of `source`, named in errors). Throws
// moebius::error(errc::invalid_argument) "config.json <source>: ..." naming the field for
// text that is not JSON, a missing or mistyped field, or a config the engine cannot run.
hf_config parse_hf_config(std::string_view text, const std::string& source);
// Reads and parses the file at `path`.
hf_config read_hf_config(const std::string& path);

}  // namespace mini_engine
