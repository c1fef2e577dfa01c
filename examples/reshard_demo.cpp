// moebius_demo: a verified live reshard of a Qwen3-style MoE layer stack.
//
// Loads the experts as a static EP deployment would, switches the whole stack EP -> TP and
// back TP -> EP through the offset-aliased arena, and after each switch compares every byte of
// every rank with what a static load of the new layout holds (an independent, naive loader).
// Prints the bytes each rank sent and the time of each stage.
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
#include "moebius/transport/host_transport.hpp"
#include "support/reference.hpp"

#if MOEBIUS_WITH_CUDA
#include <cuda_runtime_api.h>

#include "moebius/cuda/check.hpp"
#include "moebius/transport/cuda_peer_transport.hpp"
#endif

namespace {

using namespace moebius;
using clock_type = std::chrono::steady_clock;

struct options {
  int ranks = 0;  // 0: GPUs if >= 2, else 4
  expert_shape shape;
  bool force_host = false;
};

void usage() {
  std::puts(
      "usage: moebius_demo [--ranks P] [--layers L] [--experts E] [--hidden H]\n"
      "                    [--intermediate I] [--fp8] [--host]\n"
      "  Defaults: Qwen3-235B-A22B proportions (E=128, top-8) scaled to H=512, I=192, L=4;\n"
      "  --fp8 stores fp8_e4m3 weights with 128x128 block scales (I/P must be whole blocks);\n"
      "  --host forces host memory even when GPUs are present.");
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

// Where the ranks' arenas live and how plans run on them.
class demo_backend {
 public:
  virtual ~demo_backend() = default;
  virtual const char* name() const = 0;
  virtual transport& get() = 0;
  virtual void upload(const testing::rank_images& images) = 0;
  virtual void download(testing::rank_images& images) = 0;
};

class host_backend final : public demo_backend {
 public:
  explicit host_backend(testing::rank_images& images) : images_(images) {
    std::vector<host_rank_memory> ranks(images.size());
    for (size_t r = 0; r < images.size(); ++r) ranks[r].spaces[0] = images[r];
    transport_ = std::make_unique<host_transport>(std::move(ranks));
  }
  const char* name() const override { return "host memory, host_transport"; }
  transport& get() override { return *transport_; }
  // The host transport works on the images themselves.
  void upload(const testing::rank_images&) override {}
  void download(testing::rank_images&) override {}

 private:
  testing::rank_images& images_;
  std::unique_ptr<host_transport> transport_;
};

#if MOEBIUS_WITH_CUDA
class gpu_backend final : public demo_backend {
 public:
  gpu_backend(int num_ranks, int num_devices, int64_t arena_bytes) : bytes_(arena_bytes) {
    std::vector<cuda_rank_memory> ranks(static_cast<size_t>(num_ranks));
    for (int r = 0; r < num_ranks; ++r) {
      const int device = num_devices >= num_ranks ? r : 0;
      MOEBIUS_CUDA_CHECK(cudaSetDevice(device));
      void* p = nullptr;
      MOEBIUS_CUDA_CHECK(cudaMalloc(&p, static_cast<size_t>(arena_bytes)));
      arenas_.push_back(p);
      ranks[r].device = device;
      ranks[r].base[0] = p;
      ranks[r].bytes[0] = arena_bytes;
    }
    virtual_ranks_ = num_devices < num_ranks;
    transport_ = std::make_unique<cuda_peer_transport>(cuda_peer_transport::single_process(ranks));
  }
  ~gpu_backend() override {
    transport_.reset();
    for (void* p : arenas_) cudaFree(p);
  }
  const char* name() const override {
    return virtual_ranks_ ? "GPU, virtual ranks on one device, cuda_peer_transport"
                          : "GPU, one rank per device, cuda_peer_transport";
  }
  transport& get() override { return *transport_; }
  void upload(const testing::rank_images& images) override {
    for (size_t r = 0; r < arenas_.size(); ++r) {
      MOEBIUS_CUDA_CHECK(cudaMemcpy(arenas_[r], images[r].data(), static_cast<size_t>(bytes_),
                                    cudaMemcpyHostToDevice));
    }
  }
  void download(testing::rank_images& images) override {
    for (size_t r = 0; r < arenas_.size(); ++r) {
      MOEBIUS_CUDA_CHECK(cudaMemcpy(images[r].data(), arenas_[r], static_cast<size_t>(bytes_),
                                    cudaMemcpyDeviceToHost));
    }
  }

 private:
  int64_t bytes_;
  bool virtual_ranks_ = false;
  std::vector<void*> arenas_;
  std::unique_ptr<cuda_peer_transport> transport_;
};
#endif

int count_gpus() {
#if MOEBIUS_WITH_CUDA
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) return 0;
  return n;
#else
  return 0;
#endif
}

// Runs one switch and verifies it; returns false on a mismatch.
bool switch_and_verify(demo_backend& backend, const testing::logical_weights& weights,
                       const arena_geometry& g, arena_cursor from, arena_cursor to,
                       testing::rank_images& images) {
  const char* direction = to.tp_layers > from.tp_layers ? "EP->TP" : "TP->EP";
  auto t0 = clock_type::now();
  const plan p = plan_weight_switch(g, from, to);
  const double plan_ms = ms_since(t0);
  const plan_traffic traffic = traffic_of(p);

  // A first run warms up (descriptor upload, peer mappings); the timed run starts over.
  backend.upload(images);
  t0 = clock_type::now();
  backend.get().execute(p);
  const double run_ms = ms_since(t0);
  backend.download(images);

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
  const int gpus = o.force_host ? 0 : count_gpus();
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

  std::mt19937_64 rng(0x6d6f6562697573ULL);  // fixed: the demo is reproducible
  auto t0 = clock_type::now();
  const testing::logical_weights weights = testing::random_weights(o.shape, rng);
  testing::rank_images images;
  const arena_cursor all_ep{0}, all_tp{o.shape.num_layers};
  testing::load_reference(weights, g, all_ep, images);
  std::printf("  loaded a static EP deployment in %.0f ms\n", ms_since(t0));

  std::unique_ptr<demo_backend> backend;
#if MOEBIUS_WITH_CUDA
  if (gpus > 0) backend = std::make_unique<gpu_backend>(P, gpus, g.total_bytes());
#endif
  if (!backend) backend = std::make_unique<host_backend>(images);
  std::printf("  backend: %s\n", backend->name());

  bool ok = switch_and_verify(*backend, weights, g, all_ep, all_tp, images);
  ok = ok && switch_and_verify(*backend, weights, g, all_tp, all_ep, images);
  // A half-done switch is a valid resting state: go halfway, then finish from the cursor.
  const arena_cursor half{o.shape.num_layers / 2};
  ok = ok && switch_and_verify(*backend, weights, g, all_ep, half, images);
  ok = ok && switch_and_verify(*backend, weights, g, half, all_tp, images);
  std::printf("%s\n", ok ? "demo: ok" : "demo: FAILED");
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(parse(argc, argv));
  } catch (const moebius::error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 2;
  }
}
