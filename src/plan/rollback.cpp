#include "moebius/plan/rollback.hpp"

#include <algorithm>
#include <iterator>
#include <limits>
#include <map>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "moebius/detail/checked_math.hpp"
#include "moebius/error.hpp"

namespace moebius {

namespace {

// Disjoint byte ranges [begin, end) of one memory space of one rank, merged on insertion.
class byte_ranges {
 public:
  bool covers(int64_t begin, int64_t end) const {
    auto it = ranges_.upper_bound(begin);
    if (it == ranges_.begin()) return false;
    --it;
    return it->second >= end;
  }
  bool overlaps(int64_t begin, int64_t end) const {
    auto it = ranges_.lower_bound(end);  // first range starting at or after `end`
    if (it == ranges_.begin()) return false;
    --it;
    return it->second > begin;
  }
  void insert(int64_t begin, int64_t end) {
    auto it = ranges_.upper_bound(begin);
    if (it != ranges_.begin() && std::prev(it)->second >= begin) {
      --it;
      begin = it->first;
      end = std::max(end, it->second);
      it = ranges_.erase(it);
    }
    while (it != ranges_.end() && it->first <= end) {
      end = std::max(end, it->second);
      it = ranges_.erase(it);
    }
    ranges_.emplace(begin, end);
  }

 private:
  std::map<int64_t, int64_t> ranges_;  // begin -> end
};

// The bytes an op writes, by (rank, space).
using written_bytes = std::map<std::pair<int, memory_space>, byte_ranges>;

// The destination bytes of an op as `rows` ranges of `bytes` bytes, `pitch` apart: the op's own
// rows, or one range when its rows are contiguous, or just its first row when the writes of its
// (rank, space) are row-aligned (below).
struct dst_walk {
  int64_t offset, rows, pitch, bytes;
};

dst_walk walk_of(const copy_op& op, bool row_aligned) {
  if (row_aligned || op.rows == 1) return {op.dst_offset, 1, op.dst_pitch, op.row_bytes};
  if (op.dst_pitch == op.row_bytes) {
    return {op.dst_offset, 1, 0, detail::checked_mul(op.rows, op.row_bytes, "undo op bytes")};
  }
  return {op.dst_offset, op.rows, op.dst_pitch, op.row_bytes};
}

// pred(begin, end) for every range of w; false as soon as one pred is false.
template <class Pred>
bool all_ranges(const dst_walk& w, Pred pred) {
  for (int64_t r = 0; r < w.rows; ++r) {
    const int64_t begin = w.offset + r * w.pitch;
    if (!pred(begin, begin + w.bytes)) return false;
  }
  return true;
}

int64_t saturating_add(int64_t a, int64_t b) {
  constexpr int64_t top = std::numeric_limits<int64_t>::max();
  return b > 0 && a > top - b ? top : a + b;
}

// The bytes an op's destination can touch, [first row, end of last row), saturated at
// INT64_MAX: a bound, used only to tell ops that cannot meet apart.
std::pair<int64_t, int64_t> dst_extent(const copy_op& op) {
  constexpr int64_t top = std::numeric_limits<int64_t>::max();
  const int64_t row = std::max<int64_t>(op.row_bytes, 0);
  int64_t span = row;
  if (op.rows > 1 && op.dst_pitch > 0) {
    const int64_t gaps = op.rows - 1;
    span = op.dst_pitch > (top - row) / gaps ? top : gaps * op.dst_pitch + row;
  }
  return {op.dst_offset, saturating_add(op.dst_offset, span)};
}

// Which ops' writes are row-aligned. The ops of one (rank, space) fall into clusters whose
// extents overlap (ops of different clusters cannot meet). A cluster is row-aligned when every
// op in it has the same rows and dst_pitch p and their first rows lie within p bytes. Then row
// r of one op can meet only row r of another, at the same relative offset as their first rows,
// so every question about the writes there (covered, overlapping) has the same answer for each
// row as for the first. An HND KV phase is one cluster like this (each op one page of every
// (layer, K|V) tensor: rows = tensors, pitch = region); an NHD one is a cluster per page and
// tensor (each op one head slice of every token: rows = page size, pitch = a token's heads).
// Deciding on first rows makes the undo O(ops log ops) where walking every row is
// O(ops * rows * log) (seen: 10 s for 160 ops of 65535 rows under the sanitizers).
std::vector<bool> row_aligned_ops(const plan_phase& phase) {
  struct extent {
    int64_t begin, end;
    size_t op;
  };
  std::map<std::pair<int, memory_space>, std::vector<extent>> by_key;
  for (size_t i = 0; i < phase.ops.size(); ++i) {
    const copy_op& op = phase.ops[i];
    const auto [begin, end] = dst_extent(op);
    by_key[{op.dst_rank, op.dst_space}].push_back({begin, end, i});
  }
  std::vector<bool> aligned(phase.ops.size(), false);
  for (auto& [key, extents] : by_key) {
    std::sort(extents.begin(), extents.end(),
              [](const extent& a, const extent& b) { return a.begin < b.begin; });
    for (size_t first = 0; first < extents.size();) {
      const copy_op& head = phase.ops[extents[first].op];
      int64_t cluster_end = extents[first].end;
      int64_t lo = head.dst_offset, hi = saturating_add(head.dst_offset, head.row_bytes);
      bool same_shape = true;
      size_t last = first + 1;
      for (; last < extents.size() && extents[last].begin < cluster_end; ++last) {
        const copy_op& op = phase.ops[extents[last].op];
        cluster_end = std::max(cluster_end, extents[last].end);
        same_shape = same_shape && op.rows == head.rows && op.dst_pitch == head.dst_pitch;
        lo = std::min(lo, op.dst_offset);
        hi = std::max(hi, saturating_add(op.dst_offset, op.row_bytes));
      }
      const bool cluster_aligned = same_shape && hi - lo <= head.dst_pitch;
      for (size_t k = first; k < last; ++k) aligned[extents[k].op] = cluster_aligned;
      first = last;
    }
  }
  return aligned;
}

// Ops of a forward phase that read overlapping source bytes (a page sent to several ranks, or
// a head slice of a page that is also copied whole) become undo ops whose destinations
// overlap. They all write the bytes the source held before the phase, so the result is right
// in any order, but a phase must not have overlapping destinations. An op whose destination
// other ops already write entirely is dropped; an op that overlaps them only in part goes to
// the first of a sequence of phases in which its destination overlaps nothing.
std::vector<plan_phase> without_overlapping_writes(plan_phase undo) {
  std::vector<size_t> order(undo.ops.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return undo.ops[a].bytes() > undo.ops[b].bytes();  // widest first: they cover the others
  });
  const std::vector<bool> aligned = row_aligned_ops(undo);
  written_bytes all;
  std::vector<written_bytes> part_writes;
  std::vector<int> part_of(undo.ops.size(), -1);  // -1: dropped
  for (size_t i : order) {
    const copy_op& op = undo.ops[i];
    const auto key = std::make_pair(op.dst_rank, op.dst_space);
    const dst_walk w = walk_of(op, aligned[i]);
    if (all_ranges(w, [&](int64_t b, int64_t e) { return all[key].covers(b, e); })) continue;
    size_t part = 0;
    while (part < part_writes.size() &&
           !all_ranges(w, [&](int64_t b, int64_t e) {
             return !part_writes[part][key].overlaps(b, e);
           })) {
      ++part;
    }
    if (part == part_writes.size()) part_writes.emplace_back();
    all_ranges(w, [&](int64_t b, int64_t e) {
      part_writes[part][key].insert(b, e);
      all[key].insert(b, e);
      return true;
    });
    part_of[i] = static_cast<int>(part);
  }
  std::vector<plan_phase> parts(std::max<size_t>(part_writes.size(), 1));
  for (size_t k = 0; k < parts.size(); ++k) {
    parts[k].label = k == 0 ? undo.label : undo.label + " (part " + std::to_string(k + 1) + ")";
  }
  for (size_t i = 0; i < undo.ops.size(); ++i) {  // keep the forward order within a phase
    if (part_of[i] >= 0) parts[static_cast<size_t>(part_of[i])].ops.push_back(undo.ops[i]);
  }
  return parts;
}

}  // namespace

