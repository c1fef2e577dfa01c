// plan_weight_switch on random shapes and cursors, checked by independent checkers: phases are
// race-free, every target byte is written exactly once, traffic is (P-1)/P remote, each op
// copies a logical byte to the place where the same logical byte belongs.

#include <cstdint>
#include <sstream>
#include <string>

#include "moebius/error.hpp"
#include "moebius/plan/weight_plan.hpp"
#include "plan/element_decoder.hpp"
#include "support/catch.hpp"
#include "support/plan_checks.hpp"
#include "support/random.hpp"
#include "support/reference.hpp"

using namespace moebius;
using moebius::testing::test_seed;

namespace {

// Every op of phase k moves layer l from its source slot to its target slot, and (for
// sampled rows and bytes of each op) the source byte and the destination byte are the same
// logical byte.
std::string check_op_semantics(const plan& p, const arena_geometry& g, arena_cursor from,
                               arena_cursor to) {
  const bool to_tp = to.tp_layers > from.tp_layers;
  for (size_t k = 0; k < p.phases.size(); ++k) {
    const int64_t layer = to_tp ? from.tp_layers + static_cast<int64_t>(k)
                                : from.tp_layers - 1 - static_cast<int64_t>(k);
    // The arena before and after this phase.
    const arena_cursor before{to_tp ? layer : layer + 1};
    const arena_cursor after{to_tp ? layer + 1 : layer};
    const std::string want_label =
        "layer " + std::to_string(layer) + (to_tp ? " EP->TP" : " TP->EP");
    if (p.phases[k].label != want_label) {
      return "phase " + std::to_string(k) + " is labelled '" + p.phases[k].label +
             "', expected '" + want_label + "'";
    }
    for (const copy_op& op : p.phases[k].ops) {
      const int64_t rows[] = {0, op.rows / 2, op.rows - 1};
      for (int64_t j : rows) {
        const int64_t bytes[] = {0, op.row_bytes / 3, op.row_bytes - 1};
        for (int64_t b : bytes) {
          const int64_t s = op.src_offset + j * (op.rows > 1 ? op.src_pitch : 0) + b;
          const int64_t d = op.dst_offset + j * (op.rows > 1 ? op.dst_pitch : 0) + b;
          const auto src = testing::decode(g, before, op.src_rank, s);
          const auto dst = testing::decode(g, after, op.dst_rank, d);
          std::ostringstream os;
          os << "phase " << k << " op " << op << " row " << j << " byte " << b << ": ";
          if (!src) return os.str() + "reads padding or the free slot";
          if (!dst) return os.str() + "writes padding or the free slot";
          if (src->layer != layer) return os.str() + "reads another layer";
          if (!(*src == *dst)) {
            os << "copies " << *src << " to the home of " << *dst;
            return os.str();
          }
        }
      }
    }
  }
  return "";
}

}  // namespace

TEST_CASE("random switches pass every independent plan check", "[plan]") {
  std::mt19937_64 rng(test_seed());
  int checked = 0;
  for (int iter = 0; iter < 400; ++iter) {
    const int P = testing::pick(rng, {1, 2, 3, 4, 8});
    const expert_shape s = testing::random_shape(rng, P, testing::coin(rng));
    const arena_geometry g = testing::random_geometry(rng, s, P);
    const arena_cursor from = testing::random_cursor(rng, g);
    const arena_cursor to = testing::random_cursor(rng, g);
    INFO("iteration " << iter << ": " << g << ", from " << from.tp_layers << " to "
                      << to.tp_layers);
    const plan p = plan_weight_switch(g, from, to);
    REQUIRE(p.num_ranks == P);
    const int64_t moved = std::abs(to.tp_layers - from.tp_layers);
    REQUIRE(static_cast<int64_t>(p.phases.size()) == moved);
    REQUIRE(testing::check_phase_disjoint(p) == "");
    REQUIRE(testing::check_writes_exactly_once(p, g, from, to) == "");
    REQUIRE(testing::check_traffic(p, g, from, to) == "");
    REQUIRE(check_op_semantics(p, g, from, to) == "");
    // Every transport validates first: a builder's plan must pass on the arena it targets.
    const int64_t space[num_memory_spaces] = {g.total_bytes(), 0};
    REQUIRE_NOTHROW(validate(p, space));
    // Deterministic: the same inputs give an equal plan.
    REQUIRE(plan_weight_switch(g, from, to) == p);
    // traffic_of agrees with the independent count.
    const plan_traffic t = traffic_of(p);
    REQUIRE(t.num_ops == p.num_ops());
    int64_t layer_bytes = g.layer_bytes_per_rank();
    for (int r = 0; r < P; ++r) {
      CHECK(t.bytes_local[static_cast<size_t>(r)] == moved * layer_bytes / P);
      CHECK(t.bytes_sent[static_cast<size_t>(r)] == moved * layer_bytes * (P - 1) / P);
    }
    ++checked;
  }
  CHECK(checked == 400);
}

