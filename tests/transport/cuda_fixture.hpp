#pragma once

// Device memory and held caller streams for the conformance suite's GPU fixtures
// (transport_conformance.hpp): what cuda_peer_transport and nccl_transport share. Included by
// .cu test files only (it defines a kernel).

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "moebius/cuda/check.hpp"
#include "moebius/memory/rank_memory.hpp"
#include "support/catch.hpp"
#include "support/cuda_test_util.hpp"
#include "transport/transport_conformance.hpp"

namespace moebius::testing {

// Every rank's spaces as cudaMalloc buffers on the rank's device, poisoned on allocation.
class device_memory final : public fixture_memory {
 public:
  device_memory(std::vector<int> devices, const space_sizes& bytes) : devices_(std::move(devices)) {
    for (int s = 0; s < num_memory_spaces; ++s) {
      const int64_t n = bytes[static_cast<size_t>(s)];
      for (const int dev : devices_) {
        if (n == 0) {
          buffers_[s].emplace_back();
          continue;
        }
        buffers_[s].emplace_back(dev, static_cast<size_t>(n));
        buffers_[s].back().upload(std::vector<std::byte>(static_cast<size_t>(n), poison_byte));
      }
    }
  }
  std::vector<rank_memory> ranks() const override {
    std::vector<rank_memory> m(devices_.size());
    for (size_t r = 0; r < m.size(); ++r) {
      m[r].device = devices_[r];
      for (int s = 0; s < num_memory_spaces; ++s) {
        const device_buffer& b = buffers_[s][r];
        if (b.size() > 0) m[r].spaces[s] = memory_span(b.data(), static_cast<int64_t>(b.size()));
      }
    }
    return m;
  }
  void upload(int rank, memory_space s, const std::vector<std::byte>& bytes) override {
    const device_buffer& b = buffers_[static_cast<int>(s)][static_cast<size_t>(rank)];
    REQUIRE(bytes.size() == b.size());
    if (!bytes.empty()) b.upload(bytes);  // complete on return (device_buffer::upload)
  }
  std::vector<std::byte> download(int rank, memory_space s) const override {
    const device_buffer& b = buffers_[static_cast<int>(s)][static_cast<size_t>(rank)];
    if (b.size() == 0) return {};
    return b.download();
  }
  const std::vector<int>& devices() const { return devices_; }

