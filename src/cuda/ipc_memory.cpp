#include "ipc_memory.hpp"

#include <cuda.h>

#include "moebius/cuda/check.hpp"
#include "moebius/error.hpp"

namespace moebius::detail {
namespace {

// cuMemGetAddressRange, found through the runtime: linking libcuda would stop every Moebius
// binary from loading on a machine without a GPU driver (CI, build hosts).
CUresult mem_get_address_range(CUdeviceptr* base, size_t* size, CUdeviceptr p) {
  using fn_t = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);
  static const fn_t fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult found{};
    MOEBIUS_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &f, 12000,
                                                        cudaEnableDefault, &found));
    MOEBIUS_CHECK(found == cudaDriverEntryPointSuccess && f != nullptr, errc::cuda,
                  "the CUDA driver has no cuMemGetAddressRange");
    return reinterpret_cast<fn_t>(f);
  }();
  return fn(base, size, p);
}

}  // namespace

ipc_export export_ipc_allocation(void* base, std::string_view what) {
  ipc_export e;
  const cudaError_t st = cudaIpcGetMemHandle(&e.handle, base);
  MOEBIUS_CHECK(st == cudaSuccess, errc::cuda, "cannot export a CUDA IPC handle of ", what,
                ": cudaIpcGetMemHandle failed: ", cudaGetErrorName(st), " (",
                cudaGetErrorString(st), ")");
  return e;
}

ipc_export export_ipc_pointer(void* p, std::string_view what) {
  CUdeviceptr alloc_base = 0;
  size_t alloc_size = 0;
  const CUresult st =
      mem_get_address_range(&alloc_base, &alloc_size, reinterpret_cast<CUdeviceptr>(p));
  MOEBIUS_CHECK(st == CUDA_SUCCESS, errc::cuda, "cannot find the allocation of ", what,
                " to export it: cuMemGetAddressRange failed: CUresult ", static_cast<int>(st));
  ipc_export e = export_ipc_allocation(reinterpret_cast<void*>(alloc_base), what);
  e.offset = static_cast<int64_t>(reinterpret_cast<CUdeviceptr>(p) - alloc_base);
  return e;
}

void* open_ipc_memory(const cudaIpcMemHandle_t& handle, std::string_view what) {
  void* base = nullptr;
  const cudaError_t st = cudaIpcOpenMemHandle(&base, handle, cudaIpcMemLazyEnablePeerAccess);
  MOEBIUS_CHECK(st == cudaSuccess, errc::cuda, "cannot open the CUDA IPC handle of ", what, ": ",
                cudaGetErrorName(st), " (", cudaGetErrorString(st), ")");
  return base;
}

}  // namespace moebius::detail
