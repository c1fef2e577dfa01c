#pragma once

// The shape of a stack of MoE layers: what is sharded, not how. Views (weight_view.hpp) say
// how one rank holds it in EP or TP; the arena (arena_geometry.hpp) says where.

#include <cstdint>
#include <iosfwd>

#include "moebius/layout/dtype.hpp"
#include "moebius/layout/parallel_mode.hpp"

namespace moebius {

// Order of the two halves of the fused gate/up tensor w13 ([2I, H] per expert). vLLM and
// SGLang store gate rows first; some kernels want up first. The EP and TP runtimes may use
// different orders: the reshard swaps the halves on the way.
enum class gate_up_order : uint8_t { gate_first, up_first };

constexpr bool is_valid(gate_up_order o) {
  return o == gate_up_order::gate_first || o == gate_up_order::up_first;
}

constexpr const char* to_string(gate_up_order o) {
  switch (o) {
    case gate_up_order::gate_first: return "gate_first";
    case gate_up_order::up_first: return "up_first";
  }
  return "unknown";
}

struct expert_shape {
  int64_t num_layers = 0;    // L: MoE layers in the stack
  int64_t num_experts = 0;   // E: routed experts per layer
  int64_t hidden = 0;        // H: model hidden size (w13 columns, w2 rows)
  int64_t intermediate = 0;  // I: expert intermediate size (w13 holds 2I rows, w2 I columns)
  dtype weight_dtype = dtype::bf16;

  gate_up_order ep_order = gate_up_order::gate_first;  // w13 half order the EP runtime reads
  gate_up_order tp_order = gate_up_order::gate_first;  // w13 half order of each TP slice

  // Block-scaled FP8: one scale per (block_n x block_k) block of each weight matrix, stored
  // beside the weights and sharded with them: w13_scale [E, 2I/block_n, H/block_k],
  // w2_scale [E, H/block_n, I/block_k] (DeepSeek-V3 / Qwen3-FP8 checkpoint convention).
  bool block_scales = false;
  int64_t scale_block_n = 128;  // rows of a weight block (output dimension)
  int64_t scale_block_k = 128;  // columns of a weight block (reduction dimension)
  dtype scale_dtype = dtype::fp32;
};

// Qwen3-235B-A22B: L=94, E=128, H=4096, I=1536, bf16 (H=7168, I=2048 are DeepSeek-V3's).
constexpr expert_shape qwen3_235b_a22b() {
  expert_shape s;
  s.num_layers = 94;
  s.num_experts = 128;
  s.hidden = 4096;
  s.intermediate = 1536;
  return s;
}

// Throws moebius::error(errc::invalid_argument or errc::overflow) unless `shape` can be
// sharded over `num_ranks` ranks in both views: sizes > 0, P | E, P | I, whole scale blocks
// in every tensor and in every TP slice, and every byte count of one rank's arena fits in
// 64 bits. Allocates nothing.
//   validate(qwen3_235b_a22b(), 8)  -> ok (E/P = 16 experts, I/P = 192)
//   validate(qwen3 with block_scales, 8) -> throws: I/P = 192 is not a multiple of block_n 128
void validate(const expert_shape& shape, int num_ranks);

std::ostream& operator<<(std::ostream& os, const expert_shape& shape);

}  // namespace moebius
