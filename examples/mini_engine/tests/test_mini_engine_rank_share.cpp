// The rank-share emulation's arithmetic (gpu/rank_share.hpp): which share of a P-rank
// deployment one rank holds in each mode, as a model the runtime accepts, and the link model's
// price of the collectives it does not run, against values worked out by hand.
#include <moebius/error.hpp>

#include "catch.hpp"
#include "model_config.hpp"
#include "rank_share.hpp"

using namespace mini_engine;
using moebius::parallel_mode;

TEST_CASE("rank share: Qwen3-235B-A22B at P = 8, both modes", "[cpu][rank_share]") {
  const model_config full = qwen3_235b_a22b();
  const model_config tp = rank_share_of(full, parallel_mode::tp, 8, 1.0);
  CHECK(tp.num_q_heads == 8);
  CHECK(tp.num_kv_heads == 1);  // H_kv = 4 < P: one replicated head per rank
  CHECK(tp.intermediate == 192);
  CHECK(tp.vocab == 18992);
  CHECK(tp.num_experts == 128);
  CHECK(tp.top_k == 8);
  const model_config ep = rank_share_of(full, parallel_mode::ep, 8, 1.0);
  CHECK(ep.num_experts == 16);
  CHECK(ep.top_k == 8);
  CHECK(ep.num_q_heads == 64);
  CHECK(ep.num_kv_heads == 4);
  CHECK(ep.intermediate == 1536);
  CHECK(ep.vocab == full.vocab);
  CHECK(rank_share_of(full, parallel_mode::ep, 8, 1.25).top_k == 10);  // the busiest rank
  CHECK(rank_share_of(full, parallel_mode::ep, 8, 10.0).top_k == 16);  // at most E/P
  CHECK(rank_batch(parallel_mode::tp, 5, 8) == 5);
  CHECK(rank_batch(parallel_mode::ep, 5, 8) == 1);
  CHECK(rank_batch(parallel_mode::ep, 16, 8) == 2);
  CHECK(rank_batch(parallel_mode::ep, 17, 8) == 3);
}

TEST_CASE("rank share: every share the bench builds is a model the runtime accepts",
          "[cpu][rank_share]") {
  for (const model_config& full : {qwen3_30b_a3b(), qwen3_235b_a22b()})
    for (int P : {2, 4, 8})
      for (parallel_mode m : {parallel_mode::tp, parallel_mode::ep}) {
        CAPTURE(full.num_layers, P, moebius::to_string(m));
        const model_config c = rank_share_of(full, m, P, 1.0);
        CHECK_NOTHROW(validate(c));
        CHECK_NOTHROW(validate(c, 1));
      }
}

TEST_CASE("rank share: the link model's price of the collectives", "[cpu][rank_share]") {
  const model_config full = qwen3_235b_a22b();  // L 94, H 4096
  // TP, B 128: 188 all-reduces of 2 x 7/8 x 128 x 4096 x 2 B = 1,835,008 B at 389 GB/s plus
  // 10 us each, and one more latency for the LM head: 188 x 14.7173 us + 10 us.
  CHECK(priced_collectives_s(full, parallel_mode::tp, 8, 128, 8) == Approx(2.77686e-3).epsilon(1e-4));
  // EP, B 128: 16 sequences x 8 pairs, 7/8 leave: 112 rows of 8192 B = 917,504 B at 332 GB/s
  // plus 10 us, twice per layer: 188 x 12.7636 us.
  CHECK(priced_collectives_s(full, parallel_mode::ep, 8, 128, 8) == Approx(2.39955e-3).epsilon(1e-4));
  CHECK(priced_collectives_s(full, parallel_mode::tp, 1, 128, 8) == 0);
}
