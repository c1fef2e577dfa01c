// cuda_peer_transport in one process. The conformance suite (transport_conformance.hpp) runs on
// every engine setting (automatic, the mixed split with and without graphs, copy engine, SM
// kernel direct and with tiny chunks) with P in {2, 3, 4} virtual ranks on device 0 (and P = 1
// for automatic), and with two or more devices also with rank r on device r % n. Then what only
// this transport has: prepared plans and their engine report, barrier timeouts, construction
// errors, and a Qwen3-sized plan.

#include <chrono>
#include <cstdio>
#include <memory>
#include <span>
#include <random>
#include <string>
#include <vector>

#include "moebius/error.hpp"
#include "moebius/plan/weight_plan.hpp"
#include "moebius/transport/cuda_peer_transport.hpp"
#include "moebius/transport/host_transport.hpp"
#include "support/catch.hpp"
#include "support/cuda_test_util.hpp"
#include "support/random_plan.hpp"
#include "support/reference.hpp"
#include "transport/cuda_fixture.hpp"
#include "transport/transport_conformance.hpp"

namespace mt = moebius::testing;
using namespace moebius;

namespace {

// cuda_peer_transport::single_process over ranks on `devices` with one engine setting.
class cuda_peer_fixture final : public mt::transport_fixture {
 public:
  cuda_peer_fixture(const mt::engine_case& e, int num_ranks, bool spread)
      : engine_(e), devices_(mt::rank_devices(num_ranks, spread)), spread_(spread) {}
  std::string name() const override {
    return std::string("cuda_peer ") + engine_.name + " P=" + std::to_string(devices_.size()) +
           (spread_ ? " rank r on device r % n" : " virtual ranks on device 0");
  }
  int num_ranks() const override { return static_cast<int>(devices_.size()); }
  int rounds() const override { return 2; }
  std::unique_ptr<mt::fixture_memory> allocate(const mt::space_sizes& bytes) override {
    return std::make_unique<mt::device_memory>(devices_, bytes);
  }
  std::unique_ptr<transport> make(const mt::fixture_memory& memory,
                                  std::span<const plan>) override {
    return std::make_unique<cuda_peer_transport>(
        cuda_peer_transport::single_process(memory.ranks(), engine_.config));
  }
  std::unique_ptr<mt::held_streams> hold_streams(const mt::fixture_memory& memory) override {
    return std::make_unique<mt::cuda_held_streams>(memory.ranks());
  }

 private:
  mt::engine_case engine_;
  std::vector<int> devices_;
  bool spread_;
};

mt::fixture_list cuda_peer_fixtures() {
  mt::fixture_list f;
  for (const bool spread : {false, true}) {
    if (spread && mt::device_count() < 2) continue;
    for (const mt::engine_case& e : mt::engine_cases()) {
      for (const int P : {1, 2, 3, 4}) {
        if (P == 1 && (spread || std::string(e.name) != "automatic")) continue;
        f.push_back(std::make_unique<cuda_peer_fixture>(e, P, spread));
      }
    }
  }
  return f;
}

// Arena-only device memory for a weight geometry, one buffer per rank.
mt::rank_buffers arenas_for(const arena_geometry& g, const std::vector<int>& devices) {
  mt::rank_buffers b;
  for (int dev : devices) b.arena.emplace_back(dev, static_cast<size_t>(g.total_bytes()));
  return b;
}

void upload(const mt::rank_buffers& b, const mt::rank_images& images) {
  for (size_t r = 0; r < images.size(); ++r) b.arena[r].upload(images[r]);
}

mt::rank_images download(const mt::rank_buffers& b) {
  mt::rank_images images;
  for (const mt::device_buffer& d : b.arena) images.push_back(d.download());
  return images;
}

// Both memory spaces of every rank filled with the same random bytes on the device and in
// host memory (for host_transport, the reference). host_ranks point into `host`.
struct mirrored_ranks {
  mt::rank_buffers device;
  std::vector<std::vector<std::byte>> host;  // [2 * rank + space]
  std::vector<rank_memory> host_ranks;
};

mirrored_ranks mirrored_random_ranks(std::mt19937_64& rng, const std::vector<int>& devices,
                                     int64_t space) {
  const size_t P = devices.size();
  mirrored_ranks m;
  m.host.resize(2 * P);
  m.host_ranks.resize(P);
  for (size_t r = 0; r < P; ++r) {
    m.device.arena.emplace_back(devices[r], static_cast<size_t>(space));
    m.device.kv.emplace_back(devices[r], static_cast<size_t>(space));
    for (int s = 0; s < 2; ++s) {
      std::vector<std::byte>& h = m.host[2 * r + static_cast<size_t>(s)];
      h = mt::random_bytes(rng, static_cast<size_t>(space));
      (s == 0 ? m.device.arena : m.device.kv)[r].upload(h);
      m.host_ranks[r].spaces[s] = std::span<std::byte>(h);
    }
  }
  return m;
}

}  // namespace

