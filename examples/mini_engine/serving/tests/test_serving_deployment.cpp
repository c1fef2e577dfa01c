// The deployments' capacities per layout, against the paper's setting worked by hand
// (DESIGN.md §8: Qwen3-235B-A22B, P = 8, 0.85 of an H200) and against an independent sum of
// the model's tensors for random shapes.
#include <algorithm>
#include <moebius/error.hpp>
#include <random>
#include <sstream>

#include "catch.hpp"
#include "deployment.hpp"
#include "test_seed.hpp"

using namespace mini_engine;
using moebius::parallel_mode;

namespace {

// Bytes of the model's tensors, summed here from their shapes (bf16 weights): what an EP rank,
// a TP rank and the arena's spare slot hold.
struct by_hand {
  int64_t experts, attention_whole, attention_tp, dense, slot_at_least;
};

by_hand weigh(const model_config& c, int P) {
  const int64_t b = 2;  // bf16
  by_hand w{};
  w.experts = c.num_layers * (c.num_experts / P) * 3 * c.hidden * c.intermediate * b;
  const int64_t q = c.num_q_heads * c.head_dim * c.hidden * b;    // q and o alike
  const int64_t kv = c.num_kv_heads * c.head_dim * c.hidden * b;  // k and v alike
  const int64_t norms = 2 * c.head_dim * b;                       // q and k norms
  w.attention_whole = c.num_layers * (2 * q + 2 * kv + norms);
  const int64_t kv_tp = c.head_dim * c.hidden * b * std::max<int64_t>(1, c.num_kv_heads / P);
  w.attention_tp = c.num_layers * (2 * q / P + 2 * kv_tp + norms);
  w.dense = 2 * c.vocab * c.hidden * b +                         // embedding, LM head
            c.num_layers * (c.num_experts + 2) * c.hidden * b +  // router, two norms a layer
            c.hidden * b;                                        // the final norm
  w.slot_at_least = w.experts / c.num_layers;
  return w;
}

}  // namespace

