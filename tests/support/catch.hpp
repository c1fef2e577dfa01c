#pragma once

// Catch2 v2 (Debian 12's `catch2`) ships one header; v3 (newer distributions) splits it and
// moves the string matchers. Tests include this file and write what both versions accept:
// `Catch::Approx` (never a bare `Approx`: v3 has no global one; v2's is aliased below), and the string matchers
// `Catch::Contains` / `Catch::StartsWith` / `Catch::EndsWith`, which v3 spells
// `Catch::Matchers::ContainsSubstring` etc. and which are aliased below for it.
#if __has_include(<catch2/catch_all.hpp>)
#include <catch2/catch_all.hpp>

#include <string>

namespace Catch {
inline Matchers::StringContainsMatcher Contains(const std::string& s,
                                                CaseSensitive cs = CaseSensitive::Yes) {
  return Matchers::ContainsSubstring(s, cs);
}
using Matchers::EndsWith;
using Matchers::StartsWith;
}  // namespace Catch
#else
#include <catch2/catch.hpp>

// v2 declares Approx in Catch::Detail (and globally); `Catch::Approx` would otherwise find only
// the vector matcher Catch::Matchers::Approx through a using-directive.
namespace Catch {
using Detail::Approx;
}  // namespace Catch
#endif