MOEBIUS_TRANSPORT_CONFORMANCE("cuda_peer_transport", "[cuda_peer]", cuda_peer_fixtures)

TEST_CASE("prepared plans are cached and report their engines", "[cuda_peer][cache]") {
  const uint64_t seed = mt::test_seed();
  std::mt19937_64 rng(seed);
  const int P = 4;
  const expert_shape shape = mt::random_shape(rng, P, false);
  const arena_geometry g = mt::random_geometry(rng, shape, P);
  const mt::logical_weights w = mt::random_weights(shape, rng);
  const std::vector<int> devices = mt::rank_devices(P, false);
  const mt::rank_buffers buffers = arenas_for(g, devices);
  mt::rank_images images;
  mt::load_reference(w, g, arena_cursor{0}, images);
  upload(buffers, images);
  CAPTURE(seed, shape);

  for (const mt::engine_case& e : mt::engine_cases()) {
    CAPTURE(e.name);
    cuda_peer_transport t = cuda_peer_transport::single_process(buffers.memory(devices), e.config);
    const plan to_tp = plan_weight_switch(g, arena_cursor{0}, arena_cursor{shape.num_layers});
    const plan to_ep = plan_weight_switch(g, arena_cursor{shape.num_layers}, arena_cursor{0});
    t.execute(to_tp);
    CHECK_FALSE(t.last_execute_stats().from_cache);
    t.execute(to_ep);
    t.execute(to_tp);
    CHECK(t.last_execute_stats().from_cache);
    CHECK(t.last_execute_stats().prepare_seconds == 0);
    REQUIRE(mt::compare_to_reference(w, g, arena_cursor{shape.num_layers}, download(buffers)) ==
            "");
    t.execute(to_ep);
    CHECK(t.last_execute_stats().from_cache);
    REQUIRE(mt::compare_to_reference(w, g, arena_cursor{0}, download(buffers)) == "");

    const std::shared_ptr<const cuda_prepared_plan> pp = t.prepare_plan(to_tp);
    REQUIRE(pp->num_phases() == static_cast<int64_t>(to_tp.phases.size()));
    REQUIRE(pp->num_ops() == to_tp.num_ops());
    int64_t ce = 0, sm = 0;
    for (int r = 0; r < P; ++r) {
      ce += pp->copy_engine_ops(r);
      sm += pp->sm_kernel_ops(r);
      for (int64_t k = 0; k < pp->num_phases(); ++k) {
        CHECK(pp->sm_kernel_blocks(r, k) <= pp->max_sm_kernel_blocks());
      }
    }
    REQUIRE(ce + sm == to_tp.num_ops());
    CHECK(pp->uses_cuda_graphs() == e.config.use_cuda_graphs);
    if (e.config.engine == engine_policy::sm_kernel) {
      CHECK(ce == 0);
      CHECK(pp->max_sm_kernel_blocks() > 0);
    }
    if (e.config.engine == engine_policy::copy_engine) {
      CHECK(sm == 0);  // weight plans never re-read a source row
      CHECK(pp->max_sm_kernel_blocks() == 0);
    }
    t.execute(pp);
    REQUIRE(mt::compare_to_reference(w, g, arena_cursor{shape.num_layers}, download(buffers)) ==
            "");
    CHECK(t.last_execute_stats().graph_launches == (pp->uses_cuda_graphs() ? P : 0));
    std::printf("%s: %lld ops, enqueue %.1f us, %d blocks max, graphs %d\n", e.name,
                static_cast<long long>(to_tp.num_ops()),
                t.last_execute_stats().enqueue_seconds * 1e6, pp->max_sm_kernel_blocks(),
                static_cast<int>(pp->uses_cuda_graphs()));
    t.execute(to_ep);
    t.clear_plan_cache();
  }
}

