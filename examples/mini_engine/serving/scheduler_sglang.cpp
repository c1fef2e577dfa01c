// engine_preset::sglang: one step as SGLang's scheduler builds it (engine_preset.hpp names the
// source of each rule). A TP deployment runs one SGLang scheduler; DP attention (the EP mode)
// one per rank, each over its own requests and its rank's pages. Per scheduler (group), a step is
//   a prefill: the running prefill's next chunk, then admissions (first come first served,
//     each while its tokens + min(max_new_tokens, 4096) fit what is left after every running
//     request's charge), within the group's chunk; or, when no prefill can be formed,
//   a decode of every decoding request, after retracting some when the pages are short.
// A request's first chunk is taken at once, so the tables hold exactly what is written.
//
// Worked example (one rank, 12 pages of 4 tokens = 48 tokens; ratio 0.7): A (prompt 8,
// max_new 16) runs with 9 tokens written and 1 generated: its charge is 0.7 x min(16 - 1,
// 4096) = 10.5; 36 tokens are free (9 pages), so 25.5 are left. B (prompt 8, max_new 16)
// needs 8 + 16 = 24 < 25.5: admitted, charged 24 in full; C alike would need 24 >= 1.5: the
// batch is full until A or B finishes or is retracted.
#include <algorithm>
#include <limits>
#include <utility>

#include <moebius/error.hpp>

#include "kv_pages.hpp"
#include "scheduler.hpp"

