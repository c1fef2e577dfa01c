// The progressive switch on the host transport: advancing a few layers at a time ends exactly
// where switch_to() ends (weights against the independent reference, live KV bytes
// unchanged); tokens written between advances land in the layout of their layer; abort() at
// every cursor and a fault at any phase of any advance put everything back byte for byte.
#include <algorithm>
#include <map>
#include <random>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "moebius/kv/kv_geometry.hpp"
#include "moebius/switch/switcher.hpp"
#include "moebius/transport/host_transport.hpp"
#include "support/catch.hpp"
#include "support/reference.hpp"
#include "switch_world.hpp"

namespace {

using namespace moebius;
using namespace moebius::testing;

struct snapshot {
  rank_images arenas;
  std::vector<std::vector<std::byte>> live_kv;
  kv_state tables;
  arena_cursor cursor;
};

snapshot take(const world& w, const switcher& sw) {
  return {w.arenas, live_kv_bytes(w, sw.kv_tables()), sw.kv_tables(), sw.cursor()};
}

// "" when the switcher and memory are back at `s` (the free slot may differ: staging).
std::string diff(const world& w, const switcher& sw, const snapshot& s) {
  if (!(sw.cursor() == s.cursor)) return "cursor " + std::to_string(sw.cursor().tp_layers);
  if (!(sw.kv_tables() == s.tables)) return "tables differ";
  if (live_kv_bytes(w, sw.kv_tables()) != s.live_kv) return "live KV bytes differ";
  return arena_diff(w, w.arenas, s.arenas, arena_geometry::free_slot(s.cursor));
}

// Runs a progressive switch to `target` with advances of random sizes; returns the report.
switch_report progress_to(switcher& sw, parallel_mode target, std::mt19937_64& rng) {
  progressive_switch s = sw.begin(target);
  if (!s.open()) return s.report();
  while (s.layers_remaining() > 0) {
    s.advance(std::uniform_int_distribution<int64_t>(1, 3)(rng));
    REQUIRE(s.poll() == progress_state::ready);
    REQUIRE(sw.in_progress());
  }
  return s.finish();
}

}  // namespace

TEST_CASE("a progressive switch ends where switch_to ends", "[switch][progressive]") {
  const uint64_t seed = testing::test_seed();
  std::mt19937_64 rng(seed);
  for (int iter = 0; iter < 12; ++iter) {
    const int P = std::vector<int>{1, 2, 4, 8}[static_cast<size_t>(iter % 4)];
    world w = make_world(rng, P, 0.3, true);
    INFO("seed " << seed << " iter " << iter << " P=" << P << " " << w.shape << " " << w.kv);
    host_transport t(w.memory);
    parallel_mode selector = parallel_mode::ep;
    switcher_options opt;
    opt.on_commit = [&](parallel_layout l) { selector = l.attention; };
    opt.verify = [&](arena_cursor c, const kv_state& s) { return state_checksum(w, c, s); };
    const uint64_t kv_before = kv_checksum(w.kv, w.tables, w.pool_spans());
    switcher sw(w.weights, w.kv, t, w.tables, arena_cursor{0}, opt);

    // The same switch by switch_to on a copy of the world, for the tables.
    world twin = w;
    for (size_t r = 0; r < twin.memory.size(); ++r) {  // its own memory, not w's
      twin.memory[r] = rank_memory::host(twin.arenas[r], twin.pools[r]);
    }
    host_transport tt(twin.memory);
    switcher reference_switcher(twin.weights, twin.kv, tt, twin.tables, arena_cursor{0});
    const switch_report whole = reference_switcher.switch_to(parallel_mode::tp);

    const switch_report to_tp = progress_to(sw, parallel_mode::tp, rng);
    INFO(to_tp);
    if (whole.outcome == switch_outcome::refused_capacity) {
      CHECK(to_tp.outcome == switch_outcome::refused_capacity);
      continue;
    }
    REQUIRE(to_tp.outcome == switch_outcome::committed);
    CHECK(to_tp.verified);
    CHECK(selector == parallel_mode::tp);
    CHECK_FALSE(sw.in_progress());
    CHECK(sw.cursor().tp_layers == w.shape.num_layers);
    CHECK(sw.kv_tables() == reference_switcher.kv_tables());
    CHECK(testing::compare_to_reference(w.logical, w.weights, sw.cursor(), w.arenas,
                              testing::padding_rule::end_slots_unknown) == "");
    CHECK(kv_checksum(w.kv, sw.kv_tables(), w.pool_spans()) == kv_before);

    const switch_report to_ep = progress_to(sw, parallel_mode::ep, rng);
    INFO(to_ep);
    REQUIRE(to_ep.outcome == switch_outcome::committed);
    CHECK(selector == parallel_mode::ep);
    CHECK(testing::compare_to_reference(w.logical, w.weights, arena_cursor{0}, w.arenas,
                              testing::padding_rule::end_slots_unknown) == "");
    CHECK(kv_checksum(w.kv, sw.kv_tables(), w.pool_spans()) == kv_before);
  }
}

