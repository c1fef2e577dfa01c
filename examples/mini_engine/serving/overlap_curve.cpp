#include "overlap_curve.hpp"

#include <algorithm>
#include <vector>

#include <moebius/error.hpp>

namespace mini_engine {

using moebius::errc;

namespace {

// Generated from docs/results/step_beside_copies_h200x1_summary.jsonl (CMakeLists.txt).
constexpr slowdown_point h200_points[] = {
#include "measured_slowdown_h200.inc"
};

// Linear in the bytes along one row [first, last) of equal step time, from (0, 1.0).
double along_row(std::span<const slowdown_point> row, double mib) {
  double x0 = 0, y0 = 1;
  for (size_t i = 0; i < row.size(); ++i) {
    const double x1 = row[i].copy_mib, y1 = row[i].slowdown;
    if (mib <= x1 || i + 1 == row.size()) {
      // Within the segment, or beyond the last point on the last segment's slope.
      return y0 + (y1 - y0) * (mib - x0) / (x1 - x0);
    }
    x0 = x1;
    y0 = y1;
  }
  return 1;
}

}  // namespace

overlap_slowdown_curve::overlap_slowdown_curve(std::span<const slowdown_point> points) {
  MOEBIUS_CHECK(!points.empty(), errc::invalid_argument, "overlap_slowdown_curve: no points");
  for (size_t i = 0; i < points.size(); ++i) {
    const slowdown_point& p = points[i];
    MOEBIUS_CHECK(p.step_ms > 0 && p.copy_mib > 0 && p.slowdown > 0, errc::invalid_argument,
                  "overlap_slowdown_curve: point ", i, " needs positive step_ms, copy_mib and "
                  "slowdown (got ", p.step_ms, ", ", p.copy_mib, ", ", p.slowdown, ")");
    if (i > 0 && points[i - 1].step_ms == p.step_ms) {
      MOEBIUS_CHECK(points[i - 1].copy_mib < p.copy_mib, errc::invalid_argument,
                    "overlap_slowdown_curve: within a row the bytes must ascend (point ", i, ")");
    }
  }
  for (size_t i = 0; i < points.size();) {
    size_t j = i;
    while (j < points.size() && points[j].step_ms == points[i].step_ms) ++j;
    rows_.push_back(points.subspan(i, j - i));
    i = j;
  }
  std::sort(rows_.begin(), rows_.end(),
            [](auto a, auto b) { return a.front().step_ms < b.front().step_ms; });
}

const overlap_slowdown_curve& overlap_slowdown_curve::h200() {
  static const overlap_slowdown_curve c{std::span<const slowdown_point>(h200_points)};
  return c;
}

const char* overlap_slowdown_curve::h200_source() {
  return "docs/results/step_beside_copies_h200x1_summary.jsonl";
}

double overlap_slowdown_curve::at(double step_s, int64_t bytes) const {
  if (bytes <= 0) return 1;
  const double mib = static_cast<double>(bytes) / double(1 << 20), ms = step_s * 1e3;
  const std::vector<std::span<const slowdown_point>>& rows = rows_;
  double s = 1;
  if (ms <= rows.front().front().step_ms) {
    s = along_row(rows.front(), mib);
  } else if (ms >= rows.back().front().step_ms) {
    s = along_row(rows.back(), mib);
  } else {
    for (size_t r = 0; r + 1 < rows.size(); ++r) {
      const double t0 = rows[r].front().step_ms, t1 = rows[r + 1].front().step_ms;
      if (ms > t1) continue;
      const double a = along_row(rows[r], mib), b = along_row(rows[r + 1], mib);
      s = a + (b - a) * (ms - t0) / (t1 - t0);
      break;
    }
  }
  return std::max(1.0, s);
}

}  // namespace mini_engine
