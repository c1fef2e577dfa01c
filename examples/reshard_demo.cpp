// moebius_demo: live EP <-> TP switching of a Qwen3-style MoE layer stack, in two stages.
//
// Stage 1, a verified reshard: loads the experts as a static EP deployment would, switches the
// stack EP -> TP -> EP (and through a half-done switch) in the offset-aliased arena, and after
// each switch compares every byte of every rank with what a static load of the new layout
// holds (an independent, naive loader). Prints bytes sent per rank and the time of each stage.
// Stage 2, serving (serving_stage.hpp): requests come and go, the policy decides, the
// switcher moves experts and in-flight KV, checksums prove nothing was lost.
//
// Uses the GPUs when present: one rank per GPU with >= 2 GPUs, else P virtual ranks on one
// GPU (cuda_peer_transport); host memory and host_transport otherwise, or with --host.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "moebius/config.hpp"
#include "moebius/error.hpp"
#include "moebius/layout/arena_geometry.hpp"
#include "moebius/plan/weight_plan.hpp"
#include "demo_backend.hpp"
#include "moebius/kv/kv_geometry.hpp"
#include "serving_stage.hpp"
#if MOEBIUS_WITH_CUDA
#include "moebius/transport/cuda_peer_transport.hpp"
#endif
#include "support/reference.hpp"

namespace {

using namespace moebius;
using clock_type = std::chrono::steady_clock;

struct options {
  int ranks = 0;  // 0: GPUs if >= 2, else 4
  expert_shape shape;
  bool force_host = false;
  demo::serving_options serving;
};

void usage() {
  std::puts(
      "usage: moebius_demo [--ranks P] [--layers L] [--experts E] [--hidden H]\n"
      "                    [--intermediate I] [--fp8] [--host] [--steps N]\n"
      "  Defaults: Qwen3-235B-A22B proportions (E=128, top-8) scaled to H=512, I=192, L=4;\n"
      "  --fp8 stores fp8_e4m3 weights with 128x128 block scales (I/P must be whole blocks);\n"
      "  --host forces host memory even when GPUs are present; --steps sets the length of the\n"
      "  serving stage (0 skips it).");
}

options parse(int argc, char** argv) {
  options o;
  o.shape = qwen3_235b_a22b();
  o.shape.num_layers = 4;
  o.shape.hidden = 512;
  o.shape.intermediate = 192;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> int64_t {
      MOEBIUS_CHECK(i + 1 < argc, errc::invalid_argument, a, " needs a value");
      return std::strtoll(argv[++i], nullptr, 10);
    };
    if (a == "--ranks") o.ranks = static_cast<int>(value());
    else if (a == "--layers") o.shape.num_layers = value();
    else if (a == "--experts") o.shape.num_experts = value();
    else if (a == "--hidden") o.shape.hidden = value();
    else if (a == "--intermediate") o.shape.intermediate = value();
    else if (a == "--fp8") {
      o.shape.weight_dtype = dtype::fp8_e4m3;
      o.shape.block_scales = true;
    } else if (a == "--host") o.force_host = true;
    else if (a == "--steps") o.serving.steps = value();
    else if (a == "--help" || a == "-h") {
      usage();
      std::exit(0);
    } else {
      usage();
      MOEBIUS_FAIL(errc::invalid_argument, "unknown option ", a);
    }
  }
  return o;
}

double ms_since(clock_type::time_point t0) {
  return std::chrono::duration<double, std::milli>(clock_type::now() - t0).count();
}

std::string human_bytes(int64_t b) {
  char buf[32];
  if (b >= (int64_t{1} << 30)) std::snprintf(buf, sizeof buf, "%.2f GiB", static_cast<double>(b) / 1073741824.0);
  else std::snprintf(buf, sizeof buf, "%.1f MiB", static_cast<double>(b) / 1048576.0);
  return buf;
}

