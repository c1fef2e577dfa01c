#pragma once

// 64-bit arithmetic that refuses to wrap. Every byte count that reaches a plan goes through
// these: one slot of a real model is several GB and a whole arena is tens of GB, so a silent
// wrap would corrupt memory far away from its cause.

#include <cstdint>

#include "moebius/error.hpp"

namespace moebius::detail {

// a * b, or throws errc::overflow naming `what`.
inline int64_t checked_mul(int64_t a, int64_t b, const char* what) {
  int64_t out = 0;
  MOEBIUS_CHECK(!__builtin_mul_overflow(a, b, &out), errc::overflow, what,
                " overflows 64 bits (", a, " * ", b, ")");
  return out;
}

// a + b, or throws errc::overflow naming `what`.
inline int64_t checked_add(int64_t a, int64_t b, const char* what) {
  int64_t out = 0;
  MOEBIUS_CHECK(!__builtin_add_overflow(a, b, &out), errc::overflow, what,
                " overflows 64 bits (", a, " + ", b, ")");
  return out;
}

// Product of all factors, checked at each step.
template <class... Ints>
int64_t checked_product(const char* what, int64_t first, Ints... rest) {
  int64_t out = first;
  ((out = checked_mul(out, static_cast<int64_t>(rest), what)), ...);
  return out;
}

// Smallest multiple of `alignment` (> 0) that is >= value (>= 0), checked.
inline int64_t checked_align_up(int64_t value, int64_t alignment, const char* what) {
  const int64_t bumped = checked_add(value, alignment - 1, what);
  return bumped / alignment * alignment;
}

constexpr int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace moebius::detail
