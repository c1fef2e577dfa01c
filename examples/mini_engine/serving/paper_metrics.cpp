#include "paper_metrics.hpp"

#include <algorithm>
#include <cmath>

#include <moebius/error.hpp>

#include "percentile.hpp"

namespace mini_engine {

using moebius::errc;

namespace {

double mean(const std::vector<double>& v) {
  if (v.empty()) return 0;
  double s = 0;
  for (const double x : v) s += x;
  return s / static_cast<double>(v.size());
}

struct latency_samples {
  std::vector<double> ttft_ms, tpot_ms;
  latency_stats stats() const {
    latency_stats s;
    s.requests = static_cast<int64_t>(ttft_ms.size());
    s.mean_ttft_ms = mean(ttft_ms);
    s.p99_ttft_ms = p99(ttft_ms);
    s.mean_tpot_ms = mean(tpot_ms);
    s.p99_tpot_ms = p99(tpot_ms);
    return s;
  }
  void add(const request_result& q) {
    ttft_ms.push_back(q.ttft_s() * 1e3);
    if (q.output_tokens > 1) tpot_ms.push_back(q.tpot_s() * 1e3);
  }
};

bool in_any(const std::vector<arrival_period>& periods, double t) {
  for (const arrival_period& p : periods)
    if (t >= p.start_s && t < p.end_s) return true;
  return false;
}

}  // namespace

std::vector<arrival_period> find_floods(const std::vector<request>& trace, double flood_factor) {
  MOEBIUS_CHECK(flood_factor > 0, errc::invalid_argument, "find_floods: flood_factor ",
                flood_factor, " (needs > 0)");
  std::vector<double> arrivals;
  for (const request& r : trace)
    if (r.rollout_step < 0) arrivals.push_back(r.arrival_s);
  if (arrivals.empty()) return {};
  std::sort(arrivals.begin(), arrivals.end());
  const double t0 = arrivals.front();
  const size_t windows = static_cast<size_t>(std::floor(arrivals.back() - t0)) + 1;
  std::vector<int64_t> count(windows, 0);
  for (const double t : arrivals) ++count[std::min(windows - 1, static_cast<size_t>(t - t0))];
  std::vector<int64_t> sorted = count;
  std::nth_element(sorted.begin(), sorted.begin() + static_cast<std::ptrdiff_t>(windows / 2),
                   sorted.end());
  const double median = static_cast<double>(sorted[windows / 2]);
  const double threshold = std::max(1.0, flood_factor * median);
  std::vector<arrival_period> floods;
  // Adjacent windows merged by index (comparing t0 + w + 1 with t0 + (w + 1) in floating point
  // split a flood in two when the sums rounded apart).
  size_t last = windows;  // the last flood window, `windows` when none yet
  for (size_t w = 0; w < windows; ++w) {
    if (static_cast<double>(count[w]) < threshold) continue;
    const double end = t0 + static_cast<double>(w + 1);
    if (!floods.empty() && last + 1 == w) {
      floods.back().end_s = end;
    } else {
      floods.push_back({t0 + static_cast<double>(w), end});
    }
    last = w;
  }
  return floods;
}

paper_metrics paper_metrics_of(const std::vector<request>& trace, const run_result& r,
                               const std::vector<arrival_period>& floods) {
  MOEBIUS_CHECK(r.requests.size() == trace.size(), errc::invalid_argument, "paper_metrics_of: ",
                r.requests.size(), " results for a trace of ", trace.size());
  // The trace by id (the results are sorted by id).
  std::vector<const request*> by_id(trace.size());
  {
    std::vector<const request*> sorted;
    for (const request& q : trace) sorted.push_back(&q);
    std::sort(sorted.begin(), sorted.end(),
              [](const request* a, const request* b) { return a->id < b->id; });
    for (size_t i = 0; i < sorted.size(); ++i) {
      MOEBIUS_CHECK(sorted[i]->id == r.requests[i].id, errc::invalid_argument,
                    "paper_metrics_of: result ", i, " is request ", r.requests[i].id,
                    ", the trace's is ", sorted[i]->id);
      by_id[i] = sorted[i];
    }
  }
  paper_metrics m;
  m.floods = floods;
  latency_samples flood, quiet, all;
  int64_t steps = 0;
  for (const request& q : trace) steps = std::max(steps, q.rollout_step + 1);
  std::vector<double> step_start(static_cast<size_t>(steps), 0), step_end(static_cast<size_t>(steps), 0);
  int64_t tokens = 0;
  int64_t good[num_slo_bounds] = {};
  for (size_t i = 0; i < r.requests.size(); ++i) {
    const request_result& q = r.requests[i];
    if (!q.finished() || q.failed()) continue;
    tokens += q.output_tokens;
    all.add(q);
    (in_any(floods, q.arrival_s) ? flood : quiet).add(q);
    for (int b = 0; b < num_slo_bounds; ++b) {
      good[b] += q.ttft_s() * 1e3 <= slo_bounds[b].ttft_ms &&
                 (q.output_tokens <= 1 || q.tpot_s() * 1e3 <= slo_bounds[b].tpot_ms);
    }
    const int64_t k = by_id[i]->rollout_step;
    if (k >= 0) {
      // The step started when its requests arrived less their offset in the trace.
      step_start[static_cast<size_t>(k)] = q.arrival_s - by_id[i]->arrival_s;
      step_end[static_cast<size_t>(k)] = std::max(step_end[static_cast<size_t>(k)], q.finish_s);
    }
  }
  m.flood = flood.stats();
  m.quiet = quiet.stats();
  m.all = all.stats();
  for (int64_t k = 0; k < steps; ++k) {
    m.rollout_step_s.push_back(step_end[static_cast<size_t>(k)] - step_start[static_cast<size_t>(k)]);
    m.rollout_total_s += m.rollout_step_s.back();
  }
  for (const switch_record& s : r.switches) {
    if (s.outcome != moebius::switch_outcome::committed) continue;
    ++m.switches;
    m.switch_total_ms += s.clock_ms;
  }
  m.end_s = r.end_s;
  if (r.end_s > 0) {
    m.tokens_per_s = static_cast<double>(tokens) / r.end_s;
    for (int b = 0; b < num_slo_bounds; ++b)
      m.goodput_rps[b] = static_cast<double>(good[b]) / r.end_s;
  }
  return m;
}

double per_step_oracle_s(const paper_metrics& tp, const paper_metrics& ep) {
  MOEBIUS_CHECK(tp.rollout_step_s.size() == ep.rollout_step_s.size(), errc::invalid_argument,
                "per_step_oracle_s: ", tp.rollout_step_s.size(), " and ",
                ep.rollout_step_s.size(), " rollout steps");
  double s = 0;
  for (size_t k = 0; k < tp.rollout_step_s.size(); ++k)
    s += std::min(tp.rollout_step_s[k], ep.rollout_step_s[k]);
  return s;
}

double free_switch_bound_s(const run_result& r, const step_clock& clock, int num_ranks) {
  return free_switch_bound_s(r, clock, num_ranks, k_tp, k_ep);
}

double free_switch_bound_s(const run_result& r, const step_clock& clock, int num_ranks,
                           const configuration& a, const configuration& b) {
  double total = 0;
  for (const step_record& s : r.steps) {
    // The step in configuration c: the time it took when it ran in c, else priced.
    auto in = [&](const configuration& c) {
      if (s.config == c) return s.step_ms * 1e-3;
      step_cost cost;
      cost.set(c);
      cost.num_ranks = num_ranks;
      cost.num_sequences = s.sequences;
      cost.new_tokens = s.decode_tokens + s.prefill_tokens;
      cost.context_tokens = s.context_tokens;
      return clock.step_s(cost, 0);
    };
    const bool own = s.config == a || s.config == b;
    const double best = std::min(in(a), in(b));
    total += own ? best : std::min(s.step_ms * 1e-3, best);
  }
  return total;
}

}  // namespace mini_engine
