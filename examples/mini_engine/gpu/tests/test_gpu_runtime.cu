// The GPU runtime end to end: logits against a float64 reference in both modes (and in hybrid
// cursors), TP against EP, CUDA graphs captured once and replayed across switches, and a
// serving run that switches (weights and KV moved by moebius::switcher over
// cuda_peer_transport) giving the same greedy tokens as a run that never switches, hybrid
// steps (progressive switches) replaying per-layer graphs, and those graphs' logits against
// the same hybrid steps run eagerly (bit for bit at P = 1).
// P = 2 when two devices are present, else P = 1 (NCCL allows no two ranks on one device).
// Virtual ranks ([virtual]): test_gpu_runtime_virtual.cu, in the same test executable; the
// serving loop and the checks both files use: runtime_test_serve.hpp.

#include <cuda_runtime_api.h>

#include <cmath>
#include <cstring>
#include <map>
#include <moebius/switch/switcher.hpp>
#include <moebius/transport/cuda_peer_transport.hpp>
#include <random>
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

TEST_CASE("gpu_runtime matches the float64 reference in EP, TP and hybrid cursors",
          "[gpu][runtime]") {
  const int P = test_ranks();
  // fp8 experts: dequantized exactly, so fp8 with fp32 compute is held to the fp32 bound and
  // fp8 with bf16 compute to the bf16 one.
  const model_config configs[] = {
      tiny_config(moebius::dtype::fp32), tiny_config(moebius::dtype::bf16),
      tiny_fp8_config(moebius::dtype::fp32), tiny_fp8_config(moebius::dtype::bf16)};
  for (const model_config& c : configs) {
    const moebius::dtype t = compute_dtype(c);
    const bool bf16 = t == moebius::dtype::bf16;
    const test_weights w = make_test_weights(c, seed(21), bf16);
    std::map<std::string, serve_result> results;
    // (attention mode, cursor): the pure modes replay graphs; the hybrids run eagerly.
    const std::pair<parallel_mode, int64_t> cases[] = {{parallel_mode::ep, 0},
                                                       {parallel_mode::tp, c.num_layers},
                                                       {parallel_mode::ep, 1},
                                                       {parallel_mode::tp, 2}};
    for (auto [mode, k] : cases) {
      DYNAMIC_SECTION("experts " << moebius::to_string(c.expert_dtype) << " compute "
                                 << moebius::to_string(t) << " attention " << moebius::to_string(mode)
                               << " cursor " << k) {
        gpu_runtime rt(w, tiny_options(P, {k}, t));
        REQUIRE(rt.captures() == expected_captures(rt, c));
        REQUIRE(rt.graph_statistics().whole_model == (rt.graphs_enabled() ? 8 : 0));
        REQUIRE(rt.graph_statistics().per_layer ==
                rt.captures() - rt.graph_statistics().whole_model);
        const auto r = serve(rt, empty_kv_state(rt.kv(), mode), {k}, 6, {}, nullptr);
        check_against_reference(c, w, r, bf16);
        const bool pure = (mode == parallel_mode::ep && k == 0) ||
                          (mode == parallel_mode::tp && k == c.num_layers);
        if (pure && rt.graphs_enabled())
          REQUIRE(rt.graph_replays() == 6);  // decode steps 2..7 (steps 0, 1 prefill)
        else
          REQUIRE(rt.graph_replays() == 0);
        REQUIRE(rt.captures() == expected_captures(rt, c));
        REQUIRE(rt.hybrid_steps() == 0);
      }
    }
  }
}

