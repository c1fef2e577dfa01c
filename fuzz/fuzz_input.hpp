#pragma once

// Turns a fuzzer's bytes into bounded or raw values. Most values land in a small valid range
// (so inputs reach the planners), one in eight is a raw 64-bit value (so extreme inputs reach
// the validators). An exhausted input reads zeros.

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <iostream>

namespace moebius::fuzz {

class input {
 public:
  input(const uint8_t* data, size_t size) : data_(data), size_(size) {}

  template <class T>
  T raw() {
    T v{};
    const size_t n = sizeof(T) < size_ ? sizeof(T) : size_;
    std::memcpy(&v, data_, n);
    data_ += n;
    size_ -= n;
    return v;
  }
  // A value in [lo, hi] (lo when hi < lo), spread over at most 2^32 values.
  int64_t range(int64_t lo, int64_t hi) {
    if (hi <= lo) return lo;
    const uint64_t span = static_cast<uint64_t>(hi) - static_cast<uint64_t>(lo) + 1;  // 0: all
    const uint64_t r = raw<uint32_t>();
    return static_cast<int64_t>(static_cast<uint64_t>(lo) + (span == 0 ? r : r % span));
  }
  // Usually in [lo, hi]; one time in eight any int64.
  int64_t mostly(int64_t lo, int64_t hi) {
    return (raw<uint8_t>() & 7) == 7 ? raw<int64_t>() : range(lo, hi);
  }
  bool coin() { return raw<uint8_t>() & 1; }
  bool empty() const { return size_ == 0; }

 private:
  const uint8_t* data_;
  size_t size_;
};

// A failed invariant: print it and abort, so libFuzzer saves the input.
#define MOEBIUS_FUZZ_REQUIRE(cond, what)                                        \
  do {                                                                          \
    if (!(cond)) {                                                              \
      std::cerr << "fuzz invariant failed: " << (what) << " (" #cond ")\n";     \
      std::abort();                                                             \
    }                                                                           \
  } while (0)

}  // namespace moebius::fuzz
