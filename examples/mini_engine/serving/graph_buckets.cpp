#include "graph_buckets.hpp"

#include <algorithm>

#include <moebius/error.hpp>

namespace mini_engine {

void validate_graph_buckets(std::span<const int64_t> buckets) {
  for (size_t i = 0; i < buckets.size(); ++i) {
    MOEBIUS_CHECK(buckets[i] >= 1, moebius::errc::invalid_argument, "graph buckets: bucket ", i,
                  " is ", buckets[i], " (must be >= 1)");
    MOEBIUS_CHECK(i == 0 || buckets[i] > buckets[i - 1], moebius::errc::invalid_argument,
                  "graph buckets: bucket ", i, " (", buckets[i], ") is not above bucket ", i - 1,
                  " (", buckets[i - 1], "): they must ascend strictly");
  }
}

int64_t graph_bucket(std::span<const int64_t> buckets, int64_t batch) {
  const auto it = std::lower_bound(buckets.begin(), buckets.end(), batch);
  return it == buckets.end() ? 0 : *it;
}

std::vector<int64_t> vllm_capture_sizes() {
  std::vector<int64_t> sizes = {1, 2, 4};
  for (int64_t b = 8; b <= 512; b += 8) sizes.push_back(b);
  return sizes;
}

}  // namespace mini_engine