TEST_CASE("gpu_runtime: TP and EP logits agree", "[gpu][runtime]") {
  const int P = test_ranks();
  // fp32 experts, and fp8 experts dequantized to fp32 (TP reads each rank's I/P slice of the
  // codes with its scales, EP whole experts: the same weights either way).
  const model_config c = GENERATE(tiny_config(moebius::dtype::fp32),
                                      tiny_fp8_config(moebius::dtype::fp32));
  INFO("experts " << moebius::to_string(c.expert_dtype));
  const test_weights w = make_test_weights(c, seed(22), false);
  gpu_runtime ep(w, tiny_options(P, {0}, moebius::dtype::fp32));
  gpu_runtime tp(w, tiny_options(P, {c.num_layers}, moebius::dtype::fp32));
  const auto a = serve(ep, empty_kv_state(ep.kv(), parallel_mode::ep), {0}, 5, {}, nullptr);
  const auto b =
      serve(tp, empty_kv_state(tp.kv(), parallel_mode::tp), {c.num_layers}, 5, {}, nullptr);
  REQUIRE(a.seqs == b.seqs);
  for (size_t q = 0; q < a.logits.size(); ++q)
    for (size_t k = 0; k < a.logits[q].size(); ++k)
      for (size_t v = 0; v < a.logits[q][k].size(); ++v)
        REQUIRE(std::fabs(a.logits[q][k][v] - b.logits[q][k][v]) <=
                1e-4 + 1e-4 * std::fabs(a.logits[q][k][v]));
}

TEST_CASE("gpu_runtime: switches between steps keep the greedy tokens and never re-capture",
          "[gpu][runtime]") {
  const int P = test_ranks();
  // fp8: the switcher moves the codes and their block scales (the arena's w13_scale / w2_scale).
  const model_config c = GENERATE(tiny_config(moebius::dtype::fp32),
                                      tiny_fp8_config(moebius::dtype::fp32));
  INFO("experts " << moebius::to_string(c.expert_dtype));
  const test_weights w = make_test_weights(c, seed(23), false);
  gpu_runtime static_rt(w, tiny_options(P, {0}, moebius::dtype::fp32));
  const auto base =
      serve(static_rt, empty_kv_state(static_rt.kv(), parallel_mode::ep), {0}, 8, {}, nullptr);

  gpu_runtime rt(w, tiny_options(P, {0}, moebius::dtype::fp32));
  const int64_t captured = rt.captures();
  REQUIRE(captured == expected_captures(rt, c));
  moebius::cuda_peer_transport tr = moebius::cuda_peer_transport::single_process(rt.memory());
  moebius::switcher sw(rt.arena(), rt.kv(), tr, empty_kv_state(rt.kv(), parallel_mode::ep), {0});
  // EP prefill, TP from decode step 3, EP again from 6, TP from 8.
  const std::map<int, parallel_mode> plan = {
      {3, parallel_mode::tp}, {6, parallel_mode::ep}, {8, parallel_mode::tp}};
  const auto switched = serve(rt, {}, {0}, 8, plan, &sw);
  REQUIRE(rt.captures() == captured);
  REQUIRE((rt.graph_replays() > 0 || !rt.graphs_enabled()));
  for (size_t q = 0; q < base.seqs.size(); ++q) {
    for (size_t i = 0; i < base.seqs[q].size(); ++i) {
      if (base.seqs[q][i] == switched.seqs[q][i]) continue;
      // Report the first divergence with the two runs' logit margins at that position.
      std::ostringstream why;
      const size_t k = i - (base.seqs[q].size() - base.logits[q].size());
      const auto& la = base.logits[q][k];
      const auto& lb = switched.logits[q][k];
      why << "sequence " << q << " token " << i << ": static " << base.seqs[q][i] << " (logit "
          << la[static_cast<size_t>(base.seqs[q][i])] << "), switched " << switched.seqs[q][i]
          << " (logit " << lb[static_cast<size_t>(switched.seqs[q][i])] << ")";
      FAIL(why.str());
    }
  }
}

