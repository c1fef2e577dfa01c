#include "experiments.hpp"

#include <algorithm>

#include <chrono>
#include <cstdio>
#include <exception>
#include <moebius/error.hpp>
#include <mutex>
#include <sstream>
#include <thread>

#include "paper_traces.hpp"
#include "report.hpp"

namespace mini_engine::demo {

namespace {

using moebius::parallel_mode;
using wall = std::chrono::steady_clock;

// The decode batches the calibration sweeps: powers of two up to the engine's batch.
std::vector<int64_t> calibration_batches(int64_t max_batch) {
  std::vector<int64_t> batches;
  for (int64_t b = 1; b < max_batch; b *= 2) batches.push_back(b);
  batches.push_back(max_batch);
  if (batches.size() < 2) batches.insert(batches.begin(), 1), batches.back() = 2;
  return batches;
}

// The steady trace's arrival rate: Little's law at the crossover, B* running, each for ~25
// steps (24 outputs on average + its prefill) of the crossover's step time; calibrated at a
// first guess of the context (20 prompt + 24 output tokens).
double crossover_rate_of(engine& e, const std::vector<int64_t>& batches, int64_t max_batch) {
  const moebius::calibration_result c0 = calibrate_engine(e, batches, 44);
  const double bstar = c0.has_thresholds ? c0.cross.batch : static_cast<double>(max_batch) / 2;
  return bstar / (25.0 * c0.curves.tp.at(bstar) * 1e-3);
}

void print_trace_stats(const std::vector<request>& trace, const options& o, trace_kind kind,
                       double crossover_rate, int64_t* prompt_tokens, int64_t* output_tokens) {
  *prompt_tokens = 0;
  *output_tokens = 0;
  for (const request& r : trace) {
    *prompt_tokens += static_cast<int64_t>(r.prompt.size());
    *output_tokens += r.output_tokens;
  }
  std::printf(
      "  %zu requests, %lld prompt + %lld output tokens, seed %llu%s\n", trace.size(),
      static_cast<long long>(*prompt_tokens), static_cast<long long>(*output_tokens),
      static_cast<unsigned long long>(o.seed),
      kind == trace_kind::steady
          ? (", " + std::to_string(static_cast<int>(crossover_rate)) + " requests/s: ~B* running")
                .c_str()
          : "");
}

// The options of the switching runs: forced on the GPU, else our calibrated policy with its
// gate (rollout rules for a trace with rollout steps, a trace file's included; EP on blocked
// admission; the start mode from the initial load), else (no crossover measured) the faster
// mode.
engine_options switching_options(const options& o, bool rollout, const world& w,
                                 const moebius::calibration_result& cal, const engine_options& base,
                                 const switching_settings& s = {}) {
  engine_options so = base;
  if (w.on_gpu) {
    so.how = switching::forced;
    so.start_mode = parallel_mode::tp;
    for (int64_t step = s.forced_every_steps; step <= s.forced_last_step;
         step += s.forced_every_steps)
      so.forced_steps.push_back(step);
    std::printf("  on the GPU the switching runs switch every %lld steps (forced)\n",
                static_cast<long long>(s.forced_every_steps));
    return so;
  }
  if (!cal.has_thresholds) {
    so.start_mode = cal.cross.status == moebius::crossover_status::ep_always_faster
                        ? parallel_mode::ep
                        : parallel_mode::tp;
    std::printf("  no crossover in the measured range (%s): the switching runs stay in %s\n",
                moebius::to_string(cal.cross.status), moebius::to_string(so.start_mode));
    return so;
  }
  so.how = switching::policy;
  if (rollout) {
    so.policy = moebius::apply_calibration(
        cal, moebius::rollout_config(cal.t_high, s.rollout_cooldown_steps));
    so.policy.t_low = so.policy.t_high;
  } else {
    so.policy = moebius::apply_calibration(cal, moebius::interactive_config(cal.t_high));
    so.policy.cooldown_s = s.interactive_cooldown_s;
    so.policy.cooldown_steps = s.interactive_cooldown_steps;
    so.policy.down_window = s.interactive_down_window;
  }
  so.start_mode = parallel_mode::tp;
  so.start_from_load = true;
  so.policy.enter_on_blocked_admission = true;
  so.gate.enabled = o.gate;
  so.gate.curves = cal.curves;  // the calibration printed before
  std::ostringstream d;
  d << so.policy;
  std::printf(
      "  policy: %s; cost gate %s (margin %.2f, residency window %lld steps, horizon "
      "%lld steps)\n",
      d.str().c_str(), o.gate ? "on" : "OFF (--no-gate)", so.gate.margin,
      static_cast<long long>(so.gate.residency.window_steps),
      static_cast<long long>(so.gate.residency.horizon_steps));
  return so;
}

// Static TP, static EP, switching and progressive; with a policy and its gate, also the policy
// without the gate (what the gate prevents).
std::vector<run_spec> plan_runs(const options& o, const engine_options& base,
                                const engine_options& switching_opts) {
  std::vector<run_spec> runs = {{run_kind::static_tp, base},
                                {run_kind::static_ep, base},
                                {run_kind::switching, switching_opts},
                                {run_kind::progressive, switching_opts}};
  runs[0].options.start_mode = parallel_mode::tp;
  runs[1].options.start_mode = parallel_mode::ep;
  runs[3].options.style = switch_style::progressive;
  if (switching_opts.how == switching::policy && o.gate) {
    runs.push_back({run_kind::no_gate, switching_opts});
    runs.back().options.gate.enabled = false;
  }
  return runs;
}

// Requests whose greedy tokens differ between any run and the first.
int64_t requests_that_differ(const std::vector<request>& trace,
                             const std::vector<run_outcome>& runs) {
  int64_t differ = 0;
  for (size_t i = 0; i < trace.size(); ++i) {
    const auto& a = runs.front().result.requests[i].generated;
    for (size_t k = 1; k < runs.size(); ++k) {
      if (runs[k].result.requests[i].generated != a) {
        ++differ;
        break;
      }
    }
  }
  return differ;
}

// FNV-1a over every request's greedy tokens, a separator after each request: one number to
// compare a trace's tokens between two builds (the GPU demo before and after a change).
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

}  // namespace

const char* label_of(run_kind k) {
  switch (k) {
    case run_kind::static_tp:
      return "static TP";
    case run_kind::static_ep:
      return "static EP";
    case run_kind::switching:
      return "ours";
    case run_kind::progressive:
      return "ours progressive";
    case run_kind::no_gate:
      return "no gate";
    case run_kind::paper_policy:
      return "paper policy";
    case run_kind::by_cost:
      return "ours by cost";
  }
  return "unknown";
}

trace_shapes demo_trace_shapes() {
  trace_shapes t;
  t.bursty.duration_s = 1.4;
  t.bursty.quiet_s = 0.6;
  t.bursty.quiet_rate = 40;
  t.bursty.burst_s = 0.1;
  t.bursty.burst_rate = 5500;
  t.bursty.prompt_min = 8;
  t.bursty.prompt_max = 32;
  t.bursty.output_min = 4;
  t.bursty.output_max = 32;
  t.rollout.prompt_min = 16;
  t.rollout.prompt_max = 48;
  t.rollout.output_median = 32;
  t.rollout.output_sigma = 1.0;
  t.rollout.output_max = 1024;
  t.steady.duration_s = 1.5;
  t.steady.prompt_min = 8;
  t.steady.prompt_max = 32;
  t.steady.output_min = 8;
  t.steady.output_max = 40;
  t.production.duration_s = 3.0;
  t.production.mean_rate = 30;
  t.production.rate_period_s = 0.5;
  t.production.prompt_max = 256;
  t.production.output_max = 512;
  return t;
}

std::vector<request> make_trace(const options& o, trace_kind kind, int32_t vocab,
                                double crossover_rate) {
  trace_shapes t = demo_trace_shapes();
  auto duration = [&](double own) { return o.duration_s > 0 ? o.duration_s : own; };
  switch (kind) {
    case trace_kind::bursty:
      t.bursty.duration_s = duration(t.bursty.duration_s);
      t.bursty.vocab = vocab;
      return bursty_trace(o.seed, t.bursty);
    case trace_kind::rollout:
      t.rollout.batch = o.requests;
      t.rollout.vocab = vocab;
      return rollout_trace(o.seed, t.rollout);
    case trace_kind::steady:
      t.steady.duration_s = duration(t.steady.duration_s);
      t.steady.rate = crossover_rate;
      t.steady.vocab = vocab;
      return steady_trace(o.seed, t.steady);
    case trace_kind::production:
      t.production.duration_s = duration(t.production.duration_s);
      t.production.prompt_scale = o.context_scale;
      t.production.vocab = vocab;
      return production_trace(o.seed, t.production);
    case trace_kind::paper_bursty: {
      paper_bursty_options b;
      b.vocab = vocab;
      return paper_bursty_trace(o.seed, b);
    }
    case trace_kind::paper_steady: {  // crossover_rate: the rate that keeps ~B* running
      paper_steady_options s;
      s.vocab = vocab;
      if (crossover_rate > 0) s.rate = crossover_rate;
      return paper_steady_trace(o.seed, s);
    }
    case trace_kind::paper_rollout: {
      paper_rollout_options r;
      r.vocab = vocab;
      if (o.rollout_median >= 0) r.output_median = o.rollout_median;
      if (o.rollout_cut >= 0) r.cut_share = o.rollout_cut;
      return paper_rollout_trace(o.seed, r);
    }
    case trace_kind::file:
      try {
        return read_trace_file(o.trace_file, o.seed, vocab);
      } catch (const moebius::error& e) {
        throw usage_error(std::string("--trace: ") + e.what());
      }
  }
  return {};
}

const run_outcome* find_run(const std::vector<run_outcome>& runs, run_kind k) {
  for (const run_outcome& r : runs) {
    if (r.kind == k) return &r;
  }
  return nullptr;
}

std::vector<run_outcome> serve_runs(const std::vector<request>& trace,
                                    const std::vector<run_spec>& specs,
                                    const std::vector<engine*>& pool) {
  std::vector<run_outcome> out(specs.size());
  std::exception_ptr failure;
  std::mutex failure_mutex;
  for (size_t first = 0; first < specs.size(); first += pool.size()) {
    std::vector<std::thread> threads;
    for (size_t j = 0; j < pool.size() && first + j < specs.size(); ++j) {
      const size_t k = first + j;
      std::printf("  %s ...\n", label_of(specs[k].kind));
      std::fflush(stdout);
      threads.emplace_back([&, k, j] {
        try {
          const auto t0 = wall::now();
          out[k].kind = specs[k].kind;
          out[k].result = pool[j]->run(trace, specs[k].options, label_of(specs[k].kind));
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

trace_outcome serve_trace(const options& o, trace_kind kind, world& w, engine& e,
                          const std::vector<engine*>& pool, const step_clock& clock, int P,
                          const std::function<void(engine_options&)>& set_progress) {
  trace_outcome out;
  out.name = kind == trace_kind::file ? o.trace_file : to_string(kind);
  std::printf("\n=== trace: %s ===\n", out.name.c_str());

  const std::vector<int64_t> batches = calibration_batches(o.max_batch);
  const double crossover_rate =
      kind == trace_kind::steady ? crossover_rate_of(e, batches, o.max_batch) : 0;
  const std::vector<request> trace = make_trace(o, kind, w.vocab, crossover_rate);
  if (trace.empty()) throw usage_error("--trace: the trace has no requests");
  int64_t prompt_tokens = 0, output_tokens = 0;
  print_trace_stats(trace, o, kind, crossover_rate, &prompt_tokens, &output_tokens);

  // The calibration at the trace's mean context (prompt + half the output).
  const int64_t context = std::max<int64_t>(
      1, (prompt_tokens + output_tokens / 2) / static_cast<int64_t>(trace.size()));
  // The crossover where the curves themselves cross (piecewise through the points).
  moebius::calibration_options calibration;
  calibration.fit = moebius::curve_fit::piecewise_linear;
  const moebius::calibration_result cal = calibrate_engine(e, batches, context, calibration);
  {
    std::ostringstream d;
    d << cal;
    std::printf("  calibration at %lld context tokens: %s\n", static_cast<long long>(context),
                d.str().c_str());
  }
  engine_options base;
  base.scheduler.max_running = o.max_batch;
  base.scheduler.max_step_tokens = o.step_tokens;
  base.scheduler.admission = o.oracle_admission ? admission_policy::oracle : admission_policy::known;
  set_progress(base);
  // The rollout trace (one batch at t = 0), or any trace with rollout steps.
  const bool rollout = kind == trace_kind::rollout ||
                       std::any_of(trace.begin(), trace.end(),
                                   [](const request& r) { return r.rollout_step >= 0; });
  const engine_options switching_opts = switching_options(o, rollout, w, cal, base);
  const std::vector<run_outcome> runs = serve_runs(trace, plan_runs(o, base, switching_opts), pool);

  // The proof: the switching runs' greedy tokens are the static runs', request by request.
  const int64_t differ = requests_that_differ(trace, runs);
  print_table(runs, runs.front().result.clock);
  print_switch_steps(runs);
  const run_outcome& best = best_static(runs);
  print_beside_best(runs, best);
  if (!w.on_gpu) print_bound(runs, clock, P, w.arena.shape.num_layers);
  if (!w.on_gpu) {
    int64_t peak = 0;
    for (const step_record& st : find_run(runs, run_kind::static_tp)->result.steps)
      peak = std::max(peak, st.running + st.waiting);
    peak = std::min(peak, o.max_batch);
    print_gate(find_run(runs, run_kind::switching)->result, &cal.curves, peak);
    print_gate(find_run(runs, run_kind::progressive)->result, &cal.curves, 0);
    const run_outcome* no_gate = find_run(runs, run_kind::no_gate);
    if (no_gate != nullptr && no_gate->summary.switches > 0) {
      std::printf(
          "    no gate: the rules alone switch %lld times (%.0f ms): %.3fx the best static "
          "tokens/s, p99 TTFT %.1f ms\n",
          static_cast<long long>(no_gate->summary.switches), no_gate->summary.switch_total_ms,
          best.summary.tokens_per_s > 0 ? no_gate->summary.tokens_per_s / best.summary.tokens_per_s
                                        : 0,
          no_gate->summary.p99_ttft_ms);
    }
    for (const run_kind k : {run_kind::switching, run_kind::progressive}) {
      out.targets.push_back(
          check_targets(kind, best.summary, find_run(runs, k)->summary, label_of(k)));
      std::printf("  %s\n", out.targets.back().line.c_str());
    }
  }
  std::printf("  greedy tokens: %s (%zu requests, digest %016llx)\n",
              differ == 0
                  ? (runs.size() == 5 ? "identical in all five runs" : "identical in all four runs")
                  : "DIFFER",
              trace.size(), static_cast<unsigned long long>(token_digest(runs.front().result)));
  const bool exact = !w.on_gpu || P == 1;
  out.tokens_identical = differ == 0 || !exact;
  write_run_files(o.out_dir + "/" + (kind == trace_kind::file ? "file" : to_string(kind)), runs);
  return out;
}

}  // namespace mini_engine::demo
