// EP -> TP: every live EP page's head slices ("pieces") go to the ranks that hold them in TP.
// See kv_migration.hpp for the contract; round_scheduler.hpp for what a round may do.
//
// With dcp > 1 an EP page is logical page i of its sequence(s) and goes, per head slice, only
// to the rank of DCP index i % dcp in each replica set of that slice: an item is (owner, EP
// page, DCP index), one per distinct residue the page is used at (a shared prefix page sits at
// the same index in every sharer, so one). The owner keeps its own slice in place only when it
// is one of those ranks; otherwise that slice is sent like the others and its TP page frees.

#include <algorithm>
#include <sstream>
#include <utility>
#include <vector>

#include "migration_directions.hpp"
#include "moebius/error.hpp"
#include "round_scheduler.hpp"

namespace moebius::kv_detail {

namespace {

std::size_t idx(int64_t v) { return static_cast<std::size_t>(v); }

// Distinct live (EP page, DCP index), interleaved across owners so every round frees pages on
// every rank.
struct ep_item {
  int owner;
  int64_t page;
  int64_t share = 0;  // DCP index of the TP ranks receiving it (logical page % dcp)
};

struct ep_items {
  std::vector<ep_item> items;
  rank_table<int64_t> item_of;  // (owner, EP page * dcp + share) -> item, -1 when unused
  std::vector<int64_t> used;    // [P] distinct used (EP page, share)
  std::vector<int64_t> per_share;  // [dcp] items received by each DCP index
};

ep_items collect_ep_items(const kv_geometry& g, const kv_state& s) {
  const int P = g.num_ranks;
  const int64_t D = g.dcp;
  ep_items out{{}, rank_table<int64_t>(P, g.num_ep_pages * D, -1),
               std::vector<int64_t>(idx(P), 0), std::vector<int64_t>(idx(D), 0)};
  std::vector<std::vector<int64_t>> owned(idx(P));  // keys page * dcp + share
  for (int r = 0; r < P; ++r)
    for (const kv_sequence& q : s.ranks[idx(r)].sequences)
      for (int64_t k = 0; k < q.num_pages(); ++k) {
        const int64_t key = q.pages[idx(k)] * D + k % D;
        // A page shared at logical pages of two DCP indices would be one EP page and two TP
        // pages on different ranks; a shared prefix is at the same index in every sharer.
        for (int64_t other = 0; other < D; ++other)
          MOEBIUS_CHECK(other == k % D || out.item_of(r, q.pages[idx(k)] * D + other) < 0,
                        errc::invalid_argument, "EP rank ", r, " page ", q.pages[idx(k)],
                        " is logical page ", k, " of sequence ", q.seq_id,
                        " but another sequence uses it at an index of another DCP share "
                        "(dcp ", D, "): shared prefix pages must sit at one logical index");
        if (out.item_of(r, key) < 0) {
          out.item_of(r, key) = 0;
          owned[idx(r)].push_back(key);
        }
      }
  for (std::size_t k = 0;; ++k) {
    bool any = false;
    for (int r = 0; r < P; ++r) {
      if (k >= owned[idx(r)].size()) continue;
      any = true;
      const int64_t key = owned[idx(r)][k];
      out.item_of(r, key) = static_cast<int64_t>(out.items.size());
      out.items.push_back({r, key / D, key % D});
      ++out.per_share[idx(key % D)];
    }
    if (!any) break;
  }
  for (int r = 0; r < P; ++r) out.used[idx(r)] = static_cast<int64_t>(owned[idx(r)].size());
  return out;
}

// One head slice of one item, sent to every rank holding that slice and the item's share in
// TP: ranks first, first + stride, .. (count of them; dcp 1: the slice's replicas).
struct unit {
  int64_t item;
  int64_t slice;
  int first, stride, count;
  int rank(int n) const { return first + n * stride; }
};

class ep_to_tp_rounds {
 public:
  ep_to_tp_rounds(const kv_geometry& g, const kv_pool_layout& layout, const kv_state& s,
                  const kv_migration_options& opt, const ep_items& it, kv_migration& res)
      : g_(g),
        P_(g.num_ranks),
        split_(g.tp_pages_per_ep_page()),
        in_place_(kv_slices_in_place(g, layout)),
        it_(it),
        sch_(g, layout, opt.staging, staging_slots(g, opt, parallel_mode::tp),
             kv_staging_slot_bytes(g, parallel_mode::tp), opt.max_rounds, "EP->TP", res.copies),
        dst_(P_, static_cast<int64_t>(it.items.size()), -1),
        staged_(idx(P_)),
        stats_(res.stats) {
    set_up_pool(s);
    make_units();
  }

  // The rounds; false with failure() when stuck or over max_rounds.
  bool run() {
    while (!rem_.empty() || any_staged()) {
      if (!sch_.begin_round(waiting())) return false;
      drain_staged();
      send_pieces();
      if (!sch_.end_round(waiting())) return false;
    }
    stats_.rounds = sch_.rounds();
    stats_.bytes_copied = sch_.bytes();
    return true;
  }
  const std::string& failure() const { return sch_.failure(); }
  // TP page of item `i` on rank r (in place: the owner's own slice).
  int64_t tp_page(int64_t i, int r) const {
    const ep_item& m = it_.items[idx(i)];
    if (m.owner == r && keeps_own(m)) return m.page * split_ + g_.tp_slice_of_rank(r);
    return dst_(r, i);
  }

