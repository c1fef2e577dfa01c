// The rank-share emulation's arithmetic (gpu/rank_share.hpp): which share of a P-rank
// deployment one rank holds in each static layout (TP, TP with dcp, EP, TEP with or without
// dcp), as a model the runtime accepts, the tokens a DCP rank attends over, and the link
// model's price of the collectives it does not run, against values worked out by hand.
#include <moebius/error.hpp>

#include "catch.hpp"
#include "model_config.hpp"
#include "rank_share.hpp"

using namespace mini_engine;
using moebius::parallel_mode;

namespace {

const rank_layout k_layouts[] = {rank_layout::tp(), rank_layout::tp(2), rank_layout::ep(),
                                 rank_layout::tep(), rank_layout::tep(2)};

}  // namespace

TEST_CASE("rank share: Qwen3-235B-A22B at P = 8, every layout", "[cpu][rank_share]") {
  const model_config full = qwen3_235b_a22b();
  for (const rank_layout& l : {rank_layout::tp(), rank_layout::tp(2)}) {
    CAPTURE(name_of(l));
    const model_config tp = rank_share_of(full, l, 8, 1.0);
    CHECK(tp.num_q_heads == 8);
    CHECK(tp.num_kv_heads == 1);  // H_kv = 4 < P: one replicated head per rank
    CHECK(tp.intermediate == 192);
    CHECK(tp.vocab == 18992);
    CHECK(tp.num_experts == 128);
    CHECK(tp.top_k == 8);
  }
  // Data-parallel attention: the EP rank holds and reads every attention weight (all 64 q and 4
  // KV heads: 13.4 GB of Qwen3-235B's, against TP's 1.68 GB slice) and the whole LM head each
  // step, so the measured EP curves include those reads.
  const model_config ep = rank_share_of(full, rank_layout::ep(), 8, 1.0);
  CHECK(ep.num_experts == 16);
  CHECK(ep.top_k == 8);
  CHECK(ep.num_q_heads == 64);
  CHECK(ep.num_kv_heads == 4);
  CHECK(ep.intermediate == 1536);
  CHECK(ep.vocab == full.vocab);
  CHECK(rank_share_of(full, rank_layout::ep(), 8, 1.25).top_k == 10);  // the busiest rank
  CHECK(rank_share_of(full, rank_layout::ep(), 8, 10.0).top_k == 16);  // at most E/P
  // TEP: TP's attention and LM head, EP's whole experts, top-k/P = 1 of them per token.
  for (const rank_layout& l : {rank_layout::tep(), rank_layout::tep(2)}) {
    CAPTURE(name_of(l));
    const model_config tep = rank_share_of(full, l, 8, 1.0);
    CHECK(tep.num_q_heads == 8);
    CHECK(tep.num_kv_heads == 1);
    CHECK(tep.vocab == 18992);
    CHECK(tep.num_experts == 16);
    CHECK(tep.intermediate == 1536);
    CHECK(tep.top_k == 1);
  }
  CHECK(rank_share_of(full, rank_layout::tep(), 8, 1.25).top_k == 1);  // round(1.25)
  CHECK(rank_share_of(full, rank_layout::tep(), 8, 1.5).top_k == 2);   // round(1.5), away from 0
  CHECK(rank_share_of(full, rank_layout::tep(), 8, 0.1).top_k == 1);   // at least one
  CHECK(rank_share_of(full, rank_layout::tep(), 8, 40.0).top_k == 16); // at most E/P
  for (const rank_layout& l : k_layouts) {
    CAPTURE(name_of(l));
    const bool dp = l.attention == parallel_mode::ep;
    CHECK(rank_batch(l, 5, 8) == (dp ? 1 : 5));
    CHECK(rank_batch(l, 16, 8) == (dp ? 2 : 16));
    CHECK(rank_batch(l, 17, 8) == (dp ? 3 : 17));
  }
}

