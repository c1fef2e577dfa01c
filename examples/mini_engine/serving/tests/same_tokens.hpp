#pragma once

// Every request of `want` (sorted by id) finished once in `got` with the same greedy tokens:
// the serving tests' check that switching, faults and recovery change nothing a user sees.

#include <cstddef>
#include <cstdint>

#include "catch.hpp"
#include "engine.hpp"

namespace mini_engine::testing {

inline void check_same_tokens(const run_result& got, const run_result& want) {
  REQUIRE(got.requests.size() == want.requests.size());
  for (size_t i = 0; i < want.requests.size(); ++i) {
    const request_result& a = want.requests[i];
    const request_result& b = got.requests[i];
    CAPTURE(a.id);
    REQUIRE(b.id == a.id);
    CHECK(b.admissions == 1);
    REQUIRE(static_cast<int64_t>(b.generated.size()) == a.output_tokens);
    CHECK(b.generated == a.generated);
  }
}

}  // namespace mini_engine::testing
