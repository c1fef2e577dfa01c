#include "paper_report.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>
#include <optional>
#include <sstream>
#include <stdexcept>

#include <moebius/error.hpp>

#include "deployment.hpp"
#include "sim_deployment.hpp"
#include "trace_stats.hpp"

namespace mini_engine::demo {

namespace {

// The paper's figures (8x H200, measured; §9.2-9.3), as its tables and text give them.
constexpr double k_paper_tp_flood_ttft_s = 9.9;
constexpr double k_paper_moebius_flood_ttft_s = 3.1;
constexpr const char* k_paper_bursty =
    "paper (8x H200, measured): static TP flood TTFT 9.9 s mean / 90 s p99, Moebius 3.1 s / 6.0 "
    "s; quiet TPOT TP ~37 ms, EP 52 ms, Moebius ~37 ms; 4 switches";
constexpr const char* k_paper_rollout =
    "paper (8x H200, measured): Moebius 1.16-1.25x (mean 1.22x) the better static layout, up to "
    "1.31x the worse, ahead of the per-step oracle";


// The figures of an interactive table's row, as printed (without the run's name).
std::string interactive_row(const paper_metrics& x) {
  char buf[256];
  std::snprintf(buf, sizeof buf, "%9.2f s %8.2f s %8.1f ms %7.1f ms %6lld (%6.0f ms) %7.2f %7.2f/s %9.0f",
                x.flood.mean_ttft_ms / 1e3, x.flood.p99_ttft_ms / 1e3, x.quiet.mean_tpot_ms,
                x.quiet.p99_tpot_ms, static_cast<long long>(x.switches), x.switch_total_ms,
                x.goodput_rps[0], x.goodput_rps[1], x.tokens_per_s);
  return buf;
}

// The better static layout of an interactive trace, by tokens/s (static TP on a tie).
size_t better_static(const std::vector<run_outcome>& runs, const std::vector<paper_metrics>& m) {
  const size_t tp = index_of(runs, run_kind::static_tp), ep = index_of(runs, run_kind::static_ep);
  return m[tp].tokens_per_s >= m[ep].tokens_per_s ? tp : ep;
}


// "+14%" (x against base), "=" when equal to the printed digit.
std::string change(double x, double base) {
  if (base <= 0) return "-";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%+.0f%%", (x / base - 1) * 100);
  return std::string(buf) == "+0%" || std::string(buf) == "-0%" ? "=" : buf;
}

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

}  // namespace

size_t index_of(const std::vector<run_outcome>& runs, run_kind k) {
  for (size_t i = 0; i < runs.size(); ++i)
    if (runs[i].kind == k) return i;
  throw std::logic_error(std::string("no run '") + label_of(k) + "' was served");
}

std::string changes(const paper_metrics& x, const paper_metrics& base) {
  std::string s = "quiet TPOT " + change(x.quiet.mean_tpot_ms, base.quiet.mean_tpot_ms);
  if (!x.floods.empty())
    s += ", flood TTFT " + change(x.flood.mean_ttft_ms, base.flood.mean_ttft_ms);
  return s;
}

std::string layouts_of(const deployment& d) {
  std::string out;
  for (const layout_capacity& l : d.layouts()) out += (out.empty() ? "" : " <-> ") + name_of(l.config);
  return out;
}

std::string capacity_line(const std::vector<run_kind>& kinds) {
  std::vector<deployment_kind> seen;
  std::string statics, designs;
  char buf[160];
  for (const run_kind k : kinds) {
    const deployment_kind dk = deployment_of(k);
    if (std::find(seen.begin(), seen.end(), dk) != seen.end()) continue;
    seen.push_back(dk);
    const deployment d = make_deployment(qwen3_235b_a22b(), dk);
    const std::vector<layout_capacity> ls = d.layouts();
    if (ls.size() == 1) {
      std::snprintf(buf, sizeof buf, "%s%s %.2fM", statics.empty() ? "" : ", ", to_string(dk),
                    static_cast<double>(ls.front().tokens) / 1e6);
      statics += buf;
      continue;
    }
    std::string each;
    for (const layout_capacity& l : ls) {
      std::snprintf(buf, sizeof buf, "%s%s %.2fM", each.empty() ? "" : " / ",
                    name_of(l.config).c_str(), static_cast<double>(l.tokens) / 1e6);
      each += buf;
    }
    designs += (designs.empty() ? "" : ", ") + std::string(to_string(dk)) + " " + each;
  }
  return "KV tokens: " + statics + (designs.empty() ? "" : "; " + designs);
}

void print_sim_preamble(const options& o, const std::string& clock_name,
                        const std::string& curves, const std::vector<run_kind>& runs,
                        int64_t max_running, int64_t step_tokens) {
  std::printf("moebius demo: the paper's two experiments at the paper's scale, on the simulated "
              "runtime, scheduled by %s's rules (--engine)%s\n",
              o.engine == engine_preset::sglang ? "SGLang" : "vLLM",
              o.mixed_chunk       ? ", with mixed chunks (--mixed-chunk)"
              : o.vllm_dp_engines ? ", one engine core per DP rank under EP (--vllm-dp-engines)"
                                  : "");
  if (!o.verbose) {
    std::printf("  Qwen3-235B-A22B on 8 H200s, every step priced by curves measured on one H200 "
                "(priced, not measured: tokens not computed); --verbose for the deployment, "
                "clock, calibration and gate\n");
    std::printf("  %s\n  %s\n", capacity_line(runs).c_str(), curves.c_str());
    return;
  }
  std::printf("  the deployments (serving/deployment.hpp):\n");
  std::vector<deployment_kind> seen;
  for (const run_kind k : runs) {
    const deployment_kind dk = deployment_of(k);
    if (std::find(seen.begin(), seen.end(), dk) != seen.end()) continue;
    seen.push_back(dk);
    std::ostringstream d, g;
    const deployment dep = make_deployment(qwen3_235b_a22b(), dk);
    d << dep;
    g << make_sim_geometry(dep);
    std::printf("    %s\n      simulated as %s\n", d.str().c_str(), g.str().c_str());
  }
  std::printf("  %s\n", capacity_line(runs).c_str());
  std::printf("  %s\n", curves.c_str());
  std::printf("  clock (priced, not measured): %s\n", clock_name.c_str());
  std::printf(
      "  simulated: tokens are not computed (the serving loop never reads them: "
      "test_serving_sim); collectives priced by a link model; each of the 8 GPUs emulated by "
      "the one rank measured; at most %lld running, %lld tokens a step (chunked prefill)\n",
      static_cast<long long>(max_running), static_cast<long long>(step_tokens));
  std::printf("  admission: %s\n",
              o.oracle_admission
                  ? "oracle (each request's true output length reserved: never preempts; no "
                    "engine knows it)"
              : o.engine == engine_preset::sglang
                  ? "on what is known, by SGLang's rules (a request admitted while prompt + "
                    "min(max_new_tokens, 4096) fits beside the running ones' remaining "
                    "estimates x new_token_ratio; a decode short of pages retracts the fewest "
                    "generated to the back of the queue; a step is a prefill or a decode, per "
                    "rank under DP attention, or with --mixed-chunk a prefill beside the running "
                    "decodes; serving/engine_preset.hpp)"
                  : "on what is known, by vLLM's rules (prompt and generated tokens, a 1% "
                    "watermark; a sequence that finds no page preempts the newest, which is "
                    "recomputed when re-admitted; serving/engine_preset.hpp)");
  std::printf("  max_new_tokens of a request that gives none: %lld (raised to its output where "
              "that is longer)\n",
              static_cast<long long>(o.max_new_tokens));
}

std::vector<paper_metrics> paper_metrics_of_runs(const std::vector<request>& trace,
                                                 const std::vector<run_outcome>& runs,
                                                 const std::vector<arrival_period>& floods) {
  std::vector<paper_metrics> m;
  for (const run_outcome& r : runs) m.push_back(paper_metrics_of(trace, r.result, floods));
  return m;
}

const paper_metrics& metrics_of(const std::vector<run_outcome>& runs,
                                const std::vector<paper_metrics>& m, run_kind k) {
  return m[index_of(runs, k)];
}

void print_trace_title(const std::string& name, const std::vector<request>& trace,
                       const std::vector<arrival_period>& floods, double rate, double bstar) {
  std::ostringstream s;
  s << statistics_of(trace);
  std::string text = s.str();
  text = text.substr(0, text.find(';'));  // the counts and rates; the lengths in --verbose
  if (rate > 0) {
    char buf[96];
    if (bstar > 0)
      std::snprintf(buf, sizeof buf, " at %.2f/s, the rate that keeps B* = %.0f running", rate,
                    bstar);
    else
      std::snprintf(buf, sizeof buf, " at %.2f/s, given (--rate)", rate);
    text += buf;
  }
  for (size_t i = 0; i < floods.size(); ++i) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "%s%.0f-%.0f s", i == 0 ? "; floods at " : ", ",
                  floods[i].start_s, floods[i].end_s);
    text += buf;
  }
  std::printf("\n%s: %s\n", name.c_str(), text.c_str());
}

