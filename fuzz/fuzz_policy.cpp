// Fuzzes the switch policy: a configuration with arbitrary integers and doubles, then a
// sequence of steps with arbitrary loads, modes and times (NaN and infinities included). Any
// input must give a moebius::error or a decision that is well formed: a valid reason, a
// switch only to the other mode, counters that add up, a finite window mean.
#include <cmath>
#include <cstring>

#include "fuzz_input.hpp"
#include "moebius/error.hpp"
#include "moebius/policy/switch_policy.hpp"

using namespace moebius;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  fuzz::input in(data, size);
  switch_policy_config c;
  c.t_high = in.mostly(1, 512);
  c.t_low = in.mostly(1, c.t_high > 0 && c.t_high < 512 ? c.t_high : 512);
  c.up_window = in.mostly(1, 8);
  c.down_window = in.mostly(1, 300);
  c.rule = static_cast<down_rule>(in.range(0, 2));
  c.cooldown_steps = in.mostly(0, 8);
  c.cooldown_s = in.coin() ? in.raw<double>() : static_cast<double>(in.range(0, 10));
  c.expected_residency_steps = in.mostly(0, 100);
  try {
    switch_policy policy(c);
    int64_t steps = 0, switches = 0;
    double now = 0.0;
    while (!in.empty()) {
      const int64_t load = (in.raw<uint8_t>() & 3) == 0 ? in.raw<int64_t>() : in.range(0, 1024);
      const auto mode = static_cast<parallel_mode>(in.range(0, 2));
      now = (in.raw<uint8_t>() & 15) == 0 ? in.raw<double>() : now + 0.5;
      switch_decision d;
      try {
        d = policy.step(load, mode, now);
      } catch (const error&) {
        MOEBIUS_FUZZ_REQUIRE(policy.stats().steps == steps, "a refused step counts nothing");
        continue;
      }
      ++steps;
      MOEBIUS_FUZZ_REQUIRE(is_valid(d.reason) && is_valid(d.target), "valid decision enums");
      if (d.do_switch) {
        ++switches;
        MOEBIUS_FUZZ_REQUIRE(d.target != mode, "a switch goes to the other mode");
      }
      MOEBIUS_FUZZ_REQUIRE(std::isfinite(policy.window_mean()) && policy.window_mean() >= 0,
                           "finite window mean");
    }
    const switch_policy_stats& st = policy.stats();
    MOEBIUS_FUZZ_REQUIRE(st.steps == steps && st.switches == switches, "counters");
    int64_t by_reason = 0;
    for (int64_t n : st.by_reason) by_reason += n;
    MOEBIUS_FUZZ_REQUIRE(by_reason == steps, "one reason per step");
  } catch (const error&) {
  }
  return 0;
}