TEST_CASE("each phase moves one layer, ascending EP->TP and descending TP->EP", "[plan]") {
  std::mt19937_64 rng(test_seed());
  expert_shape s = testing::random_shape(rng, 2, false);
  s.num_layers = 5;
  const arena_geometry g = testing::random_geometry(rng, s, 2);
  const plan up = plan_weight_switch(g, {1}, {4});
  REQUIRE(up.phases.size() == 3);
  CHECK(up.phases[0].label == "layer 1 EP->TP");
  CHECK(up.phases[1].label == "layer 2 EP->TP");
  CHECK(up.phases[2].label == "layer 3 EP->TP");
  const plan down = plan_weight_switch(g, {5}, {0});
  REQUIRE(down.phases.size() == 5);
  CHECK(down.phases[0].label == "layer 4 TP->EP");
  CHECK(down.phases[4].label == "layer 0 TP->EP");
  // A switch split at any intermediate cursor is the concatenation of its parts.
  const plan a = plan_weight_switch(g, {0}, {2});
  const plan b = plan_weight_switch(g, {2}, {5});
  const plan whole = plan_weight_switch(g, {0}, {5});
  REQUIRE(whole.phases.size() == 5);
  for (size_t k = 0; k < 2; ++k) CHECK(whole.phases[k] == a.phases[k]);
  for (size_t k = 0; k < 3; ++k) CHECK(whole.phases[k + 2] == b.phases[k]);
  // P=2, all four tensors absent except w13/w2: 2 sources x 2 destinations x 2 tensors ops at
  // least, each phase non-empty.
  for (const plan_phase& ph : whole.phases) CHECK(ph.ops.size() >= 8);
}

TEST_CASE("from == to gives an empty plan", "[plan]") {
  std::mt19937_64 rng(test_seed());
  for (int iter = 0; iter < 20; ++iter) {
    const int P = testing::pick(rng, {1, 2, 3, 4, 8});
    const arena_geometry g = testing::random_geometry(rng, testing::random_shape(rng, P, testing::coin(rng)), P);
    const arena_cursor c = testing::random_cursor(rng, g);
    const plan p = plan_weight_switch(g, c, c);
    CHECK(p.num_ranks == P);
    CHECK(p.phases.empty());
    CHECK(p.num_ops() == 0);
    CHECK(traffic_of(p).total_bytes_sent() == 0);
  }
}

TEST_CASE("cursors outside [0, L] throw", "[plan]") {
  std::mt19937_64 rng(test_seed());
  expert_shape s = testing::random_shape(rng, 2, false);
  const arena_geometry g = testing::random_geometry(rng, s, 2);
  const int64_t L = s.num_layers;
  for (auto [a, b] : {std::pair<int64_t, int64_t>{-1, 0}, {0, -1}, {0, L + 1}, {L + 1, L},
                      {INT64_MIN, 0}, {0, INT64_MAX}}) {
    INFO("from " << a << " to " << b);
    try {
      (void)plan_weight_switch(g, {a}, {b});
      FAIL("no throw");
    } catch (const moebius::error& e) {
      CHECK(e.code() == errc::invalid_argument);
      CHECK(std::string(e.what()).find("arena cursor must lie in [0, L]") != std::string::npos);
    }
  }
}

