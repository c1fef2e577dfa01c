// The GPU runtime with decode context parallelism (gpu_runtime_options::dcp; [dcp], on virtual
// ranks): the options it refuses, static TP(dcp) runs against dcp 1, P = 1 and the float64
// model, every rank's pool holding its DCP share of the K/V and nothing else, TP(dcp) attention
// with EP experts, and switches EP <-> TP(dcp) (stop-the-world and progressive, through
// cuda_peer_transport) against a static run. Part of test_mini_engine_gpu_runtime.

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <moebius/kv/page_table.hpp>
#include <moebius/layout/parallel_layout.hpp>
#include <moebius/switch/switcher.hpp>
#include <moebius/transport/cuda_peer_transport.hpp>
#include <vector>

#include "gpu_runtime.hpp"
#include "runtime_test_serve.hpp"
#include "tests/catch.hpp"

using namespace mini_engine;
using namespace mini_engine::gpu;
using namespace mini_engine::gpu::testing;
using moebius::parallel_mode;

namespace {

// The tiny model (Hq = 4, D = 16, pages of 4 tokens, fp32) with `kv_heads` KV heads: H_kv < P
// lets the P / H_kv TP ranks of a head split its tokens.
model_config dcp_config(int64_t kv_heads) {
  model_config c = tiny_config(moebius::dtype::fp32);
  c.num_kv_heads = kv_heads;
  return c;
}

gpu_runtime_options dcp_options(int P, int64_t dcp, moebius::arena_cursor cursor) {
  gpu_runtime_options o = virtual_options(P, cursor, moebius::dtype::fp32);
  o.dcp = dcp;
  return o;
}

// P ranks, H_kv, dcp: one set of 2 at P = 2; at P = 4 two heads each split by a pair, one
// head split by two pairs, one head split by all four.
struct dcp_case {
  int P;
  int64_t kv_heads, dcp;
};
constexpr dcp_case dcp_cases[] = {{2, 1, 2}, {4, 2, 2}, {4, 1, 2}, {4, 1, 4}};

// Every rank's pool, read back after a static TP(dcp) run whose KV started poisoned (0xff):
// the K and V of every layer at every position of every sequence written exactly on the ranks
// of the position's DCP index (logical page (position / page_size) % dcp, at that rank's
// local page (position / page_size) / dcp), and every other element still 0xff: no rank
// stored a token of another index's page, none is missing. The rule is written out here from
// the interleave, not taken from kv_geometry.
void check_kv_shares(const gpu_runtime& rt, const moebius::kv_state& tables) {
  const moebius::kv_geometry& g = rt.kv();
  REQUIRE(tables.mode == parallel_mode::tp);
  const int64_t es = moebius::dtype_bytes(g.type), D = g.head_dim;
  const std::vector<moebius::rank_memory> mem = rt.memory();
  MOEBIUS_CUDA_CHECK(cudaDeviceSynchronize());
  for (int r = 0; r < rt.num_ranks(); ++r) {
    const moebius::memory_span& kv = mem[static_cast<size_t>(r)].space(moebius::memory_space::kv_pool);
    std::vector<std::byte> pool(static_cast<size_t>(kv.bytes));
    MOEBIUS_CUDA_CHECK(cudaMemcpy(pool.data(), kv.base, pool.size(), cudaMemcpyDeviceToHost));
    std::vector<char> expect_written(pool.size(), 0);
    const int64_t k = r % g.dcp;
    for (const moebius::kv_sequence& q : tables.ranks[static_cast<size_t>(r)].sequences)
      for (int64_t p = 0; p < q.num_tokens; ++p) {
        if ((p / g.page_size) % g.dcp != k) continue;
        const int64_t local = (p / g.page_size) / g.dcp;
        REQUIRE(local < q.num_pages());
        const int64_t page = q.pages[static_cast<size_t>(local)];
        for (int64_t l = 0; l < g.num_layers; ++l)
          for (moebius::kv_tensor t : {moebius::kv_tensor::k, moebius::kv_tensor::v})
            for (int64_t d = 0; d < D; ++d) {
              const int64_t off = g.offset(parallel_mode::tp, l, t, page, 0, p % g.page_size, d);
              std::memset(&expect_written[static_cast<size_t>(off)], 1, static_cast<size_t>(es));
            }
      }
    int64_t missing = 0, stray = 0, written = 0;
    for (size_t e = 0; e < pool.size(); e += static_cast<size_t>(es)) {
      bool poison = true;  // all bytes 0xff: never written (no value the model writes is that)
      for (int64_t b = 0; b < es; ++b) poison = poison && pool[e + static_cast<size_t>(b)] == std::byte{0xff};
      if (expect_written[e] != 0) {
        ++written;
        missing += poison;
      } else {
        stray += !poison;
      }
    }
    INFO("rank " << r << " (DCP index " << k << "): " << written << " elements of its share, "
                 << missing << " of them unwritten, " << stray << " elements written elsewhere");
    REQUIRE(written > 0);
    REQUIRE(missing == 0);
    REQUIRE(stray == 0);
  }
}

}  // namespace

