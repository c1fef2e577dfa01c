// The model's configuration, element conversions, seeded weights and their placement into
// the arena (read back through moebius::weight_view, element by element).

#include <cmath>
#include <cstring>
#include <moebius/error.hpp>
#include <moebius/layout/weight_view.hpp>
#include <random>
#include <string>

#include "catch.hpp"
#include "model_config.hpp"
#include "numerics.hpp"
#include "weights.hpp"

using namespace mini_engine;
using moebius::dtype;
using moebius::errc;
using moebius::parallel_mode;

namespace {

// The error's code and message of f(), or errc::internal and "" when it does not throw.
template <class F>
std::pair<errc, std::string> error_of(F&& f) {
  try {
    f();
  } catch (const moebius::error& e) {
    return {e.code(), e.what()};
  }
  return {errc::internal, ""};
}

}  // namespace

TEST_CASE("model_config: presets validate and map to moebius descriptors", "[model]") {
  for (int P : {1, 2, 4}) {
    validate(tiny(), P);
    validate(small(), P);
    model_config fp8 = small();
    fp8.expert_dtype = dtype::fp8_e4m3;
    validate(fp8, P);
  }
  validate(qwen3_30b_a3b(), 8);
  const auto s = expert_shape_of(qwen3_30b_a3b());
  CHECK(s.num_layers == 48);
  CHECK(s.num_experts == 128);
  CHECK(s.hidden == 2048);
  CHECK(s.intermediate == 768);
  CHECK(s.weight_dtype == dtype::bf16);
  const auto g = kv_geometry_of(qwen3_30b_a3b(), 8, 10);
  CHECK(g.num_kv_heads == 4);
  CHECK(g.head_dim == 128);
  CHECK(g.tp_replicas() == 2);
  CHECK(qwen3_30b_a3b().vocab == 151936);
}

TEST_CASE("model_config: bad configs name the broken constraint", "[model]") {
  struct bad {
    void (*edit)(model_config&);
    int P;
    const char* says;
  };
  const bad cases[] = {
      {[](model_config& c) { c.hidden = 0; }, 1, "hidden"},
      {[](model_config& c) { c.num_kv_heads = 3; }, 1, "num_kv_heads must divide"},
      {[](model_config& c) { c.head_dim = 7; }, 1, "even"},
      {[](model_config& c) { c.top_k = 9; }, 1, "top_k"},
      {[](model_config& c) { c.kv_dtype = dtype::fp8_e4m3; }, 1, "kv_dtype"},
      {[](model_config& c) { c.expert_dtype = dtype::fp16; }, 1, "expert_dtype"},
      {[](model_config& c) {
         c.expert_dtype = dtype::fp8_e4m3;
         c.fp8_block = 24;
       },
       1, "fp8_block"},
      {[](model_config& c) { c.rope_theta = 0; }, 1, "rope_theta"},
      {[](model_config& c) {
         c.num_q_heads = 6;
         c.num_kv_heads = 2;
       },
       4, "num_q_heads"},
      {[](model_config& c) {
         c.num_experts = 6;
         c.top_k = 2;
       },
       4, "E"},
  };
  for (const bad& b : cases) {
    model_config c = tiny();
    b.edit(c);
    const auto [code, what] = error_of([&] { validate(c, b.P); });
    INFO(b.says << ": " << what);
    CHECK(code == errc::invalid_argument);
    CHECK(what.find(b.says) != std::string::npos);
  }
}

