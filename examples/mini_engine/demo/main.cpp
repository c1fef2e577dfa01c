// moebius_demo: the mini-engine serving a request trace while Moebius switches it between TP
// and EP (README: the first command). Four runs of the same trace (static TP, static EP,
// switching by the policy stop-the-world, and progressively: a few layers per step) on the
// same runtime, then a table, a CSV and an SVG timeline.
//
//   stage 1  a verified reshard: the model's experts EP -> TP -> EP through the switcher,
//            with layout-independent checksums of every layer before and after;
//   stage 2  calibration: decode-step times of both modes over a batch sweep, on the clock
//            in use -> moebius::calibrate -> the policy's thresholds;
//   stage 3  the four runs, with progress; both switching runs must produce the static
//            runs' greedy tokens, request for request.
//
// Runtimes: the host runtime (P virtual ranks in this process) on the small() model, priced
// on the modelled H200 clock; in a CUDA + NCCL build on a machine with GPUs (`--runtime gpu`,
// or auto) the GPU runtime (gpu/gpu_runtime.hpp) serves the same small() model and weights on
// P = min(GPUs, 2) ranks, one per device, or with one GPU on P = 2 virtual ranks
// (--gpu-ranks P: more ranks than GPUs are virtual, all on GPU 0: every rank's steps and copies
// share that GPU's HBM and SMs, the contention P GPUs would each see, never NVLink), each step
// timed with CUDA events (measured clock), the switches over cuda_peer_transport on the
// runtime's own memory (so they move real bytes). At GPU step times the trace keeps few sequences
// running, below the calibrated thresholds (and one GPU has no crossover), so on GPUs the
// switching runs switch every 100 steps (forced), which still moves every weight and KV page
// and serves across each switch (graphs replayed after it, hybrid steps during progressive).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <new>
#include <sstream>
#include <string>
#include <vector>

#include <unistd.h>

#include <moebius/config.hpp>
#include <moebius/error.hpp>
#include <moebius/switch/checksum.hpp>
#include <moebius/switch/switcher.hpp>
#include <moebius/transport/host_transport.hpp>
#if MOEBIUS_WITH_CUDA
#include <cuda_runtime_api.h>
#endif
#if MINI_ENGINE_DEMO_GPU
#include <moebius/transport/cuda_peer_transport.hpp>

#include "gpu_runtime.hpp"
#endif

#include "engine.hpp"
#include "fake_runtime.hpp"
#include "options.hpp"
#include "timeline_svg.hpp"
#if __has_include("host_runtime.hpp")
#define MINI_ENGINE_DEMO_HOST_RUNTIME 1
#include "host_runtime.hpp"
#include "model_config.hpp"
#include "weights.hpp"
#else
#define MINI_ENGINE_DEMO_HOST_RUNTIME 0
#endif

namespace {

using namespace mini_engine;
using moebius::parallel_mode;
using wall = std::chrono::steady_clock;

double seconds_since(wall::time_point t0) {
  return std::chrono::duration<double>(wall::now() - t0).count();
}

int count_gpus() {
#if MOEBIUS_WITH_CUDA
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) return 0;
  return n;
#else
  return 0;
#endif
}

// The runtime the demo serves with, its memory and what describes it.
struct world {
  std::unique_ptr<runtime> rt;
  std::vector<moebius::rank_memory> memory;
  moebius::arena_geometry arena;
  moebius::kv_geometry kv;
  int32_t vocab = 0;
  std::string description;
  bool on_gpu = false;
  std::function<std::unique_ptr<moebius::transport>()> make_transport;
};