// Runs one switch and verifies it; returns false on a mismatch.
bool switch_and_verify(demo::backend& backend, const testing::logical_weights& weights,
                       const arena_geometry& g, arena_cursor from, arena_cursor to,
                       demo::rank_mirror& mirror) {
  testing::rank_images& images = mirror.arenas;
  const char* direction = to.tp_layers > from.tp_layers ? "EP->TP" : "TP->EP";
  auto t0 = clock_type::now();
  const plan p = plan_weight_switch(g, from, to);
  const double plan_ms = ms_since(t0);
  const plan_traffic traffic = traffic_of(p);

  backend.upload(mirror);
  t0 = clock_type::now();
  backend.get().execute(p);
  const double run_ms = ms_since(t0);
  backend.download(mirror);

  t0 = clock_type::now();
  const std::string mismatch = testing::compare_to_reference(weights, g, to, images);
  const double verify_ms = ms_since(t0);

  const int64_t sent = traffic.max_bytes_sent();
  std::printf("  %s  plan %7.2f ms (%zu phases, %lld ops)   move %8.2f ms, %s leaving each rank "
              "(%.1f GB/s)   verify %s (%.0f ms)\n",
              direction, plan_ms, p.phases.size(), static_cast<long long>(p.num_ops()), run_ms,
              human_bytes(sent).c_str(), static_cast<double>(sent) / (run_ms * 1e6),
              mismatch.empty() ? "ok, every byte" : "FAILED", verify_ms);
  if (!mismatch.empty()) std::printf("  first mismatch: %s\n", mismatch.c_str());
  return mismatch.empty();
}

int run(const options& o) {
  const int gpus = o.force_host ? 0 : demo::count_gpus();
  const int P = o.ranks > 0 ? o.ranks : (gpus >= 2 ? gpus : 4);
  const arena_geometry g = make_arena_geometry(o.shape, P);
  std::printf("moebius demo: live EP <-> TP reshard, verified byte for byte\n");
  std::printf("  %s\n", [&] {
    std::ostringstream s;
    s << o.shape;
    return s.str();
  }().c_str());
  std::printf("  P=%d ranks; arena per rank: %lld slots x %s = %s (spare slot + padding: %.2f%% "
              "over a static deployment)\n",
              P, static_cast<long long>(g.num_slots()), human_bytes(g.slot_bytes).c_str(),
              human_bytes(g.total_bytes()).c_str(), g.overhead_fraction() * 100.0);

  // The KV cache of the serving stage: Qwen3's 4 KV heads, narrower, in one pool per rank.
  const kv_geometry kv = make_kv_geometry(o.shape.num_layers, 4, 32, 16, 640, P);

  std::mt19937_64 rng(0x6d6f6562697573ULL);  // fixed: the demo is reproducible
  auto t0 = clock_type::now();
  const testing::logical_weights weights = testing::random_weights(o.shape, rng);
  demo::rank_mirror mirror;
  const arena_cursor all_ep{0}, all_tp{o.shape.num_layers};
  testing::load_reference(weights, g, all_ep, mirror.arenas);
  mirror.pools.assign(static_cast<size_t>(P), std::vector<std::byte>(static_cast<size_t>(kv.pool_bytes())));
  for (auto& pool : mirror.pools) {
    for (std::byte& b : pool) b = static_cast<std::byte>(rng());
  }
  std::printf("  loaded a static EP deployment in %.0f ms\n", ms_since(t0));

  const std::unique_ptr<demo::backend> backend = demo::make_backend(mirror, gpus);
  std::printf("  backend: %s\n\nstage 1: verified reshard\n", backend->name());

  bool ok = switch_and_verify(*backend, weights, g, all_ep, all_tp, mirror);
  ok = ok && switch_and_verify(*backend, weights, g, all_tp, all_ep, mirror);
  // A half-done switch is a valid resting state: go halfway, then finish from the cursor.
  const arena_cursor half{o.shape.num_layers / 2};
  ok = ok && switch_and_verify(*backend, weights, g, all_ep, half, mirror);
  ok = ok && switch_and_verify(*backend, weights, g, half, all_tp, mirror);
  ok = ok && switch_and_verify(*backend, weights, g, all_tp, all_ep, mirror);
  if (ok && o.serving.steps > 0) {
    backend->upload(mirror);
    ok = demo::run_serving_stage(*backend, mirror, g, kv, o.serving);
  }
  std::printf("%s\n", ok ? "demo: ok" : "demo: FAILED");
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
#if MOEBIUS_WITH_CUDA
  // With one GPU the demo runs its ranks as virtual ranks on it.
  moebius::request_hardware_queues_for_virtual_ranks();
#endif
  try {
    return run(parse(argc, argv));
  } catch (const moebius::error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 2;
  }
}
