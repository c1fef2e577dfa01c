// The GPU runtime on virtual ranks ([virtual]: P = 2 and 4 on device 0, collectives over device
// memory): static runs against P = 1 and the float64 model, switches (stop-the-world and
// progressive, through cuda_peer_transport on the runtime's memory) against a static run, the
// arena read back after every move against the static placement, no capture after
// construction. Part of test_mini_engine_gpu_runtime (the cases on real ranks:
// test_gpu_runtime.cu).

#include <cuda_runtime_api.h>

#include <cmath>
#include <cstddef>
#include <map>
#include <moebius/layout/parallel_layout.hpp>
#include <moebius/switch/switcher.hpp>
#include <moebius/transport/cuda_peer_transport.hpp>
#include <span>
#include <sstream>
#include <string>
#include <vector>

#include "gpu_runtime.hpp"
#include "runtime_test_serve.hpp"
#include "tests/catch.hpp"

using namespace mini_engine;
using namespace mini_engine::gpu;
using namespace mini_engine::gpu::testing;
using moebius::parallel_mode;

TEST_CASE("virtual ranks: placement (automatic on one device, refused one per device)",
          "[gpu][runtime][virtual]") {
  int devices = 0;
  MOEBIUS_CUDA_CHECK(cudaGetDeviceCount(&devices));
  const model_config c = tiny_config(moebius::dtype::fp32);
  const test_weights w = make_test_weights(c, seed(30), false);
  const int P = devices + 1;  // one more rank than devices
  gpu_runtime_options o = tiny_options(P, {0}, moebius::dtype::fp32);
  o.capture_graphs = false;
  if (c.num_q_heads % P == 0 && c.num_experts % P == 0) {
    gpu_runtime automatic(w, o);
    REQUIRE(automatic.virtual_ranks());
    REQUIRE(automatic.num_ranks() == P);
    for (const moebius::rank_memory& m : automatic.memory()) REQUIRE(m.device == 0);
    o.placement = rank_placement::one_per_device;
    REQUIRE_THROWS_AS(gpu_runtime(w, o), moebius::error);
  }
  gpu_runtime one(w, tiny_options(1, {0}, moebius::dtype::fp32));
  REQUIRE(!one.virtual_ranks());
}

TEST_CASE("virtual ranks: static TP and EP runs give P = 1's greedy tokens and the float64 "
          "model's logits",
          "[gpu][runtime][virtual]") {
  for (moebius::dtype t : {moebius::dtype::fp32, moebius::dtype::bf16}) {
    const model_config c = tiny_config(t);  // L = 3, Hq = 4, Hkv = 2, E = 8
    const bool bf16 = t == moebius::dtype::bf16;
    const test_weights w = make_test_weights(c, seed(31), bf16);
    for (parallel_mode mode : {parallel_mode::ep, parallel_mode::tp}) {
      const int64_t k = mode == parallel_mode::tp ? c.num_layers : 0;
      for (int P : {2, 4}) {
        DYNAMIC_SECTION("dtype " << moebius::to_string(t) << " " << moebius::to_string(mode)
                                 << " P " << P << " virtual") {
          gpu_runtime one(w, tiny_options(1, {k}, t));
          const auto base = serve(one, empty_kv_state(one.kv(), mode), {k}, 6, {}, nullptr);
          gpu_runtime rt(w, virtual_options(P, {k}, t));
          REQUIRE(rt.virtual_ranks());
          REQUIRE(rt.num_ranks() == P);
          REQUIRE(rt.captures() == expected_captures(rt, c));
          poison_kv(rt);
          check_arena(rt, w, {k});
          const auto r = serve(rt, empty_kv_state(rt.kv(), mode), {k}, 6, {}, nullptr);
          check_against_reference(c, w, r, bf16);
          require_same_tokens(base, r, "virtual ranks", bf16);
          if (rt.graphs_enabled()) REQUIRE(rt.graph_replays() == 6);  // decode steps 2..7
          REQUIRE(rt.captures() == expected_captures(rt, c));
        }
      }
    }
  }
}

TEST_CASE("virtual ranks: TP attention with EP experts and DP attention with TP experts give "
          "P = 1's greedy tokens and the float64 model's logits",
          "[gpu][runtime][virtual][layouts]") {
  // Attention follows the tables, the experts the cursor: the MoE block dispatches when the
  // attention is data-parallel and combines by all-reduce under TP attention (moe_block.cu).
  // These steps are not whole-model graphs (a static step of one mode is): they run eagerly.
  const moebius::dtype t = moebius::dtype::fp32;
  const model_config c = tiny_config(t);
  const test_weights w = make_test_weights(c, seed(36), false);
  gpu_runtime one(w, tiny_options(1, {0}, t));
  const auto base = serve(one, empty_kv_state(one.kv(), parallel_mode::ep), {0}, 6, {}, nullptr);
  for (parallel_mode attention : {parallel_mode::tp, parallel_mode::ep}) {
    const parallel_mode experts =
        attention == parallel_mode::tp ? parallel_mode::ep : parallel_mode::tp;
    const moebius::arena_cursor k{experts == parallel_mode::tp ? c.num_layers : 0};
    for (int P : {2, 4}) {
      DYNAMIC_SECTION(moebius::to_string(moebius::parallel_layout{attention, experts}) << " P "
                                                                                      << P) {
        gpu_runtime rt(w, virtual_options(P, k, t));
        poison_kv(rt);
        check_arena(rt, w, k);
        const auto r = serve(rt, empty_kv_state(rt.kv(), attention), k, 6, {}, nullptr);
        check_against_reference(c, w, r, false);
        require_same_tokens(base, r, "mixed layout");
      }
    }
  }
}

