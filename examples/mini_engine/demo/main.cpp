// moebius_demo: the mini-engine serving request traces while Moebius switches it between TP
// and EP (README: the first command). Per trace (bursty, RL rollout, steady near the crossover,
// production-shaped; or a file) five runs of the same trace on the same runtimes: static TP,
// static EP, switching by the calibrated policy with its cost gate (stop-the-world, and
// progressively: a few layers per step), and the same policy without the gate; then a table
// with the best static run beside switching, the targets, the gate's reasoning, a
// bound on what any switching could gain, a CSV and an SVG timeline.
//
//   stage 1  a verified reshard: the model's experts EP -> TP -> EP through the switcher,
//            with layout-independent checksums of every layer before and after;
//   per trace: calibration (decode-step times of both modes over a batch sweep, on the clock
//            in use -> moebius::calibrate -> the policy's thresholds and the gate's curves),
//            then the runs, two at a time on two host runtimes; every switching run must
//            produce the static runs' greedy tokens, request for request.
//
// The parts, each in its own file: options (the command line), world (the runtime, its memory
// and every build axis), clock (priced or measured), reshard_stage (stage 1), experiments (the
// traces and the runs), report (tables and files), targets (what the runs are graded against).
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
// (graphs replayed after it, hybrid steps during progressive).
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
#include "options.hpp"
#include "paper.hpp"
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

// Whether to serve on the GPU runtime (printing why not, when GPUs are there but unused).
bool choose_gpu(const options& o) {
  const int gpus = count_gpus();
  if (o.runtime != runtime_kind::gpu && !(o.runtime == runtime_kind::automatic && gpus > 0))
    return false;
  if (!has_gpu_runtime()) {
    std::printf(
        "  note: %d GPU(s) found, but this build has no GPU runtime (it needs CUDA and "
        "NCCL); running the host runtime\n",
        gpus);
    return false;
  }
  if (gpus == 0) std::printf("  note: no GPU found; running the host runtime\n");
  return gpus > 0;
}

std::unique_ptr<hf_checkpoint> open_checkpoint(const options& o) {
  if (o.model_dir.empty()) return nullptr;
  auto ck = std::make_unique<hf_checkpoint>(o.model_dir);  // checked before any load
  std::printf("  checkpoint: %s, %lld shard(s), %.3f GB of tensors, %s\n", o.model_dir.c_str(),
              static_cast<long long>(ck->num_shards()), static_cast<double>(ck->bytes()) / 1e9,
              ck->config().tie_word_embeddings ? "tied embeddings" : "own LM head");
  return ck;
}

// The world the runs serve in, and on the host a second one beside it (two runs at a time on
// two cores).
std::vector<world> make_worlds(const options& o, bool use_gpu, int P, const hf_checkpoint* ck) {
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
  check_memory(plan, 2 * o.ranks);
  worlds.push_back(make_host_world(o, plan, ck, true));
  worlds.push_back(make_host_world(o, plan, ck, false));
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

int run_demo(options o) {
  const auto t_start = wall::now();
  if (!o.write_trace.empty()) return write_trace_file(o);
  if (o.runtime == runtime_kind::sim) return run_paper_experiments(o);
  std::printf("moebius demo: a mini-engine serving while Moebius switches it between TP and EP\n");
  const bool use_gpu = choose_gpu(o);
  // GPU: 2 ranks (one per GPU with two GPUs or more, virtual on one GPU), or --gpu-ranks.
  const int P = !use_gpu ? o.ranks : o.gpu_ranks > 0 ? o.gpu_ranks : 2;
  if (use_gpu && !o.traces_given) {
    // The steady and production traces are sized for the priced clock (tens of thousands of
    // requests at the crossover of Qwen3-235B-A22B); the GPU runtime's small model serves the
    // two that show its switches: bursty and rollout (--trace steady|production to add them).
    o.traces = {trace_kind::bursty, trace_kind::rollout};
    std::printf(
        "on the GPU runtime the demo serves the bursty and rollout traces (--trace to "
        "choose)\n");
  }
  std::string kv_why = std::to_string(o.kv_pages) + " EP pages a rank (--kv-pages)";
  if (o.kv_pages == 0) {
    if (use_gpu) {
      o.kv_pages = 2048;
      kv_why = "2048 EP pages a rank (the GPU runtime's default; --kv-pages to change)";
    } else {
      // The run's KV heads only matter for the Qwen3-30B-A3B pricing; lite(): 4.
      o.kv_pages = h200_kv_pages(priced_of(o, 4), P, 16, &kv_why);
    }
  }
  const std::unique_ptr<hf_checkpoint> checkpoint = open_checkpoint(o);
  std::vector<world> worlds = make_worlds(o, use_gpu, P, checkpoint.get());
  world& w = worlds.front();
  std::printf("  runtime: %s\n", w.description.c_str());
  std::printf("  KV pool: %s\n", kv_why.c_str());
  if (!use_gpu && o.priced == priced_kind::qwen3_235b_a22b) print_paper_deployment();

  bool ok = true;
  if (o.reshard_stage) {
    std::printf("\nstage 1: verified reshard of the model's experts\n");
    ok = verified_reshard(w);
  }
  const demo_clock clock = make_clock(o, w, P);

  // An engine per world, for every trace (an engine owns its runtime's arena cursor and
  // tables from its construction on); the first also calibrates.
  std::vector<std::unique_ptr<moebius::transport>> transports;
  std::vector<std::unique_ptr<engine>> engines;
  std::vector<engine*> pool;
  for (world& x : worlds) {
    transports.push_back(x.make_transport());
    engines.push_back(std::make_unique<engine>(*x.rt, *transports.back(), x.arena, x.kv,
                                               *clock.clock, moebius::arena_cursor{0},
                                               x.kv_layout));
    pool.push_back(engines.back().get());
  }

  progress_printer progress;
  const auto set_progress = [&progress](engine_options& base) { progress.install(base); };

  std::vector<trace_outcome> outcomes;
  for (const trace_kind k : o.traces) {
    outcomes.push_back(serve_trace(o, k, w, *pool.front(), pool, *clock.clock, P, set_progress));
    ok = ok && outcomes.back().tokens_identical;
  }

  print_summary(outcomes, clock.priced, to_string(o.priced), P);
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
