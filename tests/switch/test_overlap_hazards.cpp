// The overlap order of a progressive switch (switch/overlap.hpp) on a model of one rank's two
// streams: decode steps on the compute stream, the switch's copies on the copy stream, and only
// the waits copy_waits() and step_waits() name between them. The model knows what every weight
// slot and every layer's KV pages must hold when each op runs (independently of the library),
// and checks, for every read: no write to the same slot or pages is unordered with it, and the
// last write ordered before it produced what the reader needs. Then it drops each wait in turn
// and requires a hazard: no wait is superfluous.
#include <algorithm>
#include <cstdint>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "moebius/error.hpp"
#include "moebius/switch/overlap.hpp"
#include "support/catch.hpp"
#include "support/reference.hpp"

namespace {

using moebius::arena_cursor;
using moebius::arena_geometry;
using moebius::parallel_mode;

// What a slot holds: a layer in one mode's form, a staging buffer, or nothing.
constexpr int64_t k_nothing = -1;
constexpr int64_t k_staging = -2;
int64_t weights_of(parallel_mode m, int64_t layer) {
  return 2 * layer + (m == parallel_mode::tp ? 1 : 0);
}
// TP layer l lives in slot l, EP layer l in slot l + 1 (DESIGN.md §3).
int64_t slot_of(parallel_mode m, int64_t layer) {
  return m == parallel_mode::tp ? layer : layer + 1;
}

struct access {
  int64_t resource;
  bool write;
  int64_t value;  // read: what the reader needs; write: what it leaves
};

struct op {
  bool copy_stream;
  std::string name;
  std::vector<access> accesses;  // in order: a step reads its pages, then writes its token
  std::vector<size_t> after;     // ops whose recorded events it waits for
};

// One rank's two streams, the ops in the order they are enqueued (a topological order: every
// event waited for was recorded by an op enqueued before).
class stream_model {
 public:
  explicit stream_model(int64_t num_layers) : L_(num_layers) {}

  int64_t slot(int64_t s) const { return s; }
  int64_t pages(int64_t layer, parallel_mode m) const {
    return L_ + 1 + 2 * layer + (m == parallel_mode::tp ? 1 : 0);
  }
  size_t add(op o) {
    ops_.push_back(std::move(o));
    return ops_.size() - 1;
  }
  op& at(size_t i) { return ops_[i]; }

  // "" when every read sees what it needs and nothing races, else the first hazard.
  std::string hazard(const std::vector<int64_t>& initial) const {
    const size_t n = ops_.size();
    // before[i][j]: op j happens before op i (stream order and event waits, transitively).
    std::vector<std::vector<bool>> before(n, std::vector<bool>(n, false));
    for (size_t i = 0; i < n; ++i) {
      std::vector<size_t> direct = ops_[i].after;
      for (size_t j = i; j-- > 0;) {
        if (ops_[j].copy_stream == ops_[i].copy_stream) {
          direct.push_back(j);
          break;
        }
      }
      for (const size_t j : direct) {
        before[i][j] = true;
        for (size_t k = 0; k < n; ++k) before[i][k] = before[i][k] || before[j][k];
      }
    }
    auto ordered = [&](size_t a, size_t b) { return a == b || before[a][b] || before[b][a]; };
    for (size_t i = 0; i < n; ++i) {
      for (const access& a : ops_[i].accesses) {
        // Every other write to the resource is ordered with this access.
        std::optional<size_t> last;
        for (size_t j = 0; j < n; ++j) {
          if (j == i) continue;
          for (const access& w : ops_[j].accesses) {
            if (!w.write || w.resource != a.resource) continue;
            if (!ordered(i, j)) {
              return ops_[i].name + " races " + ops_[j].name + " on resource " +
                     std::to_string(a.resource);
            }
            if (before[i][j] && (!last || before[j][*last])) last = j;  // the latest
          }
        }
        if (a.write) continue;
        int64_t seen = initial[static_cast<size_t>(a.resource)];
        if (last) {
          for (const access& w : ops_[*last].accesses) {
            if (w.write && w.resource == a.resource) seen = w.value;
          }
        }
        if (seen != a.value) {
          return ops_[i].name + " reads resource " + std::to_string(a.resource) + " = " +
                 std::to_string(seen) + ", needs " + std::to_string(a.value) +
                 (last ? " (last write: " + ops_[*last].name + ")" : " (never written)");
        }
      }
    }
    return "";
  }

