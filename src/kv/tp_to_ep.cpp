// TP -> EP: every owner gathers the head slices of its pages into EP pages (= aligned groups
// of split TP pages). See kv_migration.hpp for the contract; round_scheduler.hpp for what a
// round may do.
//
// Contiguous slices (HND, NHD page 1): an EP page fills piece by piece, so every free TP page
// is a destination in the round it is free: an owner's page is assigned to a group as soon as
// the group has a free TP page (most free first) and each piece lands when its TP page frees.
// The owner's own piece stays in place when it already sits at its slice position. Each piece
// moves once; only when no piece can land anywhere (a cycle of waits) does a piece step aside
// into a spare free page (or a staging slot). Rounds ~ (pieces to land) / (free TP pages).
// Interleaved slices (NHD, page > 1): an EP page needs a wholly free group; owners short of
// groups compact (move live pieces out of their least-used groups) in the same rounds.
//
// A logical page is named by l = k * num_tp_pages + (its page id on rank k), k its DCP index
// (dcp 1: rank 0's TP page id, as before). With dcp > 1 logical page l lives, per slice, only on
// the ranks of DCP index k (one per replica set): each piece is read from one of them, and
// replicas exist only when dcp < tp_replicas().

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

// Where a piece of an item is.
enum class piece_at : uint8_t { source, staged, landed };

struct tp_item {
  int owner;
  int64_t l;             // logical page (k * num_tp_pages + rank k's TP page id)
  int64_t group = -1;    // destination EP page on the owner, -1 before assignment
  int64_t slot = -1;     // staging slot holding some of its pieces, -1 when none
  int32_t waiting = 0;   // pieces not landed
  bool in_place = false; // the owner's own piece stays where it is
};

class tp_to_ep_rounds {
 public:
  tp_to_ep_rounds(const kv_geometry& g, const kv_pool_layout& layout, const kv_state& s,
                  const kv_placement& pl, const kv_migration_options& opt, kv_migration& res)
      : g_(g),
        P_(g.num_ranks),
        split_(g.tp_pages_per_ep_page()),
        reps_(g.tp_replicas()),
        sets_(g.tp_replica_sets()),
        N_(g.num_tp_pages()),
        contiguous_(kv_slices_in_place(g, layout)),
        sch_(g, layout, opt.staging, staging_slots(g, opt, parallel_mode::ep),
             kv_staging_slot_bytes(g, parallel_mode::ep), opt.max_rounds, "TP->EP", res.copies),
        loc_(P_, g.dcp * g.num_tp_pages(), -1),
        l_of_(P_, g.num_tp_pages(), -1),
        reads_(P_, g.num_tp_pages(), 0),
        slice_reads_(static_cast<int>(split_), g.dcp * g.num_tp_pages(), 0),
        item_of_(P_, g.dcp * g.num_tp_pages(), -1),
        group_item_(P_, g.num_ep_pages, -1),
        unassigned_(idx(P_)),
        stats_(res.stats) {
    map_pages(s);
    make_items(s, pl);
  }

  bool run() {
    while (!done()) {
      if (!sch_.begin_round(waiting())) return false;
      const int64_t before = moved_;
      if (sch_.rounds() == 0) drop_unread_replicas();
      assign_groups();
      land_pieces();
      if (!contiguous_) compact();
      step_aside(moved_ == before);
      if (!sch_.end_round(waiting())) return false;
      for (const auto& [r, t] : sch_.freed()) forget(r, t);
    }
    stats_.rounds = sch_.rounds();
    stats_.bytes_copied = sch_.bytes();
    return true;
  }
  const std::string& failure() const { return sch_.failure(); }
  int64_t ep_page(int owner, int64_t l) const { return items_[idx(item_of_(owner, l))].group; }

