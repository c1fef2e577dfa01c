// nccl_transport on real devices: one process drives P = (number of devices, at most 8) ranks
// through ncclCommInitAll; with one device P = 1 still runs every local copy, strided and
// contiguous. (NCCL refuses two ranks of one communicator on one device: no virtual ranks.)
// The conformance suite (transport_conformance.hpp) runs on that P, each transport given
// exactly the staging workspace its plans need (nccl_transport::workspace_bytes); then what
// only this transport has: the workspace size and its check.

#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "moebius/error.hpp"
#include "moebius/transport/nccl_transport.hpp"
#include "support/catch.hpp"
#include "support/cuda_test_util.hpp"
#include "transport/cuda_fixture.hpp"
#include "transport/transport_conformance.hpp"

namespace {

using namespace moebius;
namespace mt = moebius::testing;

// The communicators, created once per process (ncclCommInitAll takes a second or more) and
// never destroyed: the process ends right after the tests.
struct nccl_world {
  int num_ranks = 0;
  std::vector<ncclComm_t> comms;
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
    (void)cudaSetDevice(0);
    std::printf("nccl_transport tests: P = %d rank(s), one per device\n", nw->num_ranks);
    return nw;
  }();
  return *w;
}

std::vector<int> all_devices() {
  std::vector<int> d(static_cast<size_t>(world().num_ranks));
  for (size_t r = 0; r < d.size(); ++r) d[r] = static_cast<int>(r);
  return d;
}

// Per-rank staging of `bytes[r]` bytes, and the transport over `memory` that uses it.
std::unique_ptr<nccl_transport> make_nccl(const mt::fixture_memory& memory,
                                          const std::vector<int64_t>& bytes,
                                          std::vector<mt::device_buffer>& workspaces) {
  const nccl_world& w = world();
  std::vector<nccl_rank_comm> comms;
  for (int r = 0; r < w.num_ranks; ++r) {
    const int64_t n = bytes[static_cast<size_t>(r)];
    void* ws = nullptr;
    if (n > 0) {
      workspaces.emplace_back(r, static_cast<size_t>(n));
      ws = workspaces.back().data();
    }
    comms.push_back({w.comms[static_cast<size_t>(r)], ws, n});
  }
  return std::make_unique<nccl_transport>(memory.ranks(), std::move(comms));
}

// nccl_transport over every device, with the staging its plans need.
class nccl_fixture final : public mt::transport_fixture {
 public:
  std::string name() const override { return "nccl P=" + std::to_string(world().num_ranks); }
  int num_ranks() const override { return world().num_ranks; }
  std::unique_ptr<mt::fixture_memory> allocate(const mt::space_sizes& bytes) override {
    return std::make_unique<mt::device_memory>(all_devices(), bytes);
  }
  std::unique_ptr<transport> make(const mt::fixture_memory& memory,
                                  std::span<const plan> plans) override {
    std::vector<int64_t> bytes(static_cast<size_t>(num_ranks()), 0);
    for (const plan& p : plans) {
      for (int r = 0; r < num_ranks(); ++r) {
        bytes[static_cast<size_t>(r)] =
            std::max(bytes[static_cast<size_t>(r)], nccl_transport::workspace_bytes(p, r));
      }
    }
    // Kept until the fixture goes, after every transport of the property (those are local).
    return make_nccl(memory, bytes, workspaces_);
  }
  std::unique_ptr<mt::held_streams> hold_streams(const mt::fixture_memory& memory) override {
    return std::make_unique<mt::cuda_held_streams>(memory.ranks());
  }

 private:
  std::vector<mt::device_buffer> workspaces_;
};

mt::fixture_list nccl_fixtures() {
  mt::fixture_list f;
  f.push_back(std::make_unique<nccl_fixture>());
  return f;
}

}  // namespace

MOEBIUS_TRANSPORT_CONFORMANCE("nccl_transport", "[nccl]", nccl_fixtures)

TEST_CASE("nccl_transport: workspace_bytes and its check", "[nccl][workspace]") {
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

  const mt::device_memory memory(all_devices(), {4096, 0});
  std::vector<mt::device_buffer> workspaces;
  if (expected > 0) {
    const std::unique_ptr<nccl_transport> small =
        make_nccl(memory, std::vector<int64_t>(static_cast<size_t>(P), expected - 1), workspaces);
    try {
      small->validate(p);
      FAIL("a workspace one byte short was accepted");
    } catch (const moebius::error& e) {
      CHECK(e.code() == errc::invalid_argument);
      CHECK(std::string(e.what()).find("workspace") != std::string::npos);
    }
    CHECK_THROWS_AS(small->execute(p), moebius::error);
  }
  const std::unique_ptr<nccl_transport> ok =
      make_nccl(memory, std::vector<int64_t>(static_cast<size_t>(P), expected), workspaces);
  CHECK_NOTHROW(ok->validate(p));
  CHECK_NOTHROW(ok->execute(p));
}
