// kv_pool_layout: the present layout reproduces kv_geometry's offsets; each preset and random
// engine-like arrays match the independent model (kv_layout_model.hpp) element by element in both
// views; validation names the broken constraint.

#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "kv_cases.hpp"
#include "kv_layout_model.hpp"
#include "kv_reference.hpp"
#include "moebius/kv/kv_pool_layout.hpp"
#include "support/catch.hpp"

using namespace moebius;
using namespace moebius::testing;

static_assert(std::is_trivially_copyable_v<kv_strides>);
static_assert(std::is_trivially_copyable_v<kv_pool_layout>);

namespace {

// Every element of both views: the layout's offset equals `ref`, and each view maps its elements
// one to one into [0, pool_bytes).
template <class Ref>
void require_offsets(const kv_geometry& g, const kv_pool_layout& l, Ref&& ref) {
  for (parallel_mode m : {parallel_mode::ep, parallel_mode::tp}) {
    const int64_t heads = m == parallel_mode::ep ? g.heads_per_ep_page() : g.heads_per_tp_page();
    std::vector<uint8_t> seen(static_cast<size_t>(l.pool_bytes), 0);
    for (int64_t layer = 0; layer < g.num_layers; ++layer)
      for (int64_t kv = 0; kv < g.kv_tensors(); ++kv)
        for (int64_t p = 0; p < g.num_pages(m); ++p)
          for (int64_t h = 0; h < heads; ++h)
            for (int64_t t = 0; t < g.page_size; ++t)
              for (int64_t d = 0; d < g.head_dim; ++d) {
                const int64_t off = l.offset(m, layer, static_cast<kv_tensor>(kv), p, h, t, d);
                REQUIRE(off == ref(m, layer, kv, p, h, t, d));
                REQUIRE(off >= 0);
                REQUIRE(off + dtype_bytes(g.type) <= l.pool_bytes);
                for (int64_t b = 0; b < dtype_bytes(g.type); ++b) {
                  REQUIRE(seen[static_cast<size_t>(off + b)] == 0);
                  seen[static_cast<size_t>(off + b)] = 1;
                }
              }
  }
}

kv_geometry small_geometry(std::mt19937_64& rng) {
  kv_geometry g = random_kv_geometry(rng, 8192);
  g.num_ep_pages = std::min<int64_t>(g.num_ep_pages, 3);
  return g;
}

std::string error_of(const kv_geometry& g, const kv_pool_layout& l) {
  try {
    validate(g, l);
  } catch (const moebius::error& e) {
    CHECK(e.code() == errc::invalid_argument);
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("present_kv_layout gives kv_geometry's offsets", "[kv][layout]") {
  std::mt19937_64 rng(kv_test_seed());
  for (int iter = 0; iter < 60; ++iter) {
    const kv_geometry g = small_geometry(rng);
    const kv_pool_layout l = present_kv_layout(g);
    INFO(g << "\n" << l);
    REQUIRE(l.pool_bytes == g.pool_bytes());
    REQUIRE(kv_slices_in_place(g, l) ==
            (g.layout == kv_layout::hnd || g.page_size == 1 || g.tp_pages_per_ep_page() == 1));
    require_offsets(g, l,
                    [&](parallel_mode m, int64_t layer, int64_t kv, int64_t p, int64_t h, int64_t t,
                        int64_t d) {
                      REQUIRE(g.offset(m, layer, static_cast<kv_tensor>(kv), p, h, t, d) ==
                              ref_offset(g, m, layer, kv, p, h, t, d));
                      return ref_offset(g, m, layer, kv, p, h, t, d);
                    });
  }
}

TEST_CASE("presets match the engines' shapes in both views", "[kv][layout]") {
  std::mt19937_64 rng(kv_test_seed() + 1);
  for (int iter = 0; iter < 60; ++iter) {
    kv_geometry g = small_geometry(rng);
    for (kv_preset p : {kv_preset::present, kv_preset::vllm_flash_attn, kv_preset::vllm_flashinfer,
                        kv_preset::sglang_mha}) {
      if (p == kv_preset::sglang_mha) g.layout = kv_layout::nhd;  // token-major buffers
      const kv_pool_layout l = kv_preset_layout(p, g);
      const layout_model model = preset_model(p, g);
      INFO(g << "\n" << l << "\nmodel " << model.order);
      REQUIRE(l.preset == p);
      REQUIRE(l.pool_bytes == model.bytes(g));
      require_offsets(
          g, l,
          [&](parallel_mode m, int64_t layer, int64_t kv, int64_t pg, int64_t h, int64_t t,
              int64_t d) { return model.offset(g, m, layer, kv, pg, h, t, d); });
    }
    // Packed vLLM FlashAttention and SGLang buffers are the present layout (HND / NHD).
    REQUIRE(vllm_flash_attn_layout(g).ep == present_kv_layout(g).ep);
    g.layout = kv_layout::nhd;
    REQUIRE(sglang_mha_layout(g).ep == present_kv_layout(g).ep);
  }
}

TEST_CASE("random engine-like arrays: the derived TP view is the engine's TP array",
          "[kv][layout]") {
  std::mt19937_64 rng(kv_test_seed() + 2);
  for (int iter = 0; iter < 80; ++iter) {
    const kv_geometry g = small_geometry(rng);
    const layout_model model = random_layout_model(rng, g);
    const kv_pool_layout l = model.layout(g);
    INFO(g << "\n" << l << "\nmodel " << model.order);
    require_offsets(g, l,
                    [&](parallel_mode m, int64_t layer, int64_t kv, int64_t p, int64_t h, int64_t t,
                        int64_t d) { return model.offset(g, m, layer, kv, p, h, t, d); });
  }
}

TEST_CASE("preset spacing: buffers at any uniform distance, one allocation each", "[kv][layout]") {
  // Qwen3-235B KV, 8 pages, P=8: pb = 16384.
  const kv_geometry g = make_kv_geometry(94, 4, 128, 16, 8, 8, dtype::bf16, kv_layout::nhd);
  const int64_t pb = g.ep_page_bytes(), region = g.region_bytes();
  // vLLM FlashAttention per-layer tensors 1 MiB apart, each its own allocation.
  const kv_pool_layout fa = vllm_flash_attn_layout(g, {1 << 20, 0, 1 << 20});
  CHECK(fa.ep.layer == 1 << 20);
  CHECK(fa.ep.kv == region);
  CHECK(fa.pool_bytes == 93 * (1 << 20) + 2 * region);
  CHECK_FALSE(kv_slices_in_place(g, fa));  // NHD
  // SGLang K and V buffers of a layer in separate allocations: per layer and K|V.
  const kv_pool_layout sg = sglang_mha_layout(g, {2 * region + 4096, region + 2048, 0});
  CHECK(sg.ep.kv == region + 2048);
  CHECK(sg.tp.token == g.heads_per_tp_page() * g.head_bytes());
  // FlashInfer, HND: K and V side by side in a block; TP keeps the order with 1/4 the heads.
  const kv_geometry h = make_kv_geometry(94, 4, 128, 16, 8, 8);
  const kv_pool_layout fi = vllm_flashinfer_layout(h);
  CHECK(fi.ep.page == 2 * pb);
  CHECK(fi.ep.kv == pb);
  CHECK(fi.tp.page == 2 * pb / 4);
  CHECK(fi.tp.kv == pb / 4);
  CHECK(kv_slice_is_block(h, fi));
  CHECK_FALSE(kv_slices_in_place(h, fi));
  CHECK(kv_slices_in_place(h, vllm_flash_attn_layout(h)));
}

TEST_CASE("kv_pool_layout validation names the broken constraint", "[kv][layout][validate]") {
  const kv_geometry g = make_kv_geometry(2, 4, 8, 16, 4, 2);  // HND, bf16, pb = 1024
  const kv_pool_layout ok = present_kv_layout(g);
  REQUIRE(error_of(g, ok).empty());
  auto with_ep = [&](auto&& change) {
    kv_strides s = ok.ep;
    change(s);
    kv_pool_layout l = ok;
    l.ep = s;
    try {
      l.tp = derive_tp_strides(g, s);
    } catch (const moebius::error&) {
    }
    return l;
  };
  auto contains = [](const std::string& s, const char* what) {
    INFO(s);
    return s.find(what) != std::string::npos;
  };
  CHECK(contains(error_of(g, with_ep([](kv_strides& s) { s.dim = 4; })), "dim stride"));
  CHECK(contains(error_of(g, with_ep([](kv_strides& s) { s.token = 32; })), "dense HND or NHD"));
  CHECK(contains(error_of(g, with_ep([](kv_strides& s) { s.base = 3; })),
                 "multiples of the element"));
  CHECK(contains(error_of(g, with_ep([](kv_strides& s) { s.layer = -8; })), ">= 0"));
  CHECK(contains(error_of(g, with_ep([](kv_strides& s) { s.page = 512; })),
                 "pages of one tensor overlap"));
  CHECK(contains(error_of(g, with_ep([](kv_strides& s) { s.kv = 1024; })), "overlap"));
  CHECK(
      contains(error_of(g, with_ep([](kv_strides& s) { s.kv = 4096 - 512; })), "layer 0 V page 0"));
  CHECK(contains(error_of(g, with_ep([](kv_strides& s) { s.base = 1024; })), "beyond pool_bytes"));
  {
    kv_pool_layout l = ok;
    l.tp.page = 1024;
    CHECK(contains(error_of(g, l), "must be derived from the EP view"));
  }
  {
    kv_pool_layout l = ok;
    l.segment_bytes = 4096 + 1024;  // tensor 1 (layer 0 V) at [4096, 8192) straddles 5120
    CHECK(contains(error_of(g, l), "crosses an allocation boundary"));
    l.segment_bytes = 4096;
    CHECK(error_of(g, l).empty());
  }
  // One EP page: its stride is never stepped in EP, but TP tiles the page by it.
  {
    const kv_geometry one = make_kv_geometry(2, 4, 8, 16, 1, 2);
    kv_strides s = present_kv_layout(one).ep;
    s.page = 512;  // < 1024 bytes of a page
    try {
      derive_tp_strides(one, s);
      FAIL("a page stride under one EP page was taken");
    } catch (const moebius::error& e) {
      CHECK(e.code() == errc::invalid_argument);
      CHECK(contains(e.what(), "smaller than an EP page (1024 bytes)"));
    }
  }
  // A shrinking stride split does not divide.
  CHECK_THROWS_AS(derive_tp_strides(g, with_ep([](kv_strides& s) { s.page = 1025; }).ep),
                  moebius::error);
  // SGLang needs NHD.
  CHECK_THROWS_AS(sglang_mha_layout(g), moebius::error);
  CHECK_THROWS_AS(kv_preset_layout(kv_preset::custom, g), moebius::error);
}

TEST_CASE("kv_pool_layout validation at any number of layers", "[kv][layout][validate]") {
  // A layer stride whose last base wraps 64 bits is refused, not taken for a base that fits.
  const kv_geometry g = make_kv_geometry(3, 4, 8, 16, 4, 2);
  kv_pool_layout wrap = present_kv_layout(g);
  wrap.ep.layer = int64_t{1} << 62;
  wrap.tp = derive_tp_strides(g, wrap.ep);
  try {
    validate(g, wrap);
    FAIL("a layout whose last layer's base overflows 64 bits validated");
  } catch (const moebius::error& e) {
    CHECK(e.code() == errc::overflow);
    CHECK(std::string(e.what()).find("KV layout base") != std::string::npos);
  }
  // 2^30 layers: the present layout, vLLM FlashInfer (K and V side by side in a block, a TP
  // view whose K|V stride shrinks) and per-layer allocations validate without a table per
  // tensor (that would be tens of GB).
  const int64_t layers = int64_t{1} << 30;
  for (kv_layout inner : {kv_layout::hnd, kv_layout::nhd}) {
    const kv_geometry big = make_kv_geometry(layers, 2, 1, 1, 2, 2, dtype::fp16, inner);
    CHECK_NOTHROW(present_kv_layout(big));
    const kv_pool_layout fi = vllm_flashinfer_layout(big);
    CHECK(fi.tp.kv != fi.ep.kv);
    CHECK_NOTHROW(validate(big, fi));
    const int64_t layer_bytes = 2 * big.region_bytes();
    CHECK_NOTHROW(vllm_flash_attn_layout(big, {2 * layer_bytes, 0, 2 * layer_bytes}));
  }
}