TEST_CASE("dcp: the runtime refuses a dcp the KV geometry or the placement cannot take, and "
          "TP tables of another dcp, naming dcp",
          "[gpu][runtime][virtual][dcp]") {
  const test_weights w1 = make_test_weights(dcp_config(1), seed(50), false);
  const test_weights w2 = make_test_weights(dcp_config(2), seed(50), false);
  const moebius::arena_cursor tp{w1.config.num_layers};
  // H_kv >= P: no two TP ranks share a head.
  REQUIRE_THROWS_WITH(gpu_runtime(w2, dcp_options(2, 2, tp)), Catch::Contains("dcp"));
  // dcp must divide P / H_kv.
  REQUIRE_THROWS_WITH(gpu_runtime(w2, dcp_options(4, 4, tp)), Catch::Contains("dcp"));
  REQUIRE_THROWS_WITH(gpu_runtime(w1, dcp_options(4, 3, tp)), Catch::Contains("dcp"));
  REQUIRE_THROWS_WITH(gpu_runtime(w1, dcp_options(2, 0, tp)), Catch::Contains("dcp"));
  // P = 1 holds every head alone.
  gpu_runtime_options one = tiny_options(1, tp, moebius::dtype::fp32);
  one.dcp = 2;
  REQUIRE_THROWS_WITH(gpu_runtime(w1, one), Catch::Contains("dcp"));
  // One rank per device: the merge is written for virtual ranks only (with one device the
  // placement itself is refused first).
  gpu_runtime_options real = dcp_options(2, 2, tp);
  real.placement = rank_placement::one_per_device;
  int devices = 0;
  MOEBIUS_CUDA_CHECK(cudaGetDeviceCount(&devices));
  if (devices >= 2)
    REQUIRE_THROWS_WITH(gpu_runtime(w1, real), Catch::Contains("dcp=2 runs on virtual ranks only"));
  else
    REQUIRE_THROWS_AS(gpu_runtime(w1, real), moebius::error);
  // Accepted: the geometry carries it, its TP view holds dcp x the tokens.
  gpu_runtime rt(w1, dcp_options(2, 2, tp));
  REQUIRE(rt.kv().dcp == 2);
  REQUIRE(rt.kv().max_tokens(parallel_mode::tp) == rt.kv().max_tokens(parallel_mode::ep));
  // TP tables of dcp 1 (every rank every page) on a dcp-2 runtime: refused by the step.
  moebius::kv_geometry plain = rt.kv();
  plain.dcp = 1;
  moebius::kv_state tables = empty_kv_state(plain, parallel_mode::tp);
  reserve_tokens(plain, tables, 0, 9, 0);  // 3 pages: rank 1's share is 1 of them
  std::vector<int32_t> tokens = {1, 2, 3, 4, 5, 6, 7, 8, 9};
  step_item it;
  it.seq_id = 0;
  it.tokens = tokens;
  it.start_position = 0;
  it.sample = true;
  const std::vector<step_item> items = {it};
  REQUIRE_THROWS_WITH(rt.step(step_layout{&tables, tp}, items, nullptr), Catch::Contains("dcp=2"));
  // A step at a dcp the runtime does not serve (serve_dcps), and a serve dcp the geometry
  // does not allow.
  step_layout other{&tables, tp};
  other.dcp = 1;
  REQUIRE_THROWS_WITH(rt.step(other, items, nullptr),
                      Catch::Contains("step_layout::dcp 1 is not one the runtime serves (2"));
  gpu_runtime_options bad = dcp_options(2, 2, tp);
  bad.serve_dcps = {1, 3};
  REQUIRE_THROWS_WITH(gpu_runtime(w1, bad), Catch::Contains("dcp"));
  gpu_runtime_options real_two = dcp_options(2, 1, tp);
  real_two.serve_dcps = {2};
  real_two.placement = rank_placement::one_per_device;
  if (devices >= 2)
    REQUIRE_THROWS_WITH(gpu_runtime(w1, real_two),
                        Catch::Contains("dcp=2 runs on virtual ranks only"));
}

