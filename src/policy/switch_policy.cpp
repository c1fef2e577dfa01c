#include "moebius/policy/switch_policy.hpp"

#include <algorithm>
#include <cmath>
#include <ostream>

#include "moebius/detail/enum_check.hpp"
#include "moebius/error.hpp"
#include "moebius/policy/residency.hpp"

namespace moebius {

namespace {
// Keeps T_l · W (the mean rule compares sums, not means) far from overflow.
constexpr int64_t max_threshold = int64_t{1} << 40;
// Loads enter the window saturated at 2^48 >= T_l · W (2^40 · 256): a load that large already
// keeps the window's sum at or above T_l · W, so saturating changes no decision, and a full
// ring of saturated loads (2^56) cannot overflow the sum.
constexpr int64_t max_window_load = max_threshold * switch_policy_config::max_window;

constexpr int mode_idx(parallel_mode m) { return m == parallel_mode::ep ? 0 : 1; }
}  // namespace

switch_policy_config interactive_config(int64_t t_high, double low_ratio) {
  MOEBIUS_CHECK(std::isfinite(low_ratio) && low_ratio > 0.0 && low_ratio <= 1.0,
                errc::invalid_argument, "low_ratio must lie in (0, 1] (low_ratio=", low_ratio,
                ")");
  MOEBIUS_CHECK(t_high > 0 && t_high <= max_threshold, errc::invalid_argument,
                "T_h must lie in [1, 2^40] (t_high=", t_high, ")");
  switch_policy_config c;
  c.t_high = t_high;
  c.t_low = std::max<int64_t>(1, std::llround(low_ratio * static_cast<double>(t_high)));
  validate(c);
  return c;
}

switch_policy_config rollout_config(int64_t t_high, int64_t cooldown_steps) {
  switch_policy_config c;
  c.t_high = t_high;
  c.t_low = t_high;
  c.up_window = 1;
  c.down_window = 1;
  c.rule = down_rule::every;
  c.cooldown_steps = cooldown_steps;
  c.cooldown_s = 0.0;
  validate(c);
  return c;
}

void validate(const switch_policy_config& c) {
  MOEBIUS_CHECK(c.t_high > 0 && c.t_high <= max_threshold, errc::invalid_argument,
                "T_h must lie in [1, 2^40] (t_high=", c.t_high, ")");
  MOEBIUS_CHECK(c.t_low > 0 && c.t_low <= c.t_high, errc::invalid_argument,
                "T_l must lie in [1, T_h] (t_low=", c.t_low, ", t_high=", c.t_high, ")");
  MOEBIUS_CHECK(c.up_window >= 1 && c.up_window <= switch_policy_config::max_window,
                errc::invalid_argument, "up_window must lie in [1, ",
                switch_policy_config::max_window, "] (up_window=", c.up_window, ")");
  MOEBIUS_CHECK(c.down_window >= 1 && c.down_window <= switch_policy_config::max_window,
                errc::invalid_argument, "down_window W must lie in [1, ",
                switch_policy_config::max_window, "] (down_window=", c.down_window, ")");
  detail::check_enum(c.rule, "switch_policy_config rule (down_rule)");
  MOEBIUS_CHECK(c.cooldown_steps >= 0, errc::invalid_argument,
                "cooldown_steps must be >= 0 (cooldown_steps=", c.cooldown_steps, ")");
  MOEBIUS_CHECK(std::isfinite(c.cooldown_s) && c.cooldown_s >= 0.0, errc::invalid_argument,
                "cooldown_s must be finite and >= 0 (cooldown_s=", c.cooldown_s, ")");
  MOEBIUS_CHECK(c.expected_residency_steps >= 0, errc::invalid_argument,
                "expected_residency_steps must be >= 0 (expected_residency_steps=",
                c.expected_residency_steps, ")");
  MOEBIUS_CHECK(std::isfinite(c.gate_margin) && c.gate_margin >= 0.0 && c.gate_margin <= 1e6,
                errc::invalid_argument, "gate_margin must lie in [0, 1e6] (gate_margin=",
                c.gate_margin, ")");
}

std::ostream& operator<<(std::ostream& os, const switch_policy_config& c) {
  return os << "switch_policy_config{T_h=" << c.t_high << ", T_l=" << c.t_low
            << ", up_window=" << c.up_window << ", W=" << c.down_window << " (" << to_string(c.rule)
            << "), cooldown=" << c.cooldown_steps << " steps/" << c.cooldown_s
            << " s, residency=" << c.expected_residency_steps << " steps, gate margin "
            << c.gate_margin << (c.enter_on_blocked_admission ? ", EP on blocked admission" : "")
            << (c.enter_on_sustained_gain ? ", EP on sustained gain" : "") << "}";
}

std::ostream& operator<<(std::ostream& os, const gate_evaluation& g) {
  if (!g.evaluated) return os << "gate{not evaluated}";
  os << "gate{to " << to_string(g.target) << " at load " << g.load;
  if (g.current_batch > 0 || g.target_batch > 0)
    os << " (batch " << g.current_batch << " now, " << g.target_batch << " in "
       << to_string(g.target) << ", " << g.waiting << " waiting)";
  os << ": gain " << g.gain_ms << " ms over " << g.residency_steps << " steps";
  if (g.residency_from[0] != '\0') os << " (" << g.residency_from << ")";
  const char* resolution = g.below_resolution() ? " (a step's gain under the curves' resolution)" : "";
  if (!g.priced)
    return os << " vs at least " << g.cost_ms << " ms: refused before planning" << resolution << "}";
  return os << " vs cost " << g.cost_ms << " ms: " << (g.passed ? "pays" : "refused") << resolution
            << "}";
}

std::ostream& operator<<(std::ostream& os, const switch_decision& d) {
  if (d.do_switch) {
    return os << "switch to " << to_string(d.target) << " (" << to_string(d.reason) << ")";
  }
  if (d.blocked()) {
    return os << "stay: " << to_string(d.target) << " refused (" << to_string(d.reason) << ")";
  }
  return os << "stay (" << to_string(d.reason) << ")";
}

int64_t residency_boundary(const switch_policy_config& c, parallel_mode target) {
  detail::check_enum(target, "residency_boundary target (parallel_mode)");
  return target == parallel_mode::ep ? c.t_low : c.t_high;
}

int64_t residency_steps(const switch_policy_config& c, const residency_predictor* predictor,
                        int64_t load, parallel_mode target) {
  const int64_t boundary = residency_boundary(c, target);
  return predictor != nullptr ? predictor->steps_until_cross(load, boundary)
                              : c.expected_residency_steps;
}

switch_policy::switch_policy(const switch_policy_config& config) : config_(config) {
  validate(config_);
}

void switch_policy::set_thresholds(int64_t t_high, int64_t t_low) {
  switch_policy_config c = config_;
  c.t_high = t_high;
  c.t_low = t_low;
  validate(c);
  config_ = c;
}

void switch_policy::reset() {
  stats_ = {};
  seen_mode_ = false;
  cooling_ = false;
  last_switch_step_ = 0;
  last_switch_s_ = 0.0;
  above_run_ = below_run_ = 0;
  ring_head_ = ring_count_ = ring_sum_ = 0;
  undecided_ = false;
}

double switch_policy::window_mean() const {
  return ring_count_ == 0 ? 0.0
                          : static_cast<double>(ring_sum_) / static_cast<double>(ring_count_);
}

void switch_policy::restart_windows(int64_t step_idx, double now_s) {
  cooling_ = true;
  last_switch_step_ = step_idx;
  last_switch_s_ = now_s;
  above_run_ = below_run_ = 0;
  ring_head_ = ring_count_ = ring_sum_ = 0;
}

bool switch_policy::in_cooldown(double now_s) const {
  if (!cooling_) return false;
  // Blocked for the cooldown_steps steps after the switch step, and while less than
  // cooldown_s seconds have passed (a seconds cooldown of 0 ignores the clock entirely, so
  // a caller that passes no meaningful time is never blocked by it).
  return stats_.steps - 1 - last_switch_step_ <= config_.cooldown_steps ||
         (config_.cooldown_s > 0.0 && now_s - last_switch_s_ < config_.cooldown_s);
}

switch_proposal switch_policy::propose(int64_t load, parallel_mode current, double now_s,
                                       bool admission_blocked, bool sustained_gain) {
  MOEBIUS_CHECK(load >= 0, errc::invalid_argument, "load must be >= 0 (load=", load, ")");
  detail::check_enum(current, "switch_policy::propose current (parallel_mode)");
  // A NaN time compares false against everything: the seconds cooldown would never hold.
  MOEBIUS_CHECK(std::isfinite(now_s), errc::invalid_argument,
                "switch_policy::propose now_s must be finite (now_s=", now_s, ")");
  MOEBIUS_CHECK(!undecided_, errc::invalid_argument,
                "switch_policy::propose: the proposal of step ", stats_.steps - 1,
                " was not decided (call decide() after each propose())");
  const int64_t step_idx = stats_.steps++;

  // A mode change the policy did not predict (an operator switch, or a proposed switch that
  // failed and rolled back): a switch all the same, so restart windows and the cooldown.
  if (seen_mode_ && current != last_mode_) {
    ++stats_.external_switches;
    restart_windows(step_idx, now_s);
  }
  seen_mode_ = true;
  last_mode_ = current;

  // Observe.
  const bool blocked = admission_blocked && config_.enter_on_blocked_admission;
  const bool gain = sustained_gain && config_.enter_on_sustained_gain;
  above_run_ = load >= config_.t_high || blocked || gain ? above_run_ + 1 : 0;
  below_run_ = load < config_.t_low ? below_run_ + 1 : 0;
  if (ring_count_ == config_.down_window) {
    ring_sum_ -= ring_[ring_head_];
  } else {
    ++ring_count_;
  }
  const int64_t window_load = std::min(load, max_window_load);
  ring_[ring_head_] = window_load;
  ring_sum_ += window_load;
  ring_head_ = ring_head_ + 1 == config_.down_window ? 0 : ring_head_ + 1;

  switch_proposal p;
  p.load = load;
  p.step = step_idx;
  if (current == parallel_mode::tp) {
    if (above_run_ >= config_.up_window) {
      p.target = parallel_mode::ep;
      p.reason = load >= config_.t_high ? decision_reason::above_high
                 : blocked              ? decision_reason::admission_blocked
                                        : decision_reason::sustained_gain;
    }
  } else if (ring_count_ == config_.down_window) {
    const bool below = config_.rule == down_rule::mean
                           ? ring_sum_ < config_.t_low * config_.down_window
                           : below_run_ >= config_.down_window;
    if (below) {
      p.target = parallel_mode::tp;
      p.reason = decision_reason::below_low;
    }
  }
  if (p.reason != decision_reason::hold && in_cooldown(now_s)) p.reason = decision_reason::cooldown;
  undecided_ = true;
  proposed_s_ = now_s;
  return p;
}

switch_decision switch_policy::decide(const switch_proposal& p, const switch_pricing& priced) {
  MOEBIUS_CHECK(undecided_ && p.step == stats_.steps - 1, errc::invalid_argument,
                "switch_policy::decide: the proposal of step ", p.step,
                " is not the last propose()'s undecided one (steps proposed: ", stats_.steps,
                undecided_ ? "" : ", the last one already decided", ")");
  detail::check_enum(p.reason, "switch_policy::decide proposal reason (decision_reason)");
  undecided_ = false;
  switch_decision d;
  d.target = p.target;
  d.reason = p.reason;
  if (p.proposed()) {
    if (!priced.fits) {
      d.reason = decision_reason::capacity_refused;
    } else if (priced.gate.evaluated && !priced.gate.passed) {
      d.reason = decision_reason::cost_exceeds_gain;
    } else {
      d.do_switch = true;
      ++stats_.switches;
      restart_windows(p.step, proposed_s_);
      last_mode_ = d.target;  // expected next step; anything else is a failed switch
    }
  }
  ++stats_.by_reason[static_cast<int>(d.reason)];
  return d;
}

}  // namespace moebius