 private:
  // DCP index of logical page l.
  int64_t share(int64_t l) const { return l / N_; }
  // Slice j of logical page l for owner o comes from o itself when o holds slice j and l's
  // share, else from the replica set that spreads owners over the sets.
  int src_rank(int64_t j, int o, int64_t l) const {
    const int64_t k = share(l);
    if (g_.tp_slice_of_rank(o) == j && g_.dcp_rank(o) == k) return o;
    return static_cast<int>(g_.tp_rank_of(j, o % sets_, k));
  }
  // A page freed at the barrier no longer holds its logical page: both maps drop it, so a
  // later look-up by logical page (an unread replica to drop) never finds the page's next
  // content (e.g. a piece moved aside into it).
  void forget(int r, int64_t t) {
    const int64_t l = l_of_(r, t);
    if (l >= 0 && loc_(r, l) == t) loc_(r, l) = -1;
    l_of_(r, t) = -1;
  }
  piece_at& at(int64_t i, int64_t j) { return at_[idx(i * split_ + j)]; }
  bool done() const { return landed_items_ == static_cast<int64_t>(items_.size()); }
  // (candidates: pages whose own piece sits at its slice position, [owner] not assigned yet)
  std::vector<int64_t> waiting() const {
    std::vector<int64_t> w(idx(P_), 0);
    for (const tp_item& m : items_) w[idx(m.owner)] += m.waiting;
    return w;
  }

  void map_pages(const kv_state& s) {
    for (int r = 0; r < P_; ++r) {
      const int64_t sh = g_.dcp_rank(r);  // rank sh names the logical pages of this share
      const std::vector<kv_sequence>& seqs = s.ranks[idx(sh)].sequences;
      const std::vector<kv_sequence>& rs = s.ranks[idx(r)].sequences;
      for (std::size_t i = 0; i < seqs.size(); ++i)
        for (std::size_t k = 0; k < seqs[i].pages.size(); ++k) {
          const int64_t l = sh * N_ + seqs[i].pages[k], t = rs[i].pages[k];
          if (loc_(r, l) >= 0) continue;  // a shared page
          loc_(r, l) = t;
          l_of_(r, t) = l;
          sch_.mark_live(r, t);
        }
    }
  }

  // Items: distinct (owner, logical page), interleaved across owners; reads per source page
  // and per slice; in-place pages reserve their group at once.
  void make_items(const kv_state& s, const kv_placement& pl) {
    const std::size_t num_seqs = s.ranks[0].sequences.size();
    std::vector<std::vector<int64_t>> owned(idx(P_));
    for (std::size_t i = 0; i < num_seqs; ++i)
      for (int64_t sh = 0; sh < g_.dcp; ++sh)
        for (int64_t p : s.ranks[idx(sh)].sequences[i].pages)
          if (int64_t& it = item_of_(pl.owner[i], sh * N_ + p); it < 0) {
            it = 0;
            owned[idx(pl.owner[i])].push_back(sh * N_ + p);
          }
    for (std::size_t k = 0;; ++k) {
      bool any = false;
      for (int o = 0; o < P_; ++o) {
        if (k >= owned[idx(o)].size()) continue;
        any = true;
        const int64_t l = owned[idx(o)][k];
        item_of_(o, l) = static_cast<int64_t>(items_.size());
        items_.push_back({o, l, -1, -1, static_cast<int32_t>(split_), false});
      }
      if (!any) break;
    }
    at_.assign(items_.size() * idx(split_), piece_at::source);
    for (std::size_t i = 0; i < items_.size(); ++i) {
      tp_item& m = items_[i];
      for (int64_t j = 0; j < split_; ++j) {
        const int sr = src_rank(j, m.owner, m.l);
        ++reads_(sr, loc_(sr, m.l));
        ++slice_reads_(static_cast<int>(j), m.l);
      }
      // The owner holds a piece of the page only when it is of the page's share.
      const int64_t t = loc_(m.owner, m.l), own = g_.tp_slice_of_rank(m.owner);
      if (contiguous_ && t >= 0 && t % split_ == own) {
        candidate_[idx(m.owner)].push_back(static_cast<int64_t>(i));
        cand_group_(m.owner, t / split_) = static_cast<int64_t>(i);
      } else {
        unassigned_[idx(m.owner)].push_back(static_cast<int64_t>(i));
      }
    }
    for (auto& u : unassigned_) std::reverse(u.begin(), u.end());  // popped from the back
  }

