// The serving soak (soak.hpp) on the GPU runtime, shorter: P = 2 virtual ranks on device 0
// (collectives over device memory), switches moved by moebius::cuda_peer_transport on the
// runtime's memory, fp32 throughout so that greedy tokens are comparable with the static run.
// The device transport throws errc::injected_fault for every injected fault (the code of a
// fault_point is honoured by the host transport only), so its "timeouts" are exact faults here
// (rolled back); faults whose undo fails still end inconsistent and are recovered, the experts
// reloaded from the host copy. Label gpu; exits 77 without a device.
//
// Rounds: MOEBIUS_SOAK_ROUNDS (default 6), seed MOEBIUS_TEST_SEED (printed) or random.
#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstdlib>
#include <random>
#include <span>
#include <vector>

#include <moebius/cuda/check.hpp>
#include <moebius/error.hpp>
#include <moebius/transport/cuda_peer_transport.hpp>

#include "engine.hpp"
#include "gpu_runtime.hpp"
#include "model_config.hpp"
#include "soak.hpp"
#include "weights.hpp"

using namespace mini_engine;

namespace {

// The experts of `w` where `cursor` puts them, written from host images into every rank's
// device arena (engine_options::reload_experts).
void reload_experts(const gpu::gpu_runtime& rt, const model_weights& w, moebius::arena_cursor cursor) {
  const moebius::arena_geometry& g = rt.arena();
  const std::vector<moebius::rank_memory> mem = rt.memory();
  std::vector<std::vector<std::byte>> images(mem.size(),
                                             std::vector<std::byte>(static_cast<size_t>(g.total_bytes())));
  std::vector<std::span<std::byte>> spans(images.begin(), images.end());
  place_experts(w, g, cursor, spans);
  MOEBIUS_CUDA_CHECK(cudaDeviceSynchronize());
  for (size_t r = 0; r < mem.size(); ++r) {
    MOEBIUS_CUDA_CHECK(cudaSetDevice(mem[r].device));
    MOEBIUS_CUDA_CHECK(cudaMemcpy(mem[r].space(moebius::memory_space::arena).base, images[r].data(),
                                  images[r].size(), cudaMemcpyHostToDevice));
  }
}

}  // namespace

TEST_CASE("soak on the GPU runtime: faults, tight pools and bad requests keep every good "
          "request's tokens",
          "[gpu][soak]") {
  const uint64_t seed = testing::soak_seed();
  std::mt19937_64 rng(seed);
  const char* env = std::getenv("MOEBIUS_SOAK_ROUNDS");
  const int64_t rounds = env != nullptr && *env != '\0' ? std::strtoll(env, nullptr, 10) : 6;
  testing::soak_counts n;
  for (int64_t round = 0; round < rounds; ++round) {
    auto pick = [&](std::initializer_list<int64_t> v) {
      return *(v.begin() + std::uniform_int_distribution<size_t>(0, v.size() - 1)(rng));
    };
    model_config c = tiny();
    c.num_layers = pick({2, 3});
    c.num_kv_heads = pick({1, 2});
    c.page_size = pick({1, 2, 4});
    c.expert_dtype = moebius::dtype::fp32;
    c.kv_dtype = moebius::dtype::fp32;
    const int P = 2;
    const int64_t tokens = std::uniform_int_distribution<int64_t>(24, 64)(rng);
    const int64_t per_step = pick({1, 2});
    INFO("seed " << seed << " round " << round << " L=" << c.num_layers << " H_kv="
                 << c.num_kv_heads << " page " << c.page_size << " tokens/rank " << tokens);
    validate(c, P);
    const model_weights weights = make_weights(c, rng());
    gpu::gpu_runtime_options o = gpu::options_from_env();
    o.num_ranks = P;
    o.placement = gpu::rank_placement::virtual_ranks;
    o.num_ep_pages = (tokens + c.page_size - 1) / c.page_size;
    o.max_pages_per_seq = o.num_ep_pages;
    o.max_tokens = 32;
    o.buckets = {1, 2, 4, 8};
    o.dense_dtype = moebius::dtype::fp32;
    o.fp8_compute_dtype = moebius::dtype::fp32;
    o.slot_alignment = 4096;
    gpu::gpu_runtime rt(weights, o);
    moebius::cuda_peer_transport transport = moebius::cuda_peer_transport::single_process(rt.memory());
    const testing::paced_clock clock(per_step);
    engine e(rt, transport, rt.arena(), rt.kv(), clock, moebius::arena_cursor{0});
    testing::soak_round(
        e, rt.kv(), c.num_layers, static_cast<int32_t>(c.vocab), per_step,
        [&](moebius::arena_cursor at) { reload_experts(rt, weights, at); }, rng, n);
  }
  std::printf("GPU soak: %lld rounds, %lld requests (%lld bad), %lld switches: %lld committed, "
              "%lld rolled back, %lld refused, %lld recovered (%lld sequences lost, %lld "
              "resumed)\n",
              static_cast<long long>(n.rounds), static_cast<long long>(n.requests),
              static_cast<long long>(n.bad_requests), static_cast<long long>(n.switches),
              static_cast<long long>(n.committed), static_cast<long long>(n.rolled_back),
              static_cast<long long>(n.refused), static_cast<long long>(n.recovered),
              static_cast<long long>(n.lost_sequences), static_cast<long long>(n.resumes));
  CHECK(n.committed >= rounds);
  CHECK(n.resumes + n.capacity_failures == n.lost_sequences);  // each lost one resumed, or failed for room
}