TEST_CASE("rank share: the tokens a DCP rank attends over", "[cpu][rank_share]") {
  // Page 16. dcp 1: every token. dcp 2: the busier DCP index's whole pages (the one holding
  // the partial last page, or index 0 when the last page is index 1's and full).
  for (const rank_layout& l : k_layouts)
    if (l.dcp == 1) CHECK(rank_tokens(l, 8193, 16) == 8193);
  const rank_layout d2 = rank_layout::tep(2);
  CHECK(rank_tokens(d2, 513, 16) == 257);     // 33 pages: 0, 2, .., 32 (1 token)
  CHECK(rank_tokens(d2, 2049, 16) == 1025);   // 129 pages: 65, the last with 1 token
  CHECK(rank_tokens(d2, 8193, 16) == 4097);
  CHECK(rank_tokens(d2, 32769, 16) == 16385);
  CHECK(rank_tokens(d2, 16, 16) == 16);       // one page: index 0 holds it all
  CHECK(rank_tokens(d2, 32, 16) == 16);       // two full pages, one each
  CHECK(rank_tokens(d2, 40, 16) == 24);       // pages 16 + 16 + 8: index 0 holds 16 + 8
  CHECK(rank_tokens(rank_layout::tp(2), 520, 16) == 264);  // 33 pages, the last with 8
}

TEST_CASE("rank share: layouts by name, and the ones refused", "[cpu][rank_share]") {
  CHECK(name_of(rank_layout::tp()) == "TP");
  CHECK(name_of(rank_layout::tp(2)) == "TP-dcp2");
  CHECK(name_of(rank_layout::ep()) == "EP");
  CHECK(name_of(rank_layout::tep()) == "TEP");
  CHECK(name_of(rank_layout::tep(2)) == "TEP-dcp2");
  // The library's layout underneath: TEP is TP attention over EP experts.
  CHECK(moebius::parallel_layout(rank_layout::tep(2)) ==
        moebius::parallel_layout(parallel_mode::tp, parallel_mode::ep));
  CHECK(moebius::parallel_layout(rank_layout::tp(2)) == moebius::parallel_layout(parallel_mode::tp));
  for (const rank_layout& l : k_layouts) CHECK(parse_rank_layout(name_of(l)) == l);
  CHECK(parse_rank_layout("tep-dcp2") == rank_layout::tep(2));
  CHECK_THROWS_WITH(parse_rank_layout("ep-dcp2"), Catch::Contains("dcp with tp or tep only"));
  CHECK_THROWS_WITH(parse_rank_layout("tpx"), Catch::Contains("expected tp, ep or tep"));
  CHECK_THROWS_WITH(parse_rank_layout("tp-dcp"), Catch::Contains("-dcpN"));
  const model_config q235 = qwen3_235b_a22b(), q30 = qwen3_30b_a3b();
  for (const rank_layout& l : k_layouts) CHECK_NOTHROW(validate(l, q235, 8));
  // dcp must divide the P / Hkv = 2 ranks replicating a KV head.
  CHECK_THROWS_WITH(validate(rank_layout::tp(4), q235, 8), Catch::Contains("dcp 4 must divide the 2"));
  CHECK_THROWS_WITH(validate(rank_layout::tep(2), q30, 4), Catch::Contains("dcp 2 must divide the 1"));
  CHECK_NOTHROW(validate(rank_layout::tep(2), q30, 8));
  CHECK_THROWS_WITH(validate({{parallel_mode::ep, parallel_mode::tp}, 1}, q235, 8),
                    Catch::Contains("data-parallel attention with TP experts"));
  CHECK_THROWS_WITH(validate(rank_layout::tp(), q235, 16 * 3), Catch::Contains("must divide"));
}

TEST_CASE("rank share: every share the bench builds is a model the runtime accepts",
          "[cpu][rank_share]") {
  for (const model_config& full : {qwen3_30b_a3b(), qwen3_235b_a22b()})
    for (int P : {2, 4, 8})
      for (const rank_layout& l : k_layouts) {
        CAPTURE(full.num_layers, P, name_of(l));
        if (l.dcp > P / std::min<int64_t>(full.num_kv_heads, P)) continue;
        REQUIRE_NOTHROW(validate(l, full, P));
        const model_config c = rank_share_of(full, l, P, 1.0);
        CHECK_NOTHROW(validate(c));
        CHECK_NOTHROW(validate(c, 1));
        // The runtime's DCP emulation (gpu_runtime_options::emulated_dcp) needs one KV head
        // and the set's gathered q heads within a row of H.
        if (l.dcp > 1) {
          CHECK(c.num_kv_heads == 1);
          CHECK(l.dcp * c.num_q_heads * c.head_dim <= c.hidden);
        }
      }
}

