#pragma once

// Device memory for a deployment (Moebius::cuda): the owner of deployment_memory.hpp over
// cudaMalloc. Its ranks' memory can be shared with other processes of the host through
// export_ipc (device_rank_ipc.hpp).
//
// Single process, two GPUs, one rank each:
//   device_deployment_memory mem(arena, kv, /*devices=*/{0, 1});
//   cuda_peer_transport t(... mem.ranks() ...);
//
// One process per GPU (rank r on device d): each process allocates its own rank, exports
// its handles, the engine's own collective (NCCL, torch.distributed, MPI) carries the bytes of
// device_rank_ipc to the peers, and each peer opens them (imported_rank_memory):
//   device_deployment_memory mine(arena, kv, {d}, {r});
//   device_rank_ipc h = mine.export_ipc(0);

#include <vector>

#include "moebius/memory/deployment_memory.hpp"
#include "moebius/memory/device_rank_ipc.hpp"

namespace moebius {

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

}  // namespace moebius
