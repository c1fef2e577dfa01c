// Reshards a small layer stack EP -> TP -> EP on the host transport through the installed
// package and checks that every byte came back.
#include <cstddef>
#include <cstdio>
#include <vector>

#include <moebius/config.hpp>
#include <moebius/layout/arena_geometry.hpp>
#include <moebius/plan/weight_plan.hpp>
#include <moebius/transport/host_transport.hpp>

int main() {
  moebius::expert_shape shape;
  shape.num_layers = 3;
  shape.num_experts = 8;
  shape.hidden = 64;
  shape.intermediate = 32;
  const int P = 4;
  const moebius::arena_geometry g = moebius::make_arena_geometry(shape, P, 256, 4096);

  std::vector<std::vector<std::byte>> arenas(P, std::vector<std::byte>(g.total_bytes()));
  std::vector<moebius::rank_memory> ranks(P);
  unsigned x = 12345;
  for (int r = 0; r < P; ++r) {
    for (std::byte& b : arenas[r]) b = std::byte((x = x * 1103515245u + 12345u) >> 16);
    ranks[r].spaces[0] = arenas[r];
  }
  const std::vector<std::vector<std::byte>> before = arenas;
  moebius::host_transport transport(ranks);
  const moebius::arena_cursor ep{0}, tp{shape.num_layers};
  transport.execute(moebius::plan_weight_switch(g, ep, tp));
  transport.execute(moebius::plan_weight_switch(g, tp, ep));

  // The EP layers live in slots 1..L; slot 0 is free and may differ.
  for (int r = 0; r < P; ++r) {
    for (int64_t b = g.slot_offset(1); b < g.total_bytes(); ++b) {
      if (arenas[r][b] != before[r][b]) {
        std::printf("consumer: byte %lld of rank %d differs\n", static_cast<long long>(b), r);
        return 1;
      }
    }
  }
  std::printf("consumer: ok (Moebius %d.%d.%d, CUDA %d)\n", MOEBIUS_VERSION_MAJOR,
              MOEBIUS_VERSION_MINOR, MOEBIUS_VERSION_PATCH, MOEBIUS_WITH_CUDA);
  return 0;
}
