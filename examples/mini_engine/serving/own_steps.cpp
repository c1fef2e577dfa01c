#include "own_steps.hpp"

#include <cmath>
#include <vector>

#include <moebius/error.hpp>

namespace mini_engine {

using moebius::errc;
using moebius::parallel_mode;

own_step_kind kind_of(const step_record& s, int64_t step_tokens) {
  if (s.prefill_tokens == 0) return own_step_kind::decode;
  return s.decode_tokens + s.prefill_tokens >= step_tokens ? own_step_kind::prefill_full
                                                           : own_step_kind::prefill_small;
}

step_cost cost_of(const step_record& s, int P) {
  step_cost cost;
  cost.set(s.config);
  cost.num_ranks = P;
  cost.num_sequences = s.sequences;
  cost.new_tokens = s.decode_tokens + s.prefill_tokens;
  cost.context_tokens = s.context_tokens;
  return cost;
}

own_step_sums& own_step_sums::operator+=(const own_step_sums& o) {
  steps += o.steps;
  measured_ms += o.measured_ms;
  priced_ms += o.priced_ms;
  return *this;
}

namespace {
double factor_of(const own_step_sums& x) {
  return x.priced_ms > 0 ? x.measured_ms / x.priced_ms : 1.0;
}
}  // namespace

double own_step_prices::decode_factor() const {
  return factor_of(by_kind[static_cast<int>(own_step_kind::decode)]);
}

double own_step_prices::prefill_factor() const {
  own_step_sums prefills = by_kind[static_cast<int>(own_step_kind::prefill_full)];
  prefills += by_kind[static_cast<int>(own_step_kind::prefill_small)];
  return factor_of(prefills);
}

own_step_prices price_own_steps(const run_result& r, const step_clock& clock, int P,
                                int64_t step_tokens) {
  MOEBIUS_CHECK(P >= 1 && step_tokens >= 1, errc::invalid_argument,
                "price_own_steps: P and step_tokens must be >= 1 (got ", P, ", ", step_tokens, ")");
  own_step_prices out;
  for (const step_record& s : r.steps) {
    if (s.sequences <= 0 || s.in_switch) continue;
    step_cost cost = cost_of(s, P);
    if (cost.mode == parallel_mode::ep) {
      if (P > 1 && static_cast<int>(s.ranks.size()) != P) {
        ++out.skipped;
        continue;
      }
      cost.ranks = P > 1 ? s.ranks
                         : std::vector<rank_work>{
                               rank_work{cost.num_sequences, cost.new_tokens, cost.context_tokens}};
    }
    const own_step_sums one{1, s.measured_ms, clock.step_s(cost, s.measured_ms * 1e-3) * 1e3};
    const int kind = static_cast<int>(kind_of(s, step_tokens));
    out.by_kind[kind] += one;
    out.by_mode[cost.mode == parallel_mode::ep ? 0 : 1][kind] += one;
  }
  return out;
}

rescaled_clock::rescaled_clock(const step_clock& base, double decode_factor,
                               double prefill_factor)
    : base_(base), decode_(decode_factor), prefill_(prefill_factor) {
  MOEBIUS_CHECK(std::isfinite(decode_factor) && decode_factor > 0 &&
                    std::isfinite(prefill_factor) && prefill_factor > 0,
                errc::invalid_argument, "rescaled_clock: factors must be finite and > 0 (got ",
                decode_factor, ", ", prefill_factor, ")");
}

double rescaled_clock::step_s(const step_cost& cost, double measured_s) const {
  const bool prefills = cost.new_tokens > cost.num_sequences;  // a decode item is one token
  return base_.step_s(cost, measured_s) * (prefills ? prefill_ : decode_);
}

}  // namespace mini_engine
