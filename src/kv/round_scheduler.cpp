#include "round_scheduler.hpp"

#include <sstream>

#include "moebius/error.hpp"

namespace moebius::kv_detail {

namespace {
std::size_t idx(int64_t v) { return static_cast<std::size_t>(v); }
}  // namespace

const char* to_string(page_state s) {
  switch (s) {
    case page_state::free: return "free";
    case page_state::live: return "live";
    case page_state::leaving: return "leaving";
    case page_state::built: return "built";
  }
  return "?";
}

round_scheduler::round_scheduler(const kv_geometry& g, const kv_pool_layout& layout,
                                 const kv_staging& staging,
                                 int64_t num_slots, int64_t slot_bytes, int64_t max_rounds,
                                 std::string direction, plan& out)
    : g_(g),
      P_(g.num_ranks),
      split_(g.tp_pages_per_ep_page()),
      num_slots_(num_slots),
      slot_bytes_(slot_bytes),
      max_rounds_(max_rounds),
      direction_(std::move(direction)),
      out_(out),
      emit_(g, layout, staging),
      state_(g.num_ranks, g.num_tp_pages(), page_state::free),
      group_free_(g.num_ranks, g.num_ep_pages, static_cast<int32_t>(g.tp_pages_per_ep_page())),
      free_count_(idx(g.num_ranks), g.num_tp_pages()),
      preferred_(idx(g.num_ranks)),
      reused_(idx(g.num_ranks)),
      slots_(idx(g.num_ranks)) {
  out_.num_ranks = P_;
  for (auto& s : slots_)
    for (int64_t z = num_slots - 1; z >= 0; --z) s.push_back(z);
  emit_.target(&phase_.ops);
}

void round_scheduler::set(int r, int64_t t, page_state s) {
  page_state& cur = state_(r, t);
  const bool was_free = cur == page_state::free, is_free = s == page_state::free;
  if (was_free != is_free) {
    const int32_t d = is_free ? 1 : -1;
    group_free_(r, t / split_) += d;
    free_count_[idx(r)] += d;
  }
  cur = s;
}

void round_scheduler::mark_live(int r, int64_t t) {
  MOEBIUS_CHECK(state_(r, t) == page_state::free && rounds_ == 0 && phase_.ops.empty(),
                errc::internal, direction_, ": page ", t, " of rank ", r,
                " marked live twice or after the start");
  set(r, t, page_state::live);
}

void round_scheduler::fill(int r, int64_t t, page_state then) {
  MOEBIUS_CHECK(state_(r, t) == page_state::free, errc::internal, direction_, " round ",
                rounds_, ": destination page ", t, " of rank ", r, " is ",
                to_string(state_(r, t)), ", not free");
  set(r, t, then);
}

void round_scheduler::keep(int r, int64_t t) {
  MOEBIUS_CHECK(state_(r, t) == page_state::live, errc::internal, direction_, ": page ", t,
                " of rank ", r, " kept in place is ", to_string(state_(r, t)));
  set(r, t, page_state::built);
  changed_ = true;
}

void round_scheduler::release(int r, int64_t t) {
  MOEBIUS_CHECK(state_(r, t) == page_state::live, errc::internal, direction_, ": page ", t,
                " of rank ", r, " released is ", to_string(state_(r, t)), ", not live");
  set(r, t, page_state::leaving);
  leaving_.emplace_back(r, t);
}

void round_scheduler::offer(int r, int64_t t, bool preferred) {
  (preferred ? preferred_ : reused_)[idx(r)].push_back(t);
}

bool round_scheduler::pool_empty(int r) {
  for (auto* v : {&preferred_[idx(r)], &reused_[idx(r)]}) {
    while (!v->empty() && state_(r, v->back()) != page_state::free) v->pop_back();
    if (!v->empty()) return false;
  }
  return true;
}

int64_t round_scheduler::take_page(int r) {
  if (pool_empty(r)) return -1;
  std::vector<int64_t>& v = preferred_[idx(r)].empty() ? reused_[idx(r)] : preferred_[idx(r)];
  const int64_t t = v.back();
  v.pop_back();
  return t;
}

int64_t round_scheduler::take_slot(int r) {
  std::vector<int64_t>& s = slots_[idx(r)];
  if (s.empty()) return -1;
  const int64_t z = s.back();
  s.pop_back();
  changed_ = true;
  return z;
}

void round_scheduler::release_slot(int r, int64_t slot) { slots_leaving_.emplace_back(r, slot); }

std::string round_scheduler::rank_report(const std::vector<int64_t>& waiting) const {
  std::ostringstream os;
  for (int r = 0; r < P_; ++r) {
    int64_t groups = 0;
    for (int64_t q = 0; q < g_.num_ep_pages; ++q) groups += group_free_(r, q) == split_;
    os << "; rank " << r << ": " << waiting[idx(r)] << " waiting, " << free_count_[idx(r)]
       << " free TP pages (" << groups << " whole EP pages), " << slots_[idx(r)].size()
       << " of " << num_slots_ << " staging slots free";
  }
  return os.str();
}

bool round_scheduler::begin_round(const std::vector<int64_t>& waiting) {
  if (rounds_ < max_rounds_) return true;
  int64_t total = 0;
  for (int64_t w : waiting) total += w;
  std::ostringstream os;
  os << direction_ << " needs more than max_rounds=" << max_rounds_ << " rounds: " << total
     << " pieces still waiting after " << rounds_ << " rounds" << rank_report(waiting);
  failure_ = os.str();
  return false;
}

bool round_scheduler::end_round(const std::vector<int64_t>& waiting) {
  const bool moved = !phase_.ops.empty() || !phase_.restores.empty() || !leaving_.empty();
  if (!moved && !changed_) {
    int64_t total = 0;
    for (int64_t w : waiting) total += w;
    std::ostringstream os;
    os << direction_ << " is stuck after " << rounds_ << " rounds with " << total
       << " pieces waiting: no piece finds a free destination and nothing can move aside"
       << rank_report(waiting) << "; lend a staging region (" << slot_bytes_
       << " bytes per slot)";
    failure_ = os.str();
    return false;
  }
  changed_ = false;
  freed_.clear();
  for (const auto& [r, t] : leaving_) {
    set(r, t, page_state::free);
    reused_[idx(r)].push_back(t);
    freed_.emplace_back(r, t);
  }
  leaving_.clear();
  for (const auto& [r, z] : slots_leaving_) slots_[idx(r)].push_back(z);
  slots_leaving_.clear();
  if (!phase_.ops.empty() || !phase_.restores.empty()) {
    phase_.label = "KV " + direction_ + " round " + std::to_string(rounds_);
    out_.phases.push_back(std::move(phase_));
    phase_ = plan_phase{};
    emit_.target(&phase_.ops);
    ++rounds_;
  }
  return true;
}

}  // namespace moebius::kv_detail
