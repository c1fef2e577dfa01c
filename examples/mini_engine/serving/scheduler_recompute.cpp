// The scheduler's running sequences that lose their KV and are recomputed from their tokens
// (scheduler.hpp): after a switch that lost it (lose_kv, the engine's recovery), and when
// preempted for another sequence's pages (admission_policy::known). Either way the recompute is
// a prefill of every token the sequence has, whose sample is the token it would have decoded
// next: greedy tokens unchanged.
#include <algorithm>
#include <string>
#include <utility>

#include <moebius/error.hpp>

#include "kv_pages.hpp"
#include "scheduler.hpp"

namespace mini_engine {

using moebius::kv_state;
using moebius::parallel_mode;

int64_t scheduler::lose_kv(kv_state& kv, std::span<const int64_t> lost, bool resume,
                           const std::string& why) {
  std::vector<int64_t> ids(lost.begin(), lost.end());
  std::sort(ids.begin(), ids.end());
  auto is_lost = [&](const running_seq& s) {
    return std::binary_search(ids.begin(), ids.end(),
                              results_[static_cast<size_t>(s.result_idx)].id);
  };
  std::vector<bool> drop(running_.size(), false);
  // Resumed sequences are re-reserved one by one, largest first, on the rank with the most
  // pages left (EP); TP reservations are on every rank and were counted before the loss.
  std::vector<size_t> order;
  int64_t affected = 0;
  for (size_t i = 0; i < running_.size(); ++i) {
    running_seq& s = running_[i];
    if (!is_lost(s)) continue;
    ++affected;
    request_result& res = results_[static_cast<size_t>(s.result_idx)];
    if (!resume) {
      res.error = "request " + std::to_string(res.id) + ": " + why;
      drop[i] = true;
      continue;
    }
    ++res.resumes;
    // Recompute every token it has: the prompt and the generated ones but the last, whose
    // K/V the next decode would have written. A prefill of all of them samples that next token.
    s.prompt = static_cast<int64_t>(s.tokens.size());
    s.in_kv = 0;
    s.resume_owner = -1;
    order.push_back(i);
  }
  if (kv.mode == parallel_mode::tp) {
    // Every rank holds every sequence's reservation already: a table of one token (within it)
    // makes the sequence visible to a switch before its recompute starts.
    for (const size_t i : order)
      reserve_tokens(g_, kv, results_[static_cast<size_t>(running_[i].result_idx)].id, 1, -1);
  } else {
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
      return reserved_tokens(running_[a]) > reserved_tokens(running_[b]);
    });
    for (const size_t i : order) {
      running_seq& s = running_[i];
      const std::vector<int64_t> left = unreserved(kv);  // counts those placed so far
      const int owner = static_cast<int>(std::max_element(left.begin(), left.end()) - left.begin());
      if (left[static_cast<size_t>(owner)] >= pages_needed(g_, kv.mode, reserved_tokens(s))) {
        s.resume_owner = owner;
        reserve_tokens(g_, kv, results_[static_cast<size_t>(s.result_idx)].id, 1, owner);
        continue;
      }
      request_result& res = results_[static_cast<size_t>(s.result_idx)];
      res.error = "request " + std::to_string(res.id) + ": " + why +
                  "; no rank has room to recompute it after the recovery (capacity)";
      drop[i] = true;
    }
  }
  size_t out = 0;
  for (size_t i = 0; i < running_.size(); ++i) {
    if (drop[i]) {
      ++num_failed_;
      // A failed request ends its rollout step as a finished one would (at the last step's
      // time: the loss happened in a switch after it).
      if (running_[i].step >= 0 && --steps_[static_cast<size_t>(running_[i].step)].left == 0)
        start_next_step(running_[i].step, last_step_s_);
      continue;
    }
    if (out != i) running_[out] = std::move(running_[i]);
    ++out;
  }
  running_.resize(out);
  return affected;
}

int64_t scheduler::preemption_victim(const kv_state& kv, int64_t slot, int rank,
                                     const std::vector<bool>& in_batch,
                                     const std::vector<bool>& preempted) const {
  auto holds_there = [&](int64_t k) {
    const int64_t id = results_[static_cast<size_t>(running_[static_cast<size_t>(k)].result_idx)].id;
    if (rank < 0) return held_tokens(kv, id) > 0;
    return find_sequence(kv, rank, id) != nullptr;
  };
  for (int64_t k = static_cast<int64_t>(running_.size()) - 1; k >= 0; --k) {
    if (k == slot) return holds_there(k) ? k : -1;
    if (in_batch[static_cast<size_t>(k)] || preempted[static_cast<size_t>(k)]) continue;
    if (holds_there(k)) return k;
  }
  return -1;
}

void scheduler::preempt(int64_t slot, page_source& pages) {
  preempted_.push_front(take_for_recompute(slot, pages));
}

scheduler::running_seq scheduler::take_for_recompute(int64_t slot, page_source& pages) {
  running_seq& s = running_[static_cast<size_t>(slot)];
  request_result& res = results_[static_cast<size_t>(s.result_idx)];
  pages.release(res.id);
  ++res.preemptions;
  ++num_preemptions_;
  // Recomputed as a prefill of every token it has (as lose_kv resumes): its sample is the token
  // it would have decoded next. (running_[slot] is left empty: the caller drops it.)
  running_seq q = std::move(s);
  q.prompt = static_cast<int64_t>(q.tokens.size());
  q.in_kv = 0;
  q.resume_owner = -1;
  q.owner = -1;
  return q;
}

}  // namespace mini_engine
