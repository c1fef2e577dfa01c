#include "moebius/policy/step_time_gate.hpp"

#include <cmath>

#include "moebius/detail/enum_check.hpp"
#include "moebius/error.hpp"
#include "moebius/policy/calibration.hpp"

namespace moebius {

gate_evaluation weigh_step_time(const latency_curves& curves, parallel_mode current,
                                parallel_mode target, int64_t load, int64_t residency_steps,
                                double switch_ms, double margin) {
  detail::check_enum(current, "weigh_step_time current (parallel_mode)");
  detail::check_enum(target, "weigh_step_time target (parallel_mode)");
  MOEBIUS_CHECK(current != target, errc::invalid_argument,
                "weigh_step_time: current and target are both ", to_string(target));
  MOEBIUS_CHECK(load >= 0, errc::invalid_argument, "weigh_step_time: load must be >= 0 (",
                load, ")");
  MOEBIUS_CHECK(std::isfinite(switch_ms) && switch_ms >= 0.0, errc::invalid_argument,
                "the switch cost estimate must be finite and >= 0 ms (to ", to_string(target),
                ": ", switch_ms, " ms)");
  MOEBIUS_CHECK(std::isfinite(margin) && margin >= 0.0, errc::invalid_argument,
                "weigh_step_time: margin must be finite and >= 0 (", margin, ")");
  gate_evaluation g;
  if (residency_steps <= 0) return g;  // unknown residency: no gate
  const double b = static_cast<double>(load);
  g.evaluated = true;
  g.target = target;
  g.load = load;
  g.residency_steps = residency_steps;
  g.gain_ms = (curves.latency_ms(current, b) - curves.latency_ms(target, b)) *
              static_cast<double>(residency_steps);
  g.cost_ms = switch_ms;
  g.passed = g.gain_ms >= switch_ms * (1.0 + margin);
  return g;
}

}  // namespace moebius