// Each rank's arena as host bytes (device memory is copied back first).
std::vector<std::vector<std::byte>> arena_bytes(const world& w) {
  std::vector<std::vector<std::byte>> out;
  for (const moebius::rank_memory& m : w.memory) {
    const moebius::memory_span& s = m.space(moebius::memory_space::arena);
    std::vector<std::byte> b(static_cast<size_t>(s.bytes));
    if (m.device == moebius::host_memory_device) {
      std::copy(s.data(), s.data() + s.bytes, b.begin());
    } else {
#if MOEBIUS_WITH_CUDA
      if (cudaSetDevice(m.device) != cudaSuccess ||
          cudaMemcpy(b.data(), s.data(), b.size(), cudaMemcpyDeviceToHost) != cudaSuccess)
        throw std::runtime_error("cannot read device " + std::to_string(m.device) + "'s arena");
#endif
    }
    out.push_back(std::move(b));
  }
  return out;
}

int64_t kv_bytes_per_token(const moebius::kv_geometry& g) {
  return g.num_tensors() * g.heads_per_ep_page() * g.head_bytes();
}

// Geometry of the host deployment, computed without allocating; a model that cannot split
// over P ranks, or sizes that overflow, are usage errors.
struct host_plan {
  moebius::arena_geometry arena;
  moebius::kv_geometry kv;
  int32_t vocab = 0;
  int64_t weight_bytes = 0;  // logical weights held beside the arena
};

host_plan plan_host(const demo::options& o) {
  host_plan p;
  try {
#if MINI_ENGINE_DEMO_HOST_RUNTIME
    const model_config c = small();
    validate(c, o.ranks);
    p.arena = moebius::make_arena_geometry(expert_shape_of(c), o.ranks, 256, 4096);
    p.kv = kv_geometry_of(c, o.ranks, o.kv_pages);
    p.vocab = static_cast<int32_t>(c.vocab);
    // Embedding, LM head and attention per layer, in fp32, replicated once (host runtime).
    p.weight_bytes = 4 * (2 * c.vocab * c.hidden +
                          c.num_layers * (2 * c.q_dim() * c.hidden + 2 * c.kv_dim() * c.hidden +
                                          c.num_experts * 3 * c.hidden * c.intermediate));
#else
    moebius::expert_shape s;  // the small() model's experts: L=4, E=16, H=256, I=128, fp32
    s.num_layers = 4;
    s.num_experts = 16;
    s.hidden = 256;
    s.intermediate = 128;
    s.weight_dtype = moebius::dtype::fp32;
    p.arena = moebius::make_arena_geometry(s, o.ranks, 256, 4096);
    p.kv = moebius::make_kv_geometry(4, 2, 32, 16, o.kv_pages, o.ranks, moebius::dtype::fp32);
    p.vocab = 1024;
#endif
  } catch (const moebius::error& e) {
    throw demo::usage_error("--ranks " + std::to_string(o.ranks) + " / --kv-pages " +
                            std::to_string(o.kv_pages) + ": " + e.what());
  }
  return p;
}

// Physical memory of this machine (0 when unknown).
int64_t physical_bytes() {
  const long pages = sysconf(_SC_PHYS_PAGES), size = sysconf(_SC_PAGE_SIZE);
  return pages > 0 && size > 0 ? static_cast<int64_t>(pages) * size : 0;
}

void check_memory(const host_plan& p, int P) {
  const double need = static_cast<double>(P) * static_cast<double>(p.arena.total_bytes() +
                                                                   p.kv.pool_bytes()) +
                      static_cast<double>(p.weight_bytes);
  const int64_t have = physical_bytes();
  const double limit = have > 0 ? 0.5 * static_cast<double>(have) : 64.0 * (1 << 30);
  if (need > limit) {
    char buf[256];
    std::snprintf(buf, sizeof buf,
                  "the host runtime would need %.2f GiB (P=%d ranks x (arena %.1f MiB + KV pool "
                  "%.1f MiB)), more than half of this machine's %.2f GiB: lower --kv-pages or --ranks",
                  need / 1073741824.0, P, static_cast<double>(p.arena.total_bytes()) / 1048576.0,
                  static_cast<double>(p.kv.pool_bytes()) / 1048576.0,
                  static_cast<double>(have) / 1073741824.0);
    throw demo::usage_error(std::string("--kv-pages ") + buf);
  }
}

