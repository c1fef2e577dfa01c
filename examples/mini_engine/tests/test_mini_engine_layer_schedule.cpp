// layer_schedule: the token layouts and the hand-off maps of a hybrid step, which both
// runtimes use, against a brute-force model of what each rank holds (every row of every
// rank, on random batches and EP owners).

#include <cstdint>
#include <moebius/error.hpp>
#include <moebius/kv/page_table.hpp>
#include <random>
#include <vector>

#include "catch.hpp"
#include "kv_pages.hpp"
#include "layer_schedule.hpp"

using namespace mini_engine;
using moebius::parallel_mode;

namespace {

struct batch {
  std::vector<std::vector<int32_t>> tokens;  // per item
  std::vector<int> owner;                    // per item: its EP owner
  std::vector<step_item> items;
  moebius::kv_state tp, ep;
};

// Items with 1..4 new tokens each (1 when `decode`), sequence ids shuffled, each on a random
// EP owner, with page tables of both modes holding them.
batch random_batch(std::mt19937_64& rng, int P, bool decode) {
  const auto g = moebius::make_kv_geometry(1, 2, 4, 4, 256, P, moebius::dtype::fp32);
  batch b;
  b.tp = make_empty_kv_state(g, parallel_mode::tp);
  b.ep = make_empty_kv_state(g, parallel_mode::ep);
  const int n = std::uniform_int_distribution<int>(0, 9)(rng);
  std::vector<int64_t> ids(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) ids[static_cast<size_t>(i)] = 10 * i + 3;
  std::shuffle(ids.begin(), ids.end(), rng);
  b.tokens.resize(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) {
    const int len = decode ? 1 : std::uniform_int_distribution<int>(1, 4)(rng);
    for (int j = 0; j < len; ++j) b.tokens[static_cast<size_t>(i)].push_back(j);
    b.owner.push_back(std::uniform_int_distribution<int>(0, P - 1)(rng));
    const int64_t start = std::uniform_int_distribution<int64_t>(0, 9)(rng);
    reserve_tokens(g, b.tp, ids[static_cast<size_t>(i)], start + len, 0);
    reserve_tokens(g, b.ep, ids[static_cast<size_t>(i)], start + len, b.owner.back());
    b.items.push_back({ids[static_cast<size_t>(i)], b.tokens[static_cast<size_t>(i)], start, true});
  }
  return b;
}

// The brute-force model: batch rows in item order; rank r's EP rows are the batch rows of its
// own items, in item order.
std::vector<std::vector<int64_t>> ep_rows(const batch& b, int P) {
  std::vector<std::vector<int64_t>> rows(static_cast<size_t>(P));
  int64_t t = 0;
  for (size_t i = 0; i < b.items.size(); ++i)
    for (size_t j = 0; j < b.tokens[i].size(); ++j, ++t)
      rows[static_cast<size_t>(b.owner[i])].push_back(t);
  return rows;
}

}  // namespace

TEST_CASE("layer_schedule: the worked example of the header", "[layer_schedule]") {
  const auto g = moebius::make_kv_geometry(1, 2, 4, 4, 16, 2, moebius::dtype::fp32);
  auto tp = make_empty_kv_state(g, parallel_mode::tp);
  auto ep = make_empty_kv_state(g, parallel_mode::ep);
  const std::vector<int32_t> a{1, 2}, bt{3}, c{4, 5, 6};
  const int owners[3] = {1, 0, 1};
  const std::vector<step_item> items = {{7, a, 0, true}, {8, bt, 0, true}, {9, c, 0, true}};
  for (size_t i = 0; i < items.size(); ++i) {
    reserve_tokens(g, tp, items[i].seq_id, static_cast<int64_t>(items[i].tokens.size()), 0);
    reserve_tokens(g, ep, items[i].seq_id, static_cast<int64_t>(items[i].tokens.size()), owners[i]);
  }
  const token_layout lt = token_layout_of(tp, 2, items), le = token_layout_of(ep, 2, items);
  CHECK(lt.first[0] == std::vector<int64_t>{0, 2, 3});
  CHECK(lt.first[1] == std::vector<int64_t>{0, 2, 3});
  CHECK(lt.count == std::vector<int64_t>{6, 6});
  CHECK(le.first[0] == std::vector<int64_t>{-1, 0, -1});
  CHECK(le.first[1] == std::vector<int64_t>{0, -1, 2});
  CHECK(le.count == std::vector<int64_t>{1, 5});
  const hand_off_maps m = hand_off_maps_of(lt, le, items, 5);
  CHECK(m.to_ep[1] == std::vector<int32_t>{0, 1, 3, 4, 5});
  CHECK(m.to_ep[0] == std::vector<int32_t>{2});
  CHECK(m.to_tp[0] == std::vector<int32_t>{5, 6, 0, 7, 8, 9});
  CHECK(m.to_tp[1] == m.to_tp[0]);
  CHECK(last_token_rows(le, items) == std::vector<std::pair<int, int64_t>>{{1, 1}, {0, 0}, {1, 4}});
  CHECK(last_token_rows(lt, items) == std::vector<std::pair<int, int64_t>>{{0, 1}, {0, 2}, {0, 5}});
  const step_layout hybrid = step_layout::hybrid_of(tp, ep, moebius::arena_cursor{1});
  CHECK(layer_modes(hybrid, 4) == std::vector<parallel_mode>{parallel_mode::tp, parallel_mode::ep,
                                                             parallel_mode::ep, parallel_mode::ep});
}

