#include "report.hpp"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <stdexcept>

#include "paper_metrics.hpp"
#include "runs.hpp"
#include "timeline_svg.hpp"

namespace mini_engine::demo {

namespace {

using moebius::parallel_mode;

double p99(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t rank = static_cast<size_t>(std::ceil(0.99 * static_cast<double>(v.size())));
  return v[std::max<size_t>(rank, 1) - 1];
}

struct switch_steps {
  double normal_max_ms = 0, normal_p99_ms = 0, switch_max_ms = 0, switch_p99_ms = 0;
  double mean_length_steps = 0;  // steps per committed switch (stop-the-world: 1)
};

switch_steps switch_steps_of(const run_result& r) {
  std::vector<double> normal, during;
  for (const step_record& s : r.steps) {
    if (s.switched)
      during.push_back(s.step_ms + s.switch_ms);
    else if (s.in_switch)
      during.push_back(s.step_ms);
    else
      normal.push_back(s.step_ms);
  }
  switch_steps out;
  out.normal_p99_ms = p99(normal);
  out.switch_p99_ms = p99(during);
  for (double x : normal) out.normal_max_ms = std::max(out.normal_max_ms, x);
  for (double x : during) out.switch_max_ms = std::max(out.switch_max_ms, x);
  int64_t n = 0, steps = 0;
  for (const switch_record& w : r.switches) {
    if (w.outcome != moebius::switch_outcome::committed) continue;
    ++n;
    steps += w.progressive ? w.steps : 1;
  }
  out.mean_length_steps = n > 0 ? static_cast<double>(steps) / static_cast<double>(n) : 0;
  return out;
}

bool is_switching(run_kind k) {
  return !is_static(k);
}

// The step log's sampling: 1 when every run's steps fit max_rows (or max_rows is 0), else the
// smallest k that brings every k-th step under it.
int64_t step_log_every(const std::vector<run_outcome>& runs, int64_t max_rows) {
  int64_t steps = 0;
  for (const run_outcome& r : runs) steps += static_cast<int64_t>(r.result.steps.size());
  if (max_rows <= 0 || steps <= max_rows) return 1;
  return (steps + max_rows - 1) / max_rows;
}

// Every `every`-th step, the last, and every step at a switch (stop-the-world or beside a
// progressive one's copies) or a change of mode.
std::vector<step_record> sampled_steps(const std::vector<step_record>& steps, int64_t every) {
  std::vector<step_record> out;
  for (size_t i = 0; i < steps.size(); ++i) {
    const step_record& s = steps[i];
    const bool event = s.switched || s.in_switch || (i > 0 && steps[i - 1].mode != s.mode) ||
                       i + 1 == steps.size();
    if (event || static_cast<int64_t>(i) % every == 0) out.push_back(s);
  }
  return out;
}

// "2nd", "33rd", "11th".
std::string ordinal(int64_t n) {
  const int64_t tens = n % 100, ones = n % 10;
  const char* suffix = (tens >= 11 && tens <= 13) ? "th"
                       : ones == 1                ? "st"
                       : ones == 2                ? "nd"
                       : ones == 3                ? "rd"
                                                  : "th";
  return std::to_string(n) + suffix;
}

const run_summary* summary_of(const trace_outcome& t, run_kind k) {
  for (const auto& [kind, s] : t.runs)
    if (kind == k) return &s;
  return nullptr;
}

// The best static run's summary (by tokens/s, static TP on a tie) and its kind.
std::pair<run_kind, const run_summary*> best_of(const trace_outcome& t) {
  const run_summary* tp = summary_of(t, run_kind::static_tp);
  const run_summary* ep = summary_of(t, run_kind::static_ep);
  if (tp == nullptr || ep == nullptr) throw std::logic_error("a static run is missing");
  return tp->tokens_per_s >= ep->tokens_per_s ? std::pair{run_kind::static_tp, tp}
                                              : std::pair{run_kind::static_ep, ep};
}

// Run `k`'s tokens/s against the best static run's ("0.924x"), or "-" when it was not served.
std::string ratio_text(const trace_outcome& t, run_kind k) {
  const run_summary* x = summary_of(t, k);
  const run_summary* b = best_of(t).second;
  if (x == nullptr) return "-";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3fx", b->tokens_per_s > 0 ? x->tokens_per_s / b->tokens_per_s : 0);
  return buf;
}

void print_summary_row(const trace_outcome& t) {
  const auto [best_kind, b] = best_of(t);
  const run_summary* ours = summary_of(t, run_kind::switching);
  char best[48], ttft[48], bound[32] = "-";
  std::snprintf(best, sizeof best, "%s %.0f", label_of(best_kind), b->tokens_per_s);
  std::snprintf(ttft, sizeof ttft, "%.1f / %.1f ms", b->p99_ttft_ms, ours ? ours->p99_ttft_ms : 0);
  if (t.bound.priced) std::snprintf(bound, sizeof bound, "<= %.3fx", t.bound.ratio);
  std::string targets;
  for (const target_check& c : t.targets) targets += (targets.empty() ? "" : " / ") + std::string(c.met ? "met" : "MISSED");
  std::printf("  %-10s %-19s %7s %12s %8s %22s %9s  %s\n", t.name.c_str(), best,
              ratio_text(t, run_kind::switching).c_str(), ratio_text(t, run_kind::progressive).c_str(),
              ratio_text(t, run_kind::no_gate).c_str(), ttft, bound,
              targets.empty() ? "-" : targets.c_str());
}

// "a", "a and b", "a, b and c".
std::string joined(const std::vector<std::string>& items) {
  std::string s;
  for (size_t i = 0; i < items.size(); ++i)
    s += (i == 0 ? "" : i + 1 == items.size() ? " and " : ", ") + items[i];
  return s;
}

// "verdict: ours gains on rollout (1.013x), matches the best static run on steady and
// production, trails it on bursty (0.924x); 4 of 8 targets met; greedy tokens identical in
// every run of every trace"
void print_verdict(const std::vector<trace_outcome>& outcomes) {
  std::vector<std::string> gains, matches, trails, differ;
  int64_t met = 0, targets = 0;
  for (const trace_outcome& t : outcomes) {
    const std::string r = ratio_text(t, run_kind::switching);
    if (r == "1.000x" || r == "-")
      matches.push_back(t.name);
    else
      (std::stod(r) > 1 ? gains : trails).push_back(t.name + " (" + r + ")");
    for (const target_check& c : t.targets) met += c.met, ++targets;
    if (t.differ > 0) differ.push_back(t.name + " (" + std::to_string(t.differ) + " requests)");
  }
  std::vector<std::string> parts;
  if (!gains.empty()) parts.push_back("gains on " + joined(gains));
  if (!matches.empty()) parts.push_back("matches the best static run on " + joined(matches));
  if (!trails.empty()) parts.push_back((parts.empty() ? "trails the best static run on "
                                                      : "trails it on ") + joined(trails));
  std::string v = "ours";
  for (size_t i = 0; i < parts.size(); ++i) v += (i == 0 ? " " : ", ") + parts[i];
  if (targets > 0) v += "; " + std::to_string(met) + " of " + std::to_string(targets) + " targets met";
  v += "; greedy tokens " + (differ.empty() ? std::string("identical in every run of every trace")
                                            : "DIFFER: " + joined(differ));
  std::printf("  verdict: %s\n", v.c_str());
}

// The targets line by line, and what a miss means (--verbose).
void print_targets(const std::vector<trace_outcome>& outcomes, bool priced,
                   const char* priced_model, int P) {
  if (priced)
    std::printf("\nsummary (modelled H200 clock, %s, P=%d):\n", priced_model, P);
  else
    std::printf("\nsummary (measured clock, P=%d):\n", P);
  int64_t missed = 0;
  for (const trace_outcome& t : outcomes) {
    for (const target_check& c : t.targets) {
      std::printf("  %-10s %s\n", t.name.c_str(), c.line.c_str());
      missed += !c.met;
    }
  }
  if (missed > 0) {
    std::printf(
        "  %lld target%s missed on this clock. Each trace's 'bound' line says what free "
        "switches at every step would gain on each static layout's own trajectory; what a "
        "run reached short of it went to the switches' cost and to the other layout's pool "
        "(which admits another batch), and the gate's line says which switch it refused and "
        "why; the paper-scale experiments are --runtime sim (docs/BENCHMARKS.md)\n",
        static_cast<long long>(missed), missed == 1 ? "" : "s");
  }
}

}  // namespace

void print_table(const std::vector<run_outcome>& runs, const std::string& clock) {
  std::printf("  %-16s %10s %10s %10s %10s %9s %8s %17s %7s\n", "run", "mean TTFT", "p99 TTFT",
              "mean TPOT", "p99 TPOT", "tokens/s", "switches", "switch total/mean", "host s");
  for (const run_outcome& r : runs) {
    const run_summary& s = r.summary;
    char sw[64];
    if (s.switches > 0) {
      std::snprintf(sw, sizeof sw, "%.0f / %.1f ms", s.switch_total_ms, s.switch_mean_ms);
    } else {
      std::snprintf(sw, sizeof sw, "-");
    }
    std::printf("  %-16s %7.1f ms %7.1f ms %7.2f ms %7.2f ms %9.0f %8lld %17s %7.1f\n",
                label_of(r.kind), s.mean_ttft_ms, s.p99_ttft_ms, s.mean_tpot_ms, s.p99_tpot_ms,
                s.tokens_per_s, static_cast<long long>(s.switches), sw, r.wall_s);
  }
  std::printf("  (times on the %s clock; 'host s' is the wall time this machine took)\n",
              clock.c_str());
}

void print_switch_steps(const std::vector<run_outcome>& runs) {
  std::printf("\n  %-16s %23s %23s %14s\n", "run", "normal steps max / p99",
              "switch steps max / p99", "switch length");
  for (const run_outcome& r : runs) {
    const switch_steps w = switch_steps_of(r.result);
    char len[32] = "-", sw[48] = "-";
    if (w.mean_length_steps > 0) {
      std::snprintf(len, sizeof len, "%.1f steps", w.mean_length_steps);
      std::snprintf(sw, sizeof sw, "%.2f / %.2f ms", w.switch_max_ms, w.switch_p99_ms);
    }
    char normal[48];
    std::snprintf(normal, sizeof normal, "%.2f / %.2f ms", w.normal_max_ms, w.normal_p99_ms);
    std::printf("  %-16s %23s %23s %14s\n", label_of(r.kind), normal, sw, len);
  }
  std::printf(
      "  (a stop-the-world switch counts as one step: the step after it, plus the switch)\n");
}

const run_outcome& best_static(const std::vector<run_outcome>& runs) {
  const run_outcome* tp = find_run(runs, run_kind::static_tp);
  const run_outcome* ep = find_run(runs, run_kind::static_ep);
  if (tp == nullptr || ep == nullptr)
    throw std::logic_error("best_static: a static run is missing");
  return tp->summary.tokens_per_s >= ep->summary.tokens_per_s ? *tp : *ep;
}

void print_beside_best(const std::vector<run_outcome>& runs, const run_outcome& best) {
  const run_summary& b = best.summary;
  std::printf("\n  best static (%s, by tokens/s) beside switching:\n", label_of(best.kind));
  for (const run_outcome& r : runs) {
    if (!is_switching(r.kind)) continue;
    const run_summary& x = r.summary;
    std::printf(
        "    %-16s %.3fx tokens/s, p99 TTFT %.1f vs %.1f ms, p99 TPOT %.2f vs %.2f ms, "
        "%lld switches (%.0f ms)\n",
        label_of(r.kind), b.tokens_per_s > 0 ? x.tokens_per_s / b.tokens_per_s : 0, x.p99_ttft_ms,
        b.p99_ttft_ms, x.p99_tpot_ms, b.p99_tpot_ms, static_cast<long long>(x.switches),
        x.switch_total_ms);
  }
}

bound_line bound_of(const std::vector<run_outcome>& runs, const step_clock& clock, int P,
                    int64_t num_layers) {
  bound_line b;
  if (clock.needs_measurement()) return b;  // a measuring clock prices no step it did not run
  b.priced = true;
  for (const run_kind k : {run_kind::static_tp, run_kind::static_ep}) {
    const run_outcome* r = find_run(runs, k);
    if (r == nullptr) continue;
    double steps_s = 0;
    for (const step_record& st : r->result.steps) steps_s += st.step_ms * 1e-3;
    const double bound_s = free_switch_bound_s(r->result, clock, P);
    const double ratio = bound_s > 0 ? steps_s / bound_s : 0;
    b.ratio = std::max(b.ratio, ratio);
    char buf[160];
    std::snprintf(buf, sizeof buf, "%s%s's %.0f ms of steps -> %.0f ms (<= %.3fx)",
                  b.parts.empty() ? "" : "; ", label_of(k), steps_s * 1e3, bound_s * 1e3, ratio);
    b.parts += buf;
  }
  moebius::layer_bytes none;
  none.weight_bytes_sent.assign(static_cast<size_t>(P), 0);
  none.kv_bytes_sent.assign(static_cast<size_t>(P), 0);
  b.one_switch_ms = clock.predicted_switch_s(none, num_layers) * 1e3;
  return b;
}

void print_bound(const bound_line& b) {
  if (!b.priced) return;
  std::printf(
      "  bound: a free switch at every step of each static layout's own trajectory (the batches "
      "its pool admitted; each step priced in both modes, the faster taken): %s; at most "
      "%.3fx; one switch costs >= %.0f ms (weights alone), a round trip >= %.0f ms\n",
      b.parts.c_str(), b.ratio, b.one_switch_ms, 2 * b.one_switch_ms);
}

void print_gate(const run_result& r, const moebius::latency_curves* curves, int64_t peak_load) {
  if (r.gate.empty()) return;
  int64_t passed = 0;
  for (const switch_record& s : r.switches) passed += s.gate.evaluated && s.gate.passed;
  std::printf("    %s: gate let %lld switch%s through, refused %lld decision%s", r.name.c_str(),
              static_cast<long long>(passed), passed == 1 ? "" : "es",
              static_cast<long long>(r.gate_refusals), r.gate_refusals == 1 ? "" : "s");
  if (r.gate_refusals > 0) {
    std::ostringstream g;
    g << r.last_refusal;
    std::printf("; last refused: %s", g.str().c_str());
  }
  if (!r.switches.empty() && r.switches.front().gate.evaluated) {
    std::ostringstream g;
    g << r.switches.front().gate;
    std::printf("; first let through: %s", g.str().c_str());
  }
  std::printf("\n");
  if (r.corrections > 0)
    std::printf("    %s: the gate's curves corrected by what the steps took (%lld times); last: "
                "%s\n",
                r.name.c_str(), static_cast<long long>(r.corrections), r.correction.c_str());
  if (curves != nullptr && peak_load > 0) {
    const double b = static_cast<double>(peak_load);
    const double tp = curves->tp.at(b), ep = curves->ep.at(b);
    std::printf(
        "    at the peak load %lld the calibrated steps are TP %.2f ms, EP %.2f ms (%+.1f%%)\n",
        static_cast<long long>(peak_load), tp, ep, (ep - tp) / tp * 100.0);
  }
}

int64_t write_run_files(const std::string& dir, const std::vector<run_outcome>& runs,
                        int64_t max_rows) {
  std::filesystem::create_directories(dir);
  const int64_t every = step_log_every(runs, max_rows);
  const std::string csv_path = dir + "/steps.csv", svg_path = dir + "/timeline.svg";
  std::ofstream csv(csv_path);
  for (size_t k = 0; k < runs.size(); ++k) {
    std::ostringstream part;
    if (every == 1) {
      write_steps_csv(part, runs[k].result);
    } else {
      run_result sampled;  // write_steps_csv reads the name and the steps alone
      sampled.name = runs[k].result.name;
      sampled.steps = sampled_steps(runs[k].result.steps, every);
      write_steps_csv(part, sampled);
    }
    std::string text = part.str();
    if (k > 0) text = text.substr(text.find('\n') + 1);  // one header
    csv << text;
  }
  if (!csv) throw std::runtime_error("cannot write " + csv_path);
  const std::string requests_path = dir + "/requests.csv";
  std::ofstream requests(requests_path);
  for (size_t k = 0; k < runs.size(); ++k) write_requests_csv(requests, runs[k].result, k == 0);
  if (!requests) throw std::runtime_error("cannot write " + requests_path);
  std::ofstream svg(svg_path);
  std::vector<const run_result*> panels;
  for (const run_outcome& r : runs) panels.push_back(&r.result);
  write_timeline_svg(svg, panels);
  if (!svg) throw std::runtime_error("cannot write " + svg_path);
  return every;
}

std::string files_line(const std::string& dir, int64_t every) {
  std::string steps = dir + "/steps.csv";
  if (every > 1)
    steps += " (every " + ordinal(every) +
             " step, and each at a switch or a change of mode; --full-step-log: all)";
  return "wrote " + steps + ", " + dir + "/requests.csv and " + dir + "/timeline.svg";
}

progress_printer::progress_printer(style s) : style_(s), tty_(isatty(STDERR_FILENO) != 0) {}

void progress_printer::install(engine_options& o) {
  o.progress_every_steps = 1;
  if (style_ == style::status && !tty_) return;
  o.on_progress = [this](const progress_info& p) {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto now = std::chrono::steady_clock::now();
    if (std::chrono::duration<double>(now - last_).count() < (style_ == style::lines ? 5.0 : 1.0))
      return;
    last_ = now;
    char line[256];
    std::snprintf(
        line, sizeof line, "[%s] step %6lld  t=%7.3f s  running %4lld  done %5lld/%lld  %s  switches %lld",
        p.run->c_str(), static_cast<long long>(p.step), p.now_s, static_cast<long long>(p.running),
        static_cast<long long>(p.finished), static_cast<long long>(p.total),
        name_of(p.config).c_str(), static_cast<long long>(p.switches));
    if (style_ == style::lines) {
      std::printf("    %s\n", line);
      std::fflush(stdout);
    } else {
      std::fprintf(stderr, "\r  %-100.100s", line);
      std::fflush(stderr);
      shown_ = true;
    }
  };
}

void progress_printer::done() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!shown_) return;
  std::fprintf(stderr, "\r%102s\r", "");
  std::fflush(stderr);
  shown_ = false;
}

