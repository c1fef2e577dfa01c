#include "paper.hpp"

#include <chrono>
#include <cstdio>
#include <exception>
#include <fstream>
#include <memory>
#include <mutex>
#include <sstream>
#include <thread>

#include <nlohmann/json.hpp>

#include <moebius/error.hpp>
#include <moebius/transport/dry_run_transport.hpp>

#include "deployment.hpp"
#include "engine.hpp"
#include "experiments.hpp"
#include "paper_metrics.hpp"
#include "paper_traces.hpp"
#include "report.hpp"
#include "sim_deployment.hpp"
#include "sim_runtime.hpp"
#include "step_curves.hpp"
#include "trace_stats.hpp"

namespace mini_engine::demo {

namespace {

using moebius::parallel_mode;
using wall = std::chrono::steady_clock;

// The paper's limits (§9.1) and SGLang's default chunked-prefill size on large GPUs.
constexpr int64_t k_max_running = 2048;
constexpr int64_t k_step_tokens = 8192;
// The paper's cooldown between switches (§7.1).
constexpr double k_cooldown_s = 5.0;

// One run's deployment on the simulated runtime: its geometry, runtime, dry-run transport and
// engine (each run its own: the static deployments' pools differ).
struct sim_world {
  sim_geometry geometry;
  std::unique_ptr<sim_runtime> rt;
  std::unique_ptr<moebius::dry_run_transport> transport;
  std::unique_ptr<engine> eng;
};

sim_world make_sim_world(deployment_kind k, const step_clock& clock) {
  sim_world w;
  w.geometry = make_sim_geometry(make_deployment(qwen3_235b_a22b(), k));
  w.rt = std::make_unique<sim_runtime>(w.geometry.arena, w.geometry.kv, 1024);
  w.transport = std::make_unique<moebius::dry_run_transport>(w.geometry.kv.num_ranks, w.rt->spaces());
  w.eng = std::make_unique<engine>(*w.rt, *w.transport, w.geometry.arena, w.geometry.kv, clock,
                                   moebius::arena_cursor{0});
  return w;
}

deployment_kind deployment_of(run_kind k) {
  switch (k) {
    case run_kind::static_tp:
      return deployment_kind::static_tp;
    case run_kind::static_ep:
      return deployment_kind::static_ep;
    default:
      return deployment_kind::switching;
  }
}

// The clock: the region curves of Qwen3-235B-A22B at P = 8 and the H200 model (switches, the
// link, the overlap slowdown) at the run model's KV bytes, contexts as they are (scale 1).
struct paper_clock {
  std::unique_ptr<h200_step_model> model;
  std::unique_ptr<curves_step_clock> clock;
};

paper_clock make_paper_clock(const options& o) {
  std::optional<step_curves> curves =
      o.curves.empty() ? step_curves::region("qwen3_235b", 8)
                       : std::optional<step_curves>(step_curves::from_file(o.curves));
  if (!curves)
    throw usage_error("--runtime sim: no step curves of qwen3_235b at P=8 over the operating "
                      "region (docs/results/step_region_*.jsonl); give --curves FILE");
  if (o.collective_us_tp >= 0)
    curves = curves->with_collective_latency(o.collective_us_tp, o.collective_us_ep);
  priced_model m = qwen3_235b_a22b_priced();
  m.context_scale = 1;
  const sim_geometry g = make_sim_geometry(make_deployment(qwen3_235b_a22b(), deployment_kind::switching));
  paper_clock c;
  c.model = std::make_unique<h200_step_model>(m, h200_params{}, 8, g.kv_bytes_per_token);
  c.clock = std::make_unique<curves_step_clock>(std::move(*curves), *c.model);
  return c;
}

std::vector<int64_t> calibration_batches() {
  std::vector<int64_t> b;
  for (int64_t x = 1; x <= k_max_running; x *= 2) b.push_back(x);
  return b;
}

bool is_rollout(const std::vector<request>& trace) {
  return !trace.empty() && trace.front().rollout_step >= 0;
}

// Our policy: the paper's rules (interactive: T_l = 0.8 T_h, cooldown 5 s; rollout: eq. 13) at
// the thresholds of the calibrated crossover, EP also on blocked admission, the start mode from
// the initial load, and the throughput gate (engine.hpp: admission, queueing and known work).
engine_options switching_options(const moebius::calibration_result& cal, bool rollout,
                                 const engine_options& base) {
  engine_options so = base;
  if (!cal.has_thresholds) {
    so.start_mode = cal.cross.status == moebius::crossover_status::ep_always_faster
                        ? parallel_mode::ep
                        : parallel_mode::tp;
    return so;
  }
  so.how = switching::policy;
  if (rollout) {
    so.policy = moebius::apply_calibration(cal, moebius::rollout_config(cal.t_high, 8));
    so.policy.t_low = so.policy.t_high;
  } else {
    so.policy = moebius::apply_calibration(cal, moebius::interactive_config(cal.t_high));
    so.policy.cooldown_s = k_cooldown_s;
  }
  so.start_mode = parallel_mode::tp;
  so.start_from_load = true;
  so.policy.enter_on_blocked_admission = true;
  so.gate.kind = gate_kind::throughput;
  so.gate.curves = cal.curves;
  return so;
}

// The paper's policy as written (§7.1, eq. 13): its rules at the same thresholds, the load it
// uses (running + waiting, capped at 2,048), no gate, no blocked-admission rule, starting in TP.
engine_options paper_policy_options(const engine_options& ours) {
  engine_options p = ours;
  p.gate.enabled = false;
  p.policy.enter_on_blocked_admission = false;
  p.start_from_load = false;
  p.start_mode = parallel_mode::tp;
  return p;
}

// Each policy run's decisions (engine_options::explain) into `dir`/decisions.txt; the first
// lines of the first such run printed.
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

// Serves each spec on its own deployment, two at a time (two cores).
std::vector<run_outcome> serve(const std::vector<request>& trace, const std::vector<run_spec>& specs,
                               std::vector<sim_world>& worlds) {
  std::vector<run_outcome> out(specs.size());
  std::exception_ptr failure;
  std::mutex failure_mutex;
  for (size_t first = 0; first < specs.size(); first += 2) {
    std::vector<std::thread> threads;
    for (size_t k = first; k < std::min(first + 2, specs.size()); ++k) {
      threads.emplace_back([&, k] {
        try {
          const auto t0 = wall::now();
          out[k].kind = specs[k].kind;
          out[k].result = worlds[k].eng->run(trace, specs[k].options, label_of(specs[k].kind));
          out[k].wall_s = std::chrono::duration<double>(wall::now() - t0).count();
        } catch (...) {
          std::lock_guard<std::mutex> lock(failure_mutex);
          if (!failure) failure = std::current_exception();
        }
      });
    }
    for (std::thread& t : threads) t.join();
    if (failure) std::rethrow_exception(failure);
  }
  for (run_outcome& r : out) r.summary = summarize(r.result);
  return out;
}

nlohmann::json latency_json(const latency_stats& s) {
  return {{"requests", s.requests},       {"mean_ttft_ms", s.mean_ttft_ms},
          {"p99_ttft_ms", s.p99_ttft_ms}, {"mean_tpot_ms", s.mean_tpot_ms},
          {"p99_tpot_ms", s.p99_tpot_ms}};
}

nlohmann::json metrics_json(const paper_metrics& m) {
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

void print_bursty_table(const std::vector<run_outcome>& runs, const std::vector<paper_metrics>& m) {
  std::printf("\n  %-16s %21s %21s %17s %17s %9s\n", "run", "flood TTFT mean/p99",
              "quiet TPOT mean/p99", "switches (total)", "goodput int/srv", "tokens/s");
  for (size_t i = 0; i < runs.size(); ++i) {
    const paper_metrics& x = m[i];
    std::printf("  %-16s %9.2f s %8.2f s %8.1f ms %7.1f ms %6lld (%6.0f ms) %7.2f %7.2f/s %9.0f\n",
                label_of(runs[i].kind), x.flood.mean_ttft_ms / 1e3, x.flood.p99_ttft_ms / 1e3,
                x.quiet.mean_tpot_ms, x.quiet.p99_tpot_ms, static_cast<long long>(x.switches),
                x.switch_total_ms, x.goodput_rps[0], x.goodput_rps[1], x.tokens_per_s);
  }
  std::printf(
      "  paper (8x H200, measured): static TP flood TTFT 9.9 s mean / 90 s p99, Moebius 3.1 s "
      "/ 6.0 s; quiet TPOT TP ~37 ms, EP 52 ms, Moebius ~37 ms; 4 switches\n");
}

void print_rollout_table(const std::vector<run_outcome>& runs, const std::vector<paper_metrics>& m) {
  const paper_metrics& tp = m[0];
  const paper_metrics& ep = m[1];
  const double oracle = per_step_oracle_s(tp, ep);
  const double best = std::min(tp.rollout_total_s, ep.rollout_total_s);
  const double worst = std::max(tp.rollout_total_s, ep.rollout_total_s);
  std::printf("\n  %-16s %10s %19s %11s %11s %11s %17s\n", "run", "total", "per step min..max",
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
  std::printf("  (x best / x worst / x oracle: that run's speed-up over the better static layout, "
              "the worse, and the per-step oracle)\n");
  std::printf(
      "  paper (8x H200, measured): Moebius 1.16-1.25x (mean 1.22x) the better static layout, "
      "up to 1.31x the worse, ahead of the per-step oracle\n");
}

// The offline ceiling of a closed-loop rollout: one switch point per rollout step. Every step
// starts at a load of 2,048 (in EP, or switching there at once) and may switch to TP once the
// load falls under b: the paper's rollout rule at T_h = T_l = b, rules alone. Each b of the grid
// serves the whole trace once, and each rollout step takes the b that served it fastest; the
// steps are independent (each starts when the last has finished, and the rule sends it to EP at
// once whatever the last one ended in), so that sum is a schedule's time: the search's best.
struct search_result {
  std::vector<int64_t> grid;
  std::vector<paper_metrics> runs;  // per b
  size_t best_single = 0;           // the b whose whole run was fastest
  std::vector<size_t> best_per_step;
  double per_step_total_s = 0;
};

search_result search_rollout(const std::vector<request>& trace, const engine_options& base,
                             const std::vector<arrival_period>& floods, const step_clock& clock) {
  search_result s;
  s.grid = {32, 64, 96, 128, 192, 256, 384, 512, 768, 1024};
  std::vector<run_spec> specs;
  std::vector<sim_world> worlds;
  for (const int64_t b : s.grid) {
    engine_options e = base;
    e.how = switching::policy;
    e.policy = moebius::rollout_config(b, 8);
    e.gate.enabled = false;
    e.start_mode = parallel_mode::ep;
    specs.push_back({run_kind::paper_policy, e});
    worlds.push_back(make_sim_world(deployment_kind::switching, clock));
  }
  const std::vector<run_outcome> runs = serve(trace, specs, worlds);
  for (const run_outcome& r : runs) s.runs.push_back(paper_metrics_of(trace, r.result, floods));
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

}  // namespace

int run_paper_experiments(const options& o) {
  const auto t_start = wall::now();
  std::printf("moebius demo: the paper's two experiments at the paper's scale, on the simulated "
              "runtime\n");
  std::printf("  the deployment (serving/deployment.hpp):\n");
  for (const deployment_kind k :
       {deployment_kind::static_tp, deployment_kind::static_ep, deployment_kind::switching}) {
    std::ostringstream d, g;
    const deployment dep = make_deployment(qwen3_235b_a22b(), k);
    d << dep;
    g << make_sim_geometry(dep);
    std::printf("    %s\n      simulated as %s\n", d.str().c_str(), g.str().c_str());
  }
  const paper_clock clock = make_paper_clock(o);
  std::printf("  clock (priced, not measured): %s\n", clock.clock->name());
  std::printf(
      "  simulated: tokens are not computed (the serving loop never reads them: "
      "test_serving_sim); collectives priced by a link model; each of the 8 GPUs emulated by "
      "the one rank measured; at most %lld running, %lld tokens a step (chunked prefill)\n",
      static_cast<long long>(k_max_running), static_cast<long long>(k_step_tokens));
  std::printf("  admission: %s\n",
              o.oracle_admission
                  ? "oracle (each request's true output length reserved: never preempts; no "
                    "engine knows it)"
                  : "on what is known, as vLLM and SGLang (prompt and generated tokens, a 1% "
                    "watermark; a sequence that finds no page preempts the newest, which is "
                    "recomputed when re-admitted)");

  progress_printer progress;
  nlohmann::json results = nlohmann::json::array();
  bool ok = true;
  for (const trace_kind kind : o.traces) {
    const std::string name = kind == trace_kind::file ? o.trace_file : to_string(kind);
    std::printf("\n=== trace: %s ===\n", name.c_str());
    std::vector<request> trace = make_trace(o, kind, 1024, 0);
    if (trace.empty()) throw usage_error("--trace: the trace has no requests");
    const bool rollout = is_rollout(trace);
    {
      std::ostringstream s;
      s << statistics_of(trace, rollout ? 32768 : 0);
      std::printf("  %s, seed %llu\n", s.str().c_str(), static_cast<unsigned long long>(o.seed));
    }
    std::vector<arrival_period> floods = find_floods(trace);
    for (const arrival_period& p : floods)
      std::printf("  flood found in the arrivals: %.0f-%.0f s\n", p.start_s, p.end_s);

    const std::vector<run_kind> kinds = {run_kind::static_tp, run_kind::static_ep,
                                         run_kind::switching, run_kind::progressive,
                                         run_kind::paper_policy, run_kind::by_cost};
    std::vector<sim_world> worlds;
    for (const run_kind k : kinds) worlds.push_back(make_sim_world(deployment_of(k), *clock.clock));
    const int64_t context = mean_decode_context(trace);
    // The crossover where the curves themselves cross (piecewise through the measured points),
    // not where two fitted lines do.
    moebius::calibration_options calibration;
    calibration.fit = moebius::curve_fit::piecewise_linear;
    const moebius::calibration_result cal =
        calibrate_engine(*worlds[2].eng, calibration_batches(), context, calibration);
    {
      std::ostringstream d;
      d << cal;
      std::printf("  calibration at %lld context tokens: %s\n", static_cast<long long>(context),
                  d.str().c_str());
    }
    if (kind == trace_kind::paper_steady && cal.has_thresholds) {
      // The rate that keeps ~B* running (Little's law): B* sequences each decoding the mean
      // output at the curves' step time at B*. The lengths' distribution, and so the
      // calibration's context, does not depend on the rate (its sample mean moves with the
      // count by sampling alone): the trace is drawn again at it, same seed.
      const double step_s = cal.curves.latency_ms(parallel_mode::tp, cal.cross.batch) / 1e3;
      const double rate = cal.cross.batch / (paper_steady_options{}.output_mean * step_s);
      trace = make_trace(o, kind, 1024, rate);
      floods = find_floods(trace);
      std::ostringstream s;
      s << statistics_of(trace, 0);
      std::printf("  at %.2f requests/s (B* %.0f / (%.1f output tokens x %.1f ms)): %s\n", rate,
                  cal.cross.batch, paper_steady_options{}.output_mean, step_s * 1e3,
                  s.str().c_str());
      for (const arrival_period& p : floods)
        std::printf("  flood found in the arrivals: %.0f-%.0f s\n", p.start_s, p.end_s);
    }
    engine_options base;
    base.scheduler.max_running = k_max_running;
    base.scheduler.max_step_tokens = k_step_tokens;
    base.scheduler.admission = o.oracle_admission ? admission_policy::oracle : admission_policy::known;
    progress.install(base);
    base.progress_every_steps = 2000;
    engine_options so = switching_options(cal, rollout, base);
    so.explain = o.explain;
    {
      std::ostringstream d;
      d << so.policy;
      std::printf("  policy runs: %s; ours: throughput gate (margin %.2f), start mode from the "
                  "initial load; paper policy: the rules alone, starting in TP\n",
                  d.str().c_str(), so.gate.margin);
    }
    std::vector<run_spec> specs = {{run_kind::static_tp, base},
                                   {run_kind::static_ep, base},
                                   {run_kind::switching, so},
                                   {run_kind::progressive, so}};
    specs[0].options.start_mode = parallel_mode::tp;
    specs[1].options.start_mode = parallel_mode::ep;
    specs[3].options.style = switch_style::progressive;
    specs.push_back({run_kind::paper_policy, paper_policy_options(so)});
    specs.push_back({run_kind::by_cost, so});
    specs.back().options.style = switch_style::by_cost;
    const std::vector<run_outcome> runs = serve(trace, specs, worlds);

    std::vector<paper_metrics> m;
    for (const run_outcome& r : runs) {
      m.push_back(paper_metrics_of(trace, r.result, floods));
      ok = ok && r.result.failed_requests == 0;
      std::printf("  %s: served in %.1f s of host time (%lld steps, %lld preemptions)\n",
                  label_of(r.kind), r.wall_s, static_cast<long long>(r.result.steps.size()),
                  static_cast<long long>(r.result.preemptions));
    }
    if (rollout) {
      print_rollout_table(runs, m);
      const double bound = free_switch_bound_s(runs[1].result, *clock.clock, 8);
      std::printf("  a free switch at every step, capacity ignored (static EP's steps each priced in "
                  "both modes, the faster taken): %.1f s, %.3fx the better static layout\n",
                  bound, std::min(m[0].rollout_total_s, m[1].rollout_total_s) / bound);
    } else {
      print_bursty_table(runs, m);
    }
    print_gate(runs[2].result, &cal.curves, 0);
    if (o.search && rollout) {
      const search_result s = search_rollout(trace, base, floods, *clock.clock);
      print_search(s, std::min(m[0].rollout_total_s, m[1].rollout_total_s), m[2].rollout_total_s);
      nlohmann::json j;
      j["trace"] = name;
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
      results.push_back(std::move(j));
    }
    const std::string dir = o.out_dir + "/" + (kind == trace_kind::file ? "file" : to_string(kind));
    write_run_files(dir, runs);
    if (o.explain) write_decisions(dir, runs);
    for (size_t i = 0; i < runs.size(); ++i) {
      nlohmann::json j = metrics_json(m[i]);
      j["trace"] = name;
      j["run"] = label_of(runs[i].kind);
      j["deployment"] = to_string(deployment_of(runs[i].kind));
      j["clock"] = clock.clock->name();
      j["host_s"] = runs[i].wall_s;
      results.push_back(std::move(j));
    }
  }
  if (!o.results_file.empty()) {
    std::ofstream f(o.results_file);
    f << results.dump(2) << "\n";
    if (!f) throw std::runtime_error("cannot write " + o.results_file);
    std::printf("\n  every metric of every run: %s\n", o.results_file.c_str());
  }
  std::printf("%s (%.1f s)\n", ok ? "demo: ok" : "demo: FAILED",
              std::chrono::duration<double>(wall::now() - t_start).count());
  return ok ? 0 : 1;
}

}  // namespace mini_engine::demo
