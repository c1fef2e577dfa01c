#pragma once

// The host's clock for the serving loop's own measurements (a step's host time when the runtime
// does not time itself, a progressive switch's waits): steady, never the wall clock.

#include <chrono>

namespace mini_engine {

using host_clock = std::chrono::steady_clock;

// Seconds from `t0` to now on the host clock.
inline double seconds_since(host_clock::time_point t0) {
  return std::chrono::duration<double>(host_clock::now() - t0).count();
}

}  // namespace mini_engine
