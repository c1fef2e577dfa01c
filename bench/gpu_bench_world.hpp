#pragma once

// What the GPU benchmarks share: the ranks they run on (one per GPU, at most 8, or two virtual
// ranks on one GPU, which are named "virtual_" so nobody mistakes them for link figures), one
// non-blocking stream and (real ranks only) one NCCL communicator per rank, how much memory a
// rank may take, and a random fill that is never zeros.

#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <span>
#include <string>
#include <vector>

#include <benchmark/benchmark.h>

#include <cstdio>
#include <exception>

#include "moebius/cuda/check.hpp"
#include "moebius/cuda/nccl_check.hpp"
#include "moebius/transport/cuda_peer_transport.hpp"

namespace moebius::bench {

// Integer environment variable `name`, or `fallback` when unset or empty.
inline int64_t env_int(const char* name, int64_t fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  return std::strtoll(v, nullptr, 10);
}

struct gpu_world {
  int num_ranks = 0;
  bool virtual_ranks = false;         // all ranks on device 0
  std::vector<int> device_of;         // per rank
  std::vector<cudaStream_t> streams;  // per rank, for the ceiling and NCCL
  std::vector<ncclComm_t> comms;      // per rank; empty with virtual ranks
  std::string prefix;                 // "" or "virtual_"
};

inline gpu_world& world() {
  static gpu_world w;
  return w;
}

// The world's streams as transport::enqueue() takes them (one per rank: every rank is local).
inline std::span<const stream_handle> world_streams() {
  static std::vector<stream_handle> handles;
  handles.assign(world().streams.begin(), world().streams.end());
  return handles;
}

// Ranks over `devices` (>= 1) GPUs. NCCL_NVLS_ENABLE must already be 0 (multicast stays off).
inline void init_world(int devices) {
  gpu_world& w = world();
  if (devices >= 2) {
    w.num_ranks = std::min(devices, 8);
    for (int r = 0; r < w.num_ranks; ++r) w.device_of.push_back(r);
  } else {
    w.num_ranks = 2;
    w.virtual_ranks = true;
    w.device_of = {0, 0};
    w.prefix = "virtual_";
  }
  for (int r = 0; r < w.num_ranks; ++r) {
    cudaStream_t s = nullptr;
    MOEBIUS_CUDA_CHECK(cudaSetDevice(w.device_of[static_cast<size_t>(r)]));
    MOEBIUS_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    w.streams.push_back(s);
  }
  if (!w.virtual_ranks) {
    w.comms.resize(static_cast<size_t>(w.num_ranks));
    MOEBIUS_NCCL_CHECK(ncclCommInitAll(w.comms.data(), w.num_ranks, w.device_of.data()));
  }
  MOEBIUS_CUDA_CHECK(cudaSetDevice(0));
}

// The start of every GPU benchmark's main(): hardware queues for virtual ranks, NVLink SHARP
// multicast off (it can take a shared host's GPUs out of service; NCCL reads this when a
// communicator is created), Google Benchmark's arguments, then the ranks. Returns -1 to go on,
// else the exit status: 0 without a GPU (nothing to measure), 1 for bad arguments or a failed
// setup.
inline int start_gpu_benchmark(int* argc, char** argv, const char* name) {
  moebius::request_hardware_queues_for_virtual_ranks();
  setenv("NCCL_NVLS_ENABLE", "0", 1);
  benchmark::Initialize(argc, argv);
  if (benchmark::ReportUnrecognizedArguments(*argc, argv)) return 1;
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("%s: no CUDA device; nothing to measure\n", name);
    return 0;
  }
  try {
    init_world(devices);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: setup failed: %s\n", name, e.what());
    return 1;
  }
  return -1;
}

inline void sync_all() {
  for (int d : world().device_of) {
    MOEBIUS_CUDA_CHECK(cudaSetDevice(d));
    MOEBIUS_CUDA_CHECK(cudaDeviceSynchronize());
  }
}

// Free bytes one rank may use: 85% of the smallest device's free memory, less 2 GiB of
// headroom, shared by the ranks of a device.
inline int64_t budget_per_rank() {
  gpu_world& w = world();
  int64_t least = INT64_MAX;
  for (int d : w.device_of) {
    size_t free_b = 0, total_b = 0;
    MOEBIUS_CUDA_CHECK(cudaSetDevice(d));
    MOEBIUS_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
    least = std::min(least, static_cast<int64_t>(free_b));
  }
  MOEBIUS_CUDA_CHECK(cudaSetDevice(0));
  const int64_t ranks_per_device = w.virtual_ranks ? w.num_ranks : 1;
  return std::max<int64_t>(0, (least / 100 * 85 - (int64_t{2} << 30)) / ranks_per_device);
}

// splitmix64 of the word index: random-looking, never all zeros (zeros hide unwritten bytes
// and can run faster than real data).
__global__ inline void fill_random_kernel(uint64_t* words, int64_t n, uint64_t seed) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    uint64_t z = seed + static_cast<uint64_t>(i) * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    words[i] = z ^ (z >> 31);
  }
}

// Fills `bytes` (a multiple of 8) at `p` on the current device, on the legacy stream.
inline void fill_random(void* p, int64_t bytes, uint64_t seed) {
  fill_random_kernel<<<1024, 256>>>(static_cast<uint64_t*>(p), bytes / 8, seed);
  MOEBIUS_CUDA_CHECK(cudaGetLastError());
}

}  // namespace moebius::bench
