// Host time to build weight reshard plans. Target (issue 2): the full EP->TP plan for
// Qwen3-235B-A22B (L=94, E=128, H=4096, I=1536, P=8) in under 1 ms.
//   ./bench_plan_build --benchmark_format=json
#include <benchmark/benchmark.h>

#include "moebius/layout/arena_geometry.hpp"
#include "moebius/plan/weight_plan.hpp"

namespace {

using namespace moebius;

void set_counters(benchmark::State& state, const plan& p) {
  state.counters["phases"] = static_cast<double>(p.phases.size());
  state.counters["ops"] = static_cast<double>(p.num_ops());
  state.counters["ops_per_second"] =
      benchmark::Counter(static_cast<double>(p.num_ops()), benchmark::Counter::kIsIterationInvariantRate);
}

// Whole-model EP->TP plan at P ranks; arg 1 selects FP8 with 128x128 block scales.
void BM_plan_qwen3_ep_to_tp(benchmark::State& state) {
  expert_shape shape = qwen3_235b_a22b();
  const int P = static_cast<int>(state.range(0));
  if (state.range(1) != 0) {
    shape.weight_dtype = dtype::fp8_e4m3;
    shape.block_scales = true;
  }
  const arena_geometry g = make_arena_geometry(shape, P);
  plan p;
  for (auto _ : state) {
    p = plan_weight_switch(g, arena_cursor{0}, arena_cursor{shape.num_layers});
    benchmark::DoNotOptimize(p.phases.data());
  }
  set_counters(state, p);
}
// FP8 block scales need whole 128-blocks per TP slice: I/P = 768 at P=2 (P=8 is rejected).
BENCHMARK(BM_plan_qwen3_ep_to_tp)->Args({8, 0})->Args({4, 0})->Args({2, 0})->Args({2, 1})
    ->ArgNames({"P", "fp8"})->Unit(benchmark::kMicrosecond);

// Whole-model TP->EP plan (descending), P=8.
void BM_plan_qwen3_tp_to_ep(benchmark::State& state) {
  const expert_shape shape = qwen3_235b_a22b();
  const arena_geometry g = make_arena_geometry(shape, 8);
  plan p;
  for (auto _ : state) {
    p = plan_weight_switch(g, arena_cursor{shape.num_layers}, arena_cursor{0});
    benchmark::DoNotOptimize(p.phases.data());
  }
  set_counters(state, p);
}
BENCHMARK(BM_plan_qwen3_tp_to_ep)->Unit(benchmark::kMicrosecond);

// Mismatched gate/up orders double the w13 ops (one strided copy per half).
void BM_plan_qwen3_order_swap(benchmark::State& state) {
  expert_shape shape = qwen3_235b_a22b();
  shape.tp_order = gate_up_order::up_first;
  const arena_geometry g = make_arena_geometry(shape, 8);
  plan p;
  for (auto _ : state) {
    p = plan_weight_switch(g, arena_cursor{0}, arena_cursor{shape.num_layers});
    benchmark::DoNotOptimize(p.phases.data());
  }
  set_counters(state, p);
}
BENCHMARK(BM_plan_qwen3_order_swap)->Unit(benchmark::kMicrosecond);

}  // namespace

BENCHMARK_MAIN();
