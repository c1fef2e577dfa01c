// The engine on a KV pool laid out as another engine lays out its own (host_runtime_options::
// kv_preset = vLLM FlashInfer: per layer (num_blocks, 2, block_size, H, D), K and V of a block
// side by side): the runtime's attention reads and writes through that layout, the engine hands
// it to its switcher (switcher_options::kv_layout), and a run that switches at every other step,
// stop-the-world and progressive, verified by checksums read through the same layout, gives
// the greedy tokens of a static run on the present layout. The same runtime under an engine
// that does not pass the layout loses tokens: the layout is what the switches honoured.
#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include <moebius/kv/kv_pool_layout.hpp>
#include <moebius/switch/checksum.hpp>

#include "catch.hpp"
#include "engine.hpp"
#include "fault_fixture.hpp"
#include "paced_clock.hpp"
#include "same_tokens.hpp"
#include "small_trace.hpp"

using namespace mini_engine;
using moebius::switch_outcome;
using testing::check_same_tokens;
using testing::every_other_step;
using testing::host_world;
using testing::make_host_world;
using testing::with_layers;


TEST_CASE("switches of a pool in vLLM FlashInfer's layout give the present pool's tokens",
          "[cpu][kv_layout]") {
  for (const int P : {2, 4}) {
    const int64_t L = 3;
    const uint64_t seed = 23 + static_cast<uint64_t>(P);
    CAPTURE(P);
    host_world present = make_host_world(with_layers(L), P, 96, seed);
    host_world flashinfer =
        make_host_world(with_layers(L), P, 96, seed, moebius::kv_preset::vllm_flashinfer);
    // Not the present layout by another name: K and V of a page sit side by side.
    REQUIRE(flashinfer.rt->kv_layout().ep.page == 2 * present.rt->kv_layout().ep.page);
    const std::vector<request> reqs =
        testing::small_trace(seed, static_cast<int32_t>(present.c.vocab), 12);
    const testing::paced_clock clock(1);
    engine reference(*present.rt, *present.transport, present.rt->arena(), present.rt->kv(),
                     clock, moebius::arena_cursor{0});
    engine_options o = testing::small_trace_options();
    const run_result ep = reference.run(reqs, o, "static EP, present layout");

    engine e(*flashinfer.rt, *flashinfer.transport, flashinfer.rt->arena(), flashinfer.rt->kv(),
             clock, moebius::arena_cursor{0}, flashinfer.rt->kv_layout());
    REQUIRE(e.get_switcher().kv_layout() == flashinfer.rt->kv_layout());
    check_same_tokens(e.run(reqs, o, "static EP, FlashInfer layout"), ep);
    o.how = switching::forced;
    o.forced_steps = every_other_step(2, static_cast<int64_t>(ep.steps.size()), 9);
    o.verify = testing::checksum_hook(*flashinfer.rt);
    for (const switch_style style : {switch_style::stop_the_world, switch_style::progressive}) {
      CAPTURE(static_cast<int>(style));
      o.style = style;
      const run_result sw = e.run(reqs, o, "switching, FlashInfer layout");
      check_same_tokens(sw, ep);
      for (const switch_record& s : sw.switches) {
        CAPTURE(s.step, s.error);
        CHECK(s.outcome == switch_outcome::committed);
      }
      CHECK(testing::count(sw, switch_outcome::committed) >= 4);
    }

    // The same runtime under an engine whose switcher assumes the present layout: the switches
    // move K/V to where the runtime's attention does not read it.
    host_world unaware_world =
        make_host_world(with_layers(L), P, 96, seed, moebius::kv_preset::vllm_flashinfer);
    engine unaware(*unaware_world.rt, *unaware_world.transport, unaware_world.rt->arena(),
                   unaware_world.rt->kv(), clock, moebius::arena_cursor{0});
    o.verify = nullptr;
    o.style = switch_style::stop_the_world;
    const run_result garbled = unaware.run(reqs, o, "switching, layout not passed");
    int64_t differ = 0;
    for (size_t i = 0; i < ep.requests.size(); ++i)
      differ += garbled.requests[i].generated != ep.requests[i].generated;
    CHECK(differ > 0);
  }
}

TEST_CASE("a KV preset the host runtime cannot lay out is refused by name", "[cpu][kv_layout]") {
  // SGLang's buffers are token-major (NHD); the host runtime's pool is HND.
  REQUIRE_THROWS_WITH(make_host_world(with_layers(2), 2, 16, 1, moebius::kv_preset::sglang_mha),
                      Catch::Contains("NHD"));
}
