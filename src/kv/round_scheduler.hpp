#pragma once

// Internal to the KV migration planner: the rounds both directions share.
//
// A ROUND is one plan phase followed by a barrier. Its copies may only write pages (or staging
// slots) that were free when it started and may only read pages that stay untouched during it;
// what it empties becomes free only after the barrier (a later round may reuse it). The
// scheduler keeps that bookkeeping per rank, so a direction only decides WHAT moves:
//   - the pool state of every TP page (EP page q = TP pages q*split .. q*split+split-1),
//     with free pools per rank (preferred pages first) and free counts per EP page;
//   - staging slots per rank;
//   - frees deferred to the barrier;
//   - the round count, the max_rounds limit and the "stuck" verdict (a round that moved
//     nothing), each with a report that names the direction, the ranks and the numbers.
//
//   P=2, split=2: rank 1 reads its live TP page 7 into rank 0's free page 4 in round 0:
//   fill(0, 4) and release(1, 7) during the round; after end_round() page 7 of rank 1 is free
//   (and offered to rank 1's pool) for round 1, page 4 of rank 0 stays built.

#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "page_copies.hpp"

namespace moebius::kv_detail {

// A table of `n` entries per rank: table(rank, i).
template <class T>
class rank_table {
 public:
  rank_table() = default;
  rank_table(int num_ranks, int64_t n, const T& init = T{})
      : n_(n), v_(static_cast<std::size_t>(num_ranks) * static_cast<std::size_t>(n), init) {}

  T& operator()(int rank, int64_t i) { return v_[at(rank, i)]; }
  const T& operator()(int rank, int64_t i) const { return v_[at(rank, i)]; }
  std::span<T> row(int rank) { return {v_.data() + at(rank, 0), static_cast<std::size_t>(n_)}; }
  int64_t size() const { return n_; }  // entries per rank

 private:
  std::size_t at(int rank, int64_t i) const {
    return static_cast<std::size_t>(rank) * static_cast<std::size_t>(n_) +
           static_cast<std::size_t>(i);
  }
  int64_t n_ = 0;
  std::vector<T> v_;
};

// State of one TP page of a rank's pool during a migration.
enum class page_state : uint8_t {
  free,     // holds nothing: may be written this round
  live,     // holds KV still to be read (or kept in place)
  leaving,  // read (or dropped unread) this round: free after the barrier
  built,    // holds its final content in the target view
};

const char* to_string(page_state s);

class round_scheduler {
 public:
  // `direction` names the migration in reports ("EP->TP"); `num_slots` staging slots per rank
  // of `slot_bytes` each; the plan's phases are appended to `out`.
  round_scheduler(const kv_geometry& g, const kv_pool_layout& layout, const kv_staging& staging,
                  int64_t num_slots,
                  int64_t slot_bytes, int64_t max_rounds, std::string direction, plan& out);

  // --- pool (TP pages) ---------------------------------------------------------------------
  page_state state(int r, int64_t t) const { return state_(r, t); }
  // Set-up only: a page holding KV at the start (pages start free).
  void mark_live(int r, int64_t t);
  // A free page becomes a destination of this round (`then`: built, or live when what it
  // receives will be read again, e.g. a piece moved aside).
  void fill(int r, int64_t t, page_state then = page_state::built);
  // A live page keeps its content as part of the target view.
  void keep(int r, int64_t t);
  // A live page was read (or is dropped unread) this round: free after the barrier.
  void release(int r, int64_t t);
  // Free TP pages of EP page q on rank r.
  int64_t free_in_group(int r, int64_t q) const { return group_free_(r, q); }
  int64_t free_pages(int r) const { return free_count_[static_cast<std::size_t>(r)]; }
  // Offers a free page to rank r's pool (preferred pages are taken first); pages freed at a
  // barrier are offered automatically, not preferred.
  void offer(int r, int64_t t, bool preferred);
  // A free page from rank r's pool (preferred first; -1 when empty). The caller fills it.
  int64_t take_page(int r);
  bool pool_empty(int r);

  // --- staging slots -----------------------------------------------------------------------
  int64_t num_slots() const { return num_slots_; }
  int64_t free_slots(int r) const {
    return static_cast<int64_t>(slots_[static_cast<std::size_t>(r)].size());
  }
  int64_t take_slot(int r);                // -1 when none is free
  void release_slot(int r, int64_t slot);  // free after the barrier

  // --- rounds ------------------------------------------------------------------------------
  // Starts a round; false (see failure()) when max_rounds rounds are already planned.
  // waiting[r]: pieces still to move per rank (for the report).
  bool begin_round(const std::vector<int64_t>& waiting);
  plan_phase& phase() { return phase_; }
  copy_emitter& emit() { return emit_; }
  // Emits into the phase's restores (bytes not counted) while `f` runs.
  template <class F>
  void restores(F&& f) {
    emit_.target(&phase_.restores);
    emit_.count_bytes(false);
    f(emit_);
    emit_.count_bytes(true);
    emit_.target(&phase_.ops);
  }
  // Ends the round: false (see failure()) when it moved nothing (stuck); otherwise the phase
  // is appended and the round's releases become free. waiting[r] as in begin_round.
  bool end_round(const std::vector<int64_t>& waiting);
  // Pages that became free at the last barrier, in release order.
  const std::vector<std::pair<int, int64_t>>& freed() const { return freed_; }
  int64_t rounds() const { return rounds_; }
  const std::string& failure() const { return failure_; }
  int64_t bytes() const { return emit_.bytes(); }

 private:
  std::string rank_report(const std::vector<int64_t>& waiting) const;
  void set(int r, int64_t t, page_state s);

  const kv_geometry& g_;
  int P_;
  int64_t split_;
  int64_t num_slots_;
  int64_t slot_bytes_;
  int64_t max_rounds_;
  std::string direction_;
  plan& out_;
  copy_emitter emit_;
  plan_phase phase_;
  int64_t rounds_ = 0;
  std::string failure_;
  bool changed_ = false;  // a keep or slot take this round (no op, still progress)

  rank_table<page_state> state_;
  rank_table<int32_t> group_free_;
  std::vector<int64_t> free_count_;
  std::vector<std::vector<int64_t>> preferred_, reused_;  // pool stacks (may hold stale ids)
  std::vector<std::vector<int64_t>> slots_;
  std::vector<std::pair<int, int64_t>> leaving_, freed_, slots_leaving_;
};

}  // namespace moebius::kv_detail
