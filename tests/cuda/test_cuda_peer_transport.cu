// cuda_peer_transport in one process: weight reshards against the independent static-load
// reference (every engine policy, virtual ranks on one GPU and one rank per GPU), random plans
// over both memory spaces against host_transport, the plan cache, fault injection, barrier
// timeouts and argument checks.

#include <chrono>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "cuda_test_util.hpp"
#include "moebius/error.hpp"
#include "moebius/plan/weight_plan.hpp"
#include "moebius/transport/cuda_peer_transport.hpp"
#include "moebius/transport/host_transport.hpp"
#include "support/catch.hpp"
#include "support/reference.hpp"

namespace mt = moebius::testing;
using namespace moebius;

namespace {

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

// EP->TP->EP and partial switches of random shapes through `t`, each compared with the static
// load at the cursor reached. Cursors: random a -> random b -> L -> 0.
void run_weight_switches(std::mt19937_64& rng, int num_ranks, bool spread,
                         const cuda_peer_config& config, const char* engine_name) {
  const std::vector<int> devices = mt::rank_devices(num_ranks, spread);
  for (bool block_scales : {false, true}) {
    for (int rep = 0; rep < 2; ++rep) {
      const expert_shape shape = mt::random_shape(rng, num_ranks, block_scales);
      const arena_geometry g = mt::random_geometry(rng, shape, num_ranks);
      const mt::logical_weights w = mt::random_weights(shape, rng);
      const int64_t L = shape.num_layers;
      const arena_cursor a = mt::random_cursor(rng, g);
      const arena_cursor b = mt::random_cursor(rng, g);
      const arena_cursor path[] = {a, b, arena_cursor{L}, arena_cursor{0}};
      CAPTURE(engine_name, num_ranks, spread, block_scales, rep, shape, a.tp_layers,
              b.tp_layers);

      mt::rank_images images;
      mt::load_reference(w, g, a, images);
      const mt::rank_buffers buffers = arenas_for(g, devices);
      upload(buffers, images);
      cuda_peer_transport t =
          cuda_peer_transport::single_process(buffers.memory(devices), config);
      for (int step = 1; step < 4; ++step) {
        const arena_cursor from = path[step - 1];
        const arena_cursor to = path[step];
        CAPTURE(step, from.tp_layers, to.tp_layers);
        // Poison the free slot: a destination the switch forgets keeps random bytes.
        images = download(buffers);
        mt::scribble_slot(g, arena_geometry::free_slot(from), images, rng);
        upload(buffers, images);
        const plan p = plan_weight_switch(g, from, to);
        t.execute(p);
        REQUIRE(t.completed_phases() == static_cast<int64_t>(p.phases.size()));
        const std::string diff = mt::compare_to_reference(w, g, to, download(buffers));
        REQUIRE(diff == "");
      }
    }
  }
}

// A random plan over both spaces through the CUDA transport and through host_transport from
// the same initial bytes: every byte of every rank and space must agree.
void run_random_plans(std::mt19937_64& rng, int num_ranks, bool spread,
                      const cuda_peer_config& config, const char* engine_name) {
  const std::vector<int> devices = mt::rank_devices(num_ranks, spread);
  const int64_t space = int64_t{1} << mt::uniform(rng, 12, 21);
  mt::rank_buffers buffers;
  std::vector<std::vector<std::byte>> host(static_cast<size_t>(2 * num_ranks));
  std::vector<rank_memory> host_ranks(static_cast<size_t>(num_ranks));
  for (int r = 0; r < num_ranks; ++r) {
    buffers.arena.emplace_back(devices[static_cast<size_t>(r)], static_cast<size_t>(space));
    buffers.kv.emplace_back(devices[static_cast<size_t>(r)], static_cast<size_t>(space));
    for (int s = 0; s < 2; ++s) {
      std::vector<std::byte>& h = host[static_cast<size_t>(2 * r + s)];
      h = mt::random_bytes(rng, static_cast<size_t>(space));
      (s == 0 ? buffers.arena : buffers.kv)[static_cast<size_t>(r)].upload(h);
      host_ranks[static_cast<size_t>(r)].spaces[s] = std::span<std::byte>(h);
    }
  }
  host_transport reference(host_ranks);
  cuda_peer_transport t = cuda_peer_transport::single_process(buffers.memory(devices), config);
  for (int rep = 0; rep < 3; ++rep) {
    const plan p = mt::random_plan(rng, num_ranks, space, static_cast<int>(mt::uniform(rng, 1, 5)),
                                   static_cast<int>(mt::uniform(rng, 1, 80)), space / 8);
    CAPTURE(engine_name, num_ranks, spread, space, rep, p.num_ops());
    reference.execute(p);
    t.execute(p);
    REQUIRE(t.completed_phases() == static_cast<int64_t>(p.phases.size()));
    for (int r = 0; r < num_ranks; ++r) {
      for (int s = 0; s < 2; ++s) {
        const mt::device_buffer& d = (s == 0 ? buffers.arena : buffers.kv)[static_cast<size_t>(r)];
        const std::string diff = mt::first_difference(
            host[static_cast<size_t>(2 * r + s)], d.download(),
            "rank " + std::to_string(r) + " " + to_string(static_cast<memory_space>(s)));
        REQUIRE(diff == "");
      }
    }
  }
}

}  // namespace

