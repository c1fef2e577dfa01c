#pragma once

// REQUIRE_MOEBIUS_ERROR(expr, code, "substring"): expr throws moebius::error with `code`
// and a message containing the substring (the name of the broken constraint).

#include <string>

#include "moebius/error.hpp"
#include "support/catch.hpp"

#define REQUIRE_MOEBIUS_ERROR(expr, expected_code, substring)                              \
  do {                                                                                     \
    bool moebius_threw_ = false;                                                           \
    try {                                                                                  \
      (void)(expr);                                                                        \
    } catch (const ::moebius::error& moebius_e_) {                                         \
      moebius_threw_ = true;                                                               \
      INFO("message: " << moebius_e_.what());                                              \
      CHECK(moebius_e_.code() == (expected_code));                                         \
      CHECK(std::string(moebius_e_.what()).find(substring) != std::string::npos);          \
    }                                                                                      \
    if (!moebius_threw_) FAIL("expected moebius::error from " #expr);                      \
  } while (0)
