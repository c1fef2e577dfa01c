#pragma once

// Rank memory for the KV planner tests: pools of random bytes filled through the independent
// reference (kv_reference.hpp) in the present layout or an engine array (kv_layout_model.hpp),
// and what the tests compare a migration's tables and per-layer plans with.

#include <algorithm>
#include <random>
#include <vector>

#include "kv_cases.hpp"
#include "kv_layout_model.hpp"
#include "kv_reference.hpp"
#include "moebius/kv/kv_pool_layout.hpp"
#include "moebius/memory/rank_memory.hpp"
#include "moebius/plan/plan.hpp"
#include "support/catch.hpp"

namespace moebius::testing {

struct memory {
  pools kv;     // [P][pool_bytes]
  pools arena;  // [P][staging bytes]
  // The pool's layout and the model's offsets (present: the library default and ref_offset).
  kv_pool_layout layout;
  ref_offset_fn model;
  const ref_offset_fn* where() const { return model ? &model : nullptr; }

  std::vector<rank_memory> spans() {
    std::vector<rank_memory> out(kv.size());
    for (size_t r = 0; r < kv.size(); ++r) {
      out[r].spaces[static_cast<int>(memory_space::kv_pool)] = kv[r];
      out[r].spaces[static_cast<int>(memory_space::arena)] = arena[r];
    }
    return out;
  }
};

// Random bytes everywhere (a page a plan forgets to write then differs), then the reference.
// `model` (optional): the pool is that engine array instead of the present layout.
inline memory make_memory(std::mt19937_64& rng, const kv_case& c, int64_t staging_bytes,
                          const layout_model* model = nullptr) {
  memory m;
  m.layout = present_kv_layout(c.g);
  if (model) {
    m.layout = model->layout(c.g);
    m.model = [g = c.g, md = *model](parallel_mode mode, int64_t l, int64_t kv, int64_t p,
                                     int64_t h, int64_t t, int64_t d) {
      return md.offset(g, mode, l, kv, p, h, t, d);
    };
  }
  m.kv.assign(static_cast<size_t>(c.g.num_ranks),
              std::vector<std::byte>(static_cast<size_t>(m.layout.pool_bytes)));
  m.arena.assign(static_cast<size_t>(c.g.num_ranks),
                 std::vector<std::byte>(static_cast<size_t>(staging_bytes + 64)));
  for (auto* ps : {&m.kv, &m.arena})
    for (auto& p : *ps)
      for (auto& b : p) b = static_cast<std::byte>(rng() & 0xFF);
  fill_reference(c.g, c.state, c.content, m.kv, m.where());
  return m;
}

// Same sequences, tokens, sharing and cursors in both states (pages differ).
inline void require_same_sequences(const kv_state& a, const kv_state& b) {
  auto collect = [](const kv_state& s) {
    std::vector<kv_sequence> all;
    for (const kv_rank_state& r : s.ranks)
      for (kv_sequence q : r.sequences) {
        q.pages.clear();
        all.push_back(q);
      }
    std::sort(all.begin(), all.end(),
              [](const kv_sequence& x, const kv_sequence& y) { return x.seq_id < y.seq_id; });
    all.erase(std::unique(all.begin(), all.end()), all.end());  // TP: one per rank
    return all;
  };
  REQUIRE(collect(a) == collect(b));
}

// Every preset and a random engine-like array (custom), in the order the tests cycle through.
inline constexpr kv_preset all_presets[] = {kv_preset::present, kv_preset::vllm_flash_attn,
                                            kv_preset::vllm_flashinfer, kv_preset::sglang_mha,
                                            kv_preset::custom};

// The preset's array for g (SGLang's buffers are token-major: g becomes NHD), or a random
// engine-like array for `custom`.
inline layout_model engine_model(std::mt19937_64& rng, kv_preset preset, kv_geometry& g) {
  if (preset == kv_preset::sglang_mha) g.layout = kv_layout::nhd;
  return preset == kv_preset::custom ? random_layout_model(rng, g) : preset_model(preset, g);
}

// The one-layer plan of `g` (what a progressive switch runs per layer), shifted to `layer`.
inline plan shifted_to_layer(plan p, const kv_pool_layout& layout, int64_t layer) {
  for (plan_phase& ph : p.phases)
    for (auto* ops : {&ph.ops, &ph.restores})
      for (copy_op& op : *ops) {
        if (op.src_space == memory_space::kv_pool) op.src_offset += layer * layout.ep.layer;
        if (op.dst_space == memory_space::kv_pool) op.dst_offset += layer * layout.ep.layer;
      }
  return p;
}

}  // namespace moebius::testing