world make_world(const demo::options& o, const host_plan& p) {
  world w;
  w.arena = p.arena;
  w.kv = p.kv;
  w.vocab = p.vocab;
#if MINI_ENGINE_DEMO_HOST_RUNTIME
  const model_config c = small();
  host_runtime_options ho;
  ho.num_ranks = o.ranks;
  ho.num_ep_pages = o.kv_pages;
  auto rt = std::make_unique<host_runtime>(make_weights(c, o.seed), ho);
  w.memory = rt->memory();
  w.arena = rt->arena();
  w.kv = rt->kv();
  std::ostringstream d;
  d << "host runtime, small model (" << c << "), " << o.ranks << " virtual ranks";
  w.description = d.str();
  w.rt = std::move(rt);
#else
  auto rt = std::make_unique<fake_runtime>(p.arena, p.kv, p.vocab);
  w.memory = rt->memory();
  w.description = "token-hash fake runtime (the model's host runtime is not in this build), " +
                  std::to_string(o.ranks) + " virtual ranks";
  w.rt = std::move(rt);
#endif
  w.make_transport = [mem = w.memory] { return std::make_unique<moebius::host_transport>(mem); };
  return w;
}

#if MINI_ENGINE_DEMO_GPU && MINI_ENGINE_DEMO_HOST_RUNTIME
// The GPU world: the small() model with the host demo's weights (same seed) on P GPUs, fp32
// throughout (so TP and EP compute the same sums on one GPU), graphs per mode and bucket up to
// the step's token budget, page tables as long as the trace's longest request.
world make_gpu_world(const demo::options& o, int P, const std::vector<request>& trace) {
  const model_config c = small();
  validate(c, P);
  int64_t longest = 1;
  for (const request& r : trace)
    longest = std::max(longest, static_cast<int64_t>(r.prompt.size()) + r.output_tokens);
  gpu::gpu_runtime_options go = gpu::options_from_env();
  go.num_ranks = P;  // more than the GPUs: virtual ranks (placement automatic)
  go.num_ep_pages = o.kv_pages;
  go.max_pages_per_seq = (longest + c.page_size - 1) / c.page_size + 1;
  go.max_tokens = std::max(o.step_tokens, o.max_batch);
  go.buckets.clear();
  for (int64_t b = 1; b < go.max_tokens; b *= 2) go.buckets.push_back(b);
  go.buckets.push_back(go.max_tokens);
  go.dense_dtype = moebius::dtype::fp32;
  go.cursor = moebius::arena_cursor{0};
  go.tensor_alignment = 256;
  go.slot_alignment = 4096;
  const model_weights weights = make_weights(c, o.seed);
  auto rt = std::make_unique<gpu::gpu_runtime>(weights, go);
  world w;
  w.on_gpu = true;
  w.memory = rt->memory();
  w.arena = rt->arena();
  w.kv = rt->kv();
  w.vocab = static_cast<int32_t>(c.vocab);
  std::ostringstream d;
  d << "GPU runtime, small model (" << c << ", fp32), " << P
    << (rt->virtual_ranks() ? " virtual" : " GPU") << " rank" << (P > 1 ? "s" : "")
    << (rt->virtual_ranks()
            ? " on one GPU (each its own arena, KV pool, buffers and stream; collectives and "
              "switch copies over that GPU's memory: they emulate the contention for HBM and "
              "SMs each of P GPUs would see, not NVLink)"
            : "")
    << ", CUDA graphs captured once: " << rt->graph_statistics().whole_model
    << " whole-model (2 modes x " << go.buckets.size() << " buckets up to " << go.max_tokens
    << " tokens) and " << rt->graph_statistics().per_layer
    << " per-layer ones for the hybrid steps of progressive switches";
  w.description = d.str();
  w.rt = std::move(rt);
  w.make_transport = [mem = w.memory] {
    return std::make_unique<moebius::cuda_peer_transport>(
        moebius::cuda_peer_transport::single_process(mem));
  };
  return w;
}
#endif

