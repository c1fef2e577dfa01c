#pragma once

// Undoing a partly executed plan.
//
// Every Moebius plan keeps one rule per phase: its destinations were free (held nothing the
// state before the phase needs) and its sources stay untouched during the phase. A phase
// therefore changes only bytes that were free before it, and copying each destination back
// onto its source, phase by phase in reverse order, restores every byte that was live before
// the first phase, whatever later phases overwrote:
//
//   phase 0: X -> Y (Y free; X free afterwards)   phase 1: Z -> X (X free; Z free afterwards)
//   undo 1:  X -> Z  (Z already held it)           undo 0:  Y -> X  (X gets its bytes back)
//
// A phase that failed part-way wrote only bytes that were free before it, so it needs no undo.
// A phase that frees bytes without reading them (an unread replica) lists, in
// plan_phase::restores, the copies that re-create them; the undo runs those right after.
// This is what makes a KV migration that reuses freed pages in later rounds reversible.

#include <cstdint>

#include "moebius/plan/plan.hpp"

namespace moebius {

// The plan that undoes the first `completed_phases` phases of `executed`: phases in reverse
// order, each op with source and destination swapped, each followed by a phase of its
// restores when it has any. Ops of a phase that read overlapping source bytes (a page sent to
// several ranks, a head slice of a page also copied whole) would write those bytes back
// twice: the undo drops an op whose destination the others already write entirely, and moves
// one that overlaps them in part to an extra phase ("undo <label> (part 2)"), so no undo phase
// has overlapping destinations. Throws
// errc::invalid_argument when completed_phases is outside [0, phases], an undone op names a
// rank outside [0, num_ranks), an out-of-range memory_space or rows < 1, or its source pitch
// is smaller than its row (its undo would overlap itself).
//   executed = {phase "layer 0 EP->TP": 1->0 arena[A] -> arena[B]}, completed 1
//     -> {phase "undo layer 0 EP->TP": 0->1 arena[B] -> arena[A]}
plan rollback_plan(const plan& executed, int64_t completed_phases);

}  // namespace moebius
