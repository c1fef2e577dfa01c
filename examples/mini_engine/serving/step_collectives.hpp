#pragma once

// The collectives one decode step of a P-rank deployment runs, per layout, and their price: by
// the cited table (collective_table.hpp, the default) or by the link model the first step
// curves were priced with (latency + bytes / link rate: 10 us assumed, never measured on 8
// GPUs). One description, read by the rank-share bench (gpu/rank_share.hpp), the simulated
// runtime's curves (step_curves: the repricing) and the roofline (step_clock.hpp's
// h200_step_model).
//
// Per layer, bf16 activations (2 B), fp32 log-sum-exps (4 B):
//   TP attention (TP, TEP)  two all-reduces of B x H x 2 B: after o_proj and after the experts
//                           (TP experts' partial sums, or TEP's, every token on every rank: no
//                           dispatch); one more for the LM head's candidates a step (the
//                           smallest all-reduce);
//     with dcp d > 1        DCP's exchange within each set of d ranks (vLLM's decode context
//                           parallel), hq = Hq/P, D the head dim:
//                             q all-gather     the set's d x hq q heads on every member
//                             LSE all-gather   each member's d x hq log-sum-exps
//                             reduce-scatter   the corrected partial outputs: each keeps its hq
//                           (the link model: each rank receiving (d-1)/d of the gathered bytes,
//                           at the all-reduce rate, a latency per collective; vLLM's two merge
//                           collectives, or one fused exchange of (output, LSE));
//   data-parallel attention with EP experts: a dispatch and a combine of the rank's pairs
//                           (ceil(B/P) x k rows of H x 2 B; the link model sends (P-1)/P of
//                           them at the all-to-all rate).
//
// The cited table prices each at P = 8 (DCP's three at d ranks, collective_s scaling the bytes
// that leave a rank; its 8-rank latency kept: an over-estimate for a set of 2).

#include <cstdint>
#include <string_view>

namespace mini_engine {

// What prices the collectives of a step.
enum class collective_pricing : uint8_t {
  link,   // latency + bytes / link rate (link_model)
  cited,  // the cited measurements' fits (collective_table.hpp)
};

std::string_view name_of(collective_pricing p);

// latency + bytes / rate per collective.
struct link_model {
  double allreduce_bytes_per_s = 389e9;   // NVLink copy-engine ceiling per GPU per direction
  double all_to_all_bytes_per_s = 332e9;  // NCCL all-to-all at 1 GiB, 2x H200 (measured here)
  double latency_s = 10e-6;               // per collective (assumed: not measured on 8 GPUs)
  // Collectives merging the DCP partial outputs per layer: 2 as vLLM runs them (an all-gather
  // of the log-sum-exps, then a reduce-scatter of the corrected outputs), 1 for a fused
  // exchange of (output, LSE).
  int dcp_merge_collectives = 2;
};

// One decode step's shape, as far as its collectives see it.
struct decode_step_shape {
  bool tp_attention = true;
  int64_t dcp = 1;         // TP attention's decode context parallel degree
  int64_t batch = 0;       // B: the deployment's sequences
  int64_t rank_pairs = 0;  // data-parallel attention: the (token, expert) pairs a rank sends
  int num_ranks = 8;       // P
  int64_t layers = 0, hidden = 0;
  int64_t q_heads = 0, head_dim = 0;  // the model's Hq (all ranks) and D
};

// Seconds of DCP's exchange in one layer (0 for dcp 1 or data-parallel attention).
//   link, Qwen3-235B, P 8, d 2, B 64: q 131,072 B, LSE 4,096 B, outputs 131,072 B at 389 GB/s
//   plus 3 x 10 us = 30.684 us.
double dcp_exchange_layer_s(const decode_step_shape& s, collective_pricing pricing,
                            const link_model& link = {});

// Seconds of every collective of one decode step (0 at P = 1).
//   link, TP, B 128, Qwen3-235B (L 94, H 4096), P 8: 188 x 14.7173 us + 10 us = 2.77686 ms;
//   cited, TP, B 1: 189 x 13.43 us (the 0.5 MiB clamp) = 2.538 ms.
// Throws errc::invalid_argument naming a negative batch or pairs, num_ranks < 1, dcp < 1, or
// layers / hidden / heads < 1 where they are used.
double decode_step_collectives_s(const decode_step_shape& s, collective_pricing pricing,
                                 const link_model& link = {});

// The change in ms to a step priced by `from` when `to` prices it instead (cited - link, or
// its negative; 0 when equal).
double collectives_shift_ms(const decode_step_shape& s, collective_pricing from,
                            collective_pricing to);

}  // namespace mini_engine
