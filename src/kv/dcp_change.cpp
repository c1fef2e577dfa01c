// TP(dcp a) -> TP(dcp b): each rank keeps its share at dcp lcm(a, b), drops what it held only at
// a, and receives what it holds only at b from the page's keeper. See dcp_change.hpp for the
// contract and why two rounds always suffice; round_scheduler.hpp for what a round may do.

#include "moebius/kv/dcp_change.hpp"

#include <algorithm>
#include <map>
#include <numeric>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "migration_directions.hpp"
#include "moebius/error.hpp"
#include "round_scheduler.hpp"

namespace moebius::kv_detail {

namespace {

std::size_t idx(int64_t v) { return static_cast<std::size_t>(v); }

// One TP page a rank receives: its keeper's page, and where it lands.
struct dcp_item {
  int receiver;
  int keeper;
  int64_t src;        // the keeper's TP page
  int64_t dst = -1;   // the receiver's TP page, once copied
};

// The three geometries of a change (the pool's, at the source, target and keeper dcp) and the
// questions the planner asks them; no index arithmetic of its own.
struct dcp_views {
  kv_geometry from, to, keep;  // dcp a, b, lcm(a, b)

  // The rank holding logical page i for rank r at dcp lcm(a, b): r itself when r keeps it.
  int keeper(int r, int64_t i) const {
    return static_cast<int>(keep.tp_rank_of(from.tp_slice_of_rank(r), keep.tp_replica_set(r),
                                            keep.dcp_rank_of_page(i)));
  }
  bool holds_before(int r, int64_t i) const {
    return from.dcp_rank_of_page(i) == from.dcp_rank(r);
  }
  bool holds_after(int r, int64_t i) const { return to.dcp_rank_of_page(i) == to.dcp_rank(r); }
  // A rank's page of sequence q (its table at dcp a) at logical page i, which it holds.
  int64_t page_before(const kv_sequence& q, int64_t i) const {
    return q.pages[idx(from.dcp_local_page(i))];
  }
};

// What every rank keeps, drops and receives, and the tables at dcp b with each received page
// standing for its item (-1 - item) until the rounds place it.
class dcp_change_items {
 public:
  dcp_change_items(const dcp_views& v, const kv_state& s)
      : v_(v),
        P_(v.from.num_ranks),
        residue_(P_, v.from.num_tp_pages(), -1),
        kept_(P_, v.from.num_tp_pages(), 0),
        keeper_page_(P_, v.from.num_tp_pages(), -1),
        keeper_of_(P_, v.from.num_tp_pages(), -1),
        tables_(idx(P_)),
        kept_count_(idx(P_), 0),
        received_(idx(P_), 0) {
    check_shared_residues(s);
    for (int r = 0; r < P_; ++r) {
      const std::vector<kv_sequence>& mine = s.ranks[idx(r)].sequences;
      for (std::size_t q = 0; q < mine.size(); ++q) {
        note_drops(s, r, q);
        tables_[idx(r)].push_back(target_sequence(s, r, q));
      }
    }
  }

  const std::vector<dcp_item>& items() const { return items_; }
  std::vector<dcp_item>& items() { return items_; }
  bool kept(int r, int64_t t) const { return kept_(r, t) != 0; }
  int64_t kept_pages(int r) const { return kept_count_[idx(r)]; }
  int64_t received_pages(int r) const { return received_[idx(r)]; }
  // The keeper rank and page that re-create dropped page t of rank r on rollback.
  std::pair<int, int64_t> restore_source(int r, int64_t t) const {
    return {static_cast<int>(keeper_of_(r, t)), keeper_page_(r, t)};
  }
  // The tables at dcp b, received pages resolved to where the rounds put them.
  std::vector<std::vector<kv_sequence>> target_tables() && {
    for (auto& rank : tables_)
      for (kv_sequence& q : rank)
        for (int64_t& p : q.pages)
          if (p < 0) p = items_[idx(-1 - p)].dst;
    return std::move(tables_);
  }

 private:
  // A page of rank r used at two logical pages keeps or drops, and has one keeper, only when
  // both pages lie on one rank at dcp lcm(a, b): true for a shared prefix, which sits at one
  // logical index in every sharer.
  void check_shared_residues(const kv_state& s) {
    const int64_t l = v_.keep.dcp;
    for (int r = 0; r < P_; ++r)
      for (const kv_sequence& q : s.ranks[idx(r)].sequences)
        for (int64_t k = 0; k < q.num_pages(); ++k) {
          const int64_t i = v_.from.dcp_logical_page(v_.from.dcp_rank(r), k);
          int64_t& res = residue_(r, q.pages[idx(k)]);
          MOEBIUS_CHECK(res < 0 || res == v_.keep.dcp_rank_of_page(i), errc::invalid_argument,
                        "TP rank ", r, " page ", q.pages[idx(k)], " is logical page ", i,
                        " of sequence ", q.seq_id, " and, in another sequence, a logical page ",
                        "that dcp ", v_.from.dcp, " -> ", v_.to.dcp,
                        " places on another rank (logical pages differ modulo lcm = ", l,
                        "): shared prefix pages must sit at one logical index");
          res = v_.keep.dcp_rank_of_page(i);
        }
  }

