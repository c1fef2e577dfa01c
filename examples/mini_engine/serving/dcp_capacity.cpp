#include "dcp_capacity.hpp"

#include <algorithm>
#include <cmath>

#include <moebius/error.hpp>

namespace mini_engine {

using moebius::errc;

recent_mean::recent_mean(double weight) : weight_(weight) {
  MOEBIUS_CHECK(weight > 0 && weight <= 1, errc::invalid_argument, "recent_mean: weight (", weight,
                ") must be in (0, 1]");
}

void recent_mean::add(double x) {
  mean_ += weight_ * (x - mean_);
  gathered_ += weight_ * (1 - gathered_);
}

bool fuller_steps_pay(double rows_now, int64_t step_tokens, int64_t waiting_tokens,
                      const moebius::latency_curve& small, const moebius::latency_curve& large,
                      double margin) {
  MOEBIUS_CHECK(rows_now > 0 && step_tokens > 0 && waiting_tokens >= 0 && margin >= 0,
                errc::invalid_argument, "fuller_steps_pay: rows_now (", rows_now,
                ") and step_tokens (", step_tokens, ") must be > 0, waiting_tokens (",
                waiting_tokens, ") and margin (", margin, ") >= 0");
  const double rows_full =
      std::max(rows_now, std::min(static_cast<double>(step_tokens),
                                  rows_now + static_cast<double>(waiting_tokens)));
  const double now_per_ms = rows_now / small.at(rows_now);
  const double full_per_ms = rows_full / large.at(rows_full);
  return full_per_ms > (1 + margin) * now_per_ms;
}

bool live_set_grows(int64_t running, int64_t running_tokens, double completions_a_step) {
  MOEBIUS_CHECK(running >= 0 && running_tokens >= 0 && std::isfinite(completions_a_step) &&
                    completions_a_step >= 0,
                errc::invalid_argument, "live_set_grows: running (", running,
                "), running_tokens (", running_tokens, ") and completions_a_step (",
                completions_a_step, ") must be >= 0 and finite");
  if (running == 0) return true;
  const double freed_a_step = completions_a_step * static_cast<double>(running_tokens) /
                              static_cast<double>(running);
  return static_cast<double>(running) > freed_a_step;
}

}  // namespace mini_engine
