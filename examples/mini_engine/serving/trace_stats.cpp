#include "trace_stats.hpp"

#include <algorithm>
#include <cmath>
#include <moebius/error.hpp>
#include <ostream>
#include <set>

namespace mini_engine {

namespace {

length_statistics lengths_of(std::vector<int64_t> v) {
  length_statistics s;
  if (v.empty()) return s;
  std::sort(v.begin(), v.end());
  const double n = static_cast<double>(v.size());
  auto rank = [&](double q) {
    const size_t k = static_cast<size_t>(std::ceil(q * n));
    return v[std::max<size_t>(k, 1) - 1];
  };
  double sum = 0;
  for (const int64_t x : v) sum += static_cast<double>(x);
  s.mean = sum / n;
  s.p50 = rank(0.50);
  s.p90 = rank(0.90);
  s.p99 = rank(0.99);
  s.max = v.back();
  return s;
}

}  // namespace

trace_statistics statistics_of(const std::vector<request>& trace, int64_t output_cap,
                               double window_s) {
  MOEBIUS_CHECK(window_s > 0 && std::isfinite(window_s), moebius::errc::invalid_argument,
                "statistics_of: window_s must be finite and > 0 (got ", window_s, ")");
  trace_statistics s;
  s.requests = static_cast<int64_t>(trace.size());
  if (trace.empty()) return s;
  std::vector<int64_t> prompts, outputs;
  std::vector<double> arrivals;
  std::set<int64_t> steps;
  int64_t cut = 0;
  for (const request& r : trace) {
    prompts.push_back(static_cast<int64_t>(r.prompt.size()));
    outputs.push_back(r.output_tokens);
    arrivals.push_back(r.arrival_s);
    if (r.rollout_step >= 0) steps.insert(r.rollout_step);
    if (output_cap > 0 && r.output_tokens >= output_cap) ++cut;
  }
  s.prompt = lengths_of(std::move(prompts));
  s.output = lengths_of(std::move(outputs));
  s.cut_share = output_cap > 0 ? static_cast<double>(cut) / static_cast<double>(s.requests) : 0;
  s.rollout_steps = static_cast<int64_t>(steps.size());
  std::sort(arrivals.begin(), arrivals.end());
  s.span_s = arrivals.back() - arrivals.front();
  s.mean_rate = s.span_s > 0 ? static_cast<double>(s.requests) / s.span_s : 0;
  // The most arrivals in [a_i, a_i + window): two pointers over the sorted arrivals.
  size_t most = 0;
  for (size_t i = 0, j = 0; i < arrivals.size(); ++i) {
    while (j < arrivals.size() && arrivals[j] < arrivals[i] + window_s) ++j;
    most = std::max(most, j - i);
  }
  s.peak_rate = static_cast<double>(most) / window_s;
  return s;
}

std::ostream& operator<<(std::ostream& os, const trace_statistics& s) {
  auto lengths = [&](const char* name, const length_statistics& l) {
    os << name << " mean " << std::llround(l.mean) << " p50 " << l.p50 << " p90 " << l.p90
       << " p99 " << l.p99 << " max " << l.max;
  };
  os << s.requests << " requests";
  if (s.rollout_steps > 0) os << " in " << s.rollout_steps << " rollout steps";
  if (s.span_s > 0)
    os << " over " << std::round(s.span_s * 10) / 10 << " s (mean "
       << std::round(s.mean_rate * 10) / 10 << "/s, peak " << s.peak_rate << "/s)";
  os << "; ";
  lengths("prompt", s.prompt);
  os << "; ";
  lengths("output", s.output);
  if (s.cut_share > 0) os << ", " << std::round(s.cut_share * 1000) / 10 << "% cut at the cap";
  return os;
}

int64_t mean_decode_context(const std::vector<request>& trace) {
  if (trace.empty()) return 1;
  int64_t sum = 0;
  for (const request& r : trace) sum += static_cast<int64_t>(r.prompt.size()) + r.output_tokens / 2;
  return std::max<int64_t>(1, sum / static_cast<int64_t>(trace.size()));
}

}  // namespace mini_engine