TEST_CASE("tokens written between advances land in the layout of their layer",
          "[switch][progressive]") {
  const uint64_t seed = testing::test_seed();
  std::mt19937_64 rng(seed);
  int switches = 0;
  for (int iter = 0; iter < 16; ++iter) {
    const int P = std::vector<int>{2, 4}[static_cast<size_t>(iter % 2)];
    world w = make_world(rng, P, 0.25, true);
    INFO("seed " << seed << " iter " << iter << " " << w.shape << " " << w.kv);
    host_transport t(w.memory);
    switcher sw(w.weights, w.kv, t, w.tables, arena_cursor{0});
    progressive_switch session = sw.begin(parallel_mode::tp);
    if (!session.open()) continue;
    ++switches;
    const kv_geometry& g = w.kv;
    // The last token of every sequence is "decoded" again at a random moment of the switch:
    // each layer writes it through the tables of the mode that layer runs in right then.
    struct token_write {
      int64_t seq_id, layer, tensor, head, dim;
      std::byte value;
    };
    std::vector<token_write> written;
    uint64_t step = 0;
    // The value of one K/V element in one step: the same on every replica of its head.
    auto value_of = [&](int64_t seq_id, int64_t layer, int64_t tensor, int64_t head, int64_t d) {
      uint64_t x = step * 0x9e3779b97f4a7c15ull ^ static_cast<uint64_t>(seq_id) * 1000003u ^
                   static_cast<uint64_t>(((layer * 2 + tensor) * 64 + head) * 4096 + d) * 0xbf58476d1ce4e5b9ull;
      x ^= x >> 31;
      x *= 0x94d049bb133111ebull;
      return static_cast<std::byte>(x >> 56);
    };
    auto decode_step = [&] {
      ++step;
      const switch_step_view view = session.view();
      for (const kv_rank_state& rank : sw.kv_tables().ranks) {
        for (const kv_sequence& seq : rank.sequences) {
          for (int64_t layer = 0; layer < g.num_layers; ++layer) {
            const parallel_mode m = view.mode_of(layer);
            const kv_state& tables = view.tables_of_layer(layer);
            const int64_t pos = seq.num_tokens - 1;
            for (int r = 0; r < g.num_ranks; ++r) {
              for (const kv_sequence& s : tables.ranks[static_cast<size_t>(r)].sequences) {
                if (s.seq_id != seq.seq_id) continue;
                const int64_t page = s.pages[static_cast<size_t>(pos / g.page_size)];
                const int64_t heads = m == parallel_mode::ep ? g.heads_per_ep_page()
                                                             : g.heads_per_tp_page();
                for (int64_t tensor = 0; tensor < g.kv_tensors(); ++tensor) {
                  for (int64_t h = 0; h < heads; ++h) {
                    for (int64_t d = 0; d < g.head_dim; ++d) {
                      const int64_t global_head = m == parallel_mode::ep
                          ? h : g.tp_slice_of_rank(r) * g.heads_per_tp_page() + h;
                      const std::byte v = value_of(seq.seq_id, layer, tensor, global_head, d);
                      const int64_t off = g.offset(m, layer, static_cast<kv_tensor>(tensor), page,
                                                   h, pos % g.page_size, d) ;
                      for (int64_t b = 0; b < dtype_bytes(g.type); ++b) {
                        w.pools[static_cast<size_t>(r)][static_cast<size_t>(off + b)] = v;
                      }
                      written.push_back({seq.seq_id, layer, tensor, global_head, d, v});
                    }
                  }
                }
              }
            }
          }
        }
      }
    };
    decode_step();
    while (session.layers_remaining() > 0) {
      session.advance(std::uniform_int_distribution<int64_t>(1, 2)(rng));
      REQUIRE(session.poll() == progress_state::ready);
      decode_step();
    }
    REQUIRE(session.finish().outcome == switch_outcome::committed);
    // Every write survives in the TP layout: the last write of each (seq, layer, tensor, head,
    // dim) is what every TP replica of that head holds now.
    std::map<std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t>, std::byte> last;
    for (const token_write& tw : written) last[{tw.seq_id, tw.layer, tw.tensor, tw.head, tw.dim}] = tw.value;
    int64_t checked = 0;
    for (int r = 0; r < g.num_ranks; ++r) {
      for (const kv_sequence& s : sw.kv_tables().ranks[static_cast<size_t>(r)].sequences) {
        const int64_t pos = s.num_tokens - 1;
        const int64_t page = s.pages[static_cast<size_t>(pos / g.page_size)];
        for (int64_t layer = 0; layer < g.num_layers; ++layer) {
          for (int64_t tensor = 0; tensor < g.kv_tensors(); ++tensor) {
            for (int64_t h = 0; h < g.heads_per_tp_page(); ++h) {
              const int64_t global_head = g.tp_slice_of_rank(r) * g.heads_per_tp_page() + h;
              for (int64_t d = 0; d < g.head_dim; ++d) {
                const int64_t off = g.offset(parallel_mode::tp, layer, static_cast<kv_tensor>(tensor),
                                             page, h, pos % g.page_size, d);
                REQUIRE(w.pools[static_cast<size_t>(r)][static_cast<size_t>(off)] ==
                        last.at({s.seq_id, layer, tensor, global_head, d}));
                ++checked;
              }
            }
          }
        }
      }
    }
    CHECK(checked > 0);
  }
  CHECK(switches > 0);
}

