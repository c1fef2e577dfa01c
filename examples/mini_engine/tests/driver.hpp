#pragma once

// A minimal serving loop for the tests: prefills sequences (in chunks), then decodes them
// together, growing the page tables with kv_pages before each step. Between steps a hook
// may switch (or do nothing). Records every sampled token and its logits. Also what the
// tests of layouts share: a static deployment at any cursor, a poisoned KV pool, and the
// comparison of two runs up to a near tie.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <moebius/kv/page_table.hpp>
#include <moebius/memory/rank_memory.hpp>
#include <random>
#include <string>
#include <vector>

#include "host_runtime.hpp"
#include "kv_pages.hpp"

namespace mini_engine::testing {

struct sequence_run {
  std::vector<int32_t> tokens;             // prompt, then the generated tokens
  std::vector<int32_t> generated;          // greedy tokens
  std::vector<std::vector<float>> logits;  // logits of each generated token
};

// Where the tables and cursor live between steps (the switcher's, or a static copy).
struct driver_state {
  std::function<moebius::kv_state&()> tables;
  std::function<moebius::arena_cursor()> cursor;
  // Called before every step with the step's index (switch here).
  std::function<void(int64_t)> before_step = [](int64_t) {};
  // When set, the step's layout (a hybrid one while a progressive switch is open) instead of
  // {&tables(), cursor()}.
  std::function<step_layout()> layout;
  // Whether the driver grows the tables before each step. false: the caller reserved every
  // sequence's final length up front (a progressive switch freezes the tables).
  bool reserve = true;
};

// Runs prompts (chunked prefill of at most `chunk` tokens per step, one chunk per sequence
// per step), then `decode_steps` steps decoding every sequence. Sequence i has seq_id
// 100 + i and EP owner i % P.
inline std::vector<sequence_run> drive(host_runtime& rt, driver_state& st,
                                       const std::vector<std::vector<int32_t>>& prompts,
                                       int64_t chunk, int64_t decode_steps) {
  std::vector<sequence_run> runs(prompts.size());
  std::vector<int64_t> done(prompts.size(), 0);  // tokens in the KV cache
  for (size_t i = 0; i < prompts.size(); ++i) runs[i].tokens = prompts[i];
  int64_t step_idx = 0;
  auto run_step = [&](const std::vector<size_t>& which, const std::vector<int64_t>& counts) {
    st.before_step(step_idx++);
    std::vector<step_item> items;
    for (size_t j = 0; j < which.size(); ++j) {
      const size_t i = which[j];
      const int64_t n = counts[j];
      if (st.reserve)
        reserve_tokens(rt.kv(), st.tables(), static_cast<int64_t>(100 + i), done[i] + n,
                       static_cast<int>(i % static_cast<size_t>(rt.num_ranks())));
      step_item it;
      it.seq_id = static_cast<int64_t>(100 + i);
      it.tokens = std::span<const int32_t>(runs[i].tokens)
                      .subspan(static_cast<size_t>(done[i]), static_cast<size_t>(n));
      it.start_position = done[i];
      it.sample = done[i] + n == static_cast<int64_t>(runs[i].tokens.size());
      items.push_back(it);
    }
    std::vector<std::vector<float>> logits;
    const step_layout layout = st.layout ? st.layout() : step_layout{&st.tables(), st.cursor()};
    const std::vector<int32_t> next = rt.step(layout, items, &logits);
    size_t li = 0;
    for (size_t j = 0; j < which.size(); ++j) {
      const size_t i = which[j];
      done[i] += counts[j];
      if (items[j].sample) {
        runs[i].generated.push_back(next[j]);
        runs[i].logits.push_back(logits[li++]);
      }
    }
    // Append after the step: the spans above point into runs[i].tokens.
    for (size_t j = 0; j < which.size(); ++j)
      if (items[j].sample) runs[which[j]].tokens.push_back(next[j]);
  };
  // Prefill: every step takes the next chunk of every unfinished prompt.
  for (;;) {
    std::vector<size_t> which;
    std::vector<int64_t> counts;
    for (size_t i = 0; i < prompts.size(); ++i) {
      const int64_t left = static_cast<int64_t>(prompts[i].size()) - done[i];
      if (left > 0) {
        which.push_back(i);
        counts.push_back(std::min(left, chunk));
      }
    }
    if (which.empty()) break;
    run_step(which, counts);
  }
  for (int64_t s = 0; s < decode_steps; ++s) {
    std::vector<size_t> which;
    for (size_t i = 0; i < prompts.size(); ++i) which.push_back(i);
    run_step(which, std::vector<int64_t>(prompts.size(), 1));
  }
  return runs;
}

// A static deployment: tables of `mode` with every page free (attention in `mode`), and the
// experts at `cursor` (default: 0 for EP, L for TP; any resting cursor is a static layout).
struct static_state {
  moebius::kv_state tables;
  moebius::arena_cursor cursor;
  driver_state driver;
  static_state(const host_runtime& rt, moebius::parallel_mode mode)
      : static_state(rt, mode,
                     moebius::arena_cursor{
                         mode == moebius::parallel_mode::tp ? rt.config().num_layers : 0}) {}
  static_state(const host_runtime& rt, moebius::parallel_mode mode, moebius::arena_cursor c)
      : tables(make_empty_kv_state(rt.kv(), mode)), cursor(c) {
    driver.tables = [this]() -> moebius::kv_state& { return tables; };
    driver.cursor = [this] { return cursor; };
  }
  static_state(const static_state&) = delete;
};

// Fills every rank's KV pool with 0xff bytes (NaN in fp32 and bf16): a position attention reads
// without having written it poisons the logits, and bytes nobody should write stay 0xff.
inline void poison_kv(host_runtime& rt) {
  for (const moebius::rank_memory& m : rt.memory()) {
    const moebius::memory_span& pool = m.space(moebius::memory_space::kv_pool);
    std::memset(pool.data(), 0xff, static_cast<size_t>(pool.bytes));
  }
}

// How far two runs of the same prompts agree (runs_agree). Their greedy tokens must be equal
// up to a near tie: where they part, `a`'s logits must rank b's token within 2 * tol *
// max(1, |a's top logit|) of its own (if b's logits are within tol of a's, b can only pick
// another token there); the sequence is compared no further. Until then every logit of b
// must lie within tol * max(1, |a|) of a's.
struct run_agreement {
  bool ok = true;
  std::string why;        // the first disagreement
  int64_t samples = 0;    // samples compared
  int64_t near_ties = 0;  // sequences that parted at a near tie
  double max_rel = 0;     // largest |b - a| / max(1, |a|) over the compared logits
  int64_t differing = 0;  // compared logits whose bits differ
};

inline run_agreement runs_agree(const std::vector<sequence_run>& a,
                                const std::vector<sequence_run>& b, double tol) {
  run_agreement r;
  auto fail = [&](const std::string& why) {
    if (r.ok) r.why = why;
    r.ok = false;
  };
  if (a.size() != b.size()) fail("different numbers of sequences");
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    if (a[i].generated.size() != b[i].generated.size()) fail("different numbers of samples");
    for (size_t s = 0; s < a[i].generated.size() && s < b[i].generated.size(); ++s) {
      const std::vector<float>& la = a[i].logits[s];
      const std::vector<float>& lb = b[i].logits[s];
      ++r.samples;
      const auto ta = static_cast<size_t>(a[i].generated[s]);
      const auto tb = static_cast<size_t>(b[i].generated[s]);
      if (ta != tb) {
        const double gap = static_cast<double>(la[ta]) - static_cast<double>(la[tb]);
        if (gap <= 2 * tol * std::max(1.0, std::fabs(static_cast<double>(la[ta])))) {
          ++r.near_ties;
          break;  // a near tie: the sequences part here, legitimately
        }
        fail("sequence " + std::to_string(i) + " sample " + std::to_string(s) + ": tokens " +
             std::to_string(ta) + " and " + std::to_string(tb) + ", gap " + std::to_string(gap));
        break;
      }
      for (size_t v = 0; v < la.size(); ++v) {
        const double rel = std::fabs(static_cast<double>(lb[v]) - static_cast<double>(la[v])) /
                           std::max(1.0, std::fabs(static_cast<double>(la[v])));
        r.max_rel = std::max(r.max_rel, rel);
        r.differing += std::memcmp(&la[v], &lb[v], sizeof(float)) != 0;
        if (!(rel <= tol))  // NaN fails too
          fail("sequence " + std::to_string(i) + " sample " + std::to_string(s) + " logit " +
               std::to_string(v) + ": " + std::to_string(la[v]) + " vs " + std::to_string(lb[v]));
      }
    }
  }
  return r;
}

inline std::vector<std::vector<int32_t>> random_prompts(std::mt19937_64& rng, int64_t count,
                                                        int64_t max_len, int64_t vocab) {
  std::vector<std::vector<int32_t>> prompts(static_cast<size_t>(count));
  for (auto& p : prompts) {
    p.resize(static_cast<size_t>(std::uniform_int_distribution<int64_t>(1, max_len)(rng)));
    for (auto& t : p)
      t = static_cast<int32_t>(std::uniform_int_distribution<int64_t>(0, vocab - 1)(rng));
  }
  return prompts;
}

}  // namespace mini_engine::testing
