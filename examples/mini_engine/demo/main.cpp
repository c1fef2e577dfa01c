// moebius_demo: the mini-engine serving request traces while Moebius switches it between TP
// and EP (README: the first command). One harness for every runtime (experiments.hpp): per
// trace (the host demo's bursty, RL rollout, steady near the crossover and production-shaped;
// the paper's bursty, steady and rollout at full size on the simulated runtime; or a file) the
// named runs of the same trace (runs.hpp: static TP, static EP, ours stop-the-world and
// progressive, and the rules without the gate; simulated, ours by cost and the paper's policy
// too, static TP-DCP2 and TEP-DCP2, and our policy on the EP <-> TP-DCP2 and experts-only
// designs), served by one pool, then per trace a table and a verdict (every table, the calibration,
// the policy and the gate's reasoning with --verbose), a CSV of the steps (bounded) and the
// requests, and an SVG timeline.
//
//   stage 1  (host, GPU) a verified reshard: the model's experts EP -> TP -> EP through the
//            switcher, with layout-independent checksums of every layer before and after;
//   per trace: calibration (decode-step times of both modes over a batch sweep, on the clock
//            in use -> moebius::calibrate -> the policy's thresholds and the gate's curves),
//            then the runs, two at a time; on the host every switching run must produce the
//            static runs' greedy tokens, request for request.
//
// The parts, each in its own file: options (the command line), world (the runtime, its memory
// and every build axis), clock (priced or measured), runs (the named runs and the pool),
// reshard_stage (stage 1), experiments (the settings and the per-trace driver), traces (their
// shapes), report (the host and GPU tables and the files), paper_report (the simulated
// runtime's tables, verdicts and JSON), targets (what the runs are graded against).
//
// Runtimes: the host runtime (P virtual ranks in this process) on the lite() model, priced
// on the modelled H200 clock (Qwen3-235B-A22B on 8 H200s by default, its KV pool sized as an
// H200 holds it); in a CUDA + NCCL build on a machine with GPUs (`--runtime gpu`, or auto) the
// GPU runtime (gpu/gpu_runtime.hpp) serves the small() model on P = min(GPUs, 2) ranks, one per
// device, or with one GPU on P = 2 virtual ranks (--gpu-ranks P: more ranks than GPUs are
// virtual, all on GPU 0: every rank's steps and copies share that GPU's HBM and SMs, the
// contention P GPUs would each see, never NVLink), each step timed with CUDA events (measured
// clock), the switches over cuda_peer_transport on the runtime's own memory (so they move real
// bytes). At GPU step times the traces keep few sequences running, below the calibrated
// thresholds (and one GPU has no crossover), so on GPUs the switching runs switch every 100
// steps (forced), which still moves every weight and KV page and serves across each switch
// (graphs replayed after it, hybrid steps during progressive). The simulated runtime (`--runtime
// sim`): the paper's deployment of Qwen3-235B-A22B on 8 H200s, each run on its own deployment
// (the configurations' and designs' pools differ), steps priced by the curves measured on one
// H200 (TP-DCP2 and TEP-DCP2 priced from TP's until theirs are measured), nothing computed.
#include <chrono>
#include <cstdio>
#include <fstream>
#include <memory>
#include <moebius/error.hpp>
#include <new>
#include <sstream>
#include <string>
#include <vector>

#include "clock.hpp"
#include "deployment.hpp"
#include "engine.hpp"
#include "experiments.hpp"
#include "nodes_report.hpp"
#include "options.hpp"
#include "paper_report.hpp"
#include "runs.hpp"
#include "report.hpp"
#include "reshard_stage.hpp"
#include "world.hpp"

