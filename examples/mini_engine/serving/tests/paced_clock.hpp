#pragma once

// The serving tests' clock: 10 ms per step in either mode, free switches, and a link that fits
// `layers` + 1/2 layers of 1 MB per step at the engine's copy fraction (0.55), so that
// progressive pacing advances exactly `layers` layers per step. With `slowdown_per_mb` > 0 it
// also has an overlap slowdown curve: each 1 MB copied beside a step makes it that share longer
// (0.04: 4%); without, none (pacing by the link alone).

#include <cstdint>

#include "step_clock.hpp"

namespace mini_engine::testing {

class paced_clock final : public step_clock {
 public:
  explicit paced_clock(int64_t layers = 1, double slowdown_per_mb = 0)
      : layers_(layers), slowdown_per_mb_(slowdown_per_mb) {}
  double step_s(const step_cost&, double) const override { return 0.01; }
  double switch_s(const moebius::switch_report&) const override { return 0.0; }
  const char* name() const override { return "paced"; }
  bool needs_measurement() const override { return false; }
  int64_t layer_bytes(const moebius::layer_bytes&, int64_t) const override { return 1'000'000; }
  moebius::link_rate link() const override {
    return moebius::link_rate{(static_cast<double>(layers_) + 0.5) * 1e6 / (0.01 * 0.55)};
  }
  overlap_slowdown slowdown() const override {
    if (slowdown_per_mb_ <= 0) return {};
    return {[](const void* c, double, int64_t bytes) {
              return 1.0 + static_cast<const paced_clock*>(c)->slowdown_per_mb_ *
                               static_cast<double>(bytes) / 1e6;
            },
            this};
  }

 private:
  int64_t layers_;
  double slowdown_per_mb_;
};

}  // namespace mini_engine::testing