TEST_CASE("virtual ranks: stop-the-world and progressive switches EP -> TP -> EP keep the "
          "static run's tokens, place the arena as a static run and never re-capture",
          "[gpu][runtime][virtual]") {
  for (moebius::dtype t : {moebius::dtype::fp32, moebius::dtype::bf16}) {
    const model_config c = tiny_config(t);  // L = 3
    const bool bf16 = t == moebius::dtype::bf16;
    const test_weights w = make_test_weights(c, seed(32), bf16);
    for (int P : {2, 4}) {
      // 0: stop-the-world (TP before decode step 3, EP again before 6); 1, 2: progressive
      // with that many layers per step (TP from step 1: seq 0's second prefill chunk runs
      // hybrid; EP from 6).
      for (int64_t layers : {int64_t{0}, int64_t{1}, int64_t{2}}) {
        DYNAMIC_SECTION("dtype " << moebius::to_string(t) << " P " << P << " virtual, "
                                 << (layers == 0 ? "stop-the-world"
                                                 : "progressive, layers per step ")
                                 << (layers == 0 ? "" : std::to_string(layers))) {
          gpu_runtime static_rt(w, virtual_options(P, {0}, t));
          poison_kv(static_rt);
          const auto base = serve(static_rt, empty_kv_state(static_rt.kv(), parallel_mode::ep),
                                  {0}, 10, {}, nullptr);

          gpu_runtime rt(w, virtual_options(P, {0}, t));
          REQUIRE(rt.virtual_ranks());
          const int64_t captured = rt.captures();
          REQUIRE(captured == expected_captures(rt, c));
          poison_kv(rt);
          moebius::cuda_peer_transport tr =
              moebius::cuda_peer_transport::single_process(rt.memory());
          moebius::switcher sw(rt.arena(), rt.kv(), tr,
                               empty_kv_state(rt.kv(), parallel_mode::ep), {0});
          const std::map<int, parallel_mode> plan =
              layers == 0
                  ? std::map<int, parallel_mode>{{3, parallel_mode::tp}, {6, parallel_mode::ep}}
                  : std::map<int, parallel_mode>{{1, parallel_mode::tp}, {6, parallel_mode::ep}};
          int64_t moves = 0;
          const auto run = serve(rt, {}, {0}, 10, plan, &sw, layers, [&](moebius::arena_cursor k) {
            check_arena(rt, w, k);
            ++moves;
          });
          // Stop-the-world: 2 switches; progressive: per switch ceil(L / layers) advances and
          // the finish.
          const int64_t per_switch = layers == 0 ? 1 : (c.num_layers + layers - 1) / layers + 1;
          REQUIRE(moves == 2 * per_switch);
          REQUIRE(sw.mode() == parallel_mode::ep);
          REQUIRE(rt.captures() == captured);
          REQUIRE((rt.graph_replays() > 0 || !rt.graphs_enabled()));
          if (layers > 0) {
            REQUIRE(rt.hybrid_steps() >= 2);
            // Every hybrid step but step 1 (a prefill chunk: eager) replays per-layer graphs.
            if (rt.hybrid_graphs_enabled())
              REQUIRE(rt.hybrid_graph_steps() == rt.hybrid_steps() - 1);
          }
          check_against_reference(c, w, run, bf16);
          require_same_tokens(base, run, layers == 0 ? "stop-the-world" : "progressive", bf16);
          // TP and EP round their sums differently (the TP-vs-EP test's bound).
          if (!bf16) require_close_logits(base, run, 1e-4);
        }
      }
    }
  }
}