TEST_CASE("bf16 and fp8 e4m3 conversions round to nearest even", "[model]") {
  CHECK(to_bf16(1.0f) == 0x3f80);
  CHECK(from_bf16(0x3f80) == 1.0f);
  CHECK(round_bf16(1.0f + 0x1p-8f) == 1.0f);            // tie -> even
  CHECK(round_bf16(1.0f + 0x3p-8f) == 1.0f + 0x1p-6f);  // tie -> even (up)
  CHECK(to_fp8_e4m3(1.0f) == 0x38);
  CHECK(from_fp8_e4m3(0x7e) == 448.0f);
  CHECK(to_fp8_e4m3(1000.0f) == 0x7e);                 // saturates
  CHECK(round_fp8_e4m3(1.0625f) == 1.0f);              // tie -> even
  CHECK(round_fp8_e4m3(1.1875f) == 1.25f);             // tie -> even (up)
  CHECK(from_fp8_e4m3(0x01) == std::ldexp(1.0f, -9));  // smallest subnormal
  // Every finite code decodes and re-encodes to itself (+-0 aside).
  for (int v = 0; v < 256; ++v) {
    const auto u = static_cast<uint8_t>(v);
    const float f = from_fp8_e4m3(u);
    if (std::isnan(f) || f == 0) continue;
    INFO("code " << v);
    CHECK(to_fp8_e4m3(f) == u);
  }
  // Rounding is to the nearest representable value.
  std::mt19937_64 rng(3);
  for (int i = 0; i < 2000; ++i) {
    const float f = std::ldexp(std::uniform_real_distribution<float>(-1, 1)(rng),
                               static_cast<int>(rng() % 20) - 10);
    const float r = round_fp8_e4m3(f);
    for (int v = 0; v < 256; ++v) {
      const float c = from_fp8_e4m3(static_cast<uint8_t>(v));
      if (!std::isnan(c)) REQUIRE(std::fabs(c - f) >= std::fabs(r - f));
    }
  }
}

TEST_CASE("weights: seeded, shaped, and rounded experts are a fixed point", "[model]") {
  for (dtype t : {dtype::fp32, dtype::bf16, dtype::fp8_e4m3}) {
    model_config c = tiny();
    c.expert_dtype = t;
    const model_weights a = make_weights(c, 11), b = make_weights(c, 11), d = make_weights(c, 12);
    validate(a);
    CHECK(a.layers[1].w13 == b.layers[1].w13);
    CHECK(a.embed != d.embed);
    model_weights again = a;
    round_experts(again);
    CHECK(again.layers[0].w13 == a.layers[0].w13);
    CHECK(again.layers[1].w2 == a.layers[1].w2);
    for (float v : a.layers[0].w13) {
      if (t == dtype::bf16) REQUIRE(round_bf16(v) == v);
    }
    if (t == dtype::fp8_e4m3) {
      CHECK(a.layers[0].w13_scale.size() ==
            static_cast<size_t>(c.num_experts * (2 * c.intermediate / c.fp8_block) *
                                (c.hidden / c.fp8_block)));
      for (float s : a.layers[0].w2_scale) {
        int e;
        REQUIRE(std::frexp(s, &e) == 0.5f);  // a power of two
      }
    }
  }
  model_weights w = make_weights(tiny(), 1);
  w.layers[1].k_norm.pop_back();
  const auto [code, what] = error_of([&] { validate(w); });
  CHECK(code == errc::invalid_argument);
  CHECK(what.find("layer 1 k_norm") != std::string::npos);
}

