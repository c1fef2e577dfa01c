#pragma once

// The state of a progressive switch in flight (switcher.hpp), shared by switcher.cpp (whose
// constructor must be able to destroy it) and progressive.cpp.

#include <chrono>
#include <cstdint>

#include "moebius/kv/page_table.hpp"
#include "moebius/layout/arena_geometry.hpp"
#include "moebius/plan/plan.hpp"
#include "moebius/switch/switcher.hpp"

namespace moebius {

using clock_type = std::chrono::steady_clock;

struct switcher::progress {
  parallel_mode target = parallel_mode::ep;
  arena_cursor start;
  arena_cursor goal;
  kv_state target_tables;
  plan kv_layer0;             // one layer's KV migration (see the top of this file)
  int64_t kv_rounds = 0;      // phases of kv_layer0
  int64_t num_layers = 0;     // layers to move
  int64_t layers_done = 0;    // layers whose advance completed
  int64_t layers_enqueued = 0;
  int64_t outstanding = 0;    // layers of the advance in flight (0: none)
  uint64_t checksum_before = 0;
  clock_type::time_point t0;

  bool ascending() const { return goal.tp_layers > start.tp_layers; }
  // The i-th layer to move, and the cursor once i layers moved.
  int64_t layer(int64_t i) const { return ascending() ? start.tp_layers + i : start.tp_layers - 1 - i; }
  arena_cursor cursor_after(int64_t i) const {
    return arena_cursor{ascending() ? start.tp_layers + i : start.tp_layers - i};
  }
};

}  // namespace moebius
