#pragma once

// The unit of every plan: one strided copy from one rank's memory to another's.

#include <cstdint>
#include <iosfwd>

#include "moebius/detail/host_device.hpp"
#include "moebius/plan/memory_space.hpp"

namespace moebius {

// Copies `rows` rows of `row_bytes` bytes: row j goes from
//   src_rank's src_space + src_offset + j * src_pitch
// to
//   dst_rank's dst_space + dst_offset + j * dst_pitch.
// All offsets and sizes are 64-bit bytes. rows == 1 is a plain contiguous copy (pitches are
// then ignored, and builders set them to row_bytes). Trivially copyable: transports upload
// ops to device memory as they are.
struct copy_op {
  int64_t src_offset = 0;
  int64_t dst_offset = 0;
  int64_t rows = 1;
  int64_t row_bytes = 0;
  int64_t src_pitch = 0;
  int64_t dst_pitch = 0;
  int32_t src_rank = 0;
  int32_t dst_rank = 0;
  memory_space src_space = memory_space::arena;
  memory_space dst_space = memory_space::arena;

  MOEBIUS_HOST_DEVICE constexpr int64_t bytes() const { return rows * row_bytes; }
  MOEBIUS_HOST_DEVICE constexpr bool is_local() const { return src_rank == dst_rank; }
  // One past the last byte touched at the source / destination.
  MOEBIUS_HOST_DEVICE constexpr int64_t src_end() const {
    return src_offset + (rows - 1) * src_pitch + row_bytes;
  }
  MOEBIUS_HOST_DEVICE constexpr int64_t dst_end() const {
    return dst_offset + (rows - 1) * dst_pitch + row_bytes;
  }

  friend constexpr bool operator==(const copy_op&, const copy_op&) = default;
};

// "3->1 arena[4096 +2x512/1024] -> arena[0 +2x512/512]"
std::ostream& operator<<(std::ostream& os, const copy_op& op);

}  // namespace moebius
