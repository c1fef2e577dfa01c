#include "model_config.hpp"

#include <moebius/error.hpp>
#include <ostream>

namespace mini_engine {

using moebius::dtype;
using moebius::errc;

void validate(const model_config& c) {
  auto positive = [](int64_t v, const char* name) {
    MOEBIUS_CHECK(v >= 1, errc::invalid_argument, "model_config: ", name, " must be >= 1 (got ", v,
                  ")");
  };
  positive(c.num_layers, "num_layers");
  positive(c.hidden, "hidden");
  positive(c.num_q_heads, "num_q_heads");
  positive(c.num_kv_heads, "num_kv_heads");
  positive(c.head_dim, "head_dim");
  positive(c.num_experts, "num_experts");
  positive(c.top_k, "top_k");
  positive(c.intermediate, "intermediate");
  positive(c.vocab, "vocab");
  positive(c.page_size, "page_size");
  MOEBIUS_CHECK(c.num_q_heads % c.num_kv_heads == 0, errc::invalid_argument,
                "model_config: num_kv_heads must divide num_q_heads (Hq=", c.num_q_heads,
                ", Hkv=", c.num_kv_heads, ")");
  MOEBIUS_CHECK(c.head_dim % 2 == 0, errc::invalid_argument,
                "model_config: head_dim must be even for RoPE (got ", c.head_dim, ")");
  MOEBIUS_CHECK(c.top_k <= c.num_experts, errc::invalid_argument,
                "model_config: top_k must be <= num_experts (top_k=", c.top_k,
                ", E=", c.num_experts, ")");
  MOEBIUS_CHECK(c.rope_theta > 0, errc::invalid_argument,
                "model_config: rope_theta must be > 0 (got ", c.rope_theta, ")");
  MOEBIUS_CHECK(c.rms_eps > 0, errc::invalid_argument, "model_config: rms_eps must be > 0 (got ",
                c.rms_eps, ")");
  MOEBIUS_CHECK(c.expert_dtype == dtype::fp32 || c.expert_dtype == dtype::bf16 ||
                    c.expert_dtype == dtype::fp8_e4m3,
                errc::invalid_argument,
                "model_config: expert_dtype must be fp32, bf16 or "
                "fp8_e4m3 (got ",
                moebius::to_string(c.expert_dtype), ")");
  MOEBIUS_CHECK(c.kv_dtype == dtype::fp32 || c.kv_dtype == dtype::bf16, errc::invalid_argument,
                "model_config: kv_dtype must be fp32 or bf16 (got ", moebius::to_string(c.kv_dtype),
                ")");
  if (c.fp8_experts()) {
    positive(c.fp8_block, "fp8_block");
    MOEBIUS_CHECK(c.hidden % c.fp8_block == 0 && c.intermediate % c.fp8_block == 0,
                  errc::invalid_argument,
                  "model_config: fp8_block must divide hidden and "
                  "intermediate (block=",
                  c.fp8_block, ", H=", c.hidden, ", I=", c.intermediate, ")");
  }
}

void validate(const model_config& c, int num_ranks) {
  validate(c);
  MOEBIUS_CHECK(num_ranks >= 1, errc::invalid_argument, "num_ranks must be >= 1 (got ", num_ranks,
                ")");
  MOEBIUS_CHECK(c.num_q_heads % num_ranks == 0, errc::invalid_argument,
                "P must divide num_q_heads for TP attention (Hq=", c.num_q_heads, ", P=", num_ranks,
                ")");
  moebius::validate(expert_shape_of(c), num_ranks);
  moebius::validate(kv_geometry_of(c, num_ranks, 1));
}

namespace {
model_config with(model_config c) {
  validate(c);
  return c;
}
}  // namespace

model_config tiny() {
  return with(model_config{.fp8_block = 8, .page_size = 4});
}

model_config small() {
  return with(model_config{.num_layers = 4,
                           .hidden = 256,
                           .num_q_heads = 8,
                           .num_kv_heads = 2,
                           .head_dim = 32,
                           .num_experts = 16,
                           .top_k = 2,
                           .intermediate = 128,
                           .vocab = 1024,
                           .fp8_block = 32,
                           .page_size = 16});
}

model_config lite() {
  return with(model_config{.num_layers = 2,
                           .hidden = 128,
                           .num_q_heads = 8,
                           .num_kv_heads = 4,
                           .head_dim = 16,
                           .num_experts = 16,
                           .top_k = 2,
                           .intermediate = 64,
                           .vocab = 512,
                           .fp8_block = 16,
                           .page_size = 16});
}

model_config qwen3_30b_a3b() {
  return with(model_config{.num_layers = 48,
                           .hidden = 2048,
                           .num_q_heads = 32,
                           .num_kv_heads = 4,
                           .head_dim = 128,
                           .num_experts = 128,
                           .top_k = 8,
                           .intermediate = 768,
                           .vocab = 151936,
                           .rope_theta = 1e6,
                           .rms_eps = 1e-6,
                           .expert_dtype = dtype::bf16,
                           .fp8_block = 128,
                           .kv_dtype = dtype::bf16,
                           .page_size = 16});
}

model_config qwen3_235b_a22b() {
  model_config c = qwen3_30b_a3b();
  c.num_layers = 94;
  c.hidden = 4096;
  c.num_q_heads = 64;
  c.intermediate = 1536;
  return with(c);
}

moebius::expert_shape expert_shape_of(const model_config& c) {
  moebius::expert_shape s;
  s.num_layers = c.num_layers;
  s.num_experts = c.num_experts;
  s.hidden = c.hidden;
  s.intermediate = c.intermediate;
  s.weight_dtype = c.expert_dtype;
  s.ep_order = moebius::gate_up_order::gate_first;
  s.tp_order = moebius::gate_up_order::gate_first;
  s.block_scales = c.fp8_experts();
  s.scale_block_n = c.fp8_block;
  s.scale_block_k = c.fp8_block;
  s.scale_dtype = dtype::fp32;
  return s;
}

moebius::kv_geometry kv_geometry_of(const model_config& c, int num_ranks, int64_t num_ep_pages) {
  return moebius::make_kv_geometry(c.num_layers, c.num_kv_heads, c.head_dim, c.page_size,
                                   num_ep_pages, num_ranks, c.kv_dtype, moebius::kv_layout::hnd);
}

std::ostream& operator<<(std::ostream& os, const model_config& c) {
  return os << "model{L=" << c.num_layers << " H=" << c.hidden << " Hq=" << c.num_q_heads
            << " Hkv=" << c.num_kv_heads << " D=" << c.head_dim << " E=" << c.num_experts << " top"
            << c.top_k << " I=" << c.intermediate << " V=" << c.vocab
            << " experts=" << moebius::to_string(c.expert_dtype)
            << (c.fp8_experts() ? " block " + std::to_string(c.fp8_block) : std::string())
            << " kv=" << moebius::to_string(c.kv_dtype) << " page=" << c.page_size
            << (c.norm_topk_prob ? "" : " top-k not renormalised") << "}";
}

}  // namespace mini_engine
