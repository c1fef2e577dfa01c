#include "sim_runtime.hpp"

#include <algorithm>
#include <numeric>

#include <moebius/error.hpp>

namespace mini_engine {

using moebius::errc;
using moebius::parallel_mode;

sim_runtime::sim_runtime(const moebius::arena_geometry& arena, const moebius::kv_geometry& kv,
                         int32_t vocab)
    : arena_(arena), kv_(kv), vocab_(vocab) {
  moebius::validate(kv_);
  MOEBIUS_CHECK(arena_.num_ranks == kv_.num_ranks, errc::invalid_argument, "sim_runtime: the arena has ",
                arena_.num_ranks, " ranks and the KV pool ", kv_.num_ranks);
  MOEBIUS_CHECK(vocab_ >= 1, errc::invalid_argument, "sim_runtime: vocab ", vocab_, " (needs >= 1)");
}

moebius::dry_run_spaces sim_runtime::spaces() const {
  return {arena_.total_bytes(), kv_.pool_bytes()};
}

std::vector<int32_t> sim_runtime::compute(const step_layout& layout,
                                          std::span<const step_item> items,
                                          std::vector<std::vector<float>>* logits) {
  MOEBIUS_CHECK(logits == nullptr, errc::invalid_argument,
                "sim_runtime: a simulated step has no logits");
  if (layout.hybrid()) {
    MOEBIUS_CHECK(layout.cursor.tp_layers >= 0 && layout.cursor.tp_layers <= arena_.shape.num_layers &&
                      arena_.shape.num_layers == kv_.num_layers,
                  errc::invalid_argument, "sim_runtime: a hybrid step at cursor ",
                  layout.cursor.tp_layers, " of ", arena_.shape.num_layers,
                  " MoE layers and ", kv_.num_layers, " KV layers");
    MOEBIUS_CHECK(layout.tp_tables->mode == parallel_mode::tp &&
                      layout.ep_tables->mode == parallel_mode::ep,
                  errc::invalid_argument, "sim_runtime: a hybrid step's tables are not TP and EP");
    check_tables(*layout.tp_tables, items);
    check_tables(*layout.ep_tables, items);
  } else {
    MOEBIUS_CHECK(layout.tables != nullptr, errc::invalid_argument, "sim_runtime: no tables");
    check_tables(*layout.tables, items);
  }
  ++steps_;
  std::vector<int32_t> tokens(items.size(), -1);
  for (size_t i = 0; i < items.size(); ++i) {
    const step_item& it = items[i];
    if (!it.sample) continue;
    const int64_t position = it.start_position + static_cast<int64_t>(it.tokens.size());
    const uint64_t h = static_cast<uint64_t>(it.seq_id) * 31u + static_cast<uint64_t>(position);
    tokens[i] = static_cast<int32_t>(h % static_cast<uint64_t>(vocab_));
  }
  return tokens;
}

void sim_runtime::check_tables(const moebius::kv_state& tables, std::span<const step_item> items) {
  MOEBIUS_CHECK(static_cast<int>(tables.ranks.size()) == kv_.num_ranks, errc::invalid_argument,
                "sim_runtime: tables of ", tables.ranks.size(), " ranks for ", kv_.num_ranks);
  // Items by sequence id, then one merge per rank against its tables (sorted by seq_id).
  std::vector<size_t> order(items.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::sort(order.begin(), order.end(),
            [&](size_t a, size_t b) { return items[a].seq_id < items[b].seq_id; });
  std::vector<int> found(items.size(), 0);
  for (int r = 0; r < kv_.num_ranks; ++r) {
    const std::vector<moebius::kv_sequence>& seqs = tables.ranks[static_cast<size_t>(r)].sequences;
    size_t s = 0;
    for (const size_t i : order) {
      const step_item& it = items[i];
      while (s < seqs.size() && seqs[s].seq_id < it.seq_id) ++s;
      if (s == seqs.size()) break;
      if (seqs[s].seq_id != it.seq_id) continue;
      const int64_t need = it.start_position + static_cast<int64_t>(it.tokens.size());
      MOEBIUS_CHECK(!it.tokens.empty() && it.start_position >= 0 && seqs[s].num_tokens >= need,
                    errc::invalid_argument, "sim_runtime: sequence ", it.seq_id, " on rank ", r,
                    " (", moebius::to_string(tables.mode), ") holds ", seqs[s].num_tokens,
                    " tokens; the step writes ", it.tokens.size(), " at position ",
                    it.start_position);
      ++found[i];
    }
  }
  const int want = tables.mode == parallel_mode::tp ? kv_.num_ranks : 1;
  for (size_t i = 0; i < items.size(); ++i) {
    MOEBIUS_CHECK(found[i] == want, errc::invalid_argument, "sim_runtime: sequence ",
                  items[i].seq_id, " is on ", found[i], " ranks of the ",
                  moebius::to_string(tables.mode), " tables (", want, " expected)");
  }
}

}  // namespace mini_engine
