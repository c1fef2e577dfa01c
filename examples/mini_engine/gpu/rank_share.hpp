#pragma once

// One rank of a P-rank deployment as a P = 1 model (bench_rank_share.cu measures it on one GPU):
// which share of the weights, heads and sequences a TP or an EP rank holds, and the link model
// that prices the collectives the emulation does not run. Host code, tested on the CPU
// (tests/test_mini_engine_rank_share.cpp).
//   Qwen3-235B-A22B, P = 8, TP: Hq 8, Hkv 1 (replicated: Hkv = 4 < P), I 192, V 18992, all 128
//   experts; EP: 16 whole experts, top-8 of them (skew 1), the whole attention; 1 of 8
//   sequences (ceil(B/8)).

#include <algorithm>
#include <cmath>
#include <cstdint>

#include <moebius/layout/parallel_mode.hpp>

#include "model_config.hpp"

namespace mini_engine {

// latency + bytes / rate per collective.
struct link_model {
  double allreduce_bytes_per_s = 389e9;   // NVLink copy-engine ceiling per GPU per direction
  double all_to_all_bytes_per_s = 332e9;  // NCCL all-to-all at 1 GiB, 2x H200 (measured here)
  double latency_s = 10e-6;               // per collective (assumed: not measured on 8 GPUs)
};

// The deployment rank's share as a P = 1 model: TP I/P, Hq/P, max(1, Hkv/P), V/P (when P | V);
// EP E/P experts with top-k' = min(E/P, round(k x skew)).
inline model_config rank_share_of(model_config c, moebius::parallel_mode m, int P, double skew) {
  if (m == moebius::parallel_mode::tp) {
    c.num_q_heads /= P;
    c.num_kv_heads = std::max<int64_t>(1, c.num_kv_heads / P);
    c.intermediate /= P;
    if (c.vocab % P == 0) c.vocab /= P;
  } else {
    c.num_experts /= P;
    c.top_k = std::min<int64_t>(
        c.num_experts, std::max<int64_t>(1, std::llround(static_cast<double>(c.top_k) * skew)));
  }
  return c;
}

// The rank's sequences for a deployment batch B: TP all, EP ceil(B / P).
inline int64_t rank_batch(moebius::parallel_mode m, int64_t B, int P) {
  return m == moebius::parallel_mode::tp ? B : (B + P - 1) / P;
}

// Priced collectives of one decode step of the deployment (seconds), bf16 activations:
//   TP  per layer two ring all-reduces of B x H (2(P-1)/P of the bytes each), plus one for the
//       LM head's candidates (latency only);
//   EP  per layer a dispatch and a combine of the rank's ceil(B/P) k' pairs ((P-1)/P of them
//       leave it), rows of H.
inline double priced_collectives_s(const model_config& full, moebius::parallel_mode m, int P,
                                   int64_t B, int64_t k_local, const link_model& link = {}) {
  if (P == 1) return 0;
  const double L = static_cast<double>(full.num_layers), H = static_cast<double>(full.hidden);
  const double act = 2;
  if (m == moebius::parallel_mode::tp) {
    const double bytes = 2.0 * (P - 1) / P * static_cast<double>(B) * H * act;
    return L * 2 * (link.latency_s + bytes / link.allreduce_bytes_per_s) + link.latency_s;
  }
  const double rows = static_cast<double>(rank_batch(m, B, P) * k_local) * (P - 1) / P;
  return L * 2 * (link.latency_s + rows * H * act / link.all_to_all_bytes_per_s);
}

}  // namespace mini_engine
