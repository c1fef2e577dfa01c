// KV plans of today's view are unchanged by decode context parallel: with dcp = 1 (the
// default) every plan, the tables after it and its statistics hash to what the planner at
// commit 4c4f828 (before dcp existed) produced, over random geometries (H_kv < P, >= P, latent;
// HND and NHD), every engine preset, EP->TP from random EP states and TP->EP from the result and
// from fragmented TP states. The digests below were printed by this file built against 4c4f828
// (MOEBIUS_PRINT_DIGESTS=1); the cases are drawn from fixed seeds so both builds see the same.
// Four were printed again after one deliberate change (cases 8, 31, 35 and 38, EP->TP with
// interleaved slices: a rank's last staging slot is kept for its own pages' pieces, so that
// other ranks' staged pieces cannot leave a full rank's pages with nowhere to go; ep_to_tp.cpp).

#include <cstdint>
#include <cstdlib>
#include <iostream>
#include <random>

#include "kv_cases.hpp"
#include "moebius/kv/kv_migration.hpp"
#include "support/catch.hpp"

using namespace moebius;
using namespace moebius::testing;

namespace {

uint64_t combine(uint64_t h, uint64_t v) { return mix(h ^ mix(v)); }

uint64_t digest(const kv_migration_attempt& a) {
  uint64_t h = combine(0, a.capacity.fits);
  h = combine(h, static_cast<uint64_t>(a.capacity.rounds));
  h = combine(h, static_cast<uint64_t>(a.capacity.pages_needed));
  h = combine(h, static_cast<uint64_t>(a.capacity.pages_available));
  if (!a.migration) return h;
  const kv_migration& m = *a.migration;
  h = combine(h, hash_of(m.copies));
  for (const kv_rank_state& r : m.new_state.ranks) {
    for (const kv_sequence& q : r.sequences) {
      h = combine(h, static_cast<uint64_t>(q.seq_id));
      for (int64_t p : q.pages) h = combine(h, static_cast<uint64_t>(p));
    }
    for (int64_t p : r.free_pages) h = combine(h, static_cast<uint64_t>(p));
  }
  const kv_migration_stats& s = m.stats;
  for (int64_t v : {s.rounds, s.pages_moved, s.pages_in_place, s.pages_staged, s.pages_compacted,
                    s.bytes_copied})
    h = combine(h, static_cast<uint64_t>(v));
  return h;
}

// One case from `seed`: a geometry, a preset, a state, staging; EP->TP then TP->EP of the result
// (EP start), or TP->EP of a fragmented TP state (TP start).
uint64_t case_digest(uint64_t seed) {
  std::mt19937_64 rng(seed);
  static constexpr kv_preset presets[] = {kv_preset::present, kv_preset::vllm_flash_attn,
                                          kv_preset::vllm_flashinfer, kv_preset::sglang_mha};
  kv_geometry g = random_kv_geometry(rng, uni(rng, 1, 6) * 16384);
  const kv_preset preset = presets[seed % 4];
  if (preset == kv_preset::sglang_mha) g.layout = kv_layout::nhd;
  const kv_pool_layout layout = kv_preset_layout(preset, g);
  const double occ = std::uniform_real_distribution<double>(0.05, 0.95)(rng);
  kv_migration_options opt;
  const int64_t slots = uni(rng, 0, 2);
  opt.staging = {memory_space::arena, 0,
                 slots * std::max(kv_staging_slot_bytes(g, parallel_mode::tp),
                                  kv_staging_slot_bytes(g, parallel_mode::ep))};
  const bool tp_start = seed % 3 == 0;
  kv_case c = random_kv_case(rng, g, tp_start ? parallel_mode::tp : parallel_mode::ep, occ,
                             uni(rng, 1, 300));
  uint64_t h = 0;
  if (tp_start) return digest(try_plan_kv_migration(g, layout, c.state, parallel_mode::ep, opt));
  const kv_migration_attempt to_tp = try_plan_kv_migration(g, layout, c.state, parallel_mode::tp, opt);
  h = combine(h, digest(to_tp));
  if (to_tp.migration)
    h = combine(h, digest(try_plan_kv_migration(g, layout, to_tp.migration->new_state,
                                                parallel_mode::ep, opt)));
  return h;
}

// Printed by this file against commit 4c4f828, seeds 1..kCases.
constexpr int kCases = 48;
constexpr uint64_t kDigests[kCases] = {
    0x8869c19ce2cfdaa4ull,
    0xa1a3000ccefd823ull,
    0x75a8fd1135e50897ull,
    0x707aedb4dc777cb3ull,
    0xac0cbe8ec1ab015cull,
    0x60df45c8352095b8ull,
    0x41ad8d631b380d13ull,
    0xd6f79defe7709085ull,
    0x70fc4e6930d1059ull,
    0x77041671fb37c793ull,
    0xe77521687bc7cb95ull,
    0x89f5b1ab65318687ull,
    0xf24830d8e2e26941ull,
    0xb5765a1288d2c092ull,
    0x77cd49955513bb1full,
    0xc0e2974c2a11b27bull,
    0x148a747b67aae45aull,
    0x137b0597246b2726ull,
    0x7d5da94ed9d7f173ull,
    0xd5202357fd591cb5ull,
    0x3983f682ddd47cccull,
    0x4ec7a8cbc81cbb5eull,
    0xe1f4619b9ed3877aull,
    0x1b64d891a6de5801ull,
    0xd5240b3e41dc0b8cull,
    0x78db3018b67009f0ull,
    0x19f6059526c98667ull,
    0x4ea2409ed6ae6b23ull,
    0xccd4e51fc1200ee3ull,
    0xdad2f5a6142d4a24ull,
    0x39bfb861bc5f4c4eull,
    0x7900dd3600f4cbe0ull,
    0x79ac120ceaa1f5a5ull,
    0x661abaf760c897full,
    0x3381678385a55cdeull,
    0xae25ab1189a7d03bull,
    0xf063338c91c5b366ull,
    0x41f89a4e864c4d6dull,
    0xba675704cc38dfe4ull,
    0xc641162d9d188a4aull,
    0xde86ffed7c5723a5ull,
    0x4ba129d77159b073ull,
    0x1a0eccba5513a472ull,
    0x3ab55476f6b92075ull,
    0x555a4e78036c4770ull,
    0xdf1d8785ffd0454bull,
    0xb635d24733121b9ull,
    0x71d9cebdbd381cc1ull,
};

}  // namespace

TEST_CASE("KV plans with dcp = 1 equal the planner's before dcp (recorded digests)",
          "[kv][migration][dcp]") {
  const bool print = std::getenv("MOEBIUS_PRINT_DIGESTS") != nullptr;
  for (int i = 0; i < kCases; ++i) {
    const uint64_t d = case_digest(static_cast<uint64_t>(i + 1));
    if (print) {
      std::cout << "    0x" << std::hex << d << std::dec << "ull,\n";
      continue;
    }
    INFO("case seed " << i + 1);
    CHECK(d == kDigests[i]);
  }
}
