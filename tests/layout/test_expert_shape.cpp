// validate(expert_shape, P) and make_arena_geometry reject every invalid input with the
// right code and a message that names the constraint.

#include <cstdint>
#include <limits>

#include "layout/error_matchers.hpp"
#include "moebius/layout/arena_geometry.hpp"
#include "moebius/layout/expert_shape.hpp"
#include "support/catch.hpp"
#include "support/random.hpp"
#include "support/reference.hpp"

using namespace moebius;
using moebius::testing::test_seed;

namespace {

expert_shape small_shape() {
  expert_shape s;
  s.num_layers = 3;
  s.num_experts = 8;
  s.hidden = 64;
  s.intermediate = 32;
  return s;
}

expert_shape qwen3_fp8() {
  expert_shape s = qwen3_235b_a22b();
  s.weight_dtype = dtype::fp8_e4m3;
  s.block_scales = true;
  return s;
}

}  // namespace

TEST_CASE("valid shapes pass", "[layout][validate]") {
  CHECK_NOTHROW(validate(small_shape(), 1));
  CHECK_NOTHROW(validate(small_shape(), 2));
  CHECK_NOTHROW(validate(small_shape(), 8));
  CHECK_NOTHROW(validate(qwen3_235b_a22b(), 8));
  CHECK_NOTHROW(validate(qwen3_fp8(), 4));  // I/P = 384 = 3 blocks
  CHECK_NOTHROW(validate(qwen3_fp8(), 1));
}

TEST_CASE("random_shape always yields valid shapes", "[layout][validate]") {
  std::mt19937_64 rng(test_seed());
  for (int P : {1, 2, 3, 4, 5, 8}) {
    for (int i = 0; i < 50; ++i) {
      const expert_shape s = testing::random_shape(rng, P, (i & 1) != 0);
      INFO(s << " P=" << P);
      CHECK_NOTHROW(validate(s, P));
      CHECK(s.num_experts <= std::max(256, P));
    }
  }
}

TEST_CASE("num_ranks < 1 is rejected", "[layout][validate]") {
  for (int P : {0, -1, std::numeric_limits<int>::min()}) {
    REQUIRE_MOEBIUS_ERROR(validate(small_shape(), P), errc::invalid_argument,
                          "num_ranks must be >= 1");
    REQUIRE_MOEBIUS_ERROR(make_arena_geometry(small_shape(), P), errc::invalid_argument,
                          "num_ranks must be >= 1");
  }
}

TEST_CASE("zero or negative sizes are rejected", "[layout][validate]") {
  for (int64_t bad : {int64_t{0}, int64_t{-1}, std::numeric_limits<int64_t>::min()}) {
    expert_shape s = small_shape();
    s.num_layers = bad;
    REQUIRE_MOEBIUS_ERROR(validate(s, 2), errc::invalid_argument, "num_layers (L) must be > 0");
    s = small_shape();
    s.num_experts = bad;
    REQUIRE_MOEBIUS_ERROR(validate(s, 2), errc::invalid_argument, "num_experts (E) must be > 0");
    s = small_shape();
    s.hidden = bad;
    REQUIRE_MOEBIUS_ERROR(validate(s, 2), errc::invalid_argument, "hidden (H) must be > 0");
    s = small_shape();
    s.intermediate = bad;
    REQUIRE_MOEBIUS_ERROR(validate(s, 2), errc::invalid_argument, "intermediate (I) must be > 0");
    REQUIRE_MOEBIUS_ERROR(make_arena_geometry(s, 2), errc::invalid_argument, "must be > 0");
  }
}

TEST_CASE("unknown dtypes are rejected", "[layout][validate]") {
  expert_shape s = small_shape();
  s.weight_dtype = static_cast<dtype>(99);
  REQUIRE_MOEBIUS_ERROR(validate(s, 2), errc::invalid_argument, "unknown weight dtype");
  s = small_shape();
  s.block_scales = true;
  s.scale_block_n = s.scale_block_k = 16;
  s.scale_dtype = static_cast<dtype>(42);
  REQUIRE_MOEBIUS_ERROR(validate(s, 2), errc::invalid_argument, "unknown scale dtype");
}

TEST_CASE("P must divide E and I", "[layout][validate]") {
  expert_shape s = small_shape();  // E=8, I=32
  REQUIRE_MOEBIUS_ERROR(validate(s, 3), errc::invalid_argument,
                        "must divide num_experts (E) for EP (E=8, P=3)");
  s.num_experts = 12;
  CHECK_NOTHROW(validate(s, 4));
  s.intermediate = 30;  // P=4 divides E=12 but not I=30
  REQUIRE_MOEBIUS_ERROR(validate(s, 4), errc::invalid_argument,
                        "must divide intermediate (I) for TP (I=30, P=4)");
  REQUIRE_MOEBIUS_ERROR(make_arena_geometry(s, 4), errc::invalid_argument, "must divide");
  // Qwen3-235B: E=128 experts cannot be split over 3 or 5 ranks.
  REQUIRE_MOEBIUS_ERROR(validate(qwen3_235b_a22b(), 3), errc::invalid_argument, "must divide");
  REQUIRE_MOEBIUS_ERROR(validate(qwen3_235b_a22b(), 256), errc::invalid_argument, "must divide");
}