  // One read of piece j of logical page l at (sr, t) this round. A source page frees when its
  // last reader read it; unread replicas of the slice free with the slice's last read and are
  // re-created, on rollback, from the page read now.
  void read(int sr, int64_t t, int64_t j, int64_t l) {
    if (--reads_(sr, t) == 0 && sch_.state(sr, t) == page_state::live) sch_.release(sr, t);
    if (--slice_reads_(static_cast<int>(j), l) > 0) return;
    for (int64_t set = 0; set < sets_; ++set) {
      const auto r = static_cast<int>(g_.tp_rank_of(j, set, share(l)));
      const int64_t u = loc_(r, l);
      if (r == sr || u < 0 || reads_(r, u) > 0 || sch_.state(r, u) != page_state::live) continue;
      MOEBIUS_CHECK(l_of_(r, u) == l, errc::internal, "TP->EP: replica of page ", l,
                    " on rank ", r, " at TP page ", u, " holds page ", l_of_(r, u));
      sch_.restores([&](copy_emitter& em) {
        em.whole(parallel_mode::tp, em.pool(parallel_mode::tp, sr, t),
                 em.pool(parallel_mode::tp, r, u));
      });
      sch_.release(r, u);
    }
  }

  // Replicas no owner reads (H_kv < P: each owner reads a slice from one of its P/H_kv
  // replicas) free in the first round instead of with their slice's last read, so a full pool
  // gets free pages at once (an interleaved owner can then empty a group). Each is re-created
  // on rollback from a replica that is read: it stays untouched to the end of this round, and
  // undoing the later rounds gives it back its bytes before this round's restores run.
  void drop_unread_replicas() {
    if (sets_ == 1) return;
    for (int r = 0; r < P_; ++r) {
      const int64_t j = g_.tp_slice_of_rank(r), sh = g_.dcp_rank(r);
      for (int64_t t = 0; t < g_.num_tp_pages(); ++t) {
        const int64_t l = l_of_(r, t);
        if (l < 0 || reads_(r, t) > 0 || sch_.state(r, t) != page_state::live) continue;
        int sr = -1;
        for (int64_t set = 0; set < sets_ && sr < 0; ++set) {
          const auto q = static_cast<int>(g_.tp_rank_of(j, set, sh));
          if (q != r && loc_(q, l) >= 0 && reads_(q, loc_(q, l)) > 0) sr = q;
        }
        if (sr < 0) continue;
        sch_.restores([&](copy_emitter& em) {
          em.whole(parallel_mode::tp, em.pool(parallel_mode::tp, sr, loc_(sr, l)),
                   em.pool(parallel_mode::tp, r, t));
        });
        sch_.release(r, t);
      }
    }
  }

  void assign(int o, int64_t i, int64_t q) {
    items_[idx(i)].group = q;
    group_item_(o, q) = i;
    active_.push_back(i);
  }

  // Each owner's waiting pages take groups: (a) pages whose own piece already sits at its
  // slice position stay in place when the rest of that group is free; (b) the others take the
  // groups with the most free TP pages (contiguous) or wholly free groups (interleaved), and
  // in-place candidates take wholly free groups left over (landing now beats waiting);
  // (c) the remaining candidates stay in place and wait for the rest of their group.
  void assign_groups() {
    for (int o = 0; o < P_; ++o) {
      std::vector<int64_t>& un = unassigned_[idx(o)];
      std::vector<int64_t>& cand = candidate_[idx(o)];
      if (un.empty() && cand.empty()) continue;
      std::vector<int64_t> later;
      for (int64_t i : cand) {
        const int64_t q = loc_(o, items_[idx(i)].l) / split_;
        if (sch_.free_in_group(o, q) == split_ - 1) assign_in_place(o, i);
        else later.push_back(i);
      }
      cand = std::move(later);
      std::vector<std::vector<int64_t>> by_free(idx(split_) + 1);
      for (int64_t q = g_.num_ep_pages - 1; q >= 0; --q)
        if (group_item_(o, q) < 0 && sch_.free_in_group(o, q) > 0 && !candidate_waits(o, q))
          by_free[idx(sch_.free_in_group(o, q))].push_back(q);
      const int64_t min_free = contiguous_ ? 1 : split_;
      for (int64_t f = split_; f >= min_free; --f)
        for (int64_t q : by_free[idx(f)]) {
          if (!un.empty()) {
            assign(o, un.back(), q);
            un.pop_back();
          } else if (f == split_ && !cand.empty()) {
            assign(o, cand.back(), q);
            cand.pop_back();
          }
        }
      for (int64_t i : cand) assign_in_place(o, i);
      cand.clear();
    }
  }

