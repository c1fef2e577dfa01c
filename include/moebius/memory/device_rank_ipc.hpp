#pragma once

// One rank's device memory shared between processes of one host through CUDA IPC
// (Moebius::cuda): the handle bytes a rank exports (device_deployment_memory::export_ipc) and
// the peer's mapping of them (imported_rank_memory).
//
//   device_rank_ipc h = mine.export_ipc(0);            // plain bytes: send them as they are
//   ... all-gather h ...
//   imported_rank_memory peer(h_of_rank_q, d);         // maps rank q's memory on device d
//   peer.memory()                                      // a rank_memory for the transport

#include <array>
#include <cstdint>

#include "moebius/memory/rank_memory.hpp"
#include "moebius/plan/memory_space.hpp"

namespace moebius {

// One exported range of device memory: the CUDA IPC handle of the allocation that holds it
// (cudaIpcMemHandle_t as bytes) and where the range sits in that allocation. Trivially
// copyable; an all-zero handle with bytes 0 stands for an absent space.
struct device_ipc_range {
  std::array<unsigned char, 64> handle{};  // cudaIpcMemHandle_t (CUDA_IPC_HANDLE_SIZE bytes)
  int64_t offset = 0;                      // of the range from the allocation's base
  int64_t bytes = 0;
};

// Everything a peer needs to map one rank's memory.
struct device_rank_ipc {
  int rank = -1;  // the rank this memory belongs to
  device_ipc_range spaces[num_memory_spaces] = {};  // indexed by memory_space
};

// A peer's memory mapped into this process (cudaIpcOpenMemHandle on `device`, peer access
// enabled lazily), unmapped when this object dies. Throws errc::invalid_argument for a handle
// without an arena (before any CUDA call), errc::cuda when the mapping fails. Not copyable.
class imported_rank_memory {
 public:
  imported_rank_memory(const device_rank_ipc& handle, int device);
  imported_rank_memory(const imported_rank_memory&) = delete;
  imported_rank_memory& operator=(const imported_rank_memory&) = delete;
  ~imported_rank_memory();

  int rank() const { return rank_; }
  const rank_memory& memory() const { return memory_; }

 private:
  int rank_ = -1;
  rank_memory memory_;
  void* mapped_[num_memory_spaces] = {};  // allocation bases as mapped here
};

}  // namespace moebius
