// The host owner of a deployment's memory: its views must address exactly the bytes a static
// deployment loader (tests/support/reference, independent of the library's views) puts there,
// for every layer, mode and tensor; its rank_memory must pass the transports' checks.
#include <cstdint>
#include <cstring>
#include <random>

#include "moebius/error.hpp"
#include "moebius/memory/deployment_memory.hpp"
#include "support/catch.hpp"
#include "support/random.hpp"
#include "support/reference.hpp"

using namespace moebius;
using moebius::testing::test_seed;
using moebius::testing::uniform;

namespace {

kv_geometry small_kv(int P, std::mt19937_64& rng) {
  // H_kv in {P, 2P} (or latent), a few pages: small, valid for every P.
  const int64_t heads = testing::coin(rng) ? 0 : P * uniform(rng, 1, 2);
  return make_kv_geometry(uniform(rng, 1, 3), heads, 8 * uniform(rng, 1, 4),
                          uniform(rng, 1, 4), uniform(rng, 1, 5), P);
}

}  // namespace

TEST_CASE("host owner: views address the bytes a static load puts there", "[memory]") {
  std::mt19937_64 rng(test_seed());
  for (int iter = 0; iter < 24; ++iter) {
    const int P = static_cast<int>(int64_t{1} << uniform(rng, 0, 3));
    const expert_shape shape = testing::random_shape(rng, P, testing::coin(rng));
    const arena_geometry g = testing::random_geometry(rng, shape, P);
    const kv_geometry kv = small_kv(P, rng);
    const arena_cursor cursor = testing::random_cursor(rng, g);
    host_deployment_memory mem(g, kv, memory_fill::poison, cursor);
    INFO("P=" << P << " L=" << shape.num_layers << " cursor=" << cursor.tp_layers);

    REQUIRE(mem.num_local_ranks() == P);
    REQUIRE(mem.cursor() == cursor);
    // Load a static deployment at `cursor` with the reference, copy it into the owner.
    const testing::logical_weights w = testing::random_weights(shape, rng);
    testing::rank_images images;
    testing::load_reference(w, g, cursor, images);
    for (int r = 0; r < P; ++r) {
      const memory_span& a = mem.memory(r).space(memory_space::arena);
      REQUIRE(a.bytes == g.total_bytes());
      REQUIRE(reinterpret_cast<uintptr_t>(a.base) % host_memory_alignment == 0);
      std::memcpy(a.base, images[static_cast<size_t>(r)].data(),
                  static_cast<size_t>(a.bytes));
    }
    // Every element of every tensor of every layer, read through the owner's view of the mode
    // the cursor puts the layer in, holds the logical element (sampled elements per tensor).
    for (int64_t l = 0; l < shape.num_layers; ++l) {
      const parallel_mode mode = arena_geometry::mode_of(cursor, l);
      for (weight_tensor t : all_weight_tensors) {
        const tensor_geometry tg = geometry_of(shape, t);
        if (tg.bytes() == 0) continue;
        for (int s = 0; s < 16; ++s) {
          const int64_t e = uniform(rng, 0, tg.num_experts - 1);
          const int64_t row = uniform(rng, 0, tg.rows - 1);
          const int64_t col = uniform(rng, 0, tg.cols - 1);
          const testing::reference_home h =
              testing::reference_home_of(shape, P, t, mode, e, row, col);
          const layer_weights view = mem.weights(h.rank, l);
          REQUIRE(view.mode == mode);
          REQUIRE(view.slot == (mode == parallel_mode::tp ? l : l + 1));
          const tensor_slab& slab = view[t];
          REQUIRE(h.byte + tg.elem_bytes <= slab.bytes);
          const std::byte* logical =
              w.layers[static_cast<size_t>(l)][static_cast<int>(t)].data() +
              ((e * tg.rows + row) * tg.cols + col) * tg.elem_bytes;
          REQUIRE(std::memcmp(slab.data + h.byte, logical, static_cast<size_t>(tg.elem_bytes)) ==
                  0);
          REQUIRE(slab.data == mem.memory(h.rank).space(memory_space::arena).data() + slab.offset);
        }
      }
    }
    // Both modes of every layer: the tensors of one slot do not overlap, stay inside the slot,
    // and the TP and EP views of layer l sit one slot apart.
    for (int r = 0; r < P; ++r) {
      for (int64_t l = 0; l < shape.num_layers; ++l) {
        const layer_weights tp = mem.weights(r, l, parallel_mode::tp);
        const layer_weights ep = mem.weights(r, l, parallel_mode::ep);
        int64_t end = g.slot_offset(tp.slot);
        for (weight_tensor t : all_weight_tensors) {
          REQUIRE(tp[t].offset >= end);
          end = tp[t].offset + tp[t].bytes;
          REQUIRE(ep[t].offset - tp[t].offset == g.slot_bytes);
          REQUIRE(tp[t].bytes == ep[t].bytes);
        }
        REQUIRE(end <= g.slot_offset(tp.slot + 1));
      }
    }
    // KV: one region per layer and tensor, tiling the pool, poisoned when fresh.
    for (int r = 0; r < P; ++r) {
      const tensor_slab pool = mem.kv_pool(r);
      REQUIRE(pool.bytes == kv.pool_bytes());
      int64_t next = 0;
      for (int64_t l = 0; l < kv.num_layers; ++l) {
        for (int64_t t = 0; t < kv.kv_tensors(); ++t) {
          const tensor_slab reg = mem.kv_region(r, l, static_cast<kv_tensor>(t));
          REQUIRE(reg.offset == next);
          REQUIRE(reg.data == pool.data + reg.offset);
          next += reg.bytes;
        }
      }
      REQUIRE(next == pool.bytes);
      for (int64_t b = 0; b < pool.bytes; ++b) REQUIRE(pool.data[b] == memory_poison_byte);
    }
    REQUIRE_NOTHROW(validate_rank_memory(mem.ranks(), memory_kind_rule::require_host));
  }
}

TEST_CASE("host owner: zero fill, cursor, refusals", "[memory]") {
  std::mt19937_64 rng(test_seed());
  const expert_shape shape = testing::random_shape(rng, 2, false);
  const arena_geometry g = make_arena_geometry(shape, 2);
  const kv_geometry kv = make_kv_geometry(2, 2, 16, 4, 3, 2);
  host_deployment_memory mem(g, kv);
  for (int r = 0; r < 2; ++r) {
    const memory_span& a = mem.memory(r).space(memory_space::arena);
    for (int64_t b = 0; b < a.bytes; ++b) REQUIRE(a.data()[b] == std::byte{0});
  }
  // The layer's mode follows the cursor.
  mem.set_cursor(arena_cursor{shape.num_layers});
  CHECK(mem.weights(0, 0).mode == parallel_mode::tp);
  mem.set_cursor(arena_cursor{0});
  CHECK(mem.weights(0, 0).mode == parallel_mode::ep);
  CHECK_THROWS_AS(mem.set_cursor(arena_cursor{shape.num_layers + 1}), moebius::error);
  CHECK_THROWS_AS(mem.memory(2), moebius::error);
  CHECK_THROWS_AS(mem.weights(0, shape.num_layers, parallel_mode::tp), moebius::error);
  CHECK_THROWS_AS(mem.kv_region(0, 2, kv_tensor::k), moebius::error);
  // Geometries for different rank counts are refused.
  const kv_geometry kv4 = make_kv_geometry(2, 4, 16, 4, 3, 4);
  CHECK_THROWS_AS(host_deployment_memory(g, kv4), moebius::error);
}