namespace {

using namespace mini_engine;
using namespace mini_engine::demo;
using wall = std::chrono::steady_clock;

double seconds_since(wall::time_point t0) {
  return std::chrono::duration<double>(wall::now() - t0).count();
}

// --write-trace: the one trace given, as JSONL.
int write_trace_file(const options& o) {
  if (o.traces.front() == trace_kind::steady)
    throw usage_error("--write-trace: the steady trace's rate comes from a calibration");
  const std::vector<request> t = make_trace(o, o.traces.front(), 1024, 0);
  std::ofstream f(o.write_trace);
  write_trace_jsonl(f, t);
  if (!f) throw std::runtime_error("cannot write " + o.write_trace);
  std::printf("wrote %zu requests to %s\n", t.size(), o.write_trace.c_str());
  return 0;
}

// --results FILE: every metric of every run (the simulated runtime's), as JSON.
void write_results(const options& o, const nlohmann::json& results) {
  if (o.results_file.empty()) return;
  std::ofstream f(o.results_file);
  f << results.dump(2) << "\n";
  if (!f) throw std::runtime_error("cannot write " + o.results_file);
  std::printf("%s  every metric of every run: %s\n", o.verbose ? "\n" : "",
              o.results_file.c_str());
}

// The runtime the demo serves on: sim when asked, else the GPU runtime when asked or (auto)
// when GPUs are there and the build has it (printing why not, when GPUs are there but unused),
// else the host runtime.
runtime_kind choose_runtime(const options& o) {
  if (o.runtime == runtime_kind::sim) return runtime_kind::sim;
  const int gpus = count_gpus();
  if (o.runtime != runtime_kind::gpu && !(o.runtime == runtime_kind::automatic && gpus > 0))
    return runtime_kind::host;
  if (!has_gpu_runtime()) {
    std::printf(
        "  note: %d GPU(s) found, but this build has no GPU runtime (it needs CUDA and "
        "NCCL); running the host runtime\n",
        gpus);
    return runtime_kind::host;
  }
  if (gpus == 0) std::printf("  note: no GPU found; running the host runtime\n");
  return gpus > 0 ? runtime_kind::gpu : runtime_kind::host;
}

std::unique_ptr<hf_checkpoint> open_checkpoint(const options& o) {
  if (o.model_dir.empty()) return nullptr;
  auto ck = std::make_unique<hf_checkpoint>(o.model_dir);  // checked before any load
  std::printf("  checkpoint: %s, %lld shard(s), %.3f GB of tensors, %s\n", o.model_dir.c_str(),
              static_cast<long long>(ck->num_shards()), static_cast<double>(ck->bytes()) / 1e9,
              ck->config().tie_word_embeddings ? "tied embeddings" : "own LM head");
  return ck;
}

// The worlds the runs serve in: the GPU runtime, or on the host `count` runtimes beside each
// other (as many runs at a time).
std::vector<world> make_worlds(const options& o, bool use_gpu, int P, const hf_checkpoint* ck,
                               size_t count) {
  const host_plan plan = plan_host(o, ck);
  std::vector<world> worlds;
  if (use_gpu) {
    std::vector<request> traces;  // the page tables fit the longest request of any trace
    for (const trace_kind k : o.traces) {
      if (k == trace_kind::steady) continue;
      std::vector<request> t = make_trace(o, k, plan.vocab, 0);
      traces.insert(traces.end(), t.begin(), t.end());
    }
    worlds.push_back(make_gpu_world(o, P, traces, ck));
    return worlds;
  }
  check_memory(plan, static_cast<int>(count) * o.ranks);
  for (size_t i = 0; i < count; ++i) worlds.push_back(make_host_world(o, plan, ck, i == 0));
  return worlds;
}

// The deployment the paper ran (Qwen3-235B-A22B, P = 8, 0.85 of an H200): what each layout
// holds per rank and in tokens and sequences (serving/deployment.hpp). The host demo's own
// pool above is sized as the priced clock scales its context, not as this.
void print_paper_deployment() {
  std::printf("  the paper's deployment (serving/deployment.hpp):\n");
  for (const deployment_kind k :
       {deployment_kind::static_tp, deployment_kind::static_ep, deployment_kind::switching}) {
    std::ostringstream d;
    d << make_deployment(qwen3_235b_a22b(), k);
    std::printf("    %s\n", d.str().c_str());
  }
}

// The traces served, by name: "bursty, rollout, steady and production".
std::string trace_names(const options& o) {
  std::string s;
  for (size_t i = 0; i < o.traces.size(); ++i) {
    const trace_kind k = o.traces[i];
    s += (i == 0 ? "" : i + 1 == o.traces.size() ? " and " : ", ") +
         (k == trace_kind::file ? o.trace_file : std::string(to_string(k)));
  }
  return s;
}

// Host and GPU: the KV pool (what an H200 holds for the priced model, or --kv-pages), the
// worlds, what they serve and the reshard stage. False when the reshard failed.
bool prepare_host(options& o, runtime_kind runtime, const run_settings& s, int P,
                  const hf_checkpoint* ck, std::vector<world>& worlds) {
  const bool use_gpu = runtime == runtime_kind::gpu;
  std::string kv_why = std::to_string(o.kv_pages) + " EP pages a rank (--kv-pages)";
  if (o.kv_pages == 0 && use_gpu) {
    o.kv_pages = 2048;
    kv_why = "2048 EP pages a rank (the GPU runtime's default; --kv-pages to change)";
  } else if (o.kv_pages == 0) {
    // The run's KV heads only matter for the Qwen3-30B-A3B pricing; lite(): 4.
    o.kv_pages = h200_kv_pages(priced_of(o, 4), P, 16, &kv_why);
  }
  worlds = make_worlds(o, use_gpu, P, ck, s.runs_at_once);
  const world& w = worlds.front();
  if (o.verbose) {
    std::printf("  runtime: %s\n", w.description.c_str());
    std::printf("  KV pool: %s\n", kv_why.c_str());
    if (!use_gpu && o.priced == priced_kind::qwen3_235b_a22b) print_paper_deployment();
  } else {
    std::printf("  %s serving %s, every token computed, each step %s; --verbose for every run's "
                "tables, the clock and the gate\n",
                w.name.c_str(), trace_names(o).c_str(),
                use_gpu && o.clock != clock_kind::model
                    ? "timed on the GPU"
                    : ("priced as " + std::string(to_string(o.priced)) + " on " +
                       std::to_string(P) + " H200s")
                          .c_str());
  }
  if (!o.reshard_stage) return true;
  if (o.verbose) std::printf("\nstage 1: verified reshard of the model's experts\n");
  return verified_reshard(worlds.front(), o.verbose);
}

// Sim: the paper's preamble; host and GPU: their worlds and the reshard stage. The pool the runs
// are served on; `ok` false when the reshard failed.
std::unique_ptr<run_pool> make_pool(options& o, runtime_kind runtime, const run_settings& s,
                                    int P, const hf_checkpoint* ck, demo_clock& clock, bool& ok) {
  if (runtime == runtime_kind::sim) {
    clock = make_sim_clock(o);
    print_sim_preamble(o, clock.clock->name(), clock.curves_summary, s.runs, s.max_running,
                       s.step_tokens);
    return std::make_unique<run_pool>(s.runs_at_once, *clock.clock);
  }
  std::vector<world> worlds;
  ok = prepare_host(o, runtime, s, P, ck, worlds);
  clock = make_clock(o, worlds.front(), P);
  if (o.verbose) std::printf("\n%s", clock.description.c_str());
  return std::make_unique<run_pool>(std::move(worlds), *clock.clock);
}

int run_demo(options o) {
  const auto t_start = wall::now();
  if (!o.write_trace.empty()) return write_trace_file(o);
  if (o.runtime != runtime_kind::sim)
    std::printf("moebius demo: a mini-engine serving while Moebius switches it between TP and "
                "EP\n");
  const runtime_kind runtime = choose_runtime(o);
  // GPU: 2 ranks (one per GPU with two GPUs or more, virtual on one GPU), or --gpu-ranks.
  const int P = runtime == runtime_kind::sim   ? 8
                : runtime == runtime_kind::gpu ? (o.gpu_ranks > 0 ? o.gpu_ranks : 2)
                                               : o.ranks;
  if (runtime == runtime_kind::gpu && !o.traces_given) {
    // The steady and production traces are sized for the priced clock (tens of thousands of
    // requests at the crossover of Qwen3-235B-A22B); the GPU runtime's small model serves the
    // two that show its switches: bursty and rollout (--trace steady|production to add them).
    o.traces = {trace_kind::bursty, trace_kind::rollout};
    std::printf(
        "on the GPU runtime the demo serves the bursty and rollout traces (--trace to "
        "choose)\n");
  }
  const std::unique_ptr<hf_checkpoint> checkpoint = open_checkpoint(o);
  const run_settings settings = settings_for(runtime, o);
  demo_clock clock;
  bool ok = true;
  const std::unique_ptr<run_pool> pool =
      make_pool(o, runtime, settings, P, checkpoint.get(), clock, ok);
  progress_printer progress(o.verbose ? progress_printer::style::lines
                                      : progress_printer::style::status);
  harness h{o, runtime, settings, *pool, clock, P, progress};
  // --nodes 2: the what-if's models, and what it prices, once before the traces.
  std::unique_ptr<nodes_models> nodes;
  if (runtime == runtime_kind::sim && o.nodes > 1) {
    nodes = std::make_unique<nodes_models>(make_nodes_models(o, *clock.clock));
    print_nodes_preamble(o, *nodes);
    h.nodes = nodes.get();
  }
  std::vector<trace_outcome> outcomes;
  for (const trace_kind k : o.traces) {
    outcomes.push_back(serve_trace(h, k));
    ok = ok && outcomes.back().ok;
  }
  if (runtime == runtime_kind::sim) {
    write_results(o, h.results);
  } else {
    print_summary(outcomes, clock.priced, to_string(o.priced), P, o.verbose, o.out_dir);
  }
  std::printf("%s (%.1f s)\n", ok ? "demo: ok" : "demo: FAILED", seconds_since(t_start));
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  prepare_process();
  options o;
  try {
    o = parse_options(argc, argv);
  } catch (const usage_error& e) {
    std::fprintf(stderr, "moebius_demo: error: %s (see --help)\n", e.what());
    return 2;
  }
  if (o.help) {
    std::fputs(usage_text().c_str(), stdout);
    return 0;
  }
  try {
    return run_demo(o);
  } catch (const usage_error& e) {
    std::fprintf(stderr, "moebius_demo: error: %s (see --help)\n", e.what());
    return 2;
  } catch (const moebius::error& e) {
    std::fprintf(stderr, "moebius_demo: failed: %s\n", e.what());
    return 1;
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr,
                 "moebius_demo: failed: out of memory (try smaller --kv-pages or --ranks)\n");
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "moebius_demo: failed: %s\n", e.what());
    return 1;
  } catch (...) {
    std::fprintf(stderr, "moebius_demo: failed: unknown exception\n");
    return 1;
  }
}