 private:
  std::vector<int> devices_;
  std::vector<device_buffer> buffers_[num_memory_spaces];
};

namespace detail {

__device__ inline uint64_t global_ns() {
  uint64_t t = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Holds its stream until the host sets *release, or gives up after timeout_ns and says so in
// *expired (so a transport that waits for a held stream fails the test instead of hanging it).
__global__ void hold_stream_kernel(const volatile int* release, volatile int* expired,
                                   uint64_t timeout_ns) {
  const uint64_t start = global_ns();
  while (*release == 0) {
    if (global_ns() - start > timeout_ns) {
      *expired = 1;
      return;
    }
    __nanosleep(1000);
  }
}

}  // namespace detail

// One non-blocking stream per rank of `ranks` (all of them local), each blocked by
// hold_stream_kernel until release().
class cuda_held_streams final : public held_streams {
 public:
  explicit cuda_held_streams(const std::vector<rank_memory>& ranks) : ranks_(ranks) {
    int saved = 0;
    MOEBIUS_CUDA_CHECK(cudaGetDevice(&saved));
    // Everything that may synchronize (allocation) happens before any stream is held.
    MOEBIUS_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&flags_),
                                     (1 + ranks_.size()) * sizeof(int),
                                     cudaHostAllocMapped | cudaHostAllocPortable));
    for (size_t i = 0; i <= ranks_.size(); ++i) flags_[i] = 0;
    int64_t probe_bytes = 0;
    for (const rank_memory& m : ranks_) {
      for (const memory_span& s : m.spaces) probe_bytes = std::max(probe_bytes, s.bytes);
    }
    for (const rank_memory& m : ranks_) {
      probes_.emplace_back(m.device, static_cast<size_t>(probe_bytes));
      MOEBIUS_CUDA_CHECK(cudaSetDevice(m.device));
      cudaStream_t s = nullptr;
      MOEBIUS_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
      streams_.push_back(s);
    }
    int* d_flags = nullptr;
    MOEBIUS_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&d_flags), flags_, 0));
    for (size_t i = 0; i < ranks_.size(); ++i) {
      MOEBIUS_CUDA_CHECK(cudaSetDevice(ranks_[i].device));
      detail::hold_stream_kernel<<<1, 1, 0, streams_[i]>>>(d_flags, d_flags + 1 + i,
                                                           uint64_t{20'000'000'000});
      MOEBIUS_CUDA_CHECK(cudaGetLastError());
    }
    MOEBIUS_CUDA_CHECK(cudaSetDevice(saved));
  }
  cuda_held_streams(const cuda_held_streams&) = delete;
  cuda_held_streams& operator=(const cuda_held_streams&) = delete;
  ~cuda_held_streams() override {
    release();
    for (size_t i = 0; i < streams_.size(); ++i) {
      (void)cudaSetDevice(ranks_[i].device);
      (void)cudaStreamSynchronize(streams_[i]);
      (void)cudaStreamDestroy(streams_[i]);
    }
    for (const cudaEvent_t e : events_) (void)cudaEventDestroy(e);
    (void)cudaFreeHost(flags_);
  }

  std::vector<stream_handle> streams() const override {
    return std::vector<stream_handle>(streams_.begin(), streams_.end());
  }
  void enqueue_probe(memory_space s) override {
    probed_ = s;
    for (size_t i = 0; i < ranks_.size(); ++i) {
      const memory_span& span = ranks_[i].space(s);
      MOEBIUS_CUDA_CHECK(cudaSetDevice(ranks_[i].device));
      if (span.bytes > 0) {
        MOEBIUS_CUDA_CHECK(cudaMemcpyAsync(probes_[i].data(), span.base,
                                           static_cast<size_t>(span.bytes),
                                           cudaMemcpyDeviceToDevice, streams_[i]));
      }
    }
  }
  void release() override { __atomic_store_n(flags_, 1, __ATOMIC_SEQ_CST); }
  void synchronize() override {
    for (size_t i = 0; i < streams_.size(); ++i) {
      MOEBIUS_CUDA_CHECK(cudaSetDevice(ranks_[i].device));
      MOEBIUS_CUDA_CHECK(cudaStreamSynchronize(streams_[i]));
    }
  }
  bool expired() const override {
    for (size_t i = 0; i < ranks_.size(); ++i) {
      if (__atomic_load_n(flags_ + 1 + i, __ATOMIC_SEQ_CST) != 0) return true;
    }
    return false;
  }
  std::vector<event_handle> record_events() override {
    std::vector<event_handle> out;
    for (size_t i = 0; i < ranks_.size(); ++i) {
      MOEBIUS_CUDA_CHECK(cudaSetDevice(ranks_[i].device));
      cudaEvent_t e = nullptr;
      MOEBIUS_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
      events_.push_back(e);
      MOEBIUS_CUDA_CHECK(cudaEventRecord(e, streams_[i]));
      out.push_back(e);
    }
    return out;
  }
  bool fired(event_handle e) const override {
    const cudaError_t q = cudaEventQuery(static_cast<cudaEvent_t>(e));
    if (q == cudaErrorNotReady) return false;
    MOEBIUS_CUDA_CHECK(q);
    return true;
  }
  std::vector<std::byte> probe(int local_idx) const override {
    std::vector<std::byte> all = probes_[static_cast<size_t>(local_idx)].download();
    all.resize(static_cast<size_t>(ranks_[static_cast<size_t>(local_idx)].space(probed_).bytes));
    return all;
  }

 private:
  std::vector<rank_memory> ranks_;
  std::vector<device_buffer> probes_;
  std::vector<cudaStream_t> streams_;
  std::vector<cudaEvent_t> events_;  // record_events()
  int* flags_ = nullptr;  // [0]: release; [1 + i]: stream i's block expired
  memory_space probed_ = memory_space::arena;
};

}  // namespace moebius::testing
