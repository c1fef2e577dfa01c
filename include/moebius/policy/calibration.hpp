#pragma once

// Threshold calibration: T_h and T_l, otherwise hand-tuned for one model on one machine, are
// derived from measurements. At start-up the engine measures the decode-step latency of each mode at a few
// batch sizes; this fits one latency curve per mode, finds the crossover B* where TP stops
// being faster than EP, and derives T_h / T_l from it, so no hand tuning is needed.
//
// Curve fit. Default: a least-squares line per mode. A decode step is close to affine in
// the batch over the CUDA-graph range (a fixed part: reading the expert and attention
// weights, launches, TP all-reduce / EP all-to-all latency; a per-sequence part: compute,
// KV reads, token bytes), and a line averages out measurement noise, so two noisy curves
// cross once, at a B* that does not jump between neighbouring samples. Alternative:
// piecewise-linear interpolation through the (duplicate-averaged) samples, for dense,
// low-noise measurements of curves with visible kinks (graph buckets, the memory-bound to
// compute-bound knee); noise then shows up as several crossings (reported).

#include <cstdint>
#include <iosfwd>
#include <span>
#include <vector>

#include "moebius/detail/enum_check.hpp"
#include "moebius/layout/parallel_mode.hpp"
#include "moebius/policy/switch_policy.hpp"

namespace moebius {

// One measurement: decode-step latency `ms` at `batch` active sequences.
struct latency_sample {
  double batch = 0;
  double ms = 0;
};

enum class curve_fit : uint8_t { least_squares_line, piecewise_linear };

constexpr bool is_valid(curve_fit f) {
  return f == curve_fit::least_squares_line || f == curve_fit::piecewise_linear;
}

constexpr const char* to_string(curve_fit f) {
  switch (f) {
    case curve_fit::least_squares_line: return "least_squares_line";
    case curve_fit::piecewise_linear: return "piecewise_linear";
  }
  return "unknown";
}

// Step latency of one mode as a function of the batch. Evaluation allocates nothing.
class latency_curve {
 public:
  latency_curve() = default;

  // Throws errc::invalid_argument unless every sample has a finite batch > 0 and a finite
  // ms > 0, at least two distinct batches are given and `kind` is a curve_fit value.
  //   fit({{1, 10}, {3, 14}}, least_squares_line) -> 8 + 2·batch
  static latency_curve fit(std::span<const latency_sample> samples, curve_fit kind);

  // Latency at `batch`; outside the measured range a line extends, a piecewise curve
  // extends its end segments.
  double at(double batch) const;

  curve_fit kind() const { return kind_; }
  double min_batch() const { return min_batch_; }
  double max_batch() const { return max_batch_; }
  double slope() const { return slope_; }          // line: ms per sequence
  double intercept() const { return intercept_; }  // line: ms at batch 0
  // Piecewise: the knots (sorted by batch, duplicates averaged); line: empty.
  const std::vector<latency_sample>& knots() const { return knots_; }

 private:
  curve_fit kind_ = curve_fit::least_squares_line;
  double slope_ = 0;
  double intercept_ = 0;
  double min_batch_ = 0;
  double max_batch_ = 0;
  std::vector<latency_sample> knots_;
};

// Both modes' curves (what the policy's cost gate reads).
class latency_curves {
 public:
  latency_curve ep;
  latency_curve tp;

  // The mode's curve. Throws errc::invalid_argument for a mode that names neither EP nor TP.
  const latency_curve& of(parallel_mode mode) const {
    detail::check_enum(mode, "latency_curves mode (parallel_mode)");
    return mode == parallel_mode::ep ? ep : tp;
  }
  double latency_ms(parallel_mode mode, double batch) const { return of(mode).at(batch); }
};

enum class crossover_status : uint8_t {
  found,              // TP faster below B*, EP faster above, inside the common range
  tp_always_faster,   // no crossing in range: stay in TP (or measure larger batches)
  ep_always_faster,   // no crossing in range: stay in EP (or measure smaller batches)
  wrong_orientation,  // EP faster below, TP above: contradicts eq. 5, measurement suspect
};

constexpr bool is_valid(crossover_status s) {
  return static_cast<uint8_t>(s) <= static_cast<uint8_t>(crossover_status::wrong_orientation);
}

constexpr const char* to_string(crossover_status s) {
  switch (s) {
    case crossover_status::found: return "found";
    case crossover_status::tp_always_faster: return "tp_always_faster";
    case crossover_status::ep_always_faster: return "ep_always_faster";
    case crossover_status::wrong_orientation: return "wrong_orientation";
  }
  return "unknown";
}

struct crossover {
  crossover_status status = crossover_status::tp_always_faster;
  double batch = 0;        // B* (valid when status == found)
  int num_crossings = 0;   // sign changes of tp - ep inside [range_lo, range_hi]
  double range_lo = 0;     // common measured range of both modes
  double range_hi = 0;
};

// Where tp(b) - ep(b) turns from negative to non-negative inside the common measured
// range; for piecewise curves the last such crossing (exact: both curves are linear between
// the merged knots), above which EP stays faster: measured curves can touch at small batch
// (EP 34.4 ms against TP 34.7 ms at batch 16 on Qwen3-235B's, TP ahead again from 32) and
// cross for good near 200; B* is the latter.
//   ep = 20 + 0.05·b, tp = 10 + 0.1·b, measured on [1, 512] -> found, B* = 200
crossover find_crossover(const latency_curves& curves);

struct calibration_options {
  curve_fit fit = curve_fit::least_squares_line;
  // T_h = ceil(B*·(1 + margin)); with the default 0.25 and low_ratio 0.8, T_l = B*: the
  // policy leaves EP only once TP is actually faster, and enters EP 25% past the crossover,
  // the same shape as the paper's hand-set T_h = 256 for B* ≈ 128–256.
  double margin = 0.25;
  double low_ratio = 0.8;  // T_l = max(1, round(low_ratio · T_h)) (paper)
};

// Throws errc::invalid_argument unless margin >= 0 and 0 < low_ratio <= 1 (both finite) and
// fit is a curve_fit value.
void validate(const calibration_options& options);

struct calibration_result {
  latency_curves curves;
  crossover cross;
  bool has_thresholds = false;  // cross.status == found
  int64_t t_high = 0;
  int64_t t_low = 0;
};

// Fits both curves, finds B* and derives T_h / T_l. Throws errc::invalid_argument for bad
// samples or options (see latency_curve::fit, validate), errc::overflow when the derived T_h
// exceeds the policy's limit of 2^40.
//   ep = 20 + 0.05·b, tp = 10 + 0.1·b sampled at 1..512, margin 0.25 -> B* 200, T_h 250,
//   T_l 200.
calibration_result calibrate(std::span<const latency_sample> ep_samples,
                             std::span<const latency_sample> tp_samples,
                             const calibration_options& options = {});

// `base` with T_h / T_l from `result`. Throws errc::invalid_argument naming the crossover
// status when the curves did not cross in range (there is no threshold to derive).
switch_policy_config apply_calibration(const calibration_result& result,
                                       switch_policy_config base);

std::ostream& operator<<(std::ostream& os, const latency_curve& c);
std::ostream& operator<<(std::ostream& os, const crossover& c);
std::ostream& operator<<(std::ostream& os, const calibration_result& r);

}  // namespace moebius
