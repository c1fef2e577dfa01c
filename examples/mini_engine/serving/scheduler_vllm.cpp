// engine_preset::vllm (and the oracle's admission): one step as vLLM V1's scheduler builds it
// (engine_preset.hpp names the source of each rule): every decode, then the running prefills'
// chunks, then admissions first come first served, within the step's token budget (or, with
// scheduler_options::vllm_dp_engines under EP, each rank's own budget: one engine core per DP
// rank); a sequence short of a page preempts the newest on its rank. engine_preset::sglang
// hands the step to scheduler_sglang.cpp.
#include <algorithm>
#include <cmath>

#include <moebius/error.hpp>

#include "kv_pages.hpp"
#include "scheduler.hpp"

namespace mini_engine {

using moebius::errc;
using moebius::kv_state;
using moebius::parallel_mode;

step_batch scheduler::next_step(page_source& pages, double now_s) {
  if (options_.engine == engine_preset::sglang) return next_step_sglang(pages, now_s);
  step_batch b;
  const kv_state& kv = pages.tables();
  // One token budget for the step, or (vllm_dp_engines, EP) one per rank; an item charges its
  // rank's (owner: -1 in TP, or a sequence whose rank is not known yet, charges budget 0).
  const bool per_rank = options_.vllm_dp_engines && kv.mode == parallel_mode::ep &&
                        g_.num_ranks > 1;
  std::vector<int64_t> budgets(per_rank ? static_cast<size_t>(g_.num_ranks) : 1,
                               options_.max_step_tokens);
  auto budget_of = [&](int owner) -> int64_t& {
    return budgets[per_rank && owner >= 0 ? static_cast<size_t>(owner) : 0];
  };
  // per_rank: each running sequence's rank at the step's start (its table's, or the owner a
  // resumed one was given), looked up once; indexed by slot until the preempted leave.
  std::vector<int> rank_at;
  if (per_rank) {
    rank_at.reserve(running_.size());
    for (const running_seq& s : running_) {
      const int o = owner_of(kv, results_[static_cast<size_t>(s.result_idx)].id);
      rank_at.push_back(o >= 0 ? o : s.resume_owner);
    }
  }
  auto rank_of = [&](size_t slot) { return per_rank ? rank_at[slot] : -1; };
  auto any_budget = [&] {
    return std::any_of(budgets.begin(), budgets.end(), [](int64_t x) { return x > 0; });
  };
  const bool may_preempt = options_.admission == admission_policy::known && pages.admits();
  std::vector<bool> in_batch(running_.size(), false), preempted(running_.size(), false);

  // Adds up to `n` tokens of running sequence `slot`, as many as `pages` grants. When it grants
  // none to a sequence that runs (not one being admitted): with known admission, preempts the
  // newest sequence on its rank and asks again (false when `slot` itself was preempted); else
  // false, a stall (counted).
  auto add = [&](int64_t slot, int64_t n, int owner, bool admitting) {
    running_seq& s = running_[static_cast<size_t>(slot)];
    request_result& res = results_[static_cast<size_t>(s.result_idx)];
    int64_t granted = pages.grant(res.id, s.in_kv, n, owner);
    while (granted <= 0 && may_preempt && !admitting) {
      const int rank = kv.mode == parallel_mode::tp ? -1 : std::max(owner, owner_of(kv, res.id));
      const int64_t victim = preemption_victim(kv, slot, rank, in_batch, preempted);
      if (victim < 0) break;
      preempt(victim, pages);
      preempted[static_cast<size_t>(victim)] = true;
      ++b.preempted;
      if (victim == slot) return false;
      granted = pages.grant(res.id, s.in_kv, n, owner);
    }
    if (granted <= 0) {
      ++res.stalls;
      ++b.stalled;
      return false;
    }
    n = granted;
    push_item(b, slot, n);
    in_batch[static_cast<size_t>(slot)] = true;
    // An admission charges the rank it was given, a running sequence its own.
    budget_of(admitting ? owner : std::max(owner, rank_of(static_cast<size_t>(slot)))) -= n;
    return true;
  };

  // 1. Decode, 2. prefill chunks of admitted sequences (admission order), each within its
  // rank's budget (one budget unless per_rank).
  for (size_t i = 0; i < running_.size() && any_budget(); ++i) {
    if (running_[i].decoding() && !preempted[i] && budget_of(rank_of(i)) > 0)
      add(static_cast<int64_t>(i), 1, -1, false);
  }
  for (size_t i = 0; i < running_.size() && any_budget(); ++i) {
    const running_seq& s = running_[i];
    const int64_t left = budget_of(rank_of(i));
    // in_kv == 0: a resumed sequence (lose_kv) starts its recompute on its reserved owner.
    if (!s.decoding() && !preempted[i] && left > 0)
      add(static_cast<int64_t>(i), std::min(left, s.prompt - s.in_kv), s.resume_owner, false);
  }
  // Per rank: its running count against max_running / P (vLLM's max_num_seqs per engine),
  // the preempted not counted.
  std::vector<int64_t> running_on(per_rank ? static_cast<size_t>(g_.num_ranks) : 0, 0);
  for (size_t i = 0; i < rank_at.size(); ++i)
    if (!preempted[i] && rank_at[i] >= 0) ++running_on[static_cast<size_t>(rank_at[i])];
  // The preempted leave the running set (items keep their slots: remapped).
  if (b.preempted > 0) drop_running(b, preempted);
  // 3. Admission, first come first served: preempted sequences first (none in a step that
  // preempted, as vLLM), then new requests.
  const double watermark = options_.admission_watermark();
  const int64_t watermark_pages =
      static_cast<int64_t>(std::ceil(watermark * static_cast<double>(g_.num_pages(kv.mode))));
  const int64_t rank_cap = std::max<int64_t>(1, options_.max_running / g_.num_ranks);
  while (pages.admits() && b.preempted == 0 && any_budget() &&
         static_cast<int64_t>(running_.size()) < options_.max_running) {
    const bool resumed = !preempted_.empty();
    if (!resumed && (next_waiting_ >= requests_.size() || requests_[next_waiting_].arrival_s > now_s))
      break;
    running_seq s = resumed ? preempted_.front() : admit_new();
    // Pages for its reservation, and the watermark beside sequences that run.
    const int64_t need = pages_needed(g_, kv.mode, reserved_tokens(s)) +
                         (running_.empty() ? 0 : watermark_pages);
    const std::vector<int64_t> left = unreserved(kv);
    int owner = -1;
    if (kv.mode == parallel_mode::tp) {
      if (*std::min_element(left.begin(), left.end()) < need) {
        b.admission_blocked = true;
        break;
      }
    } else if (!per_rank) {
      owner = static_cast<int>(std::max_element(left.begin(), left.end()) - left.begin());
      if (left[static_cast<size_t>(owner)] < need) {
        b.admission_blocked = true;
        break;
      }
    } else {
      // The rank with the most unreserved pages among those with budget and room.
      for (int r = 0; r < g_.num_ranks; ++r) {
        const size_t ri = static_cast<size_t>(r);
        if (budgets[ri] <= 0 || running_on[ri] >= rank_cap) continue;
        if (owner < 0 || left[ri] > left[static_cast<size_t>(owner)]) owner = r;
      }
      if (owner < 0) break;  // no rank has budget and room: it waits for the next step
      if (left[static_cast<size_t>(owner)] < need) {
        b.admission_blocked = true;
        break;
      }
    }
    request_result& res = results_[static_cast<size_t>(s.result_idx)];
    running_.push_back(std::move(s));
    in_batch.push_back(false);
    preempted.push_back(false);
    const int64_t slot = static_cast<int64_t>(running_.size()) - 1;
    if (!add(slot, std::min(budget_of(owner), running_.back().prompt), owner, true)) {
      // Reserved pages exist on paper but not in the free lists (a switch moved owners):
      // the request goes back to the head of the queue, not admitted.
      if (resumed) preempted_.front() = std::move(running_.back());
      running_.pop_back();
      --b.stalled;
      --res.stalls;
      break;
    }
    if (res.admitted_s < 0) res.admitted_s = now_s;
    ++res.admissions;
    ++b.admitted;
    if (per_rank) ++running_on[static_cast<size_t>(owner)];
    if (resumed) preempted_.pop_front();
    else ++next_waiting_;
  }
  // A step that preempted admits nothing: the preempted sequence waits with the pool full.
  if (b.preempted > 0) b.admission_blocked = true;
  b.num_sequences = static_cast<int64_t>(b.items.size());
  MOEBIUS_CHECK(!b.empty() || running_.empty() || !pages.admits(), errc::capacity, "scheduler: ", running_.size(),
                " running sequences and none can grow: the KV pool is exhausted (a switch moved "
                "more reservations onto a rank than it holds)");
  account(b);
  return b;
}

}  // namespace mini_engine
