#pragma once

// Stage 2 of the demo: a serving loop. Requests arrive in a quiet / burst / quiet / decay
// pattern, each step every active sequence decodes one token (growing its KV pages), the
// switch policy watches the batch size, and when it fires the switcher moves the experts and
// every in-flight request's KV to the other layout, verified by layout-independent checksums.

#include <cstdint>

#include "demo_backend.hpp"
#include "moebius/kv/kv_geometry.hpp"
#include "moebius/layout/arena_geometry.hpp"

namespace moebius::demo {

struct serving_options {
  int64_t steps = 600;    // engine steps to simulate
  int64_t t_high = 48;    // policy threshold T_h (active sequences); T_l = 0.8 T_h
  uint64_t seed = 7;
};

// Runs the loop on `b` (whose mirror holds the arena at cursor 0, all EP); returns true when
// every switch committed and verified.
bool run_serving_stage(backend& b, rank_mirror& mirror, const arena_geometry& weights,
                       const kv_geometry& kv, const serving_options& opt);

}  // namespace moebius::demo