std::vector<request> make_trace(const demo::options& o, int32_t vocab) {
  switch (o.trace) {
    case demo::trace_kind::bursty: {
      bursty_options b;
      b.duration_s = o.duration_s;
      b.quiet_s = 0.3;
      b.quiet_rate = 40;
      b.burst_s = 0.1;
      b.burst_rate = 1200;
      b.prompt_min = 16;
      b.prompt_max = 96;
      b.output_min = 8;
      b.output_max = 48;
      b.vocab = vocab;
      return bursty_trace(o.seed, b);
    }
    case demo::trace_kind::rollout: {
      rollout_options r;
      r.batch = o.requests;
      r.prompt_min = 16;
      r.prompt_max = 64;
      r.output_median = 24;
      r.output_max = 256;
      r.vocab = vocab;
      return rollout_trace(o.seed, r);
    }
    case demo::trace_kind::file:
      try {
        return read_trace_file(o.trace_file, o.seed, vocab);
      } catch (const moebius::error& e) {
        throw demo::usage_error(std::string("--trace: ") + e.what());
      }
  }
  return {};
}

// Stage 1: EP -> TP -> EP of every layer's experts through the switcher, with checksums of
// every layer read back from the ranks before and after each switch (the switcher undoes a
// switch whose checksums differ).
bool verified_reshard(world& w) {
  const std::unique_ptr<moebius::transport> t = w.make_transport();
  moebius::switcher_options so;
  so.verify = [&](moebius::arena_cursor c, const moebius::kv_state&) {
    const std::vector<std::vector<std::byte>> bytes = arena_bytes(w);
    std::vector<std::span<const std::byte>> arenas;
    for (const auto& b : bytes) arenas.emplace_back(b.data(), b.size());
    uint64_t sum = 0;
    for (int64_t l = 0; l < w.arena.shape.num_layers; ++l) {
      sum = sum * 1000003 + moebius::weight_checksum(w.arena, c, l, arenas);
    }
    return sum;
  };
  moebius::kv_state empty;
  empty.mode = parallel_mode::ep;
  empty.ranks.resize(static_cast<size_t>(w.kv.num_ranks));
  for (auto& r : empty.ranks) {
    for (int64_t p = 0; p < w.kv.num_ep_pages; ++p) r.free_pages.push_back(p);
  }
  moebius::switcher sw(w.arena, w.kv, *t, empty, moebius::arena_cursor{0}, so);
  bool ok = true;
  for (const parallel_mode target : {parallel_mode::tp, parallel_mode::ep}) {
    const moebius::switch_report r = sw.switch_to(target);
    int64_t sent = 0;
    for (int64_t b : r.weight_bytes_sent) sent = std::max(sent, b);
    const bool good = r.outcome == moebius::switch_outcome::committed && r.verified;
    std::printf("  %s -> %s: %lld layers, %.2f MiB leaving each rank, %.1f ms on this host; "
                "checksums of every layer %s\n",
                moebius::to_string(r.from), moebius::to_string(r.to),
                static_cast<long long>(r.weight_phases), static_cast<double>(sent) / 1048576.0,
                r.total_ms, good ? "equal" : ("DIFFER: " + r.error).c_str());
    ok = ok && good;
  }
  return ok;
}

struct table_row {
  std::string name;
  run_summary s;
  double wall_s = 0;
};

// Step latency during switches against normal steps: a stop-the-world switch stalls the step
// after it (its step time plus the switch), a progressive switch stretches each step it
// overlaps to max(step, copies).
struct switch_steps {
  double normal_max_ms = 0, normal_p99_ms = 0, switch_max_ms = 0, switch_p99_ms = 0;
  double mean_length_steps = 0;  // steps per committed switch (stop-the-world: 1)
};

double p99(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t rank = static_cast<size_t>(std::ceil(0.99 * static_cast<double>(v.size())));
  return v[std::max<size_t>(rank, 1) - 1];
}

