#pragma once

// One rank of a P-rank deployment as a P = 1 model (bench_rank_share.cu measures it on one GPU):
// the static layout the deployment runs (how attention and experts split over the ranks), which
// share of the weights, heads, sequences and tokens a rank of that layout holds, and the link
// model that prices the collectives the emulation does not run. Host code, tested on the CPU
// (tests/test_mini_engine_rank_share.cpp).
//   Qwen3-235B-A22B, P = 8 (Hq 64, Hkv 4 < P, E 128, top-8, I 1536, V 151936):
//   TP        Hq 8, Hkv 1 (replicated on 2 ranks), V 18992, all 128 experts at I 192, top-8;
//             all B sequences, every token
//   TP dcp 2  the same model; each sequence's tokens split over the 2 ranks sharing the KV head
//             (attention over 2 x 8 q heads, gathered)
//   EP        the whole attention and LM head, 16 whole experts, top-8 of them (skew 1);
//             ceil(B/8) sequences
//   TEP dcp d TP's attention and LM head (with dcp d), 16 whole experts, top-1 of them
//             (k'' = round(8/8)); all B sequences

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <string>

#include <moebius/error.hpp>
#include <moebius/layout/parallel_layout.hpp>
#include <moebius/layout/parallel_mode.hpp>

#include "model_config.hpp"
#include "step_collectives.hpp"

namespace mini_engine {

// A static layout of a P-rank deployment: the library's parallel_layout (how attention and
// experts split over the ranks) and the decode-context-parallel degree of TP attention.
//   attention tp: each rank computes Hq/P q heads of every sequence (KV heads replicated on
//                 P/Hkv ranks when Hkv < P); with dcp > 1 the dcp ranks sharing a KV head each
//                 hold 1/dcp of every sequence's tokens (page-interleaved, kv_geometry::dcp).
//   attention ep: data-parallel: each rank runs its own ceil(B/P) sequences with every head.
//   experts tp:   each rank holds I/P of every expert and computes every token's top-k.
//   experts ep:   each rank holds E/P whole experts and computes the pairs routed to them.
// Data-parallel attention with TP experts (SGLang's DP attention over TP experts) is not
// emulated: its rank runs attention over ceil(B/P) sequences and the MoE over all B tokens,
// two token counts a P = 1 runtime cannot run in one step (refused by validate).
struct rank_layout : moebius::parallel_layout {
  int64_t dcp = 1;  // decode context parallel degree (TP attention only)

