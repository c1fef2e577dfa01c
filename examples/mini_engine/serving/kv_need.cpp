#include "kv_need.hpp"

#include <algorithm>
#include <cmath>
#include <vector>

namespace mini_engine {

using moebius::parallel_mode;

double pool_tokens(const moebius::kv_geometry& g, parallel_mode m, int64_t dcp,
                   double watermark) {
  const double ranks =
      m == parallel_mode::ep ? static_cast<double>(g.num_ranks) : static_cast<double>(dcp);
  return ranks * static_cast<double>(g.num_pages(m)) * static_cast<double>(g.page_size) *
         (1.0 - watermark);
}

double output_prior(const work_view& w) {
  if (w.finished > 0)
    return static_cast<double>(w.finished_output_tokens) / static_cast<double>(w.finished);
  double mean_generated = 0;
  for (const int64_t x : w.generated) mean_generated += static_cast<double>(x);
  if (w.running > 0) mean_generated /= static_cast<double>(w.running);
  return std::max(1.0, mean_generated);
}

double expected_remaining(int64_t generated, double prior) {
  return std::max(static_cast<double>(generated), prior);
}

int64_t rollout_residency(const work_view& w, parallel_mode target, int64_t boundary,
                          double prior) {
  std::vector<double> left;
  left.reserve(static_cast<size_t>(w.running + w.waiting));
  for (const int64_t g : w.generated) left.push_back(expected_remaining(g, prior));
  for (int64_t q = 0; q < w.waiting; ++q) left.push_back(prior);
  if (left.empty()) return 1;
  std::sort(left.begin(), left.end());
  double steps = left.back();
  if (target == parallel_mode::ep) {
    const int64_t live = static_cast<int64_t>(left.size());
    steps = live < boundary ? 1.0 : left[static_cast<size_t>(live - boundary)];
  }
  return std::max<int64_t>(1, static_cast<int64_t>(std::min(std::ceil(steps), 1e12)));
}

}  // namespace mini_engine
