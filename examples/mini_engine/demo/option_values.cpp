#include "option_values.hpp"

#include <charconv>
#include <cmath>
#include <cstdlib>

#include "options.hpp"

namespace mini_engine::demo {

[[noreturn]] void fail_option(const std::string& option, const std::string& why) {
  throw usage_error(option + ": " + why);
}

int64_t parse_int(const std::string& option, std::string_view v, int64_t lo, int64_t hi) {
  int64_t x = 0;
  const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), x);
  if (v.empty() || ec == std::errc::invalid_argument || end != v.data() + v.size()) {
    fail_option(option, "'" + std::string(v) + "' is not an integer");
  }
  if (ec == std::errc::result_out_of_range || x < lo || x > hi) {
    fail_option(option, std::string(v) + " is out of range [" + std::to_string(lo) + ", " +
                            std::to_string(hi) + "]");
  }
  return x;
}

uint64_t parse_seed(const std::string& option, std::string_view v) {
  uint64_t x = 0;
  const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), x);
  if (v.empty() || ec != std::errc() || end != v.data() + v.size()) {
    fail_option(option, "'" + std::string(v) + "' is not an unsigned 64-bit integer");
  }
  return x;
}

double parse_double(const std::string& option, std::string_view v, double lo, double hi) {
  const std::string s(v);
  char* end = nullptr;
  const double x = std::strtod(s.c_str(), &end);
  if (s.empty() || end != s.c_str() + s.size() || s.front() == ' ') {
    fail_option(option, "'" + s + "' is not a number");
  }
  if (!std::isfinite(x) || x < lo || x > hi) {
    fail_option(option,
                s + " is out of range [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
  }
  return x;
}

}  // namespace mini_engine::demo
