#pragma once

// The serving tests' seed: MOEBIUS_TEST_SEED if set, else std::random_device; printed
// ("MOEBIUS_TEST_SEED=<n>") so that a failure can be replayed.

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>

namespace mini_engine::testing {

inline uint64_t test_seed() {
  uint64_t s = 0;
  if (const char* env = std::getenv("MOEBIUS_TEST_SEED"); env != nullptr && *env != '\0') {
    s = std::strtoull(env, nullptr, 0);
  } else {
    std::random_device rd;
    s = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  }
  std::printf("MOEBIUS_TEST_SEED=%llu\n", static_cast<unsigned long long>(s));
  return s;
}

}  // namespace mini_engine::testing