void print_interactive_table(const std::vector<run_outcome>& runs,
                             const std::vector<paper_metrics>& m, bool verbose) {
  std::printf("  %-16s %21s %21s %17s %17s %9s\n", "run", "flood TTFT mean/p99",
              "quiet TPOT mean/p99", "switches (total)", "goodput int/srv", "tokens/s");
  for (size_t i = 0; i < runs.size(); ++i)
    std::printf("  %-16s %s\n", label_of(runs[i].kind), interactive_row(m[i]).c_str());
  // The paper's figures are its bursty experiment's: beside a trace without floods (steady)
  // only with --verbose.
  if (verbose || !m.front().floods.empty()) std::printf("  %s\n", k_paper_bursty);
}

run_kind default_design(const std::vector<run_outcome>& runs) {
  return find_run(runs, run_kind::dcp_only) != nullptr ? run_kind::dcp_only : run_kind::switching;
}

void print_interactive_verdict(const std::vector<run_outcome>& runs,
                               const std::vector<paper_metrics>& m) {
  const run_kind design = default_design(runs);
  const size_t best = better_static(runs, m), ours = index_of(runs, design);
  const char* best_name = label_of(runs[best].kind);
  const std::string name = label_of(design);
  std::string v;
  if (interactive_row(m[ours]) == interactive_row(m[best])) {
    v = name + " = " + best_name + " on every figure";
    const run_result& r = runs[ours].result;
    if (m[ours].switches == 0 && r.gate_refusals > 0)
      v += " (the gate refused all " + std::to_string(r.gate_refusals) + " switches proposed)";
  } else {
    char buf[160];
    std::snprintf(buf, sizeof buf, ", %.3fx tokens/s, %lld switches (%.0f ms)",
                  m[best].tokens_per_s > 0 ? m[ours].tokens_per_s / m[best].tokens_per_s : 0,
                  static_cast<long long>(m[ours].switches), m[ours].switch_total_ms);
    v = name + " against " + best_name + ": " + changes(m[ours], m[best]) + buf;
  }
  if (design != run_kind::switching) {
    const paper_metrics& pd = m[index_of(runs, run_kind::switching)];
    char buf[96];
    std::snprintf(buf, sizeof buf, "; the paper's design (ours): %lld switches (%.0f ms), ",
                  static_cast<long long>(pd.switches), pd.switch_total_ms);
    v += buf + changes(pd, m[best]);
  }
  if (find_run(runs, run_kind::paper_policy) != nullptr) {
    const paper_metrics& pm = m[index_of(runs, run_kind::paper_policy)];
    char buf[96];
    std::snprintf(buf, sizeof buf, "; the paper's policy: %lld switches (%.0f ms), ",
                  static_cast<long long>(pm.switches), pm.switch_total_ms);
    v += buf + changes(pm, m[best]);
  }
  if (!m[best].floods.empty()) {
    const paper_metrics& tp = m[index_of(runs, run_kind::static_tp)];
    char buf[192];
    std::snprintf(buf, sizeof buf,
                  "; the paper's gain (flood TTFT %.1f s -> %.1f s) needs floods that queue on "
                  "static TP: here they wait %.2f s",
                  k_paper_tp_flood_ttft_s, k_paper_moebius_flood_ttft_s,
                  tp.flood.mean_ttft_ms / 1e3);
    v += buf;
  }
  std::printf("  verdict: %s\n", v.c_str());
}

