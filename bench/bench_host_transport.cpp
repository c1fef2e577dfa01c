// host_transport throughput: a whole EP->TP switch of a Qwen3-style stack on P ranks in host
// memory, reported as bytes leaving each rank per second (and all bytes copied per second).
// The host transport is the reference and the CI path, not a fast path: its rate is memcpy's.
//   ./bench_host_transport --benchmark_format=json
#include <benchmark/benchmark.h>

#include <cstddef>
#include <cstring>
#include <vector>

#include "moebius/layout/arena_geometry.hpp"
#include "moebius/plan/weight_plan.hpp"
#include "moebius/transport/host_transport.hpp"

namespace {

using namespace moebius;

// Qwen3-235B layer shapes with the hidden size scaled down so P arenas fit in host memory:
// arg 0 = P, arg 1 = hidden size H.
void BM_host_switch(benchmark::State& state) {
  expert_shape shape = qwen3_235b_a22b();
  const int P = static_cast<int>(state.range(0));
  shape.hidden = state.range(1);
  shape.num_layers = 4;
  const arena_geometry g = make_arena_geometry(shape, P);
  std::vector<std::vector<std::byte>> arenas(P);
  std::vector<rank_memory> ranks(P);
  for (int r = 0; r < P; ++r) {
    arenas[r].resize(static_cast<size_t>(g.total_bytes()));
    std::memset(arenas[r].data(), 0x5a + r, arenas[r].size());  // touch every page up front
    ranks[r].spaces[0] = arenas[r];
  }
  host_transport transport(ranks);
  const plan to_tp = plan_weight_switch(g, arena_cursor{0}, arena_cursor{shape.num_layers});
  const plan to_ep = plan_weight_switch(g, arena_cursor{shape.num_layers}, arena_cursor{0});
  bool at_ep = true;
  for (auto _ : state) {
    transport.execute(at_ep ? to_tp : to_ep);
    at_ep = !at_ep;
  }
  const plan_traffic t = traffic_of(to_tp);
  int64_t all = 0;
  for (int r = 0; r < P; ++r) all += t.bytes_sent[r] + t.bytes_local[r];
  state.counters["bytes_leaving_each_rank_per_s"] = benchmark::Counter(
      static_cast<double>(t.max_bytes_sent()), benchmark::Counter::kIsIterationInvariantRate);
  state.counters["bytes_copied_per_s"] =
      benchmark::Counter(static_cast<double>(all), benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_host_switch)->Args({2, 512})->Args({4, 512})->Args({8, 512})
    ->ArgNames({"P", "H"})->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
