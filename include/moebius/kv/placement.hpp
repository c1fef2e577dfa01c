#pragma once

// Longest-first placement of sequences onto ranks (DESIGN.md §4, TP->EP): each sequence gets
// one owner that will gather its KV into full EP pages.
//
// Sequences that share prefix pages form a share group, placed as ONE item (its shared pages
// counted once) so the shared pages stay single. When a group does not fit on any rank whole,
// its members are placed one by one and the group's shared pages are charged once per owner
// that receives a member (duplicated once per owner, never per sequence).
//
// Deterministic: items sorted by pages descending, then by smallest seq id; each goes to the
// least-loaded rank (ties: lowest rank id) among those whose remaining capacity holds it.
// O(n log n + n P). A device version must produce the same assignment (same sort keys, same
// tie rules), so the input is flat arrays.
//
//   capacity {10, 10}, sequences a=6, b=5, c=4 pages (no sharing):
//   a -> rank 0 (loads 0,0), b -> rank 1 (6,0), c -> rank 1 (6,5) -> loads {6, 9},
//   imbalance = 9 / 7.5 = 1.2.

#include <cstdint>
#include <span>
#include <vector>

#include "moebius/kv/kv_geometry.hpp"
#include "moebius/kv/page_table.hpp"

namespace moebius {

// What one sequence needs on its owner.
struct kv_demand {
  int64_t seq_id = 0;
  int64_t own_pages = 0;     // pages no other sequence uses
  int64_t share_group = -1;  // index into the group table, or -1 when it shares nothing
};

struct kv_placement {
  std::vector<int> owner;         // [num demands] owning rank, -1 when it did not fit
  std::vector<int64_t> load;      // [P] pages charged to each rank (shared pages once/owner)
  bool fits = false;              // every demand placed within capacity
  int64_t split_groups = 0;       // share groups that had to be split across owners
  double imbalance = 0.0;         // max load / mean load (1.0 = perfect; 0 when nothing placed)
};

// Places `demands` (any order) onto capacity.size() ranks; group_shared_pages[g] is the
// number of distinct shared pages of share group g. Never exceeds capacity[r]; demands that
// fit nowhere get owner -1 and fits = false. Throws errc::invalid_argument for a negative
// count or capacity or a share_group outside the table, errc::overflow when a share group's
// pages do not fit in 64 bits.
kv_placement place_longest_first(std::span<const kv_demand> demands,
                                 std::span<const int64_t> group_shared_pages,
                                 std::span<const int64_t> capacity);

// Demands of the sequences of a TP-mode state (rank 0's sequence order, which is seq id
// order), with share groups = connected components of sequences through shared page ids.
// With dcp > 1 a sequence's demand is its whole page count (an EP owner gathers every DCP
// share), and sharing is read on ranks 0..dcp-1, which hold one share each.
//   dcp 2, a 5-page sequence (3 pages on rank 0, 2 on rank 1), nothing shared: own_pages 5.
// Validates `s` first (validate(g, s)): errc::invalid_argument for an invalid state.
void kv_demands_of(const kv_geometry& g, const kv_state& s, std::vector<kv_demand>& demands,
                   std::vector<int64_t>& group_shared_pages);

}  // namespace moebius
