#pragma once

// MOEBIUS_NCCL_CHECK(expr): evaluates an NCCL call and throws moebius::error(errc::nccl) naming
// the call, NCCL's result code and ncclGetErrorString when it does not return ncclSuccess.
//   MOEBIUS_NCCL_CHECK(ncclSend(buf, n, ncclUint8, peer, comm, stream));
//   -> "moebius nccl: ncclSend(buf, n, ncclUint8, peer, comm, stream) failed: unhandled cuda
//       error (result 1) (nccl_transport.cpp:123)"

#include <nccl.h>

#include "moebius/error.hpp"

#define MOEBIUS_NCCL_CHECK(expr)                                                                \
  do {                                                                                          \
    const ncclResult_t moebius_nccl_result_ = (expr);                                           \
    if (moebius_nccl_result_ != ncclSuccess) [[unlikely]] {                                     \
      ::moebius::detail::throw_error(::moebius::errc::nccl, __FILE__, __LINE__, #expr,          \
                                     " failed: ", ncclGetErrorString(moebius_nccl_result_),     \
                                     " (result ", static_cast<int>(moebius_nccl_result_), ")"); \
    }                                                                                           \
  } while (0)
