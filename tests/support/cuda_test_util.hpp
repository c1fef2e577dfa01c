#pragma once

// Helpers shared by the GPU tests: RAII device buffers, image upload/download, rank placement
// on devices, and the engine configurations of cuda_peer_transport.

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "moebius/cuda/check.hpp"
#include "moebius/plan/plan.hpp"
#include "moebius/transport/cuda_peer_transport.hpp"
#include "support/random.hpp"
#include "support/random_plan.hpp"  // random_bytes

namespace moebius::testing {

// One cudaMalloc on a device, freed on destruction.
class device_buffer {
 public:
  device_buffer() = default;
  device_buffer(int device, size_t bytes) : device_(device), bytes_(bytes) {
    int saved = 0;
    MOEBIUS_CUDA_CHECK(cudaGetDevice(&saved));
    MOEBIUS_CUDA_CHECK(cudaSetDevice(device));
    MOEBIUS_CUDA_CHECK(cudaMalloc(&ptr_, bytes == 0 ? 1 : bytes));
    MOEBIUS_CUDA_CHECK(cudaSetDevice(saved));
  }
  device_buffer(device_buffer&& o) noexcept
      : device_(o.device_), bytes_(o.bytes_), ptr_(std::exchange(o.ptr_, nullptr)) {}
  device_buffer& operator=(device_buffer&& o) noexcept {
    std::swap(device_, o.device_);
    std::swap(bytes_, o.bytes_);
    std::swap(ptr_, o.ptr_);
    return *this;
  }
  device_buffer(const device_buffer&) = delete;
  device_buffer& operator=(const device_buffer&) = delete;
  ~device_buffer() {
    if (ptr_ != nullptr) (void)cudaFree(ptr_);
  }

  std::byte* data() const { return static_cast<std::byte*>(ptr_); }
  size_t size() const { return bytes_; }
  int device() const { return device_; }

  // Complete on return: a pageable cudaMemcpy may return before its DMA lands, and the
  // transport's non-blocking streams do not wait for the legacy stream.
  void upload(const std::vector<std::byte>& h) const {
    MOEBIUS_CUDA_CHECK(cudaMemcpy(ptr_, h.data(), h.size(), cudaMemcpyHostToDevice));
    int saved = 0;
    MOEBIUS_CUDA_CHECK(cudaGetDevice(&saved));
    MOEBIUS_CUDA_CHECK(cudaSetDevice(device_));
    MOEBIUS_CUDA_CHECK(cudaDeviceSynchronize());
    MOEBIUS_CUDA_CHECK(cudaSetDevice(saved));
  }
  std::vector<std::byte> download() const {
    std::vector<std::byte> h(bytes_);
    MOEBIUS_CUDA_CHECK(cudaMemcpy(h.data(), ptr_, bytes_, cudaMemcpyDeviceToHost));
    return h;
  }

 private:
  int device_ = 0;
  size_t bytes_ = 0;
  void* ptr_ = nullptr;
};

inline int device_count() {
  int n = 0;
  MOEBIUS_CUDA_CHECK(cudaGetDeviceCount(&n));
  return n;
}

// A named transport configuration the transport tests run each case with.
struct engine_case {
  const char* name;
  cuda_peer_config config;
};

// Every engine path: the default automatic choice (small test ops -> SM kernel), automatic with
// low thresholds (a mix of both engines in one phase), all copy engine, and the SM kernel with
// tiny chunks and grids (splitting and round-robin over few warps); CUDA graphs on in some,
// direct enqueue in the others.
inline std::vector<engine_case> engine_cases() {
  std::vector<engine_case> cases;
  cuda_peer_config c;
  c.barrier_timeout_ns = int64_t{5'000'000'000};
  cases.push_back({"automatic", c});
  cuda_peer_config mixed = c;
  mixed.use_cuda_graphs = false;
  mixed.copy_engine_min_op_bytes = 512;
  mixed.copy_engine_max_ops_per_phase = 1 << 20;
  cases.push_back({"automatic-mixed-direct", mixed});
  // The same split captured in a graph: remote slabs on copy engines, local ops in the
  // kernel forked onto the side stream.
  cuda_peer_config mixed_graph = mixed;
  mixed_graph.use_cuda_graphs = true;
  cases.push_back({"automatic-mixed-graph", mixed_graph});
  cuda_peer_config ce = c;
  ce.engine = engine_policy::copy_engine;
  cases.push_back({"copy_engine", ce});
  cuda_peer_config sm = c;
  sm.engine = engine_policy::sm_kernel;
  sm.use_cuda_graphs = false;
  cases.push_back({"sm_kernel-direct", sm});
  cuda_peer_config sm_small = sm;
  sm_small.use_cuda_graphs = true;
  sm_small.sm_chunk_bytes = 64;
  sm_small.sm_kernel_blocks = 3;
  sm_small.sm_kernel_threads = 64;
  cases.push_back({"sm_kernel-tiny-chunks", sm_small});
  return cases;
}

// P ranks' memory: arena and kv_pool per rank on devices[r].
struct rank_buffers {
  std::vector<device_buffer> arena;
  std::vector<device_buffer> kv;

  std::vector<rank_memory> memory(const std::vector<int>& devices) const {
    std::vector<rank_memory> m(arena.size());
    for (size_t r = 0; r < arena.size(); ++r) {
      m[r].device = devices[r];
      m[r].space(memory_space::arena) = {arena[r].data(), static_cast<int64_t>(arena[r].size())};
      if (r < kv.size()) {
        m[r].space(memory_space::kv_pool) = {kv[r].data(), static_cast<int64_t>(kv[r].size())};
      }
    }
    return m;
  }
};

// Devices for P ranks: all on device 0 (virtual ranks) or round-robin over the devices.
inline std::vector<int> rank_devices(int num_ranks, bool spread) {
  const int n = spread ? device_count() : 1;
  std::vector<int> d(static_cast<size_t>(num_ranks));
  for (int r = 0; r < num_ranks; ++r) d[static_cast<size_t>(r)] = r % n;
  return d;
}

inline std::string first_difference(const std::vector<std::byte>& want,
                                    const std::vector<std::byte>& got, const std::string& what) {
  if (want.size() != got.size()) {
    return what + ": size " + std::to_string(got.size()) + " != " + std::to_string(want.size());
  }
  for (size_t i = 0; i < want.size(); ++i) {
    if (want[i] != got[i]) {
      std::ostringstream os;
      os << what << ": first difference at byte " << i << ": want "
         << static_cast<int>(want[i]) << " got " << static_cast<int>(got[i]);
      return os.str();
    }
  }
  return "";
}

}  // namespace moebius::testing
