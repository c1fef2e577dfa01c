#include "prefill_table.hpp"

#include <algorithm>
#include <cmath>
#include <tuple>

#include <moebius/error.hpp>

namespace mini_engine {

using moebius::errc;

namespace {

// TP, EP first (as the curves order them), then by name; within one, ascending in tokens.
auto key(const prefill_point& p) {
  const int rank = p.mode == k_tp ? 0 : p.mode == k_ep ? 1 : 2;
  return std::make_tuple(rank, name_of(p.mode), p.tokens);
}

}  // namespace

prefill_table::prefill_table(std::vector<prefill_point> points, std::string source)
    : source_(std::move(source)) {
  for (size_t i = 0; i < points.size(); ++i) {
    const prefill_point& p = points[i];
    MOEBIUS_CHECK(is_named(p.mode), errc::invalid_argument, "prefill table (", source_,
                  "): point ", i, " has no named configuration (", name_of(p.mode), ")");
    MOEBIUS_CHECK(p.tokens >= 1 && p.step_ms > 0 && std::isfinite(p.step_ms),
                  errc::invalid_argument, "prefill table (", source_, "): point ", i,
                  " needs tokens >= 1 and a positive step_ms (got ", name_of(p.mode), " tokens ",
                  p.tokens, ", step_ms ", p.step_ms, ")");
  }
  std::sort(points.begin(), points.end(),
            [](const prefill_point& a, const prefill_point& b) { return key(a) < key(b); });
  for (size_t i = 1; i < points.size(); ++i)
    MOEBIUS_CHECK(key(points[i - 1]) != key(points[i]), errc::invalid_argument,
                  "prefill table (", source_, "): ", name_of(points[i].mode), " tokens ",
                  points[i].tokens, " twice");
  for (const prefill_point& p : points) {
    if (tables_.empty() || !(tables_.back().config == p.mode)) tables_.push_back(table{p.mode, {}});
    tables_.back().points.push_back(p);
  }
}

std::vector<configuration> prefill_table::configurations() const {
  std::vector<configuration> out;
  for (const table& t : tables_) out.push_back(t.config);
  return out;
}

const prefill_table::table* prefill_table::find(const configuration& c) const {
  for (const table& t : tables_)
    if (t.config == c) return &t;
  return nullptr;
}

const std::vector<prefill_point>& prefill_table::points(const configuration& c) const {
  const table* t = find(c);
  MOEBIUS_CHECK(t != nullptr, errc::invalid_argument, "prefill table (", source_, "): no ",
                name_of(c), " points");
  return t->points;
}

double prefill_table::step_ms(const configuration& c, double tokens) const {
  const std::vector<prefill_point>& pts = points(c);
  if (pts.size() == 1 || tokens <= static_cast<double>(pts.front().tokens))
    return pts.front().step_ms;
  for (size_t i = 1; i < pts.size(); ++i) {
    const double t0 = static_cast<double>(pts[i - 1].tokens);
    const double t1 = static_cast<double>(pts[i].tokens);
    if (tokens <= t1) {
      const double t = (std::log2(tokens) - std::log2(t0)) / (std::log2(t1) - std::log2(t0));
      return pts[i - 1].step_ms + t * (pts[i].step_ms - pts[i - 1].step_ms);
    }
  }
  // Beyond the largest chunk: the last segment's slope in the tokens, never falling (a last
  // segment that falls by noise would price larger chunks below the largest measured one).
  const prefill_point& a = pts[pts.size() - 2];
  const prefill_point& b = pts.back();
  const double slope =
      std::max(0.0, (b.step_ms - a.step_ms) / static_cast<double>(b.tokens - a.tokens));
  return b.step_ms + slope * (tokens - static_cast<double>(b.tokens));
}

}  // namespace mini_engine
