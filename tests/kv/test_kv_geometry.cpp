// KV geometry: the library's offsets against the independent formula for every coordinate,
// the documented worked examples, the kv_view accessor, and validation messages.

#include <random>
#include <string>
#include <type_traits>

#include "kv_cases.hpp"
#include "kv_reference.hpp"
#include "moebius/kv/kv_geometry.hpp"
#include "moebius/kv/kv_view.hpp"
#include "support/catch.hpp"

using namespace moebius;
using namespace moebius::testing;

static_assert(std::is_trivially_copyable_v<kv_geometry>);
static_assert(std::is_trivially_copyable_v<kv_view>);

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
  auto msg = [](auto f) -> std::string {
    try {
      f();
    } catch (const moebius::error& e) {
      CHECK(e.code() == errc::invalid_argument);
      return e.what();
    }
    return "";
  };
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
  kv_view v{g, parallel_mode::tp, 3, pool.data(), 2, indptr, indices, last};
  CHECK(v.num_tokens(0) == 40);
  CHECK(v.num_tokens(1) == 3);
  CHECK(v.local_heads() == 2);
  CHECK(v.global_head(1) == 7);
  // token 35 of sequence 0 is in its third page (id 5), slot 3.
  CHECK(v.element(1, kv_tensor::v, 0, 35, 1) - pool.data() ==
        ref_offset(g, parallel_mode::tp, 1, 1, 5, 1, 3, 0));
}
