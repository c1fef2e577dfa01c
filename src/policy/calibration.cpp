#include "moebius/policy/calibration.hpp"

#include <algorithm>
#include <cmath>
#include <ostream>

#include "moebius/detail/enum_check.hpp"
#include "moebius/error.hpp"

namespace moebius {

namespace {

// Sorted by batch, duplicates averaged.
std::vector<latency_sample> sorted_knots(std::span<const latency_sample> samples) {
  std::vector<latency_sample> s(samples.begin(), samples.end());
  std::sort(s.begin(), s.end(),
            [](const latency_sample& a, const latency_sample& b) { return a.batch < b.batch; });
  std::vector<latency_sample> out;
  size_t i = 0;
  while (i < s.size()) {
    size_t j = i;
    double sum = 0;
    while (j < s.size() && s[j].batch == s[i].batch) sum += s[j++].ms;
    out.push_back({s[i].batch, sum / static_cast<double>(j - i)});
    i = j;
  }
  return out;
}

double interpolate(const std::vector<latency_sample>& k, double b) {
  // Index of the segment [k[i], k[i+1]] holding b, clamped to the end segments.
  auto it = std::upper_bound(k.begin(), k.end(), b,
                             [](double x, const latency_sample& s) { return x < s.batch; });
  size_t i = it == k.begin() ? 0 : static_cast<size_t>(it - k.begin()) - 1;
  if (i + 1 >= k.size()) i = k.size() - 2;
  const latency_sample& a = k[i];
  const latency_sample& c = k[i + 1];
  return a.ms + (c.ms - a.ms) * (b - a.batch) / (c.batch - a.batch);
}

}  // namespace

latency_curve latency_curve::fit(std::span<const latency_sample> samples, curve_fit kind) {
  detail::check_enum(kind, "latency_curve::fit kind (curve_fit)");
  for (const latency_sample& s : samples) {
    MOEBIUS_CHECK(std::isfinite(s.batch) && s.batch > 0 && std::isfinite(s.ms) && s.ms > 0,
                  errc::invalid_argument,
                  "latency samples need a finite batch > 0 and ms > 0 (batch=", s.batch,
                  ", ms=", s.ms, ")");
  }
  std::vector<latency_sample> knots = sorted_knots(samples);
  MOEBIUS_CHECK(knots.size() >= 2, errc::invalid_argument,
                "a latency curve needs samples at >= 2 distinct batch sizes (got ",
                knots.size(), " distinct of ", samples.size(), " samples)");
  latency_curve c;
  c.kind_ = kind;
  c.min_batch_ = knots.front().batch;
  c.max_batch_ = knots.back().batch;
  if (kind == curve_fit::least_squares_line) {
    // Centred sums: well conditioned for batches in the thousands.
    double mb = 0, mm = 0;
    for (const latency_sample& s : samples) {
      mb += s.batch;
      mm += s.ms;
    }
    const double n = static_cast<double>(samples.size());
    mb /= n;
    mm /= n;
    double sbb = 0, sbm = 0;
    for (const latency_sample& s : samples) {
      sbb += (s.batch - mb) * (s.batch - mb);
      sbm += (s.batch - mb) * (s.ms - mm);
    }
    c.slope_ = sbm / sbb;
    c.intercept_ = mm - c.slope_ * mb;
  } else {
    c.knots_ = std::move(knots);
  }
  return c;
}

double latency_curve::at(double batch) const {
  if (kind_ == curve_fit::least_squares_line) return intercept_ + slope_ * batch;
  return interpolate(knots_, batch);
}

crossover find_crossover(const latency_curves& curves) {
  crossover x;
  x.range_lo = std::max(curves.ep.min_batch(), curves.tp.min_batch());
  x.range_hi = std::min(curves.ep.max_batch(), curves.tp.max_batch());
  MOEBIUS_CHECK(x.range_lo < x.range_hi, errc::invalid_argument,
                "EP and TP latency samples must share a batch range (EP [",
                curves.ep.min_batch(), ", ", curves.ep.max_batch(), "], TP [",
                curves.tp.min_batch(), ", ", curves.tp.max_batch(), "])");

  // tp - ep is linear between consecutive points of `grid` (every knot of either curve
  // inside the range, plus the range ends), so its sign changes are found exactly.
  std::vector<double> grid{x.range_lo, x.range_hi};
  for (const latency_curve* c : {&curves.ep, &curves.tp}) {
    for (const latency_sample& k : c->knots()) {
      if (k.batch > x.range_lo && k.batch < x.range_hi) grid.push_back(k.batch);
    }
  }
  std::sort(grid.begin(), grid.end());
  grid.erase(std::unique(grid.begin(), grid.end()), grid.end());

  auto diff = [&](double b) { return curves.tp.at(b) - curves.ep.at(b); };
  // A tie is neither side: curves equal over a stretch (a configuration priced as another
  // wherever their difference vanishes) do not cross there, and a switch into EP could gain
  // nothing. Signs are taken past ties; a crossing joins two points of opposite sign, and
  // B* is where the segment leaving the last negative point reaches 0.
  auto sign = [&](double b) {
    const double d = diff(b);
    const double tol = 1e-9 * std::max(std::abs(curves.tp.at(b)), std::abs(curves.ep.at(b)));
    return std::abs(d) <= tol ? 0 : (d < 0 ? -1 : 1);
  };
  bool found = false;
  int last = 0;
  size_t last_at = 0;
  for (size_t i = 0; i < grid.size(); ++i) {
    const int s = sign(grid[i]);
    if (s == 0) continue;
    if (last != 0 && s != last) {
      ++x.num_crossings;
      // TP faster below, EP faster above: eq. 5's crossing. The last one: above it EP stays
      // faster; an earlier one is a near-tie at small batch that TP wins again past it.
      if (last < 0) {
        found = true;
        const double b0 = grid[last_at], b1 = grid[last_at + 1];
        const double d0 = diff(b0), d1 = diff(b1);
        x.batch = d1 > d0 ? std::min(b1, b0 + (b1 - b0) * (-d0) / (d1 - d0)) : b1;
      }
    }
    last = s;
    last_at = i;
  }
  const double d_lo = diff(x.range_lo);
  const double d_hi = diff(x.range_hi);
  if (found) {
    x.status = crossover_status::found;
  } else if (x.num_crossings > 0) {
    x.status = crossover_status::wrong_orientation;  // only downward crossings
  } else {
    x.status = (d_lo < 0 || d_hi < 0) ? crossover_status::tp_always_faster
                                      : crossover_status::ep_always_faster;
  }
  return x;
}

void validate(const calibration_options& o) {
  MOEBIUS_CHECK(std::isfinite(o.margin) && o.margin >= 0, errc::invalid_argument,
                "calibration margin must be finite and >= 0 (margin=", o.margin, ")");
  MOEBIUS_CHECK(std::isfinite(o.low_ratio) && o.low_ratio > 0 && o.low_ratio <= 1,
                errc::invalid_argument, "low_ratio must lie in (0, 1] (low_ratio=", o.low_ratio,
                ")");
  detail::check_enum(o.fit, "calibration_options fit (curve_fit)");
}

calibration_result calibrate(std::span<const latency_sample> ep_samples,
                             std::span<const latency_sample> tp_samples,
                             const calibration_options& options) {
  validate(options);
  calibration_result r;
  r.curves.ep = latency_curve::fit(ep_samples, options.fit);
  r.curves.tp = latency_curve::fit(tp_samples, options.fit);
  r.cross = find_crossover(r.curves);
  if (r.cross.status == crossover_status::found) {
    // The policy takes T_h <= 2^40; a larger (or non-finite) value would also be undefined
    // behaviour to convert to an integer.
    const double t_high = std::ceil(r.cross.batch * (1.0 + options.margin) - 1e-9);
    MOEBIUS_CHECK(t_high <= static_cast<double>(int64_t{1} << 40), errc::overflow,
                  "calibrated T_h = ceil(B* x (1 + margin)) exceeds the policy's limit 2^40 (B*=",
                  r.cross.batch, ", margin=", options.margin, ")");
    r.has_thresholds = true;
    r.t_high = std::max<int64_t>(1, static_cast<int64_t>(t_high));
    r.t_low = std::clamp<int64_t>(
        std::llround(options.low_ratio * static_cast<double>(r.t_high)), 1, r.t_high);
  }
  return r;
}

switch_policy_config apply_calibration(const calibration_result& r, switch_policy_config base) {
  MOEBIUS_CHECK(r.has_thresholds, errc::invalid_argument,
                "no thresholds to apply: the latency curves do not cross in the measured range "
                "(status=", to_string(r.cross.status), ", range [", r.cross.range_lo, ", ",
                r.cross.range_hi, "])");
  base.t_high = r.t_high;
  base.t_low = r.t_low;
  validate(base);
  return base;
}

std::ostream& operator<<(std::ostream& os, const latency_curve& c) {
  if (c.kind() == curve_fit::least_squares_line) {
    os << c.intercept() << " + " << c.slope() << "*b ms";
  } else {
    os << "piecewise{";
    for (size_t i = 0; i < c.knots().size(); ++i) {
      os << (i ? ", " : "") << c.knots()[i].batch << ":" << c.knots()[i].ms;
    }
    os << "} ms";
  }
  return os << " on [" << c.min_batch() << ", " << c.max_batch() << "]";
}

std::ostream& operator<<(std::ostream& os, const crossover& c) {
  os << "crossover{" << to_string(c.status);
  if (c.status == crossover_status::found) os << ", B*=" << c.batch;
  return os << ", crossings=" << c.num_crossings << ", range [" << c.range_lo << ", "
            << c.range_hi << "]}";
}

std::ostream& operator<<(std::ostream& os, const calibration_result& r) {
  os << "calibration{EP " << r.curves.ep << "; TP " << r.curves.tp << "; " << r.cross;
  if (r.has_thresholds) os << "; T_h=" << r.t_high << ", T_l=" << r.t_low;
  return os << "}";
}

}  // namespace moebius
