#pragma once

// Plans that reshard expert weights between EP and TP inside the arena (DESIGN.md §3).

#include "moebius/layout/arena_geometry.hpp"
#include "moebius/plan/plan.hpp"

namespace moebius {

// The plan that moves the arena from cursor `from` to cursor `to`, one phase per layer.
//   to > from: EP->TP for layers [from, to), ascending; layer i goes from slot i+1 to slot i.
//   to < from: TP->EP for layers [to, from), descending; layer i goes from slot i to slot i+1.
//   to == from: an empty plan.
// Source and destination of a layer are different slots, and the destination slot holds a
// layer the previous phase already consumed, so each phase is race-free and after phase k
// the arena rests at a valid cursor. Rolling back a half-done switch is the plan from the
// cursor it reached back to where it started.
//
// Each (source rank, destination rank, tensor) pair becomes one strided copy (two when the
// EP and TP gate/up orders differ): for w13 the rows of both halves of E/P experts, for w2
// E/P * H rows of I/P columns. Each rank keeps 1/P of its bytes locally and sends (P-1)/P.
//
// Throws errc::invalid_argument for a cursor outside [0, L]. Allocates only the plan.
plan plan_weight_switch(const arena_geometry& geometry, arena_cursor from, arena_cursor to);

}  // namespace moebius
