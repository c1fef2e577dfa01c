#pragma once

// Internal: the strided device copy nccl_transport uses to pack strided rows into its staging
// workspace, unpack them on the receiver, and run strided local ops. Not part of the API.

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace moebius::detail {

// Copies `rows` rows of `row_bytes` bytes: row j from src + j*src_pitch to dst + j*dst_pitch.
// Source and destination are on the current device (or peer-accessible from it) and do not
// overlap. Pack: dst_pitch = row_bytes; unpack: src_pitch = row_bytes.
//   rows=3, row_bytes=4, src_pitch=8, dst_pitch=4: src bytes [0,4) [8,12) [16,20) -> dst [0,12)
struct strided_copy_args {
  const std::byte* src = nullptr;
  std::byte* dst = nullptr;
  int64_t rows = 0;
  int64_t row_bytes = 0;
  int64_t src_pitch = 0;
  int64_t dst_pitch = 0;
};

// Enqueues the copy on `stream` (on the current device); moves the widest vector (16, 8, 4
// or 1 bytes) that every address, row size and pitch is a multiple of. A no-op for an empty
// copy. Throws errc::cuda when the launch fails.
void launch_strided_copy(const strided_copy_args& args, cudaStream_t stream);

}  // namespace moebius::detail
