#pragma once

// The short bursty trace the serving tests replay: 3 s, a quiet second at 4 requests/s, then
// bursts of 40/s; prompts of 1-14 tokens (longer than the tests' 8-token step budget, so some
// prefill in chunks) and 1-`output_max` output tokens.

#include <cstdint>
#include <vector>

#include "trace.hpp"

namespace mini_engine::testing {

inline std::vector<request> small_trace(uint64_t seed, int32_t vocab, int64_t output_max) {
  bursty_options t;
  t.duration_s = 3;
  t.quiet_s = 1;
  t.quiet_rate = 4;
  t.burst_s = 0.5;
  t.burst_rate = 40;
  t.prompt_min = 1;
  t.prompt_max = 14;
  t.output_min = 1;
  t.output_max = output_max;
  t.vocab = vocab;
  return bursty_trace(seed, t);
}

}  // namespace mini_engine::testing