TEST_CASE("deployment: the paper's Qwen3-235B-A22B on 8 H200s at 0.85, by hand") {
  const model_config c = qwen3_235b_a22b();
  const double budget = 0.85 * 143771.0 * 1048576;  // 128.14 GB of an H200
  // DESIGN.md §8: EP rank 72.7 GB of weights, TP rank 58.9 GB.
  const deployment ep = make_deployment(c, deployment_kind::static_ep);
  const deployment tp = make_deployment(c, deployment_kind::static_tp);
  const deployment sw = make_deployment(c, deployment_kind::switching);
  CHECK(ep.ep.weight_bytes == 56'774'098'944 + 13'405'043'712 + 2'589'433'856);
  CHECK(static_cast<double>(ep.ep.weight_bytes) / 1e9 == Approx(72.77).margin(0.01));
  CHECK(tp.tp.weight_bytes == 56'774'098'944 + 1'774'238'720 + 2'589'433'856 / 8);
  CHECK(static_cast<double>(tp.tp.weight_bytes) / 1e9 == Approx(58.87).margin(0.01));
  // KV a token: 94 layers x K, V x heads x 128 x 2 B; EP all 4 heads, TP one (4 < 8).
  CHECK(ep.ep.kv_bytes_per_token == 192'512);
  CHECK(tp.tp.kv_bytes_per_token == 48'128);
  const int64_t ep_rank =
      static_cast<int64_t>(budget - static_cast<double>(ep.ep.weight_bytes)) / 192'512;
  const int64_t tp_rank =
      static_cast<int64_t>(budget - static_cast<double>(tp.tp.weight_bytes)) / 48'128;
  CHECK(ep.ep.tokens == 8 * ep_rank);
  CHECK(tp.tp.tokens == tp_rank);
  CHECK(ep_rank == Approx(288'000).epsilon(0.01));         // DESIGN.md: ~288k a rank
  CHECK(tp.tp.tokens == Approx(1'440'000).epsilon(0.01));  // ~1.44M
  // "EP admits ~1.6x the tokens of TP."
  CHECK(static_cast<double>(ep.ep.tokens) / static_cast<double>(tp.tp.tokens) ==
        Approx(1.6).margin(0.02));
  // Sequences: per rank floor(pool / context) x 8 in EP; at most 2,048 running.
  CHECK(ep.ep.sequences(32768) == ep_rank / 32768 * 8);
  CHECK(tp.tp.sequences(32768) == tp_rank / 32768);
  CHECK(ep.ep.sequences(512) == 2048);
  CHECK(tp.tp.sequences(4096) == tp_rank / 4096);
  // The switching deployment: EP's weights and the spare slot, one pool read both ways.
  CHECK(sw.ep.weight_bytes == ep.ep.weight_bytes + 603'979'776);
  CHECK(sw.tp.weight_bytes == sw.ep.weight_bytes);
  CHECK(sw.ep.kv_pool_bytes == sw.tp.kv_pool_bytes);
  CHECK(sw.ep.tokens == 8 * (sw.ep.kv_pool_bytes / 192'512));
  CHECK(sw.tp.tokens == sw.tp.kv_pool_bytes / 48'128);
  // Static TP's own pool is larger than what TP reads of the switching deployment's.
  CHECK(tp.tp.kv_pool_bytes > sw.tp.kv_pool_bytes);
  CHECK_THROWS_AS(sw.ep.sequences(0), moebius::error);
  std::ostringstream os;
  os << sw;
  CHECK_THAT(os.str(), Catch::Matchers::Contains("switching (P=8, 85% of 150.8 GB)") &&
                           Catch::Matchers::Contains("EP 73.4 GB of weights"));
}

TEST_CASE("deployment: every static configuration and switching design at the paper's setting, "
          "by hand") {
  const model_config c = qwen3_235b_a22b();
  const double budget = 0.85 * 143771.0 * 1048576;  // 128,141,596,697 B
  // Weights a rank, from the tensors (the test above): TP's slice, EP's whole attention, the
  // arena's spare slot (one expert layer's share: 603,979,776 B).
  const int64_t tp_w = 56'774'098'944 + 1'774'238'720 + 2'589'433'856 / 8;  // 58,872,016,896
  const int64_t ep_w = 56'774'098'944 + 13'405'043'712 + 2'589'433'856;    // 72,768,576,512
  const int64_t slot = 603'979'776;
  auto pool = [&](int64_t w) { return static_cast<int64_t>(budget - static_cast<double>(w)); };
  CHECK(pool(tp_w) == 69'269'580'185);
  CHECK(pool(ep_w + slot) == 54'769'040'793);
  CHECK(pool(tp_w + slot) == 68'665'600'409);

  const deployment tp = make_deployment(c, deployment_kind::static_tp);
  const deployment tp2 = make_deployment(c, deployment_kind::static_tp_dcp2);
  const deployment tep2 = make_deployment(c, deployment_kind::static_tep_dcp2);
  const deployment ep = make_deployment(c, deployment_kind::static_ep);
  const deployment a = make_deployment(c, deployment_kind::switching);
  const deployment b = make_deployment(c, deployment_kind::switching_dcp2);
  const deployment x = make_deployment(c, deployment_kind::experts_only);

  // Static TP: one replicated head a rank (48,128 B a token): 69,269,580,185 / 48,128.
  CHECK(tp.tp.tokens == 1'439'278);
  // TP-DCP2: the same weights and pool; the two ranks sharing a head split its tokens: 2x.
  CHECK(tp2.tp.config == k_tp_dcp2);
  CHECK(tp2.tp.weight_bytes == tp_w);
  CHECK(tp2.tp.kv_pool_bytes == tp.tp.kv_pool_bytes);
  CHECK(tp2.tp.kv_bytes_per_token == 48'128);
  CHECK(tp2.tp.tokens == 2 * 1'439'278);
  CHECK(tp2.tp.sequences(32768) == 2 * 1'439'278 / 32768);  // 87 (TP: 43)
  CHECK(tp.tp.sequences(32768) == 43);
  CHECK_FALSE(tp2.serves(parallel_mode::ep));
  // TEP-DCP2: TP's footprint (16 whole experts weigh 128 slices of I/8), TP-DCP2's KV; the
  // large-batch layout, so held under the policy's EP mode.
  CHECK(tep2.ep.config == k_tep_dcp2);
  CHECK(tep2.ep.weight_bytes == tp.tp.weight_bytes);
  CHECK(tep2.ep.tokens == tp2.tp.tokens);
  CHECK_FALSE(tep2.serves(parallel_mode::tp));
  CHECK(tep2.start_mode() == parallel_mode::ep);
  CHECK(tep2.modes().ep == moebius::parallel_layout{parallel_mode::tp, parallel_mode::ep});
  // Static EP: 55,373,020,569 / 192,512 = 287,634 a rank, x 8.
  CHECK(ep.ep.tokens == 8 * 287'634);
  // The paper's design: EP's weights and the slot; EP 8 x 284,496, TP 1,137,987.
  CHECK(a.ep.tokens == 8 * 284'496);
  CHECK(a.tp.tokens == 1'137'987);
  // EP <-> TP-DCP2: the same footprint and EP pool; its TP view holds 2x TP's: EP's tokens to
  // within the floor of each division (8 x floor(p / 4h) against 2 x floor(p / h)).
  CHECK(b.ep.weight_bytes == a.ep.weight_bytes);
  CHECK(b.tp.weight_bytes == a.ep.weight_bytes);
  CHECK(b.ep.tokens == a.ep.tokens);
  CHECK(b.tp.config == k_tp_dcp2);
  CHECK(b.tp.tokens == 2 * 1'137'987);
  CHECK(b.tp.tokens - b.ep.tokens == 6);
  // Experts only: TP's attention and dense weights plus the arena's slot; one pool, read as
  // TP-DCP2 under either experts' layout: 68,665,600,409 / 48,128 = 1,426,728, x 2.
  CHECK(x.ep.weight_bytes == tp_w + slot);
  CHECK(x.tp.weight_bytes == x.ep.weight_bytes);
  CHECK(x.ep.config == k_tep_dcp2);
  CHECK(x.tp.config == k_tp_dcp2);
  CHECK(x.ep.tokens == 2 * 1'426'728);
  CHECK(x.tp.tokens == x.ep.tokens);
  CHECK(x.modes().ep == moebius::parallel_layout{parallel_mode::tp, parallel_mode::ep});
  CHECK(x.modes().tp == moebius::parallel_layout{parallel_mode::tp});
  CHECK(x.layouts().size() == 2);
  CHECK(tp2.layouts().size() == 1);
  // What each holds, ordered: experts only holds 2.85M, static EP 2.30M, the paper's design's TP
  // 1.14M; static TP-DCP2 the most of all (TP's small footprint, no duplicated head).
  CHECK(tp2.tp.tokens > x.ep.tokens);
  CHECK(x.ep.tokens > ep.ep.tokens);
  CHECK(dcp_of(deployment_kind::switching_dcp2) == 2);
  CHECK(dcp_of(deployment_kind::switching) == 1);
  std::ostringstream os;
  os << x;
  CHECK_THAT(os.str(), Catch::Matchers::Contains("experts only (P=8") &&
                           Catch::Matchers::Contains("TEP-DCP2 59.5 GB of weights") &&
                           Catch::Matchers::Contains("TP-DCP2 59.5 GB of weights"));
}

TEST_CASE("deployment: random shapes weigh what their tensors weigh") {
  std::mt19937_64 rng(testing::test_seed());
  for (int iter = 0; iter < 200; ++iter) {
    const int P = std::vector<int>{1, 2, 4, 8}[std::uniform_int_distribution<size_t>(0, 3)(rng)];
    auto pick = [&](int64_t lo, int64_t hi) {
      return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
    };
    model_config c = qwen3_235b_a22b();
    c.num_layers = pick(1, 100);
    c.num_kv_heads = std::vector<int64_t>{1, 2, 4, 8, 16}[static_cast<size_t>(pick(0, 4))];
    c.num_q_heads = c.num_kv_heads * pick(1, 4) * 8;
    c.head_dim = 64 * pick(1, 2);
    c.hidden = 512 * pick(1, 8);
    c.num_experts = 8 * pick(1, 32);
    c.intermediate = 64 * pick(1, 24);
    c.vocab = pick(1000, 200000);
    c.top_k = std::min<int64_t>(8, c.num_experts);
    if (c.num_kv_heads % P != 0 && P % c.num_kv_heads != 0) continue;
    deployment_options o;
    o.num_ranks = P;
    o.memory_fraction = std::uniform_real_distribution<double>(0.5, 0.95)(rng);
    o.max_running = pick(1, 4096);
    CAPTURE(iter, P, c.num_layers, c.num_kv_heads, c.num_q_heads, c.hidden, c.num_experts,
            c.intermediate, c.vocab);
    const by_hand w = weigh(c, P);
    const deployment ep = make_deployment(c, deployment_kind::static_ep, o);
    const deployment tp = make_deployment(c, deployment_kind::static_tp, o);
    const deployment sw = make_deployment(c, deployment_kind::switching, o);
    CHECK(ep.ep.weight_bytes == w.experts + w.attention_whole + w.dense);
    CHECK(tp.tp.weight_bytes == w.experts + w.attention_tp + w.dense / P);
    CHECK(sw.ep.weight_bytes - ep.ep.weight_bytes >= w.slot_at_least);  // the spare slot
    const int64_t ep_tok = c.num_layers * 2 * c.num_kv_heads * c.head_dim * 2;
    const int64_t tp_tok =
        c.num_layers * 2 * std::max<int64_t>(1, c.num_kv_heads / P) * c.head_dim * 2;
    CHECK(ep.ep.kv_bytes_per_token == ep_tok);
    CHECK(tp.tp.kv_bytes_per_token == tp_tok);
    const double budget = o.memory_fraction * o.device_bytes;
    const int64_t ep_pool = std::max<int64_t>(
        0, static_cast<int64_t>(budget - static_cast<double>(ep.ep.weight_bytes)));
    CHECK(ep.ep.kv_pool_bytes == ep_pool);
    CHECK(ep.ep.tokens == ep_pool / ep_tok * P);
    const int64_t ctx = pick(1, 40000);
    CHECK(ep.ep.sequences(ctx) == std::min(ep_pool / ep_tok / ctx * P, o.max_running));
    CHECK(tp.tp.sequences(ctx) == std::min(tp.tp.kv_pool_bytes / tp_tok / ctx, o.max_running));
    // dcp 2 where two ranks share a KV head (P / H_kv even), refused by name elsewhere.
    const bool dcp2 = c.num_kv_heads < P && (P / c.num_kv_heads) % 2 == 0;
    for (const deployment_kind k :
         {deployment_kind::static_tp_dcp2, deployment_kind::static_tep_dcp2,
          deployment_kind::switching_dcp2, deployment_kind::experts_only}) {
      if (!dcp2) {
        CHECK_THROWS_WITH(make_deployment(c, k, o), Catch::Matchers::Contains("needs dcp 2"));
        continue;
      }
      const deployment d = make_deployment(c, k, o);
      for (const layout_capacity& l : d.layouts()) {
        const int64_t per_rank = l.kv_pool_bytes / l.kv_bytes_per_token;
        CHECK(l.tokens == (l.attention() == parallel_mode::ep ? P : 2) * per_rank);
      }
      if (k == deployment_kind::static_tp_dcp2 || k == deployment_kind::static_tep_dcp2) {
        CHECK(d.layouts().front().weight_bytes == tp.tp.weight_bytes);
        CHECK(d.layouts().front().tokens == 2 * (tp.tp.kv_pool_bytes / tp_tok));
      }
      if (k == deployment_kind::switching_dcp2) {
        CHECK(d.ep.weight_bytes == sw.ep.weight_bytes);
        CHECK(d.tp.tokens == 2 * sw.tp.tokens);
      }
      if (k == deployment_kind::experts_only)
        CHECK(d.ep.weight_bytes - tp.tp.weight_bytes == sw.ep.weight_bytes - ep.ep.weight_bytes);
    }
  }
}

TEST_CASE("deployment: bad options are refused by name") {
  using Catch::Matchers::Contains;
  deployment_options o;
  o.memory_fraction = 1.5;
  CHECK_THROWS_WITH(make_deployment(qwen3_235b_a22b(), deployment_kind::switching, o),
                    Contains("memory_fraction"));
  o = {};
  o.num_ranks = 3;
  CHECK_THROWS_AS(make_deployment(qwen3_235b_a22b(), deployment_kind::switching, o),
                  moebius::error);
  o = {};
  o.max_running = 0;
  CHECK_THROWS_WITH(make_deployment(qwen3_235b_a22b(), deployment_kind::static_ep, o),
                    Contains("max_running"));
}
