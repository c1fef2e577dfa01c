// KV geometry: the library's offsets against the independent formula for every coordinate,
// the documented worked examples, the kv_view accessor, and validation messages.

#include <algorithm>
#include <random>
#include <sstream>
#include <string>
#include <type_traits>

#include "kv_cases.hpp"
#include "kv_reference.hpp"
#include "moebius/kv/kv_geometry.hpp"
#include "moebius/kv/kv_view.hpp"
#include "moebius/kv/page_table.hpp"
#include "support/catch.hpp"

using namespace moebius;
using namespace moebius::testing;

static_assert(std::is_trivially_copyable_v<kv_geometry>);
static_assert(std::is_trivially_copyable_v<kv_view>);

// The message of the errc::invalid_argument `f` throws ("" when it does not throw).
namespace {

std::string error_of(auto f) {
  try {
    f();
  } catch (const moebius::error& e) {
    CHECK(e.code() == errc::invalid_argument);
    return e.what();
  }
  return "";
}

}  // namespace


TEST_CASE("kv_geometry offsets match the reference for every coordinate", "[kv][geometry]") {
  std::mt19937_64 rng(kv_test_seed());
  for (int iter = 0; iter < 60; ++iter) {
    kv_geometry g = random_kv_geometry(rng, 8192);
    g.num_ep_pages = std::min<int64_t>(g.num_ep_pages, 3);
    INFO(g);
    for (parallel_mode m : {parallel_mode::ep, parallel_mode::tp}) {
      const int64_t heads = m == parallel_mode::ep ? g.heads_per_ep_page() : g.heads_per_tp_page();
      int64_t max_end = 0;
      std::vector<uint8_t> seen(static_cast<size_t>(g.pool_bytes()), 0);
      for (int64_t l = 0; l < g.num_layers; ++l)
        for (int64_t kv = 0; kv < g.kv_tensors(); ++kv)
          for (int64_t p = 0; p < g.num_pages(m); ++p)
            for (int64_t h = 0; h < heads; ++h)
              for (int64_t t = 0; t < g.page_size; ++t)
                for (int64_t d = 0; d < g.head_dim; ++d) {
                  const int64_t off = g.offset(m, l, static_cast<kv_tensor>(kv), p, h, t, d);
                  REQUIRE(off == ref_offset(g, m, l, kv, p, h, t, d));
                  REQUIRE(seen[static_cast<size_t>(off)] == 0);  // a bijection onto the pool
                  seen[static_cast<size_t>(off)] = 1;
                  max_end = std::max(max_end, off + dtype_bytes(g.type));
                }
      REQUIRE(max_end == g.pool_bytes());
    }
    // The TP heads of rank r are the documented slice.
    for (int r = 0; r < g.num_ranks; ++r) {
      int64_t first = 0, count = 0;
      ref_heads(g, parallel_mode::tp, r, first, count);
      REQUIRE(g.tp_slice_of_rank(r) * g.heads_per_tp_page() == first);
      REQUIRE(g.heads_per_tp_page() == count);
    }
  }
}

TEST_CASE("kv_geometry worked examples", "[kv][geometry]") {
  // Qwen3-235B: H_kv=4, D=128, bf16, page 16, P=8.
  const kv_geometry g = make_kv_geometry(94, 4, 128, 16, 64, 8);
  CHECK(g.ep_page_bytes() == 16384);
  CHECK(g.tp_pages_per_ep_page() == 4);
  CHECK(g.tp_page_bytes() == 4096);
  CHECK(g.heads_per_tp_page() == 1);
  CHECK(g.tp_replicas() == 2);
  CHECK(g.tp_slice_of_rank(0) == 0);
  CHECK(g.tp_slice_of_rank(1) == 0);
  CHECK(g.tp_slice_of_rank(3) == 1);
  CHECK(g.tp_slice_of_rank(7) == 3);
  CHECK(g.num_tp_pages() == 256);
  CHECK(g.pool_bytes() == 188LL * 64 * 16384);
  CHECK(g.offset(parallel_mode::ep, 1, kv_tensor::v, 5, 2, 3, 0) ==
        3 * g.region_bytes() + 5 * 16384 + (2 * 16 + 3) * 128 * 2);
  // HND: EP page 5 head 1 is TP page 21 (rank 3's own slice).
  CHECK(g.offset(parallel_mode::ep, 0, kv_tensor::k, 5, 1, 0, 0) ==
        g.offset(parallel_mode::tp, 0, kv_tensor::k, 21, 0, 0, 0));
  // H_kv=8 on P=4: two heads per TP page; MLA replicated whole.
  const kv_geometry h8 = make_kv_geometry(1, 8, 64, 16, 4, 4);
  CHECK(h8.heads_per_tp_page() == 2);
  CHECK(h8.tp_slice_of_rank(2) == 2);
  const kv_geometry mla = make_kv_geometry(2, 0, 576, 64, 4, 8);
  CHECK(mla.latent());
  CHECK(mla.kv_tensors() == 1);
  CHECK(mla.num_tp_pages() == mla.num_ep_pages);
  CHECK(mla.tp_slice_of_rank(7) == 0);
  CHECK(ep_pages_for_bytes(g, g.pool_bytes() + 5) == 64);
}