plan rollback_plan(const plan& executed, int64_t completed_phases) {
  MOEBIUS_CHECK(completed_phases >= 0 &&
                    completed_phases <= static_cast<int64_t>(executed.phases.size()),
                errc::invalid_argument, "completed_phases must lie in [0, ",
                executed.phases.size(), "] (completed_phases=", completed_phases, ")");
  plan undo;
  undo.num_ranks = executed.num_ranks;
  undo.phases.reserve(static_cast<size_t>(completed_phases));
  for (int64_t k = completed_phases - 1; k >= 0; --k) {
    const plan_phase& ph = executed.phases[static_cast<size_t>(k)];
    plan_phase out;
    out.label = "undo " + ph.label;
    out.ops.reserve(ph.ops.size());
    for (const copy_op& op : ph.ops) {
      MOEBIUS_CHECK(op.src_rank >= 0 && op.src_rank < executed.num_ranks && op.dst_rank >= 0 &&
                        op.dst_rank < executed.num_ranks && is_valid(op.src_space) &&
                        is_valid(op.dst_space) && op.rows >= 1,
                    errc::invalid_argument, "cannot undo phase ", k, ": an op names a rank outside [0, ",
                    executed.num_ranks, "), an out-of-range memory_space or rows < 1: ", op);
      MOEBIUS_CHECK(op.rows == 1 || op.src_pitch >= op.row_bytes, errc::invalid_argument,
                    "cannot undo an op whose source rows overlap (src_pitch < row_bytes): ", op);
      copy_op inv = op;
      std::swap(inv.src_rank, inv.dst_rank);
      std::swap(inv.src_offset, inv.dst_offset);
      std::swap(inv.src_pitch, inv.dst_pitch);
      std::swap(inv.src_space, inv.dst_space);
      out.ops.push_back(inv);
    }
    for (plan_phase& part : without_overlapping_writes(std::move(out))) {
      undo.phases.push_back(std::move(part));
    }
    if (!ph.restores.empty()) {
      // They read what the undo above restored, so they need a phase of their own.
      undo.phases.push_back(plan_phase{"restore " + ph.label, ph.restores, {}});
    }
  }
  return undo;
}

}  // namespace moebius
