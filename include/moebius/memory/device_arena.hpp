#pragma once

// Device memory for a deployment (Moebius::cuda): the owner of deployment_memory.hpp over
// cudaMalloc, and the CUDA IPC handles through which processes of one host share it.
//
// Single process, two GPUs, one rank each:
//   device_deployment_memory mem(arena, kv, /*devices=*/{0, 1});
//   cuda_peer_transport t(... mem.ranks() ...);
//
// One process per GPU (rank r on device d): each process allocates its own rank, exports
// its handles, the engine's own collective (NCCL, torch.distributed, MPI) carries the bytes of
// device_rank_ipc to the peers, and each peer opens them:
//   device_deployment_memory mine(arena, kv, {d}, {r});
//   device_rank_ipc h = mine.export_ipc(0);            // plain bytes: send them as they are
//   ... all-gather h ...
//   imported_rank_memory peer(h_of_rank_q, d);         // maps rank q's memory on device d
//   peer.memory()                                      // a rank_memory for the transport

#include <array>
#include <cstdint>
#include <vector>

#include "moebius/memory/deployment_memory.hpp"

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

// Per local rank, one cudaMalloc of the arena and one of the KV pool on that rank's device,
// filled per `fill` (zero or memory_poison_byte), freed when the owner dies. `devices[i]` is the
// CUDA device of local rank `local_ranks[i]` (default: local ranks 0..devices.size()-1);
// several ranks may share a device (virtual ranks). Throws errc::invalid_argument on
// mismatched lists, errc::cuda when an allocation fails (nothing stays allocated).
class device_deployment_memory final : public deployment_memory {
 public:
  device_deployment_memory(const arena_geometry& arena, const kv_geometry& kv,
                           std::vector<int> devices, std::vector<int> local_ranks = {},
                           memory_fill fill = memory_fill::zero, arena_cursor cursor = {});
  ~device_deployment_memory() override;

  int device_of(int i) const { return memory(i).device; }

  // The IPC handles of local rank i's arena and KV pool (cudaIpcGetMemHandle).
  device_rank_ipc export_ipc(int i) const;

 private:
  void release() noexcept;
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
