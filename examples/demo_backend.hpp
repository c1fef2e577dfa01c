#pragma once

// Where the demo's ranks keep their memory (the expert arena and the KV pool) and which
// transport moves it: host memory with host_transport, or GPU memory with cuda_peer_transport
// (one rank per GPU, or virtual ranks sharing one GPU). Host images mirror the memory so the
// demo can check what it holds.

#include <memory>

#include "moebius/config.hpp"
#include "moebius/transport/transport.hpp"
#include "support/reference.hpp"

namespace moebius::demo {

// Host copies of every rank's memory spaces.
struct rank_mirror {
  testing::rank_images arenas;  // [P] arena images (geometry.total_bytes() each)
  testing::rank_images pools;   // [P] KV pool images (kv_geometry.pool_bytes() each)
};

class backend {
 public:
  virtual ~backend() = default;
  virtual const char* name() const = 0;
  virtual transport& get() = 0;
  // Copies the mirror to the ranks' memory, and back. The host backend works on the mirror
  // itself, so both are free there.
  virtual void upload(const rank_mirror& m) = 0;
  virtual void download(rank_mirror& m) = 0;
};

// Number of CUDA devices (0 without CUDA or without a device).
int count_gpus();

// GPU memory when `gpus` > 0 (rank r on device r when there are enough devices, else all on
// device 0), host memory (the mirror itself) otherwise. The mirror must already be sized.
std::unique_ptr<backend> make_backend(rank_mirror& mirror, int gpus);

}  // namespace moebius::demo
