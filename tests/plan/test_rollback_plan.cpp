// rollback_plan: undoing the completed phases of a plan restores every byte that was live
// before it, including plans whose later phases overwrite sources freed by earlier ones.
#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "moebius/error.hpp"
#include "moebius/plan/rollback.hpp"
#include "moebius/transport/host_transport.hpp"
#include "support/catch.hpp"
#include "support/reference.hpp"

namespace {

using namespace moebius;

// A chain of relocation rounds over P ranks of `num_blocks` blocks: each round moves some live
// blocks into blocks that are free at the start of the round, then frees the sources, as a KV
// migration in rounds does. Returns the plan and the live set before the first round.
struct chain {
  plan p;
  std::vector<std::vector<bool>> live_before;  // [rank][block]
};

chain random_chain(std::mt19937_64& rng, int P, int64_t num_blocks, int64_t block_bytes,
                   int rounds) {
  chain c;
  c.p.num_ranks = P;
  std::vector<std::vector<bool>> live(static_cast<size_t>(P), std::vector<bool>(static_cast<size_t>(num_blocks)));
  for (auto& rank : live) {
    for (size_t b = 0; b < rank.size(); ++b) rank[b] = (rng() % 3) != 0;
  }
  c.live_before = live;
  for (int k = 0; k < rounds; ++k) {
    plan_phase& ph = c.p.phases.emplace_back();
    ph.label = "round " + std::to_string(k);
    std::vector<std::vector<bool>> dst_taken(static_cast<size_t>(P), std::vector<bool>(static_cast<size_t>(num_blocks)));
    std::vector<std::pair<int, int64_t>> freed;
    for (int src = 0; src < P; ++src) {
      for (int64_t b = 0; b < num_blocks; ++b) {
        if (!live[static_cast<size_t>(src)][static_cast<size_t>(b)] || rng() % 2) continue;
        const int dst = static_cast<int>(rng() % static_cast<uint64_t>(P));
        for (int64_t d = 0; d < num_blocks; ++d) {
          const int64_t cand = (d + static_cast<int64_t>(rng() % static_cast<uint64_t>(num_blocks))) % num_blocks;
          if (live[static_cast<size_t>(dst)][static_cast<size_t>(cand)] || dst_taken[static_cast<size_t>(dst)][static_cast<size_t>(cand)]) continue;
          copy_op op;
          op.src_rank = src;
          op.dst_rank = dst;
          op.src_offset = b * block_bytes;
          op.dst_offset = cand * block_bytes;
          op.row_bytes = block_bytes;
          op.src_pitch = op.dst_pitch = block_bytes;
          ph.ops.push_back(op);
          dst_taken[static_cast<size_t>(dst)][static_cast<size_t>(cand)] = true;
          freed.emplace_back(src, b);
          break;
        }
      }
    }
    for (int r = 0; r < P; ++r) {
      for (int64_t b = 0; b < num_blocks; ++b) {
        if (dst_taken[static_cast<size_t>(r)][static_cast<size_t>(b)]) live[static_cast<size_t>(r)][static_cast<size_t>(b)] = true;
      }
    }
    for (auto [r, b] : freed) {
      if (!dst_taken[static_cast<size_t>(r)][static_cast<size_t>(b)]) live[static_cast<size_t>(r)][static_cast<size_t>(b)] = false;
    }
  }
  return c;
}

}  // namespace

