#pragma once

// Helpers of the kernel tests (test_kernels*.cu), beside gpu_test_util.hpp's.

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "tests/catch.hpp"

namespace mini_engine::gpu::testing {

// Number of elements outside atol + rtol * |want|; the first few are printed.
inline int64_t mismatches(const std::vector<float>& got, const std::vector<double>& want,
                          double atol, double rtol, const std::string& what) {
  REQUIRE(got.size() == want.size());
  int64_t bad = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double g = got[i], w = want[i];
    if (!(std::fabs(g - w) <= atol + rtol * std::fabs(w))) {
      if (bad < 5) UNSCOPED_INFO(what << "[" << i << "]: got " << g << ", want " << w);
      ++bad;
    }
  }
  return bad;
}

}  // namespace mini_engine::gpu::testing
