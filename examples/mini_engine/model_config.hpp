#pragma once

// The mini-engine's model: a Qwen3-MoE-style decoder (RMSNorm, GQA attention with RoPE and
// per-head q/k RMSNorm over a paged KV cache, a softmax top-k MoE FFN with (optionally)
// renormalised weights and fused gate/up SiLU experts, an LM head). Every layer is an MoE
// layer.
//
// The configuration maps onto Moebius's two descriptors: expert_shape (the experts in the
// arena) and kv_geometry (the paged KV pool).

#include <cstdint>
#include <iosfwd>
#include <moebius/kv/kv_geometry.hpp>
#include <moebius/layout/dtype.hpp>
#include <moebius/layout/expert_shape.hpp>
#include <string>

namespace mini_engine {

struct model_config {
  int64_t num_layers = 2;     // L
  int64_t hidden = 64;        // H
  int64_t num_q_heads = 4;    // Hq
  int64_t num_kv_heads = 2;   // Hkv (GQA: Hq / Hkv query heads share one KV head)
  int64_t head_dim = 16;      // D (even: RoPE rotates halves)
  int64_t num_experts = 8;    // E
  int64_t top_k = 2;          // experts per token
  int64_t intermediate = 32;  // I: per-expert intermediate size
  int64_t vocab = 256;        // V
  double rope_theta = 1e6;
  double rms_eps = 1e-6;
  // Whether the top-k router probabilities are renormalised to sum to 1 (Hugging Face
  // `norm_topk_prob`; Qwen3-MoE releases set it true). False: each chosen expert weighs its
  // softmax probability over all E experts.
  bool norm_topk_prob = true;
  // Expert weights in the arena: fp32, bf16, or fp8_e4m3 with one fp32 scale per
  // (fp8_block x fp8_block) block of each expert matrix.
  moebius::dtype expert_dtype = moebius::dtype::fp32;
  int64_t fp8_block = 128;
  moebius::dtype kv_dtype = moebius::dtype::fp32;  // fp32 or bf16
  int64_t page_size = 16;                          // tokens per KV page

  int64_t q_dim() const { return num_q_heads * head_dim; }
  int64_t kv_dim() const { return num_kv_heads * head_dim; }
  bool fp8_experts() const { return expert_dtype == moebius::dtype::fp8_e4m3; }
};

// Throws moebius::error(errc::invalid_argument) naming the field and value unless the
// config describes a model this engine can run on its own (sizes >= 1, Hkv | Hq, even head
// dim, top_k <= E, supported dtypes, whole fp8 blocks in every expert matrix, theta > 0).
void validate(const model_config& c);
// Also checks that the model can be split over `num_ranks` ranks in both modes: P | Hq,
// P | Hkv when Hkv >= P and Hkv | P when Hkv < P (kv_geometry), and the expert_shape's
// rules (P | E, P | I, whole fp8 blocks in every TP slice).
//   tiny() over P=4: ok.  small() (Hq=8) over P=16: throws "P must divide num_q_heads".
void validate(const model_config& c, int num_ranks);

// Tests: L=2, H=64, Hq=4, Hkv=2, D=16, E=8, top-2, I=32, V=256, fp32 (fp8 block 8), page 4.
model_config tiny();
// The CPU demo: L=4, H=256, Hq=8, Hkv=2, D=32, E=16, top-2, I=128, V=1024, fp32 (fp8 block
// 32), page 16.
model_config small();
// Qwen3-30B-A3B (the GPU runtime): L=48, H=2048, Hq=32, Hkv=4, D=128, E=128, top-8, I=768,
// V=151936, theta 1e6, eps 1e-6, bf16 experts and KV, page 16.
// The host demo's serving model: small enough for the host runtime to serve a 512-sequence
// rollout four times in well under a minute, splittable over P = 8 (Hq = 8, E = 16, I = 64), and
// with H_kv = 4 < P like Qwen3-235B-A22B at P = 8, so TP replicates each KV head on P / H_kv = 2
// ranks, as the priced model does: L=2, H=128, Hq=8, Hkv=4, D=16, E=16, top-2, I=64, V=512.
model_config lite();
model_config qwen3_30b_a3b();
// Qwen3-235B-A22B (the paper's model): L=94, H=4096, Hq=64, Hkv=4, D=128, E=128, top-8,
// I=1536, V=151936, theta 1e6, eps 1e-6, bf16 experts and KV, page 16.
model_config qwen3_235b_a22b();

// The arena's view of the experts: L layers of E experts, w13 = [gate; up] ([2I, H]) and
// w2 ([H, I]) in gate_first order in both modes; fp8 adds fp32 block scales.
moebius::expert_shape expert_shape_of(const model_config& c);
// The KV pool: L layers, Hkv heads of D, page_size, `num_ep_pages` EP pages per rank, HND.
moebius::kv_geometry kv_geometry_of(const model_config& c, int num_ranks, int64_t num_ep_pages);

std::ostream& operator<<(std::ostream& os, const model_config& c);

}  // namespace mini_engine