void print_rollout_table(const std::vector<run_outcome>& runs,
                         const std::vector<paper_metrics>& m, bool verbose) {
  const paper_metrics& tp = m[index_of(runs, run_kind::static_tp)];
  const paper_metrics& ep = m[index_of(runs, run_kind::static_ep)];
  const double oracle = per_step_oracle_s(tp, ep);
  const double best = std::min(tp.rollout_total_s, ep.rollout_total_s);
  const double worst = std::max(tp.rollout_total_s, ep.rollout_total_s);
  std::printf("  %-16s %10s %19s %11s %11s %11s %17s\n", "run", "total", "per step min..max",
              "x best", "x worst", "x oracle", "switches (total)");
  auto row = [&](const char* name, double total, const std::vector<double>& steps,
                 int64_t switches, double switch_ms) {
    double lo = steps.empty() ? 0 : steps.front(), hi = lo;
    for (const double s : steps) lo = std::min(lo, s), hi = std::max(hi, s);
    std::printf("  %-16s %8.1f s %8.1f..%6.1f s %10.3fx %10.3fx %10.3fx %6lld (%6.0f ms)\n", name,
                total, lo, hi, best / total, worst / total, oracle / total,
                static_cast<long long>(switches), switch_ms);
  };
  for (size_t i = 0; i < runs.size(); ++i)
    row(label_of(runs[i].kind), m[i].rollout_total_s, m[i].rollout_step_s, m[i].switches,
        m[i].switch_total_ms);
  std::vector<double> oracle_steps;
  for (size_t k = 0; k < tp.rollout_step_s.size(); ++k)
    oracle_steps.push_back(std::min(tp.rollout_step_s[k], ep.rollout_step_s[k]));
  row("per-step oracle", oracle, oracle_steps, 0, 0);
  if (verbose)
    std::printf("  (x best / x worst / x oracle: that run's speed-up over the better static "
                "layout, the worse, and the per-step oracle)\n");
  std::printf("  %s\n", k_paper_rollout);
}