TEST_CASE("scale blocks must tile every tensor and every TP slice", "[layout][validate]") {
  expert_shape s = small_shape();  // H=64, I=32
  s.block_scales = true;
  s.scale_block_n = 0;
  s.scale_block_k = 16;
  REQUIRE_MOEBIUS_ERROR(validate(s, 2), errc::invalid_argument, "scale blocks must be > 0");
  s.scale_block_n = 16;
  s.scale_block_k = -16;
  REQUIRE_MOEBIUS_ERROR(validate(s, 2), errc::invalid_argument, "scale blocks must be > 0");

  s.scale_block_k = 16;
  s.scale_block_n = 64;  // I=32 not a multiple of 64
  REQUIRE_MOEBIUS_ERROR(validate(s, 2), errc::invalid_argument,
                        "block_n must divide intermediate (I)");
  s.scale_block_n = 16;
  s.scale_block_k = 128;  // H=64
  REQUIRE_MOEBIUS_ERROR(validate(s, 2), errc::invalid_argument, "block_k must divide hidden (H)");
  s.hidden = 48;  // bk=16 | 48, bn=32 | I=32 but not | H=48
  s.scale_block_k = 16;
  s.scale_block_n = 32;
  REQUIRE_MOEBIUS_ERROR(validate(s, 2), errc::invalid_argument, "block_n must divide hidden (H)");
  s.hidden = 96;  // bn=32 | H, I=32; bk=96 | H, not | I=32
  s.scale_block_k = 96;
  REQUIRE_MOEBIUS_ERROR(validate(s, 1), errc::invalid_argument,
                        "block_k must divide intermediate (I)");
  // Whole blocks in the tensors, but the TP slice I/P = 16 is half a block of 32.
  s = small_shape();
  s.block_scales = true;
  s.scale_block_n = 32;
  s.scale_block_k = 16;
  CHECK_NOTHROW(validate(s, 1));
  REQUIRE_MOEBIUS_ERROR(validate(s, 2), errc::invalid_argument,
                        "each TP slice I/P must be whole scale blocks (I/P=16");
  s.scale_block_n = 16;
  s.scale_block_k = 32;
  REQUIRE_MOEBIUS_ERROR(validate(s, 2), errc::invalid_argument, "each TP slice I/P");
  // Qwen3-235B FP8 at P=8: I/P = 192 is not a multiple of 128.
  REQUIRE_MOEBIUS_ERROR(validate(qwen3_fp8(), 8), errc::invalid_argument,
                        "each TP slice I/P must be whole scale blocks (I/P=192, block_n=128");
  REQUIRE_MOEBIUS_ERROR(make_arena_geometry(qwen3_fp8(), 8), errc::invalid_argument, "I/P=192");
  // Scales off: the block sizes are ignored.
  expert_shape off = qwen3_fp8();
  off.block_scales = false;
  CHECK_NOTHROW(validate(off, 8));
}

TEST_CASE("byte counts that overflow 64 bits are rejected", "[layout][validate]") {
  expert_shape s = small_shape();
  s.num_experts = int64_t{1} << 30;
  s.hidden = int64_t{1} << 20;
  s.intermediate = int64_t{1} << 20;  // E*2I*H*2 = 2^72
  REQUIRE_MOEBIUS_ERROR(validate(s, 1), errc::overflow, "overflows 64 bits");
  REQUIRE_MOEBIUS_ERROR(make_arena_geometry(s, 1), errc::overflow, "overflows 64 bits");
  // One layer fits, the stack of L+1 slots does not.
  s = small_shape();
  s.num_experts = int64_t{1} << 20;
  s.hidden = int64_t{1} << 16;
  s.intermediate = int64_t{1} << 16;  // one layer: 3 * 2^53 B
  s.num_layers = 1;
  s.weight_dtype = dtype::fp8_e4m3;
  CHECK_NOTHROW(validate(s, 1));
  s.num_layers = 1024;
  REQUIRE_MOEBIUS_ERROR(validate(s, 1), errc::overflow, "overflows 64 bits");
  // L + 1 itself must not wrap.
  s = small_shape();
  s.num_layers = std::numeric_limits<int64_t>::max();
  REQUIRE_MOEBIUS_ERROR(validate(s, 1), errc::overflow, "overflows 64 bits");
}

TEST_CASE("make_arena_geometry rejects bad alignments", "[layout][arena]") {
  const expert_shape s = small_shape();
  for (int64_t bad : {int64_t{0}, int64_t{-256}, int64_t{3}, int64_t{96}}) {
    REQUIRE_MOEBIUS_ERROR(make_arena_geometry(s, 2, bad), errc::invalid_argument,
                          "tensor_alignment must be a power of two");
  }
  for (int64_t bad : {int64_t{0}, int64_t{-4096}, int64_t{100}, int64_t{128}}) {
    REQUIRE_MOEBIUS_ERROR(make_arena_geometry(s, 2, 256, bad), errc::invalid_argument,
                          "slot_alignment must be a power of two >= tensor_alignment");
  }
  CHECK_NOTHROW(make_arena_geometry(s, 2, 1, 1));
  CHECK_NOTHROW(make_arena_geometry(s, 2, 256, 256));
  // Alignments so large that the padded arena no longer fits in 64 bits.
  REQUIRE_MOEBIUS_ERROR(make_arena_geometry(s, 2, 256, int64_t{1} << 62), errc::overflow,
                        "overflows 64 bits");
  REQUIRE_MOEBIUS_ERROR(make_arena_geometry(s, 2, int64_t{1} << 62, int64_t{1} << 62),
                        errc::overflow, "overflows 64 bits");
}

TEST_CASE("cursors outside [0, L] are rejected", "[layout][arena]") {
  const arena_geometry g = make_arena_geometry(small_shape(), 2);  // L = 3
  for (int64_t k = 0; k <= 3; ++k) CHECK_NOTHROW(validate(g, arena_cursor{k}));
  for (int64_t k : {int64_t{-1}, int64_t{4}, std::numeric_limits<int64_t>::max(),
                    std::numeric_limits<int64_t>::min()}) {
    REQUIRE_MOEBIUS_ERROR(validate(g, arena_cursor{k}), errc::invalid_argument,
                          "arena cursor must lie in [0, L]");
  }
}
