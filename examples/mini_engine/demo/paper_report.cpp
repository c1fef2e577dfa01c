#include "paper_report.hpp"

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <stdexcept>

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
