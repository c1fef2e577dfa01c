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

int64_t scheduler_options::rank_prefill_chunk(int64_t ranks) const {
  MOEBIUS_CHECK(ranks >= 1, errc::invalid_argument,
                "scheduler: rank_prefill_chunk needs ranks >= 1 (got ", ranks, ")");
  if (engine == engine_preset::sglang) return std::max<int64_t>(1, max_step_tokens / ranks);
  return max_step_tokens;
}

void validate(const scheduler_options& o) {
  MOEBIUS_CHECK(o.max_running >= 1 && o.max_running <= o.max_step_tokens, errc::invalid_argument,
                "scheduler: need 1 <= max_running <= max_step_tokens (max_running=",
                o.max_running, ", max_step_tokens=", o.max_step_tokens,
                "): every running sequence must be able to decode in one step");
  MOEBIUS_CHECK(o.vocab >= 0, errc::invalid_argument, "scheduler: vocab must be >= 0 (0: not "
                "checked; got ", o.vocab, ")");
  MOEBIUS_CHECK(o.watermark >= 0 && o.watermark < 1, errc::invalid_argument,
                "scheduler: watermark must be in [0, 1) (got ", o.watermark, ")");
  MOEBIUS_CHECK(o.default_max_new_tokens >= 1, errc::invalid_argument,
                "scheduler: default_max_new_tokens must be >= 1 (got ", o.default_max_new_tokens,
                ")");
  MOEBIUS_CHECK(!o.vllm_dp_engines || o.engine == engine_preset::vllm, errc::invalid_argument,
                "scheduler: vllm_dp_engines is vLLM's data-parallel rule (engine vllm); SGLang's "
                "DP attention schedules per rank already");
  if (o.engine == engine_preset::sglang) {
    validate(o.sglang);
    MOEBIUS_CHECK(o.admission == admission_policy::known, errc::invalid_argument,
                  "scheduler: engine sglang needs admission known (SGLang admits on estimates, "
                  "not on each request's true output)");
  }
}

void validate_request(const kv_geometry& g, const request& r, int64_t vocab) {
  const int64_t prompt = static_cast<int64_t>(r.prompt.size());
  MOEBIUS_CHECK(prompt >= 1, errc::invalid_argument, "request ", r.id,
                ": needs a prompt of at least one token (got none)");
  MOEBIUS_CHECK(r.output_tokens >= 1, errc::invalid_argument, "request ", r.id,
                ": needs output_tokens >= 1 (got ", r.output_tokens, ")");
  MOEBIUS_CHECK(std::isfinite(r.arrival_s), errc::invalid_argument, "request ", r.id,
                ": needs a finite arrival time (got ", r.arrival_s, ")");
  MOEBIUS_CHECK(r.max_new_tokens == 0 || r.max_new_tokens >= r.output_tokens,
                errc::invalid_argument, "request ", r.id, ": max_new_tokens ", r.max_new_tokens,
                " is below its output_tokens ", r.output_tokens,
                " (0: none given; a response never outgrows its client's limit)");
  // prompt + output tokens are held in one vector and counted in 64 bits.
  MOEBIUS_CHECK(r.output_tokens <= std::numeric_limits<int64_t>::max() - prompt,
                errc::overflow, "request ", r.id, ": prompt ", prompt, " + output_tokens ",
                r.output_tokens, " does not fit in 64 bits");
  if (vocab > 0) {
    for (size_t i = 0; i < r.prompt.size(); ++i) {
      MOEBIUS_CHECK(r.prompt[i] >= 0 && r.prompt[i] < vocab, errc::invalid_argument, "request ",
                    r.id, ": prompt token ", i, " is ", r.prompt[i], ", outside the vocab [0, ",
                    vocab, ")");
    }
  }
  // A request must fit one EP rank at its largest (EP is the smaller per-sequence capacity: a
  // TP rank has tp_pages_per_ep_page() times the pages and the same tokens per page). Pages
  // counted without rounding up past 64 bits.
  const int64_t largest = prompt + r.output_tokens - 1;
  const int64_t pages = largest / g.page_size + (largest % g.page_size != 0 ? 1 : 0);
  const int64_t rank_pages =
      std::min(g.num_pages(parallel_mode::ep), g.num_pages(parallel_mode::tp));
  MOEBIUS_CHECK(pages <= rank_pages, errc::capacity, "request ", r.id, " needs ", pages,
                " KV pages at its largest (", largest, " tokens) but a rank holds ", rank_pages,
                ": it could never be admitted");
}

