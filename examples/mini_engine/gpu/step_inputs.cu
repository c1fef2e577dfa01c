// The device-side inputs of a step (gpu_runtime.hpp): per mode the step uses, one input block
// per rank at a fixed address (token ids, positions, page-table rows, page tables, the real
// token count, the hand-off map), written into its pinned mirror and uploaded on the rank's
// stream. Which rows, in which order: layer_schedule.hpp, shared with the host runtime.
//
// Hybrid steps (step_layout::hybrid(): a progressive switch in progress). Layer l runs wholly
// in attention_mode(l) (TP below the cursor) with tables_of_layer(l): the step builds one
// input block per mode (token ids, positions, page-table rows of that mode's token layout:
// TP every token on every rank, EP each rank its own sequences) and runs the layers in
// order; where the mode changes the residual stream is handed off (hand_off): TP -> EP each
// rank keeps its own sequences' rows of the full batch (a local row gather); EP -> TP the
// owners' rows are all-gathered and every token's row picked out (with layer l TP iff
// l < cursor a forward pass only meets TP -> EP; both directions are implemented). The LM
// head runs in the last layer's mode.

#include <algorithm>
#include <moebius/error.hpp>

#include "runtime_impl.hpp"

namespace mini_engine::gpu {

using moebius::dtype;
using moebius::errc;
using moebius::parallel_mode;

// Writes mode m's pinned input block of every rank from `tables` (ids, positions, rows,
// page tables; num_tokens, map and padding are the caller's) and returns its token layout
// (layer_schedule.hpp: TP every item on every rank, EP each rank its own sequences, in item
// order).
token_layout gpu_runtime::impl::build_inputs(parallel_mode m, const moebius::kv_state& tables,
                                             std::span<const step_item> items) {
  MOEBIUS_CHECK(tables.mode == m && static_cast<int>(tables.ranks.size()) == P,
                errc::invalid_argument, "gpu_runtime::step: ", moebius::to_string(m),
                " tables for ", P, " ranks expected, got ", moebius::to_string(tables.mode),
                " tables for ", tables.ranks.size());
  const token_layout lay = token_layout_of(tables, P, items);
  const int mi = mode_index(m);
  for (int r = 0; r < P; ++r) {
    rank_state& rs = ranks[static_cast<size_t>(r)];
    int32_t* ids = rs.pinned[mi];
    int32_t* pos = rs.pinned[mi] + off_pos();
    int32_t* seq = rs.pinned[mi] + off_seq();
    int32_t* tab = rs.pinned[mi] + off_tables();
    MOEBIUS_CHECK(lay.count[static_cast<size_t>(r)] <= T_max, errc::capacity,
                  "gpu_runtime::step: more than max_tokens=", T_max, " tokens on rank ", r, " in ",
                  moebius::to_string(m));
    int64_t row = 0;  // the item's page-table row on this rank
    for (size_t i = 0; i < items.size(); ++i) {
      const moebius::kv_sequence* found = lay.sequence[static_cast<size_t>(r)][i];
      if (found == nullptr) continue;  // not on this rank
      const step_item& it = items[i];
      MOEBIUS_CHECK(found->num_pages() <= max_pages, errc::capacity, "gpu_runtime::step: sequence ",
                    it.seq_id, " has ", found->num_pages(), " pages, max_pages_per_seq is ",
                    max_pages);
      // With dcp > 1 the kernels take a TP rank's table row for its DCP share (paged_tokens):
      // tables of another dcp would place tokens on the wrong pages.
      const int64_t share = moebius::pages_held(kv, m, r, moebius::logical_pages(kv, *found));
      MOEBIUS_CHECK(!dcp_split(m) || found->num_pages() == share, errc::invalid_argument,
                    "gpu_runtime::step: sequence ", it.seq_id, " of ", found->num_tokens,
                    " tokens lists ", found->num_pages(), " pages on ", moebius::to_string(m),
                    " rank ", r, ", its share at dcp=", kv.dcp, " is ", share,
                    " (tables of another KV geometry?)");
      for (int64_t p = 0; p < found->num_pages(); ++p)
        tab[row * max_pages + p] = static_cast<int32_t>(found->pages[static_cast<size_t>(p)]);
      int64_t t = lay.first[static_cast<size_t>(r)][i];
      for (int64_t j = 0; j < static_cast<int64_t>(it.tokens.size()); ++j, ++t) {
        ids[t] = it.tokens[static_cast<size_t>(j)];
        pos[t] = static_cast<int32_t>(it.start_position + j);
        seq[t] = static_cast<int32_t>(row);
      }
      ++row;
    }
  }
  return lay;
}

// Hand-off maps (a step that uses both modes; layer_schedule.hpp): the EP block's map gives
// each EP row its row in the TP layout (TP -> EP: a rank keeps its own rows); the TP block's
// map gives each TP row its row in the all-gathered EP blocks, owner * rows_ep + its EP row
// (EP -> TP), rows_ep being the EP rows per rank this step runs (its bucket).
void gpu_runtime::impl::write_hand_off_maps(const token_layout& tp, const token_layout& ep,
                                            std::span<const step_item> items, int64_t rows_ep) {
  const hand_off_maps maps = hand_off_maps_of(tp, ep, items, rows_ep);
  for (int r = 0; r < P; ++r) {
    rank_state& rs = ranks[static_cast<size_t>(r)];
    const auto& to_ep = maps.to_ep[static_cast<size_t>(r)];
    const auto& to_tp = maps.to_tp[static_cast<size_t>(r)];
    std::copy(to_ep.begin(), to_ep.end(), rs.pinned[mode_index(parallel_mode::ep)] + off_map());
    std::copy(to_tp.begin(), to_tp.end(), rs.pinned[mode_index(parallel_mode::tp)] + off_map());
  }
}

// Rank r's used input blocks onto its stream. Padding rows (from the rank's count up to the
// step's rows of that mode) get token 0, position 0, row 0, map 0: num_tokens, written here
// too, makes the kernels skip them.
void gpu_runtime::impl::upload_inputs(rank_state& rs, int r, const bool used[2],
                                      const token_layout lay[2], const int64_t rows[2]) {
  for (int mi = 0; mi < 2; ++mi) {
    if (!used[mi]) continue;
    int32_t* in = rs.pinned[mi];
    const int64_t n = lay[mi].count[static_cast<size_t>(r)];
    for (int64_t t = n; t < rows[mi]; ++t) {
      in[t] = 0;
      in[off_pos() + t] = 0;
      in[off_seq() + t] = 0;
      in[off_map() + t] = 0;
    }
    in[off_num()] = static_cast<int32_t>(n);
    MOEBIUS_CUDA_CHECK(cudaMemcpyAsync(rs.inputs[mi], in, static_cast<size_t>(rs.input_count) * 4,
                                       cudaMemcpyHostToDevice, rs.stream));
  }
}

}  // namespace mini_engine::gpu
