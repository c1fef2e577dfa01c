#pragma once

// The world the demo serves in: the runtime (the host runtime's P virtual ranks, the GPU
// runtime, or the simulated runtime's deployment of the paper's model), its memory, its
// descriptors and the transport its switches move bytes over. Every build axis of the demo (a
// CUDA build, a build with the GPU runtime) is decided in world.cpp and nowhere else: the
// experiments and the report see a world, never a preprocessor branch.

#include <functional>
#include <memory>
#include <optional>
#include <moebius/kv/kv_geometry.hpp>
#include <moebius/kv/kv_pool_layout.hpp>
#include <moebius/layout/arena_geometry.hpp>
#include <moebius/memory/rank_memory.hpp>
#include <moebius/transport/transport.hpp>
#include <string>
#include <vector>

#include "checkpoint.hpp"
#include "deployment.hpp"
#include "options.hpp"
#include "step.hpp"
#include "trace.hpp"

namespace mini_engine::demo {

struct world {
  std::unique_ptr<runtime> rt;
  std::vector<moebius::rank_memory> memory;
  moebius::arena_geometry arena;
  moebius::kv_geometry kv;
  // How the runtime's pool lies: every switch honours it (empty: the present layout, the
  // simulated runtime's, which holds no bytes).
  std::optional<moebius::kv_pool_layout> kv_layout;
  int32_t vocab = 0;
  std::string name;         // "host runtime, lite model, 8 virtual ranks"
  std::string description;  // the same with the model's and the runtime's details
  bool on_gpu = false;
  std::function<std::unique_ptr<moebius::transport>()> make_transport;
};

// Geometry of the host deployment, computed without allocating; a model that cannot split
// over P ranks, or sizes that overflow, are usage errors.
struct host_plan {
  moebius::arena_geometry arena;
  moebius::kv_geometry kv;
  int32_t vocab = 0;
  int64_t weight_bytes = 0;  // logical weights held beside the arena
};

// Before the first CUDA call: a hardware queue per virtual rank's stream (the transport's
// barriers spin; cuda_peer_transport.hpp). Nothing in a build without the GPU runtime.
void prepare_process();

// GPUs this process sees (0 without CUDA).
int count_gpus();

// Whether this build has the GPU runtime (CUDA and NCCL).
bool has_gpu_runtime();

// The host deployment `o` asks for, served as `ck` describes it (null: the lite() model).
host_plan plan_host(const options& o, const hf_checkpoint* ck);

// Throws usage_error when P host runtimes of `p` would need more than half this machine's
// memory.
void check_memory(const host_plan& p, int P);

// The host runtime on P = o.ranks virtual ranks: `ck`'s weights streamed from its shards
// (`progress`: a line per shard), else lite() with random weights from o.seed.
world make_host_world(const options& o, const host_plan& p, const hf_checkpoint* ck, bool progress);

// The GPU runtime on P ranks (more than the GPUs: virtual ranks on GPU 0), its page tables as
// long as the longest request of `traces`. Throws usage_error in a build without it.
world make_gpu_world(const options& o, int P, const std::vector<request>& traces,
                     const hf_checkpoint* ck);

// Deployment `k` of Qwen3-235B-A22B on 8 H200s at 0.85 (serving/deployment.hpp).
deployment sim_deployment_of(deployment_kind k);

// The simulated runtime serving sim_deployment_of(k) (serving/sim_deployment.hpp: nothing
// allocated, a dry-run transport; vocabulary 1024).
world make_sim_world(deployment_kind k);

// Each rank's arena as host bytes (device memory is copied back first).
std::vector<std::vector<std::byte>> arena_bytes(const world& w);

}  // namespace mini_engine::demo