TEST_CASE("abort at every cursor restores the start exactly", "[switch][progressive][fault]") {
  const uint64_t seed = testing::test_seed();
  std::mt19937_64 rng(seed);
  int aborts = 0;
  for (int iter = 0; iter < 6; ++iter) {
    const int P = std::vector<int>{2, 4, 8}[static_cast<size_t>(iter % 3)];
    world w = make_world(rng, P, 0.4, true);
    INFO("seed " << seed << " iter " << iter << " " << w.shape << " " << w.kv);
    host_transport t(w.memory);
    int flips = 0;
    switcher_options opt;
    opt.on_commit = [&](parallel_layout) { ++flips; };
    switcher sw(w.weights, w.kv, t, w.tables, arena_cursor{0}, opt);
    for (parallel_mode target : {parallel_mode::tp, parallel_mode::ep}) {
      if (target == parallel_mode::ep &&
          sw.switch_to(parallel_mode::tp).outcome != switch_outcome::committed) {
        break;
      }
      const int flips_before = flips;
      const snapshot before = take(w, sw);
      for (int64_t k = 0; k <= w.shape.num_layers; ++k) {
        progressive_switch s = sw.begin(target);
        if (!s.open()) break;
        for (int64_t i = 0; i < k; ++i) {
          s.advance(1);
          REQUIRE(s.poll() == progress_state::ready);
        }
        const switch_report rep = s.abort();
        INFO("abort after " << k << " layers: " << rep);
        REQUIRE(rep.outcome == switch_outcome::rolled_back);
        CHECK_FALSE(sw.in_progress());
        CHECK(flips == flips_before);
        REQUIRE(diff(w, sw, before) == "");
        ++aborts;
      }
    }
  }
  CHECK(aborts > 0);
}