  // Pages rank r held of sequence q and does not hold at dcp b: dropped unless another use
  // keeps them; each remembers the keeper page that re-creates it.
  void note_drops(const kv_state& s, int r, std::size_t q) {
    const kv_sequence& seq = s.ranks[idx(r)].sequences[q];
    for (int64_t k = 0; k < seq.num_pages(); ++k) {
      const int64_t i = v_.from.dcp_logical_page(v_.from.dcp_rank(r), k);
      if (v_.holds_after(r, i) || keeper_of_(r, seq.pages[idx(k)]) >= 0) continue;
      const int kr = v_.keeper(r, i);
      keeper_of_(r, seq.pages[idx(k)]) = kr;
      keeper_page_(r, seq.pages[idx(k)]) =
          v_.page_before(s.ranks[idx(kr)].sequences[q], i);
    }
  }

  // Sequence q on rank r at dcp b: its share, each page kept or an item to receive.
  kv_sequence target_sequence(const kv_state& s, int r, std::size_t q) {
    kv_sequence t = s.ranks[idx(r)].sequences[q];
    t.pages.clear();
    const int64_t n = logical_pages(v_.to, t);
    const int64_t k_to = v_.to.dcp_rank(r);
    for (int64_t local = 0; local < v_.to.dcp_pages_held(n, k_to); ++local) {
      const int64_t i = v_.to.dcp_logical_page(k_to, local);
      if (v_.holds_before(r, i)) {
        const int64_t p = v_.page_before(s.ranks[idx(r)].sequences[q], i);
        if (!kept_(r, p)) {
          kept_(r, p) = 1;
          ++kept_count_[idx(r)];
        }
        t.pages.push_back(p);
        continue;
      }
      const int kr = v_.keeper(r, i);
      const int64_t src = v_.page_before(s.ranks[idx(kr)].sequences[q], i);
      t.pages.push_back(-1 - item(r, kr, src, i < t.shared_prefix_pages));
    }
    return t;
  }

  // The item copying keeper kr's page src to r: a page of a shared prefix once per receiver.
  int64_t item(int r, int kr, int64_t src, bool shared) {
    if (shared) {
      const auto [it, fresh] =
          shared_items_.try_emplace(std::tuple(r, kr, src), static_cast<int64_t>(items_.size()));
      if (!fresh) return it->second;
    }
    items_.push_back({r, kr, src});
    ++received_[idx(r)];
    return static_cast<int64_t>(items_.size()) - 1;
  }

