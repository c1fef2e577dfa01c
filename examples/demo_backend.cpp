#include "demo_backend.hpp"

#include <vector>

#include "moebius/error.hpp"
#include "moebius/transport/host_transport.hpp"

#if MOEBIUS_WITH_CUDA
#include <cuda_runtime_api.h>

#include "moebius/cuda/check.hpp"
#include "moebius/transport/cuda_peer_transport.hpp"
#endif

namespace moebius::demo {
namespace {

class host_backend final : public backend {
 public:
  explicit host_backend(rank_mirror& m) {
    std::vector<rank_memory> ranks(m.arenas.size());
    for (size_t r = 0; r < ranks.size(); ++r) {
      ranks[r].spaces[static_cast<int>(memory_space::arena)] = m.arenas[r];
      if (r < m.pools.size()) ranks[r].spaces[static_cast<int>(memory_space::kv_pool)] = m.pools[r];
    }
    transport_ = std::make_unique<host_transport>(std::move(ranks));
  }
  const char* name() const override { return "host memory, host_transport"; }
  transport& get() override { return *transport_; }
  void upload(const rank_mirror&) override {}
  void download(rank_mirror&) override {}

 private:
  std::unique_ptr<host_transport> transport_;
};

#if MOEBIUS_WITH_CUDA
class gpu_backend final : public backend {
 public:
  gpu_backend(const rank_mirror& m, int gpus) {
    const auto P = static_cast<int>(m.arenas.size());
    virtual_ranks_ = gpus < P;
    std::vector<rank_memory> ranks(static_cast<size_t>(P));
    for (int r = 0; r < P; ++r) {
      const int device = virtual_ranks_ ? 0 : r;
      MOEBIUS_CUDA_CHECK(cudaSetDevice(device));
      for (int s = 0; s < num_memory_spaces; ++s) {
        const auto& images = s == 0 ? m.arenas : m.pools;
        const size_t bytes = static_cast<size_t>(r) < images.size() ? images[r].size() : 0;
        void* p = nullptr;
        if (bytes > 0) MOEBIUS_CUDA_CHECK(cudaMalloc(&p, bytes));
        buffers_.push_back({p, bytes, device});
        ranks[r].device = device;
        ranks[r].spaces[s] = memory_span(p, static_cast<int64_t>(bytes));
      }
    }
    transport_ = std::make_unique<cuda_peer_transport>(cuda_peer_transport::single_process(ranks));
  }
  ~gpu_backend() override {
    transport_.reset();
    for (const buffer& b : buffers_) (void)cudaFree(b.ptr);
  }
  const char* name() const override {
    return virtual_ranks_ ? "GPU, virtual ranks on one device, cuda_peer_transport"
                          : "GPU, one rank per device, cuda_peer_transport";
  }
  transport& get() override { return *transport_; }
  void upload(const rank_mirror& m) override { copy(const_cast<rank_mirror&>(m), true); }
  void download(rank_mirror& m) override { copy(m, false); }

 private:
  struct buffer {
    void* ptr;
    size_t bytes;
    int device;
  };
  // buffers_[2r + s] is rank r's space s; cudaMemcpy is synchronous for pageable memory.
  void copy(rank_mirror& m, bool to_device) {
    for (size_t i = 0; i < buffers_.size(); ++i) {
      const buffer& b = buffers_[i];
      if (b.bytes == 0) continue;
      auto& image = (i % 2 == 0 ? m.arenas : m.pools)[i / 2];
      MOEBIUS_CUDA_CHECK(cudaSetDevice(b.device));
      MOEBIUS_CUDA_CHECK(to_device
                             ? cudaMemcpy(b.ptr, image.data(), b.bytes, cudaMemcpyHostToDevice)
                             : cudaMemcpy(image.data(), b.ptr, b.bytes, cudaMemcpyDeviceToHost));
    }
    // A pageable host-to-device copy may return before its DMA lands.
    for (const buffer& b : buffers_) {
      MOEBIUS_CUDA_CHECK(cudaSetDevice(b.device));
      MOEBIUS_CUDA_CHECK(cudaDeviceSynchronize());
    }
  }

  bool virtual_ranks_ = false;
  std::vector<buffer> buffers_;
  std::unique_ptr<cuda_peer_transport> transport_;
};
#endif

}  // namespace

int count_gpus() {
#if MOEBIUS_WITH_CUDA
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) return 0;
  return n;
#else
  return 0;
#endif
}

std::unique_ptr<backend> make_backend(rank_mirror& mirror, int gpus) {
#if MOEBIUS_WITH_CUDA
  if (gpus > 0) return std::make_unique<gpu_backend>(mirror, gpus);
#endif
  (void)gpus;
  return std::make_unique<host_backend>(mirror);
}

}  // namespace moebius::demo
