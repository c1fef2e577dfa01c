#pragma once

// The shape of a trace, as a reader checks it against its sources: length percentiles, the
// share of outputs cut at a cap, mean and peak arrival rates, rollout steps.

#include <cstdint>
#include <iosfwd>
#include <vector>

#include "trace.hpp"

namespace mini_engine {

// p50/p90/p99 are nearest-rank percentiles (the ceil(q n)-th smallest value); mean is the
// arithmetic mean.
struct length_statistics {
  double mean = 0;
  int64_t p50 = 0, p90 = 0, p99 = 0, max = 0;
};

struct trace_statistics {
  int64_t requests = 0;
  length_statistics prompt, output;
  double cut_share = 0;       // share of outputs >= output_cap (0 when no cap is given)
  double span_s = 0;          // last arrival - first arrival
  double mean_rate = 0;       // requests / span (0 for a span of 0)
  double peak_rate = 0;       // most arrivals in any window of window_s, per second
  int64_t rollout_steps = 0;  // distinct rollout_step values >= 0
};

// `output_cap` > 0: count outputs at or over it as cut. `window_s` > 0: the peak rate's window.
trace_statistics statistics_of(const std::vector<request>& trace, int64_t output_cap = 0,
                               double window_s = 1.0);

// "3107 requests over 374.9 s (mean 8.3/s, peak 131/s in 1 s); prompt mean 69 p50 42 ...".
std::ostream& operator<<(std::ostream& os, const trace_statistics& s);

// Mean prompt + half the output over the trace: the context a decode step sees on average (the
// calibration's context); at least 1, and 1 for an empty trace.
int64_t mean_decode_context(const std::vector<request>& trace);

}  // namespace mini_engine
