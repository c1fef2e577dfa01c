#include "scheduler.hpp"

#include <algorithm>
#include <cmath>

#include <moebius/error.hpp>

#include "kv_pages.hpp"

namespace mini_engine {

using moebius::errc;
using moebius::kv_geometry;
using moebius::kv_state;
using moebius::parallel_mode;

void validate(const scheduler_options& o) {
  MOEBIUS_CHECK(o.max_running >= 1 && o.max_running <= o.max_step_tokens, errc::invalid_argument,
                "scheduler: need 1 <= max_running <= max_step_tokens (max_running=",
                o.max_running, ", max_step_tokens=", o.max_step_tokens,
                "): every running sequence must be able to decode in one step");
}

scheduler::scheduler(const kv_geometry& g, std::vector<request> requests,
                     scheduler_options options)
    : g_(g), options_(options), requests_(std::move(requests)) {
  validate(options_);
  // A request must fit one EP rank at its largest (EP is the smaller per-sequence capacity:
  // a TP rank has tp_pages_per_ep_page() times the pages and the same tokens per page).
  const int64_t rank_pages = std::min(g.num_pages(parallel_mode::ep), g.num_pages(parallel_mode::tp));
  for (const request& r : requests_) {
    MOEBIUS_CHECK(!r.prompt.empty() && r.output_tokens >= 1 && std::isfinite(r.arrival_s),
                  errc::invalid_argument, "request ", r.id,
                  ": needs a prompt, output_tokens >= 1 and a finite arrival (prompt ",
                  r.prompt.size(), ", output ", r.output_tokens, ")");
    const int64_t largest = static_cast<int64_t>(r.prompt.size()) + r.output_tokens - 1;
    const int64_t pages = pages_needed(g, parallel_mode::ep, largest);
    MOEBIUS_CHECK(pages <= rank_pages, errc::invalid_argument, "request ", r.id, " needs ", pages,
                  " KV pages at its largest (", largest, " tokens) but a rank holds ", rank_pages,
                  ": it could never be admitted");
  }
  std::stable_sort(requests_.begin(), requests_.end(), [](const request& a, const request& b) {
    return a.arrival_s < b.arrival_s || (a.arrival_s == b.arrival_s && a.id < b.id);
  });
  results_.reserve(requests_.size());
  for (const request& r : requests_) {
    request_result x;
    x.id = r.id;
    x.arrival_s = r.arrival_s;
    x.prompt_tokens = static_cast<int64_t>(r.prompt.size());
    x.output_tokens = r.output_tokens;
    results_.push_back(std::move(x));
  }
  std::sort(results_.begin(), results_.end(),
            [](const request_result& a, const request_result& b) { return a.id < b.id; });
  for (size_t i = 1; i < results_.size(); ++i) {
    MOEBIUS_CHECK(results_[i].id != results_[i - 1].id, errc::invalid_argument,
                  "request id ", results_[i].id, " appears twice");
  }
}

double scheduler::next_arrival_s() const {
  return next_waiting_ < requests_.size() ? requests_[next_waiting_].arrival_s
                                          : std::numeric_limits<double>::infinity();
}

int64_t scheduler::num_waiting(double now_s) const {
  int64_t n = 0;
  for (size_t i = next_waiting_; i < requests_.size() && requests_[i].arrival_s <= now_s; ++i) ++n;
  return n;
}

int64_t scheduler::num_prefilling() const {
  return std::count_if(running_.begin(), running_.end(),
                       [](const running_seq& s) { return !s.decoding(); });
}

std::vector<int64_t> scheduler::unreserved(const kv_state& kv) const {
  const int P = g_.num_ranks;
  std::vector<int64_t> left(static_cast<size_t>(P), g_.num_pages(kv.mode));
  for (const running_seq& s : running_) {
    const int64_t pages = pages_needed(g_, kv.mode, s.final_tokens);
    if (kv.mode == parallel_mode::tp) {
      for (int64_t& l : left) l -= pages;
    } else {
      // A sequence whose prefill has not written a token yet has no table: it is reserved
      // on the owner it was admitted to, which is recorded when its first chunk is placed
      // (same step), so every running sequence here has an owner.
      const int owner = owner_of(kv, results_[static_cast<size_t>(s.result_idx)].id);
      if (owner >= 0) left[static_cast<size_t>(owner)] -= pages;
    }
  }
  return left;
}

bool scheduler::fits_at_largest(const kv_state& kv, parallel_mode target) const {
  (void)kv;
  const int64_t cap = g_.num_pages(target);
  std::vector<int64_t> need;
  need.reserve(running_.size());
  for (const running_seq& s : running_) need.push_back(pages_needed(g_, target, s.final_tokens));
  if (target == parallel_mode::tp) {
    int64_t sum = 0;
    for (int64_t n : need) sum += n;
    return sum <= cap;
  }
  std::sort(need.begin(), need.end(), std::greater<>());
  std::vector<int64_t> left(static_cast<size_t>(g_.num_ranks), cap);
  for (int64_t n : need) {
    auto it = std::find_if(left.begin(), left.end(), [&](int64_t l) { return l >= n; });
    if (it == left.end()) return false;
    *it -= n;
  }
  return true;
}

namespace {

// Tokens sequence `id` holds in `kv` (0 when absent): on its EP owner, or on every TP rank.
int64_t held_tokens(const kv_state& kv, int64_t id) {
  for (int r = 0; r < static_cast<int>(kv.ranks.size()); ++r)
    if (const moebius::kv_sequence* q = find_sequence(kv, r, id)) return q->num_tokens;
  return 0;
}

}  // namespace

step_batch scheduler::next_step(kv_state& kv, double now_s) {
  step_batch b;
  int64_t budget = options_.max_step_tokens;

  // Grows seq's tables for `n` more tokens and adds the item; false (nothing changed) when a
  // page is missing.
  auto add = [&](int64_t slot, int64_t n, int owner) {
    running_seq& s = running_[static_cast<size_t>(slot)];
    const int64_t id = results_[static_cast<size_t>(s.result_idx)].id;
    try {
      // A sequence may already hold more (reserve_for_switch): then nothing grows.
      if (held_tokens(kv, id) < s.in_kv + n) reserve_tokens(g_, kv, id, s.in_kv + n, owner);
    } catch (const moebius::error& e) {
      if (e.code() != errc::capacity) throw;
      ++results_[static_cast<size_t>(s.result_idx)].stalls;
      ++b.stalled;
      return false;
    }
    step_item it;
    it.seq_id = id;
    it.tokens = std::span<const int32_t>(s.tokens.data() + s.in_kv, static_cast<size_t>(n));
    it.start_position = s.in_kv;
    it.sample = s.in_kv + n >= s.prompt;
    b.items.push_back(it);
    b.running_idx.push_back(slot);
    budget -= n;
    b.context_tokens += s.in_kv + n;
    if (s.decoding()) ++b.decode_tokens;
    else b.prefill_tokens += n;
    return true;
  };

  // 1. Decode, 2. prefill chunks of admitted sequences (admission order).
  for (size_t i = 0; i < running_.size() && budget > 0; ++i) {
    if (running_[i].decoding()) add(static_cast<int64_t>(i), 1, -1);
  }
  for (size_t i = 0; i < running_.size() && budget > 0; ++i) {
    const running_seq& s = running_[i];
    if (!s.decoding() && s.in_kv > 0) add(static_cast<int64_t>(i), std::min(budget, s.prompt - s.in_kv), -1);
  }
  // 3. Admission, first come first served.
  while (budget > 0 && next_waiting_ < requests_.size() &&
         requests_[next_waiting_].arrival_s <= now_s &&
         static_cast<int64_t>(running_.size()) < options_.max_running) {
    const request& r = requests_[next_waiting_];
    running_seq s;
    s.prompt = static_cast<int64_t>(r.prompt.size());
    s.final_tokens = s.prompt + r.output_tokens - 1;
    const int64_t pages = pages_needed(g_, kv.mode, s.final_tokens);
    const std::vector<int64_t> left = unreserved(kv);
    int owner = -1;
    if (kv.mode == parallel_mode::tp) {
      if (*std::min_element(left.begin(), left.end()) < pages) break;
    } else {
      owner = static_cast<int>(std::max_element(left.begin(), left.end()) - left.begin());
      if (left[static_cast<size_t>(owner)] < pages) break;
    }
    auto res = std::lower_bound(results_.begin(), results_.end(), r.id,
                                [](const request_result& x, int64_t id) { return x.id < id; });
    s.result_idx = res - results_.begin();
    s.tokens.reserve(static_cast<size_t>(s.prompt + r.output_tokens));
    s.tokens = r.prompt;
    running_.push_back(std::move(s));
    const int64_t slot = static_cast<int64_t>(running_.size()) - 1;
    if (!add(slot, std::min(budget, running_.back().prompt), owner)) {
      // Reserved pages exist on paper but not in the free lists (a switch moved owners):
      // the request goes back to the head of the queue, never admitted.
      running_.pop_back();
      --b.stalled;
      --res->stalls;
      break;
    }
    res->admitted_s = now_s;
    ++res->admissions;
    ++b.admitted;
    ++next_waiting_;
  }
  b.num_sequences = static_cast<int64_t>(b.items.size());
  MOEBIUS_CHECK(!b.empty() || running_.empty(), errc::capacity, "scheduler: ", running_.size(),
                " running sequences and none can grow: the KV pool is exhausted (a switch moved "
                "more reservations onto a rank than it holds)");
  return b;
}

void scheduler::reserve_for_switch(kv_state& kv, int64_t steps) {
  MOEBIUS_CHECK(steps >= 1, errc::invalid_argument, "reserve_for_switch: steps must be >= 1 (got ",
                steps, ")");
  for (const running_seq& s : running_) {
    const int64_t id = results_[static_cast<size_t>(s.result_idx)].id;
    const int64_t want = std::min(s.final_tokens, std::max(s.in_kv, s.prompt) + steps);
    if (held_tokens(kv, id) < want) reserve_tokens(g_, kv, id, want, -1);
  }
}

step_batch scheduler::next_step_frozen(const kv_state& kv) {
  step_batch b;
  int64_t budget = options_.max_step_tokens;
  auto add = [&](size_t slot, int64_t n) {
    running_seq& s = running_[slot];
    request_result& res = results_[static_cast<size_t>(s.result_idx)];
    n = std::min(n, held_tokens(kv, res.id) - s.in_kv);
    if (n <= 0) {
      ++res.stalls;
      ++b.stalled;
      return;
    }
    step_item it;
    it.seq_id = res.id;
    it.tokens = std::span<const int32_t>(s.tokens.data() + s.in_kv, static_cast<size_t>(n));
    it.start_position = s.in_kv;
    it.sample = s.in_kv + n >= s.prompt;
    b.items.push_back(it);
    b.running_idx.push_back(static_cast<int64_t>(slot));
    budget -= n;
    b.context_tokens += s.in_kv + n;
    if (s.decoding()) ++b.decode_tokens;
    else b.prefill_tokens += n;
  };
  for (size_t i = 0; i < running_.size() && budget > 0; ++i)
    if (running_[i].decoding()) add(i, 1);
  for (size_t i = 0; i < running_.size() && budget > 0; ++i)
    if (!running_[i].decoding()) add(i, std::min(budget, running_[i].prompt - running_[i].in_kv));
  b.num_sequences = static_cast<int64_t>(b.items.size());
  return b;
}

void scheduler::release_deferred(kv_state& kv) {
  for (int64_t id : deferred_release_) release_sequence(kv, id);
  deferred_release_.clear();
}

void scheduler::finish_step(const step_batch& b, std::span<const int32_t> next_tokens,
                            kv_state& kv, double now_s) {
  for (const int64_t id : record_step(b, next_tokens, now_s)) release_sequence(kv, id);
}

void scheduler::finish_step_frozen(const step_batch& b, std::span<const int32_t> next_tokens,
                                   double now_s) {
  const std::vector<int64_t> finished = record_step(b, next_tokens, now_s);
  deferred_release_.insert(deferred_release_.end(), finished.begin(), finished.end());
}

std::vector<int64_t> scheduler::record_step(const step_batch& b,
                                            std::span<const int32_t> next_tokens, double now_s) {
  MOEBIUS_CHECK(next_tokens.size() == b.items.size(), errc::invalid_argument,
                "finish_step: ", next_tokens.size(), " tokens for ", b.items.size(), " items");
  std::vector<int64_t> finished;
  std::vector<bool> retire(running_.size(), false);
  for (size_t i = 0; i < b.items.size(); ++i) {
    running_seq& s = running_[static_cast<size_t>(b.running_idx[i])];
    request_result& res = results_[static_cast<size_t>(s.result_idx)];
    s.in_kv += static_cast<int64_t>(b.items[i].tokens.size());
    if (!b.items[i].sample) {
      MOEBIUS_CHECK(next_tokens[i] == -1, errc::internal, "runtime sampled request ", res.id,
                    " mid-prefill");
      continue;
    }
    MOEBIUS_CHECK(next_tokens[i] >= 0, errc::internal, "runtime gave no token for request ",
                  res.id);
    if (res.generated.empty()) res.first_token_s = now_s;
    res.generated.push_back(next_tokens[i]);
    if (static_cast<int64_t>(res.generated.size()) == res.output_tokens) {
      res.finish_s = now_s;
      ++num_finished_;
      retire[static_cast<size_t>(b.running_idx[i])] = true;
      finished.push_back(res.id);
    } else {
      s.tokens.push_back(next_tokens[i]);  // within the capacity reserved at admission
    }
  }
  size_t out = 0;
  for (size_t i = 0; i < running_.size(); ++i) {
    if (!retire[i]) {
      if (out != i) running_[out] = std::move(running_[i]);
      ++out;
    }
  }
  running_.resize(out);
  return finished;
}

}  // namespace mini_engine