 private:
  int64_t L_;
  std::vector<op> ops_;
};

// A wait of the schedule: before op `waiter`, on op `event` (the index in its `after`).
struct wait_ref {
  size_t waiter, event;
};

struct scenario {
  stream_model model;
  std::vector<int64_t> initial;
  std::vector<wait_ref> waits;
};

// Steps and advances interleaved as the engine enqueues them: step s at the cursor before
// advance A_s (waiting for A_{s-1}'s events where step_waits says), then A_s (each copy
// waiting for step s's layer events where copy_waits says); one step after the last advance.
// `advances`: layers per advance (they sum to L). `wait_for_everything`: instead of the library's
// waits, each copy waits for the whole step and each step for every copy (tests of the model).
scenario build(int64_t L, parallel_mode from, const std::vector<int64_t>& advances,
               bool wait_for_everything = false) {
  scenario sc{stream_model(L), {}, {}};
  stream_model& m = sc.model;
  const parallel_mode to = from == parallel_mode::ep ? parallel_mode::tp : parallel_mode::ep;
  sc.initial.assign(static_cast<size_t>(3 * L + 1), k_nothing);
  for (int64_t l = 0; l < L; ++l) {
    sc.initial[static_cast<size_t>(m.slot(slot_of(from, l)))] = weights_of(from, l);
    sc.initial[static_cast<size_t>(m.pages(l, from))] = 0;  // tokens of step 0 on
  }
  arena_cursor c{from == parallel_mode::ep ? 0 : L};
  std::vector<int64_t> version(static_cast<size_t>(L), 0);  // tokens written per layer
  std::vector<size_t> copy_op(static_cast<size_t>(L), 0);
  std::vector<int64_t> prev_layers;  // the previous advance
  arena_cursor prev_cursor = c;
  auto add_step = [&](int64_t s) {
    std::vector<int64_t> waits;
    if (!prev_layers.empty()) {
      waits = wait_for_everything ? prev_layers : moebius::step_waits(L, prev_cursor, prev_layers);
    }
    std::vector<size_t> layer_ops;
    for (int64_t l = 0; l < L; ++l) {
      const parallel_mode mode = arena_geometry::mode_of(c, l);
      op o{false, "step " + std::to_string(s) + " layer " + std::to_string(l), {}, {}};
      const int64_t v = version[static_cast<size_t>(l)];
      o.accesses = {{m.pages(l, mode), false, v},
                    {m.slot(slot_of(mode, l)), false, weights_of(mode, l)},
                    {m.pages(l, mode), true, v + 1}};
      version[static_cast<size_t>(l)] = v + 1;
      if (std::find(waits.begin(), waits.end(), l) != waits.end()) {
        o.after.push_back(copy_op[static_cast<size_t>(l)]);
      }
      const size_t i = m.add(std::move(o));
      if (!m.at(i).after.empty()) sc.waits.push_back({i, 0});
      layer_ops.push_back(i);
    }
    return layer_ops;
  };
  int64_t s = 0;
  for (const int64_t n : advances) {
    const std::vector<size_t> step_ops = add_step(s);
    std::vector<int64_t> layers;
    for (int64_t i = 0; i < n; ++i) {
      layers.push_back(to == parallel_mode::tp ? c.tp_layers + i : c.tp_layers - 1 - i);
    }
    const std::vector<int64_t> waits =
        wait_for_everything ? std::vector<int64_t>(layers.size(), L - 1)
                            : moebius::copy_waits(L, c, layers);
    for (size_t i = 0; i < layers.size(); ++i) {
      const int64_t j = layers[i];
      const arena_cursor after{to == parallel_mode::tp ? j + 1 : j};
      op o{true, "copy of layer " + std::to_string(j) + " (advance " + std::to_string(s) + ")",
           {}, {}};
      const int64_t v = version[static_cast<size_t>(j)];  // step s's token included
      o.accesses = {{m.slot(slot_of(from, j)), false, weights_of(from, j)},
                    {m.slot(slot_of(to, j)), true, weights_of(to, j)},
                    {m.pages(j, from), false, v},
                    {m.slot(arena_geometry::free_slot(after)), true, k_staging},
                    {m.pages(j, to), true, v}};
      if (waits[i] >= 0) o.after.push_back(step_ops[static_cast<size_t>(waits[i])]);
      const size_t k = m.add(std::move(o));
      if (!m.at(k).after.empty()) sc.waits.push_back({k, 0});
      copy_op[static_cast<size_t>(j)] = k;
    }
    prev_layers = layers;
    prev_cursor = c;
    c = arena_cursor{to == parallel_mode::tp ? c.tp_layers + n : c.tp_layers - n};
    ++s;
  }
  add_step(s);
  return sc;
}

std::vector<int64_t> random_advances(std::mt19937_64& rng, int64_t L) {
  std::vector<int64_t> out;
  for (int64_t left = L; left > 0;) {
    const int64_t n = std::uniform_int_distribution<int64_t>(1, std::min<int64_t>(left, 4))(rng);
    out.push_back(n);
    left -= n;
  }
  return out;
}

}  // namespace