TEST_CASE("kv_geometry rejects shapes that do not divide, naming the values", "[kv][geometry]") {
  const auto msg = [](auto f) { return error_of(f); };
  const std::string a = msg([] { (void)make_kv_geometry(1, 12, 8, 16, 4, 8); });
  CHECK(a.find("P must divide H_kv") != std::string::npos);
  CHECK(a.find("H_kv=12") != std::string::npos);
  const std::string b = msg([] { (void)make_kv_geometry(1, 3, 8, 16, 4, 4); });
  CHECK(b.find("H_kv must divide P") != std::string::npos);
  CHECK(msg([] { (void)make_kv_geometry(0, 4, 8, 16, 4, 4); }).find("num_layers") !=
        std::string::npos);
  CHECK(msg([] { (void)make_kv_geometry(1, 4, 8, 16, -1, 4); }).find("num_ep_pages") !=
        std::string::npos);
  CHECK_THROWS_AS(make_kv_geometry(1 << 20, 128, 1 << 20, 1 << 20, 1 << 20, 1), moebius::error);
}

TEST_CASE("kv_view reads the element the tables name", "[kv][view]") {
  const kv_geometry g = make_kv_geometry(2, 8, 4, 16, 8, 4, dtype::fp32, kv_layout::nhd);
  std::vector<std::byte> pool(static_cast<size_t>(g.pool_bytes()));
  const int64_t indptr[] = {0, 3, 4};
  const int64_t indices[] = {7, 2, 5, 4};
  const int64_t last[] = {8, 3};
  kv_view v{g, present_kv_layout(g), parallel_mode::tp, 3, pool.data(), 2, indptr, indices, last};
  CHECK(v.num_tokens(0) == 40);
  CHECK(v.num_tokens(1) == 3);
  CHECK(v.local_heads() == 2);
  CHECK(v.global_head(1) == 7);
  // token 35 of sequence 0 is in its third page (id 5), slot 3.
  CHECK(v.element(1, kv_tensor::v, 0, 35, 1) - pool.data() ==
        ref_offset(g, parallel_mode::tp, 1, 1, 5, 1, 3, 0));
}

// ---- decode context parallel (dcp) ------------------------------------------------------------

TEST_CASE("kv_geometry dcp: derived quantities and the documented examples", "[kv][geometry][dcp]") {
  const kv_geometry q = make_kv_geometry(94, 4, 128, 16, 64, 8);
  CHECK(q.dcp == 1);
  CHECK(q.tp_replica_sets() == 2);
  const kv_geometry g = with_dcp(q, 2);
  CHECK(g != q);
  CHECK(g == with_dcp(q, 2));
  CHECK(g.tp_replica_sets() == 1);
  CHECK(g.dcp_rank(5) == 1);
  CHECK(g.tp_rank_of(2, 0, 1) == 5);
  CHECK(g.tp_replica_set(5) == 0);
  CHECK(q.tp_replica_set(5) == 1);
  CHECK(g.dcp_pages_held(5, 0) == 3);
  CHECK(g.dcp_pages_held(5, 1) == 2);
  CHECK(g.dcp_pages_held(1, 1) == 0);
  CHECK(g.dcp_logical_page(1, 2) == 5);
  CHECK(g.token_place(35) == kv_token_place{0, 1, 3});
  CHECK(g.dcp_tokens_held(40, 0) == 24);
  CHECK(g.dcp_tokens_held(40, 1) == 16);
  CHECK(g.max_tokens(parallel_mode::ep) == 8192);
  CHECK(q.max_tokens(parallel_mode::tp) == 4096);
  CHECK(g.max_tokens(parallel_mode::tp) == 8192);
  // The pool does not change with dcp: the same bytes, the same offsets.
  CHECK(g.pool_bytes() == q.pool_bytes());
  CHECK(g.offset(parallel_mode::tp, 3, kv_tensor::v, 17, 0, 5, 9) ==
        q.offset(parallel_mode::tp, 3, kv_tensor::v, 17, 0, 5, 9));
  // Printed: dcp only when it is not 1 (today's logs unchanged).
  std::ostringstream a, b;
  a << q;
  b << g;
  CHECK(a.str().find("dcp") == std::string::npos);
  CHECK(b.str().find("dcp=2") != std::string::npos);
  // Latent KV: every TP rank holds it, so any divisor of P.
  const kv_geometry mla = with_dcp(make_kv_geometry(2, 0, 576, 64, 4, 8), 8);
  CHECK(mla.tp_replica_sets() == 1);
  CHECK(mla.dcp_rank(7) == 7);
  CHECK(mla.max_tokens(parallel_mode::tp) == mla.max_tokens(parallel_mode::ep));
}

