#include "moebius/memory/deployment_memory.hpp"

#include <cstdlib>
#include <cstring>
#include <new>
#include <utility>

#include "moebius/error.hpp"

namespace moebius {

deployment_memory::deployment_memory(const arena_geometry& arena, const kv_geometry& kv,
                                     std::vector<int> local_ranks, arena_cursor cursor)
    : arena_(arena), kv_(kv), local_ranks_(std::move(local_ranks)), cursor_(cursor) {
  validate(arena_, cursor_);
  validate(kv_);
  MOEBIUS_CHECK(arena_.num_ranks == kv_.num_ranks, errc::invalid_argument,
                "deployment memory: the arena and the KV pool disagree on the rank count "
                "(arena P=", arena_.num_ranks, ", kv P=", kv_.num_ranks, ")");
  MOEBIUS_CHECK(!local_ranks_.empty(), errc::invalid_argument,
                "deployment memory: no local rank");
  for (size_t i = 0; i < local_ranks_.size(); ++i) {
    const int r = local_ranks_[i];
    MOEBIUS_CHECK(r >= 0 && r < arena_.num_ranks, errc::invalid_argument,
                  "deployment memory: local rank ", r, " is outside [0, P=", arena_.num_ranks,
                  ")");
    MOEBIUS_CHECK(i == 0 || local_ranks_[i - 1] < r, errc::invalid_argument,
                  "deployment memory: local ranks must be distinct and ascending (", 
                  local_ranks_[i - 1], " then ", r, ")");
  }
}

const rank_memory& deployment_memory::memory(int i) const {
  MOEBIUS_CHECK(i >= 0 && i < num_local_ranks(), errc::out_of_range,
                "deployment memory: local rank index ", i, " outside [0, ", num_local_ranks(),
                ")");
  return ranks_[static_cast<size_t>(i)];
}

layer_weights deployment_memory::weights(int i, int64_t layer, parallel_mode mode) const {
  const rank_memory& m = memory(i);
  MOEBIUS_CHECK(layer >= 0 && layer < arena_.shape.num_layers, errc::out_of_range,
                "deployment memory: layer ", layer, " outside [0, L=", arena_.shape.num_layers,
                ")");
  layer_weights w;
  w.layer = layer;
  w.mode = mode;
  w.slot = arena_geometry::slot_of(mode, layer);
  std::byte* base = m.space(memory_space::arena).data();
  for (weight_tensor t : all_weight_tensors) {
    tensor_slab& s = w.tensors[static_cast<int>(t)];
    s.offset = arena_.tensor_base(mode, layer, t);
    s.bytes = arena_.tensor_bytes[static_cast<int>(t)];
    s.data = base + s.offset;
  }
  return w;
}

tensor_slab deployment_memory::kv_pool(int i) const {
  const memory_span& sp = memory(i).space(memory_space::kv_pool);
  return {sp.data(), 0, sp.bytes};
}

tensor_slab deployment_memory::kv_region(int i, int64_t layer, kv_tensor t) const {
  const memory_span& sp = memory(i).space(memory_space::kv_pool);
  MOEBIUS_CHECK(layer >= 0 && layer < kv_.num_layers, errc::out_of_range,
                "deployment memory: KV layer ", layer, " outside [0, ", kv_.num_layers, ")");
  MOEBIUS_CHECK(static_cast<int64_t>(t) < kv_.kv_tensors(), errc::out_of_range,
                "deployment memory: a latent KV pool has no V tensor");
  const int64_t offset = kv_.tensor_offset(layer, t);
  return {sp.data() + offset, offset, kv_.region_bytes()};
}

void deployment_memory::set_cursor(arena_cursor c) {
  validate(arena_, c);
  cursor_ = c;
}

namespace {

std::vector<int> all_ranks(int num_ranks) {
  std::vector<int> r(static_cast<size_t>(num_ranks > 0 ? num_ranks : 0));
  for (int i = 0; i < num_ranks; ++i) r[static_cast<size_t>(i)] = i;
  return r;
}

// 64-byte aligned, `bytes` rounded up to the alignment (std::aligned_alloc's rule); nullptr
// for 0 bytes.
void* allocate_host(int64_t bytes, memory_fill fill, const char* what, int rank) {
  if (bytes == 0) return nullptr;
  const auto rounded = static_cast<size_t>((bytes + host_memory_alignment - 1) /
                                           host_memory_alignment * host_memory_alignment);
  void* p = std::aligned_alloc(static_cast<size_t>(host_memory_alignment), rounded);
  MOEBIUS_CHECK(p != nullptr, errc::capacity, "host deployment memory: cannot allocate the ",
                what, " of rank ", rank, " (", bytes, " bytes)");
  std::memset(p, fill == memory_fill::zero ? 0 : static_cast<int>(memory_poison_byte), rounded);
  return p;
}

}  // namespace

host_deployment_memory::host_deployment_memory(const arena_geometry& arena,
                                               const kv_geometry& kv, memory_fill fill,
                                               arena_cursor cursor)
    : deployment_memory(arena, kv, all_ranks(arena.num_ranks), cursor) {
  // Allocate everything before publishing anything: a failure frees what was taken.
  try {
    for (int r = 0; r < arena_.num_ranks; ++r) {
      void* a = allocate_host(arena_.total_bytes(), fill, "arena", r);
      allocations_.push_back(a);
      void* k = allocate_host(kv_.pool_bytes(), fill, "KV pool", r);
      allocations_.push_back(k);
      ranks_.push_back(rank_memory::host(
          {static_cast<std::byte*>(a), static_cast<size_t>(arena_.total_bytes())},
          {static_cast<std::byte*>(k), static_cast<size_t>(kv_.pool_bytes())}));
    }
  } catch (...) {
    for (void* p : allocations_) std::free(p);
    throw;
  }
}

host_deployment_memory::~host_deployment_memory() {
  for (void* p : allocations_) std::free(p);
}

}  // namespace moebius