TEST_CASE("undoing completed rounds restores every live byte", "[rollback]") {
  const uint64_t seed = testing::test_seed();
  std::mt19937_64 rng(seed);
  for (int iter = 0; iter < 200; ++iter) {
    const int P = 1 + static_cast<int>(rng() % 4);
    const int64_t blocks = 4 + static_cast<int64_t>(rng() % 12), block_bytes = 1 + static_cast<int64_t>(rng() % 33);
    const int rounds = 1 + static_cast<int>(rng() % 6);
    const chain c = random_chain(rng, P, blocks, block_bytes, rounds);
    std::vector<std::vector<std::byte>> mem(static_cast<size_t>(P), std::vector<std::byte>(static_cast<size_t>(blocks * block_bytes)));
    for (auto& m : mem) {
      for (auto& b : m) b = static_cast<std::byte>(rng());
    }
    const auto before = mem;
    std::vector<rank_memory> ranks(static_cast<size_t>(P));
    for (int r = 0; r < P; ++r) ranks[static_cast<size_t>(r)].spaces[0] = mem[static_cast<size_t>(r)];
    host_transport t(ranks);
    // Fail somewhere (or nowhere), then undo what completed.
    const int64_t fail_phase = static_cast<int64_t>(rng() % static_cast<uint64_t>(rounds + 1));
    if (fail_phase < rounds) t.inject_fault(fault_point{fail_phase, static_cast<int64_t>(rng() % 3)});
    int64_t completed = rounds;
    try {
      t.execute(c.p);
    } catch (const error& e) {
      REQUIRE(e.code() == errc::injected_fault);
      completed = t.completed_phases();
    }
    t.execute(rollback_plan(c.p, completed));
    INFO("seed " << seed << " iter " << iter << " completed " << completed);
    for (int r = 0; r < P; ++r) {
      for (int64_t b = 0; b < blocks; ++b) {
        if (!c.live_before[static_cast<size_t>(r)][static_cast<size_t>(b)]) continue;
        REQUIRE(std::memcmp(mem[static_cast<size_t>(r)].data() + b * block_bytes,
                            before[static_cast<size_t>(r)].data() + b * block_bytes,
                            static_cast<size_t>(block_bytes)) == 0);
      }
    }
  }
}

TEST_CASE("rollback_plan swaps ops, reverses phases and rejects bad input", "[rollback]") {
  plan p;
  p.num_ranks = 2;
  copy_op a;
  a.src_rank = 1;
  a.dst_rank = 0;
  a.src_offset = 100;
  a.dst_offset = 7;
  a.rows = 3;
  a.row_bytes = 4;
  a.src_pitch = 10;
  a.dst_pitch = 4;
  p.phases.push_back({"first", {a}});
  copy_op b = a;
  b.src_offset = 200;
  p.phases.push_back({"second", {b, b}});  // the same source read twice
  const plan undo = rollback_plan(p, 2);
  REQUIRE(undo.phases.size() == 2);
  CHECK(undo.phases[0].label == "undo second");
  REQUIRE(undo.phases[0].ops.size() == 1);  // duplicate destinations folded
  const copy_op& inv = undo.phases[1].ops.at(0);
  CHECK(inv.src_rank == 0);
  CHECK(inv.dst_rank == 1);
  CHECK(inv.src_offset == 7);
  CHECK(inv.dst_offset == 100);
  CHECK(inv.src_pitch == 4);
  CHECK(inv.dst_pitch == 10);
  CHECK(rollback_plan(p, 0).phases.empty());
  CHECK_THROWS_AS(rollback_plan(p, 3), error);
  CHECK_THROWS_AS(rollback_plan(p, -1), error);
}

