#include "moebius/memory/device_deployment_memory.hpp"

#include <cuda_runtime_api.h>

#include <cstring>
#include <string>
#include <utility>

#include "../cuda/ipc_memory.hpp"
#include "moebius/cuda/check.hpp"
#include "moebius/cuda/handles.hpp"
#include "moebius/error.hpp"

namespace moebius {

namespace {

std::vector<int> default_ranks(std::vector<int> local_ranks, size_t num_devices) {
  if (!local_ranks.empty()) return local_ranks;
  for (size_t i = 0; i < num_devices; ++i) local_ranks.push_back(static_cast<int>(i));
  return local_ranks;
}

void* allocate_device(int64_t bytes, memory_fill fill) {
  if (bytes == 0) return nullptr;
  void* p = nullptr;
  MOEBIUS_CUDA_CHECK(cudaMalloc(&p, static_cast<size_t>(bytes)));
  const cudaError_t st =
      cudaMemset(p, fill == memory_fill::zero ? 0 : static_cast<int>(memory_poison_byte),
                 static_cast<size_t>(bytes));
  if (st != cudaSuccess) {
    (void)cudaFree(p);
    MOEBIUS_CUDA_CHECK(st);
  }
  return p;
}

}  // namespace

device_deployment_memory::device_deployment_memory(const arena_geometry& arena,
                                                   const kv_geometry& kv,
                                                   std::vector<int> devices,
                                                   std::vector<int> local_ranks,
                                                   memory_fill fill, arena_cursor cursor)
    : deployment_memory(arena, kv, default_ranks(std::move(local_ranks), devices.size()),
                        cursor) {
  MOEBIUS_CHECK(devices.size() == local_ranks_.size(), errc::invalid_argument,
                "device deployment memory: ", devices.size(), " devices for ",
                local_ranks_.size(), " local ranks");
  for (int d : devices) {
    MOEBIUS_CHECK(d >= 0, errc::invalid_argument, "device deployment memory: device ", d,
                  " is not a CUDA ordinal");
  }
  device_guard guard;  // the owner sets each rank's device in turn; the caller's is restored
  try {
    for (size_t i = 0; i < devices.size(); ++i) {
      guard.set(devices[i]);
      rank_memory m;
      m.device = devices[i];
      ranks_.push_back(m);  // published first so that release() frees a partial rank too
      ranks_.back().space(memory_space::arena) = {allocate_device(arena_.total_bytes(), fill),
                                                  arena_.total_bytes()};
      ranks_.back().space(memory_space::kv_pool) = {allocate_device(kv_.pool_bytes(), fill),
                                                    kv_.pool_bytes()};
    }
    MOEBIUS_CUDA_CHECK(cudaDeviceSynchronize());  // the fills are done before anyone reads
  } catch (...) {
    release();
    throw;
  }
}

device_deployment_memory::~device_deployment_memory() { release(); }

void device_deployment_memory::release() noexcept {
  for (rank_memory& m : ranks_) {
    for (memory_span& sp : m.spaces) {
      if (sp.base != nullptr) (void)cudaFree(sp.base);  // cudaFree needs no current device
      sp = {};
    }
  }
  ranks_.clear();
}

device_rank_ipc device_deployment_memory::export_ipc(int i) const {
  const rank_memory& m = memory(i);
  device_rank_ipc h;
  h.rank = local_ranks_[static_cast<size_t>(i)];
  for (int s = 0; s < num_memory_spaces; ++s) {
    const memory_span& sp = m.spaces[s];
    if (sp.bytes == 0) continue;
    // Each space is an allocation of its own: its base is the allocation's, offset 0.
    const detail::ipc_export e = detail::export_ipc_allocation(
        sp.base, "rank " + std::to_string(h.rank) + "'s " +
                     to_string(static_cast<memory_space>(s)) + " (device " +
                     std::to_string(m.device) + ")");
    std::memcpy(h.spaces[s].handle.data(), &e.handle, sizeof(e.handle));
    h.spaces[s].offset = e.offset;
    h.spaces[s].bytes = sp.bytes;
  }
  return h;
}

}  // namespace moebius