TEST_CASE("dcp: static TP(dcp) runs give dcp 1's and P = 1's greedy tokens and the float64 "
          "model's logits, each rank's pool holding its share",
          "[gpu][runtime][virtual][dcp]") {
  for (const dcp_case& dc : dcp_cases) {
    DYNAMIC_SECTION("P " << dc.P << " Hkv " << dc.kv_heads << " dcp " << dc.dcp) {
      const model_config c = dcp_config(dc.kv_heads);
      const test_weights w = make_test_weights(c, seed(51), false);
      const moebius::arena_cursor tp{c.num_layers};
      gpu_runtime one(w, tiny_options(1, tp, moebius::dtype::fp32));
      const auto base = serve(one, empty_kv_state(one.kv(), parallel_mode::tp), tp, 6, {}, nullptr);
      gpu_runtime plain(w, dcp_options(dc.P, 1, tp));
      const auto dcp1 =
          serve(plain, empty_kv_state(plain.kv(), parallel_mode::tp), tp, 6, {}, nullptr);
      gpu_runtime rt(w, dcp_options(dc.P, dc.dcp, tp));
      REQUIRE(rt.virtual_ranks());
      REQUIRE(rt.kv().dcp == dc.dcp);
      REQUIRE(rt.captures() == expected_captures(rt, c));
      poison_kv(rt);
      const auto r = serve(rt, empty_kv_state(rt.kv(), parallel_mode::tp), tp, 6, {}, nullptr);
      check_against_reference(c, w, r, false);
      require_same_tokens(base, r, "TP(dcp) against P = 1");
      require_same_tokens(dcp1, r, "TP(dcp) against dcp 1");
      // The softmax split into dcp parts is the only difference from dcp 1.
      require_close_logits(dcp1, r, 1e-4);
      if (rt.graphs_enabled()) REQUIRE(rt.graph_replays() == 6);  // decode steps 2..7
      REQUIRE(rt.captures() == expected_captures(rt, c));
      moebius::validate(rt.kv(), r.tables);
      check_kv_shares(rt, r.tables);
    }
  }
}

TEST_CASE("dcp: TP(dcp) attention with EP experts gives P = 1's greedy tokens and the float64 "
          "model's logits",
          "[gpu][runtime][virtual][dcp][layouts]") {
  // Attention follows the tables (TP with dcp), the experts the cursor (EP): the MoE block
  // combines by all-reduce under TP attention. Not a whole-model graph: eager steps.
  for (const dcp_case& dc : dcp_cases) {
    DYNAMIC_SECTION("P " << dc.P << " Hkv " << dc.kv_heads << " dcp " << dc.dcp) {
      const model_config c = dcp_config(dc.kv_heads);
      const test_weights w = make_test_weights(c, seed(52), false);
      const moebius::arena_cursor ep{0};
      gpu_runtime one(w, tiny_options(1, ep, moebius::dtype::fp32));
      const auto base = serve(one, empty_kv_state(one.kv(), parallel_mode::ep), ep, 6, {}, nullptr);
      gpu_runtime plain(w, dcp_options(dc.P, 1, ep));
      const auto dcp1 =
          serve(plain, empty_kv_state(plain.kv(), parallel_mode::tp), ep, 6, {}, nullptr);
      gpu_runtime rt(w, dcp_options(dc.P, dc.dcp, ep));
      poison_kv(rt);
      check_arena(rt, w, ep);
      const auto r = serve(rt, empty_kv_state(rt.kv(), parallel_mode::tp), ep, 6, {}, nullptr);
      check_against_reference(c, w, r, false);
      require_same_tokens(base, r, "TP(dcp) attention, EP experts");
      require_same_tokens(dcp1, r, "TP(dcp) against TP attention, EP experts");
      require_close_logits(dcp1, r, 1e-4);
    }
  }
}

