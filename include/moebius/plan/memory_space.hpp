#pragma once

// The per-rank allocations a copy_op's offsets refer to: every rank holds one of each
// (rank_memory), and a plan names the space of both ends of each copy.

#include <cstdint>

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

}  // namespace moebius