TEST_CASE("virtual ranks: progressive switches with the copies beside the steps keep the "
          "static run's tokens, place the arena as a static run, never re-capture, and roll "
          "back exactly from a fault in an overlapped advance",
          "[gpu][runtime][virtual][overlap]") {
  for (moebius::dtype t : {moebius::dtype::fp32, moebius::dtype::bf16}) {
    const model_config c = tiny_config(t);  // L = 3
    const bool bf16 = t == moebius::dtype::bf16;
    const test_weights w = make_test_weights(c, seed(33), bf16);
    for (int P : {2, 4}) {
      for (int64_t layers : {int64_t{1}, int64_t{2}}) {
        // -1: no fault; else a transport fault at phase 1 of that advance (the second
        // advance of the EP -> TP switch, or the first of the TP -> EP one).
        for (int fault : {-1, 1, 1 + static_cast<int>((c.num_layers + layers - 1) / layers)}) {
          DYNAMIC_SECTION("dtype " << moebius::to_string(t) << " P " << P << " layers per step "
                                   << layers << " fault at advance " << fault) {
            gpu_runtime static_rt(w, virtual_options(P, {0}, t));
            poison_kv(static_rt);
            const auto base = serve(static_rt, empty_kv_state(static_rt.kv(), parallel_mode::ep),
                                    {0}, 10, {}, nullptr);
            gpu_runtime rt(w, virtual_options(P, {0}, t));
            const int64_t captured = rt.captures();
            poison_kv(rt);
            moebius::cuda_peer_transport tr =
                moebius::cuda_peer_transport::single_process(rt.memory());
            moebius::switcher sw(rt.arena(), rt.kv(), tr,
                                 empty_kv_state(rt.kv(), parallel_mode::ep), {0});
            overlap_options beside;
            beside.fault_advance = fault;
            beside.fault_phase = 1;
            int64_t moves = 0;
            const auto run = serve(
                rt, {}, {0}, 10, {{1, parallel_mode::tp}, {6, parallel_mode::ep}}, &sw, layers,
                [&](moebius::arena_cursor k) {
                  check_arena(rt, w, k);
                  ++moves;
                },
                &beside);
            REQUIRE(beside.advances >= 2);
            REQUIRE(beside.rolled_back == (fault >= 0 ? 1 : 0));
            REQUIRE(moves >= beside.advances);
            REQUIRE(rt.captures() == captured);
            if (rt.hybrid_graphs_enabled()) REQUIRE(rt.hybrid_graph_steps() >= 1);
            check_against_reference(c, w, run, bf16);
            require_same_tokens(base, run, "progressive beside the steps", bf16);
            if (!bf16) require_close_logits(base, run, 1e-4);
          }
        }
      }
    }
  }
}

// Qwen3-30B-A3B's layer shapes (H 2048, 32 query and 4 KV heads of 128, 128 experts of I 768,
// top-8, pages of 16) with 2 layers and a 4096-token vocabulary (the embedding and LM head are
// not what a switch moves), fp32 so that TP and EP agree to rounding: progressive switches with
// the copies beside the steps, EP -> TP -> EP at P = 2 and 4 virtual ranks, against a static EP
// run: the same greedy tokens, logits within the TP-vs-EP bound, the arena read back after each
// switch (2.4 GB of experts per layer: not after every advance) equal to the static placement
// byte for byte. Stop-the-world at these shapes: the under-load benchmark.
TEST_CASE("virtual ranks, Qwen3-30B-A3B layer shapes: switches with the copies beside the "
          "steps keep the static run's tokens and place the arena exactly",
          "[gpu][runtime][virtual][overlap][qwen3_30b]") {
  model_config c = qwen3_30b_a3b();
  c.num_layers = 2;
  c.vocab = 4096;
  c.expert_dtype = moebius::dtype::fp32;
  c.kv_dtype = moebius::dtype::fp32;
  const test_weights w = make_test_weights(c, seed(34), false);
  for (int P : {2, 4}) {
    for (int64_t layers : {int64_t{1}}) {
      DYNAMIC_SECTION("P " << P << " progressive beside, layers per step " << layers) {
        gpu_runtime_options o = virtual_options(P, {0}, moebius::dtype::fp32);
        o.buckets = {1, 4};
        gpu_runtime static_rt(w, o);
        poison_kv(static_rt);
        const auto base = serve(static_rt, empty_kv_state(static_rt.kv(), parallel_mode::ep), {0},
                                6, {}, nullptr);
        gpu_runtime rt(w, o);
        const int64_t captured = rt.captures();
        poison_kv(rt);
        moebius::cuda_peer_transport tr = moebius::cuda_peer_transport::single_process(rt.memory());
        moebius::switcher sw(rt.arena(), rt.kv(), tr, empty_kv_state(rt.kv(), parallel_mode::ep),
                             {0});
        overlap_options beside;
        int64_t moves = 0;
        const auto run = serve(
            rt, {}, {0}, 6, {{2, parallel_mode::tp}, {5, parallel_mode::ep}}, &sw, layers,
            [&](moebius::arena_cursor k) {
              if (k.tp_layers == 0 || k.tp_layers == c.num_layers) {
                if (++moves % 2 == 0) check_arena(rt, w, k);  // the finish after the last advance
              }
            },
            &beside);
        REQUIRE(moves == 4);
        REQUIRE(beside.advances == 2 * c.num_layers);
        REQUIRE(sw.mode() == parallel_mode::ep);
        REQUIRE(rt.captures() == captured);
        require_same_tokens(base, run, "progressive beside");
        require_close_logits(base, run, 1e-4);
      }
    }
  }
}
