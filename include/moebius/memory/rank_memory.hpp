#pragma once

// One rank's memory as every transport sees it: for each memory space (the expert arena, the
// KV pool) where it starts and how many bytes it has, and whether it lives in host memory or
// on a CUDA device. The host, CUDA peer and NCCL transports all take this type, and all run
// the same checks on it (validate_rank_memory, validate_plan_fits) in every construction path.
//
//   rank 1 of a 2-GPU deployment, 20 GiB arena and 16 GiB KV pool on device 1:
//     rank_memory m = rank_memory::on_device(1, d_arena, 20 << 30, d_kv, 16 << 30);

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <ranges>
#include <span>

#include "moebius/plan/plan.hpp"

namespace moebius {

// The `device` of host memory.
inline constexpr int host_memory_device = -1;

// A range of bytes: [base, base + bytes). An absent space is {nullptr, 0}.
struct memory_span {
  void* base = nullptr;
  int64_t bytes = 0;

  memory_span() = default;
  memory_span(void* base_, int64_t bytes_) : base(base_), bytes(bytes_) {}
  // Any contiguous range of mutable bytes (std::span<std::byte>, std::vector<std::byte>).
  template <class Range>
    requires std::ranges::contiguous_range<Range> &&
             std::same_as<std::ranges::range_value_t<Range>, std::byte>
  memory_span(Range&& r)  // NOLINT(google-explicit-constructor): a span of bytes is a span
      : base(std::ranges::data(r)), bytes(static_cast<int64_t>(std::ranges::size(r))) {}

  std::byte* data() const { return static_cast<std::byte*>(base); }
  bool empty() const { return bytes == 0; }
  friend bool operator==(const memory_span&, const memory_span&) = default;
};

struct rank_memory {
  int device = host_memory_device;           // CUDA ordinal, or host_memory_device
  memory_span spaces[num_memory_spaces] = {};  // indexed by memory_space

  const memory_span& space(memory_space s) const { return spaces[static_cast<int>(s)]; }
  memory_span& space(memory_space s) { return spaces[static_cast<int>(s)]; }

  // Host memory: the arena and (optionally) the KV pool.
  static rank_memory host(std::span<std::byte> arena, std::span<std::byte> kv_pool = {});
  // Device memory of CUDA device `device` (pointers from cudaMalloc, or ranges inside one).
  static rank_memory on_device(int device, void* arena, int64_t arena_bytes,
                               void* kv_pool = nullptr, int64_t kv_pool_bytes = 0);

  friend bool operator==(const rank_memory&, const rank_memory&) = default;
};

// The checks every transport runs on its ranks' memory before it accepts them. Throws
// errc::invalid_argument naming the rank and space unless: there is at least one rank; every
// space has bytes >= 0, a non-null base when bytes > 0, and base + bytes does not wrap; every
// rank's device is host_memory_device or >= 0 (`require_device`: >= 0, for GPU transports;
// `require_host`: host_memory_device, for the host transport); and no two spaces overlap,
// within one rank or between ranks (a copy between them would overwrite its own source).
// Pointers are compared as addresses of this process: host pointers, or device pointers under
// unified addressing (distinct allocations never share an address, also across devices; a
// peer's CUDA IPC mapping is compared as mapped here, so two ranks that exported the same
// allocation are caught).
enum class memory_kind_rule : uint8_t { any, require_host, require_device };
void validate_rank_memory(std::span<const rank_memory> ranks,
                          memory_kind_rule rule = memory_kind_rule::any);

// Bytes of memory space `s` that every rank has: the smallest over `ranks` (ranks of one
// deployment normally have equal spaces; a plan must fit the smallest).
int64_t common_space_bytes(std::span<const rank_memory> ranks, memory_space s);

// Throws errc::invalid_argument unless `p` is for `num_ranks` ranks, and (through
// validate(plan, sizes) in plan.hpp: errc::invalid_argument / errc::out_of_range) unless every
// op fits the smallest rank's space it touches. `ranks` may be the local ranks only, when the
// deployment guarantees equal spaces (multi-process transports exchange sizes at setup).
void validate_plan_fits(const plan& p, int num_ranks, std::span<const rank_memory> ranks);

}  // namespace moebius