TEST_CASE("layer_schedule: layouts and hand-off maps match a brute-force model on random batches",
          "[layer_schedule]") {
  std::mt19937_64 rng(20261207);
  for (int trial = 0; trial < 400; ++trial) {
    const int P = 1 << std::uniform_int_distribution<int>(0, 2)(rng);  // 1, 2, 4
    const bool decode = trial % 2 == 0;
    const batch b = random_batch(rng, P, decode);
    const std::vector<std::vector<int64_t>> own = ep_rows(b, P);
    const int64_t T = [&] {
      int64_t n = 0;
      for (const auto& t : b.tokens) n += static_cast<int64_t>(t.size());
      return n;
    }();
    const token_layout lt = token_layout_of(b.tp, P, b.items);
    const token_layout le = token_layout_of(b.ep, P, b.items);
    // Layouts: TP holds the batch on every rank, EP each rank its own rows.
    int64_t longest = 1;
    for (int r = 0; r < P; ++r) {
      CHECK(lt.count[static_cast<size_t>(r)] == T);
      CHECK(le.count[static_cast<size_t>(r)] ==
            static_cast<int64_t>(own[static_cast<size_t>(r)].size()));
      longest =
          std::max<int64_t>(longest, static_cast<int64_t>(own[static_cast<size_t>(r)].size()));
    }
    CHECK(le.max_count() == longest);
    for (size_t i = 0; i < b.items.size(); ++i) CHECK(le.owner(i) == b.owner[i]);
    // Any stride the gathered blocks may have (a bucket >= the largest rank's rows).
    const int64_t stride = longest + std::uniform_int_distribution<int64_t>(0, 3)(rng);
    const hand_off_maps m = hand_off_maps_of(lt, le, b.items, stride);
    for (int r = 0; r < P; ++r) {
      // TP -> EP: rank r keeps exactly its own rows, in item order.
      const auto& keep = m.to_ep[static_cast<size_t>(r)];
      REQUIRE(keep.size() == own[static_cast<size_t>(r)].size());
      for (size_t e = 0; e < keep.size(); ++e) CHECK(keep[e] == own[static_cast<size_t>(r)][e]);
      // EP -> TP: the all-gathered blocks (rank order, `stride` rows each, holding batch row
      // ids; -1 padding); every TP row picks its own batch row back.
      std::vector<int64_t> gathered(static_cast<size_t>(P * stride), -1);
      for (int q = 0; q < P; ++q)
        for (size_t e = 0; e < own[static_cast<size_t>(q)].size(); ++e)
          gathered[static_cast<size_t>(q * stride) + e] = own[static_cast<size_t>(q)][e];
      const auto& pick = m.to_tp[static_cast<size_t>(r)];
      REQUIRE(static_cast<int64_t>(pick.size()) == T);
      for (int64_t t = 0; t < T; ++t) {
        REQUIRE(pick[static_cast<size_t>(t)] >= 0);
        REQUIRE(pick[static_cast<size_t>(t)] < P * stride);
        CHECK(gathered[static_cast<size_t>(pick[static_cast<size_t>(t)])] == t);
      }
    }
    // The LM head's rows: each item's last token, on its owner (EP) or rank 0 (TP).
    const auto le_last = last_token_rows(le, b.items), lt_last = last_token_rows(lt, b.items);
    int64_t t = 0;
    for (size_t i = 0; i < b.items.size(); ++i) {
      t += static_cast<int64_t>(b.tokens[i].size());
      CHECK(lt_last[i] == std::pair<int, int64_t>{0, t - 1});
      CHECK(le_last[i].first == b.owner[i]);
      CHECK(own[static_cast<size_t>(b.owner[i])][static_cast<size_t>(le_last[i].second)] == t - 1);
    }
  }
}

TEST_CASE("layer_schedule: refuses tables that miss a sequence or lack its tokens",
          "[layer_schedule]") {
  const auto g = moebius::make_kv_geometry(1, 2, 4, 4, 16, 2, moebius::dtype::fp32);
  auto ep = make_empty_kv_state(g, parallel_mode::ep);
  const std::vector<int32_t> two{1, 2};
  reserve_tokens(g, ep, 5, 2, 1);
  const std::vector<step_item> ok = {{5, two, 0, true}};
  CHECK(token_layout_of(ep, 2, ok).owner(0) == 1);
  const std::vector<step_item> missing = {{6, two, 0, true}};
  CHECK_THROWS_AS(token_layout_of(ep, 2, missing), moebius::error);
  const std::vector<step_item> too_long = {{5, two, 1, true}};  // needs 3 tokens
  CHECK_THROWS_AS(token_layout_of(ep, 2, too_long), moebius::error);
  CHECK_THROWS_AS(token_layout_of(ep, 4, ok), moebius::error);  // tables of 2 ranks
  auto tp = make_empty_kv_state(g, parallel_mode::tp);
  CHECK_THROWS_AS(token_layout_of(tp, 2, ok), moebius::error);  // in no TP table
}
