// A switcher given the engine's own KV layout (switcher_options::kv_layout) moves every page
// and head slice to where that layout puts it, stop-the-world and layer by layer, in both
// directions. The reference is independent of the library's strides: kv_layout_model.hpp
// computes offsets from the array's sizes and order alone, and kv_reference.hpp says what each
// byte of every live sequence must hold. A switcher left on the present layout over the same
// memory must fail the same check (the layout is what put the bytes there).

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "kv/kv_cases.hpp"
#include "kv/kv_layout_model.hpp"
#include "kv/kv_reference.hpp"
#include "layout/error_matchers.hpp"
#include "moebius/kv/kv_pool_layout.hpp"
#include "moebius/layout/arena_geometry.hpp"
#include "moebius/switch/pacing.hpp"
#include "moebius/switch/switcher.hpp"
#include "moebius/transport/host_transport.hpp"
#include "support/catch.hpp"
#include "support/reference.hpp"

namespace {

using namespace moebius;
using namespace moebius::testing;

// One rank-set of memory: the arena (the KV planner's staging lives in its free slot) and a KV
// pool laid out as `model` says, random bytes everywhere, then every live element written.
struct layout_world {
  arena_geometry weights;
  kv_case c;
  layout_model model;
  kv_pool_layout layout;
  ref_offset_fn where;
  pools arenas, kv;

  std::vector<rank_memory> memory() {
    std::vector<rank_memory> out(kv.size());
    for (size_t r = 0; r < kv.size(); ++r) {
      out[r].spaces[static_cast<int>(memory_space::arena)] = arenas[r];
      out[r].spaces[static_cast<int>(memory_space::kv_pool)] = kv[r];
    }
    return out;
  }
};

layout_world make_layout_world(std::mt19937_64& rng, const kv_geometry& g,
                               const layout_model& model) {
  layout_world w;
  expert_shape shape = random_shape(rng, g.num_ranks, false);
  shape.num_layers = g.num_layers;  // a progressive switch moves each layer's KV with it
  w.weights = make_arena_geometry(shape, g.num_ranks);
  // TP replicates heads when H_kv < P (and the latent tensor on every rank): it holds P / H_kv
  // times less than EP, so the occupancy leaves TP room.
  const int64_t replication =
      g.num_kv_heads == 0 ? g.num_ranks : std::max<int64_t>(1, g.num_ranks / g.num_kv_heads);
  w.c = random_kv_case(rng, g, parallel_mode::ep, 0.4 / static_cast<double>(replication), 12);
  w.model = model;
  w.layout = model.layout(g);
  w.where = [g, model](parallel_mode m, int64_t l, int64_t kv, int64_t p, int64_t h, int64_t t,
                       int64_t d) { return model.offset(g, m, l, kv, p, h, t, d); };
  w.arenas.assign(static_cast<size_t>(g.num_ranks),
                  std::vector<std::byte>(static_cast<size_t>(w.weights.total_bytes())));
  w.kv.assign(static_cast<size_t>(g.num_ranks),
              std::vector<std::byte>(static_cast<size_t>(w.layout.pool_bytes)));
  for (pools* ps : {&w.arenas, &w.kv})
    for (auto& p : *ps)
      for (auto& b : p) b = static_cast<std::byte>(rng() & 0xFF);
  fill_reference(g, w.c.state, w.c.content, w.kv, &w.where);
  return w;
}

// The live sequences without their pages: what a switch must keep.
std::vector<std::tuple<int64_t, int64_t, int64_t>> live_sequences(const kv_state& s) {
  std::vector<std::tuple<int64_t, int64_t, int64_t>> out;
  for (const kv_rank_state& r : s.ranks)
    for (const kv_sequence& q : r.sequences) out.emplace_back(q.seq_id, q.num_tokens, q.prefill_cursor);
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());  // TP: one per rank
  return out;
}

switch_report progress_to(switcher& sw, parallel_mode target, std::mt19937_64& rng) {
  progressive_switch s = sw.begin(target);
  if (!s.open()) return s.report();
  while (s.layers_remaining() > 0) {
    s.advance(std::uniform_int_distribution<int64_t>(1, 2)(rng));
    s.wait();
  }
  return s.finish();
}

// A random geometry of at least two ranks whose pool is a few KB.
kv_geometry random_switch_geometry(std::mt19937_64& rng) {
  for (;;) {
    kv_geometry g = random_kv_geometry(rng, 6000);
    if (g.num_ranks >= 2) return g;
  }
}

layout_model model_for(std::mt19937_64& rng, const kv_geometry& g, int which) {
  switch (which) {
    case 0:
      return preset_model(kv_preset::vllm_flashinfer, g);
    case 1:
      return preset_model(kv_preset::present, g);
    default:
      return random_layout_model(rng, g);
  }
}

}  // namespace

