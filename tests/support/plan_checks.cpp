#include "support/plan_checks.hpp"

#include <algorithm>
#include <cstdint>
#include <sstream>
#include <vector>

namespace moebius::testing {

namespace {

struct interval {
  int64_t begin;
  int64_t end;
  bool is_dst;
  size_t op;
};

std::string describe(const plan& p, size_t phase, size_t op) {
  std::ostringstream os;
  os << "op " << op << " (" << p.phases[phase].ops[op] << ")";
  return os.str();
}

}  // namespace

std::string check_phase_disjoint(const plan& p) {
  const int P = p.num_ranks;
  for (size_t k = 0; k < p.phases.size(); ++k) {
    const std::vector<copy_op>& ops = p.phases[k].ops;
    // One interval list per (rank, space).
    std::vector<std::vector<interval>> lists(static_cast<size_t>(P) * num_memory_spaces);
    for (size_t i = 0; i < ops.size(); ++i) {
      const copy_op& op = ops[i];
      if (op.src_rank < 0 || op.src_rank >= P || op.dst_rank < 0 || op.dst_rank >= P) {
        return "phase " + std::to_string(k) + ": " + describe(p, k, i) + " names a bad rank";
      }
      if (op.row_bytes <= 0) continue;
      auto& src = lists[static_cast<size_t>(op.src_rank) * num_memory_spaces +
                        static_cast<size_t>(op.src_space)];
      auto& dst = lists[static_cast<size_t>(op.dst_rank) * num_memory_spaces +
                        static_cast<size_t>(op.dst_space)];
      for (int64_t j = 0; j < op.rows; ++j) {
        const int64_t s = op.src_offset + (op.rows > 1 ? j * op.src_pitch : 0);
        const int64_t d = op.dst_offset + (op.rows > 1 ? j * op.dst_pitch : 0);
        src.push_back({s, s + op.row_bytes, false, i});
        dst.push_back({d, d + op.row_bytes, true, i});
      }
    }
    for (size_t li = 0; li < lists.size(); ++li) {
      std::vector<interval>& v = lists[li];
      std::sort(v.begin(), v.end(), [](const interval& a, const interval& b) {
        return a.begin != b.begin ? a.begin < b.begin : a.is_dst > b.is_dst;
      });
      // Sweep: an interval overlaps an earlier-starting one iff it starts before the largest
      // end seen so far; track that end over all intervals and over destinations alone.
      int64_t max_end_all = INT64_MIN, max_end_dst = INT64_MIN;
      size_t arg_all = 0, arg_dst = 0;
      for (const interval& iv : v) {
        const bool clash_all = iv.is_dst && iv.begin < max_end_all;
        const bool clash_dst = !iv.is_dst && iv.begin < max_end_dst;
        if (clash_all || clash_dst) {
          std::ostringstream os;
          os << "phase " << k << " ('" << p.phases[k].label << "'), rank "
             << li / num_memory_spaces << ' '
             << to_string(static_cast<memory_space>(li % num_memory_spaces)) << ": "
             << (iv.is_dst ? "destination" : "source") << " bytes [" << iv.begin << ", "
             << iv.end << ") of " << describe(p, k, iv.op) << " overlap a destination of "
             << describe(p, k, clash_dst ? arg_dst : arg_all);
          return os.str();
        }
        if (iv.end > max_end_all) { max_end_all = iv.end; arg_all = iv.op; }
        if (iv.is_dst && iv.end > max_end_dst) { max_end_dst = iv.end; arg_dst = iv.op; }
      }
    }
  }
  return "";
}

namespace {

// Layers a switch from `from` to `to` moves and the mode they end in.
void moved_layers(arena_cursor from, arena_cursor to, int64_t& first, int64_t& last,
                  parallel_mode& target) {
  first = std::min(from.tp_layers, to.tp_layers);
  last = std::max(from.tp_layers, to.tp_layers);
  target = to.tp_layers > from.tp_layers ? parallel_mode::tp : parallel_mode::ep;
}

}  // namespace

std::string check_writes_exactly_once(const plan& p, const arena_geometry& g, arena_cursor from,
                                      arena_cursor to) {
  const int P = g.num_ranks;
  if (p.num_ranks != P) return "plan has " + std::to_string(p.num_ranks) + " ranks, expected " + std::to_string(P);
  const int64_t total = g.slot_bytes * (g.shape.num_layers + 1);
  std::vector<std::vector<uint8_t>> count(static_cast<size_t>(P),
                                          std::vector<uint8_t>(static_cast<size_t>(total), 0));
  for (size_t k = 0; k < p.phases.size(); ++k) {
    for (size_t i = 0; i < p.phases[k].ops.size(); ++i) {
      const copy_op& op = p.phases[k].ops[i];
      std::ostringstream os;
      os << "phase " << k << ' ' << describe(p, k, i);
      if (op.dst_space != memory_space::arena || op.src_space != memory_space::arena) {
        return os.str() + " leaves the arena";
      }
      if (op.dst_rank < 0 || op.dst_rank >= P) return os.str() + " names a bad rank";
      std::vector<uint8_t>& c = count[static_cast<size_t>(op.dst_rank)];
      for (int64_t j = 0; j < op.rows; ++j) {
        const int64_t d = op.dst_offset + (op.rows > 1 ? j * op.dst_pitch : 0);
        if (d < 0 || d + op.row_bytes > total) return os.str() + " writes outside the arena";
        for (int64_t b = d; b < d + op.row_bytes; ++b) {
          uint8_t& n = c[static_cast<size_t>(b)];
          if (n < 255) ++n;
        }
      }
    }
  }
  int64_t first = 0, last = 0;
  parallel_mode target = parallel_mode::ep;
  moved_layers(from, to, first, last, target);
  // Expected count per byte: 1 inside each target tensor of a moved layer, 0 elsewhere.
  std::vector<uint8_t> expected(static_cast<size_t>(total), 0);
  for (int64_t l = first; l < last; ++l) {
    const int64_t slot = target == parallel_mode::tp ? l : l + 1;
    for (int ti = 0; ti < num_weight_tensors; ++ti) {
      const int64_t b = slot * g.slot_bytes + g.tensor_offset[ti];
      std::fill_n(expected.begin() + b, g.tensor_bytes[ti], uint8_t{1});
    }
  }
  for (int r = 0; r < P; ++r) {
    const std::vector<uint8_t>& c = count[static_cast<size_t>(r)];
    for (int64_t b = 0; b < total; ++b) {
      if (c[static_cast<size_t>(b)] != expected[static_cast<size_t>(b)]) {
        std::ostringstream os;
        os << "rank " << r << " arena byte " << b << " (slot " << b / g.slot_bytes << ", slot byte "
           << b % g.slot_bytes << ") written " << int{c[static_cast<size_t>(b)]}
           << " times, expected " << int{expected[static_cast<size_t>(b)]};
        return os.str();
      }
    }
  }
  return "";
}

std::string check_traffic(const plan& p, const arena_geometry& g, arena_cursor from,
                          arena_cursor to) {
  const int P = g.num_ranks;
  if (p.num_ranks != P) return "plan has the wrong number of ranks";
  std::vector<int64_t> sent(static_cast<size_t>(P), 0), received(static_cast<size_t>(P), 0),
      local(static_cast<size_t>(P), 0);
  for (const plan_phase& ph : p.phases) {
    for (const copy_op& op : ph.ops) {
      const int64_t bytes = op.rows * op.row_bytes;
      if (op.src_rank == op.dst_rank) {
        local[static_cast<size_t>(op.src_rank)] += bytes;
      } else {
        sent[static_cast<size_t>(op.src_rank)] += bytes;
        received[static_cast<size_t>(op.dst_rank)] += bytes;
      }
    }
  }
  const int64_t moved = std::max(from.tp_layers, to.tp_layers) - std::min(from.tp_layers, to.tp_layers);
  int64_t layer_bytes = 0;
  for (int ti = 0; ti < num_weight_tensors; ++ti) layer_bytes += g.tensor_bytes[ti];
  const int64_t rank_bytes = layer_bytes * moved;
  if (rank_bytes % P != 0) return "a rank's moved bytes are not divisible by P";
  const int64_t want_local = rank_bytes / P, want_remote = rank_bytes - want_local;
  for (int r = 0; r < P; ++r) {
    const size_t i = static_cast<size_t>(r);
    if (sent[i] != want_remote || received[i] != want_remote || local[i] != want_local) {
      std::ostringstream os;
      os << "rank " << r << ": sent " << sent[i] << ", received " << received[i] << ", local "
         << local[i] << "; expected " << want_remote << ", " << want_remote << ", " << want_local
         << " (moved " << moved << " layers of " << layer_bytes << " B per rank, P=" << P << ")";
      return os.str();
    }
  }
  return "";
}

}  // namespace moebius::testing
