#include "moebius/kv/kv_migration.hpp"

#include <algorithm>
#include <numeric>
#include <ostream>
#include <sstream>
#include <utility>

#include "moebius/detail/checked_math.hpp"
#include "moebius/error.hpp"

namespace moebius {

namespace {

using std::size_t;

template <class T>
constexpr size_t idx(T v) {
  return static_cast<size_t>(v);
}

// Where one page (of one kind) starts and how far apart its per-tensor pieces are.
struct page_ref {
  memory_space space = memory_space::kv_pool;
  int rank = 0;
  int64_t base = 0;     // offset of tensor 0's piece
  int64_t k_pitch = 0;  // bytes between tensor k and k+1 pieces
};

// Turns page copies into copy_ops: one op per page piece for HND (rows = tensors); NHD slices
// are a 2-D grid of (tensor, token) pieces, and the larger of the two becomes the op's rows
// (page size 1: one op of all tensors per slice, not one op per tensor).
struct emitter {
  const kv_geometry& g;
  const kv_staging& staging;
  std::vector<copy_op>* ops = nullptr;
  int64_t bytes = 0;

  page_ref pool(parallel_mode m, int rank, int64_t page) const {
    return {memory_space::kv_pool, rank, page * g.page_bytes(m), g.region_bytes()};
  }
  page_ref stage(parallel_mode m, int rank, int64_t slot) const {
    const int64_t pb = g.page_bytes(m);
    return {staging.space, rank, staging.offset + slot * g.num_tensors() * pb, pb};
  }