TEST_CASE("weights: placement in EP and TP puts every element where the views say", "[model]") {
  for (dtype t : {dtype::fp32, dtype::bf16, dtype::fp8_e4m3})
    for (int P : {1, 2, 4}) {
      model_config c = tiny();
      c.expert_dtype = t;
      const model_weights w = make_weights(c, 5);
      const auto g = moebius::make_arena_geometry(expert_shape_of(c), P, 64, 256);
      std::vector<std::vector<std::byte>> arenas(
          static_cast<size_t>(P), std::vector<std::byte>(static_cast<size_t>(g.total_bytes())));
      std::vector<std::span<std::byte>> spans(arenas.begin(), arenas.end());
      const moebius::arena_cursor cursor{1};  // layer 0 TP, layer 1 EP
      place_experts(w, g, cursor, spans);
      for (int64_t layer = 0; layer < c.num_layers; ++layer) {
        const parallel_mode m = moebius::arena_geometry::mode_of(cursor, layer);
        const auto& lw = w.layers[static_cast<size_t>(layer)];
        auto decode = [&](moebius::weight_tensor tensor, int64_t e, int64_t r, int64_t q) {
          const auto at =
              m == parallel_mode::ep
                  ? moebius::make_view<parallel_mode::ep>(g.shape, tensor, P).locate(e, r, q)
                  : moebius::make_view<parallel_mode::tp>(g.shape, tensor, P).locate(e, r, q);
          const std::byte* p =
              arenas[static_cast<size_t>(at.rank)].data() + g.tensor_base(m, layer, tensor);
          if (t == dtype::fp32 || tensor == moebius::weight_tensor::w13_scale ||
              tensor == moebius::weight_tensor::w2_scale) {
            float f;
            std::memcpy(&f, p + 4 * at.offset, 4);
            return f;
          }
          if (t == dtype::bf16) {
            uint16_t u;
            std::memcpy(&u, p + 2 * at.offset, 2);
            return from_bf16(u);
          }
          return from_fp8_e4m3(static_cast<uint8_t>(p[at.offset]));
        };
        const int64_t E = c.num_experts, H = c.hidden, I = c.intermediate, b = c.fp8_block;
        for (int64_t e = 0; e < E; ++e) {
          for (int64_t r = 0; r < 2 * I; ++r)
            for (int64_t q = 0; q < H; ++q) {
              float v = decode(moebius::weight_tensor::w13, e, r, q);
              if (t == dtype::fp8_e4m3)
                v *= decode(moebius::weight_tensor::w13_scale, e, r / b, q / b);
              REQUIRE(v == lw.w13[static_cast<size_t>((e * 2 * I + r) * H + q)]);
            }
          for (int64_t r = 0; r < H; ++r)
            for (int64_t q = 0; q < I; ++q) {
              float v = decode(moebius::weight_tensor::w2, e, r, q);
              if (t == dtype::fp8_e4m3)
                v *= decode(moebius::weight_tensor::w2_scale, e, r / b, q / b);
              REQUIRE(v == lw.w2[static_cast<size_t>((e * H + r) * I + q)]);
            }
        }
      }
    }
}

TEST_CASE("weights: placement into one slot writes what whole-arena placement writes there",
          "[model]") {
  for (dtype t : {dtype::fp32, dtype::bf16, dtype::fp8_e4m3}) {
    for (int P : {1, 2}) {
      model_config c = tiny();
      c.expert_dtype = t;
      const model_weights w = make_weights(c, 77);
      const auto g = moebius::make_arena_geometry(expert_shape_of(c), P, 256, 4096);
      for (parallel_mode m : {parallel_mode::ep, parallel_mode::tp})
        for (int64_t layer = 0; layer < c.num_layers; ++layer) {
          std::vector<std::vector<std::byte>> whole(
              static_cast<size_t>(P), std::vector<std::byte>(static_cast<size_t>(g.total_bytes())));
          std::vector<std::vector<std::byte>> slot(
              static_cast<size_t>(P), std::vector<std::byte>(static_cast<size_t>(g.slot_bytes)));
          std::vector<std::span<std::byte>> ws(whole.begin(), whole.end());
          std::vector<std::span<std::byte>> ss(slot.begin(), slot.end());
          place_layer_experts(w, g, layer, m, ws);
          place_layer_experts_in_slot(w, g, layer, m, ss);
          const int64_t at = g.slot_offset(moebius::arena_geometry::slot_of(m, layer));
          for (int r = 0; r < P; ++r) {
            const auto& a = whole[static_cast<size_t>(r)];
            CHECK(std::memcmp(a.data() + at, slot[static_cast<size_t>(r)].data(),
                              static_cast<size_t>(g.slot_bytes)) == 0);
            // Nothing outside the slot was written.
            bool outside_zero = true;
            for (int64_t i = 0; i < g.total_bytes(); ++i)
              if ((i < at || i >= at + g.slot_bytes) && a[static_cast<size_t>(i)] != std::byte{0})
                outside_zero = false;
            CHECK(outside_zero);
          }
        }
      std::vector<std::vector<std::byte>> small(static_cast<size_t>(P),
                                                std::vector<std::byte>(16));
      std::vector<std::span<std::byte>> sm(small.begin(), small.end());
      CHECK_THROWS_AS(place_layer_experts_in_slot(w, g, 0, parallel_mode::ep, sm), moebius::error);
    }
  }
}