switch_steps switch_steps_of(const run_result& r) {
  std::vector<double> normal, during;
  for (const step_record& s : r.steps) {
    if (s.switched) during.push_back(s.step_ms + s.switch_ms);
    else if (s.in_switch) during.push_back(s.step_ms);
    else normal.push_back(s.step_ms);
  }
  switch_steps out;
  out.normal_p99_ms = p99(normal);
  out.switch_p99_ms = p99(during);
  for (double x : normal) out.normal_max_ms = std::max(out.normal_max_ms, x);
  for (double x : during) out.switch_max_ms = std::max(out.switch_max_ms, x);
  int64_t n = 0, steps = 0;
  for (const switch_record& w : r.switches) {
    if (w.outcome != moebius::switch_outcome::committed) continue;
    ++n;
    steps += w.progressive ? w.steps : 1;
  }
  out.mean_length_steps = n > 0 ? static_cast<double>(steps) / static_cast<double>(n) : 0;
  return out;
}

void print_switch_steps(const std::vector<table_row>& rows, const std::vector<run_result>& runs) {
  std::printf("\n  %-11s %23s %23s %14s\n", "run", "normal steps max / p99",
              "switch steps max / p99", "switch length");
  for (size_t k = 0; k < rows.size(); ++k) {
    const switch_steps w = switch_steps_of(runs[k]);
    char len[32] = "-", sw[48] = "-";
    if (w.mean_length_steps > 0) {
      std::snprintf(len, sizeof len, "%.1f steps", w.mean_length_steps);
      std::snprintf(sw, sizeof sw, "%.2f / %.2f ms", w.switch_max_ms, w.switch_p99_ms);
    }
    char normal[48];
    std::snprintf(normal, sizeof normal, "%.2f / %.2f ms", w.normal_max_ms, w.normal_p99_ms);
    std::printf("  %-11s %23s %23s %14s\n", rows[k].name.c_str(), normal, sw, len);
  }
  std::printf("  (a stop-the-world switch counts as one step: the step after it, plus the switch)\n");
}

void print_table(const std::vector<table_row>& rows, const std::string& clock) {
  std::printf("\n  %-11s %11s %11s %11s %10s %9s %16s %8s\n", "run", "mean TTFT", "p99 TTFT",
              "mean TPOT", "tokens/s", "switches", "switch total/mean", "host s");
  for (const table_row& r : rows) {
    char sw[64];
    if (r.s.switches > 0) {
      std::snprintf(sw, sizeof sw, "%.0f / %.1f ms", r.s.switch_total_ms, r.s.switch_mean_ms);
    } else {
      std::snprintf(sw, sizeof sw, "-");
    }
    std::printf("  %-11s %8.1f ms %8.1f ms %8.2f ms %10.0f %9lld %16s %8.1f\n", r.name.c_str(),
                r.s.mean_ttft_ms, r.s.p99_ttft_ms, r.s.mean_tpot_ms, r.s.tokens_per_s,
                static_cast<long long>(r.s.switches), sw, r.wall_s);
  }
  std::printf("  (times on the %s clock; 'host s' is the wall time this machine took)\n",
              clock.c_str());
}