TEST_CASE("a fault at any phase of an advance rolls everything back", "[switch][progressive][fault]") {
  const uint64_t seed = testing::test_seed();
  std::mt19937_64 rng(seed);
  int faults = 0;
  for (int iter = 0; iter < 8; ++iter) {
    const int P = std::vector<int>{2, 4}[static_cast<size_t>(iter % 2)];
    world w = make_world(rng, P, 0.45, true);
    INFO("seed " << seed << " iter " << iter << " " << w.shape << " " << w.kv);
    host_transport t(w.memory);
    switcher sw(w.weights, w.kv, t, w.tables, arena_cursor{0});
    const snapshot before = take(w, sw);
    for (int attempt = 0; attempt < 6; ++attempt) {
      progressive_switch s = sw.begin(parallel_mode::tp);
      const switch_report begun = s.report();
      if (!s.open()) break;
      const int64_t per_layer = 1 + begun.kv_rounds / std::max<int64_t>(begun.weight_phases, 1);
      // Advance a random number of layers cleanly, then fault one advance at a random phase.
      const int64_t clean = std::uniform_int_distribution<int64_t>(0, w.shape.num_layers - 1)(rng);
      for (int64_t i = 0; i < clean; ++i) {
        s.advance(1);
        REQUIRE(s.poll() == progress_state::ready);
      }
      const int64_t n = std::uniform_int_distribution<int64_t>(1, 3)(rng);
      const int64_t layers = std::min(n, s.layers_remaining());
      const int64_t phase =
          std::uniform_int_distribution<int64_t>(0, layers * per_layer - 1)(rng);
      sw.inject_fault(switch_fault{switch_fault::stage::weights, fault_point{phase, 0}});
      s.advance(n);
      // poll() tells a failed (and rolled back) advance from a finished one.
      REQUIRE(s.poll() == progress_state::ended);
      CHECK_FALSE(s.open());
      const switch_report& rep = s.report();
      CHECK(sw.last_report().outcome == rep.outcome);
      INFO("fault at phase " << phase << " after " << clean << " layers: " << rep);
      REQUIRE(rep.outcome == switch_outcome::rolled_back);
      CHECK_FALSE(sw.in_progress());
      REQUIRE(diff(w, sw, before) == "");
      ++faults;
    }
    // A fault in the undo of an abort leaves the switcher inconsistent, and it says so.
    if (progressive_switch s = sw.begin(parallel_mode::tp); s.open()) {
      s.advance(1);
      REQUIRE(s.poll() == progress_state::ready);
      sw.inject_fault(switch_fault{switch_fault::stage::undo, fault_point{0, 0}});
      const switch_report rep = s.abort();
      CHECK(rep.outcome == switch_outcome::inconsistent);
      CHECK_FALSE(sw.consistent());
      CHECK(sw.begin(parallel_mode::tp).report().outcome == switch_outcome::inconsistent);
    }
  }
  CHECK(faults > 0);
}

