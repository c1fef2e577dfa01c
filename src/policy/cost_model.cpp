#include "moebius/policy/cost_model.hpp"

#include <algorithm>
#include <cmath>
#include <ostream>

#include "moebius/detail/checked_math.hpp"
#include "moebius/error.hpp"

namespace moebius {

namespace {

bool finite_nonneg(double x) { return std::isfinite(x) && x >= 0; }

// ms to move `bytes` at `rate`.
double transfer_ms(int64_t bytes, link_rate rate) {
  return static_cast<double>(bytes) * 1e3 / rate.bytes_per_s;
}

// In double: both counts are user inputs, and their int64 sum may wrap.
double sync_points(const switch_workload& w) {
  return static_cast<double>(w.weight_phases) + static_cast<double>(w.kv_rounds);
}

}  // namespace

void validate(const link_params& l) {
  MOEBIUS_CHECK(std::isfinite(l.bandwidth.bytes_per_s) && l.bandwidth.bytes_per_s > 0,
                errc::invalid_argument, "link bandwidth must be finite and > 0 GB/s (bandwidth=",
                l.bandwidth.gb_per_s(), " GB/s)");
  MOEBIUS_CHECK(finite_nonneg(l.kv_bandwidth.bytes_per_s), errc::invalid_argument,
                "kv bandwidth must be finite and >= 0 GB/s, 0 meaning the weight rate "
                "(kv_bandwidth=", l.kv_bandwidth.gb_per_s(), " GB/s)");
  MOEBIUS_CHECK(finite_nonneg(l.internode.bytes_per_s), errc::invalid_argument,
                "internode bandwidth must be finite and >= 0 GB/s, 0 meaning one node "
                "(internode=", l.internode.gb_per_s(), " GB/s)");
  MOEBIUS_CHECK(finite_nonneg(l.barrier_us) && finite_nonneg(l.launch_us) &&
                    finite_nonneg(l.fixed_ms) && finite_nonneg(l.internode_barrier_us),
                errc::invalid_argument,
                "barrier, launch and fixed overheads must be finite and >= 0 (barrier_us=",
                l.barrier_us, ", internode_barrier_us=", l.internode_barrier_us,
                ", launch_us=", l.launch_us, ", fixed_ms=", l.fixed_ms, ")");
}

void validate(const switch_workload& w) {
  MOEBIUS_CHECK(w.num_ranks >= 1, errc::invalid_argument,
                "a switch workload needs num_ranks >= 1 (num_ranks=", w.num_ranks, ")");
  MOEBIUS_CHECK(w.weight_bytes_per_rank >= 0 && w.kv_bytes_per_rank >= 0 &&
                    w.weight_phases >= 0 && w.kv_rounds >= 0 && w.internode_bytes_per_rank >= 0,
                errc::invalid_argument,
                "switch workload counts must be >= 0 (weight_bytes=", w.weight_bytes_per_rank,
                ", kv_bytes=", w.kv_bytes_per_rank, ", internode_bytes=",
                w.internode_bytes_per_rank, ", phases=", w.weight_phases,
                ", kv_rounds=", w.kv_rounds, ")");
}

switch_workload weight_switch_workload(const arena_geometry& g, int64_t num_layers) {
  validate(g);
  MOEBIUS_CHECK(num_layers >= 0 && num_layers <= g.shape.num_layers, errc::invalid_argument,
                "layers to switch must lie in [0, L] (num_layers=", num_layers,
                ", L=", g.shape.num_layers, ")");
  MOEBIUS_CHECK(g.num_ranks >= 1, errc::invalid_argument,
                "geometry needs num_ranks >= 1 (num_ranks=", g.num_ranks, ")");
  switch_workload w;
  w.num_ranks = g.num_ranks;
  // Every tensor's per-rank bytes split into P equal pieces (P | E and P | I), one per peer;
  // the piece for the rank itself stays.
  int64_t per_layer = 0;
  for (int64_t b : g.tensor_bytes) {
    per_layer = detail::checked_add(per_layer, b / g.num_ranks * (g.num_ranks - 1),
                                    "bytes leaving a rank per layer");
  }
  w.weight_bytes_per_rank = detail::checked_mul(per_layer, num_layers, "bytes leaving a rank");
  w.weight_phases = num_layers;
  return w;
}

std::ostream& operator<<(std::ostream& os, const switch_cost& c) {
  os << "total " << c.total_ms() << " ms = weights " << c.weight_ms << " + kv " << c.kv_ms;
  if (c.internode_ms > 0) os << " + internode " << c.internode_ms;
  return os << " + barriers " << c.barrier_ms << " + launches " << c.launch_ms << " + fixed "
            << c.fixed_ms;
}

std::ostream& operator<<(std::ostream& os, const link_params& l) {
  os << "link{" << l.bandwidth.gb_per_s() << " GB/s, kv " << l.effective_kv_bandwidth().gb_per_s()
     << " GB/s, barrier " << l.barrier_us << " us, launch " << l.launch_us << " us, fixed "
     << l.fixed_ms << " ms";
  if (l.internode.bytes_per_s > 0) {
    os << "; internode " << l.internode.gb_per_s() << " GB/s, barrier "
       << (l.internode_barrier_us > 0 ? l.internode_barrier_us : l.barrier_us) << " us";
  }
  return os << "}";
}

cost_model::cost_model(const link_params& link) : link_(link) { validate(link_); }

switch_cost cost_model::predict(const switch_workload& w) const {
  validate(w);
  const bool crosses = w.internode_bytes_per_rank > 0;
  MOEBIUS_CHECK(!crosses || link_.internode.bytes_per_s > 0, errc::invalid_argument,
                "a switch workload with internode bytes needs the link's internode rate "
                "(internode_bytes=", w.internode_bytes_per_rank, ", internode=0 GB/s)");
  switch_cost c;
  c.weight_ms = transfer_ms(w.weight_bytes_per_rank, link_.bandwidth);
  c.kv_ms = transfer_ms(w.kv_bytes_per_rank, link_.effective_kv_bandwidth());
  if (crosses) {
    // The NIC's copies run beside NVLink's: only what outlasts them adds.
    c.internode_ms = std::max(
        0.0, transfer_ms(w.internode_bytes_per_rank, link_.internode) - c.weight_ms - c.kv_ms);
  }
  const double n = static_cast<double>(sync_points(w));
  const double barrier_us =
      crosses && link_.internode_barrier_us > 0 ? link_.internode_barrier_us : link_.barrier_us;
  c.barrier_ms = n * barrier_us * 1e-3;
  c.launch_ms = n * link_.launch_us * 1e-3;
  c.fixed_ms = link_.fixed_ms;
  return c;
}

cost_fit_result cost_model::update(const switch_measurement& m) {
  validate(m.workload);
  MOEBIUS_CHECK(std::isfinite(m.measured_ms) && m.measured_ms > 0, errc::invalid_argument,
                "a measured switch time must be finite and > 0 ms (measured_ms=",
                m.measured_ms, ")");
  MOEBIUS_CHECK(m.workload.internode_bytes_per_rank == 0, errc::invalid_argument,
                "a measured switch whose copies cross nodes cannot refine the in-node link "
                "(internode_bytes=", m.workload.internode_bytes_per_rank, ")");
  measurements_.push_back(m);
  return refit();
}

cost_fit_result cost_model::refit() {
  cost_fit_result r;
  r.num_samples = static_cast<int>(measurements_.size());
  auto rms = [&](const link_params& l) {
    if (measurements_.empty()) return 0.0;
    cost_model probe(l);
    double s = 0;
    for (const switch_measurement& m : measurements_) {
      const double e = probe.predict(m.workload).total_ms() - m.measured_ms;
      s += e * e;
    }
    return std::sqrt(s / static_cast<double>(measurements_.size()));
  };
  if (measurements_.empty()) {
    r.why = "no measurements";
    return r;
  }
  // y = x · 1e3 / bw + fixed (ms, bw in B/s), x = weight_bytes + kv_bytes · bw / kv_bw.
  const double kv_ratio =
      link_.bandwidth.bytes_per_s / link_.effective_kv_bandwidth().bytes_per_s;
  const double per_sync_ms = (link_.barrier_us + link_.launch_us) * 1e-3;
  std::vector<double> xs, ys;
  for (const switch_measurement& m : measurements_) {
    xs.push_back(static_cast<double>(m.workload.weight_bytes_per_rank) +
                 static_cast<double>(m.workload.kv_bytes_per_rank) * kv_ratio);
    ys.push_back(m.measured_ms - static_cast<double>(sync_points(m.workload)) * per_sync_ms);
  }
  const double n = static_cast<double>(xs.size());
  double mx = 0, my = 0;
  for (size_t i = 0; i < xs.size(); ++i) {
    mx += xs[i];
    my += ys[i];
  }
  mx /= n;
  my /= n;
  double sxx = 0, sxy = 0;
  for (size_t i = 0; i < xs.size(); ++i) {
    sxx += (xs[i] - mx) * (xs[i] - mx);
    sxy += (xs[i] - mx) * (ys[i] - my);
  }
  double slope = 0, fixed = link_.fixed_ms;
  // Relative spread of the byte counts: below 1e-9 they are one point, fit the rate only.
  if (sxx <= 1e-18 * mx * mx * n) {
    slope = mx > 0 ? (my - fixed) / mx : 0;
  } else {
    slope = sxy / sxx;
    fixed = my - slope * mx;
  }
  if (!(slope > 0) || !std::isfinite(slope)) {
    r.why = "fit gives a non-positive bandwidth (times do not grow with bytes)";
    r.rms_error_ms = rms(link_);
    return r;
  }
  if (fixed < 0) {
    r.why = "fit gives a negative fixed overhead (barrier/launch costs set too high?)";
    r.rms_error_ms = rms(link_);
    return r;
  }
  link_params next = link_;
  next.bandwidth = link_rate{1e3 / slope};
  if (link_.kv_bandwidth.bytes_per_s > 0) {
    next.kv_bandwidth = link_rate{next.bandwidth.bytes_per_s / kv_ratio};
  }
  next.fixed_ms = fixed;
  link_ = next;
  r.ok = true;
  r.rms_error_ms = rms(link_);
  return r;
}

void cost_model::report(std::ostream& os) const {
  os << "switch cost model: " << link_ << "\n";
  os << "  #  weight_bytes  kv_bytes  phases  rounds  predicted_ms  measured_ms  error\n";
  int i = 0;
  for (const switch_measurement& m : measurements_) {
    const double p = predict(m.workload).total_ms();
    os << "  " << i++ << "  " << m.workload.weight_bytes_per_rank << "  "
       << m.workload.kv_bytes_per_rank << "  " << m.workload.weight_phases << "  "
       << m.workload.kv_rounds << "  " << p << "  " << m.measured_ms << "  "
       << (p - m.measured_ms) / m.measured_ms * 100.0 << "%\n";
  }
}

}  // namespace moebius