int run_demo(const demo::options& o) {
  const auto t_start = wall::now();
  std::printf("moebius demo: a mini-engine serving while Moebius switches it between TP and EP\n");
  const int gpus = count_gpus();
  bool use_gpu = false;
  if (o.runtime == demo::runtime_kind::gpu ||
      (o.runtime == demo::runtime_kind::automatic && gpus > 0)) {
#if MINI_ENGINE_DEMO_GPU && MINI_ENGINE_DEMO_HOST_RUNTIME
    use_gpu = gpus > 0;
    if (!use_gpu) std::printf("  note: no GPU found; running the host runtime\n");
#else
    std::printf("  note: %d GPU(s) found, but this build has no GPU runtime (it needs CUDA and "
                "NCCL); running the host runtime\n",
                gpus);
#endif
  }
  // GPU: 2 ranks (one per GPU with two GPUs or more, virtual on one GPU), or --gpu-ranks.
  const int P = !use_gpu ? o.ranks : o.gpu_ranks > 0 ? o.gpu_ranks : 2;
  const host_plan plan = plan_host(o);
  if (!use_gpu) check_memory(plan, o.ranks);
  std::vector<request> trace = make_trace(o, plan.vocab);
  if (trace.empty()) throw demo::usage_error("--trace: the trace has no requests");

#if MINI_ENGINE_DEMO_GPU && MINI_ENGINE_DEMO_HOST_RUNTIME
  world w = use_gpu ? make_gpu_world(o, P, trace) : make_world(o, plan);
#else
  world w = make_world(o, plan);
#endif
  std::printf("  runtime: %s\n", w.description.c_str());
  int64_t prompt_tokens = 0, output_tokens = 0;
  for (const request& r : trace) {
    prompt_tokens += static_cast<int64_t>(r.prompt.size());
    output_tokens += r.output_tokens;
  }
  std::printf("  trace: %s, %zu requests, %lld prompt + %lld output tokens, seed %llu\n",
              o.trace == demo::trace_kind::bursty    ? "bursty"
              : o.trace == demo::trace_kind::rollout ? "rollout"
                                                     : o.trace_file.c_str(),
              trace.size(), static_cast<long long>(prompt_tokens),
              static_cast<long long>(output_tokens), static_cast<unsigned long long>(o.seed));

  bool ok = true;
  if (o.reshard_stage) {
    std::printf("\nstage 1: verified reshard of the model's experts\n");
    ok = verified_reshard(w);
  }

  // The clock.
  std::unique_ptr<step_clock> clock;
  const bool use_model = o.clock == demo::clock_kind::model ||
                         (o.clock == demo::clock_kind::automatic && !w.on_gpu);
  if (use_model) {
    priced_model m;
    m.num_kv_heads = w.kv.num_kv_heads;
    m.context_scale = o.context_scale;
    clock = std::make_unique<h200_step_model>(m, h200_params{}, P, kv_bytes_per_token(w.kv));
    std::ostringstream d;
    d << m;
    std::printf("\n  clock: modelled H200 x%d (DESIGN.md §6-7 rates), each step priced as the "
                "model %s; the host's own time is in the CSV (measured_ms)\n",
                P, d.str().c_str());
  } else {
    clock = std::make_unique<measured_clock>();
    if (w.on_gpu)
      std::printf("\n  clock: measured on the GPUs (each step's CUDA events, the longest rank; "
                  "switches and copies: their measured time)\n");
    else
      std::printf("\n  clock: measured (on the host all ranks run on one core: no GPU crossover)\n");
  }

  const std::unique_ptr<moebius::transport> transport = w.make_transport();
  engine e(*w.rt, *transport, w.arena, w.kv, *clock, moebius::arena_cursor{0});

  std::printf("\nstage 2: calibration (decode step of both modes, batch 1..%lld)\n",
              static_cast<long long>(o.max_batch));
  std::vector<int64_t> batches;
  for (int64_t b = 1; b < o.max_batch; b *= 2) batches.push_back(b);
  batches.push_back(o.max_batch);
  if (batches.size() < 2) batches.insert(batches.begin(), 1), batches.back() = 2;
  const int64_t context = std::max<int64_t>(1, (prompt_tokens + output_tokens / 2) /
                                                   static_cast<int64_t>(trace.size()));
  const moebius::calibration_result cal = calibrate_engine(e, batches, context);
  {
    std::ostringstream d;
    d << cal;
    std::printf("  at %lld context tokens: %s\n", static_cast<long long>(context), d.str().c_str());
  }
  engine_options base;
  base.scheduler.max_running = o.max_batch;
  base.scheduler.max_step_tokens = o.step_tokens;
  base.progress_every_steps = 1;
  auto last_print = wall::now();
  base.on_progress = [&](const progress_info& p) {
    if (seconds_since(last_print) < 2.0) return;
    last_print = wall::now();
    std::printf("    [%s] step %6lld  t=%7.3f s  running %4lld  done %5lld/%lld  %s  switches %lld\n",
                p.run->c_str(), static_cast<long long>(p.step), p.now_s,
                static_cast<long long>(p.running), static_cast<long long>(p.finished),
                static_cast<long long>(p.total), moebius::to_string(p.mode),
                static_cast<long long>(p.switches));
    std::fflush(stdout);
  };

  engine_options switching_opts = base;
  if (w.on_gpu) {
    // At GPU step times the demo's trace keeps few sequences running (each step takes a
    // fraction of a millisecond), below any threshold the calibration finds, and one GPU has
    // no crossover at all: the switching runs switch every 100 steps instead (forced), which
    // moves every weight and KV page over cuda_peer_transport and serves across each switch
    // (graphs replayed after it, hybrid steps during the progressive ones).
    switching_opts.how = switching::forced;
    switching_opts.start_mode = parallel_mode::tp;
    for (int64_t s = 100; s <= 100'000; s += 100) switching_opts.forced_steps.push_back(s);
    std::printf("  on the GPU the switching runs switch every 100 steps (forced; the "
                "calibrated policy, for reference, below)\n");
    if (cal.has_thresholds) {
      std::ostringstream d;
      d << moebius::apply_calibration(cal, moebius::interactive_config(cal.t_high));
      std::printf("  policy: %s\n", d.str().c_str());
    }
  } else if (cal.has_thresholds) {
    switching_opts.how = switching::policy;
    switching_opts.policy = moebius::apply_calibration(cal, moebius::interactive_config(cal.t_high));
    switching_opts.policy.cooldown_s = 0.02;  // the trace is compressed: bursts of 0.1 s
    switching_opts.policy.cooldown_steps = 8;
    switching_opts.policy.down_window = 8;
    switching_opts.start_mode = parallel_mode::tp;
    std::ostringstream d;
    d << switching_opts.policy;
    std::printf("  policy: %s\n", d.str().c_str());
  } else {
    switching_opts.start_mode = cal.cross.status == moebius::crossover_status::ep_always_faster
                                    ? parallel_mode::ep
                                    : parallel_mode::tp;
    std::printf("  no crossover in the measured range (%s): the switching run stays in %s\n",
                moebius::to_string(cal.cross.status), moebius::to_string(switching_opts.start_mode));
  }

  std::printf("\nstage 3: serving the trace four times\n");
  std::vector<run_result> results;
  std::vector<table_row> rows;
  for (int k = 0; k < 4; ++k) {
    engine_options opt = k >= 2 ? switching_opts : base;
    if (k < 2) opt.start_mode = k == 0 ? parallel_mode::tp : parallel_mode::ep;
    if (k == 3) opt.style = switch_style::progressive;
    const std::string name = k == 0 ? "static TP" : k == 1 ? "static EP" : k == 2 ? "switching" : "progressive";
    std::printf("  %s ...\n", name.c_str());
    std::fflush(stdout);
    const auto t0 = wall::now();
    results.push_back(e.run(trace, opt, name));
    rows.push_back({name, summarize(results.back()), seconds_since(t0)});
  }

  // The proof: the switching run's greedy tokens are the static runs', request by request.
  int64_t differ = 0;
  for (size_t i = 0; i < trace.size(); ++i) {
    const auto& a = results[0].requests[i].generated;
    differ += results[1].requests[i].generated != a || results[2].requests[i].generated != a ||
              results[3].requests[i].generated != a;
  }
  int64_t mid_prefill = 0, prog_tokens = 0;
  for (const switch_record& s : results[2].switches) mid_prefill += s.prefilling > 0;
  for (const switch_record& s : results[3].switches) prog_tokens += s.tokens;
  print_table(rows, results[0].clock);
  print_switch_steps(rows, results);
  std::printf("\n  greedy tokens: %s (%zu requests; %zu switches, %lld of them mid-prefill; "
              "progressive: %zu switches, %lld tokens served during them)\n",
              differ == 0 ? "identical in all four runs" : "DIFFER", trace.size(),
              results[2].switches.size(), static_cast<long long>(mid_prefill),
              results[3].switches.size(), static_cast<long long>(prog_tokens));
  if (differ != 0) {
    // The first divergence: which request, run and token.
    for (size_t i = 0; i < trace.size(); ++i) {
      const auto& a = results[0].requests[i].generated;
      for (size_t k = 1; k < results.size(); ++k) {
        const auto& b = results[k].requests[i].generated;
        if (b == a) continue;
        size_t t = 0;
        while (t < a.size() && t < b.size() && a[t] == b[t]) ++t;
        std::printf("  first divergence: request %zu, run '%s', generated token %zu (%d vs %d) "
                    "of %lld requests that differ\n",
                    i, results[k].name.c_str(), t, t < a.size() ? a[t] : -1,
                    t < b.size() ? b[t] : -1, static_cast<long long>(differ));
        i = trace.size();
        break;
      }
    }
  }
  // On P > 1 GPUs TP and EP add the ranks' partial sums in other orders (all-reduce against
  // one rank's whole GEMM), so an fp32 near-tie can flip a greedy token: reported, not failed
  // (the GPU tests check each mode's logits against a float64 reference).
  const bool exact = !w.on_gpu || P == 1;
  if (differ != 0 && !exact)
    std::printf("  (on %d GPU ranks TP and EP round their sums differently: a near-tie can flip a "
                "greedy token; not counted as a failure)\n",
                P);
  ok = ok && (differ == 0 || !exact);

  std::filesystem::create_directories(o.out_dir);
  const std::string csv_path = o.out_dir + "/steps.csv", svg_path = o.out_dir + "/timeline.svg";
  {
    std::ofstream csv(csv_path);
    for (size_t k = 0; k < results.size(); ++k) {
      std::ostringstream part;
      write_steps_csv(part, results[k]);
      std::string text = part.str();
      if (k > 0) text = text.substr(text.find('\n') + 1);  // one header
      csv << text;
    }
    if (!csv) throw std::runtime_error("cannot write " + csv_path);
    std::ofstream svg(svg_path);
    demo::write_timeline_svg(svg, {&results[0], &results[1], &results[2], &results[3]});
    if (!svg) throw std::runtime_error("cannot write " + svg_path);
  }
  std::printf("  wrote %s and %s\n", csv_path.c_str(), svg_path.c_str());
  std::printf("%s (%.1f s)\n", ok ? "demo: ok" : "demo: FAILED", seconds_since(t_start));
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
#if MINI_ENGINE_DEMO_GPU
  // Before the first CUDA call: a hardware queue per virtual rank's stream (the transport's
  // barriers spin; cuda_peer_transport.hpp).
  moebius::request_hardware_queues_for_virtual_ranks();
#endif
  demo::options o;
  try {
    o = demo::parse_options(argc, argv);
  } catch (const demo::usage_error& e) {
    std::fprintf(stderr, "moebius_demo: error: %s (see --help)\n", e.what());
    return 2;
  }
  if (o.help) {
    std::fputs(demo::usage_text(), stdout);
    return 0;
  }
  try {
    return run_demo(o);
  } catch (const demo::usage_error& e) {
    std::fprintf(stderr, "moebius_demo: error: %s (see --help)\n", e.what());
    return 2;
  } catch (const moebius::error& e) {
    std::fprintf(stderr, "moebius_demo: failed: %s\n", e.what());
    return 1;
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "moebius_demo: failed: out of memory (try smaller --kv-pages or --ranks)\n");
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "moebius_demo: failed: %s\n", e.what());
    return 1;
  } catch (...) {
    std::fprintf(stderr, "moebius_demo: failed: unknown exception\n");
    return 1;
  }
}
