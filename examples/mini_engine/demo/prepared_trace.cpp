#include "prepared_trace.hpp"

#include <algorithm>
#include <cstdio>
#include <sstream>

#include "paper_report.hpp"
#include "trace_stats.hpp"

namespace mini_engine::demo {

namespace {

using moebius::parallel_mode;

// The decode batches the calibration sweeps: powers of two up to the engine's batch.
std::vector<int64_t> calibration_batches(int64_t max_batch) {
  std::vector<int64_t> batches;
  for (int64_t b = 1; b < max_batch; b *= 2) batches.push_back(b);
  batches.push_back(max_batch);
  if (batches.size() < 2) batches.insert(batches.begin(), 1), batches.back() = 2;
  return batches;
}

// The host steady trace's arrival rate: Little's law at the crossover, B* running, each for
// ~25 steps (24 outputs on average + its prefill) of the crossover's step time; calibrated at a
// first guess of the context (20 prompt + 24 output tokens).
double crossover_rate_of(engine& e, const std::vector<int64_t>& batches, int64_t max_batch) {
  const moebius::calibration_result c0 = calibrate_engine(e, batches, 44);
  const double bstar = c0.has_thresholds ? c0.cross.batch : static_cast<double>(max_batch) / 2;
  return bstar / (25.0 * c0.curves.tp.at(bstar) * 1e-3);
}

void print_floods(const std::vector<arrival_period>& floods) {
  for (const arrival_period& p : floods)
    std::printf("  flood found in the arrivals: %.0f-%.0f s\n", p.start_s, p.end_s);
}

// --verbose: the trace's shape, its floods (simulated), the calibration.
void print_prepared(const harness& h, const prepared_trace& p, int64_t context) {
  const bool sim = h.runtime == runtime_kind::sim;
  std::ostringstream s;
  s << statistics_of(p.trace, sim && p.rollout ? k_rollout_output_cap : 0);
  std::printf("  %s, seed %llu", s.str().c_str(), static_cast<unsigned long long>(h.o.seed));
  if (p.kind == trace_kind::steady)
    std::printf(", %d requests/s: ~B* running", static_cast<int>(p.rate));
  std::printf("\n");
  if (sim) print_floods(p.floods);
  std::ostringstream d;
  d << p.cal;
  std::printf("  calibration at %lld context tokens: %s\n", static_cast<long long>(context),
              d.str().c_str());
  for (const auto& [kind, cal] : p.designs) {
    std::ostringstream c;
    c << cal;
    std::printf("  calibration of the %s design (%s): %s\n", to_string(kind),
                layouts_of(sim_deployment_of(kind)).c_str(), c.str().c_str());
  }
}

// The mean output tokens of the paper-scale open-loop traces served at the rate that keeps ~B*
// running (paper-steady, paper-production), as their options draw them; 0 for any other kind.
double crossover_output_mean(trace_kind kind) {
  if (kind == trace_kind::paper_steady) return paper_steady_options{}.output_mean;
  if (kind == trace_kind::paper_production)
    return paper_production_output_mean(paper_production_options{});
  return 0;
}

// paper-steady and paper-production: the rate that keeps ~B* running (Little's law): B*
// sequences each decoding `output_mean` tokens at the curves' step time at B*; or --rate. The
// lengths' distribution, and so the calibration's context, does not depend on the rate (its
// sample mean moves with the count by sampling alone): the trace is drawn again at it, same
// seed.
void redraw_at_rate(const harness& h, int32_t vocab, double output_mean, prepared_trace& p) {
  p.rate_given = h.o.rate > 0;
  const double step_s =
      p.rate_given ? 0 : p.cal.curves.latency_ms(parallel_mode::tp, p.cal.cross.batch) / 1e3;
  p.rate = p.rate_given ? h.o.rate : p.cal.cross.batch / (output_mean * step_s);
  p.trace = make_trace(h.o, p.kind, vocab, p.rate);
  p.floods = find_floods(p.trace);
  if (!h.o.verbose) return;
  std::ostringstream s;
  s << statistics_of(p.trace, 0);
  if (p.rate_given)
    std::printf("  at %.2f requests/s (--rate): %s\n", p.rate, s.str().c_str());
  else
    std::printf("  at %.2f requests/s (B* %.0f / (%.1f output tokens x %.1f ms)): %s\n", p.rate,
                p.cal.cross.batch, output_mean, step_s * 1e3, s.str().c_str());
  print_floods(p.floods);
}

}  // namespace

prepared_trace prepare_trace(harness& h, trace_kind kind) {
  prepared_trace p;
  p.kind = kind;
  p.name = kind == trace_kind::file ? h.o.trace_file : to_string(kind);
  p.dir = h.o.out_dir + "/" + (kind == trace_kind::file ? "file" : to_string(kind));
  const std::vector<int64_t> batches = calibration_batches(h.settings.max_running);
  engine& e = h.pool.calibration_engine();
  const int32_t vocab = h.pool.front_world().vocab;
  if (kind == trace_kind::steady) p.rate = crossover_rate_of(e, batches, h.settings.max_running);
  p.trace = make_trace(h.o, kind, vocab, p.rate);
  if (p.trace.empty()) throw usage_error("--trace: the trace has no requests");
  p.rollout = kind == trace_kind::rollout ||
              std::any_of(p.trace.begin(), p.trace.end(),
                          [](const request& r) { return r.rollout_step >= 0; });
  if (h.runtime == runtime_kind::sim) p.floods = find_floods(p.trace);
  const int64_t context = h.settings.calibration_context(p.trace);
  moebius::calibration_options calibration;
  calibration.fit = moebius::curve_fit::piecewise_linear;
  p.cal = calibrate_engine(e, batches, context, calibration);
  if (h.runtime == runtime_kind::sim) {
    for (const run_kind k : h.settings.runs) {
      if (!is_other_design(k)) continue;
      const deployment_kind d = deployment_of(k);
      p.designs.emplace_back(d, calibrate_engine(h.pool.calibration_engine(d), batches, context,
                                                 calibration, sim_deployment_of(d).modes()));
    }
  }
  if (h.o.verbose) print_prepared(h, p, context);
  const double output_mean = crossover_output_mean(kind);
  if (output_mean > 0 && (p.cal.has_thresholds || h.o.rate > 0))
    redraw_at_rate(h, vocab, output_mean, p);
  return p;
}

}  // namespace mini_engine::demo
