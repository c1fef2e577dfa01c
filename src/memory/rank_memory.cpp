#include "moebius/memory/rank_memory.hpp"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "moebius/error.hpp"

namespace moebius {

rank_memory rank_memory::host(std::span<std::byte> arena, std::span<std::byte> kv_pool) {
  rank_memory m;
  m.device = host_memory_device;
  m.space(memory_space::arena) = {arena.data(), static_cast<int64_t>(arena.size())};
  m.space(memory_space::kv_pool) = {kv_pool.data(), static_cast<int64_t>(kv_pool.size())};
  return m;
}

rank_memory rank_memory::on_device(int device, void* arena, int64_t arena_bytes, void* kv_pool,
                                   int64_t kv_pool_bytes) {
  rank_memory m;
  m.device = device;
  m.space(memory_space::arena) = {arena, arena_bytes};
  m.space(memory_space::kv_pool) = {kv_pool, kv_pool_bytes};
  return m;
}

namespace {

struct extent {
  uintptr_t begin = 0;
  uintptr_t end = 0;
  int rank = 0;
  int space = 0;
};

}  // namespace

void validate_rank_memory(std::span<const rank_memory> ranks, memory_kind_rule rule) {
  MOEBIUS_CHECK(!ranks.empty(), errc::invalid_argument, "a transport needs at least one rank");
  std::vector<extent> extents;
  for (size_t r = 0; r < ranks.size(); ++r) {
    const rank_memory& m = ranks[r];
    MOEBIUS_CHECK(m.device >= host_memory_device, errc::invalid_argument, "rank ", r,
                  ": device ", m.device, " is neither a CUDA ordinal (>= 0) nor host memory (-1)");
    MOEBIUS_CHECK(rule != memory_kind_rule::require_host || m.device == host_memory_device,
                  errc::invalid_argument, "rank ", r, ": this transport moves host memory, but "
                  "the rank's memory is on device ", m.device);
    MOEBIUS_CHECK(rule != memory_kind_rule::require_device || m.device >= 0,
                  errc::invalid_argument, "rank ", r, ": this transport moves device memory, "
                  "but the rank's memory is host memory (device -1)");
    for (int s = 0; s < num_memory_spaces; ++s) {
      const memory_span& sp = m.spaces[s];
      const char* name = to_string(static_cast<memory_space>(s));
      MOEBIUS_CHECK(sp.bytes >= 0, errc::invalid_argument, "rank ", r, " ", name,
                    ": negative size (", sp.bytes, " bytes)");
      if (sp.bytes == 0) continue;
      MOEBIUS_CHECK(sp.base != nullptr, errc::invalid_argument, "rank ", r, " ", name,
                    ": null base with ", sp.bytes, " bytes");
      const auto begin = reinterpret_cast<uintptr_t>(sp.base);
      MOEBIUS_CHECK(static_cast<uint64_t>(sp.bytes) <= std::numeric_limits<uintptr_t>::max() - begin,
                    errc::invalid_argument, "rank ", r, " ", name, ": base + ", sp.bytes,
                    " bytes wraps around the address space");
      extents.push_back({begin, begin + static_cast<uintptr_t>(sp.bytes), static_cast<int>(r), s});
    }
  }
  std::sort(extents.begin(), extents.end(),
            [](const extent& a, const extent& b) { return a.begin < b.begin; });
  for (size_t i = 1; i < extents.size(); ++i) {
    const extent& a = extents[i - 1];
    const extent& b = extents[i];
    MOEBIUS_CHECK(a.end <= b.begin, errc::invalid_argument, "rank ", a.rank, " ",
                  to_string(static_cast<memory_space>(a.space)), " and rank ", b.rank, " ",
                  to_string(static_cast<memory_space>(b.space)),
                  " overlap: every space of every rank must be its own memory");
  }
}

int64_t common_space_bytes(std::span<const rank_memory> ranks, memory_space s) {
  int64_t bytes = ranks.empty() ? 0 : std::numeric_limits<int64_t>::max();
  for (const rank_memory& m : ranks) bytes = std::min(bytes, m.space(s).bytes);
  return bytes;
}

void validate_plan_fits(const plan& p, int num_ranks, std::span<const rank_memory> ranks) {
  MOEBIUS_CHECK(p.num_ranks == num_ranks, errc::invalid_argument, "the plan is for ",
                p.num_ranks, " ranks but the transport has ", num_ranks);
  int64_t sizes[num_memory_spaces];
  for (int s = 0; s < num_memory_spaces; ++s) {
    sizes[s] = common_space_bytes(ranks, static_cast<memory_space>(s));
  }
  validate(p, sizes);
}

}  // namespace moebius
