#include "moebius/memory/device_rank_ipc.hpp"

#include <cuda_runtime_api.h>

#include <cstring>
#include <string>

#include "../cuda/ipc_memory.hpp"
#include "moebius/cuda/handles.hpp"
#include "moebius/error.hpp"

namespace moebius {

static_assert(sizeof(cudaIpcMemHandle_t) == sizeof(device_ipc_range::handle),
              "device_ipc_range::handle must hold a cudaIpcMemHandle_t");

imported_rank_memory::imported_rank_memory(const device_rank_ipc& handle, int device)
    : rank_(handle.rank) {
  const device_ipc_range& arena = handle.spaces[static_cast<int>(memory_space::arena)];
  MOEBIUS_CHECK(handle.rank >= 0 && arena.bytes > 0, errc::invalid_argument,
                "imported rank memory: the handle has no arena (rank ", handle.rank, ", ",
                arena.bytes, " bytes): was it exported?");
  MOEBIUS_CHECK(device >= 0, errc::invalid_argument, "imported rank memory: device ", device,
                " is not a CUDA ordinal");
  for (const device_ipc_range& r : handle.spaces) {
    MOEBIUS_CHECK(r.offset >= 0 && r.bytes >= 0, errc::invalid_argument,
                  "imported rank memory: negative offset or size (offset ", r.offset, ", ",
                  r.bytes, " bytes)");
  }
  device_guard guard(device);
  memory_.device = device;
  try {
    for (int s = 0; s < num_memory_spaces; ++s) {
      const device_ipc_range& r = handle.spaces[s];
      if (r.bytes == 0) continue;
      cudaIpcMemHandle_t h;
      std::memcpy(&h, r.handle.data(), sizeof(h));
      mapped_[s] = detail::open_ipc_memory(
          h, "rank " + std::to_string(handle.rank) + "'s " +
                 to_string(static_cast<memory_space>(s)) + " on device " + std::to_string(device));
      memory_.spaces[s] = {static_cast<std::byte*>(mapped_[s]) + r.offset, r.bytes};
    }
  } catch (...) {
    for (void*& p : mapped_) {
      if (p != nullptr) (void)cudaIpcCloseMemHandle(p);
      p = nullptr;
    }
    throw;
  }
}

imported_rank_memory::~imported_rank_memory() {
  for (void* p : mapped_) {
    if (p != nullptr) (void)cudaIpcCloseMemHandle(p);
  }
}

}  // namespace moebius
