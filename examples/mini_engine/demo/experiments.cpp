#include "experiments.hpp"

#include <algorithm>
#include <cstdio>
#include <sstream>

#include "designs_report.hpp"
#include "paper_report.hpp"
#include "prepared_trace.hpp"
#include "rollout_search.hpp"
#include "run_json.hpp"
#include "trace_stats.hpp"

namespace mini_engine::demo {

namespace {

using moebius::parallel_mode;

engine_options base_options(harness& h) {
  engine_options base;
  base.scheduler.max_running = h.settings.max_running;
  base.scheduler.max_step_tokens = h.settings.step_tokens;
  base.scheduler.admission =
      h.o.oracle_admission ? admission_policy::oracle : admission_policy::known;
  base.scheduler.engine = h.o.engine;
  base.scheduler.sglang.enable_mixed_chunk = h.o.mixed_chunk;
  base.scheduler.vllm_dp_engines = h.o.vllm_dp_engines;
  base.scheduler.default_max_new_tokens = h.o.max_new_tokens;
  h.progress.install(base);
  base.progress_every_steps = h.settings.progress_every_steps;
  return base;
}

// The rules for an open-loop trace at `t_high`: the paper's (T_l 0.8 T_h) with the run's
// cooldown and window.
moebius::switch_policy_config interactive_rules(const run_settings& s, int64_t t_high) {
  moebius::switch_policy_config c = moebius::interactive_config(t_high);
  c.cooldown_s = s.cooldown_s;
  c.cooldown_steps = s.cooldown_steps;
  c.down_window = s.down_window;
  return c;
}

// The rules at `t_high`: a rollout's (paper eq. 13, T_l = T_h, the run's cooldown in steps),
// else an open-loop trace's (interactive_rules).
moebius::switch_policy_config rules_at(const run_settings& s, bool rollout, int64_t t_high) {
  return rollout ? moebius::rollout_config(t_high, s.rollout_cooldown_steps)
                 : interactive_rules(s, t_high);
}

// Our policy's options: forced on the GPU, else the paper's rules at the calibrated thresholds
// (rollout rules for a trace with rollout steps; EP also on blocked admission; the start mode
// from the initial load) with the cost gate, else (no crossover measured) the faster mode.
engine_options switching_options(const harness& h, bool rollout,
                                 const moebius::calibration_result& cal,
                                 const engine_options& base) {
  const run_settings& s = h.settings;
  engine_options so = base;
  so.explain = h.o.explain;
  if (h.runtime == runtime_kind::gpu) {
    so.how = switching::forced;
    so.start_mode = parallel_mode::tp;
    for (int64_t step = s.forced_every_steps; step <= s.forced_last_step;
         step += s.forced_every_steps)
      so.forced_steps.push_back(step);
    return so;
  }
  if (!cal.has_thresholds) {
    so.start_mode = cal.cross.status == moebius::crossover_status::ep_always_faster
                        ? parallel_mode::ep
                        : parallel_mode::tp;
    return so;
  }
  so.how = switching::policy;
  so.policy = moebius::apply_calibration(cal, rules_at(s, rollout, cal.t_high));
  if (rollout) so.policy.t_low = so.policy.t_high;  // eq. 13 (apply_calibration sets T_l)
  so.start_mode = parallel_mode::tp;
  so.start_from_load = true;
  so.policy.enter_on_blocked_admission = true;
  so.policy.enter_on_sustained_gain = true;  // asked of the gate's curves: gated runs only
  so.gate.enabled = h.o.gate;
  so.gate.curves = cal.curves;
  return so;
}

// dcp only: our policy by capacity (run_policy::decide_for_capacity), which needs no
// crossover (TP at dcp 1 is the faster a step wherever its pool holds the KV): the rules'
// thresholds above any load (read only by the gate's residency), the gate on the design's
// calibrated curves, starting at dcp 1 (the first decision moves to dcp 2, moving no byte,
// when the first requests are expected to outgrow dcp 1's pool).
engine_options capacity_switching_options(const harness& h, bool rollout,
                                          const moebius::calibration_result& cal,
                                          const engine_options& base) {
  const run_settings& s = h.settings;
  engine_options so = base;
  so.explain = h.o.explain;
  so.how = switching::policy;
  so.policy = rules_at(s, rollout, s.max_running + 1);  // above any load
  so.start_mode = parallel_mode::tp;
  so.start_from_load = false;
  so.gate.enabled = h.o.gate;
  so.gate.curves = cal.curves;
  return so;
}

// --verbose: what the policy runs were served with.
void print_policy(const harness& h, const engine_options& so,
                  const moebius::calibration_result& cal) {
  if (so.how == switching::forced) {
    std::printf("  on the GPU the switching runs switch every %lld steps (forced)\n",
                static_cast<long long>(h.settings.forced_every_steps));
    return;
  }
  if (so.how != switching::policy) {
    std::printf("  no crossover in the measured range (%s): the switching runs stay in %s\n",
                moebius::to_string(cal.cross.status), moebius::to_string(so.start_mode));
    return;
  }
  std::ostringstream d;
  d << so.policy;
  std::printf("  policy: %s; ours: cost gate %s (margin %.2f, residency window %lld steps, "
              "horizon %lld steps), start mode from the initial load",
              d.str().c_str(), so.gate.enabled ? "on" : "OFF (--no-gate)", so.gate.margin,
              static_cast<long long>(so.gate.residency.window_steps),
              static_cast<long long>(so.gate.residency.horizon_steps));
  const auto& runs = h.settings.runs;
  if (std::find(runs.begin(), runs.end(), run_kind::paper_policy) != runs.end())
    std::printf("; paper policy: the rules alone, starting in TP");
  std::printf("\n");
}

// The paper's policy as written (§7.1, eq. 13): its rules at the same thresholds, the load it
// uses (running + waiting, capped at max_running), no gate, no blocked-admission or
// sustained-gain rule, starting in TP.
engine_options paper_policy_options(const engine_options& ours) {
  engine_options p = ours;
  p.gate.enabled = false;
  p.policy.enter_on_blocked_admission = false;
  p.policy.enter_on_sustained_gain = false;
  p.start_from_load = false;
  p.start_mode = parallel_mode::tp;
  return p;
}

// Our policy on each other switching design, with its own calibration and layouts.
using design_options = std::vector<std::pair<run_kind, engine_options>>;

run_spec spec_of(run_kind k, const engine_options& base, const engine_options& ours,
                 const design_options& designs) {
  run_spec r{k, is_static(k) ? base : ours};
  switch (k) {
    case run_kind::static_tp:
      r.options.start_mode = parallel_mode::tp;
      break;
    case run_kind::static_ep:
      r.options.start_mode = parallel_mode::ep;
      break;
    case run_kind::switching:
      break;
    case run_kind::progressive:
      r.options.style = switch_style::progressive;
      break;
    case run_kind::no_gate:
      r.options.gate.enabled = false;
      break;
    case run_kind::paper_policy:
      r.options = paper_policy_options(ours);
      break;
    case run_kind::by_cost:
      r.options.style = switch_style::by_cost;
      break;
    case run_kind::static_tp_dcp2:
    case run_kind::static_tep_dcp2: {
      const deployment d = sim_deployment_of(deployment_of(k));
      r.options.start_mode = d.start_mode();
      r.options.layouts = d.modes();
      break;
    }
    case run_kind::switching_dcp2:
    case run_kind::experts_only:
    case run_kind::dcp_only:
      for (const auto& [kind, o] : designs)
        if (kind == k) r.options = o;
      break;
  }
  return r;
}

// The runtime's runs; no gate only beside a policy with its gate (what the gate prevents).
std::vector<run_spec> plan_runs(const run_settings& s, const engine_options& base,
                                const engine_options& ours, const design_options& designs) {
  std::vector<run_spec> specs;
  for (const run_kind k : s.runs) {
    if (k == run_kind::no_gate && !(ours.how == switching::policy && ours.gate.enabled)) continue;
    specs.push_back(spec_of(k, base, ours, designs));
  }
  return specs;
}

// Our policy's options on each other switching design of `p` (its calibration, its layouts).
design_options design_options_of(const harness& h, const prepared_trace& p,
                                 const engine_options& base) {
  design_options out;
  for (const run_kind k : h.settings.runs) {
    if (!is_other_design(k)) continue;
    for (const auto& [kind, cal] : p.designs) {
      if (kind != deployment_of(k)) continue;
      const mode_layouts layouts = sim_deployment_of(kind).modes();
      engine_options o = layouts.differ_in_dcp_alone()
                             ? capacity_switching_options(h, p.rollout, cal, base)
                             : switching_options(h, p.rollout, cal, base);
      o.layouts = layouts;
      out.emplace_back(k, o);
    }
  }
  return out;
}

// --verbose on the host and GPU: the gate's reasoning, the rules without it, and the targets.
void print_host_gate(const harness& h, const prepared_trace& p,
                     const std::vector<run_outcome>& runs, const trace_outcome& out) {
  int64_t peak = 0;
  for (const step_record& st : run_of(runs, run_kind::static_tp).result.steps)
    peak = std::max(peak, st.running + st.waiting);
  peak = std::min(peak, h.settings.max_running);
  print_gate(run_of(runs, run_kind::switching).result, &p.cal.curves, peak);
  print_gate(run_of(runs, run_kind::progressive).result, &p.cal.curves, 0);
  const run_outcome* no_gate = find_run(runs, run_kind::no_gate);
  const run_outcome& best = best_static(runs);
  if (no_gate != nullptr && no_gate->summary.switches > 0) {
    std::printf(
        "    no gate: the rules alone switch %lld times (%.0f ms): %.3fx the best static "
        "tokens/s, p99 TTFT %.1f ms\n",
        static_cast<long long>(no_gate->summary.switches), no_gate->summary.switch_total_ms,
        best.summary.tokens_per_s > 0 ? no_gate->summary.tokens_per_s / best.summary.tokens_per_s
                                      : 0,
        no_gate->summary.p99_ttft_ms);
  }
  for (const target_check& t : out.targets) std::printf("  %s\n", t.line.c_str());
}

// Host and GPU: the targets, the bound and the tokens' proof (every switching run's greedy
// tokens are the static runs', request by request); the tables with --verbose, the summary at
// the end.
trace_outcome report_host_trace(harness& h, const prepared_trace& p,
                                const std::vector<run_outcome>& runs) {
  const bool gpu = h.runtime == runtime_kind::gpu, verbose = h.o.verbose;
  trace_outcome out;
  out.name = p.name;
  out.kind = p.kind;
  for (const run_outcome& r : runs) out.runs.emplace_back(r.kind, r.summary);
  out.differ = requests_that_differ(runs);
  out.digest = token_digest(runs.front().result);
  const run_outcome& best = best_static(runs);
  if (!gpu) {
    out.bound = bound_of(runs, *h.clock.clock, h.P, h.pool.front_world().arena.shape.num_layers);
    for (const run_kind k : {run_kind::switching, run_kind::progressive})
      out.targets.push_back(check_targets(p.kind, best.summary, run_of(runs, k).summary, label_of(k)));
  }
  if (verbose) {
    std::printf("\n");
    print_table(runs, runs.front().result.clock);
    print_switch_steps(runs);
    print_beside_best(runs, best);
    print_bound(out.bound);
    if (!gpu) print_host_gate(h, p, runs, out);
    std::printf("  greedy tokens: %s (%zu requests, digest %016llx)\n",
                out.differ == 0 ? (runs.size() == 5 ? "identical in all five runs"
                                                    : "identical in all four runs")
                                : "DIFFER",
                p.trace.size(), static_cast<unsigned long long>(out.digest));
  }
  const bool exact = !gpu || h.P == 1;  // virtual ranks on one GPU sum in another order
  out.ok = out.differ == 0 || !exact;
  const int64_t every = write_run_files(p.dir, runs, h.o.step_log_rows);
  if (verbose) std::printf("  %s\n", files_line(p.dir, every).c_str());
  return out;
}

// --search: the rollout served once per b of the grid, rules alone, on the switching deployment.
void run_search(harness& h, const prepared_trace& p, const engine_options& base,
                const std::vector<paper_metrics>& m, const std::vector<run_outcome>& runs) {
  std::vector<run_spec> specs;
  for (const int64_t b : k_search_grid) {
    engine_options e = base;
    e.how = switching::policy;
    e.policy = moebius::rollout_config(b, h.settings.rollout_cooldown_steps);
    e.gate.enabled = false;
    e.start_mode = parallel_mode::ep;
    specs.push_back({run_kind::paper_policy, e});
  }
  const std::vector<run_outcome> served = h.pool.serve(p.trace, specs, false);
  const search_result s = search_of(k_search_grid, paper_metrics_of_runs(p.trace, served, p.floods));
  const double tp = metrics_of(runs, m, run_kind::static_tp).rollout_total_s;
  const double ep = metrics_of(runs, m, run_kind::static_ep).rollout_total_s;
  print_search(s, std::min(tp, ep), metrics_of(runs, m, run_kind::switching).rollout_total_s);
  h.results.push_back(search_json(p.name, s));
}

// Simulated: the paper's table, the verdict, the JSON and the files; with --verbose the host
// time of each run, the bound and the gate's reasoning.
trace_outcome report_sim_trace(harness& h, const prepared_trace& p,
                               const std::vector<run_outcome>& runs, const engine_options& base) {
  const bool verbose = h.o.verbose;
  trace_outcome out;
  out.name = p.name;
  out.kind = p.kind;
  const std::vector<paper_metrics> m = paper_metrics_of_runs(p.trace, runs, p.floods);
  for (const run_outcome& r : runs) {
    out.ok = out.ok && r.result.failed_requests == 0;
    if (verbose)
      std::printf("  %s: served in %.1f s of host time (%lld steps, %lld preemptions)\n",
                  label_of(r.kind), r.wall_s, static_cast<long long>(r.result.steps.size()),
                  static_cast<long long>(r.result.preemptions));
  }
  if (verbose)
    std::printf("\n");
  else
    print_trace_title(p.name, p.trace, p.floods, p.rate, p.rate_given ? 0 : p.cal.cross.batch);
  if (p.rollout) {
    const double bound_s = free_switch_bound_s(run_of(runs, run_kind::static_ep).result,
                                               *h.clock.clock, h.P);
    print_rollout_table(runs, m, verbose);
    if (verbose) print_rollout_bound(runs, m, bound_s);
    if (!verbose) print_rollout_verdict(runs, m, bound_s);
  } else {
    print_interactive_table(runs, m, verbose);
    if (!verbose) print_interactive_verdict(runs, m);
  }
  print_designs_verdict(runs, m, p.rollout,
                        p.rollout ? design_bounds_s(runs, *h.clock.clock, h.P)
                                  : std::vector<std::pair<run_kind, double>>{});
  if (verbose) print_gate(run_of(runs, run_kind::switching).result, &p.cal.curves, 0);
  if (h.nodes != nullptr) print_nodes_trace(runs, p.rollout, *h.nodes);
  if (h.o.search && p.rollout) run_search(h, p, base, m, runs);
  const int64_t every = write_run_files(p.dir, runs, h.o.step_log_rows);
  std::printf("  %s\n", verbose ? files_line(p.dir, every).c_str()
                                : ("figure: " + p.dir + "/timeline.svg, and runs.png beside it "
                                   "where scripts/demo draws it; every step and request as CSV "
                                   "there")
                                      .c_str());
  if (h.o.explain) write_decisions(p.dir, runs);
  for (size_t i = 0; i < runs.size(); ++i) {
    h.results.push_back(run_json(p.name, runs[i], m[i], h.clock.clock->name(), p.cal));
    h.results.back()["engine"] = h.o.oracle_admission ? "oracle" : to_string(h.o.engine);
    h.results.back()["mixed_chunk"] = h.o.mixed_chunk;
    h.results.back()["vllm_dp_engines"] = h.o.vllm_dp_engines;
    h.results.back()["default_max_new_tokens"] = h.o.max_new_tokens;
  }
  return out;
}

}  // namespace

int64_t totals_context(const std::vector<request>& trace) {
  int64_t prompt_tokens = 0, output_tokens = 0;
  for (const request& r : trace) {
    prompt_tokens += static_cast<int64_t>(r.prompt.size());
    output_tokens += r.output_tokens;
  }
  return std::max<int64_t>(
      1, (prompt_tokens + output_tokens / 2) / static_cast<int64_t>(trace.size()));
}

trace_outcome serve_trace(harness& h, trace_kind kind) {
  if (h.o.verbose)
    std::printf("\n=== trace: %s ===\n",
                (kind == trace_kind::file ? h.o.trace_file : std::string(to_string(kind))).c_str());
  const prepared_trace p = prepare_trace(h, kind);
  const engine_options base = base_options(h);
  const engine_options ours = switching_options(h, p.rollout, p.cal, base);
  const design_options designs = design_options_of(h, p, base);
  if (h.o.verbose) print_policy(h, ours, p.cal);
  const bool announce = h.o.verbose && h.runtime != runtime_kind::sim;
  const std::vector<run_outcome> runs =
      h.pool.serve(p.trace, plan_runs(h.settings, base, ours, designs), announce);
  h.progress.done();
  return h.runtime == runtime_kind::sim ? report_sim_trace(h, p, runs, base)
                                        : report_host_trace(h, p, runs);
}

}  // namespace mini_engine::demo
