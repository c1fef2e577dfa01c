// nccl_transport on real devices: one process drives P = (number of devices) ranks through
// ncclCommInitAll. With one device P = 1 still runs every local copy, strided and contiguous.
// (NCCL refuses two ranks of one communicator on one device, so there are no virtual ranks.)
//
// Every switch is checked byte for byte against the independent static-deployment reference,
// and random hand-made plans against host_transport.

#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "moebius/error.hpp"
#include "moebius/layout/arena_geometry.hpp"
#include "moebius/plan/weight_plan.hpp"
#include "moebius/transport/host_transport.hpp"
#include "moebius/transport/nccl_transport.hpp"
#include "support/catch.hpp"
#include "support/random.hpp"
#include "support/reference.hpp"

namespace {

using namespace moebius;
using moebius::testing::rank_images;

#define TEST_CUDA(expr)                                                    \
  do {                                                                     \
    const cudaError_t test_cuda_status_ = (expr);                          \
    if (test_cuda_status_ != cudaSuccess) {                                \
      FAIL(#expr << " failed: " << cudaGetErrorString(test_cuda_status_)); \
    }                                                                      \
  } while (0)

// The communicators, created once per process (ncclCommInitAll takes a second or more) and
// never destroyed: the process ends right after the tests.
struct nccl_world {
  int num_ranks = 0;
  std::vector<ncclComm_t> comms;
  std::vector<cudaStream_t> streams;
};

nccl_world& world() {
  static nccl_world* w = [] {
    setenv("NCCL_NVLS_ENABLE", "0", 0);  // NVLink SHARP multicast: not wanted (KINDS.md)
    auto* nw = new nccl_world;
    int devices = 0;
    if (cudaGetDeviceCount(&devices) != cudaSuccess) devices = 0;
    nw->num_ranks = std::min(devices, 8);
    std::vector<int> ids(static_cast<size_t>(nw->num_ranks));
    for (int i = 0; i < nw->num_ranks; ++i) ids[static_cast<size_t>(i)] = i;
    nw->comms.resize(ids.size());
    const ncclResult_t r = ncclCommInitAll(nw->comms.data(), nw->num_ranks, ids.data());
    if (r != ncclSuccess) {
      std::fprintf(stderr, "ncclCommInitAll over %d devices failed: %s\n", nw->num_ranks,
                   ncclGetErrorString(r));
      std::abort();
    }
    for (int i = 0; i < nw->num_ranks; ++i) {
      cudaStream_t s = nullptr;
      (void)cudaSetDevice(i);
      (void)cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
      nw->streams.push_back(s);
    }
    (void)cudaSetDevice(0);
    std::printf("nccl_transport tests: P = %d rank(s), one per device\n", nw->num_ranks);
    return nw;
  }();
  return *w;
}

// A device buffer on `device`, freed on scope exit.
struct device_buffer {
  int device = 0;
  void* ptr = nullptr;
  size_t bytes = 0;

  device_buffer(int dev, size_t n) : device(dev), bytes(n) {
    (void)cudaSetDevice(dev);
    if (n > 0 && cudaMalloc(&ptr, n) != cudaSuccess) ptr = nullptr;
  }
  ~device_buffer() {
    if (ptr != nullptr) {
      (void)cudaSetDevice(device);
      (void)cudaFree(ptr);
    }
  }
  device_buffer(const device_buffer&) = delete;
  device_buffer& operator=(const device_buffer&) = delete;
};

// Per rank: memory spaces, a staging workspace, and the transport over them.
struct rig {
  std::vector<std::unique_ptr<device_buffer>> spaces[num_memory_spaces];
  std::vector<std::unique_ptr<device_buffer>> workspaces;
  std::unique_ptr<nccl_transport> transport;

  // space_bytes[s] per rank; workspace_bytes per rank.
  rig(const int64_t (&space_bytes)[num_memory_spaces], const std::vector<int64_t>& ws_bytes) {
    nccl_world& w = world();
    std::vector<rank_memory> memory;
    std::vector<nccl_rank_comm> comms;
    for (int r = 0; r < w.num_ranks; ++r) {
      rank_memory m;
      m.device = r;
      for (int s = 0; s < num_memory_spaces; ++s) {
        spaces[s].push_back(
            std::make_unique<device_buffer>(r, static_cast<size_t>(space_bytes[s])));
        REQUIRE((space_bytes[s] == 0 || spaces[s].back()->ptr != nullptr));
        m.spaces[s] = memory_span(spaces[s].back()->ptr, space_bytes[s]);
      }
      memory.push_back(m);
      const int64_t ws = ws_bytes[static_cast<size_t>(r)];
      workspaces.push_back(std::make_unique<device_buffer>(r, static_cast<size_t>(ws)));
      REQUIRE((ws == 0 || workspaces.back()->ptr != nullptr));
      comms.push_back({w.comms[static_cast<size_t>(r)], workspaces.back()->ptr, ws});
    }
    transport = std::make_unique<nccl_transport>(std::move(memory), std::move(comms));
  }

  void upload(memory_space s, const rank_images& images) {
    for (size_t r = 0; r < images.size(); ++r) {
      device_buffer& b = *spaces[static_cast<int>(s)][r];
      TEST_CUDA(cudaSetDevice(b.device));
      TEST_CUDA(cudaMemcpy(b.ptr, images[r].data(), images[r].size(), cudaMemcpyHostToDevice));
    }
  }
  void download(memory_space s, rank_images& images) {
    for (size_t r = 0; r < images.size(); ++r) {
      device_buffer& b = *spaces[static_cast<int>(s)][r];
      // Poison first: a download that silently fails must not leave the expected bytes.
      std::fill(images[r].begin(), images[r].end(), std::byte{0x3C});
      TEST_CUDA(cudaSetDevice(b.device));
      TEST_CUDA(cudaMemcpy(images[r].data(), b.ptr, images[r].size(), cudaMemcpyDeviceToHost));
    }
  }
};

// Staging each rank needs for any of `plans`.
std::vector<int64_t> workspace_for(const std::vector<const plan*>& plans, int num_ranks) {
  std::vector<int64_t> ws(static_cast<size_t>(num_ranks), 0);
  for (const plan* p : plans) {
    for (int r = 0; r < num_ranks; ++r) {
      ws[static_cast<size_t>(r)] =
          std::max(ws[static_cast<size_t>(r)], nccl_transport::workspace_bytes(*p, r));
    }
  }
  return ws;
}

arena_cursor cursor_after(arena_cursor from, arena_cursor to, int64_t phases) {
  return arena_cursor{to.tp_layers >= from.tp_layers ? from.tp_layers + phases
                                                     : from.tp_layers - phases};
}

}  // namespace

TEST_CASE("nccl_transport: EP->TP->EP on random shapes matches the static reference") {
  const int P = world().num_ranks;
  const uint64_t seed = moebius::testing::test_seed();
  std::mt19937_64 rng(seed);
  for (int iter = 0; iter < 12; ++iter) {
    const bool scales = moebius::testing::coin(rng);
    const expert_shape shape = moebius::testing::random_shape(rng, P, scales);
    const arena_geometry g = moebius::testing::random_geometry(rng, shape, P);
    const auto w = moebius::testing::random_weights(shape, rng);
    // Whole switch (all EP -> all TP -> all EP) half the time, else between random cursors.
    arena_cursor a{0}, b{shape.num_layers};
    if (iter % 2 == 1) {
      a = moebius::testing::random_cursor(rng, g);
      b = moebius::testing::random_cursor(rng, g);
    }
    INFO("seed " << seed << " iter " << iter << ": " << shape << " P=" << P << " cursor "
                 << a.tp_layers << " -> " << b.tp_layers << " -> " << a.tp_layers);
    const plan forward = plan_weight_switch(g, a, b);
    const plan back = plan_weight_switch(g, b, a);
    const int64_t spaces[num_memory_spaces] = {g.total_bytes(), 0};
    rig rg(spaces, workspace_for({&forward, &back}, P));

    rank_images images;
    moebius::testing::load_reference(w, g, a, images);
    moebius::testing::scribble_slot(g, arena_geometry::free_slot(a), images, rng);
    rg.upload(memory_space::arena, images);

    rg.transport->execute(forward);
    CHECK(rg.transport->completed_phases() == static_cast<int64_t>(forward.phases.size()));
    rg.download(memory_space::arena, images);
    REQUIRE(moebius::testing::compare_to_reference(w, g, b, images) == "");

    rg.transport->execute(back);
    rg.download(memory_space::arena, images);
    REQUIRE(moebius::testing::compare_to_reference(w, g, a, images) == "");
  }
}

TEST_CASE("nccl_transport: an injected fault stops at a resting cursor and rolls back") {
  const int P = world().num_ranks;
  const uint64_t seed = moebius::testing::test_seed();
  std::mt19937_64 rng(seed);
  for (int iter = 0; iter < 4; ++iter) {
    expert_shape shape = moebius::testing::random_shape(rng, P, false);
    shape.num_layers = std::max<int64_t>(shape.num_layers, 2);
    const arena_geometry g = moebius::testing::random_geometry(rng, shape, P);
    const auto w = moebius::testing::random_weights(shape, rng);
    const bool to_tp = moebius::testing::coin(rng);
    const arena_cursor from{to_tp ? 0 : shape.num_layers};
    const arena_cursor to{to_tp ? shape.num_layers : 0};
    const plan p = plan_weight_switch(g, from, to);
    const int64_t phase =
        moebius::testing::uniform(rng, 0, static_cast<int64_t>(p.phases.size()) - 1);
    // A fault fires only before an op that exists (transport.hpp).
    const int64_t op = moebius::testing::uniform(
        rng, 0, static_cast<int64_t>(p.phases[static_cast<size_t>(phase)].ops.size()) - 1);
    INFO("seed " << seed << " iter " << iter << ": " << shape << " fault at phase " << phase
                 << " op " << op);
    const int64_t spaces[num_memory_spaces] = {g.total_bytes(), 0};

    rank_images images;
    moebius::testing::load_reference(w, g, from, images);
    const arena_cursor reached = cursor_after(from, to, phase);
    const plan rollback = plan_weight_switch(g, reached, from);
    rig rg(spaces, workspace_for({&p, &rollback}, P));
    rg.upload(memory_space::arena, images);

    rg.transport->inject_fault(fault_point{phase, op});
    try {
      rg.transport->execute(p);
      FAIL("execute did not throw the injected fault");
    } catch (const moebius::error& e) {
      CHECK(e.code() == errc::injected_fault);
    }
    CHECK(rg.transport->completed_phases() == phase);
    rg.download(memory_space::arena, images);
    REQUIRE(moebius::testing::compare_to_reference(w, g, reached, images) == "");

    rg.transport->execute(rollback);
    rg.download(memory_space::arena, images);
    REQUIRE(moebius::testing::compare_to_reference(w, g, from, images) == "");
  }
}

TEST_CASE("nccl_transport: random strided plans over both memory spaces match host_transport") {
  const int P = world().num_ranks;
  const uint64_t seed = moebius::testing::test_seed();
  std::mt19937_64 rng(seed);
  for (int iter = 0; iter < 10; ++iter) {
    // Each space is split in halves; phase k reads half k%2 and writes half 1-k%2, so phase
    // k+1 reads what phase k wrote (the phase barrier is exercised) and no destination of a
    // phase overlaps a source of that phase. Destinations are bump-allocated: no overlaps.
    const int64_t half_bytes = moebius::testing::uniform(rng, 1, 64) << 10;
    const int64_t space_bytes[num_memory_spaces] = {2 * half_bytes, 2 * half_bytes};
    plan p;
    p.num_ranks = P;
    const int64_t num_phases = moebius::testing::uniform(rng, 1, 4);
    for (int64_t k = 0; k < num_phases; ++k) {
      plan_phase ph;
      ph.label = "random phase " + std::to_string(k);
      const int64_t src_half = (k % 2) * half_bytes, dst_half = (1 - k % 2) * half_bytes;
      // bump[rank][space]
      std::vector<std::array<int64_t, num_memory_spaces>> bump(static_cast<size_t>(P));
      for (auto& b : bump) b.fill(0);
      const int64_t num_ops = moebius::testing::uniform(rng, 1, 3 * P * P);
      for (int64_t i = 0; i < num_ops; ++i) {
        copy_op op;
        op.src_rank = static_cast<int32_t>(moebius::testing::uniform(rng, 0, P - 1));
        op.dst_rank = static_cast<int32_t>(moebius::testing::uniform(rng, 0, P - 1));
        op.src_space = moebius::testing::coin(rng) ? memory_space::arena : memory_space::kv_pool;
        op.dst_space = moebius::testing::coin(rng) ? memory_space::arena : memory_space::kv_pool;
        const int64_t elem = int64_t{1} << moebius::testing::uniform(rng, 0, 4);  // 1..16 B
        op.rows = moebius::testing::coin(rng) ? 1 : moebius::testing::uniform(rng, 1, 24);
        op.row_bytes = elem * moebius::testing::uniform(rng, 1, 40);
        const auto pitch = [&] {
          switch (moebius::testing::uniform(rng, 0, 2)) {
            case 0:
              return op.row_bytes;  // contiguous on this side
            case 1:
              return op.row_bytes + elem * moebius::testing::uniform(rng, 1, 8);
            default:
              return 2 * op.row_bytes;
          }
        };
        op.src_pitch = op.rows == 1 ? op.row_bytes : pitch();
        op.dst_pitch = op.rows == 1 ? op.row_bytes : pitch();
        const int64_t src_extent = (op.rows - 1) * op.src_pitch + op.row_bytes;
        const int64_t dst_extent = (op.rows - 1) * op.dst_pitch + op.row_bytes;
        int64_t& cursor = bump[static_cast<size_t>(op.dst_rank)][static_cast<int>(op.dst_space)];
        const int64_t dst_at = cursor + elem * moebius::testing::uniform(rng, 0, 3);
        if (dst_at + dst_extent > half_bytes || src_extent > half_bytes) continue;  // space is full
        op.dst_offset = dst_half + dst_at;
        cursor = dst_at + dst_extent;
        op.src_offset =
            src_half + elem * moebius::testing::uniform(rng, 0, (half_bytes - src_extent) / elem);
        ph.ops.push_back(op);
      }
      p.phases.push_back(std::move(ph));
    }
    INFO("seed " << seed << " iter " << iter << ": " << p.num_ops() << " ops in " << num_phases
                 << " phases, half_bytes " << half_bytes << " B");

    // Host side: the reference transport over random bytes.
    rank_images host[num_memory_spaces];
    std::vector<rank_memory> host_ranks(static_cast<size_t>(P));
    for (int s = 0; s < num_memory_spaces; ++s) {
      host[s].resize(static_cast<size_t>(P));
      for (int r = 0; r < P; ++r) {
        auto& img = host[s][static_cast<size_t>(r)];
        img.resize(static_cast<size_t>(space_bytes[s]));
        for (auto& byte : img) byte = static_cast<std::byte>(rng());
        host_ranks[static_cast<size_t>(r)].spaces[s] = img;
      }
    }
    rig rg(space_bytes, workspace_for({&p}, P));
    for (int s = 0; s < num_memory_spaces; ++s) {
      rg.upload(static_cast<memory_space>(s), host[s]);
    }
    host_transport reference(host_ranks);
    reference.execute(p);
    rg.transport->execute(p);
    for (int s = 0; s < num_memory_spaces; ++s) {
      rank_images got(host[s].size());
      for (size_t r = 0; r < got.size(); ++r) got[r].resize(host[s][r].size());
      rg.download(static_cast<memory_space>(s), got);
      for (int r = 0; r < P; ++r) {
        const auto& want = host[s][static_cast<size_t>(r)];
        const auto& have = got[static_cast<size_t>(r)];
        const auto mismatch = std::mismatch(want.begin(), want.end(), have.begin());
        INFO("space " << to_string(static_cast<memory_space>(s)) << " rank " << r
                      << " first mismatch at byte " << (mismatch.first - want.begin()));
        REQUIRE(mismatch.first == want.end());
      }
    }
  }
}

TEST_CASE("nccl_transport: workspace_bytes and validation") {
  const int P = world().num_ranks;
  // One op per rank, strided at both ends: the sender packs and the receiver unpacks, so
  // each rank needs two staging regions (P>1); locally it needs none.
  plan p;
  p.num_ranks = P;
  plan_phase ph;
  for (int r = 0; r < P; ++r) {
    copy_op op;
    op.src_rank = r;
    op.dst_rank = (r + 1) % P;
    op.rows = 3;
    op.row_bytes = 100;
    op.src_pitch = 200;
    op.dst_pitch = 300;
    op.src_offset = 0;
    op.dst_offset = 1024;
    ph.ops.push_back(op);
  }
  p.phases.push_back(ph);
  const int64_t expected = P == 1 ? 0 : 2 * 512;  // 300 B rounded up to 256 B, twice
  for (int r = 0; r < P; ++r) CHECK(nccl_transport::workspace_bytes(p, r) == expected);
  CHECK_THROWS_AS(nccl_transport::workspace_bytes(p, P), moebius::error);

  const int64_t spaces[num_memory_spaces] = {4096, 0};
  if (expected > 0) {
    rig small(spaces, std::vector<int64_t>(static_cast<size_t>(P), expected - 1));
    CHECK_THROWS_AS(small.transport->validate(p), moebius::error);
  }
  rig ok(spaces, std::vector<int64_t>(static_cast<size_t>(P), expected));
  CHECK_NOTHROW(ok.transport->validate(p));
  plan wrong = p;
  wrong.num_ranks = P + 1;
  CHECK_THROWS_AS(ok.transport->validate(wrong), moebius::error);
  plan outside = p;
  outside.phases[0].ops[0].dst_offset = 4000;
  CHECK_THROWS_AS(ok.transport->execute(outside), moebius::error);
  CHECK(ok.transport->completed_phases() == 0);
}
