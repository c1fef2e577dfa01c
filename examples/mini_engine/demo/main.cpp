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
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <optional>
#include <new>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
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
#include "step_curves.hpp"
#include "fake_runtime.hpp"
#include "options.hpp"
#include "timeline_svg.hpp"
#if __has_include("host_runtime.hpp")
#define MINI_ENGINE_DEMO_HOST_RUNTIME 1
#include "checkpoint.hpp"
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

#if MINI_ENGINE_DEMO_HOST_RUNTIME
// The model served: lite() (random weights), or the --model checkpoint's as config.json
// describes it (experts in its dtype, fp32 KV, pages of 16 tokens).
model_config served_model(const hf_checkpoint* ck) {
  if (!ck) return lite();
  model_config m = ck->config().model;
  m.page_size = 16;
  m.kv_dtype = moebius::dtype::fp32;
  return m;
}
#else
struct hf_checkpoint {};
#endif

host_plan plan_host(const demo::options& o, const hf_checkpoint* ck) {
  host_plan p;
  try {
#if MINI_ENGINE_DEMO_HOST_RUNTIME
    const model_config c = served_model(ck);
    validate(c, o.ranks);
    p.arena = moebius::make_arena_geometry(expert_shape_of(c), o.ranks, 256, 4096);
    p.kv = kv_geometry_of(c, o.ranks, o.kv_pages);
    p.vocab = static_cast<int32_t>(c.vocab);
    // Embedding, LM head and attention per layer, in fp32, replicated once (host runtime).
    p.weight_bytes = 4 * (2 * c.vocab * c.hidden +
                          c.num_layers * (2 * c.q_dim() * c.hidden + 2 * c.kv_dim() * c.hidden +
                                          c.num_experts * 3 * c.hidden * c.intermediate));
#else
    (void)ck;
    moebius::expert_shape s;  // the lite() model's experts: L=2, E=16, H=128, I=64, fp32
    s.num_layers = 2;
    s.num_experts = 16;
    s.hidden = 128;
    s.intermediate = 64;
    s.weight_dtype = moebius::dtype::fp32;
    p.arena = moebius::make_arena_geometry(s, o.ranks, 256, 4096);
    p.kv = moebius::make_kv_geometry(2, 4, 16, 16, o.kv_pages, o.ranks, moebius::dtype::fp32);
    p.vocab = 512;
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

// `ck`: serve the checkpoint (streamed from its shards into the runtime; `progress` prints a
// line per shard), else lite() with random weights.
world make_world(const demo::options& o, const host_plan& p, const hf_checkpoint* ck,
                 bool progress) {
  world w;
  w.arena = p.arena;
  w.kv = p.kv;
  w.vocab = p.vocab;
#if MINI_ENGINE_DEMO_HOST_RUNTIME
  const model_config c = served_model(ck);
  host_runtime_options ho;
  ho.num_ranks = o.ranks;
  ho.num_ep_pages = o.kv_pages;
  std::unique_ptr<host_runtime> rt;
  if (ck) {
    const auto t0 = wall::now();
    rt = std::make_unique<host_runtime>(c, ho, [&](weight_sink& s) {
      ck->load(c, s, [&](const load_progress& lp) {
        if (!progress) return;
        std::printf("  loading %s\n", progress_line(lp).c_str());
        std::fflush(stdout);
      });
    });
    if (progress)
      std::printf("  loaded %s: %.3f GB in %.2f s\n", ck->source().c_str(),
                  static_cast<double>(ck->bytes()) / 1e9, seconds_since(t0));
  } else {
    rt = std::make_unique<host_runtime>(make_weights(c, o.seed), ho);
  }
  w.memory = rt->memory();
  w.arena = rt->arena();
  w.kv = rt->kv();
  std::ostringstream d;
  if (ck)
    d << "host runtime, checkpoint " << ck->source() << " (" << c << "), " << o.ranks
      << " virtual ranks";
  else
    d << "host runtime, lite model (" << c << "), " << o.ranks << " virtual ranks";
  w.description = d.str();
  w.rt = std::move(rt);
#else
  (void)ck;
  (void)progress;
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
world make_gpu_world(const demo::options& o, int P, const std::vector<request>& trace,
                     const hf_checkpoint* ck) {
  // A checkpoint: its model, dense weights and KV in bf16 when it is bf16 (fp32 otherwise).
  model_config c = small();
  const bool bf16_ck = ck && ck->config().dtype == moebius::dtype::bf16;
  if (ck) {
    c = served_model(ck);
    c.kv_dtype = bf16_ck ? moebius::dtype::bf16 : moebius::dtype::fp32;
  }
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
  go.dense_dtype = bf16_ck ? moebius::dtype::bf16 : moebius::dtype::fp32;
  go.cursor = moebius::arena_cursor{0};
  go.tensor_alignment = 256;
  go.slot_alignment = 4096;
  std::unique_ptr<gpu::gpu_runtime> rt;
  if (ck) {
    const auto t0 = wall::now();
    rt = std::make_unique<gpu::gpu_runtime>(c, go, [&](weight_sink& s) {
      ck->load(c, s, [](const load_progress& lp) {
        std::printf("  loading %s\n", progress_line(lp).c_str());
        std::fflush(stdout);
      });
    });
    std::printf("  loaded %s onto the GPU runtime: %.2f GB in %.2f s\n", ck->source().c_str(),
                static_cast<double>(ck->bytes()) / 1e9, seconds_since(t0));
  } else {
    rt = std::make_unique<gpu::gpu_runtime>(make_weights(c, o.seed), go);
  }
  world w;
  w.on_gpu = true;
  w.memory = rt->memory();
  w.arena = rt->arena();
  w.kv = rt->kv();
  w.vocab = static_cast<int32_t>(c.vocab);
  std::ostringstream d;
  d << "GPU runtime, " << (ck ? "checkpoint " + ck->source() : std::string("small model")) << " ("
    << c << ", dense " << moebius::to_string(go.dense_dtype) << "), " << P
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

// The traces (fixed shapes, the same for every deployment; sizes kept small enough for the
// host runtime to serve each four times in a few minutes):
//   bursty      quiet periods (0.6 s at 40 requests/s: 1-10 running) and bursts (0.1 s at
//               5500/s: ~550 requests, the engine fills to its 512 sequences)
//   rollout     an RL rollout: `--requests` (512) prompts at t = 0, outputs log-normal
//               (median 32, sigma 1.0, clamped at 1024): a long tail of long generations
//   steady      Poisson arrivals at the rate that keeps ~B* (the calibrated crossover)
//               sequences running (Little's law at the crossover's step time)
//   production  shaped like the Azure LLM inference trace 2023 (trace.hpp: Splitwise's
//               conversation medians, prompt 1020 / output 129 tokens; prompts divided by
//               the clock's context scale), mean 30 requests/s, rate redrawn every 0.5 s
std::vector<request> make_trace(const demo::options& o, demo::trace_kind kind, int32_t vocab,
                                double crossover_rate) {
  switch (kind) {
    case demo::trace_kind::bursty: {
      bursty_options b;
      b.duration_s = o.duration_s > 0 ? o.duration_s : 1.4;
      b.quiet_s = 0.6;
      b.quiet_rate = 40;
      b.burst_s = 0.1;
      b.burst_rate = 5500;
      b.prompt_min = 8;
      b.prompt_max = 32;
      b.output_min = 4;
      b.output_max = 32;
      b.vocab = vocab;
      return bursty_trace(o.seed, b);
    }
    case demo::trace_kind::rollout: {
      rollout_options r;
      r.batch = o.requests;
      r.prompt_min = 16;
      r.prompt_max = 48;
      r.output_median = 32;
      r.output_sigma = 1.0;
      r.output_max = 1024;
      r.vocab = vocab;
      return rollout_trace(o.seed, r);
    }
    case demo::trace_kind::steady: {
      steady_options st;
      st.duration_s = o.duration_s > 0 ? o.duration_s : 1.5;
      st.rate = crossover_rate;
      st.prompt_min = 8;
      st.prompt_max = 32;
      st.output_min = 8;
      st.output_max = 40;
      st.vocab = vocab;
      return steady_trace(o.seed, st);
    }
    case demo::trace_kind::production: {
      production_options p;
      p.duration_s = o.duration_s > 0 ? o.duration_s : 3.0;
      p.mean_rate = 30;
      p.rate_period_s = 0.5;
      p.prompt_scale = o.context_scale;
      p.prompt_max = 256;
      p.output_max = 512;
      p.vocab = vocab;
      return production_trace(o.seed, p);
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
  std::printf("\n  %-11s %10s %10s %10s %10s %9s %8s %17s %7s\n", "run", "mean TTFT", "p99 TTFT",
              "mean TPOT", "p99 TPOT", "tokens/s", "switches", "switch total/mean", "host s");
  for (const table_row& r : rows) {
    char sw[64];
    if (r.s.switches > 0) {
      std::snprintf(sw, sizeof sw, "%.0f / %.1f ms", r.s.switch_total_ms, r.s.switch_mean_ms);
    } else {
      std::snprintf(sw, sizeof sw, "-");
    }
    std::printf("  %-11s %7.1f ms %7.1f ms %7.2f ms %7.2f ms %9.0f %8lld %17s %7.1f\n",
                r.name.c_str(), r.s.mean_ttft_ms, r.s.p99_ttft_ms, r.s.mean_tpot_ms,
                r.s.p99_tpot_ms, r.s.tokens_per_s, static_cast<long long>(r.s.switches), sw,
                r.wall_s);
  }
  std::printf("  (times on the %s clock; 'host s' is the wall time this machine took)\n",
              clock.c_str());
}

// The targets, per trace (never tuned for: a miss is reported with its numbers).
struct target_check {
  bool met = true;
  std::string line;
};

target_check check_targets(demo::trace_kind kind, const run_summary& best,
                           const run_summary& sw, const char* sw_name) {
  char buf[512];
  const double ratio = best.tokens_per_s > 0 ? sw.tokens_per_s / best.tokens_per_s : 0;
  target_check t;
  switch (kind) {
    case demo::trace_kind::rollout:
      t.met = ratio >= 1.16;
      std::snprintf(buf, sizeof buf, "target (rollout): %s >= 1.16x the best static tokens/s: %.3fx (%s)",
                    sw_name, ratio, t.met ? "met" : "MISSED");
      break;
    case demo::trace_kind::bursty:
      t.met = ratio >= 1.0 && sw.p99_ttft_ms <= best.p99_ttft_ms;
      std::snprintf(buf, sizeof buf,
                    "target (bursty): %s's p99 TTFT and tokens/s at least the best static's: "
                    "%.3fx tokens/s, p99 TTFT %.1f vs %.1f ms (%s)",
                    sw_name, ratio, sw.p99_ttft_ms, best.p99_ttft_ms, t.met ? "met" : "MISSED");
      break;
    default:
      t.met = ratio >= 0.98 && sw.p99_ttft_ms <= best.p99_ttft_ms * 1.02;
      std::snprintf(buf, sizeof buf,
                    "target (%s): %s never more than 2%% worse than the best static: %.3fx "
                    "tokens/s, p99 TTFT %.1f vs %.1f ms (%s)",
                    kind == demo::trace_kind::steady ? "steady" : "others", sw_name, ratio,
                    sw.p99_ttft_ms, best.p99_ttft_ms, t.met ? "met" : "MISSED");
      break;
  }
  t.line = buf;
  return t;
}

// Why the switching run did (not) switch, in the gate's numbers.
void print_gate(const run_result& r, const moebius::latency_curves* curves, int64_t peak_load) {
  if (r.gate.empty()) return;
  int64_t passed = 0;
  for (const switch_record& s : r.switches) passed += s.gate.evaluated && s.gate.passed;
  std::printf("    %s: gate let %lld switch%s through, refused %lld decision%s", r.name.c_str(),
              static_cast<long long>(passed), passed == 1 ? "" : "es",
              static_cast<long long>(r.gate_refusals), r.gate_refusals == 1 ? "" : "s");
  if (r.gate_refusals > 0) {
    std::ostringstream g;
    g << r.last_refusal;
    std::printf("; last refused: %s", g.str().c_str());
  }
  if (!r.switches.empty() && r.switches.front().gate.evaluated) {
    std::ostringstream g;
    g << r.switches.front().gate;
    std::printf("; first let through: %s", g.str().c_str());
  }
  std::printf("\n");
  if (curves != nullptr && peak_load > 0) {
    const double b = static_cast<double>(peak_load);
    const double tp = curves->tp.at(b), ep = curves->ep.at(b);
    std::printf("    at the peak load %lld the calibrated steps are TP %.2f ms, EP %.2f ms (%+.1f%%)\n",
                static_cast<long long>(peak_load), tp, ep, (ep - tp) / tp * 100.0);
  }
}

struct trace_outcome {
  std::string name;
  bool tokens_identical = true;
  std::vector<target_check> targets;
};

// Serves one trace four times and prints its table.
trace_outcome serve_trace(const demo::options& o, demo::trace_kind kind, world& w, engine& e,
                          const std::vector<engine*>& pool, const step_clock& clock, int P,
                          const std::function<void(engine_options&)>& set_progress) {
  trace_outcome out;
  out.name = kind == demo::trace_kind::file ? o.trace_file : demo::to_string(kind);
  std::printf("\n=== trace: %s ===\n", out.name.c_str());

  // Calibration at a first guess of the context, to size the steady trace's rate.
  std::vector<int64_t> batches;
  for (int64_t b = 1; b < o.max_batch; b *= 2) batches.push_back(b);
  batches.push_back(o.max_batch);
  if (batches.size() < 2) batches.insert(batches.begin(), 1), batches.back() = 2;
  double crossover_rate = 0;
  if (kind == demo::trace_kind::steady) {
    const moebius::calibration_result c0 = calibrate_engine(e, batches, 44);  // 20 + 24
    const double bstar = c0.has_thresholds ? c0.cross.batch : static_cast<double>(o.max_batch) / 2;
    // Little's law: B* running, each for ~25 steps (24 outputs on average + its prefill) of the
    // crossover's step time.
    crossover_rate = bstar / (25.0 * c0.curves.tp.at(bstar) * 1e-3);
  }
  std::vector<request> trace = make_trace(o, kind, w.vocab, crossover_rate);
  if (trace.empty()) throw demo::usage_error("--trace: the trace has no requests");
  int64_t prompt_tokens = 0, output_tokens = 0;
  for (const request& r : trace) {
    prompt_tokens += static_cast<int64_t>(r.prompt.size());
    output_tokens += r.output_tokens;
  }
  std::printf("  %zu requests, %lld prompt + %lld output tokens, seed %llu%s\n", trace.size(),
              static_cast<long long>(prompt_tokens), static_cast<long long>(output_tokens),
              static_cast<unsigned long long>(o.seed),
              kind == demo::trace_kind::steady
                  ? (", " + std::to_string(static_cast<int>(crossover_rate)) +
                     " requests/s: ~B* running")
                        .c_str()
                  : "");

  const int64_t context = std::max<int64_t>(1, (prompt_tokens + output_tokens / 2) /
                                                   static_cast<int64_t>(trace.size()));
  const moebius::calibration_result cal = calibrate_engine(e, batches, context);
  {
    std::ostringstream d;
    d << cal;
    std::printf("  calibration at %lld context tokens: %s\n", static_cast<long long>(context),
                d.str().c_str());
  }
  engine_options base;
  base.scheduler.max_running = o.max_batch;
  base.scheduler.max_step_tokens = o.step_tokens;
  set_progress(base);

  engine_options switching_opts = base;
  if (w.on_gpu) {
    // At GPU step times the demo's trace keeps few sequences running, below any threshold the
    // calibration finds, and one GPU has no crossover at all: the switching runs switch every
    // 100 steps instead (forced), which moves every weight and KV page over
    // cuda_peer_transport and serves across each switch.
    switching_opts.how = switching::forced;
    switching_opts.start_mode = parallel_mode::tp;
    for (int64_t s = 100; s <= 100'000; s += 100) switching_opts.forced_steps.push_back(s);
    std::printf("  on the GPU the switching runs switch every 100 steps (forced)\n");
  } else if (cal.has_thresholds) {
    switching_opts.how = switching::policy;
    if (kind == demo::trace_kind::rollout) {
      // Paper eq. 13: a rollout's load only decays; cooldown in steps.
      switching_opts.policy = moebius::apply_calibration(cal, moebius::rollout_config(cal.t_high, 8));
      switching_opts.policy.t_low = switching_opts.policy.t_high;
    } else {
      switching_opts.policy = moebius::apply_calibration(cal, moebius::interactive_config(cal.t_high));
      switching_opts.policy.cooldown_s = 0.02;  // the traces are compressed: bursts of 0.1 s
      switching_opts.policy.cooldown_steps = 8;
      switching_opts.policy.down_window = 8;
    }
    switching_opts.start_mode = parallel_mode::tp;
    switching_opts.gate.enabled = o.gate;
    switching_opts.gate.curves = cal.curves;  // the calibration printed above
    std::ostringstream d;
    d << switching_opts.policy;
    std::printf("  policy: %s; cost gate %s (margin %.2f, residency window %lld steps, horizon "
                "%lld steps)\n",
                d.str().c_str(), o.gate ? "on" : "OFF (--no-gate)", switching_opts.gate.margin,
                static_cast<long long>(switching_opts.gate.residency.window_steps),
                static_cast<long long>(switching_opts.gate.residency.horizon_steps));
  } else {
    switching_opts.start_mode = cal.cross.status == moebius::crossover_status::ep_always_faster
                                    ? parallel_mode::ep
                                    : parallel_mode::tp;
    std::printf("  no crossover in the measured range (%s): the switching runs stay in %s\n",
                moebius::to_string(cal.cross.status), moebius::to_string(switching_opts.start_mode));
  }

  // The four runs (and, with the gate on, a fifth: the same policy without the gate, to show
  // what the gate prevents); on the host two at a time, each on its own runtime.
  const char* names[5] = {"static TP", "static EP", "switching", "progressive", "no gate"};
  const size_t num_runs = switching_opts.how == switching::policy && o.gate ? 5 : 4;
  std::vector<engine_options> opts(num_runs);
  for (size_t k = 0; k < num_runs; ++k) {
    opts[k] = k >= 2 ? switching_opts : base;
    if (k < 2) opts[k].start_mode = k == 0 ? parallel_mode::tp : parallel_mode::ep;
    if (k == 3) opts[k].style = switch_style::progressive;
    if (k == 4) opts[k].gate.enabled = false;
  }
  std::vector<run_result> results(num_runs);
  std::vector<double> wall_s(num_runs, 0);
  std::exception_ptr failure;
  std::mutex failure_mutex;
  for (size_t first = 0; first < num_runs; first += pool.size()) {
    std::vector<std::thread> threads;
    for (size_t j = 0; j < pool.size() && first + j < num_runs; ++j) {
      const size_t k = first + j;
      std::printf("  %s ...\n", names[k]);
      std::fflush(stdout);
      threads.emplace_back([&, k, j] {
        try {
          const auto t0 = wall::now();
          results[k] = pool[j]->run(trace, opts[k], names[k]);
          wall_s[k] = seconds_since(t0);
        } catch (...) {
          std::lock_guard<std::mutex> lock(failure_mutex);
          if (!failure) failure = std::current_exception();
        }
      });
    }
    for (std::thread& t : threads) t.join();
    if (failure) std::rethrow_exception(failure);
  }
  std::vector<table_row> rows;
  for (size_t k = 0; k < num_runs; ++k) rows.push_back({names[k], summarize(results[k]), wall_s[k]});

  // The proof: the switching runs' greedy tokens are the static runs', request by request.
  int64_t differ = 0;
  for (size_t i = 0; i < trace.size(); ++i) {
    const auto& a = results[0].requests[i].generated;
    for (size_t k = 1; k < num_runs; ++k) {
      if (results[k].requests[i].generated != a) {
        ++differ;
        break;
      }
    }
  }
  print_table(rows, results[0].clock);
  print_switch_steps(rows, results);
  const bool tp_best = rows[0].s.tokens_per_s >= rows[1].s.tokens_per_s;
  const table_row& best = rows[tp_best ? 0 : 1];
  std::printf("\n  best static (%s, by tokens/s) beside switching:\n", best.name.c_str());
  for (size_t k = 2; k < num_runs; ++k) {
    const run_summary& x = rows[k].s;
    std::printf("    %-11s %.3fx tokens/s, p99 TTFT %.1f vs %.1f ms, p99 TPOT %.2f vs %.2f ms, "
                "%lld switches (%.0f ms)\n",
                names[k], best.s.tokens_per_s > 0 ? x.tokens_per_s / best.s.tokens_per_s : 0,
                x.p99_ttft_ms, best.s.p99_ttft_ms, x.p99_tpot_ms, best.s.p99_tpot_ms,
                static_cast<long long>(x.switches), x.switch_total_ms);
  }
  if (!w.on_gpu && cal.has_thresholds) {
    // An upper bound on what any switching could gain on this trace: every step of the best
    // static run in its faster mode (calibrated curves at the step's batch), switches free;
    // against the cheapest switch (weights only, no KV), priced as the clock prices one.
    const run_result& b = results[tp_best ? 0 : 1];
    double total = 0, saved = 0;
    for (const step_record& st : b.steps) {
      total += st.step_ms;
      if (st.sequences <= 0) continue;
      const double n = static_cast<double>(st.sequences);
      const parallel_mode other_mode = st.mode == parallel_mode::tp ? parallel_mode::ep : parallel_mode::tp;
      saved += std::max(0.0, cal.curves.latency_ms(st.mode, n) - cal.curves.latency_ms(other_mode, n));
    }
    moebius::layer_bytes none;
    none.weight_bytes_sent.assign(static_cast<size_t>(P), 0);
    none.kv_bytes_sent.assign(static_cast<size_t>(P), 0);
    const double one = clock.predicted_switch_s(none, w.arena.shape.num_layers) * 1e3;
    std::printf("  bound: every step of %s in its faster mode would save at most %.0f ms of its "
                "%.0f ms of steps (%.1f%%, i.e. <= %.3fx tokens/s); one switch costs >= %.0f ms "
                "(weights alone), a round trip >= %.0f ms (step time only: a mode's larger KV "
                "pool, which admits more at once, is not in it)\n",
                b.name.c_str(), saved, total, total > 0 ? saved / total * 100 : 0,
                total > saved ? total / (total - saved) : 0, one, 2 * one);
  }
  int64_t peak = 0;
  for (const step_record& st : results[0].steps) peak = std::max(peak, st.running + st.waiting);
  peak = std::min(peak, o.max_batch);
  if (!w.on_gpu) {
    for (int k = 2; k < 4; ++k) print_gate(results[static_cast<size_t>(k)], &cal.curves, k == 2 ? peak : 0);
    if (num_runs == 5 && rows[4].s.switches > 0) {
      std::printf("    no gate: the rules alone switch %lld times (%.0f ms): %.3fx the best static "
                  "tokens/s, p99 TTFT %.1f ms\n",
                  static_cast<long long>(rows[4].s.switches), rows[4].s.switch_total_ms,
                  best.s.tokens_per_s > 0 ? rows[4].s.tokens_per_s / best.s.tokens_per_s : 0,
                  rows[4].s.p99_ttft_ms);
    }
    for (int k = 2; k < 4; ++k) {
      out.targets.push_back(check_targets(kind, best.s, rows[static_cast<size_t>(k)].s, names[k]));
      std::printf("  %s\n", out.targets.back().line.c_str());
    }
  }
  std::printf("  greedy tokens: %s (%zu requests)\n",
              differ == 0 ? (num_runs == 5 ? "identical in all five runs" : "identical in all four runs")
                          : "DIFFER",
              trace.size());
  const bool exact = !w.on_gpu || P == 1;
  out.tokens_identical = differ == 0 || !exact;

  std::string dir = o.out_dir + "/" + (kind == demo::trace_kind::file ? "file" : demo::to_string(kind));
  std::filesystem::create_directories(dir);
  const std::string csv_path = dir + "/steps.csv", svg_path = dir + "/timeline.svg";
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
  std::vector<const run_result*> panels;
  for (const run_result& r : results) panels.push_back(&r);
  demo::write_timeline_svg(svg, panels);
  if (!svg) throw std::runtime_error("cannot write " + svg_path);
  std::printf("  wrote %s and %s\n", csv_path.c_str(), svg_path.c_str());
  return out;
}

// The priced model of the H200 clock.
priced_model priced_of(const demo::options& o, int64_t run_kv_heads) {
  priced_model m;
  if (o.priced == demo::priced_kind::qwen3_235b_a22b) {
    m = qwen3_235b_a22b_priced();
  } else {
    m.num_kv_heads = run_kv_heads;  // the run's KV heads (H_kv < P: TP replicates)
  }
  m.context_scale = o.context_scale;
  return m;
}

// EP KV pages per rank an H200 holds for the priced model: 90% of its 141 GB (the rest:
// activations, CUDA graphs, fragmentation) less the rank's EP weights (its 1/P of the experts,
// one spare expert slot, the whole attention and embeddings: Qwen3-235B-A22B at P=8, 73 GB,
// DESIGN.md §7), divided by the priced EP KV bytes of one run token (all L layers, K and V, all
// H_kv heads, times the context scale) and the page size.
//   Qwen3-235B-A22B, P=8, context x32, 16-token pages: (126.9 - 73.2) GB / (192.5 KB x 32 x 16)
//   = 544 pages per rank.
int64_t h200_kv_pages(const priced_model& m, int P, int64_t page_size, std::string* why) {
  const double wb = static_cast<double>(m.weight_bytes);
  const double L = static_cast<double>(m.num_layers), H = static_cast<double>(m.hidden);
  const double expert = 3.0 * H * static_cast<double>(m.intermediate) * wb;
  const double experts = L * (static_cast<double>(m.num_experts) / P + 1.0) * expert;
  const double attention = L * (2.0 * static_cast<double>(m.num_q_heads * m.head_dim) * H +
                                2.0 * static_cast<double>(m.num_kv_heads * m.head_dim) * H) * wb;
  const double embed = 2.0 * static_cast<double>(m.vocab) * H * wb;
  const double weights = experts + attention + embed;
  const double budget = 0.9 * 141e9 - weights;
  const double token = L * 2.0 * static_cast<double>(m.num_kv_heads * m.head_dim * m.kv_bytes) *
                       m.context_scale;
  const int64_t pages = std::max<int64_t>(
      16, static_cast<int64_t>(budget / (token * static_cast<double>(page_size))));
  char buf[320];
  std::snprintf(buf, sizeof buf,
                "%lld EP pages per rank: (0.9 x 141 GB - %.1f GB of weights per rank) / (%.1f KB "
                "of priced KV per run token x %lld tokens a page)",
                static_cast<long long>(pages), weights / 1e9, token / 1e3,
                static_cast<long long>(page_size));
  *why = buf;
  return pages;
}

int run_demo(demo::options o) {
  const auto t_start = wall::now();
  if (!o.write_trace.empty()) {
    if (o.traces.front() == demo::trace_kind::steady)
      throw demo::usage_error("--write-trace: the steady trace's rate comes from a calibration");
    const std::vector<request> t = make_trace(o, o.traces.front(), 1024, 0);
    std::ofstream f(o.write_trace);
    write_trace_jsonl(f, t);
    if (!f) throw std::runtime_error("cannot write " + o.write_trace);
    std::printf("wrote %zu requests to %s\n", t.size(), o.write_trace.c_str());
    return 0;
  }
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
  if (use_gpu && !o.traces_given) {
    // The steady and production traces are sized for the priced clock (tens of thousands of
    // requests at the crossover of Qwen3-235B-A22B); the GPU runtime's small model serves the
    // two that show its switches: bursty and rollout (--trace steady|production to add them).
    o.traces = {demo::trace_kind::bursty, demo::trace_kind::rollout};
    std::printf("on the GPU runtime the demo serves the bursty and rollout traces (--trace to "
                "choose)\n");
  }
  std::string kv_why = std::to_string(o.kv_pages) + " EP pages a rank (--kv-pages)";
  if (o.kv_pages == 0) {
    // The run's KV heads only matter for the Qwen3-30B-A3B pricing; lite(): 4.
    if (use_gpu) {
      o.kv_pages = 2048;
      kv_why = "2048 EP pages a rank (the GPU runtime's default; --kv-pages to change)";
    } else {
      o.kv_pages = h200_kv_pages(priced_of(o, 4), P, 16, &kv_why);
    }
  }
  std::unique_ptr<hf_checkpoint> checkpoint;
  if (!o.model_dir.empty()) {
#if MINI_ENGINE_DEMO_HOST_RUNTIME
    checkpoint = std::make_unique<hf_checkpoint>(o.model_dir);  // checked before any load
    std::printf("  checkpoint: %s, %lld shard(s), %.3f GB of tensors, %s\n", o.model_dir.c_str(),
                static_cast<long long>(checkpoint->num_shards()),
                static_cast<double>(checkpoint->bytes()) / 1e9,
                checkpoint->config().tie_word_embeddings ? "tied embeddings" : "own LM head");
#else
    throw demo::usage_error("--model " + o.model_dir + ": this build has no host runtime");
#endif
  }
  const host_plan plan = plan_host(o, checkpoint.get());
  if (!use_gpu) check_memory(plan, 2 * o.ranks);

#if MINI_ENGINE_DEMO_GPU && MINI_ENGINE_DEMO_HOST_RUNTIME
  std::vector<request> longest;
  for (const demo::trace_kind k : o.traces) {
    if (k == demo::trace_kind::steady) continue;
    std::vector<request> t = make_trace(o, k, plan.vocab, 0);
    longest.insert(longest.end(), t.begin(), t.end());
  }
  world w = use_gpu ? make_gpu_world(o, P, longest, checkpoint.get())
                    : make_world(o, plan, checkpoint.get(), true);
#else
  world w = make_world(o, plan, checkpoint.get(), true);
#endif
  std::printf("  runtime: %s\n", w.description.c_str());
  std::printf("  KV pool: %s\n", kv_why.c_str());
  // A second host runtime serves two of the four runs beside the first (two cores).
  std::vector<world> extra;
  if (!w.on_gpu) extra.push_back(make_world(o, plan, checkpoint.get(), false));

  bool ok = true;
  if (o.reshard_stage) {
    std::printf("\nstage 1: verified reshard of the model's experts\n");
    ok = verified_reshard(w);
  }

  // The clock.
  std::unique_ptr<h200_step_model> model_clock;  // under a curves clock: outlives it
  std::unique_ptr<step_clock> clock;
  const bool use_model = o.clock == demo::clock_kind::model ||
                         (o.clock == demo::clock_kind::automatic && !w.on_gpu);
  if (use_model) {
    const priced_model m = priced_of(o, w.kv.num_kv_heads);
    model_clock = std::make_unique<h200_step_model>(m, h200_params{}, P, kv_bytes_per_token(w.kv));
    std::ostringstream d;
    d << m;
    std::ostringstream link;
    link << h200_params{}.switch_link;
    std::printf("\n  clock: modelled H200 x%d (step_clock.hpp's roofline at DESIGN.md §6-7 rates), "
                "each step priced as %s (%s), switches by moebius::cost_model over the link fitted "
                "on 18 switches measured on 2x H200 (%s), steps beside a progressive switch's "
                "copies by the slowdown curve measured on one H200; the host's own time is in the "
                "CSV (measured_ms)\n",
                P, demo::to_string(o.priced), d.str().c_str(), link.str().c_str());
    // The priced deployment's name in bench_mini_engine_rank_share's files.
    const std::string bench_model =
        o.priced == demo::priced_kind::qwen3_235b_a22b ? "qwen3_235b" : "qwen3_30b";
    std::optional<step_curves> curves;
    if (o.curves.empty()) curves = step_curves::measured(bench_model, P);
    else if (o.curves != "roofline") curves = step_curves::from_file(o.curves);
    if (curves) {
      const std::string& from = o.curves.empty() ? curves->deployment() : o.curves;
      MOEBIUS_CHECK(curves->num_ranks() == P, moebius::errc::invalid_argument, "--curves ",
                    from, ": measured for P=", curves->num_ranks(), ", the demo runs P=", P);
      MOEBIUS_CHECK(curves->num_layers() == m.num_layers, moebius::errc::invalid_argument,
                    "--curves ", from, ": measured with ", curves->num_layers(),
                    " layers, the clock prices ", demo::to_string(o.priced), " (", m.num_layers,
                    " layers): curves of another model, or of a shortened one");
      std::printf("  decode steps instead from %s: per-rank compute measured on one GPU, "
                  "collectives priced by a link model (bench_mini_engine_rank_share)\n",
                  curves->deployment().c_str());
      clock = std::make_unique<curves_step_clock>(std::move(*curves), *model_clock);
    } else {
      if (o.curves.empty())
        std::printf("  decode steps from the roofline: no measured step curves of %s at P=%d "
                    "under docs/results (step_curves_*.jsonl, bench_mini_engine_rank_share)\n",
                    bench_model.c_str(), P);
      clock = std::move(model_clock);
    }
  } else {
    // --clock measured with --curves is a usage error (options.cpp); here the automatic clock
    // measured because a GPU is there.
    MOEBIUS_CHECK(o.curves.empty(), moebius::errc::invalid_argument, "--curves ", o.curves,
                  ": step curves price the modelled clock, and this run measures its steps on "
                  "the GPU (--clock model uses them)");
    clock = std::make_unique<measured_clock>();
    if (w.on_gpu)
      std::printf("\n  clock: measured on the GPUs (each step's CUDA events, the longest rank; "
                  "switches and copies: their measured time)\n");
    else
      std::printf("\n  clock: measured (on the host all ranks run on one core: no GPU crossover)\n");
  }

  const std::unique_ptr<moebius::transport> transport = w.make_transport();
  engine e(*w.rt, *transport, w.arena, w.kv, *clock, moebius::arena_cursor{0});

  std::mutex print_mutex;
  auto last_print = wall::now();
  auto set_progress = [&](engine_options& base) {
    base.progress_every_steps = 1;
    base.on_progress = [&](const progress_info& p) {
      std::lock_guard<std::mutex> lock(print_mutex);
      if (seconds_since(last_print) < 5.0) return;
      last_print = wall::now();
      std::printf("    [%s] step %6lld  t=%7.3f s  running %4lld  done %5lld/%lld  %s  switches %lld\n",
                  p.run->c_str(), static_cast<long long>(p.step), p.now_s,
                  static_cast<long long>(p.running), static_cast<long long>(p.finished),
                  static_cast<long long>(p.total), moebius::to_string(p.mode),
                  static_cast<long long>(p.switches));
      std::fflush(stdout);
    };
  };

  // The engines the runs share out, one per runtime, for every trace (an engine owns its
  // runtime's arena cursor and tables from its construction on).
  std::vector<std::unique_ptr<moebius::transport>> transports;
  std::vector<std::unique_ptr<engine>> engines;
  for (world& x : extra) {
    transports.push_back(x.make_transport());
    engines.push_back(std::make_unique<engine>(*x.rt, *transports.back(), x.arena, x.kv, *clock,
                                               moebius::arena_cursor{0}));
  }
  std::vector<engine*> pool{&e};
  for (auto& x : engines) pool.push_back(x.get());

  std::vector<trace_outcome> outcomes;
  for (const demo::trace_kind k : o.traces) {
    outcomes.push_back(serve_trace(o, k, w, e, pool, *clock, P, set_progress));
    ok = ok && outcomes.back().tokens_identical;
  }

  if (use_model)
    std::printf("\nsummary (modelled H200 clock, %s, P=%d):\n", demo::to_string(o.priced), P);
  else
    std::printf("\nsummary (measured clock, P=%d):\n", P);
  int64_t missed = 0;
  for (const trace_outcome& t : outcomes) {
    for (const target_check& c : t.targets) {
      std::printf("  %-10s %s\n", t.name.c_str(), c.line.c_str());
      missed += !c.met;
    }
  }
  if (missed > 0) {
    std::printf("  %lld target%s missed on this clock. Each trace's 'bound' line says why in "
                "numbers: even switching for free, every step in its faster mode, would gain at "
                "most that share on this priced model, less than the target asks; the gate "
                "keeps switching off where it cannot pay (docs/BENCHMARKS.md)\n",
                static_cast<long long>(missed), missed == 1 ? "" : "s");
  }
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