  // Whether group q of o holds the own piece of an in-place candidate not assigned yet.
  bool candidate_waits(int o, int64_t q) const {
    const int64_t i = cand_group_(o, q);
    return i >= 0 && items_[idx(i)].group < 0;
  }

  void assign_in_place(int o, int64_t i) {
    tp_item& m = items_[idx(i)];
    m.in_place = true;
    assign(o, i, loc_(o, m.l) / split_);
  }

  // Pieces of assigned pages land where their TP page is free.
  void land_pieces() {
    std::vector<int64_t> still;
    for (int64_t i : active_) {
      tp_item& m = items_[idx(i)];
      if (contiguous_) {
        for (int64_t j = 0; j < split_; ++j)
          if (at(i, j) != piece_at::landed) land(i, j);
      } else {
        land_whole(i);
      }
      if (m.waiting > 0) still.push_back(i);
      else ++landed_items_;
    }
    active_ = std::move(still);
  }

  // Contiguous: piece j of item i into TP page group*split+j of the owner, when it is free.
  void land(int64_t i, int64_t j) {
    tp_item& m = items_[idx(i)];
    const int o = m.owner;
    const int64_t d = m.group * split_ + j;
    if (m.in_place && j == g_.tp_slice_of_rank(o)) {
      sch_.keep(o, d);
      ++stats_.pages_in_place;
      read(o, d, j, m.l);
      finish_piece(i, j);
      return;
    }
    if (sch_.state(o, d) != page_state::free) return;
    sch_.fill(o, d);
    copy_emitter& em = sch_.emit();
    const page_ref dst = em.pool(parallel_mode::tp, o, d);
    if (at(i, j) == piece_at::staged) {
      em.whole(parallel_mode::tp, em.slice_of(em.stage(parallel_mode::ep, o, m.slot), j), dst);
    } else {
      const int sr = src_rank(j, o, m.l);
      const int64_t t = loc_(sr, m.l);
      em.whole(parallel_mode::tp, em.pool(parallel_mode::tp, sr, t), dst);
      read(sr, t, j, m.l);
    }
    finish_piece(i, j);
  }

  void finish_piece(int64_t i, int64_t j) {
    tp_item& m = items_[idx(i)];
    at(i, j) = piece_at::landed;
    ++moved_;
    if (--m.waiting == 0 && m.slot >= 0) sch_.release_slot(m.owner, m.slot);
  }

  // Interleaved: all pieces at once into the wholly free group (assigned only when free).
  void land_whole(int64_t i) {
    tp_item& m = items_[idx(i)];
    const int o = m.owner;
    copy_emitter& em = sch_.emit();
    const page_ref dst = em.pool(parallel_mode::ep, o, m.group);
    for (int64_t j = 0; j < split_; ++j) sch_.fill(o, m.group * split_ + j);
    if (m.slot >= 0) {
      em.whole(parallel_mode::ep, em.stage(parallel_mode::ep, o, m.slot), dst);
    } else {
      for (int64_t j = 0; j < split_; ++j) {
        const int sr = src_rank(j, o, m.l);
        const int64_t t = loc_(sr, m.l);
        em.slice(dst, j, em.pool(parallel_mode::tp, sr, t), false);
        read(sr, t, j, m.l);
      }
    }
    for (int64_t j = 0; j < split_; ++j) finish_piece(i, j);
  }