TEST_CASE("weight switches on virtual ranks match the static load", "[cuda_peer][reshard]") {
  const uint64_t seed = mt::test_seed();
  std::mt19937_64 rng(seed);
  for (const mt::engine_case& e : mt::engine_cases()) {
    for (int P : {1, 2, 3, 4, 8}) {
      CAPTURE(seed);
      run_weight_switches(rng, P, /*spread=*/false, e.config, e.name);
    }
  }
}

TEST_CASE("weight switches with one rank per GPU match the static load",
          "[cuda_peer][reshard][multi_gpu]") {
  const int n = mt::device_count();
  if (n < 2) {
    WARN("only " << n << " CUDA device: skipping the one-rank-per-GPU section");
    return;
  }
  const uint64_t seed = mt::test_seed();
  std::mt19937_64 rng(seed);
  for (const mt::engine_case& e : mt::engine_cases()) {
    for (int P : {2, 3, 4, 8}) {
      CAPTURE(seed);
      run_weight_switches(rng, P, /*spread=*/true, e.config, e.name);  // rank r on device r % n
    }
  }
}

TEST_CASE("random plans over both spaces match host_transport", "[cuda_peer][random_plan]") {
  const uint64_t seed = mt::test_seed();
  std::mt19937_64 rng(seed);
  const bool spread_options[] = {false, true};
  for (bool spread : spread_options) {
    if (spread && mt::device_count() < 2) {
      WARN("only one CUDA device: skipping random plans with one rank per GPU");
      continue;
    }
    for (const mt::engine_case& e : mt::engine_cases()) {
      for (int P : {1, 2, 3, 4, 8}) {
        CAPTURE(seed);
        run_random_plans(rng, P, spread, e.config, e.name);
      }
    }
  }
}

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

