#pragma once

// Reading an option's value: CLI11 finds the options, their values and unknown arguments; the
// values are read here, so every message names the option, the value and the range
// ("--ranks: '4x' is not an integer"). Each function throws usage_error (options.hpp).

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace mini_engine::demo {

// Throws usage_error("<option>: <why>").
[[noreturn]] void fail_option(const std::string& option, const std::string& why);

// An integer in [lo, hi].
int64_t parse_int(const std::string& option, std::string_view v, int64_t lo, int64_t hi);
// Any unsigned 64-bit integer (a seed).
uint64_t parse_seed(const std::string& option, std::string_view v);
// A finite number in [lo, hi].
double parse_double(const std::string& option, std::string_view v, double lo, double hi);

// One of `names` (in order, matching `values`), or a usage error listing them.
template <class E, size_t N>
E parse_choice(const std::string& option, const std::string& v, const char* const (&names)[N],
               const E (&values)[N]) {
  for (size_t i = 0; i < N; ++i) {
    if (v == names[i]) return values[i];
  }
  std::string list;
  for (size_t i = 0; i < N; ++i) list += (i ? ", " : "") + std::string(names[i]);
  fail_option(option, "'" + v + "' is not one of " + list);
}

}  // namespace mini_engine::demo
