#pragma once

// The unit of every plan: one strided copy from one rank's memory to another's.

#include <cstdint>
#include <iosfwd>

#include "moebius/detail/host_device.hpp"

namespace moebius {

// Which per-rank allocation an offset refers to.
enum class memory_space : uint8_t {
  arena,    // the expert-weight arena (arena_geometry)
  kv_pool,  // the paged KV cache pool
};

inline constexpr int num_memory_spaces = 2;

constexpr bool is_valid(memory_space s) {
  return s == memory_space::arena || s == memory_space::kv_pool;
}

constexpr const char* to_string(memory_space s) {
  switch (s) {
    case memory_space::arena: return "arena";
    case memory_space::kv_pool: return "kv_pool";
  }
  return "unknown";
}

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