TEST_CASE("kv_geometry refuses a bad dcp by name", "[kv][geometry][dcp]") {
  const kv_geometry q = make_kv_geometry(1, 4, 8, 16, 4, 8);
  const std::string zero = error_of([&] { (void)with_dcp(q, 0); });
  CHECK(zero.find("dcp >= 1") != std::string::npos);
  CHECK(zero.find("dcp=0") != std::string::npos);
  const std::string four = error_of([&] { (void)with_dcp(q, 4); });
  CHECK(four.find("dcp must divide tp_replicas()") != std::string::npos);
  CHECK(four.find("dcp=4") != std::string::npos);
  CHECK(four.find("P/H_kv=2") != std::string::npos);
  const kv_geometry wide = make_kv_geometry(1, 8, 8, 16, 4, 4);
  const std::string many = error_of([&] { (void)with_dcp(wide, 2); });
  CHECK(many.find("dcp must be 1 when H_kv >= P") != std::string::npos);
  const kv_geometry mla = make_kv_geometry(1, 0, 8, 16, 4, 8);
  const std::string big = error_of([&] { (void)with_dcp(mla, 16); });
  CHECK(big.find("dcp must divide P for a latent") != std::string::npos);
  CHECK(big.find("dcp=16") != std::string::npos);
  CHECK(error_of([&] { (void)with_dcp(mla, 3); }).find("dcp=3") != std::string::npos);
  CHECK(error_of([&] { (void)with_dcp(q, -2); }).find("dcp >= 1") != std::string::npos);
}

TEST_CASE("kv_geometry dcp: every token has one place, shares balanced", "[kv][geometry][dcp]") {
  std::mt19937_64 rng(kv_test_seed());
  for (int iter = 0; iter < 200; ++iter) {
    kv_geometry g = random_kv_geometry(rng, 8192);
    const int64_t reps = g.tp_replicas();
    std::vector<int64_t> allowed;
    for (int64_t d = 1; d <= reps; ++d)
      if (reps % d == 0) allowed.push_back(d);
    g = with_dcp(g, allowed[static_cast<size_t>(uni(rng, 0, static_cast<int64_t>(allowed.size()) - 1))]);
    INFO(g);
    const int64_t tokens = uni(rng, 1, 40 * g.page_size);
    const int64_t n = pages_for_tokens(tokens, g.page_size);
    // The model: page i on index i % dcp, as local page i / dcp (written out, not the library).
    std::vector<int64_t> held(static_cast<size_t>(g.dcp), 0), held_tokens(static_cast<size_t>(g.dcp), 0);
    for (int64_t t = 0; t < tokens; ++t) {
      const int64_t i = t / g.page_size;
      const kv_token_place at = g.token_place(t);
      REQUIRE(at.dcp_rank == i % g.dcp);
      REQUIRE(at.local_page == i / g.dcp);
      REQUIRE(at.slot == t - i * g.page_size);
      REQUIRE(g.dcp_logical_page(at.dcp_rank, at.local_page) == i);
      ++held_tokens[static_cast<size_t>(at.dcp_rank)];
      if (at.slot == 0) ++held[static_cast<size_t>(at.dcp_rank)];
    }
    int64_t lo = n, hi = 0;
    for (int64_t k = 0; k < g.dcp; ++k) {
      REQUIRE(g.dcp_pages_held(n, k) == held[static_cast<size_t>(k)]);
      REQUIRE(g.dcp_tokens_held(tokens, k) == held_tokens[static_cast<size_t>(k)]);
      lo = std::min(lo, held[static_cast<size_t>(k)]);
      hi = std::max(hi, held[static_cast<size_t>(k)]);
    }
    REQUIRE(hi - lo <= 1);  // balanced at every length
    // The ranks of one head slice: every (set, index) pair once, the slice the rank holds.
    for (int r = 0; r < g.num_ranks; ++r) {
      const int64_t j = g.tp_slice_of_rank(r);
      REQUIRE(g.tp_rank_of(j, g.tp_replica_set(r), g.dcp_rank(r)) == r);
    }
  }
}

