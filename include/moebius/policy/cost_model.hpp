#pragma once

// Predicts how long a switch takes, analytically in P, model size and link bandwidth, and
// refines itself from measured switches.
//
//   total = weight_bytes / bw + kv_bytes / kv_bw                 (bytes leaving each rank)
//         + (weight_phases + kv_rounds) · (barrier + launch)     (one barrier per phase)
//         + fixed                                                (page tables, pointer flip)
//
// Over several nodes the bytes bound for another node (switch_workload's internode bytes) take
// the rank's NIC at link_params::internode while the bytes within the node take NVLink: the two
// run side by side, so the copies last the longer of the two,
//   copies = max(weight_bytes / bw + kv_bytes / kv_bw, internode_bytes / internode),
// and every barrier of such a switch spans the nodes (internode_barrier_us).
//   Two nodes of 8, 28,387,049,472 B across at 50 GB/s, 24,838,668,288 B within at 395 GB/s:
//   copies max(62.9, 567.7) = 567.7 ms.
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
  // Between nodes: what one GPU's NIC moves per direction (an InfiniBand NDR ConnectX-7,
  // 400 Gb/s: ~50 GB/s). 0: one node, and a workload with internode bytes is refused.
  link_rate internode{};
  double barrier_us = 10.0;  // one cross-rank barrier (device flags)
  // One barrier spanning nodes, for every barrier of a switch whose copies cross nodes (a
  // round trip over the network); 0: barrier_us.
  double internode_barrier_us = 0.0;
  double launch_us = 5.0;    // launching one phase (kernel or graph node)
  double fixed_ms = 0.0;     // per switch, independent of bytes and phases

  link_rate effective_kv_bandwidth() const {
    return kv_bandwidth.bytes_per_s > 0 ? kv_bandwidth : bandwidth;
  }
};

// Throws errc::invalid_argument unless bandwidth > 0, kv and internode bandwidths >= 0,
// barrier, internode barrier, launch and fixed >= 0 (all finite).
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
  // The cross-node copies beyond the in-node ones (weight_ms + kv_ms), which they run beside:
  // max(0, internode bytes / internode - weight_ms - kv_ms). 0 on one node.
  double internode_ms = 0;
  double barrier_ms = 0;
  double launch_ms = 0;
  double fixed_ms = 0;

  double total_ms() const {
    return weight_ms + kv_ms + internode_ms + barrier_ms + launch_ms + fixed_ms;
  }
};

// "total 152.3 ms = weights 150.5 + kv 0 + barriers 0.94 + launches 0.47 + fixed 0"; with
// cross-node bytes, "+ internode X" after kv.
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

  // Time of one switch, broken down. Validates `w`; throws errc::invalid_argument naming the
  // internode bytes when `w` has some and the link no internode rate.
  switch_cost predict(const switch_workload& w) const;

  // Records a measured switch (validated; measured_ms finite and > 0) and refits. The fit is of
  // the in-node link: a switch with internode bytes is refused (errc::invalid_argument).
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
