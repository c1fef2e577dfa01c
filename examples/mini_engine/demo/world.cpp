#include "world.hpp"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <moebius/config.hpp>
#include <moebius/error.hpp>
#include <moebius/transport/dry_run_transport.hpp>
#include <moebius/transport/host_transport.hpp>
#include <sstream>
#include <stdexcept>
#if MOEBIUS_WITH_CUDA
#include <cuda_runtime_api.h>
#endif
#if MINI_ENGINE_DEMO_GPU
#include <moebius/transport/cuda_peer_transport.hpp>

#include "gpu_runtime.hpp"
#endif

#include "host_runtime.hpp"
#include "model_config.hpp"
#include "sim_deployment.hpp"
#include "sim_runtime.hpp"
#include "weights.hpp"

#ifndef MINI_ENGINE_DEMO_GPU  // defined by CMake when the GPU runtime is built
#define MINI_ENGINE_DEMO_GPU 0
#endif

namespace mini_engine::demo {

namespace {

using wall = std::chrono::steady_clock;

double seconds_since(wall::time_point t0) {
  return std::chrono::duration<double>(wall::now() - t0).count();
}

// The model served: lite() (random weights), or the checkpoint's as config.json describes it
// (experts in its dtype, fp32 KV, pages of 16 tokens).
model_config served_model(const hf_checkpoint* ck) {
  if (!ck) return lite();
  model_config m = ck->config().model;
  m.page_size = 16;
  m.kv_dtype = moebius::dtype::fp32;
  return m;
}

// Physical memory of this machine (0 when unknown).
int64_t physical_bytes() {
  const long pages = sysconf(_SC_PHYS_PAGES), size = sysconf(_SC_PAGE_SIZE);
  return pages > 0 && size > 0 ? static_cast<int64_t>(pages) * size : 0;
}

}  // namespace

void prepare_process() {
#if MINI_ENGINE_DEMO_GPU
  moebius::request_hardware_queues_for_virtual_ranks();
#endif
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

bool has_gpu_runtime() {
  return MINI_ENGINE_DEMO_GPU != 0;
}

host_plan plan_host(const options& o, const hf_checkpoint* ck) {
  host_plan p;
  try {
    const model_config c = served_model(ck);
    validate(c, o.ranks);
    p.arena = moebius::make_arena_geometry(expert_shape_of(c), o.ranks, 256, 4096);
    p.kv = kv_geometry_of(c, o.ranks, o.kv_pages);
    p.vocab = static_cast<int32_t>(c.vocab);
    // Embedding, LM head and attention per layer, in fp32, replicated once (host runtime).
    p.weight_bytes = 4 * (2 * c.vocab * c.hidden +
                          c.num_layers * (2 * c.q_dim() * c.hidden + 2 * c.kv_dim() * c.hidden +
                                          c.num_experts * 3 * c.hidden * c.intermediate));
  } catch (const moebius::error& e) {
    throw usage_error("--ranks " + std::to_string(o.ranks) + " / --kv-pages " +
                      std::to_string(o.kv_pages) + ": " + e.what());
  }
  return p;
}

void check_memory(const host_plan& p, int P) {
  const double need =
      static_cast<double>(P) * static_cast<double>(p.arena.total_bytes() + p.kv.pool_bytes()) +
      static_cast<double>(p.weight_bytes);
  const int64_t have = physical_bytes();
  const double limit = have > 0 ? 0.5 * static_cast<double>(have) : 64.0 * (1 << 30);
  if (need > limit) {
    char buf[256];
    std::snprintf(
        buf, sizeof buf,
        "the host runtime would need %.2f GiB (P=%d ranks x (arena %.1f MiB + KV pool "
        "%.1f MiB)), more than half of this machine's %.2f GiB: lower --kv-pages or --ranks",
        need / 1073741824.0, P, static_cast<double>(p.arena.total_bytes()) / 1048576.0,
        static_cast<double>(p.kv.pool_bytes()) / 1048576.0,
        static_cast<double>(have) / 1073741824.0);
    throw usage_error(std::string("--kv-pages ") + buf);
  }
}

world make_host_world(const options& o, const host_plan& p, const hf_checkpoint* ck,
                      bool progress) {
  world w;
  w.arena = p.arena;
  w.kv = p.kv;
  w.vocab = p.vocab;
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
  w.kv_layout = rt->kv_layout();
  std::ostringstream d;
  if (ck)
    d << "host runtime, checkpoint " << ck->source() << " (" << c << "), " << o.ranks
      << " virtual ranks";
  else
    d << "host runtime, lite model (" << c << "), " << o.ranks << " virtual ranks";
  w.description = d.str();
  w.name = "host runtime, " + (ck ? "checkpoint " + ck->source() : std::string("lite model")) +
           ", " + std::to_string(o.ranks) + " virtual ranks";
  w.rt = std::move(rt);
  w.make_transport = [mem = w.memory] { return std::make_unique<moebius::host_transport>(mem); };
  return w;
}

#if MINI_ENGINE_DEMO_GPU
namespace {

// The GPU runtime's options: P ranks (more than the GPUs: virtual ranks, placement automatic),
// page tables as long as the longest request of `traces`, graphs per mode and bucket up to the
// step's token budget.
gpu::gpu_runtime_options gpu_options(const options& o, int P, const model_config& c,
                                     const std::vector<request>& traces, bool bf16) {
  int64_t longest = 1;
  for (const request& r : traces)
    longest = std::max(longest, static_cast<int64_t>(r.prompt.size()) + r.output_tokens);
  gpu::gpu_runtime_options go = gpu::options_from_env();
  go.num_ranks = P;
  go.num_ep_pages = o.kv_pages;
  go.max_pages_per_seq = (longest + c.page_size - 1) / c.page_size + 1;
  go.max_tokens = std::max(o.step_tokens, o.max_batch);
  go.buckets.clear();
  for (int64_t b = 1; b < go.max_tokens; b *= 2) go.buckets.push_back(b);
  go.buckets.push_back(go.max_tokens);
  go.dense_dtype = bf16 ? moebius::dtype::bf16 : moebius::dtype::fp32;
  go.cursor = moebius::arena_cursor{0};
  go.tensor_alignment = 256;
  go.slot_alignment = 4096;
  return go;
}

std::string gpu_description(const gpu::gpu_runtime& rt, const gpu::gpu_runtime_options& go,
                            const model_config& c, int P, const hf_checkpoint* ck) {
  std::ostringstream d;
  d << "GPU runtime, " << (ck ? "checkpoint " + ck->source() : std::string("small model")) << " ("
    << c << ", dense " << moebius::to_string(go.dense_dtype) << "), " << P
    << (rt.virtual_ranks() ? " virtual" : " GPU") << " rank" << (P > 1 ? "s" : "")
    << (rt.virtual_ranks()
            ? " on one GPU (each its own arena, KV pool, buffers and stream; collectives and "
              "switch copies over that GPU's memory: they emulate the contention for HBM and "
              "SMs each of P GPUs would see, not NVLink)"
            : "")
    << ", CUDA graphs captured once: " << rt.graph_statistics().whole_model
    << " whole-model (2 modes x " << go.buckets.size() << " buckets up to " << go.max_tokens
    << " tokens) and " << rt.graph_statistics().per_layer
    << " per-layer ones for the hybrid steps of progressive switches";
  return d.str();
}

}  // namespace

// The small() model with the host demo's weights (same seed) on P GPUs, fp32 throughout (so
// TP and EP compute the same sums on one GPU); a checkpoint: its model, dense weights and KV in
// bf16 when it is bf16.
world make_gpu_world(const options& o, int P, const std::vector<request>& traces,
                     const hf_checkpoint* ck) {
  model_config c = small();
  const bool bf16_ck = ck && ck->config().dtype == moebius::dtype::bf16;
  if (ck) {
    c = served_model(ck);
    c.kv_dtype = bf16_ck ? moebius::dtype::bf16 : moebius::dtype::fp32;
  }
  validate(c, P);
  const gpu::gpu_runtime_options go = gpu_options(o, P, c, traces, bf16_ck);
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
  w.kv_layout = rt->kv_layout();
  w.vocab = static_cast<int32_t>(c.vocab);
  w.description = gpu_description(*rt, go, c, P, ck);
  w.name = "GPU runtime, " + (ck ? "checkpoint " + ck->source() : std::string("small model")) +
           ", " + std::to_string(P) +
           (rt->virtual_ranks() ? " virtual ranks on one GPU" : P > 1 ? " GPU ranks" : " GPU rank");
  w.rt = std::move(rt);
  w.make_transport = [mem = w.memory] {
    return std::make_unique<moebius::cuda_peer_transport>(
        moebius::cuda_peer_transport::single_process(mem));
  };
  return w;
}
#else
world make_gpu_world(const options&, int, const std::vector<request>&, const hf_checkpoint*) {
  throw usage_error("--runtime gpu: this build has no GPU runtime (it needs CUDA and NCCL)");
}
#endif

deployment sim_deployment_of(deployment_kind k) {
  return make_deployment(qwen3_235b_a22b(), k);
}

world make_sim_world(deployment_kind k) {
  const sim_geometry g = make_sim_geometry(sim_deployment_of(k));
  world w;
  w.arena = g.arena;
  w.kv = g.kv;
  w.vocab = 1024;
  auto rt = std::make_unique<sim_runtime>(g.arena, g.kv, w.vocab);
  std::ostringstream d;
  d << "simulated runtime, " << g;
  w.description = d.str();
  w.name = std::string("simulated runtime, ") + to_string(k) + " deployment";
  w.make_transport = [ranks = static_cast<int>(g.kv.num_ranks), spaces = rt->spaces()] {
    return std::make_unique<moebius::dry_run_transport>(ranks, spaces);
  };
  w.rt = std::move(rt);
  return w;
}

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

}  // namespace mini_engine::demo