TEST_CASE("overlap: the listed waits order every read after its write and before the next",
          "[switch][overlap]") {
  const uint64_t seed = moebius::testing::test_seed();
  std::mt19937_64 rng(seed);
  int64_t waits_checked = 0;
  for (int iter = 0; iter < 60; ++iter) {
    const int64_t L = std::uniform_int_distribution<int64_t>(1, 9)(rng);
    const parallel_mode from = iter % 2 ? parallel_mode::tp : parallel_mode::ep;
    const std::vector<int64_t> advances = random_advances(rng, L);
    INFO("seed " << seed << " iter " << iter << " L=" << L << " from "
                 << moebius::to_string(from) << " advances " << advances.size());
    scenario sc = build(L, from, advances);
    REQUIRE(sc.model.hazard(sc.initial) == "");
    // Each wait is needed: without it some read races a write or sees stale bytes.
    for (const wait_ref& w : sc.waits) {
      scenario dropped = build(L, from, advances);
      dropped.model.at(w.waiter).after.clear();
      INFO("without the wait of " << dropped.model.at(w.waiter).name);
      CHECK(dropped.model.hazard(dropped.initial) != "");
      ++waits_checked;
    }
  }
  CHECK(waits_checked > 0);
}

TEST_CASE("overlap: the model itself finds hazards without waits and none with every wait",
          "[switch][overlap]") {
  for (const parallel_mode from : {parallel_mode::ep, parallel_mode::tp}) {
    for (int64_t L = 1; L <= 5; ++L) {
      const std::vector<int64_t> one_by_one(static_cast<size_t>(L), 1);
      scenario all = build(L, from, one_by_one, /*wait_for_everything=*/true);
      CHECK(all.model.hazard(all.initial) == "");
      scenario none = build(L, from, one_by_one);
      for (const wait_ref& w : none.waits) none.model.at(w.waiter).after.clear();
      CHECK(none.model.hazard(none.initial) != "");
    }
  }
}

TEST_CASE("overlap: the worked examples and bad advances", "[switch][overlap]") {
  using V = std::vector<int64_t>;
  CHECK(moebius::copy_waits(8, arena_cursor{2}, V{2, 3, 4}) == V{2, 3, 4});
  CHECK(moebius::copy_waits(8, arena_cursor{6}, V{5, 4, 3}) == V{5, -1, -1});
  CHECK(moebius::step_waits(8, arena_cursor{2}, V{2, 3, 4}) == V{2, 3, 4});
  CHECK(moebius::step_waits(8, arena_cursor{6}, V{5, 4, 3}) == V{3});
  CHECK_THROWS_AS(moebius::copy_waits(8, arena_cursor{2}, V{}), moebius::error);
  CHECK_THROWS_AS(moebius::copy_waits(8, arena_cursor{2}, V{2, 4}), moebius::error);
  CHECK_THROWS_AS(moebius::copy_waits(8, arena_cursor{2}, V{3}), moebius::error);
  CHECK_THROWS_AS(moebius::copy_waits(2, arena_cursor{2}, V{2}), moebius::error);
  CHECK_THROWS_AS(moebius::step_waits(8, arena_cursor{9}, V{8}), moebius::error);
}