TEST_CASE("rank share: the link model's price of the collectives", "[cpu][rank_share]") {
  const model_config full = qwen3_235b_a22b();  // L 94, H 4096, Hq 64, D 128
  // TP, B 128: 188 all-reduces of 2 x 7/8 x 128 x 4096 x 2 B = 1,835,008 B at 389 GB/s plus
  // 10 us each, and one more latency for the LM head: 188 x 14.7173 us + 10 us.
  CHECK(priced_collectives_s(full, rank_layout::tp(), 8, 128, 8) == Approx(2.77686e-3).epsilon(1e-4));
  // TEP prices as TP (its experts' partial sums are all-reduced as TP's are; no dispatch).
  CHECK(priced_collectives_s(full, rank_layout::tep(), 8, 128, 1) ==
        priced_collectives_s(full, rank_layout::tp(), 8, 128, 8));
  // EP, B 128: 16 sequences x 8 pairs, 7/8 leave: 112 rows of 8192 B = 917,504 B at 332 GB/s
  // plus 10 us, twice per layer: 188 x 12.7636 us.
  CHECK(priced_collectives_s(full, rank_layout::ep(), 8, 128, 8) == Approx(2.39955e-3).epsilon(1e-4));
  // EP, B 2048: 256 x 8 x 7/8 = 1792 rows, 14,680,064 B: 188 x (10 + 44.2171) us.
  CHECK(priced_collectives_s(full, rank_layout::ep(), 8, 2048, 8) == Approx(10.1928e-3).epsilon(1e-4));
  // DCP 2, B 64, per layer: q all-gather 64 x 8 x 128 x 2 = 131,072 B; LSE all-gather
  // 64 x 16 x 4 = 4,096 B; output reduce-scatter 131,072 B: 266,240 B at 389 GB/s = 0.68442 us
  // plus 3 x 10 us.
  CHECK(priced_dcp_layer_s(full, rank_layout::tp(2), 8, 64) == Approx(30.68442e-6).epsilon(1e-5));
  CHECK(priced_dcp_layer_s(full, rank_layout::tep(), 8, 64) == 0);
  // TP B 64: 188 x (10 + 917,504 B / 389 GB/s = 2.35862) us + 10 us = 2.33342 ms; with dcp 2
  // 94 x 30.68442 us more = 5.21776 ms; a fused (output, LSE) exchange saves 94 x 10 us.
  CHECK(priced_collectives_s(full, rank_layout::tp(), 8, 64, 8) == Approx(2.33342e-3).epsilon(1e-4));
  CHECK(priced_collectives_s(full, rank_layout::tp(2), 8, 64, 8) == Approx(5.21776e-3).epsilon(1e-4));
  CHECK(priced_collectives_s(full, rank_layout::tep(2), 8, 64, 1) == Approx(5.21776e-3).epsilon(1e-4));
  link_model fused;
  fused.dcp_merge_collectives = 1;
  CHECK(priced_collectives_s(full, rank_layout::tp(2), 8, 64, 8, collective_pricing::link, fused) == Approx(4.27776e-3).epsilon(1e-4));
  // B 2048: TP 188 x (10 + 29,360,128 B / 389 GB/s = 75.4759) us + 10 us = 16.0795 ms; dcp 2
  // adds 94 x (30 + 8,519,680 B / 389 GB/s = 21.9015) us = 4.87874 ms: 20.9582 ms.
  CHECK(priced_collectives_s(full, rank_layout::tp(), 8, 2048, 8) == Approx(16.0795e-3).epsilon(1e-4));
  CHECK(priced_collectives_s(full, rank_layout::tp(2), 8, 2048, 8) == Approx(20.9582e-3).epsilon(1e-4));
  CHECK(priced_collectives_s(full, rank_layout::tp(), 1, 128, 8) == 0);
}
