#pragma once

// The two ways a layer's experts are sharded over P ranks. Every view, plan, KV state and
// switch names one of them; expert_shape.hpp says what is sharded, weight_view.hpp how.

#include <cstdint>

namespace moebius {

// Parallel mode of a layer: experts whole on E/P ranks each (EP), or every expert sliced
// along its intermediate dimension across all P ranks (TP).
enum class parallel_mode : uint8_t { ep, tp };

constexpr bool is_valid(parallel_mode m) {
  return m == parallel_mode::ep || m == parallel_mode::tp;
}

constexpr const char* to_string(parallel_mode m) {
  switch (m) {
    case parallel_mode::ep: return "EP";
    case parallel_mode::tp: return "TP";
  }
  return "unknown";
}

}  // namespace moebius
