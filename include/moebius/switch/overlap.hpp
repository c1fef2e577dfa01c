#pragma once

// The cross-stream order that lets a progressive switch's copies run beside the decode steps
// (DESIGN.md §7, "Overlap"): which event each side waits for, and nothing more.
//
// Two streams per rank: the step's (compute) and the switch's (copies). Step s records an event
// S_l after each layer l (layers run in ascending order); advance A_s records an event E_j after
// each layer j it moves (layer_completion). Step s runs at the cursor from before A_s: the layers
// A_s moves still run in the source mode, reading their old slot and writing their new token
// into the source pages. Then:
//
//   copy waits   the copy of layer j waits for S_w of the step beside it, w = copy_waits(..)[i],
//                so that it reads the step's new token and overwrites no slot or page that step
//                still reads;
//   step waits   step s+1 runs at the cursor after A_s and waits E_j before a layer j of A_s
//                (the target slot and pages are only valid after the copy).
//
// Why these events. EP->TP moves layer j from slot j+1 to slot j, ascending. Its weights write
// slot j, which held EP layer j-1 (read by the step at layer j-1); its KV reads the step's
// token of layer j in the EP pages and stages through slot j+1, which holds EP layer j (read by
// the step at layer j): so copy j waits S_j. TP->EP moves layer j from slot j to slot j+1,
// descending: it writes slot j+1, which held TP layer j+1 (read at layer j+1 while j+1 is below
// the cursor), and stages through slot j (TP layer j): so copy j waits S_{j+1}, or S_j for the
// first layer; the first copy's wait (S_{c-1}) already orders every later one. Likewise step
// s+1 reads layers ascending: EP->TP it waits each E_j; TP->EP the lowest layer moved last, so
// one wait on it orders them all. Each wait listed is needed: drop one and a read races a write
// (tests/switch/test_overlap_hazards.cpp proves both on a model of the two streams).
//
// With several ranks a wait means every rank's event: the copies of a phase write peers' memory,
// so a transport that starts a phase after such a wait must have every rank pass its own wait
// first (a barrier after the waits), not only the rank that issues the copy.

#include <cstdint>
#include <span>
#include <vector>

#include "moebius/layout/arena_geometry.hpp"

namespace moebius {

// For an advance that moves `layers` (in the order they move: from `before`, EP->TP ascending
// from before.tp_layers, TP->EP descending from before.tp_layers - 1) beside a step running at
// `before`: per layer of the advance, the step layer after which its copy may start, or -1 when
// the wait of an earlier copy (the copies run in order on one stream) already orders it.
//   EP->TP, before 2, layers {2, 3, 4}: {2, 3, 4}.   TP->EP, before 6, layers {5, 4, 3}: {5, -1, -1}.
// Throws errc::invalid_argument unless `layers` is such an advance within [0, num_layers).
std::vector<int64_t> copy_waits(int64_t num_layers, arena_cursor before,
                                std::span<const int64_t> layers);

// The layers (ascending) before which the step after that advance waits for the layer's
// completion event; the others are ordered by those waits.
//   EP->TP layers {2, 3, 4}: {2, 3, 4}.   TP->EP layers {5, 4, 3}: {3}.
// Same errors as copy_waits.
std::vector<int64_t> step_waits(int64_t num_layers, arena_cursor before,
                                std::span<const int64_t> layers);

}  // namespace moebius
