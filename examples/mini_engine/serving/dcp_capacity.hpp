#pragma once

// What the dcp-only design's capacity rule (run_policy::decide_for_capacity) reads in an open
// loop (requests arrive on their own) before it counts KV still to come against the smaller
// dcp's pool: whether the pool keeping a queue out costs throughput, and whether the running
// sequences' KV grows at all. A closed-loop rollout counts both without asking: nothing is
// admitted into the space its finished sequences free.

#include <cstdint>

#include <moebius/policy/calibration.hpp>

namespace mini_engine {

// An exponential mean over the recent steps (by default weight 1/64 a step: the residency
// predictor's weight of one completion), unbiased from its start: the mean over the weight it
// has gathered, so the first steps count as themselves, not toward 0.
class recent_mean {
 public:
  static constexpr double k_weight = 1.0 / 64;
  // Throws errc::invalid_argument unless 0 < weight <= 1.
  explicit recent_mean(double weight = k_weight);
  void add(double x);
  bool seen() const { return gathered_ > 0; }
  double value() const { return seen() ? mean_ / gathered_ : 0; }

 private:
  double weight_;
  double mean_ = 0, gathered_ = 0;
};

// A queue that the smaller dcp's pool keeps out (admission blocked): whether the larger pool's
// fuller steps would serve more tokens a second, by more than `margin` (the gate's). The
// recent steps' rows (`rows_now`: decode and prefill tokens a step) priced on `small`, against
// the rows the step's token budget would carry with the queue admitted,
// min(step_tokens, rows_now + waiting_tokens), priced on `large`. Steps already compute-bound
// (time growing with the rows) gain nothing from more KV but longer steps, and every running
// sequence's TPOT with them (a production-shaped trace at 3.9x load: ~6,350 rows a step against
// the budget's 8,192, about 2% more tokens a second on the curves, TPOT +21% at dcp 2).
//   rows_now 64, step_tokens 8,192, curves flat at 10 ms -> true (128x the tokens a second)
//   curves 0.01 ms a row through 0                        -> false (the same tokens a second)
// Throws errc::invalid_argument unless rows_now > 0, step_tokens > 0, waiting_tokens >= 0 and
// margin >= 0.
bool fuller_steps_pay(double rows_now, int64_t step_tokens, int64_t waiting_tokens,
                      const moebius::latency_curve& small, const moebius::latency_curve& large,
                      double margin);

// Whether the running sequences' KV grows: each running sequence's decode token a step against
// what the recent completions a step free, each taken as a live sequence's mean tokens
// (running_tokens / running; a finishing sequence holds more, so the estimate leans to growth).
// Where the completions free more, the running set never outgrows the pool that admission fills
// (that trace: 754 running, ~3.6 completions a step freeing ~6,300 tokens against 754 grown).
// No running sequence: true (nothing frees). Throws errc::invalid_argument for a negative
// count or a non-finite or negative completions_a_step.
bool live_set_grows(int64_t running, int64_t running_tokens, double completions_a_step);

}  // namespace mini_engine
