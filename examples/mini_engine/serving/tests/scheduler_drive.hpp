#pragma once

// Drives a scheduler (scheduler.hpp) to the end with the model replaced by a token rule and a
// clock of 1 per step, checking its invariants at every step: tokens in order and never
// restarted (known admission: a preempted or retracted sequence restarts at position 0 with
// every token it had), page tables holding exactly the tokens written and valid, the step's
// budget and batch cap, every page free at the end.

#include <algorithm>
#include <map>
#include <vector>

#include <moebius/kv/page_table.hpp>

#include "catch.hpp"
#include "kv_pages.hpp"
#include "scheduler.hpp"

namespace mini_engine::testing {

using moebius::parallel_mode;

inline moebius::kv_state empty_state(const moebius::kv_geometry& g, parallel_mode m) {
  std::vector<std::vector<moebius::kv_sequence>> tables(static_cast<size_t>(g.num_ranks));
  return moebius::make_kv_state(g, m, tables);
}

inline int32_t rule(int64_t id, int64_t k) { return static_cast<int32_t>((id * 31 + k * 7) % 97); }

inline const moebius::kv_sequence* table_of(const moebius::kv_state& s, int64_t id) {
  for (const auto& r : s.ranks) {
    for (const auto& q : r.sequences) {
      if (q.seq_id == id) return &q;
    }
  }
  return nullptr;
}

// Runs `reqs` to the end on a step clock of 1 per step; checks the invariants at every step
// (known admission: a preempted sequence restarts at position 0 with every token it had).
// `log`, when given, receives every step's batch (its items' token spans are not kept valid).
inline std::vector<request_result> drive(const moebius::kv_geometry& g, parallel_mode m,
                                  std::vector<request> reqs, scheduler_options o,
                                  int64_t* chunked = nullptr, std::vector<step_batch>* log = nullptr) {
  std::map<int64_t, int64_t> prompt_len;
  for (const request& r : reqs) prompt_len[r.id] = static_cast<int64_t>(r.prompt.size());
  std::map<int64_t, int64_t> prefill_len = prompt_len;  // tokens before its first sample
  std::map<int64_t, std::vector<int32_t>> history;  // tokens fed to the model per id
  for (const request& r : reqs) history[r.id] = {};
  std::map<int64_t, int64_t> chunks;
  scheduler s(g, std::move(reqs), o);
  moebius::kv_state kv = empty_state(g, m);
  growing_pages pages(g, kv);
  double now = 0;
  for (int64_t step = 0; !s.done(); ++step) {
    REQUIRE(step < 100000);
    if (s.num_running() == 0) now = std::max(now, s.next_arrival_s());
    const step_batch b = s.next_step(pages, now);
    if (log != nullptr) log->push_back(b);
    // Admission reserved every page a sequence will need (vllm: or preempts; sglang's estimates
    // may leave a prefill chunk waiting while its rank decodes).
    if (o.engine == engine_preset::vllm) CHECK(b.stalled == 0);
    // The step's tokens: per rank with one vLLM engine core per DP rank (EP), else in all.
    const bool per_rank = o.vllm_dp_engines && m == parallel_mode::ep;
    std::vector<int64_t> tokens(per_rank ? kv.ranks.size() : 1, 0);
    std::vector<int32_t> next;
    for (const step_item& it : b.items) {
      tokens[per_rank ? static_cast<size_t>(std::max(0, owner_of(kv, it.seq_id))) : 0] +=
          static_cast<int64_t>(it.tokens.size());
      std::vector<int32_t>& h = history[it.seq_id];
      if (o.admission == admission_policy::known && it.start_position == 0 && !h.empty()) {
        // Re-admitted after a preemption: a prefill of every token it had (prompt, generated).
        // Every token it had: its prefill (a prompt, or a recompute cut short), or what it fed
        // and the token sampled last.
        REQUIRE(static_cast<int64_t>(it.tokens.size()) <=
                std::max<int64_t>(prefill_len[it.seq_id], static_cast<int64_t>(h.size()) + 1));
        const size_t n = std::min(it.tokens.size(), h.size());
        CHECK(std::equal(it.tokens.begin(), it.tokens.begin() + static_cast<std::ptrdiff_t>(n),
                         h.begin()));
        prefill_len[it.seq_id] =
            std::max<int64_t>(prefill_len[it.seq_id], static_cast<int64_t>(h.size()) + 1);
        h.clear();
      }
      REQUIRE(it.start_position == static_cast<int64_t>(h.size()));  // in order, no restart
      h.insert(h.end(), it.tokens.begin(), it.tokens.end());
      const moebius::kv_sequence* q = table_of(kv, it.seq_id);
      REQUIRE(q != nullptr);
      CHECK(q->num_tokens == static_cast<int64_t>(h.size()));  // tables = tokens written
      if (m == parallel_mode::ep) CHECK(owner_of(kv, it.seq_id) >= 0);
      if (it.start_position < prompt_len[it.seq_id]) ++chunks[it.seq_id];
      CHECK(it.sample == (static_cast<int64_t>(h.size()) >= prefill_len[it.seq_id]));
      // The sampled token is the k-th generated one: k = tokens beyond the prompt.
      next.push_back(it.sample ? rule(it.seq_id, static_cast<int64_t>(h.size()) -
                                                     prompt_len[it.seq_id])
                               : -1);
    }
    for (const int64_t t : tokens) CHECK(t <= o.max_step_tokens);
    CHECK(s.num_running() <= o.max_running);
    now += 1;
    s.finish_step(b, next, pages, now);
    moebius::validate(g, kv);
  }
  for (const auto& r : kv.ranks) {
    CHECK(r.sequences.empty());
    CHECK(static_cast<int64_t>(r.free_pages.size()) == g.num_pages(m));  // no leak
  }
  if (chunked != nullptr) {
    *chunked = 0;
    for (const auto& [id, n] : chunks) *chunked += n > 1;
  }
  return s.results();
}

}  // namespace mini_engine::testing