TEST_CASE("progressive switch misuse is refused and moves nothing", "[switch][progressive]") {
  std::mt19937_64 rng(testing::test_seed());
  world w = make_world(rng, 2, 0.2, true);
  host_transport t(w.memory);
  switcher sw(w.weights, w.kv, t, w.tables, arena_cursor{0});
  const snapshot before = take(w, sw);
  auto code_of = [](auto&& f) {
    try {
      f();
    } catch (const moebius::error& e) {
      return e.code();
    }
    return errc::internal;
  };
  {
    // A session that did not open (already there) refuses everything but its report.
    progressive_switch none = sw.begin(parallel_mode::ep);
    CHECK(none.report().outcome == switch_outcome::already_there);
    CHECK_FALSE(none.open());
    CHECK(none.layers_remaining() == 0);
    CHECK(code_of([&] { none.advance(1); }) == errc::invalid_argument);
    CHECK(code_of([&] { none.view(); }) == errc::invalid_argument);
    CHECK(code_of([&] { none.bytes_per_layer(); }) == errc::invalid_argument);
    CHECK(none.poll() == progress_state::ended);
    CHECK(none.finish().outcome == switch_outcome::already_there);
    CHECK_FALSE(sw.in_progress());
  }
  progressive_switch s = sw.begin(parallel_mode::tp);
  REQUIRE(s.open());
  CHECK(s.report().outcome == switch_outcome::in_progress);
  CHECK(code_of([&] { sw.begin(parallel_mode::tp); }) == errc::invalid_argument);
  CHECK(code_of([&] { sw.switch_to(parallel_mode::tp); }) == errc::invalid_argument);
  // The tables are frozen while the session is open: read-only through its view.
  CHECK(code_of([&] { sw.mutable_kv_tables(); }) == errc::invalid_argument);
  static_assert(std::is_const_v<std::remove_reference_t<
                    decltype(std::declval<switch_step_view>().tables(parallel_mode::tp))>>);
  CHECK(code_of([&] { s.advance(0); }) == errc::invalid_argument);
  const layer_completion& c = s.advance(1);
  CHECK(std::vector<int64_t>(c.layers().begin(), c.layers().end()) == std::vector<int64_t>{0});
  CHECK(c.event(0, 0) == nullptr);  // the host transport has finished inside enqueue
  CHECK(code_of([&] { c.event(1, 0); }) == errc::out_of_range);
  CHECK(code_of([&] { c.event(0, 2); }) == errc::out_of_range);
  CHECK(code_of([&] { s.advance(1); }) == errc::invalid_argument);  // outstanding: poll first
  REQUIRE(s.poll() == progress_state::ready);
  CHECK(s.view().cursor().tp_layers == 1);
  CHECK(s.abort().outcome == switch_outcome::rolled_back);
  CHECK_FALSE(s.open());
  CHECK(s.poll() == progress_state::ended);
  CHECK(code_of([&] { s.advance(1); }) == errc::invalid_argument);
  CHECK(s.abort().outcome == switch_outcome::rolled_back);  // ended: its report again
  CHECK(diff(w, sw, before) == "");
  CHECK_NOTHROW(sw.mutable_kv_tables());

  // KV layers must pair with MoE layers.
  world odd = make_world(rng, 2, 0.2);
  while (odd.kv.num_layers == odd.shape.num_layers) odd = make_world(rng, 2, 0.2);
  host_transport ot(odd.memory);
  switcher osw(odd.weights, odd.kv, ot, odd.tables, arena_cursor{0});
  CHECK(code_of([&] { osw.begin(parallel_mode::tp); }) == errc::invalid_argument);
}

TEST_CASE("a session that goes out of scope open puts everything back", "[switch][progressive]") {
  const uint64_t seed = testing::test_seed();
  std::mt19937_64 rng(seed);
  for (int iter = 0; iter < 4; ++iter) {
    world w = make_world(rng, 2 + 2 * (iter % 2), 0.3, true);
    INFO("seed " << seed << " iter " << iter << " " << w.shape << " " << w.kv);
    host_transport t(w.memory);
    switcher sw(w.weights, w.kv, t, w.tables, arena_cursor{0});
    const snapshot before = take(w, sw);
    {
      progressive_switch s = sw.begin(parallel_mode::tp);
      if (!s.open()) continue;
      s.advance(std::uniform_int_distribution<int64_t>(1, w.shape.num_layers)(rng));
      progressive_switch moved = std::move(s);  // the session moves; the switch stays open
      CHECK_FALSE(s.open());
      CHECK(moved.open());
      CHECK(sw.in_progress());
    }
    CHECK_FALSE(sw.in_progress());
    CHECK(sw.last_report().outcome == switch_outcome::rolled_back);
    CHECK(diff(w, sw, before) == "");
  }
}

