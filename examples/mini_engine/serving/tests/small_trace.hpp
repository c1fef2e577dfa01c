#pragma once

// The short bursty trace the serving tests replay: 3 s, a quiet second at 4 requests/s, then
// bursts of 40/s; prompts of 1-14 tokens and 1-`output_max` output tokens; and the options it
// is served with (an 8-token step budget, so longer prompts prefill in chunks).

#include <cstdint>
#include <vector>

#include "engine.hpp"
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

// A 1 s trace that bursts hard: 0.3 s quiet at 10 requests/s, then 0.1 s bursts at 2500/s;
// prompts and outputs of 4-24 tokens (the switching and gate tests: bursts well above T_h).
inline std::vector<request> burst_trace(uint64_t seed, int32_t vocab) {
  bursty_options t;
  t.duration_s = 1.0;
  t.quiet_s = 0.3;
  t.quiet_rate = 10;
  t.burst_s = 0.1;
  t.burst_rate = 2500;
  t.prompt_min = 4;
  t.prompt_max = 24;
  t.output_min = 4;
  t.output_max = 24;
  t.vocab = vocab;
  return bursty_trace(seed, t);
}

// Static EP from step 0, at most 6 sequences running, tables validated after every step.
inline engine_options small_trace_options() {
  engine_options o;
  o.scheduler.max_step_tokens = 8;  // prompts up to 14 tokens: chunked prefill
  o.scheduler.max_running = 6;
  o.validate_every_step = true;
  return o;
}

}  // namespace mini_engine::testing