  // Moves the live piece at (r, t) to free TP page d of r (or into staging when d < 0);
  // its readers read it there.
  void move_aside(int r, int64_t t, int64_t d) {
    const int64_t l = l_of_(r, t);
    copy_emitter& em = sch_.emit();
    sch_.fill(r, d, page_state::live);  // still to be read by its page's owners
    em.whole(parallel_mode::tp, em.pool(parallel_mode::tp, r, t), em.pool(parallel_mode::tp, r, d));
    sch_.release(r, t);
    loc_(r, l) = d;
    l_of_(r, d) = l;
    reads_(r, d) = reads_(r, t);
    reads_(r, t) = 0;
    ++stats_.pages_compacted;
    ++moved_;
  }

  // Interleaved: an owner with waiting pages and too few wholly free groups empties its
  // least-used groups into free TP pages of the fullest ones.
  void compact() {
    for (int o = 0; o < P_; ++o) {
      const auto want = static_cast<int64_t>(unassigned_[idx(o)].size());
      if (want == 0) continue;
      std::vector<std::pair<int64_t, int64_t>> movable, dest;  // (free pages, group)
      int64_t avail = 0;  // free pages outside the groups chosen to empty
      for (int64_t q = 0; q < g_.num_ep_pages; ++q) {
        const int64_t f = sch_.free_in_group(o, q);
        if (group_item_(o, q) >= 0 || f == split_) continue;
        if (f > 0) movable.emplace_back(f, q);
        avail += f;
      }
      std::sort(movable.begin(), movable.end(), std::greater<>());  // fewest live pieces first
      std::vector<uint8_t> chosen(idx(g_.num_ep_pages), 0);
      int64_t emptied = 0, need = 0;
      for (const auto& [f, q] : movable) {
        if (emptied >= want || need + (split_ - f) > avail - f) break;
        chosen[idx(q)] = 1;
        need += split_ - f;
        avail -= f;
        ++emptied;
      }
      for (int64_t q = 0; q < g_.num_ep_pages; ++q)
        if (!chosen[idx(q)] && group_item_(o, q) < 0 && sch_.free_in_group(o, q) > 0)
          dest.emplace_back(sch_.free_in_group(o, q), q);
      std::sort(dest.begin(), dest.end());  // fullest groups first
      std::vector<int64_t> pages;
      for (const auto& [f, q] : dest)
        for (int64_t j = 0; j < split_; ++j)
          if (sch_.state(o, q * split_ + j) == page_state::free) pages.push_back(q * split_ + j);
      std::size_t next = 0;
      for (int64_t q = 0; q < g_.num_ep_pages; ++q) {
        if (!chosen[idx(q)]) continue;
        for (int64_t j = 0; j < split_ && next < pages.size(); ++j)
          if (sch_.state(o, q * split_ + j) == page_state::live) move_aside(o, q * split_ + j, pages[next++]);
      }
    }
  }

  // Free TP pages outside every assigned group ("spare": no page of this owner wants them)
  // would idle this round: pieces blocking a destination step aside into them, so the waiting
  // piece lands next round instead of at the end of a chain of waits. When nothing moved at
  // all (a cycle of waits and no spare page), a waiting page's pieces go to a staging slot.
  void step_aside(bool nothing_landed) {
    bool moved_aside = false;
    for (int64_t i : active_) {
      tp_item& m = items_[idx(i)];
      const int o = m.owner;
      if (!unassigned_[idx(o)].empty() || !contiguous_) continue;
      for (int64_t j = 0; j < split_; ++j) {
        const int64_t d = m.group * split_ + j;
        if (at(i, j) == piece_at::landed || sch_.state(o, d) != page_state::live) continue;
        const int64_t spare = spare_page(o);
        if (spare < 0) break;
        move_aside(o, d, spare);
        moved_aside = true;
      }
    }
    if (moved_aside || !nothing_landed) return;  // moved pages are written this round
    for (int o = 0; o < P_; ++o) stage_one(o);
  }

