// weight_view<ep|tp>::locate() against the independent reference placement, for every
// element of every tensor of random small shapes; each rank's local tensor is covered exactly
// once, and EP and TP hold the same bytes per rank.

#include <cstdint>
#include <vector>

#include "moebius/layout/weight_view.hpp"
#include "support/catch.hpp"
#include "support/random.hpp"
#include "support/reference.hpp"

using namespace moebius;
using moebius::testing::test_seed;

namespace {

template <parallel_mode Mode>
void check_view_against_reference(const expert_shape& s, int P, weight_tensor t) {
  const weight_view<Mode> view = make_view<Mode>(s, t, P);
  const tensor_geometry g = geometry_of(s, t);
  const int64_t eb = g.elem_bytes;
  const int64_t local_elems = g.num_experts * g.rows * g.cols / P;
  REQUIRE(view.bytes_per_rank() == local_elems * eb);
  REQUIRE(view.local_layout().size() == local_elems);
  std::vector<std::vector<uint8_t>> hits(static_cast<size_t>(P),
                                         std::vector<uint8_t>(static_cast<size_t>(local_elems), 0));
  for (int64_t e = 0; e < g.num_experts; ++e) {
    for (int64_t r = 0; r < g.rows; ++r) {
      for (int64_t c = 0; c < g.cols; ++c) {
        const element_location loc = view.locate(e, r, c);
        const testing::reference_home ref = testing::reference_home_of(s, P, t, Mode, e, r, c);
        if (loc.rank != ref.rank || loc.offset * eb != ref.byte) {
          FAIL_CHECK(to_string(Mode) << ' ' << to_string(t) << " (e=" << e << ", row=" << r
                                     << ", col=" << c << "): locate() -> rank " << loc.rank
                                     << " elem " << loc.offset << ", reference rank " << ref.rank
                                     << " byte " << ref.byte);
          return;
        }
        REQUIRE(loc.offset >= 0);
        REQUIRE(loc.offset < local_elems);
        uint8_t& h = hits[static_cast<size_t>(loc.rank)][static_cast<size_t>(loc.offset)];
        if (h < 255) ++h;
      }
    }
  }
  for (int r = 0; r < P; ++r) {
    for (int64_t i = 0; i < local_elems; ++i) {
      const int n = hits[static_cast<size_t>(r)][static_cast<size_t>(i)];
      if (n != 1) {
        FAIL_CHECK(to_string(Mode) << ' ' << to_string(t) << ": rank " << r << " local element "
                                   << i << " covered " << n << " times");
        return;
      }
    }
  }
}

}  // namespace

TEST_CASE("locate() matches the reference placement for every element", "[layout][view]") {
  std::mt19937_64 rng(test_seed());
  for (int iter = 0; iter < 120; ++iter) {
    const int P = testing::pick(rng, {1, 2, 3, 4, 8});
    const expert_shape s = testing::random_shape(rng, P, testing::coin(rng));
    INFO("iteration " << iter << ": " << s << ", P=" << P);
    for (weight_tensor t : all_weight_tensors) {
      const tensor_geometry g = geometry_of(s, t);
      if (g.bytes() == 0) {
        CHECK(make_view<parallel_mode::ep>(s, t, P).bytes_per_rank() == 0);
        CHECK(make_view<parallel_mode::tp>(s, t, P).bytes_per_rank() == 0);
        continue;
      }
      if (g.elements() > 300000) continue;  // keep the test quick
      check_view_against_reference<parallel_mode::ep>(s, P, t);
      check_view_against_reference<parallel_mode::tp>(s, P, t);
      CHECK(make_view<parallel_mode::ep>(s, t, P).bytes_per_rank() ==
            make_view<parallel_mode::tp>(s, t, P).bytes_per_rank());
    }
  }
}

TEST_CASE("worked examples of the view comments", "[layout][view]") {
  expert_shape s;
  s.num_layers = 1;
  s.num_experts = 4;
  s.hidden = 2;
  s.intermediate = 8;
  // E=4, P=2: expert 3 lives on EP rank 1 as local expert 1.
  const ep_view ep = make_view<parallel_mode::ep>(s, weight_tensor::w13, 2);
  CHECK(ep.locate(3, 0, 0).rank == 1);
  CHECK(ep.locate(3, 0, 0).offset == 1 * 16 * 2);
  // w13, I=8, P=2, gate_first: TP rank 1 holds gate rows 4..7 then up rows 12..15.
  const tp_view tp = make_view<parallel_mode::tp>(s, weight_tensor::w13, 2);
  for (int64_t row = 4; row < 8; ++row) {
    CHECK(tp.locate(0, row, 1).rank == 1);
    CHECK(tp.locate(0, row, 1).offset == (row - 4) * 2 + 1);
  }
  for (int64_t row = 12; row < 16; ++row) {
    CHECK(tp.locate(0, row, 0).rank == 1);
    CHECK(tp.locate(0, row, 0).offset == (4 + row - 12) * 2);
  }
  // up_first in TP: the up slice comes first on each rank.
  s.tp_order = gate_up_order::up_first;
  const tp_view tp_up = make_view<parallel_mode::tp>(s, weight_tensor::w13, 2);
  CHECK(tp_up.locate(0, 12, 0).rank == 1);
  CHECK(tp_up.locate(0, 12, 0).offset == 0);
  CHECK(tp_up.locate(0, 4, 0).offset == 4 * 2);
  // w2 [E, H, I]: TP rank r holds columns [r*I/P, (r+1)*I/P).
  const tp_view w2 = make_view<parallel_mode::tp>(s, weight_tensor::w2, 2);
  CHECK(w2.locate(1, 1, 5).rank == 1);
  CHECK(w2.locate(1, 1, 5).offset == 1 * 8 + 1 * 4 + 1);
}
