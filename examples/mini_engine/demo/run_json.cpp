#include "run_json.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <sstream>

#include <moebius/error.hpp>

#include "deployment.hpp"
#include "paper_report.hpp"

namespace mini_engine::demo {

namespace {

nlohmann::json latency_json(const latency_stats& s) {
  return {{"requests", s.requests},       {"mean_ttft_ms", s.mean_ttft_ms},
          {"p99_ttft_ms", s.p99_ttft_ms}, {"mean_tpot_ms", s.mean_tpot_ms},
          {"p99_tpot_ms", s.p99_tpot_ms}};
}

nlohmann::json paper_metrics_json(const paper_metrics& m) {
  nlohmann::json j = {{"switches", m.switches},
                      {"switch_total_ms", m.switch_total_ms},
                      {"tokens_per_s", m.tokens_per_s},
                      {"end_s", m.end_s},
                      {"all", latency_json(m.all)}};
  for (int b = 0; b < num_slo_bounds; ++b)
    j[std::string("goodput_") + slo_bounds[b].name + "_rps"] = m.goodput_rps[b];
  if (!m.floods.empty()) {
    j["flood"] = latency_json(m.flood);
    j["quiet"] = latency_json(m.quiet);
    nlohmann::json periods = nlohmann::json::array();
    for (const arrival_period& p : m.floods) periods.push_back({p.start_s, p.end_s});
    j["flood_periods_s"] = periods;
  }
  if (!m.rollout_step_s.empty()) {
    j["rollout_step_s"] = m.rollout_step_s;
    j["rollout_total_s"] = m.rollout_total_s;
  }
  return j;
}

// What the cost gate did in a policy run: what --verbose prints, as fields.
nlohmann::json gate_json(const run_result& r) {
  int64_t passed = 0;
  for (const switch_record& s : r.switches) passed += s.gate.evaluated && s.gate.passed;
  nlohmann::json j = {{"curves", r.gate}, {"passed", passed}, {"refused", r.gate_refusals}};
  std::ostringstream g;
  if (r.gate_refusals > 0) {
    g << r.last_refusal;
    j["last_refused"] = g.str();
  }
  if (!r.switches.empty() && r.switches.front().gate.evaluated) {
    std::ostringstream f;
    f << r.switches.front().gate;
    j["first_passed"] = f.str();
  }
  j["curve_corrections"] = r.corrections;
  if (r.corrections > 0) j["last_correction"] = r.correction;
  return j;
}

// What admission did over a run, from its steps: the longest queue and, at that step, the KV
// tokens written and counted as taken (reserved); the most reserved (and written then) and the
// most written; the new_token_ratio's range and last value (SGLang); the means over the run;
// the decode steps above the CUDA-graph limit.
nlohmann::json admission_json(const run_result& r) {
  nlohmann::json j;
  const step_record* peak = nullptr;
  const step_record* most_reserved = nullptr;
  int64_t most_written = 0;
  double ratio_min = std::numeric_limits<double>::infinity(), ratio_max = 0;
  double waiting_sum = 0, written_sum = 0, reserved_sum = 0;
  int64_t eager = 0;
  for (const step_record& s : r.steps) {
    if (peak == nullptr || s.waiting > peak->waiting) peak = &s;
    if (most_reserved == nullptr || s.kv_reserved_tokens > most_reserved->kv_reserved_tokens)
      most_reserved = &s;
    most_written = std::max(most_written, s.kv_written_tokens);
    ratio_min = std::min(ratio_min, s.new_token_ratio);
    ratio_max = std::max(ratio_max, s.new_token_ratio);
    waiting_sum += static_cast<double>(s.waiting);
    written_sum += static_cast<double>(s.kv_written_tokens);
    reserved_sum += static_cast<double>(s.kv_reserved_tokens);
    eager += s.eager;
  }
  const double n = std::max<double>(1, static_cast<double>(r.steps.size()));
  j["retractions_or_preemptions"] = r.preemptions;
  j["peak_waiting"] = peak != nullptr ? peak->waiting : 0;
  j["peak_waiting_at_s"] = peak != nullptr ? peak->start_s : 0;
  j["peak_waiting_kv_written_tokens"] = peak != nullptr ? peak->kv_written_tokens : 0;
  j["peak_waiting_kv_reserved_tokens"] = peak != nullptr ? peak->kv_reserved_tokens : 0;
  j["peak_waiting_running"] = peak != nullptr ? peak->running : 0;
  j["peak_kv_reserved_tokens"] = most_reserved != nullptr ? most_reserved->kv_reserved_tokens : 0;
  j["peak_kv_reserved_written_tokens"] =
      most_reserved != nullptr ? most_reserved->kv_written_tokens : 0;
  j["peak_kv_reserved_at_s"] = most_reserved != nullptr ? most_reserved->start_s : 0;
  j["peak_kv_written_tokens"] = most_written;
  j["mean_waiting"] = waiting_sum / n;
  j["mean_kv_written_tokens"] = written_sum / n;
  j["mean_kv_reserved_tokens"] = reserved_sum / n;
  j["new_token_ratio_min"] = r.steps.empty() ? 0 : ratio_min;
  j["new_token_ratio_max"] = ratio_max;
  j["new_token_ratio_last"] = r.steps.empty() ? 0 : r.steps.back().new_token_ratio;
  j["eager_steps"] = eager;
  return j;
}

}  // namespace

double admission_bucket_s(double end_s) {
  constexpr double most_rows = 200;  // ~6 KB a run in the results JSON
  return end_s <= most_rows ? 1.0 : std::ceil(end_s / most_rows);
}

nlohmann::json admission_over_time_json(const run_result& r, double bucket_s) {
  MOEBIUS_CHECK(std::isfinite(bucket_s) && bucket_s > 0, moebius::errc::invalid_argument,
                "admission_over_time_json: bucket_s ", bucket_s, " is not > 0 and finite");
  nlohmann::json rows = nlohmann::json::array();
  // One window at a time: the steps come in time order, so a window closes at the first step
  // past it.
  int64_t window = -1, waiting = 0, running = 0, reserved = 0, written = 0, retracted = 0;
  double ratio = 0;
  const auto close = [&] {
    if (window < 0) return;
    char row[200];
    std::snprintf(row, sizeof row, "%.10g,%lld,%lld,%lld,%lld,%.6g,%lld",
                  static_cast<double>(window) * bucket_s, static_cast<long long>(waiting),
                  static_cast<long long>(running), static_cast<long long>(reserved),
                  static_cast<long long>(written), ratio, static_cast<long long>(retracted));
    rows.push_back(row);
  };
  for (const step_record& s : r.steps) {
    const auto w = static_cast<int64_t>(std::floor(std::max(0.0, s.start_s) / bucket_s));
    if (w != window) {
      close();
      window = w;
      waiting = running = reserved = written = retracted = 0;
    }
    waiting = std::max(waiting, s.waiting);
    running = std::max(running, s.running);
    reserved = std::max(reserved, s.kv_reserved_tokens);
    written = std::max(written, s.kv_written_tokens);
    ratio = s.new_token_ratio;
    retracted += s.preempted;
  }
  close();
  return {{"bucket_s", bucket_s},
          {"columns",
           "start_s,waiting_max,running_max,kv_reserved_tokens_max,kv_written_tokens_max,"
           "new_token_ratio_last,retracted"},
          {"rows", std::move(rows)}};
}

nlohmann::json flood_admission_json(const run_result& r,
                                    const std::vector<arrival_period>& floods) {
  nlohmann::json out = nlohmann::json::array();
  for (const arrival_period& f : floods) {
    const step_record* first = nullptr;
    const step_record* longest = nullptr;
    const step_record* most_reserved = nullptr;
    int64_t running = 0, retracted = 0;
    double window_end_s = f.end_s;
    for (const step_record& s : r.steps) {
      if (s.start_s < f.start_s) continue;
      // Past the last arrival, the window lasts while requests still wait.
      if (s.start_s >= f.end_s && s.waiting == 0) {
        window_end_s = std::max(window_end_s, s.start_s);
        break;
      }
      if (first == nullptr) first = &s;
      if (longest == nullptr || s.waiting > longest->waiting) longest = &s;
      if (most_reserved == nullptr || s.kv_reserved_tokens > most_reserved->kv_reserved_tokens)
        most_reserved = &s;
      running = std::max(running, s.running);
      retracted += s.preempted;
      window_end_s = std::max(window_end_s, s.start_s);
    }
    out.push_back(
        {{"from_s", f.start_s},
         {"arrivals_to_s", f.end_s},
         {"to_s", window_end_s},
         {"new_token_ratio_at_start", first != nullptr ? first->new_token_ratio : 0.0},
         {"kv_reserved_tokens_at_start", first != nullptr ? first->kv_reserved_tokens : 0},
         {"peak_waiting", longest != nullptr ? longest->waiting : 0},
         {"peak_waiting_at_s", longest != nullptr ? longest->start_s : 0.0},
         {"peak_running", running},
         {"peak_kv_reserved_tokens",
          most_reserved != nullptr ? most_reserved->kv_reserved_tokens : 0},
         {"peak_kv_reserved_written_tokens",
          most_reserved != nullptr ? most_reserved->kv_written_tokens : 0},
         {"new_token_ratio_at_peak_reserved",
          most_reserved != nullptr ? most_reserved->new_token_ratio : 0.0},
         {"retractions_or_preemptions", retracted}});
  }
  return out;
}

nlohmann::json run_json(const std::string& trace, const run_outcome& r, const paper_metrics& m,
                        const std::string& clock, const moebius::calibration_result& cal) {
  nlohmann::json j = paper_metrics_json(m);
  j["trace"] = trace;
  j["run"] = label_of(r.kind);
  j["deployment"] = to_string(deployment_of(r.kind));
  j["layouts"] = layouts_of(make_deployment(qwen3_235b_a22b(), deployment_of(r.kind)));
  j["clock"] = clock;
  j["host_s"] = r.wall_s;
  j["steps"] = r.result.steps.size();
  j["preemptions"] = r.result.preemptions;
  j["admission"] = admission_json(r.result);
  j["admission"]["over_time"] =
      admission_over_time_json(r.result, admission_bucket_s(r.result.end_s));
  if (!m.floods.empty()) j["admission"]["floods"] = flood_admission_json(r.result, m.floods);
  j["failed_requests"] = r.result.failed_requests;
  std::ostringstream c;
  c << cal;
  j["calibration"] = c.str();
  if (!r.result.policy.empty()) j["policy"] = r.result.policy;
  if (!r.result.gate.empty()) j["gate"] = gate_json(r.result);
  return j;
}

}  // namespace mini_engine::demo
