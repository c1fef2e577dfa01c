// KV migrations (EP->TP, then TP->EP) of random paged-KV states on the GPU transports, checked
// byte for byte against host_transport running the same plans over host images, and element by
// element against the independent reference (kv_reference.hpp) at the end.
//
// Per case the plans are built once on the host; then each transport starts from the same
// initial images (random bytes everywhere, the reference KV in the live pages):
//   host      host_transport over host images: the expected bytes after each plan
//   virtual   cuda_peer_transport, all P ranks on device 0 (engine sm_kernel, and automatic)
//   spread    cuda_peer_transport, rank r on device r (P <= device count, else a WARN)
//   nccl      nccl_transport, one communicator per device via ncclCommInitAll (P <= devices)
// Device memory is poisoned before every upload and host copies before every download, and
// whole pools and staging arenas are compared (bytes no plan writes keep their random value).

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "support/cuda_test_util.hpp"
#include "kv_cases.hpp"
#include "kv_layout_model.hpp"
#include "kv_reference.hpp"
#include "moebius/config.hpp"
#include "moebius/kv/kv_migration.hpp"
#include "moebius/transport/cuda_peer_transport.hpp"
#include "moebius/transport/host_transport.hpp"
#include "support/catch.hpp"
#if MOEBIUS_WITH_NCCL
#include <nccl.h>

#include "moebius/transport/nccl_transport.hpp"
#endif

using namespace moebius;
using namespace moebius::testing;

