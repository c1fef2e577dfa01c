// arena_geometry: hand-computed numbers for real models, alignment of every offset for random
// shapes and alignments, and the slot bookkeeping (slot_of, free_slot, mode_of, tensor_base).

#include <cstdint>
#include <sstream>

#include "moebius/layout/arena_geometry.hpp"
#include "support/catch.hpp"
#include "support/random.hpp"
#include "support/reference.hpp"

using namespace moebius;
using moebius::testing::test_seed;

namespace {
constexpr int k_w13 = 0, k_w2 = 1, k_w13_scale = 2, k_w2_scale = 3;
}

TEST_CASE("Qwen3-235B at P=8, bf16: hand-computed arena", "[layout][arena]") {
  const arena_geometry g = make_arena_geometry(qwen3_235b_a22b(), 8);
  // w13: 128 experts * 2*1536 rows * 4096 cols * 2 B / 8 ranks.
  CHECK(g.tensor_bytes[k_w13] == 402'653'184);
  // w2: 128 * 4096 * 1536 * 2 B / 8.
  CHECK(g.tensor_bytes[k_w2] == 201'326'592);
  CHECK(g.tensor_bytes[k_w13_scale] == 0);
  CHECK(g.tensor_bytes[k_w2_scale] == 0);
  CHECK(g.tensor_offset[k_w13] == 0);
  CHECK(g.tensor_offset[k_w2] == 402'653'184);
  CHECK(g.slot_bytes == 603'979'776);  // 288 MiB, already 2 MiB aligned
  CHECK(g.num_slots() == 95);
  CHECK(g.total_bytes() == int64_t{95} * 603'979'776);
  CHECK(g.layer_bytes_per_rank() == 603'979'776);
  CHECK(g.static_bytes_per_rank() == int64_t{94} * 603'979'776);
  CHECK(g.overhead_bytes() == 603'979'776);  // exactly one spare slot
  CHECK(g.overhead_fraction() == Catch::Approx(1.0 / 94.0));
  CHECK(g.total_bytes() > (int64_t{1} << 32));  // 57 GB: offsets need 64 bits
  std::ostringstream os;
  os << g;
  CHECK(os.str().find("w13@0+402653184") != std::string::npos);
}

TEST_CASE("DeepSeek-V3-like FP8 with 128x128 scales at P=8: hand-computed arena",
          "[layout][arena]") {
  expert_shape s;
  s.num_layers = 58;
  s.num_experts = 256;
  s.hidden = 7168;
  s.intermediate = 2048;
  s.weight_dtype = dtype::fp8_e4m3;
  s.block_scales = true;
  const arena_geometry g = make_arena_geometry(s, 8);
  CHECK(g.tensor_bytes[k_w13] == 939'524'096);     // 256*4096*7168*1 / 8
  CHECK(g.tensor_bytes[k_w2] == 469'762'048);      // 256*7168*2048*1 / 8
  CHECK(g.tensor_bytes[k_w13_scale] == 229'376);   // 256*32*56*4 / 8
  CHECK(g.tensor_bytes[k_w2_scale] == 114'688);    // 256*56*16*4 / 8
  CHECK(g.tensor_offset[k_w13] == 0);
  CHECK(g.tensor_offset[k_w2] == 939'524'096);
  CHECK(g.tensor_offset[k_w13_scale] == 1'409'286'144);
  CHECK(g.tensor_offset[k_w2_scale] == 1'409'515'520);
  CHECK(g.slot_bytes == 1'411'383'296);  // 1,409,630,208 rounded up to 2 MiB
  CHECK(g.overhead_bytes() == g.slot_bytes + 58 * (g.slot_bytes - 1'409'630'208));
}

TEST_CASE("tensor offsets and slots are aligned, ordered and disjoint", "[layout][arena]") {
  std::mt19937_64 rng(test_seed());
  for (int iter = 0; iter < 300; ++iter) {
    const int P = testing::pick(rng, {1, 2, 3, 4, 6, 8});
    const expert_shape s = testing::random_shape(rng, P, testing::coin(rng));
    const int64_t ta = int64_t{1} << testing::uniform(rng, 0, 12);
    const int64_t sa = ta << testing::uniform(rng, 0, 10);
    INFO(s << ", P=" << P << ", tensor_alignment=" << ta << ", slot_alignment=" << sa);
    const arena_geometry g = make_arena_geometry(s, P, ta, sa);
    CHECK(g.num_ranks == P);
    CHECK(g.tensor_alignment == ta);
    CHECK(g.slot_bytes % sa == 0);
    CHECK(g.num_slots() == s.num_layers + 1);
    int64_t end = 0;
    for (int t = 0; t < num_weight_tensors; ++t) {
      const tensor_geometry tg = geometry_of(s, static_cast<weight_tensor>(t));
      CHECK(g.tensor_bytes[t] == tg.num_experts * tg.rows * tg.cols * tg.elem_bytes / P);
      CHECK(g.tensor_offset[t] % ta == 0);
      CHECK(g.tensor_offset[t] >= end);
      CHECK(g.tensor_offset[t] < end + ta);  // no more padding than alignment needs
      end = g.tensor_offset[t] + g.tensor_bytes[t];
    }
    CHECK(g.slot_bytes >= end);
    CHECK(g.slot_bytes < end + sa + ta);
    CHECK(g.total_bytes() == g.slot_bytes * (s.num_layers + 1));
    CHECK(g.overhead_bytes() == g.total_bytes() - s.num_layers * g.layer_bytes_per_rank());
  }
}

TEST_CASE("slot bookkeeping: slot_of, free_slot, mode_of, tensor_base", "[layout][arena]") {
  std::mt19937_64 rng(test_seed());
  for (int iter = 0; iter < 50; ++iter) {
    const int P = testing::pick(rng, {1, 2, 4});
    const expert_shape s = testing::random_shape(rng, P, testing::coin(rng));
    const arena_geometry g = testing::random_geometry(rng, s, P);
    const int64_t L = s.num_layers;
    for (int64_t k = 0; k <= L; ++k) {
      const arena_cursor c{k};
      CHECK(arena_geometry::free_slot(c) == k);
      std::vector<int> used(static_cast<size_t>(L + 1), 0);
      for (int64_t l = 0; l < L; ++l) {
        const parallel_mode m = arena_geometry::mode_of(c, l);
        CHECK(m == (l < k ? parallel_mode::tp : parallel_mode::ep));
        const int64_t slot = arena_geometry::slot_of(m, l);
        CHECK(slot == (l < k ? l : l + 1));
        ++used[static_cast<size_t>(slot)];
        for (weight_tensor t : all_weight_tensors) {
          CHECK(g.tensor_base(m, l, t) ==
                slot * g.slot_bytes + g.tensor_offset[static_cast<int>(t)]);
        }
      }
      // Every slot but the free one holds exactly one layer.
      for (int64_t slot = 0; slot <= L; ++slot) {
        CHECK(used[static_cast<size_t>(slot)] == (slot == k ? 0 : 1));
      }
    }
  }
  CHECK(arena_geometry::slot_of(parallel_mode::tp, 5) == 5);
  CHECK(arena_geometry::slot_of(parallel_mode::ep, 5) == 6);
  CHECK(arena_geometry().slot_offset(3) == 0);
}