 private:
  // Whether the owner keeps its own slice of item m in place: slices in place and the owner is
  // a receiver (its DCP index is the item's share; always with dcp 1).
  bool keeps_own(const ep_item& m) const {
    return in_place_ && g_.dcp_rank(m.owner) == m.share;
  }
  bool skip_owner(const unit& u) const {
    const ep_item& m = it_.items[idx(u.item)];
    return keeps_own(m) && u.slice == g_.tp_slice_of_rank(m.owner);
  }
  bool any_staged() const {
    return std::any_of(staged_.begin(), staged_.end(), [](const auto& v) { return !v.empty(); });
  }
  std::vector<int64_t> waiting() const {
    std::vector<int64_t> w(idx(P_), 0);
    for (int64_t u : rem_)
      for (int n = 0; n < units_[idx(u)].count; ++n) ++w[idx(units_[idx(u)].rank(n))];
    for (int r = 0; r < P_; ++r) w[idx(r)] += static_cast<int64_t>(staged_[idx(r)].size());
    return w;
  }

  // Live EP pages' TP pages are live (the owner's own slice stays: it is already a TP page);
  // TP pages of wholly free EP pages are preferred destinations, so the owners' freed pieces
  // stay free and the way back can be in place.
  void set_up_pool(const kv_state& s) {
    for (const ep_item& m : it_.items)
      for (int64_t j = 0; j < split_; ++j) {
        sch_.mark_live(m.owner, m.page * split_ + j);
        if (keeps_own(m) && j == g_.tp_slice_of_rank(m.owner))
          sch_.keep(m.owner, m.page * split_ + j);
      }
    for (int r = 0; r < P_; ++r) {
      const std::vector<int64_t>& f = s.ranks[idx(r)].free_pages;
      for (auto q = f.rbegin(); q != f.rend(); ++q)
        for (int64_t j = split_ - 1; j >= 0; --j) sch_.offer(r, *q * split_ + j, true);
    }
  }

  // Piece j of an item goes to the ranks holding slice j and the item's share, one per
  // replica set (the owner skips its own slice when it stays in place). Pieces move
  // independently, so two full ranks unblock each other.
  void make_units() {
    const auto sets = static_cast<int>(g_.tp_replica_sets());
    left_.assign(it_.items.size(), 0);
    for (std::size_t i = 0; i < it_.items.size(); ++i)
      for (int64_t j = 0; j < split_; ++j) {
        const unit u{static_cast<int64_t>(i), j,
                     static_cast<int>(g_.tp_rank_of(j, 0, it_.items[i].share)),
                     static_cast<int>(g_.dcp), sets};
        if (skip_owner(u) && sets == 1) continue;  // nobody receives it
        rem_.push_back(static_cast<int64_t>(units_.size()));
        units_.push_back(u);
        ++left_[i];
      }
  }

  // Staged pieces go into pool pages freed by earlier rounds.
  void drain_staged() {
    for (int r = 0; r < P_; ++r) {
      std::vector<std::pair<int64_t, int64_t>> kept;
      for (const auto& [i, slot] : staged_[idx(r)]) {
        const int64_t q = sch_.take_page(r);
        if (q < 0) {
          kept.emplace_back(i, slot);
          continue;
        }
        sch_.fill(r, q);
        copy_emitter& em = sch_.emit();
        em.whole(parallel_mode::tp, em.stage(parallel_mode::tp, r, slot),
                 em.pool(parallel_mode::tp, r, q));
        dst_(r, i) = q;
        sch_.release_slot(r, slot);
      }
      staged_[idx(r)] = std::move(kept);
    }
  }

  // Every piece whose receivers all find a free page (or staging slot) moves this round.
  void send_pieces() {
    std::vector<int64_t> next;
    for (int64_t u : rem_) {
      const unit& un = units_[idx(u)];
      const ep_item& m = it_.items[idx(un.item)];
      bool fits = true;
      for (int n = 0; n < un.count && fits; ++n) {
        const int r = un.rank(n);
        // Interleaved slices: a rank's last staging slot is kept for its own pages' pieces. A
        // piece staged on r frees an EP page of r only when it is r's own (its page frees once
        // its last piece left); were every slot of a full r taken by other ranks' pieces, which
        // wait for r's pages, r's own pages could never leave and nothing would free.
        const int64_t reserved = !in_place_ && r != m.owner ? 1 : 0;
        fits = (skip_owner(un) && r == m.owner) || !sch_.pool_empty(r) ||
               sch_.free_slots(r) > reserved;
      }
      if (!fits) {
        next.push_back(u);
        continue;
      }
      copy_emitter& em = sch_.emit();
      const page_ref src = em.pool(parallel_mode::ep, m.owner, m.page);
      for (int n = 0; n < un.count; ++n) {
        const int r = un.rank(n);
        if (skip_owner(un) && r == m.owner) continue;
        if (const int64_t q = sch_.take_page(r); q >= 0) {
          sch_.fill(r, q);
          em.slice(src, un.slice, em.pool(parallel_mode::tp, r, q), true);
          dst_(r, un.item) = q;
        } else {
          const int64_t z = sch_.take_slot(r);
          em.slice(src, un.slice, em.stage(parallel_mode::tp, r, z), true);
          staged_[idx(r)].emplace_back(un.item, z);
          ++stats_.pages_staged;
        }
      }
      // Contiguous slices: this piece of the owner's page is free after the barrier (unless
      // it is the owner's own slice). Interleaved: the whole EP page, once its last piece left.
      if (in_place_) {
        if (!skip_owner(un)) sch_.release(m.owner, m.page * split_ + un.slice);
      } else if (--left_[idx(un.item)] == 0) {
        for (int64_t j = 0; j < split_; ++j) sch_.release(m.owner, m.page * split_ + j);
      }
    }
    rem_ = std::move(next);
  }

