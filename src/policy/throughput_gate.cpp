#include "moebius/policy/throughput_gate.hpp"

#include <algorithm>
#include <cmath>
#include <ostream>

#include "moebius/detail/enum_check.hpp"
#include "moebius/error.hpp"
#include "moebius/policy/calibration.hpp"

namespace moebius {

std::ostream& operator<<(std::ostream& os, const gate_terms& t) {
  return os << "gate_terms{admission " << (t.admission ? "on" : "off") << ", queueing "
            << (t.queueing ? "on" : "off") << ", known work " << (t.known_work ? "on" : "off")
            << "}";
}

namespace {

void check_load(const serving_load& l) {
  MOEBIUS_CHECK(l.running >= 0 && l.waiting >= 0 && l.admits_ep >= 0 && l.admits_tp >= 0,
                errc::invalid_argument, "serving_load: counts must be >= 0 (running ", l.running,
                ", waiting ", l.waiting, ", admits EP ", l.admits_ep, ", TP ", l.admits_tp, ")");
  MOEBIUS_CHECK(l.max_running >= 1, errc::invalid_argument,
                "serving_load: max_running must be >= 1 (", l.max_running, ")");
  MOEBIUS_CHECK(std::isfinite(l.queue_tokens) && l.queue_tokens >= 0, errc::invalid_argument,
                "serving_load: queue_tokens must be finite and >= 0 (", l.queue_tokens, ")");
  MOEBIUS_CHECK(l.predicted_residency_steps >= 1, errc::invalid_argument,
                "serving_load: predicted_residency_steps must be >= 1 (",
                l.predicted_residency_steps, ")");
}

// The batch mode `m` runs: every sequence that wants to run, within the scheduler's cap and,
// with the admission term, what m's pool holds (at least 1: a mode always runs something).
int64_t batch_of(const serving_load& l, parallel_mode m, bool admission) {
  int64_t b = std::min(l.running + l.waiting, l.max_running);
  if (admission) b = std::min(b, l.admits(m));
  return std::max<int64_t>(b, 1);
}

}  // namespace

gate_evaluation weigh_switch(const latency_curves& curves, parallel_mode current,
                             parallel_mode target, const serving_load& load, double switch_ms,
                             double margin, const gate_terms& terms) {
  detail::check_enum(current, "weigh_switch current (parallel_mode)");
  detail::check_enum(target, "weigh_switch target (parallel_mode)");
  MOEBIUS_CHECK(current != target, errc::invalid_argument,
                "weigh_switch: current and target are both ", to_string(target));
  check_load(load);
  MOEBIUS_CHECK(std::isfinite(switch_ms) && switch_ms >= 0, errc::invalid_argument,
                "weigh_switch: switch_ms must be finite and >= 0 (", switch_ms, ")");
  MOEBIUS_CHECK(std::isfinite(margin) && margin >= 0, errc::invalid_argument,
                "weigh_switch: margin must be finite and >= 0 (", margin, ")");
  gate_evaluation g;
  g.evaluated = true;
  g.target = target;
  g.load = load.running + load.waiting;
  g.waiting = load.waiting;
  g.current_batch = batch_of(load, current, terms.admission);
  g.target_batch = batch_of(load, target, terms.admission);

  int64_t residency = load.predicted_residency_steps;
  g.residency_from = "predictor";
  if (terms.known_work && load.known_residency_steps >= 0) {
    residency = std::max<int64_t>(1, load.known_residency_steps);
    g.residency_from = "known work";
  }
  if (terms.queueing && load.waiting > 0) {
    const double drain = std::ceil(load.queue_tokens / static_cast<double>(g.target_batch));
    if (drain > static_cast<double>(residency)) {
      residency = static_cast<int64_t>(std::min(drain, 1e15));
      g.residency_from = "queue";
    }
  }
  g.residency_steps = residency;

  const double b_cur = static_cast<double>(g.current_batch);
  const double b_tgt = static_cast<double>(g.target_batch);
  const double per_step_ms =
      curves.latency_ms(current, b_cur) - b_cur * curves.latency_ms(target, b_tgt) / b_tgt;
  g.gain_ms = per_step_ms * static_cast<double>(residency);
  g.cost_ms = switch_ms;
  g.passed = g.gain_ms >= switch_ms * (1.0 + margin);
  return g;
}

}  // namespace moebius
