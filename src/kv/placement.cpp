#include "moebius/kv/placement.hpp"

#include <algorithm>
#include <bit>
#include <limits>
#include <numeric>

#include "moebius/detail/checked_math.hpp"
#include "moebius/error.hpp"

namespace moebius {

namespace {

struct item {
  int64_t pages;    // pages the item needs on one owner
  int64_t min_seq;  // tie-break key
  int64_t group;    // share group, or -1 for a single sequence
  int64_t demand;   // single sequence: its demand index
};

// Least (load + cost) rank whose remaining capacity holds `cost(r)`; ties: lowest rank. -1 if none.
template <class Cost>
int best_rank(const std::vector<int64_t>& load, std::span<const int64_t> capacity, Cost cost) {
  int best = -1;
  int64_t best_after = std::numeric_limits<int64_t>::max();
  const int P = static_cast<int>(load.size());
  for (int r = 0; r < P; ++r) {
    int64_t after = 0;
    const bool wraps = __builtin_add_overflow(load[static_cast<size_t>(r)], cost(r), &after);
    const bool better = !wraps & (after <= capacity[static_cast<size_t>(r)]) & (after < best_after);
    best = better ? r : best;  // selects, not branches: the winner is unpredictable
    best_after = better ? after : best_after;
  }
  return best;
}

// Sorts by pages descending, then smallest seq id. The hot path (the engine's ids span a
// range of at most 8x the item count) packs both keys into one integer and radix-sorts it
// (8-bit digits, only the digits the keys use), several times faster than a comparator sort
// of the same order.
void sort_items(std::vector<item>& items) {
  if (items.size() < 2) return;
  int64_t lo = items[0].min_seq, hi = lo, max_pages = 0;
  for (const item& it : items) {
    lo = std::min(lo, it.min_seq);
    hi = std::max(hi, it.min_seq);
    max_pages = std::max(max_pages, it.pages);
  }
  const auto range = static_cast<uint64_t>(hi) - static_cast<uint64_t>(lo);
  const int range_bits = static_cast<int>(std::bit_width(range));
  const int page_bits = static_cast<int>(std::bit_width(static_cast<uint64_t>(max_pages)));
  auto comparator_sort = [&] {
    std::sort(items.begin(), items.end(), [](const item& a, const item& b) {
      return a.pages != b.pages ? a.pages > b.pages : a.min_seq < b.min_seq;
    });
  };
  if (range >= 8 * static_cast<uint64_t>(items.size()) + 64 || range_bits + page_bits > 64) {
    comparator_sort();
    return;
  }
  const size_t n = items.size();
  std::vector<uint64_t> keys(n), tmp(n);
  constexpr uint32_t no_item = ~uint32_t{0};
  std::vector<uint32_t> slot_of(static_cast<size_t>(range) + 1, no_item);
  for (size_t i = 0; i < n; ++i) {
    const auto off = static_cast<uint64_t>(items[i].min_seq) - static_cast<uint64_t>(lo);
    keys[i] = (static_cast<uint64_t>(max_pages - items[i].pages) << range_bits) | off;
    // The key names its item through the seq id: two items with one id (the caller's ids
    // repeat) would collapse into one, and the other would never be placed.
    if (slot_of[static_cast<size_t>(off)] != no_item) {
      comparator_sort();
      return;
    }
    slot_of[static_cast<size_t>(off)] = static_cast<uint32_t>(i);
  }
  for (int shift = 0; shift < range_bits + page_bits; shift += 8) {
    size_t count[257] = {};
    for (uint64_t k : keys) ++count[((k >> shift) & 0xFF) + 1];
    for (int b = 0; b < 256; ++b) count[b + 1] += count[b];
    for (uint64_t k : keys) tmp[count[(k >> shift) & 0xFF]++] = k;
    keys.swap(tmp);
  }
  const uint64_t mask = range_bits == 64 ? ~uint64_t{0} : (uint64_t{1} << range_bits) - 1;
  std::vector<item> sorted(n);
  for (size_t i = 0; i < n; ++i) sorted[i] = items[slot_of[static_cast<size_t>(keys[i] & mask)]];
  items.swap(sorted);
}

}  // namespace

kv_placement place_longest_first(std::span<const kv_demand> demands,
                                 std::span<const int64_t> group_shared_pages,
                                 std::span<const int64_t> capacity) {
  const auto num_groups = static_cast<int64_t>(group_shared_pages.size());
  const auto P = static_cast<int>(capacity.size());
  MOEBIUS_CHECK(P >= 1, errc::invalid_argument, "placement needs >= 1 rank of capacity");
  for (int r = 0; r < P; ++r) {
    MOEBIUS_CHECK(capacity[static_cast<size_t>(r)] >= 0, errc::invalid_argument,
                  "placement capacity of rank ", r, " is ", capacity[static_cast<size_t>(r)],
                  " < 0 pages");
  }
  kv_placement out;
  out.owner.assign(demands.size(), -1);
  out.load.assign(static_cast<size_t>(P), 0);

  // One item per share group (shared pages once + members' own pages), one per loner.
  std::vector<item> items;
  items.reserve(demands.size());
  std::vector<int64_t> group_item(static_cast<size_t>(num_groups), -1);
  for (size_t i = 0; i < demands.size(); ++i) {
    const kv_demand& d = demands[i];
    MOEBIUS_CHECK(d.own_pages >= 0, errc::invalid_argument, "demand of sequence ", d.seq_id,
                  " has own_pages ", d.own_pages, " < 0");
    MOEBIUS_CHECK(d.share_group >= -1 && d.share_group < num_groups, errc::invalid_argument,
                  "demand of sequence ", d.seq_id, " names share group ", d.share_group,
                  " outside [-1, ", num_groups, ")");
    if (d.share_group < 0) {
      items.push_back({d.own_pages, d.seq_id, -1, static_cast<int64_t>(i)});
      continue;
    }
    int64_t& gi = group_item[static_cast<size_t>(d.share_group)];
    if (gi < 0) {
      const int64_t shared = group_shared_pages[static_cast<size_t>(d.share_group)];
      MOEBIUS_CHECK(shared >= 0, errc::invalid_argument, "share group ", d.share_group,
                    " has ", shared, " < 0 shared pages");
      gi = static_cast<int64_t>(items.size());
      items.push_back({shared, d.seq_id, d.share_group, -1});
    }
    item& it = items[static_cast<size_t>(gi)];
    it.pages = detail::checked_add(it.pages, d.own_pages, "pages of a share group");
    it.min_seq = std::min(it.min_seq, d.seq_id);
  }
  sort_items(items);

  // Members of each group, CSR (counting sort by group).
  std::vector<int64_t> member_begin(static_cast<size_t>(num_groups) + 1, 0);
  std::vector<size_t> member_list;
  if (num_groups > 0) {
    for (const kv_demand& d : demands)
      if (d.share_group >= 0) ++member_begin[static_cast<size_t>(d.share_group) + 1];
    for (size_t k = 1; k < member_begin.size(); ++k) member_begin[k] += member_begin[k - 1];
    member_list.resize(static_cast<size_t>(member_begin.back()));
    std::vector<int64_t> fill(member_begin.begin(), member_begin.end() - 1);
    for (size_t i = 0; i < demands.size(); ++i)
      if (demands[i].share_group >= 0)
        member_list[static_cast<size_t>(fill[static_cast<size_t>(demands[i].share_group)]++)] = i;
  }
  bool fits = true;
  // Ranks kept sorted by (load, rank id): the first one that holds a whole item is the
  // least-loaded fitting rank, and re-sorting after a placement is a short bubble.
  std::vector<int> order(static_cast<size_t>(P));
  std::iota(order.begin(), order.end(), 0);
  auto before = [&](int a, int b) {
    const int64_t la = out.load[static_cast<size_t>(a)], lb = out.load[static_cast<size_t>(b)];
    return la < lb || (la == lb && a < b);
  };
  auto place_whole = [&](int64_t pages) {
    for (size_t i = 0; i < order.size(); ++i) {
      const int r = order[i];
      // load <= capacity always, so the room left never wraps (load + pages could).
      if (pages > capacity[static_cast<size_t>(r)] - out.load[static_cast<size_t>(r)]) continue;
      out.load[static_cast<size_t>(r)] += pages;
      size_t j = i;
      while (j + 1 < order.size() && before(order[j + 1], r)) {
        order[j] = order[j + 1];
        ++j;
      }
      order[j] = r;
      return r;
    }
    return -1;
  };
  for (const item& it : items) {
    const int r = place_whole(it.pages);
    if (r >= 0) {
      if (it.group < 0) {
        out.owner[static_cast<size_t>(it.demand)] = r;
      } else {
        for (int64_t i = member_begin[static_cast<size_t>(it.group)];
             i < member_begin[static_cast<size_t>(it.group) + 1]; ++i)
          out.owner[static_cast<size_t>(member_list[static_cast<size_t>(i)])] = r;
      }
      continue;
    }
    if (it.group < 0) {
      fits = false;
      continue;
    }
    // Split the group: members longest first; the shared pages are charged once per owner.
    ++out.split_groups;
    std::vector<size_t> mem(member_list.begin() + member_begin[static_cast<size_t>(it.group)],
                            member_list.begin() + member_begin[static_cast<size_t>(it.group) + 1]);
    std::sort(mem.begin(), mem.end(), [&](size_t a, size_t b) {
      return demands[a].own_pages != demands[b].own_pages
                 ? demands[a].own_pages > demands[b].own_pages
                 : demands[a].seq_id < demands[b].seq_id;
    });
    const int64_t shared = group_shared_pages[static_cast<size_t>(it.group)];
    std::vector<uint8_t> charged(static_cast<size_t>(P), 0);
    for (size_t i : mem) {
      auto cost = [&](int q) {
        return demands[i].own_pages + (charged[static_cast<size_t>(q)] ? 0 : shared);
      };
      const int q = best_rank(out.load, capacity, cost);
      if (q < 0) {
        fits = false;
        continue;
      }
      out.load[static_cast<size_t>(q)] += cost(q);
      charged[static_cast<size_t>(q)] = 1;
      out.owner[i] = q;
    }
    std::sort(order.begin(), order.end(), before);
  }
  out.fits = fits;
  // In double: each load is within its capacity, but P capacities near 2^63 sum past it.
  double total = 0.0;
  for (int64_t l : out.load) total += static_cast<double>(l);
  const int64_t max_load = *std::max_element(out.load.begin(), out.load.end());
  out.imbalance = total == 0.0 ? 0.0 : static_cast<double>(max_load) * P / total;
  return out;
}

void kv_demands_of(const kv_geometry& g, const kv_state& s, std::vector<kv_demand>& demands,
                   std::vector<int64_t>& group_shared_pages) {
  demands.clear();
  group_shared_pages.clear();
  // Page ids index the tables below: a state edited since it was built must not index past
  // them (a repeated page would also miscount the shared pages).
  validate(g, s);
  const std::vector<kv_sequence>& seqs = s.ranks[0].sequences;
  const int64_t num_pages = g.num_pages(s.mode);
  // With dcp > 1 ranks 0..dcp-1 each hold one DCP share of every sequence (the same sequences
  // in the same order: validate()); a shared page is (share, page id).
  const int64_t shares = s.mode == parallel_mode::tp ? g.dcp : 1;
  auto id_of = [&](int64_t share, int64_t p) { return static_cast<size_t>(share * num_pages + p); };
  auto for_shared = [&](size_t i, auto&& f) {  // f(page key) over q's shared pages, all shares
    for (int64_t k = 0; k < shares; ++k) {
      const kv_sequence& q = s.ranks[static_cast<size_t>(k)].sequences[i];
      const int64_t held = pages_held(g, s.mode, static_cast<int>(k), q.shared_prefix_pages);
      for (int64_t j = 0; j < held; ++j) f(id_of(k, q.pages[static_cast<size_t>(j)]));
    }
  };
  // Pages in shared prefixes used by >= 2 sequences link those sequences (union-find).
  std::vector<int32_t> count(static_cast<size_t>(shares * num_pages), 0);
  std::vector<int64_t> first(static_cast<size_t>(shares * num_pages), -1);
  std::vector<int64_t> parent(seqs.size());
  std::iota(parent.begin(), parent.end(), int64_t{0});
  auto find = [&](int64_t x) {
    while (parent[static_cast<size_t>(x)] != x) {
      parent[static_cast<size_t>(x)] = parent[static_cast<size_t>(parent[static_cast<size_t>(x)])];
      x = parent[static_cast<size_t>(x)];
    }
    return x;
  };
  bool any_shared = false;
  for (size_t i = 0; i < seqs.size(); ++i) {
    for_shared(i, [&](size_t p) {
      if (count[p]++ == 0) {
        first[p] = static_cast<int64_t>(i);
      } else {
        any_shared = true;
        const int64_t a = find(first[p]), b = find(static_cast<int64_t>(i));
        if (a != b) parent[static_cast<size_t>(std::max(a, b))] = std::min(a, b);
      }
    });
  }
  std::vector<int64_t> group_of_root(seqs.size(), -1);
  std::vector<int64_t> size_of_root(seqs.size(), 0);
  if (any_shared)
    for (size_t i = 0; i < seqs.size(); ++i) ++size_of_root[static_cast<size_t>(find(static_cast<int64_t>(i)))];
  demands.reserve(seqs.size());
  for (size_t i = 0; i < seqs.size(); ++i) {
    const kv_sequence& q = seqs[i];
    kv_demand d;
    d.seq_id = q.seq_id;
    int64_t shared = 0;
    for_shared(i, [&](size_t p) { shared += count[p] >= 2 ? 1 : 0; });
    d.own_pages = logical_pages(g, q) - shared;
    if (any_shared) {
      const auto root = static_cast<size_t>(find(static_cast<int64_t>(i)));
      if (size_of_root[root] >= 2) {
        if (group_of_root[root] < 0) {
          group_of_root[root] = static_cast<int64_t>(group_shared_pages.size());
          group_shared_pages.push_back(0);
        }
        d.share_group = group_of_root[root];
        // Count each shared page once, at its first user.
        for_shared(i, [&](size_t p) {
          if (count[p] >= 2 && first[p] == static_cast<int64_t>(i))
            ++group_shared_pages[static_cast<size_t>(d.share_group)];
        });
      }
    }
    demands.push_back(d);
  }
}

}  // namespace moebius