  // A free TP page of rank r outside every assigned group (-1 when none).
  int64_t spare_page(int r) {
    std::vector<int64_t>& c = spare_[idx(r)];
    if (spare_round_[idx(r)] != sch_.rounds()) {
      c.clear();
      spare_round_[idx(r)] = sch_.rounds();
      for (int64_t t = g_.num_tp_pages() - 1; t >= 0; --t)
        if (group_item_(r, t / split_) < 0 && sch_.state(r, t) == page_state::free) c.push_back(t);
    }
    while (!c.empty() && sch_.state(r, c.back()) != page_state::free) c.pop_back();
    if (c.empty()) return -1;
    return c.back();
  }

  // The first waiting page of owner o not staged yet: its pieces still at their sources go to
  // a staging slot (which frees them). A page kept in place qualifies once its own piece is
  // kept (always, once it is active): with a full pool, two in-place pages whose groups each
  // hold the other's missing piece wait on each other, and only staging breaks that cycle.
  void stage_one(int o) {
    if (sch_.free_slots(o) == 0) return;
    auto stageable = [&](int64_t i) {
      const tp_item& m = items_[idx(i)];
      return m.owner == o && m.slot < 0 &&
             (!m.in_place || at(i, g_.tp_slice_of_rank(o)) == piece_at::landed);
    };
    int64_t pick = -1;
    for (int64_t i : active_)
      if (stageable(i)) {
        pick = i;
        break;
      }
    const std::vector<int64_t>& un = unassigned_[idx(o)];
    for (auto it = un.rbegin(); pick < 0 && it != un.rend(); ++it)
      if (stageable(*it)) pick = *it;
    if (pick < 0) return;
    tp_item& m = items_[idx(pick)];
    m.slot = sch_.take_slot(o);
    copy_emitter& em = sch_.emit();
    const page_ref stage = em.stage(parallel_mode::ep, o, m.slot);
    for (int64_t j = 0; j < split_; ++j) {
      if (at(pick, j) != piece_at::source) continue;
      const int sr = src_rank(j, o, m.l);
      const int64_t t = loc_(sr, m.l);
      em.slice(stage, j, em.pool(parallel_mode::tp, sr, t), false);
      read(sr, t, j, m.l);
      at(pick, j) = piece_at::staged;
    }
    ++stats_.pages_staged;
    ++moved_;
  }

  const kv_geometry& g_;
  int P_;
  int64_t split_, reps_, sets_, N_;
  bool contiguous_;
  round_scheduler sch_;
  rank_table<int64_t> loc_;         // (rank, logical page) -> TP page holding its slice
  rank_table<int64_t> l_of_;        // (rank, TP page) -> logical page, -1 when none
  rank_table<int32_t> reads_;       // (rank, TP page) -> reads left
  rank_table<int32_t> slice_reads_; // (slice, logical page) -> reads left over all replicas
  rank_table<int64_t> item_of_;     // (owner, logical page) -> item
  rank_table<int64_t> group_item_;  // (owner, EP page) -> item assigned to it, -1 when none
  std::vector<tp_item> items_;
  std::vector<piece_at> at_;        // [item * split + slice]
  std::vector<std::vector<int64_t>> unassigned_;  // [owner] items without a group
  std::vector<std::vector<int64_t>> candidate_{std::vector<std::vector<int64_t>>(idx(P_))};
  rank_table<int64_t> cand_group_{P_, g_.num_ep_pages, -1};  // (owner, group) -> candidate
  std::vector<int64_t> active_;     // items with a group and pieces still to land
  int64_t landed_items_ = 0, moved_ = 0;
  std::vector<std::vector<int64_t>> spare_{std::vector<std::vector<int64_t>>(idx(P_))};
  std::vector<int64_t> spare_round_{std::vector<int64_t>(idx(P_), -1)};
  kv_migration_stats& stats_;
};

}  // namespace

