#include "timeline_svg.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <ostream>
#include <string>

namespace mini_engine::demo {

namespace {

constexpr double width = 1000, panel_h = 180, left = 60, right = 60, top = 30, gap = 50;

std::string fmt(const char* f, double a) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, a);
  return buf;
}

// One run's panel: where its time, batch and step time land.
struct panel {
  double y0 = 0, t_end = 1, max_batch = 1, max_ms = 1;
  double plot_w() const { return width - left - right; }
  double x(double t) const { return left + plot_w() * t / t_end; }
  double y_batch(double b) const { return y0 + panel_h - panel_h * b / max_batch; }
  double y_ms(double ms) const { return y0 + panel_h - panel_h * ms / max_ms; }
};

// Mode bands: one rectangle per run of equal mode.
void write_mode_bands(std::ostream& os, const run_result& r, const panel& p) {
  size_t a = 0;
  while (a < r.steps.size()) {
    size_t b = a;
    while (b + 1 < r.steps.size() && r.steps[b + 1].mode == r.steps[a].mode) ++b;
    const double t0 = r.steps[a].start_s;
    const double t1 = b + 1 < r.steps.size() ? r.steps[b + 1].start_s
                                             : r.steps[b].start_s + r.steps[b].step_ms * 1e-3;
    os << "<rect x=\"" << fmt("%.2f", p.x(t0)) << "\" y=\"" << p.y0 << "\" width=\""
       << fmt("%.2f", std::max(0.5, p.x(t1) - p.x(t0))) << "\" height=\"" << panel_h
       << "\" fill=\"" << (r.steps[a].mode == moebius::parallel_mode::tp ? "#dff3df" : "#ece0f5")
       << "\"/>\n";
    a = b + 1;
  }
}

// Batch (series 0) or step time (1) as a polyline, at most its range per half pixel: a run of
// a million steps draws what a screen shows (the envelope), not a million points.
void write_series(std::ostream& os, const run_result& r, const panel& p, int series) {
  os << "<polyline fill=\"none\" stroke=\"" << (series == 0 ? "#1f5fbf" : "#e08020")
     << "\" stroke-width=\"1\" points=\"";
  auto y_of = [&](const step_record& s) {
    return series == 0 ? p.y_batch(static_cast<double>(s.sequences)) : p.y_ms(s.step_ms);
  };
  size_t first = 0;
  while (first < r.steps.size()) {
    const long column = std::lround(2 * p.x(r.steps[first].start_s));
    double lo = y_of(r.steps[first]), hi = lo, last = lo;
    size_t end = first + 1;
    for (; end < r.steps.size() && std::lround(2 * p.x(r.steps[end].start_s)) == column; ++end) {
      last = y_of(r.steps[end]);
      lo = std::min(lo, last);
      hi = std::max(hi, last);
    }
    const std::string x = fmt("%.2f", p.x(r.steps[first].start_s));
    os << x << ',' << fmt("%.2f", y_of(r.steps[first])) << ' ';
    if (end - first > 1) {
      os << x << ',' << fmt("%.2f", lo) << ' ' << x << ',' << fmt("%.2f", hi) << ' ' << x << ','
         << fmt("%.2f", last) << ' ';
    }
    first = end;
  }
  os << "\"/>\n";
}

void write_switches(std::ostream& os, const run_result& r, const panel& p) {
  for (const switch_record& s : r.switches) {
    if (s.outcome != moebius::switch_outcome::committed) continue;
    os << "<line x1=\"" << fmt("%.2f", p.x(s.start_s)) << "\" x2=\"" << fmt("%.2f", p.x(s.start_s))
       << "\" y1=\"" << p.y0 << "\" y2=\"" << p.y0 + panel_h
       << "\" stroke=\"#d02020\" stroke-width=\"1.5\"><title>switch "
       << moebius::switch_direction(s.from, s.to, s.from_dcp, s.to_dcp)
       << fmt(", %.1f ms", s.clock_ms) << "</title></line>\n";
  }
}

void write_axes(std::ostream& os, const panel& p) {
  os << "<text x=\"" << left - 6 << "\" y=\"" << p.y0 + 10
     << "\" text-anchor=\"end\" fill=\"#1f5fbf\">" << fmt("%.0f", p.max_batch) << "</text>\n"
     << "<text x=\"" << left - 6 << "\" y=\"" << p.y0 + panel_h << "\" text-anchor=\"end\">0</text>\n"
     << "<text x=\"" << width - right + 6 << "\" y=\"" << p.y0 + 10 << "\" fill=\"#e08020\">"
     << fmt("%.2f ms", p.max_ms) << "</text>\n"
     << "<text x=\"" << width - right << "\" y=\"" << p.y0 + panel_h + 14
     << "\" text-anchor=\"end\">" << fmt("%.3f s", p.t_end) << "</text>\n"
     << "<text x=\"" << left << "\" y=\"" << p.y0 + panel_h + 14 << "\">0 s</text>\n";
}

}  // namespace

void write_timeline_svg(std::ostream& os, const std::vector<const run_result*>& runs) {
  panel p;
  p.t_end = 0;
  p.max_ms = 0;
  for (const run_result* r : runs) {
    p.t_end = std::max(p.t_end, r->end_s);
    for (const step_record& s : r->steps) {
      p.max_batch = std::max(p.max_batch, static_cast<double>(s.sequences));
      p.max_ms = std::max(p.max_ms, s.step_ms);
    }
  }
  if (p.t_end <= 0) p.t_end = 1;
  if (p.max_ms <= 0) p.max_ms = 1;
  const double height = top + static_cast<double>(runs.size()) * (panel_h + gap) + 20;
  os << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << width << "\" height=\"" << height
     << "\" font-family=\"sans-serif\" font-size=\"11\">\n"
     << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
     << "<text x=\"" << left << "\" y=\"18\" font-size=\"13\">Moebius mini-engine: batch "
        "(blue, left axis), step time (orange, right axis), mode bands (TP green, EP purple), "
        "switches (red)</text>\n";
  for (size_t i = 0; i < runs.size(); ++i) {
    const run_result& r = *runs[i];
    p.y0 = top + static_cast<double>(i) * (panel_h + gap) + 20;
    os << "<text x=\"" << left << "\" y=\"" << p.y0 - 6 << "\" font-size=\"12\">" << r.name
       << " (clock: " << r.clock << ")</text>\n";
    write_mode_bands(os, r, p);
    os << "<rect x=\"" << left << "\" y=\"" << p.y0 << "\" width=\"" << p.plot_w()
       << "\" height=\"" << panel_h << "\" fill=\"none\" stroke=\"#888\"/>\n";
    for (const int series : {0, 1}) write_series(os, r, p, series);
    write_switches(os, r, p);
    write_axes(os, p);
  }
  os << "</svg>\n";
}

}  // namespace mini_engine::demo