TEST_CASE("plans print their phases and ops", "[plan]") {
  std::mt19937_64 rng(test_seed());
  expert_shape s = testing::random_shape(rng, 4, true);
  s.num_layers = std::max<int64_t>(s.num_layers, 2);
  const arena_geometry g = testing::random_geometry(rng, s, 4);
  const plan p = plan_weight_switch(g, {0}, {2});
  std::ostringstream brief, full, streamed;
  print(brief, p, false);
  print(full, p, true);
  streamed << p;
  CHECK(brief.str() == streamed.str());
  CHECK(brief.str().find("4 ranks, 2 phases") != std::string::npos);
  CHECK(brief.str().find("phase 0 'layer 0 EP->TP'") != std::string::npos);
  CHECK(brief.str().find("phase 1 'layer 1 EP->TP'") != std::string::npos);
  std::ostringstream first_op;
  first_op << p.phases[0].ops.front();
  CHECK(full.str().find(first_op.str()) != std::string::npos);
  CHECK(full.str().size() > brief.str().size());
  CHECK(first_op.str().find("->") != std::string::npos);
  CHECK(first_op.str().find("arena[") != std::string::npos);
}

TEST_CASE("plans compare by value", "[plan]") {
  std::mt19937_64 rng(test_seed());
  const expert_shape s = testing::random_shape(rng, 2, false);
  const arena_geometry g = testing::random_geometry(rng, s, 2);
  const plan p = plan_weight_switch(g, {0}, {s.num_layers});
  plan q = p;
  CHECK(q == p);
  q.phases[0].ops[0].row_bytes += 1;
  CHECK_FALSE(q == p);
  q = p;
  q.phases[0].label += "x";
  CHECK_FALSE(q == p);
  q = p;
  q.num_ranks = 3;
  CHECK_FALSE(q == p);
}

TEST_CASE("the independent checkers catch broken plans", "[plan][checks]") {
  std::mt19937_64 rng(test_seed());
  for (int iter = 0; iter < 30; ++iter) {
    const int P = testing::pick(rng, {2, 3, 4, 8});
    expert_shape s = testing::random_shape(rng, P, testing::coin(rng));
    s.num_layers = std::max<int64_t>(s.num_layers, 2);
    const arena_geometry g = testing::random_geometry(rng, s, P);
    const arena_cursor from{0}, to{s.num_layers};
    const plan good = plan_weight_switch(g, from, to);
    INFO("iteration " << iter << ": " << g);
    const size_t k = static_cast<size_t>(testing::uniform(rng, 0, static_cast<int64_t>(good.phases.size()) - 1));
    const size_t i = static_cast<size_t>(testing::uniform(rng, 0, static_cast<int64_t>(good.phases[k].ops.size()) - 1));
    {  // An op run twice in its phase.
      plan bad = good;
      bad.phases[k].ops.push_back(bad.phases[k].ops[i]);
      CHECK(testing::check_phase_disjoint(bad) != "");
      CHECK(testing::check_writes_exactly_once(bad, g, from, to) != "");
      CHECK(testing::check_traffic(bad, g, from, to) != "");
    }
    {  // An op dropped.
      plan bad = good;
      bad.phases[k].ops.erase(bad.phases[k].ops.begin() + static_cast<std::ptrdiff_t>(i));
      CHECK(testing::check_phase_disjoint(bad) == "");
      CHECK(testing::check_writes_exactly_once(bad, g, from, to) != "");
      CHECK(testing::check_traffic(bad, g, from, to) != "");
    }
    {  // A destination shifted by one byte.
      plan bad = good;
      bad.phases[k].ops[i].dst_offset += 1;
      CHECK(testing::check_writes_exactly_once(bad, g, from, to) != "");
    }
    {  // Two consecutive layers in one phase: layer l+1 overwrites the slot layer l reads.
      plan bad = good;
      auto& next = bad.phases[1].ops;
      bad.phases[0].ops.insert(bad.phases[0].ops.end(), next.begin(), next.end());
      bad.phases.erase(bad.phases.begin() + 1);
      CHECK(testing::check_phase_disjoint(bad) != "");
      CHECK(testing::check_writes_exactly_once(bad, g, from, to) == "");
    }
    {  // Sent to the wrong rank (same bytes, other peer).
      plan bad = good;
      copy_op& op = bad.phases[k].ops[i];
      op.dst_rank = (op.dst_rank + 1) % P;
      CHECK(testing::check_writes_exactly_once(bad, g, from, to) != "");
    }
  }
}