TEST_CASE("kv_view with dcp reads the element of the rank's share", "[kv][view][dcp]") {
  const kv_geometry g = with_dcp(make_kv_geometry(2, 2, 4, 16, 8, 4, dtype::fp32, kv_layout::nhd), 2);
  std::vector<std::byte> pool(static_cast<size_t>(g.pool_bytes()));
  // The header's example: sequences of 40 and 3 tokens; DCP index 1 holds logical page 1 of
  // the first ({2}) and nothing of the second.
  const int64_t indptr[] = {0, 1, 1};
  const int64_t indices[] = {2};
  const int64_t last[] = {16, 0};
  const kv_pool_layout layout = vllm_flashinfer_layout(g);
  kv_view v{g, layout, parallel_mode::tp, 3, pool.data(), 2, indptr, indices, last};
  CHECK(v.dcp_rank() == 1);
  CHECK(v.num_tokens(0) == 16);
  CHECK(v.num_tokens(1) == 0);
  CHECK(v.holds(21));
  CHECK_FALSE(v.holds(35));
  // token 21 = logical page 1 = local page 0 (id 2), slot 5: where the layout puts it.
  CHECK(v.element(1, kv_tensor::v, 0, 21, 0) - pool.data() ==
        layout.offset(parallel_mode::tp, 1, kv_tensor::v, 2, 0, 5, 0));
  // EP ignores dcp: the sequence is whole on its owner.
  const int64_t ep_indptr[] = {0, 3};
  const int64_t ep_indices[] = {7, 2, 5};
  const int64_t ep_last[] = {8};
  kv_view e{g, layout, parallel_mode::ep, 1, pool.data(), 1, ep_indptr, ep_indices, ep_last};
  CHECK(e.num_tokens(0) == 40);
  CHECK(e.holds(21));
  CHECK(e.element(0, kv_tensor::k, 0, 35, 1) - pool.data() ==
        layout.offset(parallel_mode::ep, 0, kv_tensor::k, 5, 1, 3, 0));
}

TEST_CASE("page tables with dcp: each rank lists its share; validate checks it", "[kv][tables][dcp]") {
  const kv_geometry g = with_dcp(make_kv_geometry(1, 1, 4, 16, 4, 2), 2);  // one head on 2 ranks
  auto seq = [](int64_t id, int64_t tokens, std::vector<int64_t> pages) {
    kv_sequence q;
    q.seq_id = id;
    q.num_tokens = tokens;
    q.last_page_len = tokens - (tokens - 1) / 16 * 16;
    q.pages = std::move(pages);
    return q;
  };
  // 40 tokens = 3 logical pages: rank 0 holds 0 and 2, rank 1 page 1; 3 tokens: rank 0 only.
  const kv_state s = make_kv_state(g, parallel_mode::tp,
                                   {{seq(1, 40, {3, 0}), seq(2, 3, {1})}, {seq(1, 40, {2}), seq(2, 3, {})}});
  CHECK(used_pages(g, s, 0) == 3);
  CHECK(used_pages(g, s, 1) == 1);
  // A rank listing another share's count is refused, naming the DCP index and counts.
  const std::string wrong = error_of([&] {
    (void)make_kv_state(g, parallel_mode::tp, {{seq(1, 40, {3, 0})}, {seq(1, 40, {2, 1})}});
  });
  CHECK(wrong.find("DCP index 1") != std::string::npos);
  CHECK(wrong.find("lists 2 pages but holds 1") != std::string::npos);
  // The same tables are not a dcp 1 state (every rank would need all 3 pages).
  const kv_geometry one = make_kv_geometry(1, 1, 4, 16, 4, 2);
  CHECK(error_of([&] {
          (void)make_kv_state(one, parallel_mode::tp, {{seq(1, 40, {3, 0})}, {seq(1, 40, {2})}});
        }).find("num_tokens == (pages-1)*page_size") != std::string::npos);
  // Sequences must agree in tokens across the DCP indices.
  CHECK(error_of([&] {
          (void)make_kv_state(g, parallel_mode::tp, {{seq(1, 40, {3, 0})}, {seq(1, 33, {2})}});
        }).find("differs from rank 0") != std::string::npos);
  // EP states are whole on their owner whatever dcp says.
  const kv_state e = make_kv_state(g, parallel_mode::ep, {{seq(1, 40, {3, 0, 1})}, {}});
  CHECK(e.ranks[0].sequences[0].num_pages() == 3);
}
