#pragma once

// What one layer of a switch sends per rank (moebius::layer_bytes, switch/pacing.hpp): the one
// piece of code behind switch_layer_bytes() and switch_plan::bytes_per_layer.

#include "moebius/layout/arena_geometry.hpp"
#include "moebius/plan/plan.hpp"
#include "moebius/switch/pacing.hpp"

namespace moebius::detail {

// The expert weights of the first layer a switch to `target` moves (one-layer weight plan;
// every layer moves alike) and `layer_kv`, one layer's KV migration (null: no KV moves).
layer_bytes layer_traffic(const arena_geometry& weights, parallel_mode target,
                          const plan* layer_kv);

}  // namespace moebius::detail
