#pragma once

// Random plans that keep the phase rule of plan.hpp (no destination of a phase overlaps another
// destination or a source of that phase), for running the same plan through a transport under
// test and through host_transport and comparing every byte.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "moebius/plan/plan.hpp"
#include "support/random.hpp"

namespace moebius::testing {

struct random_plan_options {
  // Bytes of each memory space on every rank; a space of fewer than 128 bytes gets no op.
  int64_t space_bytes[num_memory_spaces] = {int64_t{1} << 16, int64_t{1} << 16};
  int min_phases = 1;
  int max_phases = 4;
  int max_ops_per_phase = 60;   // a phase may have 0 ops
  int64_t max_op_bytes = 4096;  // destination extent of one op, at most
  // Source rows may overlap (src_pitch < row_bytes, or 0: one row read again and again);
  // validate() allows it, copy engines cannot do it in one 2D call.
  bool overlapping_source_rows = true;
  // In about half the phases a random set of ranks neither sends nor receives.
  bool idle_ranks = true;
};

// Phase k writes only the half (k % 2) of each (rank, space) and reads only the other half, so
// phase k+1 reads what phase k wrote (the phase barrier matters) and no destination of a phase
// overlaps a source; destinations are bump-allocated in their half with random gaps, so they
// never overlap each other. Ops: any pair of ranks (local ones included), any pair of spaces,
// 1 byte up to max_op_bytes, odd offsets, pitches and row counts.
//   P = 2, spaces of 64 KiB: phase 0 might hold "1->0 kv_pool[40000 +7x100/0] -> arena[13 +7x100/117]"
inline plan random_hazard_free_plan(std::mt19937_64& rng, int num_ranks,
                                    const random_plan_options& o) {
  plan p;
  p.num_ranks = num_ranks;
  int64_t half[num_memory_spaces];
  std::vector<memory_space> usable;
  for (int s = 0; s < num_memory_spaces; ++s) {
    half[s] = o.space_bytes[s] / 2;
    if (half[s] >= 64) usable.push_back(static_cast<memory_space>(s));
  }
  const int num_phases = static_cast<int>(uniform(rng, o.min_phases, o.max_phases));
  for (int k = 0; k < num_phases; ++k) {
    plan_phase ph;
    ph.label = "random phase " + std::to_string(k);
    if (usable.empty()) {
      p.phases.push_back(std::move(ph));
      continue;
    }
    std::vector<int32_t> active;
    const bool some_idle = o.idle_ranks && num_ranks > 1 && coin(rng);
    for (int32_t r = 0; r < num_ranks; ++r) {
      if (!some_idle || uniform(rng, 0, 2) != 0) active.push_back(r);
    }
    if (active.empty()) active.push_back(static_cast<int32_t>(uniform(rng, 0, num_ranks - 1)));
    const auto any_active = [&] {
      return active[static_cast<size_t>(uniform(rng, 0, static_cast<int64_t>(active.size()) - 1))];
    };
    const auto any_space = [&] {
      return usable[static_cast<size_t>(uniform(rng, 0, static_cast<int64_t>(usable.size()) - 1))];
    };
    // Next free byte of the written half, per (rank, space).
    std::vector<int64_t> used(static_cast<size_t>(num_ranks * num_memory_spaces), 0);
    const int num_ops = static_cast<int>(uniform(rng, 0, o.max_ops_per_phase));
    for (int i = 0; i < num_ops; ++i) {
      copy_op op;
      op.src_rank = any_active();
      op.dst_rank = any_active();
      op.src_space = any_space();
      op.dst_space = any_space();
      const int64_t dst_half = half[static_cast<int>(op.dst_space)];
      const int64_t src_half = half[static_cast<int>(op.src_space)];
      int64_t& next = used[static_cast<size_t>(op.dst_rank * num_memory_spaces +
                                               static_cast<int>(op.dst_space))];
      const int64_t room = dst_half - next;
      if (room < 48) continue;
      const int64_t budget = std::min({room - 16, o.max_op_bytes, src_half});
      // Shape: one contiguous row, a few large rows, or many small rows.
      const int kind = static_cast<int>(uniform(rng, 0, 2));
      if (kind == 0) {
        op.rows = 1;
        op.row_bytes = uniform(rng, 1, budget);
        op.src_pitch = op.dst_pitch = op.row_bytes;
      } else {
        op.row_bytes = uniform(rng, 1, kind == 1 ? std::max<int64_t>(1, budget / 2)
                                                 : std::min<int64_t>(budget, 300));
        op.dst_pitch = op.row_bytes + uniform(rng, 0, 37);
        op.rows = uniform(rng, 1, std::max<int64_t>(1, (budget - op.row_bytes) / op.dst_pitch + 1));
        const int64_t pitch_kind = uniform(rng, 0, 5);
        if (o.overlapping_source_rows && pitch_kind == 0) {
          op.src_pitch = 0;
        } else if (o.overlapping_source_rows && pitch_kind == 1) {
          op.src_pitch = uniform(rng, 1, op.row_bytes);
        } else {
          op.src_pitch = op.row_bytes + uniform(rng, 0, 41);
        }
      }
      const int64_t dst_extent = (op.rows - 1) * op.dst_pitch + op.row_bytes;
      const int64_t src_extent = (op.rows - 1) * op.src_pitch + op.row_bytes;
      if (dst_extent > room - 16 || src_extent > src_half) continue;
      const int64_t skip = uniform(rng, 0, std::min<int64_t>(15, room - 16 - dst_extent));
      const int64_t write_base = (k % 2) * dst_half;
      const int64_t read_base = ((k + 1) % 2) * src_half;
      op.dst_offset = write_base + next + skip;
      next += skip + dst_extent;
      op.src_offset = read_base + uniform(rng, 0, src_half - src_extent);
      ph.ops.push_back(op);
    }
    p.phases.push_back(std::move(ph));
  }
  return p;
}

// n random bytes.
inline std::vector<std::byte> random_bytes(std::mt19937_64& rng, size_t n) {
  std::vector<std::byte> v(n);
  for (size_t i = 0; i < n; i += 8) {
    const uint64_t x = rng();
    std::memcpy(v.data() + i, &x, std::min<size_t>(8, n - i));
  }
  return v;
}

}  // namespace moebius::testing
