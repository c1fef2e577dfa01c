#include "moebius/plan/plan.hpp"

#include <algorithm>
#include <numeric>
#include <ostream>
#include <sstream>
#include <vector>

#include "moebius/detail/checked_math.hpp"
#include "moebius/error.hpp"

namespace moebius {

std::ostream& operator<<(std::ostream& os, const copy_op& op) {
  os << op.src_rank << "->" << op.dst_rank << ' ' << to_string(op.src_space) << '['
     << op.src_offset;
  if (op.rows > 1) os << " +" << op.rows << 'x' << op.row_bytes << '/' << op.src_pitch;
  else os << " +" << op.row_bytes;
  os << "] -> " << to_string(op.dst_space) << '[' << op.dst_offset;
  if (op.rows > 1) os << " +" << op.rows << 'x' << op.row_bytes << '/' << op.dst_pitch;
  else os << " +" << op.row_bytes;
  return os << ']';
}

namespace {

// One 64-bit mixing step (splitmix64's finaliser over the running state and the value), so
// that a change in any field flips about half of the result's bits.
uint64_t mix(uint64_t h, uint64_t v) {
  uint64_t x = h ^ (v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2));
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

uint64_t mix_op(uint64_t h, const copy_op& op) {
  h = mix(h, static_cast<uint64_t>(op.src_offset));
  h = mix(h, static_cast<uint64_t>(op.dst_offset));
  h = mix(h, static_cast<uint64_t>(op.rows));
  h = mix(h, static_cast<uint64_t>(op.row_bytes));
  h = mix(h, static_cast<uint64_t>(op.src_pitch));
  h = mix(h, static_cast<uint64_t>(op.dst_pitch));
  h = mix(h, (static_cast<uint64_t>(static_cast<uint32_t>(op.src_rank)) << 32) |
                 static_cast<uint32_t>(op.dst_rank));
  return mix(h, (static_cast<uint64_t>(op.src_space) << 8) | static_cast<uint64_t>(op.dst_space));
}

// Mixes up to 16 ops of `ops` spread evenly, the first and the last included.
uint64_t mix_sampled(uint64_t h, const std::vector<copy_op>& ops) {
  constexpr size_t k_samples = 16;
  const size_t n = ops.size();
  h = mix(h, n);
  if (n == 0) return h;
  const size_t count = std::min(n, k_samples);
  for (size_t i = 0; i < count; ++i) {
    h = mix_op(h, ops[count == 1 ? 0 : i * (n - 1) / (count - 1)]);
  }
  return h;
}

}  // namespace

uint64_t fingerprint_of(const plan& p) {
  uint64_t h = mix(0, static_cast<uint64_t>(static_cast<uint32_t>(p.num_ranks)));
  h = mix(h, p.phases.size());
  for (const plan_phase& ph : p.phases) {
    h = mix(h, ph.label.size());
    h = mix_sampled(h, ph.ops);
    h = mix_sampled(h, ph.restores);
  }
  return h;
}

uint64_t hash_of(const plan& p) {
  uint64_t h = mix(0, static_cast<uint64_t>(static_cast<uint32_t>(p.num_ranks)));
  h = mix(h, p.phases.size());
  for (const plan_phase& ph : p.phases) {
    // Lengths separate the sequences, so ops cannot shift between phases or lists unseen.
    h = mix(h, ph.label.size());
    for (const char c : ph.label) h = mix(h, static_cast<unsigned char>(c));
    h = mix(h, ph.ops.size());
    for (const copy_op& op : ph.ops) h = mix_op(h, op);
    h = mix(h, ph.restores.size());
    for (const copy_op& op : ph.restores) h = mix_op(h, op);
  }
  return h;
}

int64_t plan::num_ops() const {
  int64_t n = 0;
  for (const plan_phase& ph : phases) n += static_cast<int64_t>(ph.ops.size());
  return n;
}

int64_t plan_traffic::max_bytes_sent() const {
  return bytes_sent.empty() ? 0 : *std::max_element(bytes_sent.begin(), bytes_sent.end());
}

int64_t plan_traffic::total_bytes_sent() const {
  return std::accumulate(bytes_sent.begin(), bytes_sent.end(), int64_t{0});
}

plan_traffic traffic_of(const plan& p) {
  plan_traffic t;
  const auto P = static_cast<size_t>(std::max(p.num_ranks, 0));
  t.bytes_sent.assign(P, 0);
  t.bytes_received.assign(P, 0);
  t.bytes_local.assign(P, 0);
  for (size_t k = 0; k < p.phases.size(); ++k) {
    const std::vector<copy_op>& ops = p.phases[k].ops;
    for (size_t i = 0; i < ops.size(); ++i) {
      const copy_op& op = ops[i];
      // The per-rank tables are indexed by rank: an unvalidated plan must not index past them.
      MOEBIUS_CHECK(op.src_rank >= 0 && op.src_rank < p.num_ranks && op.dst_rank >= 0 &&
                        op.dst_rank < p.num_ranks,
                    errc::invalid_argument, "traffic_of: op ", i, " of phase ", k,
                    " names a rank outside [0, ", p.num_ranks, "): ", op);
      ++t.num_ops;
      const int64_t bytes = detail::checked_mul(op.rows, op.row_bytes, "traffic_of op bytes");
      auto add = [&](std::vector<int64_t>& to, int32_t rank) {
        int64_t& sum = to[static_cast<size_t>(rank)];
        sum = detail::checked_add(sum, bytes, "traffic_of bytes per rank");
      };
      if (op.is_local()) {
        add(t.bytes_local, op.src_rank);
      } else {
        ++t.num_remote_ops;
        add(t.bytes_sent, op.src_rank);
        add(t.bytes_received, op.dst_rank);
      }
    }
  }
  return t;
}

namespace {

// One past the last byte `rows` rows of `row_bytes` at `pitch` touch, checked.
int64_t checked_end(int64_t offset, int64_t rows, int64_t row_bytes, int64_t pitch) {
  const int64_t span = detail::checked_add(
      detail::checked_mul(rows - 1, pitch, "copy op extent"), row_bytes, "copy op extent");
  return detail::checked_add(offset, span, "copy op end");
}

}  // namespace

void validate(const plan& p, const int64_t (&space_bytes)[num_memory_spaces]) {
  MOEBIUS_CHECK(p.num_ranks >= 1, errc::invalid_argument,
                "plan must have num_ranks >= 1 (num_ranks=", p.num_ranks, ")");
  for (size_t k = 0; k < p.phases.size(); ++k) {
    const std::vector<copy_op>& ops = p.phases[k].ops;
    for (size_t i = 0; i < ops.size(); ++i) {
      const copy_op& op = ops[i];
      MOEBIUS_CHECK(op.src_rank >= 0 && op.src_rank < p.num_ranks && op.dst_rank >= 0 &&
                        op.dst_rank < p.num_ranks,
                    errc::invalid_argument, "op ", i, " of phase ", k, " names a rank outside [0, ",
                    p.num_ranks, "): ", op);
      MOEBIUS_CHECK(is_valid(op.src_space) && is_valid(op.dst_space), errc::invalid_argument,
                    "op ", i, " of phase ", k, " names an out-of-range memory_space (src ",
                    static_cast<int>(op.src_space), ", dst ", static_cast<int>(op.dst_space), ")");
      MOEBIUS_CHECK(op.rows >= 1 && op.row_bytes >= 1, errc::invalid_argument, "op ", i,
                    " of phase ", k, " must have rows >= 1 and row_bytes >= 1: ", op);
      MOEBIUS_CHECK(op.rows == 1 || (op.dst_pitch >= op.row_bytes && op.src_pitch >= 0),
                    errc::invalid_argument, "op ", i, " of phase ", k,
                    " must have dst_pitch >= row_bytes and src_pitch >= 0: ", op);
      MOEBIUS_CHECK(op.src_offset >= 0 && op.dst_offset >= 0, errc::out_of_range, "op ", i,
                    " of phase ", k, " has a negative offset: ", op);
      const int64_t src_end = checked_end(op.src_offset, op.rows, op.row_bytes, op.src_pitch);
      const int64_t dst_end = checked_end(op.dst_offset, op.rows, op.row_bytes, op.dst_pitch);
      const int64_t src_cap = space_bytes[static_cast<int>(op.src_space)];
      const int64_t dst_cap = space_bytes[static_cast<int>(op.dst_space)];
      MOEBIUS_CHECK(src_end <= src_cap, errc::out_of_range, "op ", i, " of phase ", k,
                    " reads up to byte ", src_end, " of ", to_string(op.src_space), " (", src_cap,
                    " bytes): ", op);
      MOEBIUS_CHECK(dst_end <= dst_cap, errc::out_of_range, "op ", i, " of phase ", k,
                    " writes up to byte ", dst_end, " of ", to_string(op.dst_space), " (", dst_cap,
                    " bytes): ", op);
    }
  }
}

void print(std::ostream& os, const plan& p, bool print_ops) {
  const plan_traffic t = traffic_of(p);
  os << "plan: " << p.num_ranks << " ranks, " << p.phases.size() << " phases, " << t.num_ops
     << " ops (" << t.num_remote_ops << " remote), max " << t.max_bytes_sent()
     << " bytes sent by one rank\n";
  for (size_t k = 0; k < p.phases.size(); ++k) {
    const plan_phase& ph = p.phases[k];
    int64_t bytes = 0;
    for (const copy_op& op : ph.ops) bytes += op.bytes();
    os << "  phase " << k << " '" << ph.label << "': " << ph.ops.size() << " ops, " << bytes
       << " bytes\n";
    if (print_ops) {
      for (const copy_op& op : ph.ops) os << "    " << op << '\n';
    }
  }
}

std::ostream& operator<<(std::ostream& os, const plan& p) {
  print(os, p, false);
  return os;
}

std::string find_phase_hazard(const plan& p) {
  struct span {
    int rank;
    memory_space space;
    int64_t begin, end;
    bool is_dst;
    size_t op;
  };
  std::vector<span> spans;
  for (size_t k = 0; k < p.phases.size(); ++k) {
    const std::vector<copy_op>& ops = p.phases[k].ops;
    spans.clear();
    for (size_t i = 0; i < ops.size(); ++i) {
      const copy_op& c = ops[i];
      for (int64_t row = 0; row < c.rows; ++row) {
        spans.push_back({c.src_rank, c.src_space, c.src_offset + row * c.src_pitch,
                         c.src_offset + row * c.src_pitch + c.row_bytes, false, i});
        spans.push_back({c.dst_rank, c.dst_space, c.dst_offset + row * c.dst_pitch,
                         c.dst_offset + row * c.dst_pitch + c.row_bytes, true, i});
      }
    }
    std::sort(spans.begin(), spans.end(), [](const span& a, const span& b) {
      if (a.rank != b.rank) return a.rank < b.rank;
      if (a.space != b.space) return a.space < b.space;
      return a.begin < b.begin;
    });
    // Sweep: a destination may overlap nothing earlier; a source no earlier destination.
    const span* max_any = nullptr;
    const span* max_dst = nullptr;
    for (size_t i = 0; i < spans.size(); ++i) {
      const span& sp = spans[i];
      if (i > 0 && (spans[i - 1].rank != sp.rank || spans[i - 1].space != sp.space)) {
        max_any = max_dst = nullptr;
      }
      const span* clash = nullptr;
      if (sp.is_dst && max_any && max_any->end > sp.begin) clash = max_any;
      if (!sp.is_dst && max_dst && max_dst->end > sp.begin) clash = max_dst;
      if (clash) {
        std::ostringstream os;
        os << "phase " << k << " ('" << p.phases[k].label << "'): op " << sp.op << " ("
           << ops[sp.op] << ") " << (sp.is_dst ? "writes" : "reads") << " bytes that op "
           << clash->op << " (" << ops[clash->op] << ") " << (clash->is_dst ? "writes" : "reads")
           << " on rank " << sp.rank << ' ' << to_string(sp.space);
        return os.str();
      }
      if (!max_any || sp.end > max_any->end) max_any = &sp;
      if (sp.is_dst && (!max_dst || sp.end > max_dst->end)) max_dst = &sp;
    }
  }
  return "";
}

}  // namespace moebius