TEST_CASE("an advance marks one event per layer, in the order the layers move",
          "[switch][progressive]") {
  const uint64_t seed = testing::test_seed();
  std::mt19937_64 rng(seed);
  for (int iter = 0; iter < 6; ++iter) {
    world w = make_world(rng, 2, 0.2, true);
    INFO("seed " << seed << " iter " << iter << " " << w.shape);
    host_transport t(w.memory);
    switcher sw(w.weights, w.kv, t, w.tables, arena_cursor{0});
    REQUIRE(sw.switch_to(parallel_mode::tp).outcome == switch_outcome::committed);
    progressive_switch s = sw.begin(parallel_mode::ep);  // TP->EP: descending
    REQUIRE(s.open());
    const int64_t L = w.shape.num_layers;
    int64_t expected = L - 1;
    // A step beside the copies (host: its events are nullptr, nothing to wait for); layer
    // events that do not cover the model are refused before anything is enqueued.
    const step_layer_events beside(L, 2);
    const step_layer_events short_by_one(L + 1, 2);
    CHECK_THROWS_AS(s.advance(1, {}, &short_by_one), moebius::error);
    CHECK(s.layers_remaining() == L);
    while (s.layers_remaining() > 0) {
      const int64_t n = std::uniform_int_distribution<int64_t>(1, 3)(rng);
      const layer_completion& c = s.advance(n, {}, rng() % 2 ? &beside : nullptr);
      REQUIRE(static_cast<int64_t>(c.layers().size()) == std::min(n, expected + 1));
      for (const int64_t layer : c.layers()) {
        CHECK(layer == expected--);
        CHECK(c.contains(layer));
        for (size_t r = 0; r < 2; ++r) CHECK(c.event(layer, r) == nullptr);
      }
      REQUIRE(s.poll() == progress_state::ready);
      // The settled cursor: every layer at or above it runs EP now.
      CHECK(s.view().cursor().tp_layers == expected + 1);
      for (int64_t l = 0; l < L; ++l) {
        CHECK(s.view().mode_of(l) == (l <= expected ? parallel_mode::tp : parallel_mode::ep));
      }
    }
    CHECK(s.finish().outcome == switch_outcome::committed);
    CHECK(testing::compare_to_reference(w.logical, w.weights, arena_cursor{0}, w.arenas,
                              testing::padding_rule::end_slots_unknown) == "");
  }
}

TEST_CASE("the pacing input is planned with the switcher's own options",
          "[switch][progressive]") {
  const uint64_t seed = testing::test_seed();
  std::mt19937_64 rng(seed);
  int checked = 0;
  for (int iter = 0; iter < 12; ++iter) {
    world w = make_world(rng, 2 + 2 * (iter % 2), 0.5 + 0.04 * iter, true);
    INFO("seed " << seed << " iter " << iter << " " << w.shape << " " << w.kv);
    host_transport t(w.memory);
    switcher_options opt;
    opt.stage_kv_in_free_slot = iter % 3 != 0;  // with and without staging
    switcher sw(w.weights, w.kv, t, w.tables, arena_cursor{0}, opt);
    progressive_switch s = sw.begin(parallel_mode::tp);
    if (!s.open()) {
      CHECK_THROWS_AS(sw.layer_bytes_of(parallel_mode::tp), moebius::error);
      continue;
    }
    const layer_bytes before = sw.layer_bytes_of(parallel_mode::tp);
    const layer_bytes& during = s.bytes_per_layer();
    CHECK(before.weight_bytes_sent == during.weight_bytes_sent);
    CHECK(before.kv_bytes_sent == during.kv_bytes_sent);
    // Every layer moves alike: L layers of it are what the report says the switch moves.
    const int64_t L = w.shape.num_layers;
    for (size_t r = 0; r < during.weight_bytes_sent.size(); ++r) {
      CHECK(during.weight_bytes_sent[r] * L == s.report().weight_bytes_sent[r]);
      CHECK(during.kv_bytes_sent[r] * L == s.report().kv_bytes_sent[r]);
    }
    CHECK(s.finish().outcome == switch_outcome::committed);
    ++checked;
  }
  CHECK(checked > 0);
}

