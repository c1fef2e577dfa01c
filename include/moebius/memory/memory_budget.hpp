#pragma once

// Per-rank memory budget of a Moebius deployment, and what it costs beyond a static-EP and a
// static-TP deployment.
//
// What is counted, per rank, in bytes:
//   expert weights       L · layer bytes (the same in EP, TP and Moebius: volume invariance)
//   arena spare slot     one slot_bytes (the free slot of the offset-aliased arena, §3)
//   arena padding        L · (slot_bytes - layer bytes): alignment inside occupied slots
//   attention weights    q/k/v/o (+ q/k norms) of every layer, whole: EP runs attention
//                        data-parallel, and TP reads head slices of the same tensors as
//                        strided views (DESIGN.md §3), so TP costs no second copy
//   other dense weights  embeddings, lm_head, router gates, layer norms (optional: set
//                        dense.vocab = 0 to leave them out); replicated as in static EP
//   KV pool              given (the same pool serves both views)
//   plan descriptors     sizeof(copy_op) · descriptor ops per rank, resident on device
//   barrier flags        flag slots per rank · flag bytes
//   scratch              graph-independent switch scratch (given)
//
// Switching overhead (the same against static EP and static TP: both hold the same expert
// bytes per rank) = spare slot + padding + descriptors + flags + scratch.
// Against static TP there is one more difference, reported separately: static TP holds
// only its head slice of attention (q/o sliced by P; k/v sliced by P, or one replicated
// KV head per rank when H_kv < P), Moebius holds attention whole because EP needs it.

#include <cstdint>
#include <iosfwd>

#include "moebius/layout/arena_geometry.hpp"
#include "moebius/layout/dtype.hpp"
#include "moebius/plan/plan.hpp"

namespace moebius {

// Attention and dense (non-expert) parts of the model.
struct attention_shape {
  int64_t num_layers = 0;
  int64_t hidden = 0;        // H
  int64_t num_q_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  bool qk_norm = true;       // per-head RMSNorm weights on q and k (Qwen3)
  dtype weight_dtype = dtype::bf16;
};

struct dense_shape {
  int64_t vocab = 0;             // 0: leave embeddings / lm_head / norms / router out
  bool tied_embeddings = false;  // lm_head shares the embedding matrix
  int64_t num_experts = 0;       // router gate [E, H] per layer (0: none)
  int64_t norms_per_layer = 2;   // RMSNorm vectors of H per layer (input, post-attention)
  dtype weight_dtype = dtype::bf16;
};

// Qwen3-235B-A22B: 94 layers, H 4096, 64 q heads, 4 kv heads, head_dim 128, q/k norms.
constexpr attention_shape qwen3_235b_a22b_attention() {
  attention_shape a;
  a.num_layers = 94;
  a.hidden = 4096;
  a.num_q_heads = 64;
  a.num_kv_heads = 4;
  a.head_dim = 128;
  return a;
}

// Qwen3-235B-A22B: vocab 151,936, untied lm_head, 128-expert router, 2 norms per layer.
constexpr dense_shape qwen3_235b_a22b_dense() {
  dense_shape d;
  d.vocab = 151936;
  d.num_experts = 128;
  return d;
}

// Bytes of the whole attention of the model (what one EP rank, or Moebius, holds).
//   Qwen3-235B: per layer q 67,108,864 + k 4,194,304 + v 4,194,304 + o 67,108,864
//   + norms 512 = 142,606,848 B; 94 layers: 13,405,043,712 B.
int64_t attention_bytes_whole(const attention_shape& a);

// Bytes of the attention one static-TP rank holds: q/o sliced by P, k/v sliced by P or one
// head per rank when H_kv < P (heads replicated P/H_kv times).
//   Qwen3-235B, P=8: per layer q 8,388,608 + k 1,048,576 + v 1,048,576 + o 8,388,608
//   + norms 512 = 18,874,880 B; 94 layers: 1,774,238,720 B.
int64_t attention_bytes_tp_rank(const attention_shape& a, int num_ranks);

// Embeddings (+ lm_head unless tied) + router gates + norms + final norm, whole.
int64_t dense_bytes(const dense_shape& d, const attention_shape& a);

// Switch-runtime state resident on each device.
struct switch_footprint {
  int64_t descriptor_ops_per_rank = 0;  // copy_ops resident on device (all cached plans)
  int64_t barrier_flag_slots = 0;       // flag words per rank (e.g. one per peer per epoch)
  int64_t flag_bytes = 128;             // bytes per flag slot (padded: no false sharing)
  int64_t scratch_bytes = 0;            // graph-independent switch scratch per rank
};

// Ops of `p` a rank executes (push model: the source rank runs the op); max over ranks.
int64_t max_ops_per_rank(const plan& p);

struct memory_budget {
  int num_ranks = 0;
  int64_t num_layers = 0;
  int64_t expert_bytes = 0;
  int64_t spare_slot_bytes = 0;
  int64_t padding_bytes = 0;
  int64_t attention_bytes = 0;
  int64_t attention_tp_view_bytes = 0;  // always 0: TP reads slices of the same tensors
  int64_t dense_bytes = 0;
  int64_t kv_pool_bytes = 0;
  int64_t descriptor_bytes = 0;
  int64_t flag_bytes = 0;
  int64_t scratch_bytes = 0;

  int64_t arena_bytes = 0;               // geometry.total_bytes()
  int64_t static_tp_attention_bytes = 0; // what a static-TP rank holds of attention

  // Everything this rank holds.
  int64_t total_bytes() const;
  // Spare slot + padding + descriptors + flags + scratch.
  int64_t switching_overhead_bytes() const;
  // Static-EP rank: experts + attention + dense + KV (no spare slot, no switch state).
  int64_t static_ep_total_bytes() const;
  // Static-TP rank: experts + TP attention slice + dense + KV.
  int64_t static_tp_total_bytes() const;

  double spare_fraction_of_arena() const;        // spare / arena bytes (1/(L+1) unpadded)
  double overhead_fraction_of_experts() const;   // switching overhead / expert bytes
  double overhead_fraction_vs_static_ep() const; // (total - static EP) / static EP total
  double overhead_fraction_vs_static_tp() const; // (total - static TP) / static TP total
};

// Builds the table. Validates: geometry (num_ranks >= 1, slot >= layer bytes), attention
// (sizes > 0, layers equal to the arena's L), counts >= 0. Throws errc::invalid_argument
// naming the broken constraint, errc::overflow when a byte count does not fit in 64 bits.
//   Qwen3-235B, P=8, bf16: experts 56,774,098,944 B, spare 603,979,776 B = 1/95 of the
//   arena, padding 0.
memory_budget make_memory_budget(const arena_geometry& geometry, const attention_shape& attention,
                                 const dense_shape& dense, int64_t kv_pool_bytes,
                                 const switch_footprint& footprint);

// A table, one row per item, in bytes and GiB, then the overheads.
std::ostream& operator<<(std::ostream& os, const memory_budget& b);

}  // namespace moebius
