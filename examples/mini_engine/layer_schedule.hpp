#pragma once

// The per-layer schedule of a step, shared by the host and the GPU runtime: which mode each
// layer runs in, where each item's rows sit in each mode's token layout, and the activation
// hand-off of a hybrid step (which rows each rank keeps, which it all-gathers, in which
// order). Host code only (no CUDA): the GPU runtime uploads what these functions compute.
//
// Token layouts. TP (every rank holds every token) lays the step's items out in item order on
// every rank; EP (data-parallel attention) lays out, on each rank, only its own sequences
// (their EP owner in the EP tables), in item order.
//   items {a: 2 tokens, b: 1, c: 3}, EP owners {a: 1, b: 0, c: 1}, P = 2:
//     TP: first = {0, 2, 3} on both ranks, count 6 each
//     EP: rank 0 first = {-1, 0, -1}, count 1; rank 1 first = {0, -1, 2}, count 5
//
// Hand-off (step.hpp: where a hybrid step's mode changes between two layers).
//   TP -> EP: every rank holds the whole batch; it keeps its own sequences' rows
//             (to_ep: rank 1 above keeps TP rows {0, 1, 3, 4, 5}).
//   EP -> TP: every owner's rows are all-gathered, one block of `ep_stride` rows per rank in
//             rank order, and each TP row picked out of its owner's block (to_tp with
//             ep_stride 5: TP rows 0..5 <- {5, 6, 0, 7, 8, 9}).

#include <cstddef>
#include <cstdint>
#include <moebius/kv/page_table.hpp>
#include <moebius/layout/arena_geometry.hpp>
#include <span>
#include <utility>
#include <vector>

#include "step.hpp"

namespace mini_engine {

// The attention mode of every layer (a hybrid step: also its MoE's): layout.attention_mode.
//   hybrid, L = 4, cursor 1: {tp, ep, ep, ep}
std::vector<moebius::parallel_mode> layer_modes(const step_layout& layout, int64_t num_layers);

// One mode's token layout of a step.
struct token_layout {
  moebius::parallel_mode mode = moebius::parallel_mode::ep;
  std::vector<std::vector<int64_t>> first;  // [rank][item]: the item's first row, -1: absent
  std::vector<int64_t> count;               // [rank]: rows used
  // [rank][item]: the item's page table on that rank (null: absent); points into the tables
  // the layout was built from.
  std::vector<std::vector<const moebius::kv_sequence*>> sequence;

  int num_ranks() const { return static_cast<int>(count.size()); }
  // The most rows any rank holds, at least 1 (a step's row count per rank).
  int64_t max_count() const;
  // The lowest rank holding `item` (EP: its owner), -1 when none does.
  int owner(size_t item) const;
};

// The layout of `tables.mode` for `items` over `num_ranks` ranks. Throws
// errc::invalid_argument, naming the sequence, unless the tables are of num_ranks ranks, each
// item's sequence is on every rank (TP) or on exactly one (EP), and every holder's table holds
// the item's tokens (start_position + tokens.size()).
token_layout token_layout_of(const moebius::kv_state& tables, int num_ranks,
                             std::span<const step_item> items);

// The hand-off maps between the TP and the EP layout of one step.
struct hand_off_maps {
  // [rank][EP row]: that row's row in the rank's TP layout (TP -> EP: the rows it keeps).
  std::vector<std::vector<int32_t>> to_ep;
  // [rank][TP row]: that row's row in the all-gathered EP blocks, owner * ep_stride + its
  // EP row (EP -> TP). The same on every rank.
  std::vector<std::vector<int32_t>> to_tp;
};
// Requires tp.mode == tp, ep.mode == ep, both of `items` (token_layout_of) and
// ep_stride >= ep.max_count(); throws errc::invalid_argument otherwise.
hand_off_maps hand_off_maps_of(const token_layout& tp, const token_layout& ep,
                               std::span<const step_item> items, int64_t ep_stride);

// The row holding item i's last token in `layout` (the LM head's input): (rank, row). TP:
// rank 0 (every rank holds it); EP: its owner.
std::vector<std::pair<int, int64_t>> last_token_rows(const token_layout& layout,
                                                     std::span<const step_item> items);

}  // namespace mini_engine
