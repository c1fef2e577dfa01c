#pragma once

// A rank-3 strided layout in the CuTe sense: shape + stride, and layout(coord) -> offset.
// Offsets are in elements and 64-bit. We need runtime integers and a fixed rank, nothing more.

#include <cstdint>

#include "moebius/detail/host_device.hpp"

namespace moebius {

struct layout3 {
  int64_t shape[3];   // extents of the three modes
  int64_t stride[3];  // elements between neighbours along each mode

  // Element offset of coordinate (i, j, k).
  //   row_major(2, 3, 4)(1, 2, 3) == 1*12 + 2*4 + 3 == 23
  MOEBIUS_HOST_DEVICE constexpr int64_t operator()(int64_t i, int64_t j, int64_t k) const {
    return i * stride[0] + j * stride[1] + k * stride[2];
  }

  // Number of elements the layout addresses (its cosize when compact).
  MOEBIUS_HOST_DEVICE constexpr int64_t size() const { return shape[0] * shape[1] * shape[2]; }

  MOEBIUS_HOST_DEVICE static constexpr layout3 row_major(int64_t n0, int64_t n1, int64_t n2) {
    return layout3{{n0, n1, n2}, {n1 * n2, n2, 1}};
  }
};

MOEBIUS_HOST_DEVICE constexpr bool operator==(const layout3& a, const layout3& b) {
  for (int m = 0; m < 3; ++m) {
    if (a.shape[m] != b.shape[m] || a.stride[m] != b.stride[m]) return false;
  }
  return true;
}

}  // namespace moebius
