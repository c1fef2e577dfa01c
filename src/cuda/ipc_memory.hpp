#pragma once

// CUDA IPC export and open of device memory, the one implementation behind both users: the
// device memory owner (device_deployment_memory::export_ipc, imported_rank_memory) and
// cuda_peer_transport::multi_process. Internal to Moebius::cuda.
//
//   ipc_export e = export_ipc_pointer(p, "rank 0's kv_pool");     // any pointer into a cudaMalloc
//   ... send e.handle and e.offset to the peer ...
//   void* base = open_ipc_memory(e.handle, "rank 0's kv_pool");   // in the peer, device current
//   std::byte* q = static_cast<std::byte*>(base) + e.offset;      // == p, mapped here
//   ipc_mapping owner(base, device);                              // closes it

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string_view>

namespace moebius::detail {

// The CUDA IPC handle of a cudaMalloc allocation, and the byte offset inside it of the
// pointer that was exported (CUDA IPC exports whole allocations).
struct ipc_export {
  cudaIpcMemHandle_t handle{};
  int64_t offset = 0;
};

// Exports `base`, which must be the base of its allocation (offset 0; no driver call).
// Throws errc::cuda naming `what` when cudaIpcGetMemHandle fails.
ipc_export export_ipc_allocation(void* base, std::string_view what);

// Exports the allocation that holds `p` (found with cuMemGetAddressRange, through the
// runtime's driver entry point) and p's offset inside it. Throws errc::cuda naming `what`
// and the call that failed.
ipc_export export_ipc_pointer(void* p, std::string_view what);

// Maps a peer's allocation into this process on the current device, peer access enabled
// lazily (cudaIpcMemLazyEnablePeerAccess), and returns its base here; the caller closes it
// (ipc_mapping in moebius/cuda/handles.hpp, or cudaIpcCloseMemHandle). Throws errc::cuda
// "cannot open the CUDA IPC handle of <what>: <error name> (<description>)".
void* open_ipc_memory(const cudaIpcMemHandle_t& handle, std::string_view what);

}  // namespace moebius::detail
