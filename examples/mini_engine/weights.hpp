#pragma once

// The model's logical weights (Hugging Face Qwen3-MoE names and shapes, row-major, float)
// and their placement into the Moebius expert arena.
//
// Experts are kept fused the way the arena holds them: w13 = [gate_proj; up_proj] ([2I, H]
// per expert, gate rows first) and w2 = down_proj ([H, I]). Their values are already what
// the arena stores: rounded to bf16, or for fp8 a code times its block's power-of-two scale
// (exact in float, so placing them and reading them back loses nothing). Everything else
// is float and, not being switched, is replicated whole on every rank (TP reads its head
// slices of the whole tensors).

#include <cstddef>
#include <cstdint>
#include <moebius/layout/arena_geometry.hpp>
#include <span>
#include <vector>

#include "model_config.hpp"
#include "weight_sink.hpp"

namespace mini_engine {

struct layer_weights {
  std::vector<float> input_layernorm;           // [H]
  std::vector<float> q_proj;                    // [Hq*D, H]
  std::vector<float> k_proj;                    // [Hkv*D, H]
  std::vector<float> v_proj;                    // [Hkv*D, H]
  std::vector<float> o_proj;                    // [H, Hq*D]
  std::vector<float> q_norm;                    // [D], shared by every q head
  std::vector<float> k_norm;                    // [D]
  std::vector<float> post_attention_layernorm;  // [H]
  std::vector<float> router;                    // [E, H]  (mlp.gate)
  std::vector<float> w13;                       // [E, 2I, H]: gate_proj rows, then up_proj
  std::vector<float> w2;                        // [E, H, I]: down_proj
  std::vector<float> w13_scale;                 // fp8: [E, 2I/b, H/b], powers of two
  std::vector<float> w2_scale;                  // fp8: [E, H/b, I/b]
};

struct model_weights {
  model_config config;
  std::vector<float> embed;  // [V, H]  (model.embed_tokens)
  std::vector<layer_weights> layers;
  std::vector<float> norm;     // [H]  (model.norm)
  std::vector<float> lm_head;  // [V, H]
};

// Weights drawn from splitmix64(seed) in a fixed order (embed, then per layer the tensors in
// declaration order, then norm, lm_head), uniform and scaled by sqrt(3 / fan_in) so that
// activations stay O(1); norms are 1 + U(-0.1, 0.1); the LM head is scaled 2x so logits
// are spread (greedy ties are rare). Experts are then rounded (round_experts).
model_weights make_weights(const model_config& c, uint64_t seed);

// Zero-filled tensors of the right shapes (a loader fills them in).
model_weights make_empty_weights(const model_config& c);

// Rounds the experts to what the arena holds: bf16 (nearest even), or fp8 e4m3 with one
// power-of-two scale per block (the smallest with amax / scale <= 448), filling w13_scale
// and w2_scale. Idempotent. fp32 leaves them alone.
void round_experts(model_weights& w);

// Throws errc::invalid_argument naming the tensor unless every tensor has its shape.
void validate(const model_weights& w);

// Writes the experts of `layer` into every rank's arena in `mode` (slot layer+1 in EP, slot
// layer in TP) through moebius::weight_view. `arenas[r]` is rank r's arena
// (geometry.total_bytes()); the geometry must be of expert_shape_of(w.config).
void place_layer_experts(const model_weights& w, const moebius::arena_geometry& geometry,
                         int64_t layer, moebius::parallel_mode mode,
                         std::span<const std::span<std::byte>> arenas);
// The same into one slot: `slots[r]` holds rank r's bytes of the layer's slot in `mode`
// (geometry.slot_bytes from arena byte slot_offset(slot_of(mode, layer))), so a device
// runtime uploads a layer through P slot-sized host images instead of P whole arenas.
void place_layer_experts_in_slot(const model_weights& w, const moebius::arena_geometry& geometry,
                                 int64_t layer, moebius::parallel_mode mode,
                                 std::span<const std::span<std::byte>> slots);
// One checkpoint matrix of expert `e` of `layer` straight into its home in `mode` (slot
// layer+1 in EP, slot layer in TP) through moebius::weight_view, converted once to the
// arena's dtype: gate_proj [I, H] as w13 rows [0, I), up_proj as rows [I, 2I), down_proj
// [H, I] as w2. fp32 and bf16 from any source dtype (bf16: copied from BF16, otherwise
// rounded to nearest even from the value rounded to float); fp8_e4m3 only from an F8_E4M3
// source of block c.fp8_block: codes copied, its block scales into w13_scale / w2_scale.
// `arenas[r]` holds rank r's arena bytes from arena byte `origin` (0: whole arenas; a slot's
// offset: images of that slot). Throws errc::invalid_argument naming the tensor when its
// shape or dtype does not fit, or an image is too small, before writing anything.
//   E=4, P=2, EP: expert 3's gate_proj goes to rank 1, local expert 1, rows [0, I).
//   TP: rank r gets its rows [r*I/P, (r+1)*I/P) of gate_proj, and columns of down_proj.
void place_expert_part(const model_config& c, const moebius::arena_geometry& geometry,
                       int64_t layer, moebius::parallel_mode mode, int64_t e, hf_tensor part,
                       const tensor_source& src, std::span<const std::span<std::byte>> arenas,
                       int64_t origin = 0);

// Every layer where `cursor` puts it: layers < cursor in TP, the rest in EP.
void place_experts(const model_weights& w, const moebius::arena_geometry& geometry,
                   moebius::arena_cursor cursor, std::span<const std::span<std::byte>> arenas);

}  // namespace mini_engine
