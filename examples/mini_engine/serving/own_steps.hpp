#pragma once

// A run's own steps priced again by another clock (mini_engine_fidelity: the GPU runtime's
// measured steps priced by the simulated runtime's clocks): where a simulated run's error comes
// from, per kind of step and per mode. And a clock rescaled per kind of step, to ask what is
// left of each metric's error once the step prices are right on average.

#include <cstdint>

#include "run_report.hpp"
#include "step_clock.hpp"

namespace mini_engine {

// A step that decodes only; one that prefills as many tokens as its budget holds (decodes and
// chunks together); one that prefills fewer (a short prompt, or a prompt's tail).
enum class own_step_kind { decode = 0, prefill_full = 1, prefill_small = 2 };

// `s`'s kind under a budget of `step_tokens` tokens a step.
own_step_kind kind_of(const step_record& s, int64_t step_tokens);

// The cost `s` was priced as, rebuilt from its record on a deployment of `P` ranks:
// configuration, number of ranks, sequences, new tokens (decode + prefill) and context. Its EP
// split over the ranks (step_cost::ranks) is left to the caller.
step_cost cost_of(const step_record& s, int P);

// Steps summed: how many, their measured ms and the ms one clock priced them at.
struct own_step_sums {
  int64_t steps = 0;
  double measured_ms = 0, priced_ms = 0;
  // priced / measured (0 for no measured time).
  double ratio() const { return measured_ms > 0 ? priced_ms / measured_ms : 0.0; }
  own_step_sums& operator+=(const own_step_sums& o);
};

struct own_step_prices {
  own_step_sums by_kind[3];     // [own_step_kind]
  own_step_sums by_mode[2][3];  // [EP, TP][own_step_kind], by the attention's layout
  // EP steps at P > 1 without a recorded split over the ranks (step_record::ranks: a step of
  // a progressive switch), which cannot be priced as the clock was given them.
  int64_t skipped = 0;
  // measured / priced of the decode steps, and of the steps that prefill (both kinds): the
  // factors rescaled_clock takes (1 where a kind has no priced time).
  double decode_factor() const;
  double prefill_factor() const;
};

// Every step of `r` outside a switch with at least one sequence, priced by `clock` on a
// deployment of `P` ranks: its cost rebuilt from the record (configuration, sequences, tokens,
// context; an EP step at P > 1 by its recorded split, at P = 1 as one rank's), priced with its
// measured time, and summed per kind (budget `step_tokens`) and mode.
own_step_prices price_own_steps(const run_result& r, const step_clock& clock, int P,
                                int64_t step_tokens);

// `base` with each step's seconds times a factor per kind: decode_factor for a step that only
// decodes (every item one token), prefill_factor for one that prefills. Switches, links,
// predictions and slowdown are base's; name() is its own. Holds a reference to `base`.
class rescaled_clock final : public step_clock {
 public:
  // Throws errc::invalid_argument unless both factors are finite and > 0.
  rescaled_clock(const step_clock& base, double decode_factor, double prefill_factor);

  double step_s(const step_cost& cost, double measured_s) const override;
  double switch_s(const moebius::switch_report& r) const override { return base_.switch_s(r); }
  const char* name() const override { return "rescaled per kind of step"; }
  bool needs_measurement() const override { return base_.needs_measurement(); }
  int64_t layer_bytes(const moebius::layer_bytes& run, int64_t layers) const override {
    return base_.layer_bytes(run, layers);
  }
  moebius::link_rate link() const override { return base_.link(); }
  double copies_s(const switch_copies& c) const override { return base_.copies_s(c); }
  double predicted_switch_s(const moebius::layer_bytes& run, int64_t layers) const override {
    return base_.predicted_switch_s(run, layers);
  }
  double predicted_kv_switch_s(const moebius::layer_bytes& run, int64_t layers) const override {
    return base_.predicted_kv_switch_s(run, layers);
  }
  overlap_slowdown slowdown() const override { return base_.slowdown(); }

 private:
  const step_clock& base_;
  double decode_, prefill_;
};

}  // namespace mini_engine