TEST_CASE("wait() ends an advance as poll() does: ready past its layers, or ended and undone",
          "[switch][progressive][fault]") {
  const uint64_t seed = testing::test_seed();
  std::mt19937_64 rng(seed);
  int readies = 0, ends = 0, faulted = 0;
  for (int iter = 0; iter < 8; ++iter) {
    const int P = std::vector<int>{2, 4}[static_cast<size_t>(iter % 2)];
    world w = make_world(rng, P, 0.45, true);
    INFO("seed " << seed << " iter " << iter << " " << w.shape << " " << w.kv);
    host_transport t(w.memory);
    switcher sw(w.weights, w.kv, t, w.tables, arena_cursor{0});
    const snapshot before = take(w, sw);
    progressive_switch s = sw.begin(parallel_mode::tp);
    if (!s.open()) {  // TP cannot hold this KV: refused, nothing to wait for
      CHECK(s.report().outcome == switch_outcome::refused_capacity);
      CHECK(s.wait() == progress_state::ended);
      continue;
    }
    const int64_t per_layer =
        1 + s.report().kv_rounds / std::max<int64_t>(s.report().weight_phases, 1);
    // Nothing outstanding: wait() returns at once with what poll() says.
    CHECK(s.wait() == progress_state::ready);
    CHECK(sw.cursor().tp_layers == 0);
    const bool fault = (iter / 2) % 2 == 1;  // P = 2 and 4 each with and without a fault
    faulted += fault;
    while (s.layers_remaining() > 0) {
      const int64_t n = std::uniform_int_distribution<int64_t>(1, 2)(rng);
      const int64_t layers = std::min(n, s.layers_remaining());
      // EP -> TP moves layers in ascending order: the cursor ends past them.
      const int64_t cursor_after = s.view().cursor().tp_layers + layers;
      if (fault && s.layers_remaining() <= 2) {
        sw.inject_fault(switch_fault{
            switch_fault::stage::weights,
            fault_point{std::uniform_int_distribution<int64_t>(0, layers * per_layer - 1)(rng),
                        0}});
      }
      s.advance(n);
      const progress_state got = s.wait();
      if (got == progress_state::ended) {
        CHECK_FALSE(s.open());
        CHECK(s.report().outcome == switch_outcome::rolled_back);
        CHECK(diff(w, sw, before) == "");
        CHECK(s.wait() == progress_state::ended);  // an ended session stays ended
        ++ends;
        break;
      }
      REQUIRE(got == progress_state::ready);
      CHECK(s.view().cursor().tp_layers == cursor_after);
      CHECK(s.poll() == progress_state::ready);  // nothing left outstanding
      CHECK(s.wait() == progress_state::ready);
      CHECK(s.view().cursor().tp_layers == cursor_after);
      ++readies;
    }
    if (s.open()) {
      CHECK_FALSE(fault);
      CHECK(s.finish().outcome == switch_outcome::committed);
      CHECK(sw.cursor().tp_layers == w.shape.num_layers);
    } else {
      CHECK(fault);
    }
  }
  CHECK(readies > 0);
  CHECK(ends == faulted);  // every fault ended its switch, undone
}
