#pragma once

// A parallel layout: how the attention and how the experts are laid out over P ranks, each on
// its own. The two are independent choices in the engines (vLLM's `--enable-expert-parallel`
// runs EP experts under TP attention; SGLang's DP attention runs with EP or TP experts), and a
// switch may change one of them or both (switch/switcher.hpp):
//
//   attention   ep  data-parallel attention: each rank runs its own sequences with every
//                   head, over the EP view of the KV pool (a sequence whole on its owner)
//               tp  tensor-parallel attention: every rank runs every sequence for its head
//                   slice, over the TP view (kv_geometry: heads replicated when H_kv < P, or
//                   their tokens split over dcp ranks)
//   experts     ep  E/P whole experts a rank (the arena's EP view, cursor 0)
//               tp  every expert's I/P slice on every rank (the TP view, cursor L)
//
// Where each half lives: the attention's layout is the KV tables' mode (kv_state::mode), the
// experts' is where the arena rests (arena_cursor 0 or L). The paper's two layouts are the
// uniform ones, and a parallel_mode names them: parallel_layout(parallel_mode::tp) is TP
// attention with TP experts, so every call that takes a layout takes a mode.
//   {tp, ep}: TP attention, EP experts (TensorRT-LLM's "TEP"): after attention every rank
//   holds every token, the experts' dispatch is a local selection, their combine the
//   all-reduce TP attention already does; switching only the experts moves no KV.

#include <cstdint>

#include "moebius/layout/parallel_mode.hpp"

namespace moebius {

struct parallel_layout {
  parallel_mode attention = parallel_mode::ep;
  parallel_mode experts = parallel_mode::ep;

  constexpr parallel_layout() = default;
  constexpr parallel_layout(parallel_mode attention_mode, parallel_mode experts_mode)
      : attention(attention_mode), experts(experts_mode) {}
  // The uniform layout of a mode (implicit: a mode names the layout it has always meant).
  constexpr parallel_layout(parallel_mode m) : attention(m), experts(m) {}  // NOLINT

  // Attention and experts in the same mode (one of the paper's two layouts).
  constexpr bool uniform() const { return attention == experts; }
  friend constexpr bool operator==(const parallel_layout&, const parallel_layout&) = default;
};

constexpr bool is_valid(parallel_layout l) { return is_valid(l.attention) && is_valid(l.experts); }

//   {ep, ep} "EP", {tp, tp} "TP", {tp, ep} "TP attention, EP experts",
//   {ep, tp} "DP attention, TP experts".
constexpr const char* to_string(parallel_layout l) {
  if (!is_valid(l)) return "unknown";
  if (l.uniform()) return to_string(l.attention);
  return l.attention == parallel_mode::tp ? "TP attention, EP experts" : "DP attention, TP experts";
}

}  // namespace moebius