TEST_CASE("a switcher given the engine's KV layout moves every byte to where that layout says",
          "[switch][kv][layout]") {
  const uint64_t seed = kv_test_seed();
  std::mt19937_64 rng(seed);
  int unaware_misplaced = 0;  // trials where the present-layout switcher put bytes wrong
  for (int trial = 0; trial < 24; ++trial) {
    const kv_geometry g = random_switch_geometry(rng);
    layout_world w = make_layout_world(rng, g, model_for(rng, g, trial % 4));
    INFO("seed " << seed << " trial " << trial << " order " << w.model.order << " layout "
                 << w.layout);
    const auto live = live_sequences(w.c.state);
    layout_world again = w;  // the same start, for the switcher that ignores the layout
    host_transport t(w.memory());
    switcher_options o;
    o.kv_layout = w.layout;
    switcher sw(w.weights, g, t, w.c.state, arena_cursor{0}, o);
    REQUIRE(sw.kv_layout() == w.layout);

    auto require_in_place = [&](const switch_report& r, parallel_mode m) {
      REQUIRE(r.outcome == switch_outcome::committed);
      REQUIRE(sw.mode() == m);
      REQUIRE(live_sequences(sw.kv_tables()) == live);
      REQUIRE(check_reference(g, sw.kv_tables(), w.c.content, w.kv, &w.where) == "");
    };
    // Layer by layer where the layers translate (the next case has layers that do not).
    const bool by_layer = w.layout.ep.layer == w.layout.tp.layer;
    auto progressive_or_whole = [&](parallel_mode m) {
      return by_layer ? progress_to(sw, m, rng) : sw.switch_to(m);
    };
    if (by_layer) {
      // The pacing's bytes a layer over the same layout: the switcher's per-layer plan's.
      kv_migration_options opt;
      opt.staging.space = memory_space::arena;
      opt.staging.offset = 0;
      opt.staging.bytes = w.weights.slot_bytes;
      const layer_bytes b =
          switch_layer_bytes(w.weights, g, w.layout, w.c.state, parallel_mode::tp, opt);
      const switch_plan p = sw.plan(parallel_mode::tp);
      REQUIRE(p.layer_kv != nullptr);
      CHECK(b.kv_bytes_sent == p.bytes_per_layer.kv_bytes_sent);
      CHECK(b.weight_bytes_sent == p.bytes_per_layer.weight_bytes_sent);
    }
    require_in_place(sw.switch_to(parallel_mode::tp), parallel_mode::tp);
    require_in_place(progressive_or_whole(parallel_mode::ep), parallel_mode::ep);
    require_in_place(progressive_or_whole(parallel_mode::tp), parallel_mode::tp);
    require_in_place(sw.switch_to(sw.plan(parallel_mode::ep)), parallel_mode::ep);

      // The same memory under a switcher that assumes the present layout: the bytes land where
    // the engine's kernels do not look (unless the layout is the present one).
    // (Strides may differ and address the same bytes: one layer, one head. The live bytes tell.)
    if (check_reference(g, again.c.state, again.c.content, again.kv) == "") continue;
    host_transport t2(again.memory());
    switcher unaware(again.weights, g, t2, again.c.state, arena_cursor{0});
    REQUIRE(unaware.switch_to(parallel_mode::tp).outcome == switch_outcome::committed);
    // (A copy between equal page indices may still cover the live bytes by chance.)
    if (check_reference(g, unaware.kv_tables(), again.c.content, again.kv, &again.where) != "")
      ++unaware_misplaced;
  }
  CHECK(unaware_misplaced > 0);
}

TEST_CASE("a layout whose layers interleave inside a page switches whole, not layer by layer",
          "[switch][kv][layout]") {
  std::mt19937_64 rng(kv_test_seed());
  // H_kv = 4 on P = 2: split 2, so the TP view halves every stride inside a page, the layer's
  // among them, and layer l of TP is not layer 0 of TP moved by EP's layer stride.
  const kv_geometry g = make_kv_geometry(3, 4, 4, 2, 8, 2);
  layout_model model;
  model.order = "KPLHTD";
  layout_world w = make_layout_world(rng, g, model);
  REQUIRE(w.layout.ep.layer != w.layout.tp.layer);
  host_transport t(w.memory());
  switcher_options o;
  o.kv_layout = w.layout;
  switcher sw(w.weights, g, t, w.c.state, arena_cursor{0}, o);
  const switch_plan p = sw.plan(parallel_mode::tp);
  CHECK(p.layer_kv == nullptr);
  CHECK(p.layer_capacity.reason.find("interleave inside a page") != std::string::npos);
  REQUIRE_MOEBIUS_ERROR((void)sw.begin(p), errc::invalid_argument, "interleave inside a page");
  REQUIRE(sw.switch_to(p).outcome == switch_outcome::committed);
  REQUIRE(check_reference(g, sw.kv_tables(), w.c.content, w.kv, &w.where) == "");
}

TEST_CASE("a KV layout that does not fit the geometry is refused by name", "[switch][kv][layout]") {
  std::mt19937_64 rng(kv_test_seed());
  const kv_geometry g = make_kv_geometry(2, 4, 4, 2, 8, 2);
  layout_world w = make_layout_world(rng, g, preset_model(kv_preset::vllm_flashinfer, g));
  host_transport t(w.memory());
  switcher_options o;
  o.kv_layout = w.layout;
  o.kv_layout->pool_bytes -= 1;  // the last page ends one byte beyond the pool
  REQUIRE_MOEBIUS_ERROR(switcher(w.weights, g, t, w.c.state, arena_cursor{0}, o),
                        errc::invalid_argument, "beyond pool_bytes");
  o.kv_layout = present_kv_layout(make_kv_geometry(2, 4, 4, 2, 7, 2));  // a smaller pool
  REQUIRE_MOEBIUS_ERROR(switcher(w.weights, g, t, w.c.state, arena_cursor{0}, o),
                        errc::invalid_argument, "kv_pool_layout");
}