  const dcp_views& v_;
  int P_;
  rank_table<int64_t> residue_;      // (rank, page) -> logical page mod lcm(a, b), -1 unused
  rank_table<uint8_t> kept_;         // (rank, page) -> kept at dcp b
  rank_table<int64_t> keeper_page_;  // (rank, dropped page) -> its keeper's page
  rank_table<int64_t> keeper_of_;    // (rank, dropped page) -> its keeper rank, -1 none
  std::vector<std::vector<kv_sequence>> tables_;
  std::vector<dcp_item> items_;
  std::map<std::tuple<int, int, int64_t>, int64_t> shared_items_;
  std::vector<int64_t> kept_count_, received_;
};

std::string direction_of(const dcp_views& v) {
  return "TP(dcp " + std::to_string(v.from.dcp) + ")->TP(dcp " + std::to_string(v.to.dcp) + ")";
}

// The rounds: round 0 into the pages free at the start, dropping every dropped page; round 1
// into the pages the drops freed. False with the scheduler's failure when over max_rounds.
bool run_rounds(const dcp_views& v, const kv_pool_layout& layout, const kv_state& s,
                const kv_migration_options& opt, dcp_change_items& it, kv_migration& res,
                std::string& failure) {
  const kv_geometry& g = v.from;
  const int P = g.num_ranks;
  round_scheduler sch(g, layout, opt.staging, staging_slots(g, opt, parallel_mode::tp),
                      kv_staging_slot_bytes(g, parallel_mode::tp), opt.max_rounds,
                      direction_of(v), res.copies);
  std::vector<std::vector<int64_t>> drops(idx(P));
  for (int r = 0; r < P; ++r) {
    std::vector<uint8_t> live(idx(g.num_tp_pages()), 1);
    for (int64_t t : s.ranks[idx(r)].free_pages) live[idx(t)] = 0;
    for (int64_t t = 0; t < g.num_tp_pages(); ++t) {
      if (!live[idx(t)]) continue;
      sch.mark_live(r, t);
      if (it.kept(r, t)) sch.keep(r, t);
      else drops[idx(r)].push_back(t);
    }
    const std::vector<int64_t>& f = s.ranks[idx(r)].free_pages;
    for (auto t = f.rbegin(); t != f.rend(); ++t) sch.offer(r, *t, true);
  }
  std::vector<int64_t> pending(it.items().size());
  std::iota(pending.begin(), pending.end(), int64_t{0});
  auto waiting = [&] {
    std::vector<int64_t> w(idx(P), 0);
    for (int64_t i : pending) ++w[idx(it.items()[idx(i)].receiver)];
    return w;
  };
  // Without a copy nothing is written: the drops free with the tables, no phase, no barrier.
  while (!pending.empty()) {
    if (!sch.begin_round(waiting())) {
      failure = sch.failure();
      return false;
    }
    if (sch.rounds() == 0) {
      for (int r = 0; r < P; ++r)
        for (int64_t t : drops[idx(r)]) {
          const std::pair<int, int64_t> keeper = it.restore_source(r, t);
          sch.restores([&](copy_emitter& em) {
            em.whole(parallel_mode::tp, em.pool(parallel_mode::tp, keeper.first, keeper.second),
                     em.pool(parallel_mode::tp, r, t));
          });
          sch.release(r, t);
        }
    }
    std::vector<int64_t> next;
    for (int64_t i : pending) {
      dcp_item& m = it.items()[idx(i)];
      const int64_t d = sch.take_page(m.receiver);
      if (d < 0) {
        next.push_back(i);
        continue;
      }
      sch.fill(m.receiver, d);
      copy_emitter& em = sch.emit();
      em.whole(parallel_mode::tp, em.pool(parallel_mode::tp, m.keeper, m.src),
               em.pool(parallel_mode::tp, m.receiver, d));
      m.dst = d;
    }
    pending = std::move(next);
    if (!sch.end_round(waiting())) {
      failure = sch.failure();
      return false;
    }
  }
  res.stats.rounds = sch.rounds();
  res.stats.bytes_copied = sch.bytes();
  return true;
}

outcome plan_dcp_change(const kv_geometry& g, const kv_pool_layout& layout, const kv_state& s,
                        int64_t dcp, const kv_migration_options& opt) {
  validate(g, s);
  validate(g, layout);
  MOEBIUS_CHECK(opt.max_rounds >= 1, errc::invalid_argument,
                "max_rounds must be >= 1 (max_rounds=", opt.max_rounds, ")");
  const dcp_views v{g, with_dcp(g, dcp), with_dcp(g, std::lcm(g.dcp, dcp))};
  (void)staging_slots(g, opt, parallel_mode::tp);  // a bad region is refused even when unused
  outcome out;
  kv_migration& res = out.result;
  res.copies.num_ranks = g.num_ranks;
  res.stats.imbalance = 1.0;
  out.pages_available = g.num_pages(s.mode);
  if (s.mode == parallel_mode::ep || dcp == g.dcp) {  // the identity
    res.new_state = s;
    for (int r = 0; r < g.num_ranks; ++r)
      out.pages_needed = std::max(out.pages_needed, used_pages(g, s, r));
    return out;
  }
  dcp_change_items it(v, s);
  int busiest = 0;
  for (int r = 0; r < g.num_ranks; ++r) {
    const int64_t need = it.kept_pages(r) + it.received_pages(r);
    res.stats.pages_in_place += it.kept_pages(r);
    if (need > out.pages_needed) {
      out.pages_needed = need;
      busiest = r;
    }
  }
  res.stats.pages_moved = static_cast<int64_t>(it.items().size());
  if (out.pages_needed > out.pages_available) {
    std::ostringstream why;
    why << "TP view at dcp " << dcp << " cannot hold the live KV: TP rank " << busiest
        << " (DCP index " << v.to.dcp_rank(busiest) << " of dcp " << dcp << ") needs "
        << out.pages_needed << " pages (its share of every sequence: "
        << it.kept_pages(busiest) << " it keeps, " << it.received_pages(busiest)
        << " it receives) but has " << out.pages_available;
    out.ok = out.holds = false;
    out.reason = why.str();
    return out;
  }
  if (!run_rounds(v, layout, s, opt, it, res, out.reason)) {
    out.ok = false;
    return out;
  }
  res.new_state = make_kv_state(v.to, parallel_mode::tp, std::move(it).target_tables());
  return out;
}

}  // namespace
}  // namespace moebius::kv_detail

namespace moebius {

kv_migration_attempt try_plan_kv_dcp_change(const kv_geometry& g, const kv_pool_layout& layout,
                                            const kv_state& s, int64_t dcp,
                                            const kv_migration_options& opt) {
  return kv_detail::attempt_of(kv_detail::plan_dcp_change(g, layout, s, dcp, opt));
}

kv_migration plan_kv_dcp_change(const kv_geometry& g, const kv_state& s, int64_t dcp,
                                const kv_migration_options& opt) {
  return plan_kv_dcp_change(g, present_kv_layout(g), s, dcp, opt);
}

kv_migration plan_kv_dcp_change(const kv_geometry& g, const kv_pool_layout& layout,
                                const kv_state& s, int64_t dcp, const kv_migration_options& opt) {
  kv_migration_attempt a = try_plan_kv_dcp_change(g, layout, s, dcp, opt);
  MOEBIUS_CHECK(a.migration.has_value(), errc::capacity, "KV dcp change TP(dcp ", g.dcp,
                ")->TP(dcp ", dcp, ") impossible: ", a.capacity.reason);
  return std::move(*a.migration);
}

}  // namespace moebius