namespace {

constexpr std::byte k_poison{0xA5};

// Host images of every rank: KV pool and arena (staging region inside it).
struct images {
  pools kv;
  pools arena;
};

// One case: geometry, initial state and bytes, the two plans and host results.
struct gpu_case {
  kv_case c;
  kv_migration_options opt;
  int64_t arena_bytes = 0;
  images initial;
  std::vector<kv_migration> steps;  // EP->TP, then TP->EP when it fits
  std::vector<images> expected;     // host_transport result after each step
  std::string layout_name;          // the pool's layout (engine presets, random arrays)
  ref_offset_fn where;              // the layout's independent offsets
};

std::vector<rank_memory> spans_of(images& m) {
  std::vector<rank_memory> out(m.kv.size());
  for (size_t r = 0; r < m.kv.size(); ++r) {
    out[r].spaces[static_cast<int>(memory_space::kv_pool)] = m.kv[r];
    out[r].spaces[static_cast<int>(memory_space::arena)] = m.arena[r];
  }
  return out;
}

// A geometry from the brief's ranges: H_kv in {0 (latent), 1, 4, 8}, P in {1, 2, 4, 8},
// page size 1 or 16, HND or NHD, pool of about `budget` bytes per rank.
kv_geometry pick_geometry(std::mt19937_64& rng, int64_t budget) {
  static constexpr int ranks[] = {1, 2, 4, 8, 2, 4, 8};  // P >= 2 is where transports differ
  static constexpr int64_t heads[] = {0, 1, 4, 8};
  static constexpr int64_t dims[] = {2, 8, 16};
  static constexpr int64_t sizes[] = {1, 16};
  kv_geometry g;
  g.num_ranks = pick_one(rng, ranks);
  g.num_kv_heads = pick_one(rng, heads);
  g.head_dim = pick_one(rng, dims);
  g.num_layers = uni(rng, 1, 2);
  g.page_size = pick_one(rng, sizes);
  g.type = uni(rng, 0, 1) ? dtype::bf16 : dtype::fp32;
  g.layout = uni(rng, 0, 1) ? kv_layout::hnd : kv_layout::nhd;
  g.num_ep_pages = 1;
  const int64_t per_page = g.pool_bytes();
  g.num_ep_pages = std::clamp<int64_t>(budget / per_page, 2, 2048);
  validate(g);  // every (H_kv, P) above is valid: 1 | P, 4 | 8, P | 4 and P | 8
  return g;
}

// Builds a case whose EP->TP plan fits; false when the random state does not.
// The pool is in the present layout, an engine preset or a random engine-like array
// (kv_layout_model.hpp), in turn.
bool make_case(std::mt19937_64& rng, gpu_case& out) {
  kv_geometry g = pick_geometry(rng, uni(rng, 2, 16) * 16384);
  static constexpr kv_preset presets[] = {kv_preset::present, kv_preset::vllm_flash_attn,
                                          kv_preset::vllm_flashinfer, kv_preset::sglang_mha,
                                          kv_preset::custom};
  const kv_preset preset = pick_one(rng, presets);
  if (preset == kv_preset::sglang_mha) g.layout = kv_layout::nhd;
  const layout_model model =
      preset == kv_preset::custom ? random_layout_model(rng, g) : preset_model(preset, g);
  const kv_pool_layout layout = model.layout(g);
  const ref_offset_fn where = [g, model](parallel_mode m, int64_t l, int64_t kv, int64_t p,
                                         int64_t h, int64_t t, int64_t d) {
    return model.offset(g, m, l, kv, p, h, t, d);
  };
  out.layout_name = std::string(to_string(preset)) + " " + model.order;
  out.where = where;
  static constexpr double occupancies[] = {0.1, 0.25, 0.5, 0.75, 0.9, 1.0};
  out.c = random_kv_case(rng, g, parallel_mode::ep, pick_one(rng, occupancies), 512);
  const int64_t slots = pick_one(rng, {int64_t{0}, int64_t{1}, int64_t{4}});
  out.opt.staging = {memory_space::arena, uni(rng, 0, 64),
                     slots * std::max(kv_staging_slot_bytes(g, parallel_mode::tp),
                                      kv_staging_slot_bytes(g, parallel_mode::ep))};
  out.arena_bytes = out.opt.staging.offset + out.opt.staging.bytes + 64;
  if (!check_kv_capacity(g, layout, out.c.state, parallel_mode::tp, out.opt).fits) return false;
  out.steps.push_back(plan_kv_migration(g, layout, out.c.state, parallel_mode::tp, out.opt));
  const kv_state& tp = out.steps.back().new_state;
  if (check_kv_capacity(g, layout, tp, parallel_mode::ep, out.opt).fits)
    out.steps.push_back(plan_kv_migration(g, layout, tp, parallel_mode::ep, out.opt));

  const size_t P = static_cast<size_t>(g.num_ranks);
  out.initial.kv.assign(P, std::vector<std::byte>(static_cast<size_t>(layout.pool_bytes)));
  out.initial.arena.assign(P, std::vector<std::byte>(static_cast<size_t>(out.arena_bytes)));
  for (auto* ps : {&out.initial.kv, &out.initial.arena})
    for (auto& p : *ps) p = random_bytes(rng, p.size());
  fill_reference(g, out.c.state, out.c.content, out.initial.kv, &where);

  images host = out.initial;
  host_transport tr(spans_of(host));
  for (const kv_migration& m : out.steps) {
    REQUIRE(find_phase_hazard(m.copies) == "");
    tr.execute(m.copies);
    out.expected.push_back(host);
  }
  REQUIRE(check_reference(g, out.steps.back().new_state, out.c.content, host.kv, &where) == "");
  return true;
}

// Device copies of every rank's KV pool and arena on `devices[r]`.
struct device_images {
  std::vector<device_buffer> kv;
  std::vector<device_buffer> arena;