TEST_CASE("a peer that never arrives is a timeout, not a hang", "[cuda_peer][timeout]") {
  const uint64_t seed = mt::test_seed();
  std::mt19937_64 rng(seed);
  for (const mt::engine_case& e : mt::engine_cases()) {
    for (int P : {2, 3}) {
      const int absent = P - 1;
      const int64_t space = int64_t{1} << 16;
      const std::vector<int> devices = mt::rank_devices(P, false);
      mirrored_ranks m = mirrored_random_ranks(rng, devices, space);
      mt::rank_buffers& buffers = m.device;
      std::vector<rank_memory>& host_ranks = m.host_ranks;
      cuda_peer_config config = e.config;
      config.barrier_timeout_ns = 200'000'000;  // 200 ms
      config.debug_absent_rank = absent;
      cuda_peer_transport t = cuda_peer_transport::single_process(buffers.memory(devices), config);
      mt::random_plan_options o;
      o.space_bytes[0] = o.space_bytes[1] = space;
      o.min_phases = o.max_phases = 3;
      o.max_ops_per_phase = 40;
      o.idle_ranks = false;
      const plan p = mt::random_hazard_free_plan(rng, P, o);
      CAPTURE(seed, e.name, P);
      const auto t0 = std::chrono::steady_clock::now();
      try {
        t.execute(p);
        FAIL("execute did not throw");
      } catch (const moebius::error& err) {
        CAPTURE(err.what());
        REQUIRE(err.code() == errc::timeout);
        REQUIRE(std::string(err.what()).find("phase 0") != std::string::npos);
        REQUIRE(std::string(err.what()).find("waiting for rank " + std::to_string(absent)) !=
                std::string::npos);
      }
      const double seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      CHECK(seconds < 5.0);  // 200 ms timeout: generous bound, only to catch a hang-like wait
      REQUIRE(t.completed_phases() == 0);
      // What moved: phase 0's ops of the present ranks, nothing after the failed barrier (the
      // SM kernel skips its work; copy-engine ops cannot be cancelled, so only check the
      // kernel-only configuration byte for byte).
      if (e.config.engine == engine_policy::sm_kernel) {
        plan first;
        first.num_ranks = P;
        first.phases.push_back(p.phases[0]);
        std::erase_if(first.phases[0].ops, [&](const copy_op& op) { return op.src_rank == absent; });
        host_transport reference(host_ranks);
        reference.execute(first);
        for (int r = 0; r < P; ++r) {
          for (int s = 0; s < 2; ++s) {
            const mt::device_buffer& d =
                (s == 0 ? buffers.arena : buffers.kv)[static_cast<size_t>(r)];
            REQUIRE(mt::first_difference(m.host[static_cast<size_t>(2 * r + s)], d.download(),
                                         "rank " + std::to_string(r)) == "");
          }
        }
      }
    }
  }
}

