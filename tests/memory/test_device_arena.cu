// The device owner (label gpu; skipped without a device): per rank one arena and one KV pool
// on the rank's device, filled as asked, with views at the same offsets as the host owner's,
// memory the transports accept, and IPC handles for every space. (Opening a handle needs a
// second process: tests/transport/test_cuda_ipc.cu covers that path through the transport.)
#include <cuda_runtime_api.h>

#include <cstdint>
#include <vector>

#include "moebius/cuda/check.hpp"
#include "moebius/error.hpp"
#include "moebius/memory/device_deployment_memory.hpp"
#include "moebius/memory/device_rank_ipc.hpp"
#include "support/catch.hpp"

using namespace moebius;

TEST_CASE("device owner: allocation, fill, views, IPC export", "[memory][gpu]") {
  expert_shape shape;
  shape.num_layers = 3;
  shape.num_experts = 8;
  shape.hidden = 64;
  shape.intermediate = 32;
  const int P = 2;
  const arena_geometry g = make_arena_geometry(shape, P);
  const kv_geometry kv = make_kv_geometry(3, 2, 64, 4, 5, P);
  device_deployment_memory mem(g, kv, {0, 0}, {}, memory_fill::poison);
  host_deployment_memory host(g, kv);
  REQUIRE(mem.num_local_ranks() == P);
  REQUIRE_NOTHROW(validate_rank_memory(mem.ranks(), memory_kind_rule::require_device));
  for (int r = 0; r < P; ++r) {
    REQUIRE(mem.device_of(r) == 0);
    const memory_span& a = mem.memory(r).space(memory_space::arena);
    REQUIRE(a.bytes == g.total_bytes());
    std::vector<std::byte> back(static_cast<size_t>(a.bytes));
    MOEBIUS_CUDA_CHECK(cudaMemcpy(back.data(), a.base, back.size(), cudaMemcpyDeviceToHost));
    for (std::byte b : back) REQUIRE(b == memory_poison_byte);
    for (int64_t l = 0; l < shape.num_layers; ++l) {
      for (parallel_mode m : {parallel_mode::ep, parallel_mode::tp}) {
        for (weight_tensor t : all_weight_tensors) {
          REQUIRE(mem.weights(r, l, m)[t].offset == host.weights(r, l, m)[t].offset);
          REQUIRE(mem.weights(r, l, m)[t].data == a.data() + host.weights(r, l, m)[t].offset);
        }
      }
    }
    const device_rank_ipc h = mem.export_ipc(r);
    REQUIRE(h.rank == r);
    for (int s = 0; s < num_memory_spaces; ++s) {
      REQUIRE(h.spaces[s].bytes == mem.memory(r).spaces[s].bytes);
      REQUIRE(h.spaces[s].offset == 0);
    }
  }
  // A handle that was never exported is refused before any CUDA call.
  CHECK_THROWS_AS(imported_rank_memory(device_rank_ipc{}, 0), moebius::error);
  // Mismatched device and rank lists are refused.
  CHECK_THROWS_AS(device_deployment_memory(g, kv, {0}, {0, 1}), moebius::error);
}
