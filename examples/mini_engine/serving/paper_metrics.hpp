#pragma once

// The paper's metrics of a serving run (Moebius §9.2-9.3), per phase, computed from the run's
// request results and the trace it served:
//
//   bursty   flood and quiet periods found from the trace's own arrivals (1 s windows whose
//            arrivals reach flood_factor x the median window's, neighbours merged): mean and
//            p99 TTFT of the requests that arrived in a flood, mean and p99 TPOT of those that
//            arrived in quiet, the same over all requests
//   rollout  per rollout step, its time (from its start, when the step before it has finished,
//            to its last request's finish) and the total
//   both     switches (committed) and their total time on the serving clock; goodput: requests
//            a second that finish meeting a TTFT and a TPOT bound (two pairs, MLPerf
//            Inference's LLM latency constraints, see slo_bounds); tokens a second
//
// Nothing here serves or times: the figures are on the run's own clock (priced by a named model
// in a simulated run, measured on GPUs), and say so where they are printed.

#include <cstdint>
#include <iosfwd>
#include <string>
#include <vector>

#include "run_report.hpp"
#include "step_clock.hpp"
#include "trace.hpp"

namespace mini_engine {

// A latency bound pair for goodput: a request counts when TTFT <= ttft_ms and TPOT <= tpot_ms.
struct slo_bound {
  const char* name = "";
  double ttft_ms = 0, tpot_ms = 0;
};
// MLPerf Inference (v5.0 rules, Llama-2-70B): "interactive" TTFT 450 ms, TPOT 40 ms; "server"
// TTFT 2 s, TPOT 200 ms.
inline constexpr slo_bound slo_bounds[] = {{"interactive", 450, 40}, {"server", 2000, 200}};
inline constexpr int num_slo_bounds = 2;

struct arrival_period {
  double start_s = 0, end_s = 0;
};

// Flood periods of `trace` (open loop: requests without a rollout step): 1 s windows from the
// first arrival whose arrivals are >= flood_factor x the median window's (and >= 1), adjacent
// ones merged. Empty for a trace with no flood.
std::vector<arrival_period> find_floods(const std::vector<request>& trace,
                                        double flood_factor = 4.0);

struct latency_stats {
  int64_t requests = 0;
  double mean_ttft_ms = 0, p99_ttft_ms = 0, mean_tpot_ms = 0, p99_tpot_ms = 0;
};

struct paper_metrics {
  // Bursty (open loop).
  std::vector<arrival_period> floods;
  latency_stats flood, quiet, all;
  // Rollout (closed loop): per step its time, and the total.
  std::vector<double> rollout_step_s;
  double rollout_total_s = 0;
  // Both.
  int64_t switches = 0;  // committed
  double switch_total_ms = 0;
  double goodput_rps[num_slo_bounds] = {};
  double tokens_per_s = 0;
  double end_s = 0;
};

// The metrics of run `r` of `trace` (the trace it served: arrival periods and rollout steps).
// Throws errc::invalid_argument when the run's requests are not the trace's.
paper_metrics paper_metrics_of(const std::vector<request>& trace, const run_result& r,
                               const std::vector<arrival_period>& floods);

// The per-rollout-step oracle of the paper (§9.3): the sum over steps of the faster of the two
// static runs' step times. Throws errc::invalid_argument unless both have the same steps.
double per_step_oracle_s(const paper_metrics& tp, const paper_metrics& ep);

// The bound a free switch would reach on run `r`'s trajectory: every step priced in the other
// mode too by `clock` (at `num_ranks` ranks; an EP step with its work spread evenly over the
// ranks, the best EP can do), the faster taken, no switch charged. The trajectory is the run's
// own: the batch each step ran as its layout's pool admitted it, so admission is counted for
// that layout and not for the other. Seconds.
double free_switch_bound_s(const run_result& r, const step_clock& clock, int num_ranks);
// The same for a design that switches between configurations `a` and `b`: every step of `r`
// priced in both (a step's own configuration at the time it took), the faster taken. The paper's
// design is (TP, EP): the function above.
double free_switch_bound_s(const run_result& r, const step_clock& clock, int num_ranks,
                           const configuration& a, const configuration& b);

}  // namespace mini_engine
