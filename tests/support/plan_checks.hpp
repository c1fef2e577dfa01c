#pragma once

// Independent checks of a plan's structure, written from the plan's contract (plan.hpp,
// weight_plan.hpp) rather than from the builder. Each returns "" when the property holds,
// else a description of the first violation.

#include <string>

#include "moebius/layout/arena_geometry.hpp"
#include "moebius/plan/plan.hpp"

namespace moebius::testing {

// Within each phase, no destination byte range (row by row) overlaps another destination or
// any source of that phase, on the same rank and memory space. Exact: every row of every op
// is one interval, checked with a sweep. Sources may overlap each other.
std::string check_phase_disjoint(const plan& p);

// A switch from `from` to `to` writes every byte of the target tensors of the moved layers
// (target slot, target mode) exactly once and nothing else: no padding, no other slot, no
// other memory space. Uses a per-rank byte coverage counter over the arena
// (g.total_bytes() per rank, so keep the geometry small).
std::string check_writes_exactly_once(const plan& p, const arena_geometry& g, arena_cursor from,
                                      arena_cursor to);

// Traffic of a switch from `from` to `to`: each rank sends exactly (P-1)/P of its expert bytes
// of the moved layers to other ranks, keeps 1/P local (src_rank == dst_rank) and receives
// (P-1)/P from others. Counted from the ops directly.
std::string check_traffic(const plan& p, const arena_geometry& g, arena_cursor from,
                          arena_cursor to);

}  // namespace moebius::testing
