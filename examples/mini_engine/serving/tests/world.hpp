#pragma once

// The runtime the serving tests run on, behind `runtime&`. With the model's
// host_runtime in the build (examples/mini_engine/host_runtime.hpp) the tests use it, on the
// tiny() model; otherwise the token-hash fake_runtime with the same KV shape. To force the
// fake, define MINI_ENGINE_SERVING_FAKE_RUNTIME (the one line to change).

#include <cstdint>
#include <memory>
#include <vector>

#include <moebius/kv/kv_geometry.hpp>
#include <moebius/layout/arena_geometry.hpp>
#include <moebius/transport/host_transport.hpp>

#include "fake_runtime.hpp"

#if __has_include("host_runtime.hpp") && !defined(MINI_ENGINE_SERVING_FAKE_RUNTIME)
#define MINI_ENGINE_SERVING_REAL_RUNTIME 1
#include "host_runtime.hpp"
#include "model_config.hpp"
#include "weights.hpp"
#else
#define MINI_ENGINE_SERVING_REAL_RUNTIME 0
#endif

namespace mini_engine::testing {

struct world {
  std::unique_ptr<runtime> rt;
  std::unique_ptr<moebius::host_transport> transport;
  moebius::arena_geometry arena;
  moebius::kv_geometry kv;
  int32_t vocab = 0;
  const char* name = "";
};

// P ranks, `ep_pages` KV pages per rank, weights from `seed`; the arena rests in EP; the TP
// view at KV-parallel degree `dcp` (tiny() has 2 KV heads: dcp 2 at P = 4).
inline world make_world(int P, int64_t ep_pages, uint64_t seed, int64_t dcp = 1) {
  world w;
#if MINI_ENGINE_SERVING_REAL_RUNTIME
  const model_config c = tiny();
  host_runtime_options o;
  o.num_ranks = P;
  o.num_ep_pages = ep_pages;
  o.dcp = dcp;
  auto rt = std::make_unique<host_runtime>(make_weights(c, seed), o);
  w.arena = rt->arena();
  w.kv = rt->kv();
  w.transport = std::make_unique<moebius::host_transport>(rt->memory());
  w.vocab = static_cast<int32_t>(c.vocab);
  w.name = "host_runtime(tiny)";
  w.rt = std::move(rt);
#else
  (void)seed;
  moebius::expert_shape shape;  // tiny(): L=2, E=8, H=64, I=32, fp32; KV 2 heads of 16, page 4
  shape.num_layers = 2;
  shape.num_experts = 8;
  shape.hidden = 64;
  shape.intermediate = 32;
  shape.weight_dtype = moebius::dtype::fp32;
  w.arena = moebius::make_arena_geometry(shape, P, 256, 4096);
  w.kv = moebius::with_dcp(moebius::make_kv_geometry(2, 2, 16, 4, ep_pages, P, moebius::dtype::fp32),
                           dcp);
  w.vocab = 256;
  auto rt = std::make_unique<fake_runtime>(w.arena, w.kv, w.vocab);
  w.transport = std::make_unique<moebius::host_transport>(rt->memory());
  w.name = "fake_runtime";
  w.rt = std::move(rt);
#endif
  return w;
}

}  // namespace mini_engine::testing
