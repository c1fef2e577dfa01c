#pragma once

// Where a checkpoint loader puts each tensor: a runtime's own buffers (host_runtime,
// gpu_runtime) or the logical model_weights (the reference, tests). The loader hands over one
// tensor at a time as it lies in a memory-mapped shard (tensor_source), and the sink converts
// it once, straight into its destination (experts: place_expert_part, weights.hpp).

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <moebius/layout/dtype.hpp>
#include <string_view>

#include "numerics.hpp"

namespace mini_engine {

static_assert(std::endian::native == std::endian::little,
              "safetensors data is little-endian; the loader reads it in place");

// The Qwen3-MoE tensors, by their Hugging Face names:
//   embed       model.embed_tokens.weight                     [V, H]
//   lm_head     lm_head.weight (the embedding when tied)      [V, H]
//   norm        model.norm.weight                             [H]
//   per layer i, model.layers.{i}.:
//   input_layernorm, post_attention_layernorm  .weight        [H]
//   q_proj, k_proj, v_proj, o_proj   self_attn.*.weight       [Hq*D, H], [Hkv*D, H] x2, [H, Hq*D]
//   q_norm, k_norm                   self_attn.*.weight       [D]
//   router                           mlp.gate.weight          [E, H]
//   gate_proj, up_proj, down_proj    mlp.experts.{e}.*.weight [I, H], [I, H], [H, I]
enum class hf_tensor : uint8_t {
  embed,
  lm_head,
  norm,
  input_layernorm,
  post_attention_layernorm,
  q_proj,
  k_proj,
  v_proj,
  o_proj,
  q_norm,
  k_norm,
  router,
  gate_proj,
  up_proj,
  down_proj,
};

constexpr bool is_expert(hf_tensor t) {
  return t == hf_tensor::gate_proj || t == hf_tensor::up_proj || t == hf_tensor::down_proj;
}

// One tensor's bytes in a mapped shard, read as a [rows, cols] row-major matrix (a 1-D
// tensor is one row) and decoded on read. F8_E4M3 carries its block scales (the checkpoint's
// weight_scale_inv, already as float): element (r, c) is
//   code(r, c) * scales[(r / block) * scale_cols + c / block],
// exact in double (a 4-bit significand times a float).
struct tensor_source {
  std::string_view name;  // the checkpoint's name, for errors
  moebius::dtype dtype = moebius::dtype::fp32;  // fp32, bf16, fp16 or fp8_e4m3
  int64_t rows = 1, cols = 0;
  const std::byte* data = nullptr;
  const float* scales = nullptr;  // fp8_e4m3 only
  int64_t block = 0;              // fp8_e4m3: the square block's side
  int64_t scale_cols = 0;         // fp8_e4m3: ceil(cols / block)

  int64_t numel() const { return rows * cols; }
  int64_t elem_bytes() const { return moebius::dtype_bytes(dtype); }
  // The stored bytes of elements [c0, c0 + n) of row r (copy them when the dtypes agree).
  const std::byte* at(int64_t r, int64_t c0) const {
    return data + (r * cols + c0) * elem_bytes();
  }
  // The value of element (r, c) as double (exact for every dtype).
  double value(int64_t r, int64_t c) const {
    const std::byte* p = at(r, c);
    switch (dtype) {
      case moebius::dtype::fp32: {
        float f;
        std::memcpy(&f, p, 4);
        return f;
      }
      case moebius::dtype::bf16:
      case moebius::dtype::fp16: {
        uint16_t u;
        std::memcpy(&u, p, 2);
        return dtype == moebius::dtype::bf16 ? from_bf16(u) : from_fp16(u);
      }
      default:
        return static_cast<double>(from_fp8_e4m3(static_cast<uint8_t>(*p))) *
               static_cast<double>(scales[(r / block) * scale_cols + c / block]);
    }
  }
  // Elements [c0, c0 + n) of row r as T (float: each value rounded once to float; double:
  // exact).
  template <class T>
  void read_row(int64_t r, int64_t c0, int64_t n, T* out) const {
    if (dtype == moebius::dtype::fp32) {  // the common case without a switch per element
      for (int64_t j = 0; j < n; ++j) {
        float f;
        std::memcpy(&f, at(r, c0 + j), 4);
        out[j] = static_cast<T>(f);
      }
      return;
    }
    for (int64_t j = 0; j < n; ++j) out[j] = static_cast<T>(value(r, c0 + j));
  }
  template <class T>
  void read_all(T* out) const {
    for (int64_t r = 0; r < rows; ++r) read_row(r, 0, cols, out + r * cols);
  }
};

class weight_sink {
 public:
  virtual ~weight_sink() = default;
  // Tensor `t` of `layer` (-1 for embed, lm_head, norm) and, for experts, of `expert` (-1
  // otherwise). Each tensor of the model arrives exactly once, in the checkpoint's order;
  // its shape is the model's (checked by the loader).
  virtual void put(hf_tensor t, int64_t layer, int64_t expert, const tensor_source& src) = 0;
};

}  // namespace mini_engine