outcome plan_tp_to_ep(const kv_geometry& g, const kv_pool_layout& layout, const kv_state& s,
                      const kv_migration_options& opt) {
  outcome out;
  const int P = g.num_ranks;
  const int64_t n_ep = g.num_ep_pages;
  kv_migration& res = out.result;
  res.copies.num_ranks = P;
  const std::vector<kv_sequence>& seqs = s.ranks[0].sequences;
  kv_placement own_placement;
  const kv_placement* pl = opt.placement;
  if (pl == nullptr) {
    std::vector<kv_demand> demands;
    std::vector<int64_t> groups;
    kv_demands_of(g, s, demands, groups);
    own_placement = place_longest_first(demands, groups, std::vector<int64_t>(idx(P), n_ep));
    pl = &own_placement;
  }
  MOEBIUS_CHECK(pl->owner.size() == seqs.size(), errc::invalid_argument, "placement has ",
                pl->owner.size(), " owners but the TP state holds ", seqs.size(), " sequences");
  out.pages_available = n_ep;
  if (!pl->fits) {
    std::ostringstream why;
    why << "EP view cannot hold the live KV: longest-first placement found no owner within "
           "capacity (" << n_ep << " EP pages per rank) for some sequence; loads:";
    for (int64_t l : pl->load) why << ' ' << l;
    out.ok = out.holds = false;
    out.reason = why.str();
    out.pages_needed = pl->load.empty() ? 0 : *std::max_element(pl->load.begin(), pl->load.end());
    return out;
  }
  // Distinct (owner, logical page) per owner; logical page k * num_tp_pages + rank k's id.
  const int64_t N = g.num_tp_pages();
  std::vector<std::vector<uint8_t>> seen(idx(P), std::vector<uint8_t>(idx(g.dcp * N), 0));
  std::vector<int64_t> need(idx(P), 0);
  for (std::size_t i = 0; i < seqs.size(); ++i) {
    const int o = pl->owner[i];
    MOEBIUS_CHECK(o >= 0 && o < P, errc::invalid_argument, "placement gives sequence ",
                  seqs[i].seq_id, " owner ", o, " outside [0, ", P, ")");
    for (int64_t sh = 0; sh < g.dcp; ++sh)
      for (int64_t p : s.ranks[idx(sh)].sequences[i].pages)
        if (!seen[idx(o)][idx(sh * N + p)]) {
          seen[idx(o)][idx(sh * N + p)] = 1;
          ++need[idx(o)];
          ++res.stats.pages_moved;
        }
  }
  out.pages_needed = *std::max_element(need.begin(), need.end());
  if (out.pages_needed > n_ep) {
    out.ok = out.holds = false;
    out.reason = "EP view cannot hold the live KV: an owner needs " +
                 std::to_string(out.pages_needed) + " EP pages but has " + std::to_string(n_ep);
    return out;
  }
  res.stats.imbalance = pl->imbalance;
  tp_to_ep_rounds rounds(g, layout, s, *pl, opt, res);
  if (!rounds.run()) {
    out.ok = false;
    out.reason = rounds.failure();
    return out;
  }
  // Each owner's sequences over its EP pages, in logical order (page x from DCP index x % dcp,
  // its local page x / dcp); free = wholly free groups.
  std::vector<std::vector<kv_sequence>> tables(idx(P));
  for (std::size_t i = 0; i < seqs.size(); ++i) {
    kv_sequence q = seqs[i];
    q.pages.resize(idx(logical_pages(g, q)));
    for (std::size_t x = 0; x < q.pages.size(); ++x) {
      const int64_t sh = static_cast<int64_t>(x) % g.dcp;
      const int64_t p = s.ranks[idx(sh)].sequences[i].pages[x / idx(g.dcp)];
      q.pages[x] = rounds.ep_page(pl->owner[i], sh * N + p);
    }
    tables[idx(pl->owner[i])].push_back(std::move(q));
  }
  res.new_state = make_kv_state(g, parallel_mode::ep, std::move(tables));
  return out;
}

}  // namespace moebius::kv_detail