// Found by fuzz_kv: a TP->EP round read a 12-byte head slice of a page row and, in another op,
// the whole 48-byte row; the undo wrote both back to one range. Here ops read random, partly
// overlapping slices of live blocks (contained, shifted, identical); the undo must have no
// overlapping destinations in any phase and restore every byte.
TEST_CASE("undo of ops that read overlapping source bytes has disjoint destinations",
          "[rollback]") {
  const uint64_t seed = testing::test_seed();
  std::mt19937_64 rng(seed);
  for (int iter = 0; iter < 300; ++iter) {
    const int P = 1 + static_cast<int>(rng() % 3);
    const int64_t rows = 1 + static_cast<int64_t>(rng() % 4);
    const int64_t pitch = 8 + static_cast<int64_t>(rng() % 40);
    // Up to three read regions of `rows` rows of `pitch` bytes, a few bytes apart: the undo's
    // writes on the source rank fall into one cluster per region, as an NHD KV phase's fall
    // into one per page (rollback_plan decides on first rows in each aligned cluster alone).
    const int num_regions = 1 + static_cast<int>(rng() % 3);
    const int64_t region_stride = rows * pitch + static_cast<int64_t>(rng() % 5);
    const int64_t src_bytes = num_regions * region_stride;
    const int64_t dst_base = src_bytes;  // destinations start after them
    const int num_ops = 1 + static_cast<int>(rng() % 6);
    plan p;
    p.num_ranks = P;
    plan_phase& ph = p.phases.emplace_back();
    ph.label = "overlapping reads";
    int64_t dst_cursor = dst_base;
    const int src_rank = static_cast<int>(rng() % static_cast<uint64_t>(P));
    for (int i = 0; i < num_ops; ++i) {
      copy_op op;
      op.src_rank = src_rank;
      op.dst_rank = static_cast<int>(rng() % static_cast<uint64_t>(P));
      const int64_t region = static_cast<int64_t>(rng() % static_cast<uint64_t>(num_regions));
      const int64_t begin = static_cast<int64_t>(rng() % static_cast<uint64_t>(pitch));
      op.row_bytes = 1 + static_cast<int64_t>(rng() % static_cast<uint64_t>(pitch - begin));
      // Mostly every row, so the undo's writes are row-aligned (rollback_plan decides on the
      // first row); sometimes fewer rows from any row on, so they are not (it walks every row),
      // even where ops of the same rows and pitch start a row apart.
      op.rows = rng() % 2 == 0 ? 1 + static_cast<int64_t>(rng() % static_cast<uint64_t>(rows)) : rows;
      const int64_t first_row = static_cast<int64_t>(rng() % static_cast<uint64_t>(rows - op.rows + 1));
      op.src_offset = region * region_stride + first_row * pitch + begin;
      op.src_pitch = pitch;
      op.dst_offset = dst_cursor;  // every op writes its own range on every rank
      op.dst_pitch = op.row_bytes;
      dst_cursor += op.rows * op.row_bytes;
      ph.ops.push_back(op);
    }
    const int64_t bytes = dst_cursor;
    std::vector<std::vector<std::byte>> mem(static_cast<size_t>(P), std::vector<std::byte>(static_cast<size_t>(bytes)));
    for (auto& m : mem) {
      for (auto& b : m) b = static_cast<std::byte>(rng());
    }
    const auto before = mem;
    std::vector<rank_memory> ranks(static_cast<size_t>(P));
    for (int r = 0; r < P; ++r) ranks[static_cast<size_t>(r)].spaces[0] = mem[static_cast<size_t>(r)];
    host_transport t(ranks);
    REQUIRE(find_phase_hazard(p).empty());
    t.execute(p);
    // The phase freed its source: scribble over it, as a later round reusing the page would.
    for (int64_t b = 0; b < src_bytes; ++b) mem[static_cast<size_t>(src_rank)][static_cast<size_t>(b)] = std::byte{0xEE};
    const plan undo = rollback_plan(p, 1);
    INFO("seed " << seed << " iter " << iter << "\n" << undo);
    REQUIRE(find_phase_hazard(undo).empty());
    t.execute(undo);
    // Every source byte some op read is back; bytes no op read stay scribbled.
    for (int64_t b = 0; b < src_bytes; ++b) {
      bool read = false;
      for (const copy_op& op : ph.ops) {
        for (int64_t r = 0; r < op.rows; ++r) {
          const int64_t row_begin = op.src_offset + r * op.src_pitch;
          read = read || (b >= row_begin && b < row_begin + op.row_bytes);
        }
      }
      const std::byte want = read ? before[static_cast<size_t>(src_rank)][static_cast<size_t>(b)] : std::byte{0xEE};
      REQUIRE(mem[static_cast<size_t>(src_rank)][static_cast<size_t>(b)] == want);
    }
  }
}
