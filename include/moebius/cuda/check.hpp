#pragma once

// Checks for CUDA runtime and driver calls: a failed call throws moebius::error(errc::cuda)
// naming the call, the error's name and its description, e.g.
//   moebius cuda: cudaMalloc(&p, bytes) failed: cudaErrorMemoryAllocation (out of memory) (f.cpp:12)

#include <cuda.h>
#include <cuda_runtime_api.h>

#include "moebius/error.hpp"

namespace moebius::detail {

[[noreturn]] inline void throw_cuda_error(cudaError_t status, const char* call, const char* file,
                                          int line) {
  throw_error(errc::cuda, file, line, call, " failed: ", cudaGetErrorName(status), " (",
              cudaGetErrorString(status), ")");
}

// Driver API calls reach us through cudaGetDriverEntryPointByVersion (Moebius never links
// libcuda, so its binaries load on machines without a driver); the name of a CUresult would
// need another driver call, so the message carries its number (see cuda.h).
[[noreturn]] inline void throw_cu_error(CUresult status, const char* call, const char* file,
                                        int line) {
  throw_error(errc::cuda, file, line, call, " failed: CUresult ", static_cast<int>(status));
}

// The one launch-error idiom of every kernel launcher: right after `kernel<<<...>>>(...)`,
//   detail::check_launch("peer_copy");
// throws errc::cuda naming the kernel when the launch failed (bad configuration, no kernel
// image for this GPU, a sticky error from earlier work).
inline void check_launch(const char* kernel) {
  const cudaError_t status = cudaGetLastError();
  if (status != cudaSuccess) [[unlikely]] {
    throw_error(errc::cuda, __FILE__, __LINE__, "launching kernel ", kernel, " failed: ",
                cudaGetErrorName(status), " (", cudaGetErrorString(status), ")");
  }
}

}  // namespace moebius::detail

// MOEBIUS_CUDA_CHECK(cudaMemcpyAsync(...)): throws errc::cuda unless the runtime call
// returns cudaSuccess.
#define MOEBIUS_CUDA_CHECK(expr)                                                     \
  do {                                                                               \
    const cudaError_t moebius_cuda_status_ = (expr);                                 \
    if (moebius_cuda_status_ != cudaSuccess) [[unlikely]] {                          \
      ::moebius::detail::throw_cuda_error(moebius_cuda_status_, #expr, __FILE__, __LINE__); \
    }                                                                                \
  } while (0)

// MOEBIUS_CU_CHECK(cuMemGetAddressRange(...)): the same for driver API calls (CUresult).
#define MOEBIUS_CU_CHECK(expr)                                                       \
  do {                                                                               \
    const CUresult moebius_cu_status_ = (expr);                                      \
    if (moebius_cu_status_ != CUDA_SUCCESS) [[unlikely]] {                           \
      ::moebius::detail::throw_cu_error(moebius_cu_status_, #expr, __FILE__, __LINE__); \
    }                                                                                \
  } while (0)
