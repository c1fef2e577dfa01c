#include "moebius/policy/residency.hpp"

#include <algorithm>
#include <cmath>
#include <ostream>

#include "moebius/error.hpp"

namespace moebius {

namespace {
constexpr double lifetime_weight = 1.0 / 64.0;  // weight of one completed request in S
}  // namespace

void validate(const residency_config& c) {
  MOEBIUS_CHECK(c.window_steps >= 1 && c.window_steps <= (int64_t{1} << 30),
                errc::invalid_argument, "residency window_steps must lie in [1, 2^30] (window_steps=",
                c.window_steps, ")");
  MOEBIUS_CHECK(c.horizon_steps >= 1 && c.horizon_steps <= (int64_t{1} << 40),
                errc::invalid_argument,
                "residency horizon_steps must lie in [1, 2^40] (horizon_steps=", c.horizon_steps,
                ")");
}

std::ostream& operator<<(std::ostream& os, const residency_config& c) {
  return os << "residency_config{window=" << c.window_steps << " steps, horizon="
            << c.horizon_steps << " steps}";
}

residency_predictor::residency_predictor(const residency_config& config) : config_(config) {
  validate(config_);
  alpha_ = 1.0 / static_cast<double>(config_.window_steps);
}

void residency_predictor::reset() {
  arrivals_ewma_ = 0;
  lifetime_ewma_ = 0;
  lifetime_decay_ = 1;
  steps_ = completions_ = running_ = 0;
}

void residency_predictor::observe(const step_observation& s) {
  MOEBIUS_CHECK(s.arrivals >= 0 && s.completions >= 0 && s.completed_steps >= 0 && s.running >= 0,
                errc::invalid_argument,
                "a step observation's counts must be >= 0 (arrivals=", s.arrivals,
                ", completions=", s.completions, ", completed_steps=", s.completed_steps,
                ", running=", s.running, ")");
  MOEBIUS_CHECK(s.completions > 0 || s.completed_steps == 0, errc::invalid_argument,
                "completed_steps must be 0 when no request completed (completed_steps=",
                s.completed_steps, ")");
  arrivals_ewma_ = (1 - alpha_) * arrivals_ewma_ + alpha_ * static_cast<double>(s.arrivals);
  if (s.completions > 0) {
    // n completions of mean m at once: n updates of weight w each, in closed form.
    const double keep = std::pow(1 - lifetime_weight, static_cast<double>(s.completions));
    const double mean = static_cast<double>(s.completed_steps) / static_cast<double>(s.completions);
    lifetime_ewma_ = keep * lifetime_ewma_ + (1 - keep) * mean;
    lifetime_decay_ *= keep;
    completions_ += s.completions;
  }
  running_ = s.running;
  ++steps_;
}

double residency_predictor::arrival_rate() const {
  return arrivals_ewma_;
}

double residency_predictor::mean_lifetime_steps() const {
  return completions_ == 0 ? 0.0 : lifetime_ewma_ / (1 - lifetime_decay_);
}

double residency_predictor::completion_rate(int64_t running) const {
  const double s = mean_lifetime_steps();
  // A lifetime under one step (a request that finished in the step it was admitted) still
  // takes a step.
  return s > 0 ? static_cast<double>(running) / std::max(s, 1.0) : 0.0;
}

double residency_predictor::drift() const { return arrival_rate() - completion_rate(running_); }

int64_t residency_predictor::steps_until_cross(int64_t load, int64_t boundary) const {
  MOEBIUS_CHECK(load >= 0 && boundary >= 0, errc::invalid_argument,
                "steps_until_cross: load and boundary must be >= 0 (load=", load,
                ", boundary=", boundary, ")");
  if (completions_ == 0) return 1;  // no lifetime seen: no evidence of any residency
  const double d = drift();
  const double horizon = static_cast<double>(config_.horizon_steps);
  double steps = horizon;
  if (load >= boundary && d < 0) {
    steps = static_cast<double>(load - boundary + 1) / -d;
  } else if (load < boundary && d > 0) {
    steps = static_cast<double>(boundary - load) / d;
  }
  return static_cast<int64_t>(std::clamp(std::ceil(steps - 1e-9), 1.0, horizon));
}

std::ostream& operator<<(std::ostream& os, const residency_predictor& p) {
  return os << "residency{a=" << p.arrival_rate() << "/step, S=" << p.mean_lifetime_steps()
            << " steps, drift=" << p.drift() << "/step, " << p.steps_observed() << " steps seen}";
}

}  // namespace moebius