TEST_CASE("gpu_runtime: progressive switches (hybrid steps) keep the greedy tokens and never "
          "re-capture",
          "[gpu][runtime]") {
  const int P = test_ranks();
  const model_config c = GENERATE(tiny_config(moebius::dtype::fp32),  // L = 3
                                      tiny_fp8_config(moebius::dtype::fp32));
  INFO("experts " << moebius::to_string(c.expert_dtype));
  const test_weights w = make_test_weights(c, seed(24), false);
  gpu_runtime static_rt(w, tiny_options(P, {0}, moebius::dtype::fp32));
  const auto base =
      serve(static_rt, empty_kv_state(static_rt.kv(), parallel_mode::ep), {0}, 10, {}, nullptr);

  for (const int64_t layers : {int64_t{1}, int64_t{2}}) {
    INFO("layers per step " << layers);
    gpu_runtime rt(w, tiny_options(P, {0}, moebius::dtype::fp32));
    const int64_t captured = rt.captures();
    moebius::cuda_peer_transport tr = moebius::cuda_peer_transport::single_process(rt.memory());
    moebius::switcher sw(rt.arena(), rt.kv(), tr, empty_kv_state(rt.kv(), parallel_mode::ep),
                         {0});
    // EP -> TP from step 1 (seq 0's second prefill chunk runs hybrid: multi-token rows through
    // the TP -> EP hand-off), TP -> EP from step 6, both a few layers per step.
    const std::map<int, parallel_mode> plan = {{1, parallel_mode::tp}, {6, parallel_mode::ep}};
    const auto prog = serve(rt, {}, {0}, 10, plan, &sw, layers);
    REQUIRE(captured == expected_captures(rt, c));
    REQUIRE(rt.captures() == captured);
    REQUIRE(rt.hybrid_steps() >= 2);
    REQUIRE((rt.graph_replays() > 0 || !rt.graphs_enabled()));
    // Every hybrid step but step 1 (seq 0's second prefill chunk: several tokens, eager) is a
    // decode step of 3 tokens and replays per-layer graphs.
    if (rt.hybrid_graphs_enabled())
      REQUIRE(rt.hybrid_graph_steps() == rt.hybrid_steps() - 1);
    else
      REQUIRE(rt.hybrid_graph_steps() == 0);
    REQUIRE(sw.mode() == parallel_mode::ep);
    // The hybrid steps' logits against the float64 model, then token for token the static run.
    check_against_reference(c, w, prog, false);
    for (size_t q = 0; q < base.seqs.size(); ++q) {
      for (size_t i = 0; i < base.seqs[q].size(); ++i) {
        if (base.seqs[q][i] == prog.seqs[q][i]) continue;
        std::ostringstream why;
        const size_t k = i - (base.seqs[q].size() - base.logits[q].size());
        const auto& la = base.logits[q][k];
        const auto& lb = prog.logits[q][k];
        why << "sequence " << q << " token " << i << ": static " << base.seqs[q][i] << " (logit "
            << la[static_cast<size_t>(base.seqs[q][i])] << "), progressive " << prog.seqs[q][i]
            << " (logit " << lb[static_cast<size_t>(prog.seqs[q][i])] << ")";
        FAIL(why.str());
      }
    }
  }
}