uint64_t token_digest(const run_result& r) {
  uint64_t h = 1469598103934665603ull;
  auto mix = [&h](uint64_t x) {
    h ^= x;
    h *= 1099511628211ull;
  };
  for (const request_result& q : r.requests) {
    for (const int32_t t : q.generated) mix(static_cast<uint32_t>(t));
    mix(0xffffffffffull);
  }
  return h;
}

int64_t requests_that_differ(const std::vector<run_outcome>& runs) {
  int64_t differ = 0;
  const std::vector<request_result>& first = runs.front().result.requests;
  for (size_t i = 0; i < first.size(); ++i) {
    for (size_t k = 1; k < runs.size(); ++k) {
      if (runs[k].result.requests[i].generated != first[i].generated) {
        ++differ;
        break;
      }
    }
  }
  return differ;
}

void print_summary(const std::vector<trace_outcome>& outcomes, bool priced,
                   const char* priced_model, int P, bool verbose, const std::string& out_dir) {
  if (verbose) print_targets(outcomes, priced, priced_model, P);
  std::printf("\nper trace: the best static run's tokens/s; ours, ours progressive and no gate's "
              "against it; p99 TTFT; the bound (a free switch at every step); the targets\n");
  std::printf("  %-10s %-19s %7s %12s %8s %22s %9s  %s\n", "trace", "best static tok/s",
              "ours", "progressive", "no gate", "p99 TTFT best / ours", "bound",
              "target ours / progressive");
  for (const trace_outcome& t : outcomes) print_summary_row(t);
  print_verdict(outcomes);
  std::printf("  figures: %s/<trace>/timeline.svg, every step and request as CSV beside it\n",
              out_dir.c_str());
}

}  // namespace mini_engine::demo
