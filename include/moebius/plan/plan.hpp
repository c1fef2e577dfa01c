#pragma once

// A plan: ordered phases of copy ops (DESIGN.md §2). A phase boundary is a barrier across all
// ranks; within a phase ops may run in any order and in parallel, so no destination of a
// phase overlaps another destination or any source of the same phase. Plans are data: the
// same plan runs on every transport, and can be printed, compared, cached and fuzzed.

#include <cstddef>
#include <cstdint>
#include <functional>
#include <iosfwd>
#include <string>
#include <vector>

#include "moebius/plan/copy_op.hpp"

namespace moebius {

struct plan_phase {
  std::string label;         // what the phase does, e.g. "layer 3 EP->TP"
  std::vector<copy_op> ops;  // ordered by source rank, then by (dst - src) mod P
  // Copies that re-create, when the phase is undone, bytes it freed without reading them
  // (a KV head slice replicated on several TP ranks is read from one replica; the others are
  // freed). Transports never run these; rollback_plan() runs them after undoing `ops`.
  std::vector<copy_op> restores{};

  friend bool operator==(const plan_phase&, const plan_phase&) = default;
};

struct plan {
  int num_ranks = 0;
  std::vector<plan_phase> phases;

  int64_t num_ops() const;

  friend bool operator==(const plan&, const plan&) = default;
};

// Bytes a plan moves, per rank.
struct plan_traffic {
  std::vector<int64_t> bytes_sent;      // leaving rank r for another rank
  std::vector<int64_t> bytes_received;  // arriving at rank r from another rank
  std::vector<int64_t> bytes_local;     // copied within rank r
  int64_t num_ops = 0;
  int64_t num_remote_ops = 0;

  int64_t max_bytes_sent() const;
  int64_t total_bytes_sent() const;
};

// Throws errc::invalid_argument when an op names a rank outside [0, num_ranks), errc::overflow
// when a byte count does not fit in 64 bits.
plan_traffic traffic_of(const plan& p);

// A 64-bit hash of everything operator== compares (ranks, and each phase's label, ops and
// restores): equal plans hash equal; plans that differ anywhere almost surely do not. O(ops),
// no allocation. std::hash<plan> uses it (an unordered container of plans).
uint64_t hash_of(const plan& p);

// A cheap key for caches that confirm every hit with operator==: the rank and phase counts,
// and per phase the label's length, the op and restore counts and up to 16 ops spread evenly
// (the first and the last included). O(phases), not O(ops): hash_of costs ~110 cycles an op,
// 1.2 ms for a 30k-op KV plan, which a cache lookup before every enqueue cannot afford; the
// equality check a hit needs anyway costs ~5 ns an op. Equal plans give equal fingerprints;
// plans that differ only in an unsampled op collide, and == tells them apart.
//   p: 1 phase of 1000 ops -> mixes ops 0, 66, 133, ..., 999
uint64_t fingerprint_of(const plan& p);

// Throws errc::invalid_argument or errc::out_of_range unless every op of `p` names ranks in
// [0, num_ranks) and memory spaces that exist, has rows >= 1, row_bytes >= 1, and when
// rows > 1 dst_pitch >= row_bytes and src_pitch >= 0 (source rows may overlap: a row read
// several times), and stays inside [0, space_bytes[space]) at both ends. Run by every transport before it moves
// the first byte, so a bad plan moves nothing.
void validate(const plan& p, const int64_t (&space_bytes)[num_memory_spaces]);

// "" when, in every phase of `p`, no destination byte range overlaps another destination or a
// source on the same rank and memory space (the rule every phase must keep, so that its ops
// may run in any order and in parallel); else the first hazard: the phase and the two ops.
// Exact, row by row: O(total rows * log). Call it on a plan that passed validate().
std::string find_phase_hazard(const plan& p);

// One line per phase ("phase 0 'layer 0 EP->TP': 12 ops, 3.0 MiB") then, with
// print_ops, one line per op.
void print(std::ostream& os, const plan& p, bool print_ops = false);
std::ostream& operator<<(std::ostream& os, const plan& p);

}  // namespace moebius

template <>
struct std::hash<moebius::plan> {
  size_t operator()(const moebius::plan& p) const noexcept {
    return static_cast<size_t>(moebius::hash_of(p));
  }
};