TEST_CASE("dcp: stop-the-world and progressive switches EP -> TP(dcp) -> EP keep the static "
          "run's tokens, place the arena as a static run and never re-capture",
          "[gpu][runtime][virtual][dcp]") {
  for (const dcp_case& dc : dcp_cases) {
    // 0: stop-the-world (TP before decode step 3, EP again before 6); 1: progressive, one
    // layer per step (TP from step 1: seq 0's second prefill chunk runs hybrid; EP from 6).
    for (int64_t layers : {int64_t{0}, int64_t{1}}) {
      DYNAMIC_SECTION("P " << dc.P << " Hkv " << dc.kv_heads << " dcp " << dc.dcp << ", "
                           << (layers == 0 ? "stop-the-world" : "progressive")) {
        const model_config c = dcp_config(dc.kv_heads);
        const test_weights w = make_test_weights(c, seed(53), false);
        gpu_runtime static_rt(w, dcp_options(dc.P, dc.dcp, {0}));
        poison_kv(static_rt);
        const auto base = serve(static_rt, empty_kv_state(static_rt.kv(), parallel_mode::ep),
                                {0}, 10, {}, nullptr);
        gpu_runtime rt(w, dcp_options(dc.P, dc.dcp, {0}));
        const int64_t captured = rt.captures();
        REQUIRE(captured == expected_captures(rt, c));
        poison_kv(rt);
        moebius::cuda_peer_transport tr = moebius::cuda_peer_transport::single_process(rt.memory());
        // The switcher's TP view is the runtime's: TP(dcp).
        moebius::switcher sw(rt.arena(), rt.kv(), tr, empty_kv_state(rt.kv(), parallel_mode::ep),
                             {0});
        const std::map<int, parallel_mode> plan =
            layers == 0
                ? std::map<int, parallel_mode>{{3, parallel_mode::tp}, {6, parallel_mode::ep}}
                : std::map<int, parallel_mode>{{1, parallel_mode::tp}, {6, parallel_mode::ep}};
        int64_t moves = 0;
        const auto run = serve(rt, {}, {0}, 10, plan, &sw, layers, [&](moebius::arena_cursor k) {
          check_arena(rt, w, k);
          ++moves;
        });
        const int64_t per_switch = layers == 0 ? 1 : c.num_layers + 1;
        REQUIRE(moves == 2 * per_switch);
        REQUIRE(sw.mode() == parallel_mode::ep);
        REQUIRE(rt.captures() == captured);
        if (layers > 0) {
          REQUIRE(rt.hybrid_steps() >= 2);
          if (rt.hybrid_graphs_enabled())
            REQUIRE(rt.hybrid_graph_steps() == rt.hybrid_steps() - 1);
        }
        check_against_reference(c, w, run, false);
        require_same_tokens(base, run, layers == 0 ? "stop-the-world" : "progressive");
        require_close_logits(base, run, 1e-4);
      }
    }
  }
}

TEST_CASE("dcp: changing the TP view's dcp while serving (switcher::switch_dcp) keeps the static "
          "run's tokens and never re-captures",
          "[gpu][runtime][virtual][dcp]") {
  for (const dcp_case& dc : dcp_cases) {
    DYNAMIC_SECTION("P " << dc.P << " Hkv " << dc.kv_heads << " dcp " << dc.dcp) {
      const model_config c = dcp_config(dc.kv_heads);
      const test_weights w = make_test_weights(c, seed(57), false);
      const moebius::arena_cursor tp{c.num_layers};
      // The static run: TP at dcp 1, the runtime as it was without dcp.
      gpu_runtime plain(w, dcp_options(dc.P, 1, tp));
      const auto base = serve(plain, empty_kv_state(plain.kv(), parallel_mode::tp), tp, 10, {},
                              nullptr);
      // Built at dcp `dc.dcp`, serving every dcp from 1 to it; the changes land between decode
      // steps and before the second prefill chunk (step 1), both ways, each dcp served again.
      gpu_runtime_options o = dcp_options(dc.P, dc.dcp, tp);
      std::map<int, int64_t> changes = {{1, 1}, {4, dc.dcp}, {7, 1}, {10, dc.dcp}};
      if (dc.dcp == 4) {
        o.serve_dcps = {1, 2};
        changes = {{1, 2}, {3, 1}, {5, 4}, {7, 2}, {9, 4}, {10, 1}};
      } else {
        o.serve_dcps = {1};
      }
      gpu_runtime rt(w, o);
      REQUIRE(rt.serve_dcps().size() == (dc.dcp == 4 ? 3u : 2u));
      const int64_t captured = rt.captures();
      REQUIRE(captured == expected_captures(rt, c));
      poison_kv(rt);
      moebius::cuda_peer_transport tr = moebius::cuda_peer_transport::single_process(rt.memory());
      moebius::switcher sw(rt.arena(), rt.kv(), tr, empty_kv_state(rt.kv(), parallel_mode::tp), tp);
      REQUIRE(sw.dcp() == dc.dcp);
      const auto run = serve(rt, {}, tp, 10, {}, &sw, 0, {}, nullptr, changes);
      REQUIRE(sw.dcp() == changes.rbegin()->second);
      REQUIRE(rt.captures() == captured);
      if (rt.graphs_enabled()) REQUIRE(rt.graph_replays() >= 8);
      check_against_reference(c, w, run, false);
      require_same_tokens(base, run, "dcp changes while serving");
      require_close_logits(base, run, 1e-4);
    }
  }
}
