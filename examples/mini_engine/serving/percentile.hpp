#pragma once

// Nearest-rank percentiles: the one definition behind every latency percentile a serving run
// reports (run_report.hpp's summary, paper_metrics.hpp's phases). The p-th percentile of n
// samples is the ceil(p n / 100)-th smallest: the smallest sample with at least p% of the
// samples at or below it. No interpolation, so it is always a sample.
//   p 99, n 100: the 99th smallest (the second largest); n 200: the 198th (the third largest);
//   n 1: the sample itself; n 0: 0.

#include <algorithm>
#include <cstdint>
#include <vector>

namespace mini_engine {

// The ceil(percent n / 100)-th smallest of `samples` (0 when empty), percent in [1, 100].
// Counted in integers: ceil(0.99 * n) in floating point is the same for n up to 2M but rests on
// how 0.99 rounds.
inline double nearest_rank(std::vector<double> samples, int64_t percent) {
  if (samples.empty()) return 0;
  const int64_t n = static_cast<int64_t>(samples.size());
  const int64_t rank = std::max<int64_t>(1, (percent * n + 99) / 100);
  const auto at = samples.begin() + static_cast<std::ptrdiff_t>(rank - 1);
  std::nth_element(samples.begin(), at, samples.end());
  return *at;
}

inline double p99(std::vector<double> samples) { return nearest_rank(std::move(samples), 99); }

}  // namespace mini_engine
