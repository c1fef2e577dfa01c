#include "moebius/kv/placement.hpp"

#include <algorithm>
#include <limits>
#include <numeric>

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
  for (int r = 0; r < static_cast<int>(load.size()); ++r) {
    const int64_t c = cost(r);
    const int64_t after = load[static_cast<size_t>(r)] + c;
    if (after <= capacity[static_cast<size_t>(r)] && after < best_after) {
      best = r;
      best_after = after;
    }
  }
  return best;
}

}  // namespace

kv_placement place_longest_first(std::span<const kv_demand> demands,
                                 std::span<const int64_t> group_shared_pages,
                                 std::span<const int64_t> capacity) {
  const auto num_groups = static_cast<int64_t>(group_shared_pages.size());
  const auto P = static_cast<int>(capacity.size());
  MOEBIUS_CHECK(P >= 1, errc::invalid_argument, "placement needs >= 1 rank of capacity");
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
    it.pages += d.own_pages;
    it.min_seq = std::min(it.min_seq, d.seq_id);
  }
  std::sort(items.begin(), items.end(), [](const item& a, const item& b) {
    return a.pages != b.pages ? a.pages > b.pages : a.min_seq < b.min_seq;
  });

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
  for (const item& it : items) {
    const int r = best_rank(out.load, capacity, [&](int) { return it.pages; });
    if (r >= 0) {
      out.load[static_cast<size_t>(r)] += it.pages;
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
  }
  out.fits = fits;
  const int64_t total = std::accumulate(out.load.begin(), out.load.end(), int64_t{0});
  const int64_t max_load = *std::max_element(out.load.begin(), out.load.end());
  out.imbalance = total == 0 ? 0.0
                             : static_cast<double>(max_load) * P / static_cast<double>(total);
  return out;
}

void kv_demands_of(const kv_geometry& g, const kv_state& s, std::vector<kv_demand>& demands,
                   std::vector<int64_t>& group_shared_pages) {
  demands.clear();
  group_shared_pages.clear();
  MOEBIUS_CHECK(!s.ranks.empty(), errc::invalid_argument, "kv_demands_of needs a state with ranks");
  const std::vector<kv_sequence>& seqs = s.ranks[0].sequences;
  const int64_t num_pages = g.num_pages(s.mode);
  // Pages in shared prefixes used by >= 2 sequences link those sequences (union-find).
  std::vector<int32_t> count(static_cast<size_t>(num_pages), 0);
  std::vector<int64_t> first(static_cast<size_t>(num_pages), -1);
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
    const kv_sequence& q = seqs[i];
    for (int64_t k = 0; k < q.shared_prefix_pages; ++k) {
      const auto p = static_cast<size_t>(q.pages[static_cast<size_t>(k)]);
      if (count[p]++ == 0) {
        first[p] = static_cast<int64_t>(i);
      } else {
        any_shared = true;
        const int64_t a = find(first[p]), b = find(static_cast<int64_t>(i));
        if (a != b) parent[static_cast<size_t>(std::max(a, b))] = std::min(a, b);
      }
    }
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
    for (int64_t k = 0; k < q.shared_prefix_pages; ++k)
      if (count[static_cast<size_t>(q.pages[static_cast<size_t>(k)])] >= 2) ++shared;
    d.own_pages = q.num_pages() - shared;
    if (any_shared) {
      const auto root = static_cast<size_t>(find(static_cast<int64_t>(i)));
      if (size_of_root[root] >= 2) {
        if (group_of_root[root] < 0) {
          group_of_root[root] = static_cast<int64_t>(group_shared_pages.size());
          group_shared_pages.push_back(0);
        }
        d.share_group = group_of_root[root];
        // Count each shared page once, at its first user.
        for (int64_t k = 0; k < q.shared_prefix_pages; ++k) {
          const auto p = static_cast<size_t>(q.pages[static_cast<size_t>(k)]);
          if (count[p] >= 2 && first[p] == static_cast<int64_t>(i))
            ++group_shared_pages[static_cast<size_t>(d.share_group)];
        }
      }
    }
    demands.push_back(d);
  }
}

}  // namespace moebius