TEST_CASE("an injected fault stops at its phase with the earlier phases complete",
          "[cuda_peer][fault]") {
  const uint64_t seed = mt::test_seed();
  std::mt19937_64 rng(seed);
  for (const mt::engine_case& e : mt::engine_cases()) {
    for (int P : {1, 2, 3, 8}) {
      const int64_t space = int64_t{1} << 16;
      const std::vector<int> devices = mt::rank_devices(P, true);
      mt::rank_buffers buffers;
      std::vector<std::vector<std::byte>> host(static_cast<size_t>(2 * P));
      std::vector<rank_memory> host_ranks(static_cast<size_t>(P));
      for (int r = 0; r < P; ++r) {
        buffers.arena.emplace_back(devices[static_cast<size_t>(r)], static_cast<size_t>(space));
        buffers.kv.emplace_back(devices[static_cast<size_t>(r)], static_cast<size_t>(space));
        for (int s = 0; s < 2; ++s) {
          std::vector<std::byte>& h = host[static_cast<size_t>(2 * r + s)];
          h = mt::random_bytes(rng, static_cast<size_t>(space));
          (s == 0 ? buffers.arena : buffers.kv)[static_cast<size_t>(r)].upload(h);
          host_ranks[static_cast<size_t>(r)].spaces[s] = std::span<std::byte>(h);
        }
      }
      host_transport reference(host_ranks);
      cuda_peer_transport t =
          cuda_peer_transport::single_process(buffers.memory(devices), e.config);
      plan p = mt::random_plan(rng, P, space, 4, 40, 4096);
      for (plan_phase& ph : p.phases) {
        if (ph.ops.empty()) ph = mt::random_plan(rng, P, space, 1, 40, 4096).phases[0];
      }
      // Phases with no op cannot hold a fault point; pick one that has ops.
      int64_t k = mt::uniform(rng, 0, 3);
      while (p.phases[static_cast<size_t>(k)].ops.empty()) k = (k + 1) % 4;
      const int64_t n =
          mt::uniform(rng, 0, static_cast<int64_t>(p.phases[static_cast<size_t>(k)].ops.size()) - 1);
      CAPTURE(seed, e.name, P, k, n);
      t.inject_fault(fault_point{k, n});
      try {
        t.execute(p);
        FAIL("execute did not throw");
      } catch (const moebius::error& err) {
        REQUIRE(err.code() == errc::injected_fault);
      }
      REQUIRE(t.completed_phases() == k);
      plan done = p;
      done.phases.resize(static_cast<size_t>(k));
      reference.execute(done);
      for (int r = 0; r < P; ++r) {
        for (int s = 0; s < 2; ++s) {
          const mt::device_buffer& d = (s == 0 ? buffers.arena : buffers.kv)[static_cast<size_t>(r)];
          REQUIRE(mt::first_difference(host[static_cast<size_t>(2 * r + s)], d.download(),
                                       "rank " + std::to_string(r)) == "");
        }
      }
      // The fault was one-shot; the transport keeps working (barrier epochs stay in step).
      const plan next = mt::random_plan(rng, P, space, 3, 30, 4096);
      reference.execute(next);
      t.execute(next);
      REQUIRE(t.completed_phases() == 3);
      for (int r = 0; r < P; ++r) {
        for (int s = 0; s < 2; ++s) {
          const mt::device_buffer& d = (s == 0 ? buffers.arena : buffers.kv)[static_cast<size_t>(r)];
          REQUIRE(mt::first_difference(host[static_cast<size_t>(2 * r + s)], d.download(),
                                       "rank " + std::to_string(r)) == "");
        }
      }
    }
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
      mt::rank_buffers buffers;
      std::vector<std::vector<std::byte>> host(static_cast<size_t>(2 * P));
      std::vector<rank_memory> host_ranks(static_cast<size_t>(P));
      for (int r = 0; r < P; ++r) {
        buffers.arena.emplace_back(devices[static_cast<size_t>(r)], static_cast<size_t>(space));
        buffers.kv.emplace_back(devices[static_cast<size_t>(r)], static_cast<size_t>(space));
        for (int s = 0; s < 2; ++s) {
          std::vector<std::byte>& h = host[static_cast<size_t>(2 * r + s)];
          h = mt::random_bytes(rng, static_cast<size_t>(space));
          (s == 0 ? buffers.arena : buffers.kv)[static_cast<size_t>(r)].upload(h);
          host_ranks[static_cast<size_t>(r)].spaces[s] = std::span<std::byte>(h);
        }
      }
      cuda_peer_config config = e.config;
      config.barrier_timeout_ns = 200'000'000;  // 200 ms
      config.debug_absent_rank = absent;
      cuda_peer_transport t = cuda_peer_transport::single_process(buffers.memory(devices), config);
      const plan p = mt::random_plan(rng, P, space, 3, 40, 4096);
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
            REQUIRE(mt::first_difference(host[static_cast<size_t>(2 * r + s)], d.download(),
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
  SECTION("a plan outside the memory moves nothing") {
    std::mt19937_64 rng(mt::test_seed());
    const std::vector<std::byte> before0 = mt::random_bytes(rng, 4096);
    const std::vector<std::byte> before1 = mt::random_bytes(rng, 4096);
    buffers.arena[0].upload(before0);
    buffers.arena[1].upload(before1);
    cuda_peer_transport t = cuda_peer_transport::single_process(buffers.memory(devices));
    plan p;
    p.num_ranks = P;
    plan_phase ok;
    ok.ops.push_back(copy_op{0, 0, 1, 64, 64, 64, 0, 1});
    plan_phase bad;
    bad.ops.push_back(copy_op{0, 4000, 1, 200, 200, 200, 1, 0});
    p.phases = {ok, bad};
    try {
      t.execute(p);
      FAIL("execute did not throw");
    } catch (const moebius::error& err) {
      REQUIRE(err.code() == errc::out_of_range);
    }
    REQUIRE(t.completed_phases() == 0);
    REQUIRE(mt::first_difference(before0, buffers.arena[0].download(), "rank 0") == "");
    REQUIRE(mt::first_difference(before1, buffers.arena[1].download(), "rank 1") == "");
    p.num_ranks = 3;
    REQUIRE_THROWS_AS(t.validate(p), moebius::error);
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