TEST_CASE("bad arguments are rejected before anything moves", "[cuda_peer][errors]") {
  const int P = 2;
  const std::vector<int> devices = mt::rank_devices(P, false);
  mt::rank_buffers buffers;
  for (int r = 0; r < P; ++r) buffers.arena.emplace_back(devices[static_cast<size_t>(r)], 4096);

  SECTION("overlapping ranks") {
    std::vector<rank_memory> m = buffers.memory(devices);
    m[1].spaces[0] = memory_span(buffers.arena[0].data() + 100, 100);
    REQUIRE_THROWS_AS(cuda_peer_transport::single_process(m), moebius::error);
  }
  SECTION("bad config") {
    cuda_peer_config c;
    c.sm_kernel_threads = 100;
    REQUIRE_THROWS_AS(cuda_peer_transport::single_process(buffers.memory(devices), c),
                      moebius::error);
    c = cuda_peer_config{};
    c.sm_chunk_bytes = 1000;
    REQUIRE_THROWS_AS(cuda_peer_transport::single_process(buffers.memory(devices), c),
                      moebius::error);
  }
  SECTION("bad device") {
    std::vector<rank_memory> m = buffers.memory(devices);
    m[0].device = mt::device_count();
    REQUIRE_THROWS_AS(cuda_peer_transport::single_process(m), moebius::error);
  }
}

TEST_CASE("a Qwen3-sized plan (94 layers, E=128, P=8: 12k ops) on miniature tensors",
          "[cuda_peer][qwen_ops]") {
  // Same op count and phase structure as the real Qwen3-235B switch, small H and I so eight
  // virtual ranks fit one GPU. Checks the bytes; prints the host enqueue time of each engine
  // (information for the benchmark, not asserted: tests do not time).
  const uint64_t seed = mt::test_seed();
  std::mt19937_64 rng(seed);
  const int P = 8;
  expert_shape shape = qwen3_235b_a22b();
  shape.hidden = 64;
  shape.intermediate = 32;
  const arena_geometry g = make_arena_geometry(shape, P);
  const mt::logical_weights w = mt::random_weights(shape, rng);
  const std::vector<int> devices = mt::rank_devices(P, true);
  const mt::rank_buffers buffers = arenas_for(g, devices);
  mt::rank_images images;
  mt::load_reference(w, g, arena_cursor{0}, images);
  upload(buffers, images);
  const plan to_tp = plan_weight_switch(g, arena_cursor{0}, arena_cursor{shape.num_layers});
  const plan to_ep = plan_weight_switch(g, arena_cursor{shape.num_layers}, arena_cursor{0});
  CAPTURE(seed, to_tp.num_ops());
  for (const mt::engine_case& e : mt::engine_cases()) {
    CAPTURE(e.name);
    cuda_peer_transport t = cuda_peer_transport::single_process(buffers.memory(devices), e.config);
    const std::shared_ptr<const cuda_prepared_plan> fwd = t.prepare_plan(to_tp);
    const std::shared_ptr<const cuda_prepared_plan> back = t.prepare_plan(to_ep);
    t.execute(fwd);
    const double enqueue_fwd = t.last_execute_stats().enqueue_seconds;
    REQUIRE(mt::compare_to_reference(w, g, arena_cursor{shape.num_layers}, download(buffers)) ==
            "");
    t.execute(back);
    REQUIRE(mt::compare_to_reference(w, g, arena_cursor{0}, download(buffers)) == "");
    std::printf("qwen3-ops %s: %lld ops, %lld phases, enqueue EP->TP %.3f ms, TP->EP %.3f ms, "
                "graphs %d, ce ops %lld, sm ops %lld, max blocks %d, descriptors %lld B\n",
                e.name, static_cast<long long>(to_tp.num_ops()),
                static_cast<long long>(to_tp.phases.size()), enqueue_fwd * 1e3,
                t.last_execute_stats().enqueue_seconds * 1e3,
                static_cast<int>(fwd->uses_cuda_graphs()),
                static_cast<long long>(t.last_execute_stats().copy_engine_ops),
                static_cast<long long>(t.last_execute_stats().sm_kernel_ops),
                fwd->max_sm_kernel_blocks(),
                static_cast<long long>(fwd->device_descriptor_bytes()));
  }
}