  const kv_geometry& g_;
  int P_;
  int64_t split_;
  bool in_place_;
  const ep_items& it_;
  round_scheduler sch_;
  rank_table<int64_t> dst_;  // (receiver, item) -> TP page
  std::vector<unit> units_;
  std::vector<int64_t> rem_;    // units not sent yet
  std::vector<int32_t> left_;   // [item] units not sent yet
  std::vector<std::vector<std::pair<int64_t, int64_t>>> staged_;  // [rank] (item, slot)
  kv_migration_stats& stats_;
};

// Every rank holds every sequence (with dcp > 1 its share of the pages), over the TP pages the
// rounds chose.
kv_state tp_tables(const kv_geometry& g, const kv_state& s, const ep_items& it,
                   const ep_to_tp_rounds& rounds) {
  std::vector<std::pair<int, const kv_sequence*>> all;
  for (int r = 0; r < g.num_ranks; ++r)
    for (const kv_sequence& q : s.ranks[idx(r)].sequences) all.emplace_back(r, &q);
  std::sort(all.begin(), all.end(),
            [](const auto& a, const auto& b) { return a.second->seq_id < b.second->seq_id; });
  std::vector<std::vector<kv_sequence>> tables(idx(g.num_ranks));
  for (int r = 0; r < g.num_ranks; ++r)
    for (const auto& [o, q] : all) {
      kv_sequence t = *q;
      t.pages.clear();
      const int64_t k = g.dcp_rank(r);
      for (int64_t i = k; i < q->num_pages(); i += g.dcp)  // logical pages k, k+dcp, ..
        t.pages.push_back(rounds.tp_page(it.item_of(o, q->pages[idx(i)] * g.dcp + k), r));
      tables[idx(r)].push_back(std::move(t));
    }
  return make_kv_state(g, parallel_mode::tp, std::move(tables));
}

}  // namespace

outcome plan_ep_to_tp(const kv_geometry& g, const kv_pool_layout& layout, const kv_state& s,
                      const kv_migration_options& opt) {
  outcome out;
  kv_migration& res = out.result;
  res.copies.num_ranks = g.num_ranks;
  res.stats.imbalance = 1.0;
  const ep_items it = collect_ep_items(g, s);
  // Every TP rank holds a piece of every live page of its DCP share (dcp 1: every live page).
  const auto total = static_cast<int64_t>(it.items.size());
  const auto busiest = std::max_element(it.per_share.begin(), it.per_share.end());
  out.pages_needed = *busiest;
  out.pages_available = g.num_tp_pages();
  if (out.pages_needed > g.num_tp_pages()) {
    std::ostringstream why;
    if (g.dcp == 1) {
      why << "TP view cannot hold the live KV: every TP rank needs " << total
          << " pages (one per live EP page of all ranks) but has " << g.num_tp_pages() << " (= "
          << g.num_ep_pages << " EP pages x " << g.tp_pages_per_ep_page() << ")";
    } else {
      why << "TP view (dcp " << g.dcp << ") cannot hold the live KV: the TP ranks of DCP index "
          << (busiest - it.per_share.begin()) << " need " << out.pages_needed
          << " pages (one per live EP page at a logical page of that index) but have "
          << g.num_tp_pages() << " (= " << g.num_ep_pages << " EP pages x "
          << g.tp_pages_per_ep_page() << ")";
    }
    out.ok = out.holds = false;
    out.reason = why.str();
    return out;
  }
  res.stats.pages_moved = total;
  // In place: items whose owner receives its own slice (every item with dcp 1).
  if (kv_slices_in_place(g, layout))
    for (const ep_item& m : it.items) res.stats.pages_in_place += g.dcp_rank(m.owner) == m.share;
  ep_to_tp_rounds rounds(g, layout, s, opt, it, res);
  if (!rounds.run()) {
    out.ok = false;
    out.reason = rounds.failure();
    return out;
  }
  res.new_state = tp_tables(g, s, it, rounds);
  return out;
}

}  // namespace moebius::kv_detail
