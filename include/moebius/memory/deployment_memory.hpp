#pragma once

// The owner of a deployment's memory (DESIGN.md §2 item 4, §3): for each rank this process
// drives, one allocation of the expert arena (arena_geometry::total_bytes()) and one of the KV
// pool (kv_geometry::pool_bytes()), made once, never moved, never freed while the owner lives,
// so that CUDA graphs captured against their addresses stay valid across every switch. The
// owner hands out
//   - rank_memory, the type every transport takes (memory(i), ranks());
//   - typed views: where tensor t of layer l sits in the arena in a given mode (the slot of
//     arena_geometry::slot_of), and the KV pool's regions;
//   - the arena cursor the layers rest at (set by the engine from switch_report::cursor).
//
// deployment_memory holds what every owner shares; host_deployment_memory allocates host memory
// (CPU tests, CI, a host-side engine); device_deployment_memory
// (memory/device_deployment_memory.hpp, Moebius::cuda) allocates device memory and exports
// CUDA IPC handles.
//
//   Two host ranks of a small model (arena and kv made for P = 2), the engine reading layer
//   2's w2 in TP:
//     host_deployment_memory mem(arena, kv);  // P comes from the geometries; zero-filled
//     tensor_slab w2 = mem.weights(0, 2, parallel_mode::tp)[weight_tensor::w2];
//     // w2.data == mem.memory(0).space(memory_space::arena).data() + w2.offset,
//     // w2.offset == arena.tensor_base(parallel_mode::tp, 2, weight_tensor::w2)

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "moebius/kv/kv_geometry.hpp"
#include "moebius/layout/arena_geometry.hpp"
#include "moebius/memory/rank_memory.hpp"

namespace moebius {

// A range of one rank's memory: [data, data + bytes), `offset` bytes from the start of its
// memory space. Device memory when the rank's memory is on a device.
struct tensor_slab {
  std::byte* data = nullptr;
  int64_t offset = 0;
  int64_t bytes = 0;
};

// One layer's expert tensors on one rank in one mode. An absent scale tensor has bytes 0.
struct layer_weights {
  int64_t layer = 0;
  parallel_mode mode = parallel_mode::ep;
  int64_t slot = 0;  // arena_geometry::slot_of(mode, layer)
  tensor_slab tensors[num_weight_tensors] = {};

  const tensor_slab& operator[](weight_tensor t) const { return tensors[static_cast<int>(t)]; }
};

class deployment_memory {
 public:
  deployment_memory(const deployment_memory&) = delete;
  deployment_memory& operator=(const deployment_memory&) = delete;
  virtual ~deployment_memory() = default;

  const arena_geometry& arena() const { return arena_; }
  const kv_geometry& kv() const { return kv_; }

  // The ranks this process holds memory for, ascending (every rank for a host or
  // single-process owner); index i of memory() and the views is local_ranks()[i].
  const std::vector<int>& local_ranks() const { return local_ranks_; }
  int num_local_ranks() const { return static_cast<int>(local_ranks_.size()); }

  // The memory of local rank `i`, as transports take it. Throws errc::out_of_range on a bad i.
  const rank_memory& memory(int i) const;
  const std::vector<rank_memory>& ranks() const { return ranks_; }

  // Where each tensor of `layer` lives on local rank `i` when the layer is in `mode`.
  //   L=4: weights(i, 2, tp) is slot 2, weights(i, 2, ep) is slot 3 (DESIGN.md §3).
  // Throws errc::out_of_range unless 0 <= layer < L and i is a local rank index.
  layer_weights weights(int i, int64_t layer, parallel_mode mode) const;
  // The same, in the mode the cursor puts `layer` in (arena_geometry::mode_of).
  layer_weights weights(int i, int64_t layer) const {
    return weights(i, layer, arena_geometry::mode_of(cursor_, layer));
  }

  // The whole KV pool of local rank i, and one layer's K or V region in it (both views read
  // the same region: kv_geometry::tensor_offset). The region is the present layout's
  // (kv_pool_layout.hpp); a pool the engine lays out otherwise is addressed by its layout.
  // Throws errc::out_of_range on bad indices (and for V of a latent pool).
  tensor_slab kv_pool(int i) const;
  tensor_slab kv_region(int i, int64_t layer, kv_tensor t) const;

  // The cursor the arena rests at: TP layers [0, tp_layers), EP the rest. The owner does not
  // move bytes; the engine records here where its switcher left them (switch_report::cursor).
  arena_cursor cursor() const { return cursor_; }
  // Throws errc::invalid_argument unless 0 <= tp_layers <= L.
  void set_cursor(arena_cursor c);

 protected:
  // Validates both geometries and that `local_ranks` are distinct ranks in [0, P).
  deployment_memory(const arena_geometry& arena, const kv_geometry& kv,
                    std::vector<int> local_ranks, arena_cursor cursor);

  arena_geometry arena_;
  kv_geometry kv_;
  std::vector<int> local_ranks_;
  std::vector<rank_memory> ranks_;  // filled by the derived owner once it has allocated
  arena_cursor cursor_;
};

// What fresh host memory holds: zeros, or a poison byte pattern (0xA5) that makes a read of
// bytes nobody wrote stand out in a test.
enum class memory_fill : uint8_t { zero, poison };

inline constexpr std::byte memory_poison_byte{0xA5};
// Alignment of every host allocation: a cache line, and enough for 16-byte vector copies.
inline constexpr int64_t host_memory_alignment = 64;

// Host memory for all P ranks of a deployment (local ranks 0..P-1): per rank one 64-byte
// aligned arena and one KV pool (none when kv.pool_bytes() is 0), filled per `fill`.
// Throws errc::invalid_argument when the geometries disagree on P or are invalid.
class host_deployment_memory final : public deployment_memory {
 public:
  host_deployment_memory(const arena_geometry& arena, const kv_geometry& kv,
                         memory_fill fill = memory_fill::zero, arena_cursor cursor = {});
  ~host_deployment_memory() override;

 private:
  std::vector<void*> allocations_;
};

}  // namespace moebius
