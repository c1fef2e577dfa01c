// A decode step's collectives (step_collectives.hpp), priced by the link model and by the cited
// table, against values written out by hand from the formulas each documents.

#include <algorithm>

#include "catch.hpp"
#include "collective_table.hpp"
#include "step_collectives.hpp"

namespace {

using mini_engine::collective_impl;
using mini_engine::collective_kind;
using mini_engine::collective_pricing;
using mini_engine::decode_step_collectives_s;
using mini_engine::decode_step_shape;
using mini_engine::dcp_exchange_layer_s;
using mini_engine::fit_of;

// Qwen3-235B-A22B at P 8: 94 layers, hidden 4096, 64 q heads of 128.
decode_step_shape qwen3(bool tp_attention, int64_t batch, int64_t dcp = 1) {
  decode_step_shape s;
  s.tp_attention = tp_attention;
  s.dcp = dcp;
  s.batch = batch;
  s.rank_pairs = tp_attention ? 0 : (batch + 7) / 8 * 8;
  s.num_ranks = 8;
  s.layers = 94;
  s.hidden = 4096;
  s.q_heads = 64;
  s.head_dim = 128;
  return s;
}

double nccl_us(double bytes) { return fit_of(collective_kind::tp_all_reduce, collective_impl::nccl).us_at(bytes); }

}  // namespace

TEST_CASE("the link model prices a step as the region curves were priced") {
  // TP, batch 1: 188 all-reduces of 10 us + 2 x 7/8 x 8,192 B / 389 GB/s, and 10 us for the LM
  // head: the region curves' comm_priced_ms at batch 1, 1.8969 ms.
  const double tp = 94 * 2 * (10 + 2 * 7.0 / 8 * 8192 / 389e9 * 1e6) + 10;
  CHECK(tp * 1e-3 == Approx(1.8969).epsilon(1e-4));
  CHECK(decode_step_collectives_s(qwen3(true, 1), collective_pricing::link) * 1e6 == Approx(tp));
  // EP, batch 1: ceil(1/8) x 8 pairs, 7/8 of them leave at 332 GB/s: 1.9125 ms.
  const double ep = 94 * 2 * (10 + 8 * 7.0 / 8 * 8192 / 332e9 * 1e6);
  CHECK(ep * 1e-3 == Approx(1.9125).epsilon(1e-4));
  CHECK(decode_step_collectives_s(qwen3(false, 1), collective_pricing::link) * 1e6 == Approx(ep));
  // DCP 2, batch 64, a layer: q 131,072 B, LSE 4,096 B, outputs 131,072 B received at 389 GB/s
  // plus three latencies; a fused merge has one latency fewer.
  const double dcp = 30 + (131072.0 + 4096 + 131072) / 389e9 * 1e6;
  CHECK(dcp_exchange_layer_s(qwen3(true, 64, 2), collective_pricing::link) * 1e6 == Approx(dcp));
  mini_engine::link_model fused;
  fused.dcp_merge_collectives = 1;
  CHECK(dcp_exchange_layer_s(qwen3(true, 64, 2), collective_pricing::link, fused) * 1e6 ==
        Approx(dcp - 10));
  CHECK(dcp_exchange_layer_s(qwen3(true, 64, 1), collective_pricing::link) == 0);
  CHECK(dcp_exchange_layer_s(qwen3(false, 64), collective_pricing::cited) == 0);
}

TEST_CASE("the cited table prices a step by the fits") {
  // TP, batch 1: 189 all-reduces, each at the envelope's 0.5 MiB clamp (vLLM custom 7.5 us +
  // 0.5 MiB / 88.4 GB/s = 13.43 us).
  const double ar = std::min(
      fit_of(collective_kind::tp_all_reduce, collective_impl::vllm_custom).us_at(0),
      fit_of(collective_kind::tp_all_reduce, collective_impl::symmetric_memory).us_at(0));
  CHECK(ar == Approx(13.43).epsilon(2e-3));
  CHECK(decode_step_collectives_s(qwen3(true, 1), collective_pricing::cited) * 1e6 ==
        Approx(189 * ar));
  // EP, batch 1: DeepEP's dispatch and combine at their 128-token points (42.6 and 72.0 us).
  CHECK(decode_step_collectives_s(qwen3(false, 1), collective_pricing::cited) * 1e6 ==
        Approx(94 * (42.6 + 72.0)).epsilon(1e-3));
  // DCP 2, batch 64: each of the three an NCCL all-reduce of half its bytes, every one below
  // the 0.5 MiB clamp: three NCCL latencies at 0.5 MiB, a layer.
  const double dcp = dcp_exchange_layer_s(qwen3(true, 64, 2), collective_pricing::cited) * 1e6;
  CHECK(dcp == Approx(3 * nccl_us(0)));
  CHECK(dcp > 60);  // three 8-rank NCCL latencies: an over-estimate for a set of two
  // A TP-DCP2 step is TP's plus the layers' exchange.
  CHECK(decode_step_collectives_s(qwen3(true, 64, 2), collective_pricing::cited) ==
        Approx(decode_step_collectives_s(qwen3(true, 64), collective_pricing::cited) + 94 * dcp * 1e-6));
  // Past the clamp the bytes count: batch 2,048 of DCP 2 sends 8 MiB of outputs a member.
  const decode_step_shape big = qwen3(true, 2048, 2);
  const double q = 2048.0 * 8 * 128 * 2, lse = 2048.0 * 2 * 8 * 4, out = 2048.0 * 2 * 8 * 128 * 2;
  const double scale = 0.5 / (7.0 / 8);  // (d-1)/d over the table's 7/8
  CHECK(dcp_exchange_layer_s(big, collective_pricing::cited) * 1e6 ==
        Approx(nccl_us(2 * q * scale / 2) + nccl_us(2 * lse * scale / 2) + nccl_us(out * scale / 2)));
}

TEST_CASE("a shift is the difference of the two prices, and P = 1 costs nothing") {
  for (const bool tp : {true, false}) {
    for (const int64_t b : {1, 64, 2048}) {
      const decode_step_shape s = qwen3(tp, b, tp && b == 64 ? 2 : 1);
      const double d = (decode_step_collectives_s(s, collective_pricing::cited) -
                        decode_step_collectives_s(s, collective_pricing::link)) * 1e3;
      CHECK(mini_engine::collectives_shift_ms(s, collective_pricing::link, collective_pricing::cited) ==
            Approx(d));
      CHECK(mini_engine::collectives_shift_ms(s, collective_pricing::cited, collective_pricing::link) ==
            Approx(-d));
      CHECK(mini_engine::collectives_shift_ms(s, collective_pricing::cited, collective_pricing::cited) == 0);
    }
  }
  decode_step_shape one = qwen3(true, 64);
  one.num_ranks = 1;
  CHECK(decode_step_collectives_s(one, collective_pricing::cited) == 0);
  CHECK(decode_step_collectives_s(one, collective_pricing::link) == 0);
}

TEST_CASE("a bad step shape is refused by name") {
  decode_step_shape s = qwen3(true, -1);
  CHECK_THROWS_WITH(decode_step_collectives_s(s, collective_pricing::link),
                    Catch::Contains("batch -1"));
  s = qwen3(false, 8, 2);
  CHECK_THROWS_WITH(decode_step_collectives_s(s, collective_pricing::cited),
                    Catch::Contains("dcp 2 needs TP attention"));
  s = qwen3(true, 8);
  s.num_ranks = 0;
  CHECK_THROWS_WITH(decode_step_collectives_s(s, collective_pricing::cited),
                    Catch::Contains("num_ranks 0"));
}