namespace mini_engine {

using moebius::errc;
using moebius::kv_state;
using moebius::parallel_mode;

new_token_ratio_course scheduler::sglang_course(parallel_mode mode) const {
  // DP attention: the EP mode over more than one rank (SGLang turns it off at dp_size 1).
  return ratio_course(options_.sglang, mode == parallel_mode::ep && g_.num_ranks > 1);
}

void scheduler::sglang_groups_for(parallel_mode mode) {
  const size_t n = mode == parallel_mode::tp ? 1 : static_cast<size_t>(g_.num_ranks);
  if (groups_.size() == n && groups_mode_ == mode) return;
  // A switch changes how many schedulers there are and their conservativeness: each starts
  // afresh, as SGLang's scheduler does when it starts.
  groups_.assign(n, sglang_group{sglang_course(mode).init, false});
  groups_mode_ = mode;
}

int scheduler::sglang_group_of(const kv_state& kv, size_t i) {
  if (kv.mode == parallel_mode::tp) return 0;
  running_seq& s = running_[i];
  const int64_t id = results_[static_cast<size_t>(s.result_idx)].id;
  if (s.owner >= 0 && s.owner < g_.num_ranks && find_sequence(kv, s.owner, id) != nullptr)
    return s.owner;
  int owner = owner_of(kv, id);
  if (owner < 0) owner = s.resume_owner;
  MOEBIUS_CHECK(owner >= 0, errc::internal, "scheduler: running request ", id,
                " has no rank in the EP tables");
  s.owner = owner;
  return owner;
}

int64_t scheduler::sglang_free_tokens(const kv_state& kv, int group) const {
  if (kv.mode == parallel_mode::ep) return free_pages(kv, group) * g_.page_size;
  int64_t least = std::numeric_limits<int64_t>::max();
  for (int r = 0; r < g_.num_ranks; ++r) least = std::min(least, free_pages(kv, r));
  // A TP rank's page holds page_size tokens of 1/dcp of the sequences' pages.
  return least * g_.page_size * g_.dcp;
}

int64_t scheduler::sglang_remaining_new(const running_seq& s) const {
  const int64_t generated =
      static_cast<int64_t>(results_[static_cast<size_t>(s.result_idx)].generated.size());
  return std::clamp<int64_t>(s.max_new - generated, 0, options_.sglang.clip_max_new_tokens);
}

double scheduler::sglang_charge(const running_seq& s, int64_t written, bool prefilling,
                                double ratio) const {
  const int64_t rest = sglang_remaining_new(s);
  if (prefilling) return static_cast<double>(std::max<int64_t>(0, s.prompt - written) + rest);
  return ratio * static_cast<double>(rest);
}

step_batch scheduler::next_step_sglang(page_source& pages, double now_s) {
  step_batch b;
  const kv_state& kv = pages.tables();
  const bool tp = kv.mode == parallel_mode::tp;
  sglang_groups_for(kv.mode);
  // An idle server returns to the initial ratio (Scheduler.self_check_during_idle).
  if (running_.empty())
    for (sglang_group& gr : groups_) gr.ratio = sglang_course(kv.mode).init;
  const size_t num_groups = groups_.size();
  const int64_t ranks = tp ? 1 : g_.num_ranks;
  const int64_t chunk = options_.rank_prefill_chunk(ranks);
  const int64_t cap = std::max<int64_t>(1, options_.max_running / ranks);
  std::vector<int> group_of(running_.size());
  std::vector<int64_t> count(num_groups, 0), chunk_left(num_groups, chunk);
  // Mixed chunks: each decoding request takes one token of its group's chunk and room
  // (PrefillAdder's mixed_with_decode_tokens).
  const bool mixed = options_.sglang.enable_mixed_chunk;
  std::vector<int64_t> decoding(num_groups, 0);
  std::vector<bool> prefilling(num_groups, false);
  for (size_t i = 0; i < running_.size(); ++i) {
    group_of[i] = sglang_group_of(kv, i);
    ++count[static_cast<size_t>(group_of[i])];
    if (mixed && running_[i].decoding()) ++decoding[static_cast<size_t>(group_of[i])];
  }
  for (size_t gi = 0; gi < num_groups; ++gi) chunk_left[gi] -= decoding[gi];
  std::vector<bool> in_batch(running_.size(), false), gone(running_.size(), false);

  // 1. The running prefills' next chunks (admission order), each within its group's chunk.
  for (size_t i = 0; i < running_.size(); ++i) {
    const running_seq& s = running_[i];
    const size_t gi = static_cast<size_t>(group_of[i]);
    if (s.decoding() || chunk_left[gi] <= 0) continue;
    request_result& res = results_[static_cast<size_t>(s.result_idx)];
    const int64_t granted =
        pages.grant(res.id, s.in_kv, std::min(chunk_left[gi], s.prompt - s.in_kv), s.resume_owner);
    if (granted <= 0) {
      ++res.stalls;
      ++b.stalled;
      continue;
    }
    push_item(b, static_cast<int64_t>(i), granted);
    in_batch[i] = true;
    chunk_left[gi] -= granted;
    prefilling[gi] = true;
  }

  // 2. Admission. Each group's room: its free tokens less every running request's charge.
  // A chunk just granted is in the tables (the free pages count it), not in the charge; a
  // request mid-prefill when the step began is charged in full (its last chunk carries its
  // max_new_tokens: PrefillAdder.add_chunked_req).
  std::vector<double> charged(decoding.begin(), decoding.end());
  {
    std::vector<int64_t> granted(running_.size(), 0);
    for (size_t k = 0; k < b.items.size(); ++k)
      granted[static_cast<size_t>(b.running_idx[k])] += static_cast<int64_t>(b.items[k].tokens.size());
    for (size_t i = 0; i < running_.size(); ++i) {
      const size_t gi = static_cast<size_t>(group_of[i]);
      charged[gi] += sglang_charge(running_[i], running_[i].in_kv + granted[i],
                                   !running_[i].decoding(), groups_[gi].ratio);
    }
  }
  while (pages.admits()) {
    const std::optional<bool> head = next_waiting(now_s);
    if (!head) break;
    const bool resumed = *head;
    // The group that takes it: TP the one; EP the rank with the most room among those that
    // may prefill (not full, chunk left, below max_running_requests / ranks).
    int best = -1;
    double best_room = -std::numeric_limits<double>::infinity();
    for (size_t gi = 0; gi < num_groups; ++gi) {
      if (groups_[gi].full || chunk_left[gi] <= 0) continue;
      if (count[gi] >= cap) {
        groups_[gi].full = true;  // get_new_batch_prefill: no allocatable request slot
        continue;
      }
      const double room = static_cast<double>(sglang_free_tokens(kv, static_cast<int>(gi))) - charged[gi];
      if (room > best_room) {
        best_room = room;
        best = static_cast<int>(gi);
      }
    }
    if (best < 0) break;
    const size_t bi = static_cast<size_t>(best);
    running_seq s = resumed ? preempted_.front() : admit_new();
    const int64_t tokens = static_cast<int64_t>(s.tokens.size());
    const int64_t need = tokens + sglang_remaining_new(s);
    // add_one_req: total_tokens >= rem_total_tokens refuses. A request is never refused by a
    // group with nothing running: SGLang clamps max_new_tokens so that a lone request fits,
    // and refuses longer inputs up front, where here every request the pool holds at its
    // largest is served.
    if (count[bi] > 0 && static_cast<double>(need) >= best_room) {
      // No group has more room: every group that could prefill is full until one shrinks.
      for (size_t gi = 0; gi < num_groups; ++gi)
        if (chunk_left[gi] > 0) groups_[gi].full = groups_[gi].full_for_kv = true;
      break;
    }
    s.owner = tp ? -1 : best;
    request_result& res = results_[static_cast<size_t>(s.result_idx)];
    const int64_t n = std::min(chunk_left[bi], tokens);
    const int64_t granted = pages.grant(res.id, 0, n, tp ? -1 : best);
    if (granted <= 0) {
      // Room on paper but not in the free lists (a switch moved pages): it stays first in line.
      b.admission_blocked = true;
      break;
    }
    running_.push_back(std::move(s));
    in_batch.push_back(true);
    gone.push_back(false);
    group_of.push_back(best);
    push_item(b, static_cast<int64_t>(running_.size()) - 1, granted);
    chunk_left[bi] -= granted;
    prefilling[bi] = true;
    ++count[bi];
    charged[bi] += static_cast<double>(tokens - granted + sglang_remaining_new(running_.back()));
    if (res.admitted_s < 0) res.admitted_s = now_s;
    ++res.admissions;
    ++b.admitted;
    if (resumed) preempted_.pop_front();
    else ++next_waiting_;
  }

  // 3. A group that formed no prefill decodes (retracting first when its pages are short);
  // with mixed chunks one that did decodes beside it.
  for (size_t gi = 0; gi < num_groups; ++gi)
    if (!prefilling[gi] || mixed)
      sglang_decode(b, pages, static_cast<int>(gi), group_of, in_batch, gone, now_s,
                    prefilling[gi]);
  // The decodes a prefill held back (the prefill-first alternation's price, which the gate
  // weighs: run_policy's held share).
  if (!mixed)
    for (size_t i = 0; i < group_of.size(); ++i)
      if (prefilling[static_cast<size_t>(group_of[i])] && !in_batch[i] && !gone[i] &&
          running_[i].decoding())
        ++b.decodes_held;
  if (b.preempted > 0) drop_running(b, gone);

  // Requests wait with the pool full: a refusal now, or a group still full from one.
  if (next_waiting(now_s).has_value()) {
    for (const sglang_group& gr : groups_) b.admission_blocked = b.admission_blocked || gr.full_for_kv;
  }
  b.num_sequences = static_cast<int64_t>(b.items.size());
  MOEBIUS_CHECK(!b.empty() || running_.empty() || !pages.admits(), errc::capacity, "scheduler: ",
                running_.size(), " running sequences and none can grow: the KV pool is exhausted");
  // What admission counts as taken after the step: written + each one's charge.
  std::vector<int64_t> step_tokens(running_.size(), 0);
  for (size_t k = 0; k < b.items.size(); ++k)
    step_tokens[static_cast<size_t>(b.running_idx[k])] += static_cast<int64_t>(b.items[k].tokens.size());
  double reserved = 0;
  for (size_t i = 0; i < running_.size(); ++i) {
    const int64_t written = running_[i].in_kv + step_tokens[i];
    b.kv_written_tokens += written;
    reserved += static_cast<double>(written) +
                sglang_charge(running_[i], written, written < running_[i].prompt,
                              groups_[static_cast<size_t>(sglang_group_of(kv, i))].ratio);
  }
  b.kv_reserved_tokens = static_cast<int64_t>(reserved);
  for (const sglang_group& gr : groups_) b.new_token_ratio += gr.ratio;
  b.new_token_ratio /= static_cast<double>(num_groups);
  return b;
}

void scheduler::sglang_decode(step_batch& b, page_source& pages, int group,
                              const std::vector<int>& group_of, std::vector<bool>& in_batch,
                              std::vector<bool>& gone, double now_s, bool mixed) {
  const kv_state& kv = pages.tables();
  std::vector<size_t> decoding;
  for (size_t i = 0; i < group_of.size(); ++i) {
    if (group_of[i] == group && !in_batch[i] && !gone[i] && running_[i].decoding())
      decoding.push_back(i);
  }
  if (decoding.empty()) return;
  sglang_group& gr = groups_[static_cast<size_t>(group)];
  const new_token_ratio_course course = sglang_course(kv.mode);
  auto free_pages_of_group = [&] {
    if (kv.mode == parallel_mode::ep) return free_pages(kv, group);
    int64_t least = std::numeric_limits<int64_t>::max();
    for (int r = 0; r < g_.num_ranks; ++r) least = std::min(least, free_pages(kv, r));
    return least;
  };
  // The pages the next decode takes: one per sequence whose tokens fill their last page
  // (ScheduleBatch.check_decode_mem).
  int64_t need = 0;
  for (const size_t i : decoding) {
    const int64_t t = running_[i].in_kv;
    need += pages_needed(g_, kv.mode, t + 1) - pages_needed(g_, kv.mode, t);
  }
  if (pages.admits() && free_pages_of_group() < need) {
    // ScheduleBatch.retract_decode: sorted by output length descending, then prompt length
    // ascending (stable), taken from the end until retract_decode_steps tokens per request
    // left are free; at least one, never the last.
    auto generated = [&](size_t i) {
      return results_[static_cast<size_t>(running_[i].result_idx)].generated.size();
    };
    auto prompt = [&](size_t i) {
      return results_[static_cast<size_t>(running_[i].result_idx)].prompt_tokens;
    };
    std::stable_sort(decoding.begin(), decoding.end(), [&](size_t x, size_t y) {
      if (generated(x) != generated(y)) return generated(x) > generated(y);
      return prompt(x) < prompt(y);
    });
    const int64_t per_page = g_.page_size * (kv.mode == parallel_mode::tp ? g_.dcp : 1);
    const int64_t steps = options_.sglang.retract_decode_steps;
    for (bool first = true;
         first || free_pages_of_group() * per_page < steps * static_cast<int64_t>(decoding.size());
         first = false) {
      if (decoding.size() == 1) break;
      const size_t victim = decoding.back();
      decoding.pop_back();
      running_seq q = take_for_recompute(static_cast<int64_t>(victim), pages);
      q.requeue_s = now_s;  // waiting_queue.extend: behind every request that has arrived
      preempted_.push_back(std::move(q));
      gone[victim] = true;
      ++b.preempted;
    }
    // new_estimate_ratio over the requests left.
    int64_t decoded = 0, max_new = 0;
    for (const size_t i : decoding) {
      decoded += static_cast<int64_t>(generated(i));
      max_new += running_[i].max_new;
    }
    gr.ratio = max_new > 0 ? std::min(1.0, static_cast<double>(decoded + steps * static_cast<int64_t>(
                                                                             decoding.size())) /
                                               static_cast<double>(max_new))
                           : 1.0;
    gr.full = gr.full_for_kv = false;  // the batch shrank
    std::sort(decoding.begin(), decoding.end());  // the batch in running order
  } else if (!mixed) {
    gr.ratio = std::max(gr.ratio - course.decay, course.floor);
  }
  int64_t decoded_now = 0;
  for (const size_t i : decoding) {
    request_result& res = results_[static_cast<size_t>(running_[i].result_idx)];
    if (pages.grant(res.id, running_[i].in_kv, 1, -1) <= 0) {
      ++res.stalls;
      ++b.stalled;
      continue;
    }
    push_item(b, static_cast<int64_t>(i), 1);
    in_batch[i] = true;
    ++decoded_now;
  }
  const int64_t graph_max = options_.sglang.cuda_graph_max_bs;
  if (graph_max > 0 && decoded_now > graph_max) b.eager = true;
}

}  // namespace mini_engine