// Hybrid decode steps through per-layer graphs against the same steps run eagerly (a second
// runtime with the same weights and set_hybrid_eager(true)): B sequences decode one token
// per step at positions 0, 1, ..., the cursor walking 0 .. L and back (TP and EP tables both
// reserved up front, as a progressive switch freezes them), tokens drawn from a seed.
// P = 1 (any machine): bit for bit. With one rank and B a bucket size the eager step runs
// the graphs' shapes: rows = the bucket in both modes, and the graphs' expert capacity
// (1.25x the expected pairs + k) is never below the worst case (T k) when every expert is
// local, so both run the same kernels with the same launch shapes on the same data in the
// same order. P = 2 (two devices, fp32 only): EP graphs size the expert tiles for 1.25x the
// expected pairs and eager steps for the worst case, so other tile rows and other GEMM
// blockings sum in another order: within 1e-4 + 1e-4 |x| (the TP-vs-EP bound).
TEST_CASE(
    "gpu_runtime: hybrid steps through per-layer graphs give the eager hybrid steps' "
    "logits",
    "[gpu][runtime]") {
  std::vector<int> rank_counts = {1};
  if (test_ranks() == 2) rank_counts.push_back(2);
  for (int P : rank_counts)
    for (moebius::dtype t : {moebius::dtype::fp32, moebius::dtype::bf16}) {
      if (P == 2 && t == moebius::dtype::bf16) continue;  // see above
      for (int64_t B : {int64_t{1}, int64_t{4}, int64_t{8}}) {
        DYNAMIC_SECTION("P " << P << " dtype " << moebius::to_string(t) << " batch " << B) {
          const model_config c = tiny_config(t);  // L = 3
          const bool bf16 = t == moebius::dtype::bf16;
          const test_weights w = make_test_weights(c, seed(25), bf16);
          gpu_runtime graphed(w, tiny_options(P, {0}, t));
          gpu_runtime eager(w, tiny_options(P, {0}, t));
          eager.set_hybrid_eager(true);
          std::vector<int64_t> cursors;
          for (int64_t k = 0; k <= c.num_layers; ++k) cursors.push_back(k);
          for (int64_t k = c.num_layers; k >= 0; --k) cursors.push_back(k);
          const auto steps = static_cast<int64_t>(cursors.size());
          moebius::kv_state tp = empty_kv_state(graphed.kv(), parallel_mode::tp);
          moebius::kv_state ep = empty_kv_state(graphed.kv(), parallel_mode::ep);
          for (int64_t q = 0; q < B; ++q) {
            reserve_tokens(graphed.kv(), tp, q, steps, static_cast<int>(q % P));
            reserve_tokens(graphed.kv(), ep, q, steps, static_cast<int>(q % P));
          }
          moebius::validate(graphed.kv(), tp);
          moebius::validate(graphed.kv(), ep);
          std::mt19937_64 rng(seed(26));
          std::vector<int32_t> tokens(static_cast<size_t>(B));
          for (int64_t s = 0; s < steps; ++s) {
            INFO("step " << s << " cursor " << cursors[static_cast<size_t>(s)]);
            std::vector<step_item> items(static_cast<size_t>(B));
            for (int64_t q = 0; q < B; ++q) {
              tokens[static_cast<size_t>(q)] = static_cast<int32_t>(rng() % c.vocab);
              items[static_cast<size_t>(q)] = {q, {&tokens[static_cast<size_t>(q)], 1}, s, true};
            }
            const step_layout layout = step_layout::hybrid_of(
                tp, ep, moebius::arena_cursor{cursors[static_cast<size_t>(s)]});
            std::vector<std::vector<float>> lg, le;
            const std::vector<int32_t> ng = graphed.step(layout, items, &lg);
            const std::vector<int32_t> ne = eager.step(layout, items, &le);
            REQUIRE(ng == ne);
            REQUIRE(lg.size() == static_cast<size_t>(B));
            REQUIRE(le.size() == lg.size());
            for (size_t i = 0; i < lg.size(); ++i) {
              INFO("sequence " << i);
              REQUIRE(lg[i].size() == static_cast<size_t>(c.vocab));
              REQUIRE(le[i].size() == lg[i].size());
              int64_t differ = 0;
              for (size_t v = 0; v < lg[i].size(); ++v) {
                if (P == 1)
                  differ += std::memcmp(&lg[i][v], &le[i][v], sizeof(float)) != 0;
                else
                  differ += !(std::fabs(lg[i][v] - le[i][v]) <= 1e-4 + 1e-4 * std::fabs(le[i][v]));
                REQUIRE(std::isfinite(lg[i][v]));
              }
              INFO(differ << " of " << lg[i].size() << " logits differ");
              REQUIRE(differ == 0);
            }
          }
          REQUIRE(graphed.hybrid_steps() == steps);
          REQUIRE(eager.hybrid_steps() == steps);
          REQUIRE(eager.hybrid_graph_steps() == 0);
          REQUIRE(graphed.hybrid_graph_steps() == (graphed.hybrid_graphs_enabled() ? steps : 0));
          REQUIRE(graphed.captures() == expected_captures(graphed, c));
          REQUIRE(eager.captures() == graphed.captures());
        }
      }
    }
}