void print_rollout_bound(const std::vector<run_outcome>& runs,
                         const std::vector<paper_metrics>& m, double bound_s) {
  const paper_metrics& tp = m[index_of(runs, run_kind::static_tp)];
  const paper_metrics& ep = m[index_of(runs, run_kind::static_ep)];
  std::printf("  a free switch at every step, capacity ignored (static EP's steps each priced in "
              "both modes, the faster taken): %.1f s, %.3fx the better static layout\n",
              bound_s, std::min(tp.rollout_total_s, ep.rollout_total_s) / bound_s);
}

void print_rollout_verdict(const std::vector<run_outcome>& runs,
                           const std::vector<paper_metrics>& m, double bound_s) {
  const size_t tp = index_of(runs, run_kind::static_tp), ep = index_of(runs, run_kind::static_ep);
  const size_t best = m[tp].rollout_total_s <= m[ep].rollout_total_s ? tp : ep;
  const double best_s = m[best].rollout_total_s;
  const run_kind design = default_design(runs);
  const paper_metrics& ours = m[index_of(runs, design)];
  std::printf("  verdict: %s %.3fx the better static layout (%s) with %lld switches",
              label_of(design), best_s / ours.rollout_total_s, label_of(runs[best].kind),
              static_cast<long long>(ours.switches));
  if (design != run_kind::switching)
    std::printf(", the paper's design (ours) %.3fx",
                best_s / m[index_of(runs, run_kind::switching)].rollout_total_s);
  if (find_run(runs, run_kind::paper_policy) != nullptr)
    std::printf(", the paper's policy %.3fx",
                best_s / m[index_of(runs, run_kind::paper_policy)].rollout_total_s);
  std::printf("; the paper measured 1.16-1.25x; a free switch at every step (capacity ignored) "
              "would reach %.3fx\n",
              best_s / bound_s);
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

search_result search_of(std::vector<int64_t> grid, std::vector<paper_metrics> runs) {
  search_result s;
  s.grid = std::move(grid);
  s.runs = std::move(runs);
  for (size_t i = 1; i < s.runs.size(); ++i)
    if (s.runs[i].rollout_total_s < s.runs[s.best_single].rollout_total_s) s.best_single = i;
  const size_t steps = s.runs.front().rollout_step_s.size();
  for (size_t k = 0; k < steps; ++k) {
    size_t best = 0;
    for (size_t i = 1; i < s.runs.size(); ++i)
      if (s.runs[i].rollout_step_s[k] < s.runs[best].rollout_step_s[k]) best = i;
    s.best_per_step.push_back(best);
    s.per_step_total_s += s.runs[best].rollout_step_s[k];
  }
  return s;
}

void print_search(const search_result& s, double best_static_s, double switching_s) {
  std::printf("\n  offline search: the rollout rule at T_h = T_l = b, rules alone, the trace served "
              "once per b:\n   ");
  for (size_t i = 0; i < s.grid.size(); ++i)
    std::printf(" b=%lld %.0f s%s", static_cast<long long>(s.grid[i]), s.runs[i].rollout_total_s,
                i + 1 < s.grid.size() ? "," : "\n");
  std::printf("    best single b = %lld: %.1f s, %.3fx the better static layout\n",
              static_cast<long long>(s.grid[s.best_single]), s.runs[s.best_single].rollout_total_s,
              best_static_s / s.runs[s.best_single].rollout_total_s);
  std::printf("    best b per rollout step (");
  for (size_t k = 0; k < s.best_per_step.size(); ++k)
    std::printf("%lld%s", static_cast<long long>(s.grid[s.best_per_step[k]]),
                k + 1 < s.best_per_step.size() ? ", " : "");
  std::printf("): %.1f s, %.3fx the better static layout; the switching run takes %.3fx its time\n",
              s.per_step_total_s, best_static_s / s.per_step_total_s,
              switching_s / s.per_step_total_s);
}

nlohmann::json search_json(const std::string& trace, const search_result& s) {
  nlohmann::json j;
  j["trace"] = trace;
  j["run"] = "offline search";
  j["grid"] = s.grid;
  std::vector<double> totals;
  for (const paper_metrics& r : s.runs) totals.push_back(r.rollout_total_s);
  j["grid_total_s"] = totals;
  j["best_single_b"] = s.grid[s.best_single];
  std::vector<int64_t> per_step;
  for (const size_t i : s.best_per_step) per_step.push_back(s.grid[i]);
  j["best_b_per_step"] = per_step;
  j["rollout_total_s"] = s.per_step_total_s;
  return j;
}

void write_decisions(const std::string& dir, const std::vector<run_outcome>& runs) {
  const std::string path = dir + "/decisions.txt";
  std::ofstream f(path);
  bool printed = false;
  for (const run_outcome& r : runs) {
    if (r.result.decisions.empty()) continue;
    f << "== " << label_of(r.kind) << ": " << r.result.policy << "; " << r.result.gate << "\n";
    for (const decision_record& d : r.result.decisions) f << d << "\n";
    if (printed) continue;
    printed = true;
    std::printf("\n  decisions of %s (%zu records; all in %s):\n", label_of(r.kind),
                r.result.decisions.size(), path.c_str());
    for (size_t i = 0; i < std::min<size_t>(r.result.decisions.size(), 8); ++i) {
      std::ostringstream line;
      line << r.result.decisions[i];
      std::printf("    %s\n", line.str().c_str());
    }
  }
  if (!f) throw std::runtime_error("cannot write " + path);
}

}  // namespace mini_engine::demo
