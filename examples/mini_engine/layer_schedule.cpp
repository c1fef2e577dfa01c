#include "layer_schedule.hpp"

#include <algorithm>
#include <moebius/error.hpp>

#include "kv_pages.hpp"

namespace mini_engine {

using moebius::errc;
using moebius::parallel_mode;

std::vector<parallel_mode> layer_modes(const step_layout& layout, int64_t num_layers) {
  std::vector<parallel_mode> modes;
  modes.reserve(static_cast<size_t>(num_layers));
  for (int64_t l = 0; l < num_layers; ++l) modes.push_back(layout.attention_mode(l));
  return modes;
}

int64_t token_layout::max_count() const {
  int64_t need = 1;
  for (int64_t n : count) need = std::max(need, n);
  return need;
}

int token_layout::owner(size_t item) const {
  for (size_t r = 0; r < first.size(); ++r)
    if (first[r][item] >= 0) return static_cast<int>(r);
  return -1;
}

token_layout token_layout_of(const moebius::kv_state& tables, int num_ranks,
                             std::span<const step_item> items) {
  const parallel_mode m = tables.mode;
  MOEBIUS_CHECK(static_cast<int>(tables.ranks.size()) == num_ranks, errc::invalid_argument,
                "step: ", moebius::to_string(m), " tables for ", num_ranks, " ranks expected, got ",
                tables.ranks.size());
  token_layout lay;
  lay.mode = m;
  lay.first.assign(static_cast<size_t>(num_ranks), std::vector<int64_t>(items.size(), -1));
  lay.count.assign(static_cast<size_t>(num_ranks), 0);
  lay.sequence.assign(static_cast<size_t>(num_ranks),
                      std::vector<const moebius::kv_sequence*>(items.size(), nullptr));
  for (int r = 0; r < num_ranks; ++r) {
    int64_t t = 0;
    for (size_t i = 0; i < items.size(); ++i) {
      const step_item& it = items[i];
      const moebius::kv_sequence* s = find_sequence(tables, r, it.seq_id);
      if (s == nullptr) continue;  // not on this rank
      const auto n = static_cast<int64_t>(it.tokens.size());
      MOEBIUS_CHECK(s->num_tokens >= it.start_position + n, errc::invalid_argument,
                    "step: sequence ", it.seq_id, " holds ", s->num_tokens, " tokens in the ",
                    moebius::to_string(m), " tables of rank ", r, ", the step needs ",
                    it.start_position + n);
      lay.first[static_cast<size_t>(r)][i] = t;
      lay.sequence[static_cast<size_t>(r)][i] = s;
      t += n;
    }
    lay.count[static_cast<size_t>(r)] = t;
  }
  for (size_t i = 0; i < items.size(); ++i) {
    int64_t holders = 0;
    for (int r = 0; r < num_ranks; ++r) holders += lay.first[static_cast<size_t>(r)][i] >= 0;
    MOEBIUS_CHECK(m == parallel_mode::tp ? holders == num_ranks : holders == 1,
                  errc::invalid_argument, "step: sequence ", items[i].seq_id, " is on ", holders,
                  " ranks of the ", moebius::to_string(m), " tables");
  }
  return lay;
}

hand_off_maps hand_off_maps_of(const token_layout& tp, const token_layout& ep,
                               std::span<const step_item> items, int64_t ep_stride) {
  const int P = tp.num_ranks();
  MOEBIUS_CHECK(tp.mode == parallel_mode::tp && ep.mode == parallel_mode::ep &&
                    ep.num_ranks() == P && tp.first.size() == static_cast<size_t>(P) &&
                    ep.first.size() == static_cast<size_t>(P) && ep_stride >= ep.max_count(),
                errc::invalid_argument, "hand_off_maps_of: a TP and an EP layout of ", P,
                " ranks and a stride >= ", ep.max_count(), " needed (stride ", ep_stride, ")");
  hand_off_maps maps;
  maps.to_ep.resize(static_cast<size_t>(P));
  maps.to_tp.resize(static_cast<size_t>(P));
  for (int r = 0; r < P; ++r) {
    maps.to_ep[static_cast<size_t>(r)].assign(static_cast<size_t>(ep.count[static_cast<size_t>(r)]),
                                              -1);
    maps.to_tp[static_cast<size_t>(r)].assign(static_cast<size_t>(tp.count[static_cast<size_t>(r)]),
                                              -1);
    for (size_t i = 0; i < items.size(); ++i) {
      MOEBIUS_CHECK(i < tp.first[static_cast<size_t>(r)].size() &&
                        i < ep.first[static_cast<size_t>(r)].size(),
                    errc::invalid_argument, "hand_off_maps_of: layouts of fewer items than ",
                    items.size());
      const auto n = static_cast<int64_t>(items[i].tokens.size());
      const int owner = ep.owner(i);
      const int64_t e0 = ep.first[static_cast<size_t>(owner)][i];
      const int64_t t0 = tp.first[static_cast<size_t>(r)][i];
      for (int64_t j = 0; j < n; ++j) {
        if (owner == r)
          maps.to_ep[static_cast<size_t>(r)][static_cast<size_t>(e0 + j)] =
              static_cast<int32_t>(t0 + j);
        maps.to_tp[static_cast<size_t>(r)][static_cast<size_t>(t0 + j)] =
            static_cast<int32_t>(owner * ep_stride + e0 + j);
      }
    }
  }
  return maps;
}

std::vector<std::pair<int, int64_t>> last_token_rows(const token_layout& layout,
                                                     std::span<const step_item> items) {
  std::vector<std::pair<int, int64_t>> at(items.size(), {-1, -1});
  for (size_t i = 0; i < items.size(); ++i) {
    const int r = layout.mode == parallel_mode::ep ? layout.owner(i) : 0;
    at[i] = {r, layout.first[static_cast<size_t>(r)][i] +
                    static_cast<int64_t>(items[i].tokens.size()) - 1};
  }
  return at;
}

}  // namespace mini_engine
