#include "options.hpp"

#include <CLI/CLI.hpp>
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <utility>

#include "option_values.hpp"

namespace mini_engine::demo {

namespace {

constexpr const char* k_description =
    "Serves each request trace several times on the mini-engine (static TP, static EP, and\n"
    "switching live between them with the Moebius policy and its cost gate, stop-the-world\n"
    "and progressive), then prints per trace a table against the best static run and a\n"
    "verdict (--verbose: every table and the details), and writes a CSV and an SVG timeline\n"
    "per trace. Without GPUs it runs the host runtime (small model, P virtual ranks) and prices\n"
    "each step with an H200 model; with GPUs (a CUDA build) the GPU runtime serves the small\n"
    "model on P = min(GPUs, 2) ranks (one GPU: 2 virtual ranks on it), each step timed with\n"
    "CUDA events; --runtime sim: the paper's experiments at its scale, steps priced.";

// A text option read by `read` (a callback CLI11 calls with the value).
template <class Read>
void add_text(CLI::App& app, const char* name, const char* type, const char* help, Read&& read) {
  app.add_option_function<std::string>(name, std::forward<Read>(read), help)->type_name(type);
}

// --trace V [V ...]: the traces in order (all: the host demo's four; anything else a file).
void read_traces(options& o, const std::vector<std::string>& vs) {
  static const std::pair<const char*, trace_kind> names[] = {
      {"bursty", trace_kind::bursty},
      {"rollout", trace_kind::rollout},
      {"steady", trace_kind::steady},
      {"production", trace_kind::production},
      {"paper-bursty", trace_kind::paper_bursty},
      {"paper-rollout", trace_kind::paper_rollout},
      {"paper-steady", trace_kind::paper_steady},
      {"paper-production", trace_kind::paper_production}};
  o.traces.clear();
  o.traces_given = true;
  for (const std::string& v : vs) {
    if (v == "all") {
      o.traces.insert(o.traces.end(), {trace_kind::bursty, trace_kind::rollout,
                                       trace_kind::steady, trace_kind::production});
      continue;
    }
    const auto named = std::find_if(std::begin(names), std::end(names),
                                    [&v](const auto& n) { return v == n.first; });
    if (named != std::end(names)) {
      o.traces.push_back(named->second);
    } else if (v.empty()) {
      fail_option("--trace",
                  "needs all, bursty, rollout, steady, production, paper-bursty, "
                  "paper-steady, paper-rollout, paper-production or a file name");
    } else {
      if (!o.trace_file.empty()) fail_option("--trace", "one trace file at most");
      o.traces.push_back(trace_kind::file);
      o.trace_file = v;
    }
  }
}

// The runtime and its ranks.
void declare_runtime(CLI::App& app, options& o) {
  const auto text = [&app](const char* n, const char* t, const char* h, auto&& read) {
    add_text(app, n, t, h, std::forward<decltype(read)>(read));
  };
  text("--runtime", "auto|host|gpu|sim",
       "which runtime (auto: gpu when GPUs are present); sim: the paper's two experiments at "
       "the paper's scale on the simulated runtime (steps priced by measured curves)",
       [&o](const std::string& v) {
         o.runtime = parse_choice("--runtime", v, {"auto", "host", "gpu", "sim"},
                                  {runtime_kind::automatic, runtime_kind::host, runtime_kind::gpu,
                                   runtime_kind::sim});
       });
  text("--ranks", "P", "host ranks, 1..64 (default 8; the model must split over P)",
       [&o](const std::string& v) { o.ranks = static_cast<int>(parse_int("--ranks", v, 1, 64)); });
  text("--gpu-ranks", "P",
       "GPU runtime ranks, 1..8 (default 2: one per GPU, or virtual); more than the GPUs: "
       "virtual ranks on GPU 0",
       [&o](const std::string& v) {
         o.gpu_ranks = static_cast<int>(parse_int("--gpu-ranks", v, 1, 8));
       });
}

// What is served: the traces, the model, the gate, the seed and the traces' sizes.
void declare_workload(CLI::App& app, options& o) {
  const auto text = [&app](const char* n, const char* t, const char* h, auto&& read) {
    add_text(app, n, t, h, std::forward<decltype(read)>(read));
  };
  app.add_option_function<std::vector<std::string>>(
         "--trace",
         [&o](const std::vector<std::string>& vs) { read_traces(o, vs); },
         "the workload (default all: the four in turn; with --runtime sim paper-bursty, "
         "paper-steady (at the rate that keeps ~B* running) and paper-rollout, the paper's "
         "experiments at full size; paper-production: shaped like the Azure LLM inference "
         "trace 2023 at full size, at paper-steady's rate rule (not in the default set); FILE: "
         ".jsonl, or text lines 'arrival_s prompt output'; may be repeated)")
      ->type_name("all|bursty|rollout|steady|production|paper-bursty|paper-steady|paper-rollout|"
                  "paper-production|FILE")
      ->expected(1)
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  text("--model", "qwen3-235b-a22b|qwen3-30b-a3b|DIR",
       "the model the H200 clock prices (default qwen3-235b-a22b); or DIR: serve a Hugging Face "
       "Qwen3-MoE checkpoint directory (config.json, model.safetensors or shards with "
       "model.safetensors.index.json) instead of the random model, on the host or GPU runtime "
       "(needs a build with the host runtime); one progress line per shard",
       [&o](const std::string& v) {
         if (v == "qwen3-235b-a22b")
           o.priced = priced_kind::qwen3_235b_a22b;
         else if (v == "qwen3-30b-a3b")
           o.priced = priced_kind::qwen3_30b_a3b;
         else if (std::filesystem::is_directory(v))
           o.model_dir = v;
         else
           fail_option("--model", "'" + v +
                                      "' is not one of qwen3-235b-a22b, qwen3-30b-a3b, nor a "
                                      "checkpoint directory");
       });
  app.add_flag_callback(
      "--no-gate", [&o] { o.gate = false; },
      "switching runs without the cost gate (the rules alone)");
  text("--write-trace", "FILE", "write the one --trace given as JSONL to FILE and exit",
       [&o](const std::string& v) {
         if (v.empty()) fail_option("--write-trace", "needs a file name");
         o.write_trace = v;
       });
  text("--seed", "N", "seed of the trace and the weights (default 1)",
       [&o](const std::string& v) { o.seed = parse_seed("--seed", v); });
  text("--duration", "S",
       "bursty/steady/production length in seconds, (0, 3600] (default: each trace's own)",
       [&o](const std::string& v) {
         o.duration_s = parse_double("--duration", v, 0, 3600);
         if (o.duration_s <= 0) fail_option("--duration", "must be > 0");
       });
  text("--requests", "N", "rollout batch, 1..100000 (default 512)",
       [&o](const std::string& v) { o.requests = parse_int("--requests", v, 1, 100000); });
}

// The serving limits and the clock.
void declare_serving(CLI::App& app, options& o, bool& max_batch_set) {
  const auto text = [&app](const char* n, const char* t, const char* h, auto&& read) {
    add_text(app, n, t, h, std::forward<decltype(read)>(read));
  };
  text(
      "--kv-pages", "N",
      "EP KV pages per rank, 1..16777216 (default: what an H200 holds for the priced model "
      "after its weights)",
      [&o](const std::string& v) { o.kv_pages = parse_int("--kv-pages", v, 1, int64_t{1} << 24); });
  text("--max-batch", "N", "sequences running at once, 1..4096 (default 512)",
       [&o, &max_batch_set](const std::string& v) {
         o.max_batch = parse_int("--max-batch", v, 1, 4096);
         max_batch_set = true;
       });
  text("--step-tokens", "N", "token budget per step, 1..65536 (default 1024)",
       [&o](const std::string& v) { o.step_tokens = parse_int("--step-tokens", v, 1, 65536); });
  text("--clock", "auto|model|measured",
       "step times: H200 model (host default) or measured (GPU default)",
       [&o](const std::string& v) {
         o.clock = parse_choice("--clock", v, {"auto", "model", "measured"},
                                {clock_kind::automatic, clock_kind::model, clock_kind::measured});
       });
  text("--context-scale", "X", "H200 model: context tokens priced x X, [1, 1024] (32)",
       [&o](const std::string& v) {
         o.context_scale = parse_double("--context-scale", v, 1, 1024);
       });
  text("--curves", "FILE|roofline",
       "H200 model: decode steps from measured per-rank curves (bench_mini_engine_rank_share's "
       "JSON lines), or from the roofline (default: the priced deployment's curves under "
       "docs/results, compiled in, when there are any)",
       [&o](const std::string& v) {
         o.curves = v;
         if (v != "roofline" && !std::ifstream(v).good())
           fail_option("--curves", "cannot open " + v);
       });
}

// What is written and printed.
void declare_output(CLI::App& app, options& o) {
  const auto text = [&app](const char* n, const char* t, const char* h, auto&& read) {
    add_text(app, n, t, h, std::forward<decltype(read)>(read));
  };
  text("--out", "DIR", "where the CSV and SVG go (default moebius_demo_out)",
       [&o](const std::string& v) {
         if (v.empty()) fail_option("--out", "needs a directory name");
         o.out_dir = v;
       });
  app.add_flag_callback(
      "--no-reshard", [&o] { o.reshard_stage = false; }, "skip the verified-reshard stage");
  app.add_flag_callback(
      "--verbose", [&o] { o.verbose = true; },
      "every table of every run, the deployment, the clock, the calibration, the policy and "
      "the gate's reasoning, each run's progress (default: per trace a table and a verdict)");
  app.add_flag_callback(
      "--full-step-log", [&o] { o.step_log_rows = 0; },
      "steps.csv with every step of every run (default: at most 80,000 rows a trace, every "
      "k-th step and every step at a switch; the paper's rollout in full is 232 MB)");
  text("--step-log-rows", "N",
       "the most rows steps.csv keeps a trace, 1..100000000 (default 80000; --full-step-log: all)",
       [&o](const std::string& v) {
         o.step_log_rows = parse_int("--step-log-rows", v, 1, 100'000'000);
       });
}

// The simulated runtime's experiments.
void declare_sim(CLI::App& app, options& o) {
  const auto text = [&app](const char* n, const char* t, const char* h, auto&& read) {
    add_text(app, n, t, h, std::forward<decltype(read)>(read));
  };
  text("--rate", "R",
       "--runtime sim: paper-steady's and paper-production's (mean) requests/s, (0, 10000], "
       "instead of the rate that keeps ~B* running (Little's law at the crossover's step time)",
       [&o](const std::string& v) {
         o.rate = parse_double("--rate", v, 0, 1e4);
         if (o.rate <= 0) fail_option("--rate", "must be > 0");
       });
  text("--collective-us", "US|TP_US,EP_US",
       "--runtime sim: price the collectives by the link model with each at US microseconds of "
       "latency (its own: 10), or TP's all-reduce at TP_US and EP's dispatch and combine at "
       "EP_US; each in [0, 10000]",
       [&o](const std::string& v) {
         const size_t comma = v.find(',');
         o.collective_us_tp = parse_double("--collective-us", v.substr(0, comma), 0, 1e4);
         o.collective_us_ep = comma == std::string::npos
                                  ? o.collective_us_tp
                                  : parse_double("--collective-us", v.substr(comma + 1), 0, 1e4);
       });
  text("--collectives", "link|cited",
       "--runtime sim: price the step curves' collectives from cited measurements on one "
       "8-GPU NVLink node (cited, the default: serving/collective_table.hpp) or by the link "
       "model (link: 10 us + bytes / link rate)",
       [&o](const std::string& v) {
         if (v != "link" && v != "cited")
           fail_option("--collectives", "'" + v + "' is not link or cited");
         o.collectives = v == "cited" ? collective_pricing::cited : collective_pricing::link;
         o.collectives_given = true;
       });
  text("--routing-skew", "S",
       "--runtime sim: the router's skew the busiest EP rank's expert load is priced at, "
       "[0, 4] (default 0: uniform; > 0: expert popularity ~ rank^-S, serving/expert_load.hpp)",
       [&o](const std::string& v) { o.routing_skew = parse_double("--routing-skew", v, 0, 4); });
  text("--graph-buckets", "vllm|none",
       "--runtime sim: price each decode step at the CUDA-graph bucket its rank batch is "
       "padded to, vLLM's default capture sizes (vllm: 1, 2, 4, then 8 to 512 in steps of 8; "
       "beyond them eager) or at its own batch (none, the default)",
       [&o](const std::string& v) {
         if (v != "vllm" && v != "none")
           fail_option("--graph-buckets", "'" + v + "' is not vllm or none");
         o.vllm_graph_buckets = v == "vllm";
         o.graph_buckets_given = true;
       });
  text("--nodes", "N",
       "--runtime sim: the paper's deployment over N nodes of 8 H200s, [1, 2] (default 1); 2: "
       "a PRICED what-if, nothing measured: capacities and switch cost of EP16 against TP8 x 2, "
       "and the two experiments' runs repriced on two nodes (the paper-bursty and "
       "paper-rollout traces unless --trace)",
       [&o](const std::string& v) { o.nodes = static_cast<int>(parse_int("--nodes", v, 1, 2)); });
  text("--rollout-median", "TOKENS",
       "paper-rollout: the median output length, [64, 32000] (default 2000: DeepMath-103K's R1 "
       "mean with a 2% cut; the paper-shaped sweep covers 4k-10k)",
       [&o](const std::string& v) { o.rollout_median = parse_double("--rollout-median", v, 64, 32000); });
  text("--rollout-cut", "SHARE",
       "paper-rollout: the share of responses cut at 32,768 tokens, (0, 0.5) (default 0.02; the "
       "sweep covers 0.02-0.2)",
       [&o](const std::string& v) {
         o.rollout_cut = parse_double("--rollout-cut", v, 0, 0.5);
         if (o.rollout_cut <= 0 || o.rollout_cut >= 0.5)
           fail_option("--rollout-cut", "must be in (0, 0.5)");
       });
  app.add_flag_callback(
      "--search", [&o] { o.search = true; },
      "--runtime sim, rollout traces: the offline ceiling, one switch point per rollout step "
      "searched over a grid of thresholds (ten more runs of the trace)");
  app.add_flag_callback(
      "--explain", [&o] { o.explain = true; },
      "--runtime sim: log every decision of the policy runs in which a rule fired, taken or "
      "refused, with the gate's numbers (decisions.txt beside steps.csv; the first lines printed)");
  text("--admission", "known|oracle",
       "how admission reserves KV pages: known (the default, as vLLM and SGLang: the tokens a "
       "request has; a sequence that finds no page preempts the newest, recomputed later) or "
       "oracle (each request's true output length, which no engine knows: never preempts)",
       [&o](const std::string& v) {
         o.oracle_admission = parse_choice("--admission", v, {"known", "oracle"}, {false, true});
       });
  text("--engine", "vllm|sglang",
       "whose scheduling rules admission on what is known follows (serving/engine_preset.hpp, "
       "each rule with its source): vllm (the default: a prompt admitted beside the running "
       "sequences' tokens and a 1% watermark, pages on demand, the newest preempted, decode and "
       "prefill mixed in one step) or sglang (a request admitted while prompt + "
       "min(max_new_tokens, 4096) fits beside the running ones' remaining estimates x "
       "new_token_ratio, retraction of the fewest generated when a decode finds no page, a step "
       "either a prefill or a decode; in EP (DP attention) per rank, a chunk of --step-tokens / "
       "ranks)",
       [&o](const std::string& v) {
         o.engine = parse_choice("--engine", v, {"vllm", "sglang"},
                                 {engine_preset::vllm, engine_preset::sglang});
       });
  app.add_flag_callback(
      "--mixed-chunk", [&o] { o.mixed_chunk = true; },
      "--engine sglang: SGLang's --enable-mixed-chunk (a prefill step carries the running "
      "decodes, its chunk less one token each; off by default, as SGLang's); vLLM always mixes");
  app.add_flag_callback(
      "--vllm-dp-engines", [&o] { o.vllm_dp_engines = true; },
      "--engine vllm: under EP (data-parallel attention) each rank schedules its own requests "
      "within its own --step-tokens and max running / ranks, as vLLM's data-parallel deployment "
      "runs one engine core per DP rank (default: one budget for the whole EP step)");
  text("--max-new-tokens", "N",
       "the max_new_tokens of a request whose trace gives none, 1..1048576 (default 4096, "
       "SGLang's estimate clip; raised to a request's output where that is longer): what "
       "--engine sglang admits by (paper-rollout's requests carry its cap, 32768)",
       [&o](const std::string& v) {
         o.max_new_tokens = parse_int("--max-new-tokens", v, 1, int64_t{1} << 20);
       });
  text("--results", "FILE", "write every metric of every run as JSON to FILE (--runtime sim)",
       [&o](const std::string& v) {
         if (v.empty()) fail_option("--results", "needs a file name");
         o.results_file = v;
       });
}

// The options, each read into `o` by its own callback (CLI11 calls them after the whole line
// is parsed, in the order they are declared here; --help lists them in that order).
void declare(CLI::App& app, options& o, bool& max_batch_set) {
  declare_runtime(app, o);
  declare_workload(app, o);
  declare_serving(app, o, max_batch_set);
  declare_output(app, o);
  declare_sim(app, o);
}

// Constraints between options, once all are read.
void check_together(options& o, bool max_batch_set) {
  if (!o.curves.empty() && o.clock == clock_kind::measured) {
    fail_option("--curves",
                "step curves price the modelled clock, and --clock measured measures its "
                "steps (--clock model uses them)");
  }
  const auto is_paper = [](trace_kind t) {
    return t == trace_kind::paper_bursty || t == trace_kind::paper_steady ||
           t == trace_kind::paper_rollout || t == trace_kind::paper_production;
  };
  const bool paper_trace = std::any_of(o.traces.begin(), o.traces.end(), is_paper);
  if (o.nodes > 1 && o.runtime != runtime_kind::sim)
    fail_option("--nodes", "prices the simulated runtime's runs on more nodes (--runtime sim)");
  if (o.runtime == runtime_kind::sim) {
    if (!o.traces_given)
      o.traces = o.nodes > 1 ? std::vector<trace_kind>{trace_kind::paper_bursty,
                                                       trace_kind::paper_rollout}
                             : std::vector<trace_kind>{trace_kind::paper_bursty,
                                                       trace_kind::paper_steady,
                                                       trace_kind::paper_rollout};
    for (const trace_kind t : o.traces) {
      if (!is_paper(t) && t != trace_kind::file)
        fail_option("--trace",
                    std::string(to_string(t)) +
                        " is the host demo's small trace; the simulated runtime serves "
                        "paper-bursty, paper-steady, paper-rollout, paper-production or a "
                        "FILE");
    }
  } else if (paper_trace && o.write_trace.empty()) {
    fail_option("--trace",
                "the paper's traces are served at full size by the simulated runtime only "
                "(--runtime sim)");
  }
  if (o.rate > 0 && std::none_of(o.traces.begin(), o.traces.end(), [](trace_kind t) {
        return t == trace_kind::paper_steady || t == trace_kind::paper_production;
      }))
    fail_option("--rate",
                "sets the rate of paper-steady and paper-production, and neither is served");
  if ((o.rollout_median >= 0 || o.rollout_cut >= 0) &&
      std::find(o.traces.begin(), o.traces.end(), trace_kind::paper_rollout) == o.traces.end())
    fail_option(o.rollout_median >= 0 ? "--rollout-median" : "--rollout-cut",
                "shapes the paper-rollout trace, which is not served");
  if (o.explain && o.runtime != runtime_kind::sim)
    fail_option("--explain", "logs the simulated runtime's policy runs (--runtime sim)");
  if (o.search && o.runtime != runtime_kind::sim)
    fail_option("--search", "searches the simulated runtime's rollout runs (--runtime sim)");
  if (o.collective_us_tp >= 0 && o.runtime != runtime_kind::sim)
    fail_option("--collective-us", "reprices the simulated runtime's step curves (--runtime sim)");
  if (o.routing_skew != 0 && o.runtime != runtime_kind::sim)
    fail_option("--routing-skew", "prices the simulated runtime's EP steps (--runtime sim)");
  if (o.graph_buckets_given && o.runtime != runtime_kind::sim)
    fail_option("--graph-buckets", "prices the simulated runtime's decode steps (--runtime sim)");
  if (o.collectives_given && o.runtime != runtime_kind::sim)
    fail_option("--collectives", "reprices the simulated runtime's step curves (--runtime sim)");
  if (o.collective_us_tp >= 0) {
    if (o.collectives_given && o.collectives == collective_pricing::cited)
      fail_option("--collectives",
                  "cited prices each collective from the table; --collective-us sets "
                  "the link model's latency: give one");
    o.collectives = collective_pricing::link;
  }
  if (o.mixed_chunk && o.engine != engine_preset::sglang)
    fail_option("--mixed-chunk",
                "is SGLang's --enable-mixed-chunk (--engine sglang); vLLM always "
                "mixes prefill chunks into its decode steps");
  if (o.vllm_dp_engines && o.engine != engine_preset::vllm)
    fail_option("--vllm-dp-engines",
                "is vLLM's data-parallel rule (--engine vllm); SGLang's DP "
                "attention schedules per rank already");
  if (o.engine == engine_preset::sglang && o.oracle_admission)
    fail_option("--engine",
                "sglang admits on estimates of what is known; --admission oracle reserves "
                "each request's true output: give one");
  if (!o.results_file.empty() && o.runtime != runtime_kind::sim)
    fail_option("--results", "is written by the simulated runtime's experiments (--runtime sim)");
  if (!o.write_trace.empty() && o.traces.size() != 1) {
    fail_option("--write-trace", "needs exactly one --trace");
  }
  if (o.max_batch > o.step_tokens) {
    if (max_batch_set) {
      fail_option("--max-batch", std::to_string(o.max_batch) + " exceeds --step-tokens " +
                                     std::to_string(o.step_tokens) +
                                     " (every running sequence decodes one token per step)");
    }
    o.max_batch = o.step_tokens;
  }
}

}  // namespace

const char* to_string(trace_kind t) {
  switch (t) {
    case trace_kind::bursty:
      return "bursty";
    case trace_kind::rollout:
      return "rollout";
    case trace_kind::steady:
      return "steady";
    case trace_kind::production:
      return "production";
    case trace_kind::file:
      return "file";
    case trace_kind::paper_bursty:
      return "paper-bursty";
    case trace_kind::paper_rollout:
      return "paper-rollout";
    case trace_kind::paper_steady:
      return "paper-steady";
    case trace_kind::paper_production:
      return "paper-production";
  }
  return "unknown";
}

const char* to_string(priced_kind m) {
  return m == priced_kind::qwen3_30b_a3b ? "Qwen3-30B-A3B" : "Qwen3-235B-A22B";
}

std::string usage_text() {
  options o;
  bool max_batch_set = false;
  CLI::App app(k_description, "moebius_demo");
  declare(app, o, max_batch_set);
  return app.help();
}

options parse_options(int argc, const char* const* argv) {
  options o;
  bool max_batch_set = false;
  CLI::App app(k_description, "moebius_demo");
  declare(app, o, max_batch_set);
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp&) {
    o.help = true;
    return o;
  } catch (const CLI::ParseError& e) {
    throw usage_error(e.what());
  }
  check_together(o, max_batch_set);
  return o;
}

}  // namespace mini_engine::demo
