#pragma once

// moebius_demo's command line: CLI11 finds the options and their values (an unknown option,
// a missing value or a value given twice is an error), and each value is read strictly: its
// type (no trailing garbage: `4x`, `2.9` for an integer) and its range. A bad command line
// throws usage_error, which main() reports with exit status 2.

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "engine_preset.hpp"
#include "step_collectives.hpp"
#include "trace.hpp"

namespace mini_engine::demo {

class usage_error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

enum class runtime_kind : uint8_t { automatic, host, gpu, sim };
// paper_bursty, paper_rollout, paper_steady, paper_production: the paper's experiments and
// two traces beside them at full size (serving/paper_traces.hpp), for the simulated runtime.
enum class trace_kind : uint8_t {
  bursty,
  rollout,
  steady,
  production,
  file,
  paper_bursty,
  paper_rollout,
  paper_steady,
  paper_production
};
// The model the H200 clock prices each step as.
enum class priced_kind : uint8_t { qwen3_30b_a3b, qwen3_235b_a22b };
enum class clock_kind : uint8_t { automatic, model, measured };

struct options {
  runtime_kind runtime = runtime_kind::automatic;
  int ranks = 8;                 // P (virtual ranks on the host)
  // P of the GPU runtime; 0: 2 (one per GPU with two GPUs or more, virtual on one GPU). More
  // than the GPUs: virtual ranks (all on GPU 0).
  int gpu_ranks = 0;
  // The traces served, in order (default: bursty, rollout, steady, production).
  std::vector<trace_kind> traces = {trace_kind::bursty, trace_kind::rollout, trace_kind::steady,
                                    trace_kind::production};
  bool traces_given = false;  // --trace was given (else the GPU runtime serves bursty, rollout)
  std::string trace_file;        // trace_kind::file
  std::string write_trace;       // non-empty: write the (single) trace as JSONL here and exit
  priced_kind priced = priced_kind::qwen3_235b_a22b;
  // --model DIR: a Hugging Face Qwen3-MoE checkpoint directory the runtime serves (instead of
  // the demo's random model); empty: the random model.
  std::string model_dir;
  bool gate = true;              // the cost gate in the switching runs
  uint64_t seed = 1;
  double duration_s = 0;         // bursty/steady/production length, s (0: each trace's own)
  int64_t requests = 512;        // rollout: the batch
  int64_t kv_pages = 0;          // EP KV pages per rank (0: what an H200 holds, priced)
  int64_t max_batch = 512;       // sequences running at once
  int64_t step_tokens = 1024;    // token budget per step (chunked prefill)
  clock_kind clock = clock_kind::automatic;
  double context_scale = 32;     // H200 model: each context token priced as this many
  // H200 model: decode steps from measured per-rank curves (bench_mini_engine_rank_share's
  // JSON lines, serving/step_curves.hpp) in this file, or "roofline"; empty: the priced
  // deployment's curves committed under docs/results when there are any, else the roofline.
  std::string curves;
  std::string out_dir = "moebius_demo_out";
  std::string results_file;  // --results FILE: every metric of every run as JSON
  // How admission reserves KV pages (serving/scheduler.hpp): what is known, with preemption by
  // recompute as vLLM and SGLang do (the default), or each request's true output (an oracle).
  bool oracle_admission = false;
  // Whose scheduling rules admission on what is known follows (serving/engine_preset.hpp):
  // vLLM's (the default) or SGLang's.
  engine_preset engine = engine_preset::vllm;
  // --engine sglang: SGLang's --enable-mixed-chunk (a prefill step carries the running decodes;
  // engine_preset.hpp). vLLM always mixes.
  bool mixed_chunk = false;
  // --engine vllm: one engine core per DP rank under EP (scheduler_options::vllm_dp_engines:
  // each rank its own token budget and max_running / P).
  bool vllm_dp_engines = false;
  // The max_new_tokens of a request whose trace gives none (raised to its output where that is
  // longer): what SGLang's admission charges (trace.hpp, k_default_max_new_tokens).
  int64_t max_new_tokens = k_default_max_new_tokens;
  // --runtime sim, rollout traces: search one switch point per rollout step over a grid of
  // thresholds (the offline ceiling, paper_report.hpp).
  bool search = false;
  // --runtime sim: every decision of the policy runs in which a rule fired (decisions.txt).
  bool explain = false;
  // --runtime sim: what prices the step curves' collectives (serving/step_collectives.hpp):
  // the cited measurements (serving/collective_table.hpp, the default) or the link model;
  // collectives_given: --collectives was given.
  collective_pricing collectives = collective_pricing::cited;
  bool collectives_given = false;
  // --runtime sim: the link model with each collective's latency at these us, TP's all-reduce
  // and EP's dispatch or combine (< 0: not given), for the results' sensitivity to it.
  double collective_us_tp = -1, collective_us_ep = -1;
  // --runtime sim: the paper's deployment over this many nodes of 8 H200s, priced (a what-if,
  // nodes_report.hpp): 1 the paper's one node; 2 EP16 against TP8 x 2, every step and switch
  // of the one-node runs repriced.
  int nodes = 1;
  // --runtime sim: the routing skew the busiest EP rank's expert load is priced at
  // (serving/expert_load.hpp: 0 uniform, > 0 a Zipf exponent).
  double routing_skew = 0;
  // --runtime sim: price each decode step at the CUDA-graph bucket an engine pads its rank
  // batch to, vLLM's default capture sizes (serving/graph_buckets.hpp: 1, 2, 4, 8..512 step
  // 8; beyond them eager); false: at its own batch. graph_buckets_given: --graph-buckets was
  // given.
  bool vllm_graph_buckets = false;
  bool graph_buckets_given = false;
  // --rate: paper-steady's and paper-production's requests/s (mean requests/s), instead of
  // the rate that keeps ~B* running (0: that rate, from the calibration).
  double rate = 0;
  // paper-rollout's shape for the sensitivity sweep (serving/paper_traces.hpp; < 0: its own).
  double rollout_median = -1;  // output tokens
  double rollout_cut = -1;     // share of responses cut at the cap
  bool reshard_stage = true;
  // --verbose: every table of every run, the deployment, the clock, the calibration, the
  // policy's configuration and the gate's reasoning (by default: a table per trace and a
  // verdict).
  bool verbose = false;
  // The step log (steps.csv) of a trace's runs holds at most this many rows (about 90 bytes
  // each: ~7 MB): every k-th step of each run, k the same for every run of the trace, and every
  // step at a switch or a change of mode. 0 (--full-step-log): every step; the paper's rollout
  // served six times is 2.6M steps, 232 MB.
  int64_t step_log_rows = 80'000;
  bool help = false;
};

// Parses argv[1..argc). Throws usage_error with a message naming the option and the value.
options parse_options(int argc, const char* const* argv);

const char* to_string(trace_kind t);
const char* to_string(priced_kind m);

// The --help text (CLI11's, from the options' own descriptions).
std::string usage_text();

}  // namespace mini_engine::demo