scheduler::scheduler(const kv_geometry& g, std::vector<request> requests,
                     scheduler_options options)
    : g_(g), options_(options) {
  validate(options_);
  // SGLang under DP attention splits both among the ranks (engine_preset.hpp): one each at least.
  MOEBIUS_CHECK(options_.engine != engine_preset::sglang ||
                    (options_.max_step_tokens >= g_.num_ranks && options_.max_running >= g_.num_ranks),
                errc::invalid_argument, "scheduler: engine sglang on ", g_.num_ranks,
                " ranks needs max_step_tokens (", options_.max_step_tokens, ") and max_running (",
                options_.max_running, ") >= the ranks: in EP each rank has its share of both");
  // Bad requests get a result (none is lost) but never enter the queue.
  std::vector<request_result> failed;
  for (request& r : requests) {
    try {
      validate_request(g, r, options_.vocab);
    } catch (const moebius::error& e) {
      if (options_.bad_requests == bad_request_policy::refuse_run) throw;
      request_result x;
      x.id = r.id;
      x.arrival_s = r.arrival_s;
      x.prompt_tokens = static_cast<int64_t>(r.prompt.size());
      x.output_tokens = r.output_tokens;
      x.error = e.what();
      failed.push_back(std::move(x));
      continue;
    }
    requests_.push_back(std::move(r));
  }
  num_failed_ = static_cast<int64_t>(failed.size());
  const int64_t closed = std::count_if(requests_.begin(), requests_.end(),
                                       [](const request& r) { return r.rollout_step >= 0; });
  MOEBIUS_CHECK(closed == 0 || closed == static_cast<int64_t>(requests_.size()),
                errc::invalid_argument, "scheduler: ", closed, " of ", requests_.size(),
                " requests have a rollout_step: a closed-loop rollout gives every request one, "
                "an open-loop trace none");
  std::stable_sort(requests_.begin(), requests_.end(), [](const request& a, const request& b) {
    if (a.rollout_step != b.rollout_step) return a.rollout_step < b.rollout_step;
    return a.arrival_s < b.arrival_s || (a.arrival_s == b.arrival_s && a.id < b.id);
  });
  if (closed > 0) {
    // Dense steps in order; every step but the first waits for the one before it.
    relative_arrival_s_.resize(requests_.size());
    for (size_t i = 0; i < requests_.size(); ++i) {
      if (i == 0 || requests_[i].rollout_step != requests_[i - 1].rollout_step)
        steps_.push_back({i, i, 0});
      steps_.back().end = i + 1;
      ++steps_.back().left;
      relative_arrival_s_[i] = requests_[i].arrival_s;
      if (steps_.size() > 1) requests_[i].arrival_s = std::numeric_limits<double>::infinity();
    }
  }
  results_.reserve(requests_.size() + failed.size());
  for (request_result& x : failed) results_.push_back(std::move(x));
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

void scheduler::start_next_step(int64_t k, double now_s) {
  const size_t next = static_cast<size_t>(k) + 1;
  if (next >= steps_.size()) return;
  // Every step holds at least one request (steps_ is built from requests_), so the step after
  // it waits for it in turn; requests_ stays sorted by arrival: later steps are still at +inf.
  for (size_t i = steps_[next].begin; i < steps_[next].end; ++i) {
    requests_[i].arrival_s = now_s + relative_arrival_s_[i];
    auto res = std::lower_bound(results_.begin(), results_.end(), requests_[i].id,
                                [](const request_result& x, int64_t id) { return x.id < id; });
    res->arrival_s = requests_[i].arrival_s;
  }
}

double scheduler::next_arrival_s() const {
  // A preempted sequence has arrived (it ran): it waits from its arrival on.
  if (!preempted_.empty()) return results_[static_cast<size_t>(preempted_.front().result_idx)].arrival_s;
  return next_waiting_ < requests_.size() ? requests_[next_waiting_].arrival_s
                                          : std::numeric_limits<double>::infinity();
}

int64_t scheduler::num_waiting(double now_s) const {
  int64_t n = static_cast<int64_t>(preempted_.size());
  for (size_t i = next_waiting_; i < requests_.size() && requests_[i].arrival_s <= now_s; ++i) ++n;
  return n;
}

work_view scheduler::work(double now_s) const {
  work_view w;
  w.running = num_running();
  w.generated.reserve(running_.size());
  w.left_to_limit.reserve(running_.size());
  for (const running_seq& s : running_) {
    w.running_tokens += static_cast<int64_t>(s.tokens.size());
    const int64_t generated =
        static_cast<int64_t>(results_[static_cast<size_t>(s.result_idx)].generated.size());
    w.generated.push_back(generated);
    w.left_to_limit.push_back(std::max<int64_t>(0, s.max_new - generated));
  }
  for (const running_seq& s : preempted_) w.waiting_tokens += static_cast<int64_t>(s.tokens.size());
  w.waiting = static_cast<int64_t>(preempted_.size());
  for (size_t i = next_waiting_; i < requests_.size() && requests_[i].arrival_s <= now_s; ++i) {
    w.waiting_tokens += static_cast<int64_t>(requests_[i].prompt.size());
    ++w.waiting;
  }
  w.finished = num_finished_;
  w.finished_output_tokens = finished_output_tokens_;
  w.rollout = !steps_.empty();
  return w;
}

int64_t scheduler::num_prefilling() const {
  return std::count_if(running_.begin(), running_.end(),
                       [](const running_seq& s) { return !s.decoding(); });
}

int64_t scheduler::reserved_tokens(const running_seq& s) const {
  if (options_.admission == admission_policy::oracle) return s.final_tokens;
  // Prompt and generated tokens: the next decode writes the last of them.
  return std::min(s.final_tokens, static_cast<int64_t>(s.tokens.size()));
}

std::vector<int64_t> scheduler::unreserved(const kv_state& kv) const {
  const int P = g_.num_ranks;
  std::vector<int64_t> left(static_cast<size_t>(P), g_.num_pages(kv.mode));
  for (const running_seq& s : running_) {
    const int64_t pages = pages_needed(g_, kv.mode, reserved_tokens(s));
    if (kv.mode == parallel_mode::tp) {
      for (int64_t& l : left) l -= pages;
    } else {
      // A sequence whose prefill has not written a token yet has no table: it is reserved
      // on the owner it was admitted to, which is recorded when its first chunk is placed
      // (same step), so every running sequence here has an owner.
      // A resumed sequence (lose_kv) has no table until its recompute starts: its reservation
      // is on resume_owner.
      int owner = owner_of(kv, results_[static_cast<size_t>(s.result_idx)].id);
      if (owner < 0) owner = s.resume_owner;
      if (owner >= 0) left[static_cast<size_t>(owner)] -= pages;
    }
  }
  return left;
}

bool scheduler::fits_reservations(const kv_state& kv, parallel_mode target,
                                  int64_t target_dcp) const {
  const moebius::kv_geometry g = target_dcp > 0 ? moebius::with_dcp(g_, target_dcp) : g_;
  const int64_t cap = g.num_pages(target);
  if (target == parallel_mode::ep && kv.mode == parallel_mode::tp) {
    // The placement the switch will use (the switcher plans with ep_placement).
    return ep_placement(kv).fits;
  }
  std::vector<int64_t> need;
  need.reserve(running_.size());
  for (const running_seq& s : running_) need.push_back(pages_needed(g, target, reserved_tokens(s)));
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

moebius::kv_placement scheduler::ep_placement(const kv_state& kv) const {
  std::vector<moebius::kv_demand> demands;
  std::vector<int64_t> groups;
  moebius::kv_demands_of(g_, kv, demands, groups);
  // Each running sequence at its reservation (EP pages; never less than it holds now).
  std::vector<std::pair<int64_t, int64_t>> largest;  // (seq_id, pages), sorted by id
  largest.reserve(running_.size());
  for (const running_seq& s : running_) {
    largest.emplace_back(results_[static_cast<size_t>(s.result_idx)].id,
                         pages_needed(g_, parallel_mode::ep, reserved_tokens(s)));
  }
  std::sort(largest.begin(), largest.end());
  for (moebius::kv_demand& d : demands) {
    const auto it = std::lower_bound(largest.begin(), largest.end(),
                                     std::pair<int64_t, int64_t>{d.seq_id, 0});
    if (it != largest.end() && it->first == d.seq_id) d.own_pages = std::max(d.own_pages, it->second);
  }
  return moebius::place_longest_first(
      demands, groups, std::vector<int64_t>(static_cast<size_t>(g_.num_ranks), g_.num_ep_pages));
}

std::vector<std::pair<int64_t, int64_t>> scheduler::written_tokens() const {
  std::vector<std::pair<int64_t, int64_t>> out;
  out.reserve(running_.size());
  for (const running_seq& s : running_) {
    out.emplace_back(results_[static_cast<size_t>(s.result_idx)].id, s.in_kv);
  }
  std::sort(out.begin(), out.end());
  return out;
}

void scheduler::push_item(step_batch& b, int64_t slot, int64_t n) {
  const running_seq& s = running_[static_cast<size_t>(slot)];
  step_item it;
  it.seq_id = results_[static_cast<size_t>(s.result_idx)].id;
  it.tokens = std::span<const int32_t>(s.tokens.data() + s.in_kv, static_cast<size_t>(n));
  it.start_position = s.in_kv;
  it.sample = s.in_kv + n >= s.prompt;
  b.items.push_back(it);
  b.running_idx.push_back(slot);
  b.context_tokens += s.in_kv + n;
  if (s.decoding()) ++b.decode_tokens;
  else b.prefill_tokens += n;
}

void scheduler::drop_running(step_batch& b, const std::vector<bool>& gone) {
  std::vector<int64_t> slot_of(running_.size(), -1);
  size_t out = 0;
  for (size_t i = 0; i < running_.size(); ++i) {
    if (gone[i]) continue;
    slot_of[i] = static_cast<int64_t>(out);
    if (out != i) running_[out] = std::move(running_[i]);  // the token buffers do not move
    ++out;
  }
  running_.resize(out);
  for (int64_t& slot : b.running_idx) slot = slot_of[static_cast<size_t>(slot)];
}

scheduler::running_seq scheduler::admit_new() const {
  const request& r = requests_[next_waiting_];
  running_seq s;
  s.prompt = static_cast<int64_t>(r.prompt.size());
  s.final_tokens = s.prompt + r.output_tokens - 1;
  s.result_idx = std::lower_bound(results_.begin(), results_.end(), r.id,
                                  [](const request_result& x, int64_t id) { return x.id < id; }) -
                 results_.begin();
  if (!steps_.empty()) {
    s.step = std::upper_bound(steps_.begin(), steps_.end(), next_waiting_,
                              [](size_t i, const rollout_step_state& st) { return i < st.end; }) -
             steps_.begin();
  }
  s.tokens.reserve(static_cast<size_t>(s.prompt + r.output_tokens));
  s.tokens = r.prompt;
  s.max_new = max_new_tokens_of(r, options_.default_max_new_tokens);
  if (options_.engine == engine_preset::sglang) {
    // SGLang clamps max_new_tokens to what its pool holds (handle_generate_request: max_req_len
    // - len(input) - 1, max_req_len = pool tokens - 1): here the smaller pool of the two modes.
    const int64_t pool = std::min(g_.num_pages(parallel_mode::ep) * g_.page_size,
                                  g_.num_pages(parallel_mode::tp) * g_.page_size * g_.dcp);
    s.max_new = std::clamp<int64_t>(pool - 2 - s.prompt, 0, s.max_new);
  }
  return s;
}

std::optional<bool> scheduler::next_waiting(double now_s) const {
  const bool fresh = next_waiting_ < requests_.size() && requests_[next_waiting_].arrival_s <= now_s;
  if (preempted_.empty()) return fresh ? std::optional<bool>(false) : std::nullopt;
  // A new request that arrived by the time the head was queued is ahead of it (vllm queues
  // preempted ones at -inf: always first).
  if (fresh && requests_[next_waiting_].arrival_s <= preempted_.front().requeue_s) return false;
  return true;
}

void scheduler::account(step_batch& b) const {
  std::vector<int64_t> step_tokens(running_.size(), 0);
  for (size_t i = 0; i < b.items.size(); ++i)
    step_tokens[static_cast<size_t>(b.running_idx[i])] += static_cast<int64_t>(b.items[i].tokens.size());
  b.kv_written_tokens = 0;
  b.kv_reserved_tokens = 0;
  for (size_t i = 0; i < running_.size(); ++i) {
    b.kv_written_tokens += running_[i].in_kv + step_tokens[i];
    b.kv_reserved_tokens += reserved_tokens(running_[i]);
  }
}

void scheduler::reserve_for_switch(kv_state& kv, int64_t steps) {
  MOEBIUS_CHECK(steps >= 1, errc::invalid_argument, "reserve_for_switch: steps must be >= 1 (got ",
                steps, ")");
  for (const running_seq& s : running_) {
    const int64_t id = results_[static_cast<size_t>(s.result_idx)].id;
    const int64_t want = std::min(s.final_tokens, std::max(s.in_kv, s.prompt) + steps);
    if (held_tokens(kv, id) < want) reserve_tokens(g_, kv, id, want, s.resume_owner);
  }
}

void scheduler::finish_step(const step_batch& b, std::span<const int32_t> next_tokens,
                            page_source& pages, double now_s) {
  for (const int64_t id : record_step(b, next_tokens, now_s)) pages.release(id);
}

std::vector<int64_t> scheduler::record_step(const step_batch& b,
                                            std::span<const int32_t> next_tokens, double now_s) {
  MOEBIUS_CHECK(next_tokens.size() == b.items.size(), errc::invalid_argument,
                "finish_step: ", next_tokens.size(), " tokens for ", b.items.size(), " items");
  last_step_s_ = now_s;
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
      // SGLang: a running batch that shrinks may admit again (batch_is_full is cleared).
      if (!groups_.empty()) {
        sglang_group& gr = groups_[groups_.size() == 1 ? 0 : static_cast<size_t>(std::max(s.owner, 0))];
        gr.full = gr.full_for_kv = false;
      }
      res.finish_s = now_s;
      ++num_finished_;
      finished_output_tokens_ += res.output_tokens;
      retire[static_cast<size_t>(b.running_idx[i])] = true;
      finished.push_back(res.id);
      if (s.step >= 0 && --steps_[static_cast<size_t>(s.step)].left == 0)
        start_next_step(s.step, now_s);
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
