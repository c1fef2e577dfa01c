#pragma once

// Predicts how long a switch takes, analytically in P, model size and link bandwidth, and
// refines itself from measured switches.
//
//   total = weight_bytes / bw + kv_bytes / kv_bw                 (bytes leaving each rank)
//         + (weight_phases + kv_rounds) · (barrier + launch)     (one barrier per phase)
//         + fixed                                                (page tables, pointer flip)
//
// Bytes are what leaves the busiest rank: a switch is an all-to-all, each rank sends and
// receives concurrently, the link's one direction is the bottleneck. Bandwidths are
// effective rates (link_rate) per GPU per direction.
// Anchor (DESIGN.md §6, paper): 50 GB leaving each GPU at 330 GB/s -> 151.5 ms.

#include <cstdint>
#include <iosfwd>
#include <vector>

#include "moebius/layout/arena_geometry.hpp"
#include "moebius/plan/plan.hpp"
#include "moebius/plan/switch_workload.hpp"
#include "moebius/transport/link_rate.hpp"

namespace moebius {

struct link_params {
  link_rate bandwidth = link_rate::gb_per_s(330);  // effective weight-copy rate, per GPU
  link_rate kv_bandwidth{};  // effective KV-page rate; 0: same as bandwidth
  double barrier_us = 10.0;  // one cross-rank barrier (device flags)
  double launch_us = 5.0;    // launching one phase (kernel or graph node)
  double fixed_ms = 0.0;     // per switch, independent of bytes and phases

  link_rate effective_kv_bandwidth() const {
    return kv_bandwidth.bytes_per_s > 0 ? kv_bandwidth : bandwidth;
  }
};

// Throws errc::invalid_argument unless bandwidth > 0, kv bandwidth >= 0, barrier, launch and
// fixed >= 0 (all finite).
void validate(const link_params& link);

// Throws errc::invalid_argument unless num_ranks >= 1 and every count >= 0.
void validate(const switch_workload& w);

// The weight part of switching `num_layers` layers of `geometry` (either direction):
// (P-1)/P of the layer's expert bytes per rank leave each rank, one phase per layer.
//   Qwen3-235B, P=8, 94 layers: 94 · 7/8 · 603,979,776 = 49,677,336,576 B, 94 phases.
// Throws errc::invalid_argument unless 0 <= num_layers <= L.
switch_workload weight_switch_workload(const arena_geometry& geometry, int64_t num_layers);

struct switch_cost {
  double weight_ms = 0;
  double kv_ms = 0;
  double barrier_ms = 0;
  double launch_ms = 0;
  double fixed_ms = 0;

  double total_ms() const { return weight_ms + kv_ms + barrier_ms + launch_ms + fixed_ms; }
};

// "total 152.3 ms = weights 150.5 + kv 0 + barriers 0.94 + launches 0.47 + fixed 0"
std::ostream& operator<<(std::ostream& os, const switch_cost& c);

// One measured switch.
struct switch_measurement {
  switch_workload workload;
  double measured_ms = 0;
};

struct cost_fit_result {
  bool ok = false;              // false: too few or inconsistent samples, link unchanged
  const char* why = "";         // why not ok
  int num_samples = 0;
  double rms_error_ms = 0;      // after the fit (or of the unchanged model when !ok)
};

class cost_model {
 public:
  // Validates `link`.
  explicit cost_model(const link_params& link = {});

  // Time of one switch, broken down. Validates `w`.
  switch_cost predict(const switch_workload& w) const;

  // Records a measured switch (validated; measured_ms finite and > 0) and refits.
  cost_fit_result update(const switch_measurement& m);

  // Least squares over all recorded measurements of
  //   measured - (phases + rounds)·(barrier + launch) = bytes_eff / bw + fixed
  // where bytes_eff = weight_bytes + kv_bytes · bw / kv_bw (the KV/weight rate ratio is
  // kept), refining the bandwidths and fixed_ms. With one distinct byte count only the
  // bandwidth is refined (fixed kept). A fit that gives a non-positive bandwidth or a
  // negative fixed overhead leaves the link unchanged and says so.
  cost_fit_result refit();

  const link_params& link() const { return link_; }
  const std::vector<switch_measurement>& measurements() const { return measurements_; }

  // One line per measurement: bytes, predicted, measured, relative error; then the link.
  void report(std::ostream& os) const;

 private:
  link_params link_;
  std::vector<switch_measurement> measurements_;
};

std::ostream& operator<<(std::ostream& os, const link_params& l);

}  // namespace moebius