  static constexpr rank_layout tp(int64_t dcp = 1) {
    return {{moebius::parallel_mode::tp, moebius::parallel_mode::tp}, dcp};
  }
  static constexpr rank_layout ep() {
    return {{moebius::parallel_mode::ep, moebius::parallel_mode::ep}, 1};
  }
  // TP attention + EP experts (vLLM --enable-expert-parallel, TensorRT-LLM's TEP).
  static constexpr rank_layout tep(int64_t dcp = 1) {
    return {{moebius::parallel_mode::tp, moebius::parallel_mode::ep}, dcp};
  }
  friend constexpr bool operator==(const rank_layout&, const rank_layout&) = default;
};

// "TP", "TP-dcp2", "EP", "TEP", "TEP-dcp2" (the benchmark's JSON "mode").
inline std::string name_of(const rank_layout& l) {
  std::string n = l.attention == moebius::parallel_mode::ep ? "EP"
                  : l.experts == moebius::parallel_mode::ep ? "TEP"
                                                            : "TP";
  if (l.dcp != 1) n += "-dcp" + std::to_string(l.dcp);
  return n;
}

// The inverse of name_of, case-insensitive ("tep-dcp2", "TP"). Throws errc::invalid_argument.
inline rank_layout parse_rank_layout(std::string s) {
  for (char& ch : s) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  int64_t dcp = 1;
  if (const size_t at = s.find("-dcp"); at != std::string::npos) {
    const std::string digits = s.substr(at + 4);
    MOEBIUS_CHECK(!digits.empty() && digits.find_first_not_of("0123456789") == std::string::npos &&
                      digits.size() < 4,
                  moebius::errc::invalid_argument, "rank layout \"", s,
                  "\": expected tp, ep or tep, then -dcpN");
    dcp = std::stoll(digits);
    s.resize(at);
  }
  if (s == "tp") return rank_layout::tp(dcp);
  if (s == "tep") return rank_layout::tep(dcp);
  if (s == "ep" && dcp == 1) return rank_layout::ep();
  MOEBIUS_FAIL(moebius::errc::invalid_argument, "rank layout \"", s, dcp != 1 ? "-dcp.." : "",
               "\": expected tp, ep or tep (dcp with tp or tep only)");
}

// Throws errc::invalid_argument unless `full` can run layout l over P ranks: P | Hq, P | E,
// P | I (the shares are whole), no data-parallel attention with TP experts, and dcp dividing
// the KV heads' replicas (P / min(Hkv, P): Qwen3-235B at P = 8 allows dcp 1 and 2), as
// kv_geometry::dcp requires.
inline void validate(const rank_layout& l, const model_config& full, int P) {
  MOEBIUS_CHECK(P >= 1 && full.num_q_heads % P == 0 && full.num_experts % P == 0 &&
                    full.intermediate % P == 0,
                moebius::errc::invalid_argument, "rank layout: P=", P, " must divide Hq=",
                full.num_q_heads, ", E=", full.num_experts, " and I=", full.intermediate);
  MOEBIUS_CHECK(!(l.attention == moebius::parallel_mode::ep &&
                  l.experts == moebius::parallel_mode::tp),
                moebius::errc::invalid_argument,
                "rank layout: data-parallel attention with TP experts is not emulated (its "
                "attention and MoE run different token counts)");
  const int64_t replicas = P / std::min<int64_t>(full.num_kv_heads, P);
  MOEBIUS_CHECK(l.dcp >= 1 && (l.dcp == 1 || (l.attention == moebius::parallel_mode::tp &&
                                              replicas % l.dcp == 0)),
                moebius::errc::invalid_argument, "rank layout ", name_of(l), ": dcp ", l.dcp,
                " must divide the ", replicas, " ranks that replicate a KV head (TP attention)");
}

// The layout's rank as a P = 1 model (validate(l, full, P) first):
//   attention tp: Hq/P, max(1, Hkv/P), V/P (when P | V); ep: the whole attention and LM head;
//   experts tp:   I/P of all E, top-k;
//   experts ep:   E/P whole experts, each token routed to top-k' of them:
//                 data-parallel attention  k' = min(E/P, max(1, round(k x skew))) over the
//                                          rank's own sequences (its pairs: ceil(B/P) k');
//                 TP attention (TEP)       k'' = min(E/P, max(1, round(k/P x skew))) over every
//                                          token (its pairs: B k/P, the uniform mean).
// dcp changes no weight: the rank attends over dcp x its q heads (the set's, gathered) and
// 1/dcp of the tokens (rank_tokens).
//   Qwen3-235B, P 8: TEP -> Hq 8, Hkv 1, E 16, top-1, I 1536, V 18992.
inline model_config rank_share_of(model_config c, const rank_layout& l, int P, double skew) {
  const bool tp_attention = l.attention == moebius::parallel_mode::tp;
  if (tp_attention) {
    c.num_q_heads /= P;
    c.num_kv_heads = std::max<int64_t>(1, c.num_kv_heads / P);
    if (c.vocab % P == 0) c.vocab /= P;
  }
  if (l.experts == moebius::parallel_mode::tp) {
    c.intermediate /= P;
  } else {
    c.num_experts /= P;
    const double k = static_cast<double>(c.top_k) * (tp_attention ? 1.0 / P : 1.0) * skew;
    c.top_k = std::min<int64_t>(c.num_experts, std::max<int64_t>(1, std::llround(k)));
  }
  return c;
}

// The rank's sequences for a deployment batch B: TP attention all B, data-parallel ceil(B/P).
inline int64_t rank_batch(const rank_layout& l, int64_t B, int P) {
  return l.attention == moebius::parallel_mode::tp ? B : (B + P - 1) / P;
}

// Tokens of a `tokens`-token sequence the rank attends over: all of them, or with dcp > 1 the
// busiest DCP index's share of whole pages (kv_geometry::dcp_tokens_held; the DCP index holding
// the partial last page, or index 0).
//   page 16, dcp 2: 513 tokens (33 pages) -> 257 (pages 0, 2, .., 32); 8193 -> 4097.
inline int64_t rank_tokens(const rank_layout& l, int64_t tokens, int64_t page_size) {
  if (l.dcp == 1) return tokens;
  moebius::kv_geometry g;
  g.page_size = page_size;
  g.dcp = l.dcp;
  int64_t most = 0;
  for (int64_t k = 0; k < l.dcp; ++k) most = std::max(most, g.dcp_tokens_held(tokens, k));
  return most;
}

// The rank's decode step as its collectives see it (serving/step_collectives.hpp prices them):
// k_local the share's top-k (rank_share_of), so a data-parallel rank sends ceil(B/P) k' pairs.
inline decode_step_shape collectives_shape_of(const model_config& full, const rank_layout& l,
                                              int P, int64_t B, int64_t k_local) {
  decode_step_shape s;
  s.tp_attention = l.attention == moebius::parallel_mode::tp;
  s.dcp = l.dcp;
  s.batch = B;
  s.rank_pairs = s.tp_attention ? 0 : rank_batch(l, B, P) * k_local;
  s.num_ranks = P;
  s.layers = full.num_layers;
  s.hidden = full.hidden;
  s.q_heads = full.num_q_heads;
  s.head_dim = full.head_dim;
  return s;
}

// The priced collectives of one layer of TP attention with dcp > 1 (seconds): DCP's exchange
// (step_collectives.hpp). Qwen3-235B, P 8, d 2, B 64, link: 30.684 us.
inline double priced_dcp_layer_s(const model_config& full, const rank_layout& l, int P, int64_t B,
                                 collective_pricing pricing = collective_pricing::link,
                                 const link_model& link = {}) {
  return dcp_exchange_layer_s(collectives_shape_of(full, l, P, B, 1), pricing, link);
}

// Priced collectives of one decode step of the deployment (seconds) for a batch of B sequences
// (step_collectives.hpp: TP attention's two all-reduces a layer and DCP's exchange, or
// data-parallel attention's dispatch and combine of the rank's pairs).
inline double priced_collectives_s(const model_config& full, const rank_layout& l, int P,
                                   int64_t B, int64_t k_local,
                                   collective_pricing pricing = collective_pricing::link,
                                   const link_model& link = {}) {
  return decode_step_collectives_s(collectives_shape_of(full, l, P, B, k_local), pricing, link);
}

}  // namespace mini_engine
