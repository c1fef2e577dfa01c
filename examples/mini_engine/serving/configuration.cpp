#include "configuration.hpp"

#include <cctype>

#include <moebius/error.hpp>

namespace mini_engine {

using moebius::errc;
using moebius::parallel_mode;

bool is_named(const configuration& c) {
  if (c.dcp < 1 || !moebius::is_valid(c.layout)) return false;
  if (c.layout.attention == parallel_mode::tp) return true;
  return c.layout.experts == parallel_mode::ep && c.dcp == 1;
}

std::string name_of(const configuration& c) {
  std::string n;
  if (c.layout.attention == parallel_mode::tp)
    n = c.layout.experts == parallel_mode::tp ? "TP" : "TEP";
  else
    n = c.layout.experts == parallel_mode::ep ? "EP" : moebius::to_string(c.layout);
  if (c.dcp != 1) n += "-DCP" + std::to_string(c.dcp) + (is_named(c) ? "" : "?");
  return n;
}

configuration parse_configuration(std::string_view name) {
  std::string s(name);
  for (char& ch : s) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  auto fail = [&](const char* why) {
    MOEBIUS_FAIL(errc::invalid_argument, "configuration \"", std::string(name), "\": ", why,
                 " (accepted: TP, EP, TEP, TP-DCP<d>, TEP-DCP<d>, any case)");
  };
  int64_t dcp = 1;
  if (const size_t at = s.find("-dcp"); at != std::string::npos) {
    const std::string digits = s.substr(at + 4);
    if (digits.empty() || digits.size() > 4 ||
        digits.find_first_not_of("0123456789") != std::string::npos)
      fail("the degree after -DCP must be a positive integer");
    dcp = std::stoll(digits);
    if (dcp < 1) fail("the degree after -DCP must be a positive integer");
    s.resize(at);
  }
  if (s == "tp") return configuration{parallel_mode::tp, dcp};
  if (s == "tep") return configuration{{parallel_mode::tp, parallel_mode::ep}, dcp};
  if (s == "ep") {
    if (dcp != 1) fail("dcp splits TP attention's tokens; EP attention holds a sequence whole");
    return configuration{parallel_mode::ep};
  }
  fail("not a configuration");
  return {};  // unreachable: MOEBIUS_FAIL throws
}

}  // namespace mini_engine
