#pragma once

// Seed for the policy tests: env MOEBIUS_TEST_SEED if set, else std::random_device; printed
// once so a failure can be replayed. (Header-only so these tests link nothing but the
// library.)

#include <cstdint>
#include <cstdlib>
#include <iostream>
#include <random>

namespace moebius::testing {

inline uint64_t policy_test_seed() {
  static const uint64_t seed = [] {
    uint64_t s = 0;
    if (const char* env = std::getenv("MOEBIUS_TEST_SEED")) {
      s = std::strtoull(env, nullptr, 10);
    } else {
      std::random_device rd;
      s = (uint64_t{rd()} << 32) ^ rd();
    }
    std::cout << "MOEBIUS_TEST_SEED=" << s << "\n";
    return s;
  }();
  return seed;
}

}  // namespace moebius::testing