  device_images(const gpu_case& gc, const std::vector<int>& devices) {
    for (size_t r = 0; r < devices.size(); ++r) {
      kv.emplace_back(devices[r], gc.initial.kv[r].size());
      arena.emplace_back(devices[r], gc.initial.arena[r].size());
    }
  }
  void upload(const images& m) {
    for (size_t r = 0; r < kv.size(); ++r) {
      for (device_buffer* b : {&kv[r], &arena[r]}) {
        MOEBIUS_CUDA_CHECK(cudaSetDevice(b->device()));
        MOEBIUS_CUDA_CHECK(cudaMemset(b->data(), static_cast<int>(k_poison), b->size()));
      }
      kv[r].upload(m.kv[r]);
      arena[r].upload(m.arena[r]);
    }
    MOEBIUS_CUDA_CHECK(cudaSetDevice(0));
  }
  images download() const {
    images m;
    for (size_t r = 0; r < kv.size(); ++r) {
      m.kv.push_back(kv[r].download());
      m.arena.push_back(arena[r].download());
    }
    return m;
  }
  std::vector<rank_memory> memory() const {
    std::vector<rank_memory> out(kv.size());
    for (size_t r = 0; r < kv.size(); ++r) {
      out[r] = rank_memory::on_device(kv[r].device(), arena[r].data(),
                                      static_cast<int64_t>(arena[r].size()), kv[r].data(),
                                      static_cast<int64_t>(kv[r].size()));
    }
    return out;
  }
};

// The first differing byte of two image sets ("" when identical).
std::string compare_images(const images& want, const images& got) {
  for (size_t r = 0; r < want.kv.size(); ++r) {
    std::string d = first_difference(want.kv[r], got.kv[r], "rank " + std::to_string(r) + " kv_pool");
    if (d.empty()) d = first_difference(want.arena[r], got.arena[r], "rank " + std::to_string(r) + " arena");
    if (!d.empty()) return d;
  }
  return "";
}

// Runs every step of `gc` through `run` on `dev` and checks the bytes after each one.
template <class Run>
void run_and_check(const gpu_case& gc, device_images& dev, Run&& run) {
  dev.upload(gc.initial);
  for (size_t i = 0; i < gc.steps.size(); ++i) {
    INFO("step " << i << " (" << (i == 0 ? "EP->TP" : "TP->EP") << "), "
                 << gc.steps[i].copies.phases.size() << " phases, "
                 << gc.steps[i].copies.num_ops() << " ops");
    run(gc.steps[i].copies);
    const images got = dev.download();
    REQUIRE(compare_images(gc.expected[i], got) == "");
    if (i + 1 == gc.steps.size())
      REQUIRE(check_reference(gc.c.g, gc.steps[i].new_state, gc.c.content, got.kv, &gc.where) ==
              "");
  }
}

void run_cuda_peer(const gpu_case& gc, const std::vector<int>& devices, engine_policy engine) {
  device_images dev(gc, devices);
  cuda_peer_config cfg;
  cfg.engine = engine;
  cfg.barrier_timeout_ns = int64_t{5'000'000'000};
  cuda_peer_transport tr = cuda_peer_transport::single_process(dev.memory(), cfg);
  run_and_check(gc, dev, [&](const plan& p) {
    tr.execute(p);
    REQUIRE(tr.completed_phases() == static_cast<int64_t>(p.phases.size()));
  });
}

#if MOEBIUS_WITH_NCCL
// One communicator over devices 0..P-1 per P, created once and kept for the process.
struct nccl_comms {
  std::vector<ncclComm_t> comms;
  std::vector<cudaStream_t> streams;
};

nccl_comms& comms_for(int P) {
  static std::map<int, nccl_comms>* all = new std::map<int, nccl_comms>;
  auto it = all->find(P);
  if (it != all->end()) return it->second;
  setenv("NCCL_NVLS_ENABLE", "0", 0);  // NVLink SHARP multicast: not wanted (KINDS.md)
  nccl_comms c;
  c.comms.resize(static_cast<size_t>(P));
  std::vector<int> ids(static_cast<size_t>(P));
  for (int i = 0; i < P; ++i) ids[static_cast<size_t>(i)] = i;
  const ncclResult_t r = ncclCommInitAll(c.comms.data(), P, ids.data());
  if (r != ncclSuccess) FAIL("ncclCommInitAll(" << P << ") failed: " << ncclGetErrorString(r));
  for (int i = 0; i < P; ++i) {
    cudaStream_t s = nullptr;
    MOEBIUS_CUDA_CHECK(cudaSetDevice(i));
    MOEBIUS_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    c.streams.push_back(s);
  }
  MOEBIUS_CUDA_CHECK(cudaSetDevice(0));
  return (*all)[P] = std::move(c);
}

void run_nccl(const gpu_case& gc) {
  const int P = gc.c.g.num_ranks;
  nccl_comms& w = comms_for(P);
  std::vector<int> devices(static_cast<size_t>(P));
  for (int r = 0; r < P; ++r) devices[static_cast<size_t>(r)] = r;
  device_images dev(gc, devices);
  std::vector<device_buffer> workspaces;
  std::vector<nccl_rank_comm> comms;
  for (int r = 0; r < P; ++r) {
    int64_t ws = 0;
    for (const kv_migration& m : gc.steps)
      ws = std::max(ws, nccl_transport::workspace_bytes(m.copies, r));
    workspaces.emplace_back(r, static_cast<size_t>(ws));
    comms.push_back({w.comms[static_cast<size_t>(r)], workspaces.back().data(), ws});
  }
  nccl_transport tr(dev.memory(), std::move(comms));
  run_and_check(gc, dev, [&](const plan& p) {
    tr.execute(p);
    REQUIRE(tr.completed_phases() == static_cast<int64_t>(p.phases.size()));
  });
}
#endif

}  // namespace

TEST_CASE("KV migrations on GPU transports match host_transport byte for byte", "[kv][gpu]") {
  const uint64_t seed = kv_test_seed();  // prints MOEBIUS_TEST_SEED
  std::mt19937_64 rng(seed);
  const int devices = device_count();
  int64_t cases = 0, refused = 0, round_trips = 0, spread_runs = 0, nccl_runs = 0;
  bool warned = false;
  std::map<int, int64_t> per_p;
  for (int iter = 0; iter < 100 && cases < 32; ++iter) {
    gpu_case gc;
    if (!make_case(rng, gc)) {
      ++refused;
      continue;
    }
    ++cases;
    const kv_geometry& g = gc.c.g;
    const int P = g.num_ranks;
    ++per_p[P];
    if (gc.steps.size() == 2) ++round_trips;
    INFO("seed " << seed << " iter " << iter << " " << g << " layout " << gc.layout_name
                 << " occupancy " << gc.c.occupancy
                 << " seqs " << gc.c.content.size() << " staging " << gc.opt.staging.bytes
                 << " B at " << gc.opt.staging.offset << ", steps " << gc.steps.size());
    {
      INFO("cuda_peer virtual ranks on device 0, sm_kernel");
      run_cuda_peer(gc, rank_devices(P, false), engine_policy::sm_kernel);
    }
    {
      INFO("cuda_peer virtual ranks on device 0, automatic");
      run_cuda_peer(gc, rank_devices(P, false), engine_policy::automatic);
    }
    if (P <= devices) {
      if (P > 1) {
        INFO("cuda_peer one rank per device, automatic");
        std::vector<int> d(static_cast<size_t>(P));
        for (int r = 0; r < P; ++r) d[static_cast<size_t>(r)] = r;
        run_cuda_peer(gc, d, engine_policy::automatic);
        ++spread_runs;
      }
#if MOEBIUS_WITH_NCCL
      INFO("nccl_transport, one communicator per device");
      run_nccl(gc);
      ++nccl_runs;
#endif
    } else if (!warned) {
      WARN("P = " << P << " > " << devices
                  << " device(s): one-rank-per-device and NCCL runs skipped for such cases");
      warned = true;
    }
  }
  std::string dist;
  for (const auto& [p, n] : per_p) dist += " P" + std::to_string(p) + ":" + std::to_string(n);
  INFO("cases " << cases << " refused " << refused << " round trips " << round_trips
                << " spread runs " << spread_runs << " nccl runs " << nccl_runs << " by P" << dist);
  CHECK(cases >= 12);
  CHECK(round_trips >= 6);
}