TEST_CASE("the plan cache tells plans apart by every op, and a hit is one graph launch per rank",
          "[cuda_peer][cache]") {
  const uint64_t seed = mt::test_seed();
  std::mt19937_64 rng(seed);
  const int P = 2;
  const int64_t space = int64_t{1} << 16;
  const int64_t piece = 256;
  const std::vector<int> devices = mt::rank_devices(P, false);
  // Plan `a`: 64 pieces, kv_pool slot i of one rank -> arena slot i of the other (ranks 0's ops
  // first). Plan `b` equals `a` but for op 1, which writes arena slot 100 instead: a cache that
  // keyed plans on a sample of their ops (16 spread evenly over 64 skip op 1) and trusted the
  // key would run `a` for `b`, and slot 100 would keep its old bytes.
  plan a;
  a.num_ranks = P;
  a.phases.resize(1);
  a.phases[0].label = "pieces";
  for (int64_t i = 0; i < 64; ++i) {
    copy_op op;
    op.src_rank = i < 32 ? 0 : 1;
    op.dst_rank = 1 - op.src_rank;
    op.src_space = memory_space::kv_pool;
    op.dst_space = memory_space::arena;
    op.src_offset = i * piece;
    op.dst_offset = i * piece;
    op.row_bytes = op.src_pitch = op.dst_pitch = piece;
    a.phases[0].ops.push_back(op);
  }
  plan b = a;
  b.phases[0].ops[1].dst_offset = 100 * piece;
  const plan a_copy = a;

  for (const mt::engine_case& e : mt::engine_cases()) {
    CAPTURE(seed, e.name);
    mirrored_ranks m = mirrored_random_ranks(rng, devices, space);
    mt::rank_buffers& buffers = m.device;
    std::vector<rank_memory>& host_ranks = m.host_ranks;
    host_transport reference(host_ranks);
    cuda_peer_transport t = cuda_peer_transport::single_process(buffers.memory(devices), e.config);
    auto check_bytes = [&](const char* after) {
      CAPTURE(after);
      for (int r = 0; r < P; ++r) {
        for (int s = 0; s < 2; ++s) {
          const mt::device_buffer& d = (s == 0 ? buffers.arena : buffers.kv)[static_cast<size_t>(r)];
          REQUIRE(mt::first_difference(m.host[static_cast<size_t>(2 * r + s)], d.download(),
                                       "rank " + std::to_string(r)) == "");
        }
      }
    };

    t.execute(a);
    reference.execute(a);
    CHECK_FALSE(t.last_execute_stats().from_cache);
    check_bytes("a");

    // An equal plan (another object) is a hit: one graph launch per rank and no kernel launch
    // from the host when graphs are on, and no lookup slower than a look at every op.
    t.execute(a_copy);
    reference.execute(a_copy);
    const cuda_execute_stats hit = t.last_execute_stats();
    CHECK(hit.from_cache);
    CHECK(hit.prepare_seconds == 0);
    CHECK(hit.lookup_seconds >= 0);
    CHECK(hit.graph_launches == (e.config.use_cuda_graphs ? P : 0));
    if (e.config.use_cuda_graphs) CHECK(hit.kernel_launches == 0);
    CHECK(hit.copy_engine_ops + hit.sm_kernel_ops == a.num_ops());
    check_bytes("a again");

    t.execute(b);
    reference.execute(b);
    CHECK_FALSE(t.last_execute_stats().from_cache);
    check_bytes("b (equal to a but for op 1)");

    t.execute(a);  // both are cached now (max_cached_plans = 8)
    reference.execute(a);
    CHECK(t.last_execute_stats().from_cache);
    t.execute(b);
    reference.execute(b);
    CHECK(t.last_execute_stats().from_cache);
    check_bytes("a, then b, from the cache");
  }
}