  void op(const page_ref& s, int64_t s_off, int64_t s_pitch, const page_ref& d, int64_t d_off,
          int64_t d_pitch, int64_t rows, int64_t row_bytes) {
    bytes += rows * row_bytes;
    copy_op c;
    c.src_space = s.space;
    c.dst_space = d.space;
    c.src_rank = s.rank;
    c.dst_rank = d.rank;
    c.src_offset = s_off;
    c.dst_offset = d_off;
    c.rows = rows;
    c.row_bytes = row_bytes;
    c.src_pitch = rows == 1 ? row_bytes : s_pitch;
    c.dst_pitch = rows == 1 ? row_bytes : d_pitch;
    ops->push_back(c);
  }
  // A whole page of kind m (all tensors).
  void whole(parallel_mode m, const page_ref& s, const page_ref& d) {
    op(s, s.base, s.k_pitch, d, d.base, d.k_pitch, g.num_tensors(), g.page_bytes(m));
  }
  // Head slice j of EP page `e` <-> TP page `t` (to_tp: e -> t, else t -> e).
  void slice(const page_ref& e, int64_t j, const page_ref& t, bool to_tp) {
    if (g.layout == kv_layout::hnd || g.tp_pages_per_ep_page() == 1) {
      const page_ref es{e.space, e.rank, e.base + j * g.tp_page_bytes(), e.k_pitch};
      if (to_tp) whole(parallel_mode::tp, es, t);
      else whole(parallel_mode::tp, t, es);
      return;
    }
    const int64_t row = g.heads_per_tp_page() * g.head_bytes();
    const int64_t ep_pitch = g.heads_per_ep_page() * g.head_bytes();
    if (g.page_size >= g.num_tensors()) {
      for (int64_t k = 0; k < g.num_tensors(); ++k) {  // rows = tokens
        const int64_t eo = e.base + k * e.k_pitch + j * row;
        const int64_t to = t.base + k * t.k_pitch;
        if (to_tp) op(e, eo, ep_pitch, t, to, row, g.page_size, row);
        else op(t, to, row, e, eo, ep_pitch, g.page_size, row);
      }
      return;
    }
    for (int64_t i = 0; i < g.page_size; ++i) {  // rows = tensors
      const int64_t eo = e.base + i * ep_pitch + j * row;
      const int64_t to = t.base + i * row;
      if (to_tp) op(e, eo, e.k_pitch, t, to, t.k_pitch, g.num_tensors(), row);
      else op(t, to, t.k_pitch, e, eo, e.k_pitch, g.num_tensors(), row);
    }
  }
};

struct outcome {
  kv_migration result;
  bool ok = true;
  bool holds = true;
  int64_t pages_needed = 0;
  int64_t pages_available = 0;
  std::string reason;
};

int64_t staging_slots(const kv_geometry& g, const kv_migration_options& opt, parallel_mode m) {
  MOEBIUS_CHECK(opt.staging.bytes >= 0 && opt.staging.offset >= 0, errc::invalid_argument,
                "staging region needs offset >= 0 and bytes >= 0 (offset=", opt.staging.offset,
                ", bytes=", opt.staging.bytes, ")");
  MOEBIUS_CHECK(opt.staging.bytes == 0 || opt.staging.space != memory_space::kv_pool,
                errc::invalid_argument,
                "staging must be outside the kv_pool (it would overlap live pages)");
  const int64_t slot = g.num_tensors() * g.page_bytes(m);
  return slot == 0 ? 0 : opt.staging.bytes / slot;
}

std::vector<int64_t> complement(int64_t n, const std::vector<uint8_t>& used) {
  std::vector<int64_t> free_pages;
  for (int64_t p = 0; p < n; ++p)
    if (!used[idx(p)]) free_pages.push_back(p);
  return free_pages;
}

// ---------------------------------------------------------------------------------------------
// EP -> TP
// ---------------------------------------------------------------------------------------------
outcome ep_to_tp(const kv_geometry& g, const kv_state& s, const kv_migration_options& opt) {
  outcome out;
  const int P = g.num_ranks;
  const int64_t split = g.tp_pages_per_ep_page();
  const int64_t n_ep = g.num_ep_pages, n_tp = g.num_tp_pages();
  const int64_t num_slots = staging_slots(g, opt, parallel_mode::tp);
  emitter em{g, opt.staging, nullptr, 0};
  kv_migration& res = out.result;
  res.copies.num_ranks = P;
  res.stats.imbalance = 1.0;

  // Items: distinct used EP pages per owner, interleaved across owners so every round frees
  // pages on every rank.
  std::vector<std::vector<int64_t>> owned(idx(P));
  std::vector<int64_t> item_of(idx(P) * idx(n_ep), -1);
  int64_t total_used = 0;
  for (int r = 0; r < P; ++r) {
    for (const kv_sequence& q : s.ranks[idx(r)].sequences) {
      for (int64_t p : q.pages) {
        int64_t& it = item_of[idx(r) * idx(n_ep) + idx(p)];
        if (it < 0) {
          it = 0;
          owned[idx(r)].push_back(p);
        }
      }
    }
    total_used += static_cast<int64_t>(owned[idx(r)].size());
  }
  struct item {
    int owner;
    int64_t page;
  };
  std::vector<item> items;
  items.reserve(idx(total_used));
  for (size_t k = 0;; ++k) {
    bool any = false;
    for (int r = 0; r < P; ++r) {
      if (k < owned[idx(r)].size()) {
        any = true;
        item_of[idx(r) * idx(n_ep) + idx(owned[idx(r)][k])] = static_cast<int64_t>(items.size());
        items.push_back({r, owned[idx(r)][k]});
      }
    }
    if (!any) break;
  }
  // Every TP rank holds a piece of every page.
  out.pages_needed = total_used;
  out.pages_available = n_tp;
  if (total_used > n_tp) {
    out.ok = out.holds = false;
    std::ostringstream why;
    why << "TP view cannot hold the live KV: every TP rank needs " << total_used
        << " pages (one per live EP page of all ranks) but has " << n_tp << " (= "
        << n_ep << " EP pages x " << split << ")";
    out.reason = why.str();
    return out;
  }
  std::vector<int64_t> dst(items.size() * idx(P), -1);
  res.stats.pages_moved = total_used;
  // HND (or an unsplit page): the owner's slice is already a TP page. NHD interleaves heads
  // per token, so the owner copies its slice out too and frees the whole EP page.
  const bool keeps_in_place = g.layout == kv_layout::hnd || split == 1;
  res.stats.pages_in_place = keeps_in_place ? total_used : 0;

  if ((P > 1 || !keeps_in_place) && !items.empty()) {
    // Free TP pages: `clean` from wholly free EP pages (used first, keeping the owners' freed
    // pieces free so the way back can stay in place), `pieces` freed during the migration.
    std::vector<std::vector<int64_t>> clean(idx(P)), pieces(idx(P)), stage_free(idx(P));
    std::vector<std::vector<std::pair<int64_t, int64_t>>> staged(idx(P));  // (item, slot)
    for (int r = 0; r < P; ++r) {
      const std::vector<int64_t>& f = s.ranks[idx(r)].free_pages;
      for (auto it = f.rbegin(); it != f.rend(); ++it)
        for (int64_t j = split - 1; j >= 0; --j) clean[idx(r)].push_back(*it * split + j);
      for (int64_t z = num_slots - 1; z >= 0; --z) stage_free[idx(r)].push_back(z);
    }
    auto pool_avail = [&](int r) { return clean[idx(r)].size() + pieces[idx(r)].size(); };
    auto pop_page = [&](int r) {
      std::vector<int64_t>& v = clean[idx(r)].empty() ? pieces[idx(r)] : clean[idx(r)];
      const int64_t q = v.back();
      v.pop_back();
      return q;
    };
    // Units: piece j of an item goes to the ranks holding slice j, [j*reps, (j+1)*reps)
    // (the owner skips its own slice when it stays in place). Pieces move independently, so
    // two full ranks unblock each other piece by piece.
    struct unit {
      int64_t item;
      int64_t slice;
      int first, last;
    };
    const int64_t reps = g.tp_replicas();
    auto skip_owner = [&](const unit& un, int owner) {
      return keeps_in_place && un.slice == g.tp_slice_of_rank(owner);
    };
    std::vector<unit> units;
    std::vector<int32_t> units_left(items.size(), 0);
    for (size_t it = 0; it < items.size(); ++it) {
      for (int64_t j = 0; j < split; ++j) {
        const unit un{static_cast<int64_t>(it), j, static_cast<int>(j * reps),
                      static_cast<int>((j + 1) * reps)};
        if (skip_owner(un, items[it].owner) && reps == 1) continue;  // nobody receives it
        units.push_back(un);
        ++units_left[it];
      }
    }
    std::vector<int64_t> rem(units.size());
    std::iota(rem.begin(), rem.end(), int64_t{0});
    std::vector<std::vector<int64_t>> freed_pieces(idx(P)), freed_slots(idx(P));
    bool any_staged = false;
    while (!rem.empty() || any_staged) {
      if (res.stats.rounds >= opt.max_rounds) {
        out.ok = false;
        out.reason = "EP->TP needs more than max_rounds=" + std::to_string(opt.max_rounds) +
                     " rounds";
        return out;
      }
      plan_phase ph;
      em.ops = &ph.ops;
      bool progress = false;
      // Drain staged pieces into pool pages freed by earlier rounds.
      any_staged = false;
      for (int r = 0; r < P; ++r) {
        std::vector<std::pair<int64_t, int64_t>> kept;
        for (const auto& [it, slot] : staged[idx(r)]) {
          if (pool_avail(r) == 0) {
            kept.emplace_back(it, slot);
            continue;
          }
          const int64_t q = pop_page(r);
          em.whole(parallel_mode::tp, em.stage(parallel_mode::tp, r, slot),
                   em.pool(parallel_mode::tp, r, q));
          dst[idx(it) * idx(P) + idx(r)] = q;
          freed_slots[idx(r)].push_back(slot);
          progress = true;
        }
        staged[idx(r)] = std::move(kept);
      }
      // Move every piece whose receivers all find a free page (or staging slot) this round.
      std::vector<int64_t> next;
      for (int64_t u : rem) {
        const unit& un = units[idx(u)];
        const item& m = items[idx(un.item)];
        bool fits = true;
        for (int r = un.first; r < un.last && fits; ++r)
          fits = (skip_owner(un, m.owner) && r == m.owner) || pool_avail(r) > 0 ||
                 !stage_free[idx(r)].empty();
        if (!fits) {
          next.push_back(u);
          continue;
        }
        const page_ref src = em.pool(parallel_mode::ep, m.owner, m.page);
        for (int r = un.first; r < un.last; ++r) {
          if (skip_owner(un, m.owner) && r == m.owner) continue;
          if (pool_avail(r) > 0) {
            const int64_t q = pop_page(r);
            em.slice(src, un.slice, em.pool(parallel_mode::tp, r, q), true);
            dst[idx(un.item) * idx(P) + idx(r)] = q;
          } else {
            const int64_t z = stage_free[idx(r)].back();
            stage_free[idx(r)].pop_back();
            em.slice(src, un.slice, em.stage(parallel_mode::tp, r, z), true);
            staged[idx(r)].emplace_back(un.item, z);
            ++res.stats.pages_staged;
          }
        }
        // HND: this piece of the owner's page is free after the barrier (unless it is the
        // owner's own slice). NHD: the whole EP page is free once its last piece left.
        if (keeps_in_place) {
          if (un.slice != g.tp_slice_of_rank(m.owner))
            freed_pieces[idx(m.owner)].push_back(m.page * split + un.slice);
        } else if (--units_left[idx(un.item)] == 0) {
          for (int64_t j = 0; j < split; ++j)
            freed_pieces[idx(m.owner)].push_back(m.page * split + j);
        }
        progress = true;
      }
      rem = std::move(next);
      if (!progress) {
        out.ok = false;
        std::ostringstream why;
        why << "EP->TP is stuck after " << res.stats.rounds << " rounds with " << rem.size()
            << " page pieces left: no piece finds a free TP page (or staging slot) on every "
               "rank that holds its slice; lend a staging region (";
        why << kv_staging_slot_bytes(g, parallel_mode::tp) << " bytes per slot)";
        out.reason = why.str();
        return out;
      }
      for (int r = 0; r < P; ++r) {
        // The owner's other pieces and the drained slots are free once the barrier passed.
        for (auto it = freed_pieces[idx(r)].rbegin(); it != freed_pieces[idx(r)].rend(); ++it)
          pieces[idx(r)].push_back(*it);
        freed_pieces[idx(r)].clear();
        for (int64_t z : freed_slots[idx(r)]) stage_free[idx(r)].push_back(z);
        freed_slots[idx(r)].clear();
        if (!staged[idx(r)].empty()) any_staged = true;
      }
      ph.label = "KV EP->TP round " + std::to_string(res.stats.rounds);
      res.copies.phases.push_back(std::move(ph));
      ++res.stats.rounds;
    }
  }
  res.stats.bytes_copied = em.bytes;

  // New tables: every rank holds every sequence; the owner's pages stayed in place.
  std::vector<std::pair<int, const kv_sequence*>> all;
  for (int r = 0; r < P; ++r)
    for (const kv_sequence& q : s.ranks[idx(r)].sequences) all.emplace_back(r, &q);
  std::sort(all.begin(), all.end(),
            [](const auto& a, const auto& b) { return a.second->seq_id < b.second->seq_id; });
  res.new_state.mode = parallel_mode::tp;
  res.new_state.ranks.resize(idx(P));
  std::vector<uint8_t> used(idx(n_tp));
  for (int r = 0; r < P; ++r) {
    std::fill(used.begin(), used.end(), 0);
    std::vector<kv_sequence>& seqs = res.new_state.ranks[idx(r)].sequences;
    seqs.reserve(all.size());
    const int64_t own = g.tp_slice_of_rank(r);
    for (const auto& [o, q] : all) {
      kv_sequence t = *q;
      for (int64_t& p : t.pages) {
        p = keeps_in_place && o == r
                ? p * split + own
                : dst[idx(item_of[idx(o) * idx(n_ep) + idx(p)]) * idx(P) + idx(r)];
        used[idx(p)] = 1;
      }
      seqs.push_back(std::move(t));
    }
    res.new_state.ranks[idx(r)].free_pages = complement(n_tp, used);
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// TP -> EP
// ---------------------------------------------------------------------------------------------
outcome tp_to_ep(const kv_geometry& g, const kv_state& s, const kv_migration_options& opt) {
  outcome out;
  const int P = g.num_ranks;
  const int64_t split = g.tp_pages_per_ep_page();
  const int64_t reps = g.tp_replicas();
  const int64_t n_ep = g.num_ep_pages, n_tp = g.num_tp_pages();
  const int64_t num_slots = staging_slots(g, opt, parallel_mode::ep);
  emitter em{g, opt.staging, nullptr, 0};
  kv_migration& res = out.result;
  res.copies.num_ranks = P;
  const std::vector<kv_sequence>& seqs = s.ranks[0].sequences;
  const bool keeps_in_place = g.layout == kv_layout::hnd || split == 1;

  // Owners.
  kv_placement own_placement;
  const kv_placement* pl = opt.placement;
  if (pl == nullptr) {
    std::vector<kv_demand> demands;
    std::vector<int64_t> groups;
    kv_demands_of(g, s, demands, groups);
    const std::vector<int64_t> cap(idx(P), n_ep);
    own_placement = place_longest_first(demands, groups, cap);
    pl = &own_placement;
  }
  MOEBIUS_CHECK(pl->owner.size() == seqs.size(), errc::invalid_argument, "placement has ",
                pl->owner.size(), " owners but the TP state holds ", seqs.size(), " sequences");
  out.pages_available = n_ep;
  if (!pl->fits) {
    out.ok = out.holds = false;
    std::ostringstream why;
    why << "EP view cannot hold the live KV: longest-first placement found no owner within "
           "capacity (" << n_ep << " EP pages per rank) for some sequence; loads:";
    for (int64_t l : pl->load) why << ' ' << l;
    out.reason = why.str();
    out.pages_needed = pl->load.empty() ? 0 : *std::max_element(pl->load.begin(), pl->load.end());
    return out;
  }
  res.stats.imbalance = pl->imbalance;

  // tp_of[r][l]: rank r's TP page holding its slice of logical page l (l = rank 0's id).
  std::vector<int64_t> tp_of(idx(P) * idx(n_tp), -1), l_of(idx(P) * idx(n_tp), -1);
  for (int r = 0; r < P; ++r) {
    const std::vector<kv_sequence>& rs = s.ranks[idx(r)].sequences;
    for (size_t i = 0; i < seqs.size(); ++i)
      for (size_t k = 0; k < seqs[i].pages.size(); ++k) {
        tp_of[idx(r) * idx(n_tp) + idx(seqs[i].pages[k])] = rs[i].pages[k];
        l_of[idx(r) * idx(n_tp) + idx(rs[i].pages[k])] = seqs[i].pages[k];
      }
  }
  // Items: distinct (owner, logical page).
  struct item {
    int owner;
    int64_t l;
    int64_t t_own = -1;  // the owner's TP page of l (tp_of, cached: the scan reads it often)
    int64_t ep_page = -1;
    bool in_place = false;
  };
  std::vector<item> items;
  std::vector<int64_t> item_of(idx(P) * idx(n_tp), -1);
  std::vector<std::vector<int64_t>> owned(idx(P));
  std::vector<int32_t> refs(idx(n_tp), 0);
  for (size_t i = 0; i < seqs.size(); ++i) {
    const int o = pl->owner[i];
    MOEBIUS_CHECK(o >= 0 && o < P, errc::invalid_argument, "placement gives sequence ",
                  seqs[i].seq_id, " owner ", o, " outside [0, ", P, ")");
    for (int64_t l : seqs[i].pages) {
      int64_t& it = item_of[idx(o) * idx(n_tp) + idx(l)];
      if (it < 0) {
        it = 0;
        owned[idx(o)].push_back(l);
        ++refs[idx(l)];
      }
    }
  }
  for (int r = 0; r < P; ++r)
    out.pages_needed = std::max(out.pages_needed, static_cast<int64_t>(owned[idx(r)].size()));
  if (out.pages_needed > n_ep) {
    out.ok = out.holds = false;
    out.reason = "EP view cannot hold the live KV: an owner needs " +
                 std::to_string(out.pages_needed) + " EP pages but has " + std::to_string(n_ep);
    return out;
  }
  for (size_t k = 0;; ++k) {
    bool any = false;
    for (int r = 0; r < P; ++r) {
      if (k < owned[idx(r)].size()) {
        any = true;
        const int64_t l = owned[idx(r)][k];
        item_of[idx(r) * idx(n_tp) + idx(l)] = static_cast<int64_t>(items.size());
        items.push_back({r, l, tp_of[idx(r) * idx(n_tp) + idx(l)]});
      }
    }
    if (!any) break;
  }
  res.stats.pages_moved = static_cast<int64_t>(items.size());

  // Page states per rank: 0 free, 1 live TP piece, 2 part of an EP page being built.
  std::vector<uint8_t> state(idx(P) * idx(n_tp), 0);
  std::vector<int64_t> gfree(idx(P) * idx(n_ep), split);  // free pieces per aligned group
  std::vector<std::vector<int64_t>> cand(idx(P));         // groups that may be wholly free
  for (int r = 0; r < P; ++r) {
    for (int64_t t = 0; t < n_tp; ++t) {
      if (l_of[idx(r) * idx(n_tp) + idx(t)] >= 0) {
        state[idx(r) * idx(n_tp) + idx(t)] = 1;
        --gfree[idx(r) * idx(n_ep) + idx(t / split)];
      }
    }
    for (int64_t q = n_ep - 1; q >= 0; --q)
      if (gfree[idx(r) * idx(n_ep) + idx(q)] == split) cand[idx(r)].push_back(q);
  }
  auto st = [&](int r, int64_t t) -> uint8_t& { return state[idx(r) * idx(n_tp) + idx(t)]; };
  auto gf = [&](int r, int64_t q) -> int64_t& { return gfree[idx(r) * idx(n_ep) + idx(q)]; };
  auto take_group = [&](int r, int64_t q) {
    for (int64_t j = 0; j < split; ++j) st(r, q * split + j) = 2;
    gf(r, q) = 0;
  };
  auto pop_group = [&](int r) -> int64_t {
    std::vector<int64_t>& c = cand[idx(r)];
    while (!c.empty()) {
      const int64_t q = c.back();
      c.pop_back();
      if (gf(r, q) == split) return q;
    }
    return -1;
  };
  auto free_page = [&](int r, int64_t t, std::vector<int64_t>& newly) {
    st(r, t) = 0;
    l_of[idx(r) * idx(n_tp) + idx(t)] = -1;
    if (++gf(r, t / split) == split) newly.push_back(t / split);
  };
  // Slice j of a page for owner o comes from o itself when o holds slice j, else from the
  // replica of j that spreads owners over replicas.
  auto src_rank = [&](int64_t j, int o) {
    return g.tp_slice_of_rank(o) == j ? o : static_cast<int>(j * reps + o % reps);
  };

  std::vector<std::vector<int64_t>> stage_free(idx(P));
  for (int r = 0; r < P; ++r)
    for (int64_t z = num_slots - 1; z >= 0; --z) stage_free[idx(r)].push_back(z);
  std::vector<std::vector<std::pair<int64_t, int64_t>>> staged(idx(P));
  std::vector<int64_t> rem(items.size());
  std::iota(rem.begin(), rem.end(), int64_t{0});
  std::vector<int64_t> pending(idx(P), 0);
  for (const item& m : items) ++pending[idx(m.owner)];
  bool any_staged = false;

  while (!rem.empty() || any_staged) {
    if (res.stats.rounds >= opt.max_rounds) {
      out.ok = false;
      out.reason = "TP->EP needs more than max_rounds=" + std::to_string(opt.max_rounds) +
                   " rounds";
      return out;
    }
    plan_phase ph;
    em.ops = &ph.ops;
    bool progress = false;
    std::vector<int64_t> done;
    std::vector<std::pair<int, int64_t>> freed_slots;
    // Drain staged EP pages into wholly free groups.
    any_staged = false;
    for (int r = 0; r < P; ++r) {
      std::vector<std::pair<int64_t, int64_t>> kept;
      for (const auto& [it, slot] : staged[idx(r)]) {
        const int64_t q = pop_group(r);
        if (q < 0) {
          kept.emplace_back(it, slot);
          continue;
        }
        take_group(r, q);
        em.whole(parallel_mode::ep, em.stage(parallel_mode::ep, r, slot),
                 em.pool(parallel_mode::ep, r, q));
        items[idx(it)].ep_page = q;
        freed_slots.emplace_back(r, slot);
        --pending[idx(r)];
        progress = true;
      }
      staged[idx(r)] = std::move(kept);
    }
    // Gather pages whose owner has a free aligned group (or its own piece in place, or a
    // staging slot).
    std::vector<int64_t> next;
    // Owners with no free group and no staging slot left this round: only in-place remains.
    std::vector<uint8_t> exhausted(idx(P), 0);
    for (int64_t it : rem) {
      item& m = items[idx(it)];
      const int o = m.owner;
      if (exhausted[idx(o)] && !keeps_in_place) {
        next.push_back(it);
        continue;
      }
      const int64_t own = g.tp_slice_of_rank(o);
      const int64_t t = m.t_own;
      const int64_t tq = t / split;
      int64_t q = -1, slot = -1;
      if (keeps_in_place && t - tq * split == own && gf(o, tq) == split - 1) {
        q = tq;
        m.in_place = true;
      } else if (!exhausted[idx(o)]) {
        if ((q = pop_group(o)) < 0 && !stage_free[idx(o)].empty()) {
          slot = stage_free[idx(o)].back();
          stage_free[idx(o)].pop_back();
        }
      }
      if (q < 0 && slot < 0) {
        exhausted[idx(o)] = 1;
        next.push_back(it);
        continue;
      }
      page_ref dref;
      if (q >= 0) {
        take_group(o, q);
        m.ep_page = q;
        dref = em.pool(parallel_mode::ep, o, q);
        --pending[idx(o)];
      } else {
        dref = em.stage(parallel_mode::ep, o, slot);
        staged[idx(o)].emplace_back(it, slot);
        ++res.stats.pages_staged;
      }
      for (int64_t j = 0; j < split; ++j) {
        if (m.in_place && j == own) continue;
        const int sr = src_rank(j, o);
        em.slice(dref, j, em.pool(parallel_mode::tp, sr, tp_of[idx(sr) * idx(n_tp) + idx(m.l)]),
                 false);
      }
      if (m.in_place) ++res.stats.pages_in_place;
      done.push_back(it);
      progress = true;
    }
    rem = std::move(next);
    // Stuck: compact. On each owner still waiting, move the live pieces of the least-used
    // groups into free pages of other groups so whole groups come free next round.
    std::vector<std::pair<int, int64_t>> compacted;  // (rank, old page) freed after the phase
    if (!progress) {
      for (int o = 0; o < P; ++o) {
        if (pending[idx(o)] == 0) continue;
        int64_t total_free = 0;
        for (int64_t q = 0; q < n_ep; ++q) total_free += gf(o, q);
        const int64_t k_max = std::min(total_free / split, pending[idx(o)]);
        if (k_max == 0) continue;
        std::vector<std::pair<int64_t, int64_t>> movable;  // (live pieces, group)
        for (int64_t q = 0; q < n_ep; ++q) {
          if (gf(o, q) == 0 || gf(o, q) == split) continue;
          bool ok = true;
          for (int64_t j = 0; j < split && ok; ++j) ok = st(o, q * split + j) != 2;
          if (ok) movable.emplace_back(split - gf(o, q), q);
        }
        std::sort(movable.begin(), movable.end());
        if (static_cast<int64_t>(movable.size()) > k_max) movable.resize(idx(k_max));
        std::vector<uint8_t> chosen(idx(n_ep), 0);
        for (const auto& mv : movable) chosen[idx(mv.second)] = 1;
        // Destinations: free pieces of unchosen groups, fullest groups first.
        std::vector<std::pair<int64_t, int64_t>> dest_groups;  // (free pieces, group)
        for (int64_t q = 0; q < n_ep; ++q)
          if (!chosen[idx(q)] && gf(o, q) > 0) dest_groups.emplace_back(gf(o, q), q);
        std::sort(dest_groups.begin(), dest_groups.end());
        std::vector<int64_t> dests;
        for (const auto& dg : dest_groups)
          for (int64_t j = 0; j < split; ++j)
            if (st(o, dg.second * split + j) == 0) dests.push_back(dg.second * split + j);
        size_t next_dest = 0;
        for (const auto& mv : movable) {
          for (int64_t j = 0; j < split; ++j) {
            const int64_t t = mv.second * split + j;
            if (st(o, t) != 1) continue;
            MOEBIUS_CHECK(next_dest < dests.size(), errc::internal,
                          "KV compaction ran out of free pages on rank ", o);
            const int64_t d = dests[next_dest++];
            em.whole(parallel_mode::tp, em.pool(parallel_mode::tp, o, t),
                     em.pool(parallel_mode::tp, o, d));
            const int64_t l = l_of[idx(o) * idx(n_tp) + idx(t)];
            tp_of[idx(o) * idx(n_tp) + idx(l)] = d;
            if (const int64_t ii = item_of[idx(o) * idx(n_tp) + idx(l)]; ii >= 0)
              items[idx(ii)].t_own = d;
            l_of[idx(o) * idx(n_tp) + idx(d)] = l;
            st(o, d) = 1;
            --gf(o, d / split);
            st(o, t) = 3;  // moving out: neither live nor free until the barrier
            compacted.emplace_back(o, t);
            ++res.stats.pages_compacted;
            progress = true;
          }
        }
      }
    }
    if (!progress) {
      out.ok = false;
      std::ostringstream why;
      why << "TP->EP is stuck after " << res.stats.rounds << " rounds with " << rem.size()
          << " pages left: no owner has a free aligned group of " << split
          << " TP pages, none can compact one, and no staging slot is free; lend a staging "
             "region (" << kv_staging_slot_bytes(g, parallel_mode::ep) << " bytes per slot)";
      out.reason = why.str();
      return out;
    }
    // After the barrier: compaction sources, finished logical pages and drained slots free up.
    std::vector<std::vector<int64_t>> newly(idx(P));
    for (const auto& [o, t] : compacted) {
      st(o, t) = 0;
      if (++gf(o, t / split) == split) newly[idx(o)].push_back(t / split);
    }
    for (int64_t it : done) {
      const int64_t l = items[idx(it)].l;
      if (--refs[idx(l)] > 0) continue;
      const int o_last = items[idx(it)].owner;
      for (int r = 0; r < P; ++r) {
        const int64_t ri = item_of[idx(r) * idx(n_tp) + idx(l)];
        if (ri >= 0 && items[idx(ri)].in_place) continue;  // now part of r's EP page
        const int64_t t = tp_of[idx(r) * idx(n_tp) + idx(l)];
        // A replica this round did not read is freed unread: tell rollback how to rebuild it
        // (from the replica that was read, which the undo of this phase restores first).
        const int sr = src_rank(g.tp_slice_of_rank(r), o_last);
        if (sr != r) {
          std::vector<copy_op>* keep = em.ops;
          em.ops = &ph.restores;
          const int64_t b = em.bytes;
          em.whole(parallel_mode::tp, em.pool(parallel_mode::tp, sr, tp_of[idx(sr) * idx(n_tp) + idx(l)]),
                   em.pool(parallel_mode::tp, r, t));
          em.bytes = b;
          em.ops = keep;
        }
        free_page(r, t, newly[idx(r)]);
      }
    }
    for (const auto& [r, z] : freed_slots) stage_free[idx(r)].push_back(z);
    for (int r = 0; r < P; ++r) {
      for (auto q = newly[idx(r)].rbegin(); q != newly[idx(r)].rend(); ++q)
        cand[idx(r)].push_back(*q);
      if (!staged[idx(r)].empty()) any_staged = true;
    }
    if (!ph.ops.empty() || !ph.restores.empty()) {
      ph.label = "KV TP->EP round " + std::to_string(res.stats.rounds);
      res.copies.phases.push_back(std::move(ph));
      ++res.stats.rounds;
    }
  }
  res.stats.bytes_copied = em.bytes;

  // New tables: each owner's sequences over its EP pages; free = wholly free groups.
  res.new_state.mode = parallel_mode::ep;
  res.new_state.ranks.resize(idx(P));
  for (size_t i = 0; i < seqs.size(); ++i) {
    const int o = pl->owner[i];
    kv_sequence q = seqs[i];
    for (int64_t& p : q.pages) p = items[idx(item_of[idx(o) * idx(n_tp) + idx(p)])].ep_page;
    res.new_state.ranks[idx(o)].sequences.push_back(std::move(q));
  }
  for (int r = 0; r < P; ++r)
    for (int64_t q = 0; q < n_ep; ++q)
      if (gf(r, q) == split) res.new_state.ranks[idx(r)].free_pages.push_back(q);
  return out;
}

outcome run(const kv_geometry& g, const kv_state& s, parallel_mode target,
            const kv_migration_options& opt) {
  validate(g, s);
  MOEBIUS_CHECK(opt.max_rounds >= 1, errc::invalid_argument, "max_rounds must be >= 1 (max_rounds=",
                opt.max_rounds, ")");
  if (s.mode == target) {
    outcome out;
    out.result.copies.num_ranks = g.num_ranks;
    out.result.new_state = s;
    out.pages_available = g.num_pages(target);
    for (int r = 0; r < g.num_ranks; ++r)
      out.pages_needed = std::max(out.pages_needed, used_pages(g, s, r));
    return out;
  }
  return target == parallel_mode::tp ? ep_to_tp(g, s, opt) : tp_to_ep(g, s, opt);
}

}  // namespace

int64_t kv_staging_slot_bytes(const kv_geometry& g, parallel_mode target) {
  return g.num_tensors() * g.page_bytes(target);
}

kv_capacity_report check_kv_capacity(const kv_geometry& g, const kv_state& s,
                                     parallel_mode target, const kv_migration_options& opt) {
  const outcome o = run(g, s, target, opt);
  kv_capacity_report rep;
  rep.fits = o.ok;
  rep.holds = o.holds;
  rep.rounds = o.ok ? o.result.stats.rounds : 0;
  rep.pages_needed = o.pages_needed;
  rep.pages_available = o.pages_available;
  rep.reason = o.reason;
  return rep;
}

kv_migration plan_kv_migration(const kv_geometry& g, const kv_state& s, parallel_mode target,
                               const kv_migration_options& opt) {
  outcome o = run(g, s, target, opt);
  MOEBIUS_CHECK(o.ok, errc::capacity, "KV migration ", to_string(s.mode), "->",
                to_string(target), " impossible: ", o.reason);
  return std::move(o.result);
}

std::ostream& operator<<(std::ostream& os, const kv_migration_stats& s) {
  return os << "rounds=" << s.rounds << " pages_moved=" << s.pages_moved
            << " in_place=" << s.pages_in_place << " staged=" << s.pages_staged
            << " compacted=" << s.pages_compacted << " bytes=" << s.bytes_copied
            << " imbalance=" << s.imbalance;
}

}  // namespace moebius
