#pragma once

// What a serving run leaves behind: a record per step and per switch, every request's result,
// and the summary metrics computed from them (TTFT, TPOT, throughput, switches), with the
// steps as CSV. Nothing here serves; engine::run fills a run_result.

#include <cstdint>
#include <iosfwd>
#include <moebius/layout/parallel_layout.hpp>
#include <moebius/policy/switch_policy.hpp>
#include <moebius/switch/switch_report.hpp>
#include <string>
#include <vector>

#include "configuration.hpp"
#include "scheduler.hpp"
#include "step_clock.hpp"

namespace mini_engine {

// One step, as the CSV records it.
struct step_record {
  int64_t step = 0;
  double start_s = 0;  // serving clock at the step's start
  // The policy's mode the step ran in (engine_options::layouts maps it to a layout; during a
  // switch, the source's, whose tables the batch was built from), and the configuration the
  // clock priced it as (the paper's runs outside a switch: EP or TP, the mode's own; during
  // a progressive switch, the layout of most of its layers).
  moebius::parallel_mode mode = moebius::parallel_mode::ep;
  configuration config = moebius::parallel_mode::ep;
  int64_t sequences = 0, decode_tokens = 0, prefill_tokens = 0, context_tokens = 0;
  int64_t running = 0, waiting = 0, stalled = 0, preempted = 0;
  int64_t decodes_held = 0;   // step_batch::decodes_held (sglang's prefill-first steps)
  int64_t kv_used_pages = 0;  // sum over ranks, in `mode`'s pages
  // Admission's view after the step (step_batch): tokens written and tokens counted as taken
  // (TP: one rank's; EP: every rank's), and SGLang's new_token_ratio (0 under other presets).
  int64_t kv_written_tokens = 0, kv_reserved_tokens = 0;
  double new_token_ratio = 0;
  // A decode batch above the engine's CUDA-graph limit (sglang_rules::cuda_graph_max_bs): run
  // eagerly. Carried for the clock, which prices it as any other step for now.
  bool eager = false;
  double step_ms = 0;         // on the serving clock
  double measured_ms = 0;     // host (or GPU) time of runtime.step()
  bool switched = false;      // a switch ran before this step
  double switch_ms = 0;       // its time on the serving clock
  // Progressive: the step ran during a switch (hybrid) with the copies of `layers` layers
  // beside it; copy_ms is what the clock charges for those copies alone and step_ms what it
  // charges for both (step_clock::switch_step_s: measured, the step's device time plus the wait
  // for copies that outlasted it; priced, by the measured slowdown curve).
  bool in_switch = false;
  int64_t layers = 0;
  int64_t cursor = 0;  // arena cursor (TP layers) the step ran at
  double copy_ms = 0;
  // EP outside a progressive switch: each rank's share of the step (ep_rank_work), as the clock
  // was given it, so that the step can be priced again offline; empty otherwise.
  std::vector<rank_work> ranks;
};

struct switch_record {
  int64_t step = 0;  // ran before this step
  double start_s = 0;
  moebius::parallel_layout from, to;
  int64_t from_dcp = 1, to_dcp = 1;  // the TP view's dcp before and after (a dcp change's)
  moebius::switch_outcome outcome = moebius::switch_outcome::committed;
  double clock_ms = 0, measured_ms = 0;
  int64_t running = 0, prefilling = 0;  // sequences live, and of them mid chunked prefill
  std::string error;
  // Progressive: steps served during the switch, layers advanced per step (paced), tokens
  // produced meanwhile. clock_ms is then begin to finish on the serving clock.
  bool progressive = false;
  int64_t steps = 0, layers_per_step = 0, tokens = 0;
  // The cost gate's reasoning when it let this switch through (evaluated false: no gate).
  moebius::gate_evaluation gate;
  // switch_style::by_cost: each style's price in request-seconds (engine::price_styles) with
  // the requests waiting then; the cheaper one ran (progressive says which). 0 under a fixed
  // style.
  double stall_request_s = 0, progressive_request_s = 0;
  int64_t waiting = 0;
  // Outcome inconsistent: the engine recovered (engine_options::reload_experts) and the
  // sequences whose K/V was lost (resumed or failed, as lost_kv says).
  bool recovered = false;
  int64_t lost_sequences = 0;
};

// One decision of a policy run in which a rule fired (engine_options::explain): what the policy
// saw and what it decided, with the gate's numbers when it weighed the switch. A run of the same
// decision on consecutive steps, none priced, is one record with the first step's numbers
// (repeats counts the steps after it).
struct decision_record {
  int64_t step = 0;
  double now_s = 0;
  moebius::parallel_mode mode = moebius::parallel_mode::ep;  // the mode the engine ran in
  int64_t load = 0, running = 0, waiting = 0;
  bool admission_blocked = false;
  moebius::switch_decision decision;
  moebius::gate_evaluation gate;  // evaluated only when the gate weighed it
  int64_t repeats = 0;
};

// "step 120 at 3.41 s in TP: load 300 (280 running, 20 waiting, admission blocked): switch to EP
// (above_high); gate{...}"
std::ostream& operator<<(std::ostream& os, const decision_record& d);

struct run_result {
  std::string name;
  std::string clock;  // step_clock::name()
  std::vector<step_record> steps;
  std::vector<switch_record> switches;   // committed or not
  std::vector<request_result> requests;  // sorted by id
  double end_s = 0;
  int64_t stalls = 0;
  int64_t preemptions = 0;      // admission_policy::known: running sequences preempted (sglang: retracted)
  int64_t failed_requests = 0;  // requests with request_result::error set
  // Policy runs: the policy as configured, the gate's curves (if any), the decisions the gate
  // refused, and the last refusal's reasoning.
  std::string policy;
  std::string gate;
  int64_t gate_refusals = 0;
  moebius::gate_evaluation last_refusal;
  std::vector<decision_record> decisions;  // engine_options::explain
  // cost_gate_options::correct_curves: how often the gate's curves were corrected, and the
  // last correction ("x1.07 EP, x1.02 TP, crossing at 212").
  int64_t corrections = 0;
  std::string correction;
};

struct run_summary {
  int64_t requests = 0, output_tokens = 0, steps = 0;
  double mean_ttft_ms = 0, p99_ttft_ms = 0, mean_tpot_ms = 0, p99_tpot_ms = 0, tokens_per_s = 0;
  int64_t switches = 0;  // committed
  double switch_total_ms = 0, switch_mean_ms = 0;
  double duration_s = 0;
};

run_summary summarize(const run_result& r);

// run,step,start_s,mode,sequences,...,config: one line per step (header first); mode the
// policy's (EP / TP), config what the step was priced as (TP, TEP-DCP2, ...).
void write_steps_csv(std::ostream& os, const run_result& r);
// One line per request of `r`: run, id, arrival, admission, first and last token (s, -1 when
// none), prompt and output tokens, preemptions, failed (0/1). With a header unless `header` is
// false.
void write_requests_csv(std::ostream& os, const run_result& r, bool header = true);

}  // namespace mini_engine
