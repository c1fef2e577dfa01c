#pragma once

// A deployment (deployment.hpp) as the simulated runtime serves it: the arena and KV geometry
// whose pages hold exactly the deployment's KV capacity in tokens, with few enough layers that
// the switcher's plans stay small. Nothing is allocated (the transport is a
// moebius::dry_run_transport); what a switch moves is scaled to the priced model by the clock
// (h200_step_model: the run's KV bytes per token against the priced model's, the priced
// experts per run layer).
//
//   the run model   `run_layers` layers (KV and MoE alike: a progressive switch moves them
//                   together), the deployment's H_kv and head_dim, pages of `page_size`
//                   tokens, bf16; E experts of hidden and intermediate sizes chosen so that
//                   one arena slot stages `staging_pages` EP pages of every KV tensor (a real
//                   deployment's slot, an expert layer's share, stages thousands)
//   KV pages        static TP: the TP pool holds d.tp.tokens; static EP and switching: each
//                   rank's EP pool holds d.ep.tokens / P (a switching deployment's TP view of
//                   that pool then holds what d.tp says: P / H_kv times fewer tokens when
//                   H_kv < P, its heads replicated)
//
//   Qwen3-235B-A22B, P = 8, 0.85 of an H200, 16-token pages, switching:
//     2.28M EP tokens: 17,838 EP pages a rank; its TP view 71,352 TP pages: 1.14M tokens

#include <cstdint>
#include <iosfwd>

#include <moebius/kv/kv_geometry.hpp>
#include <moebius/layout/arena_geometry.hpp>

#include "deployment.hpp"

namespace mini_engine {

struct sim_options {
  int64_t run_layers = 4;
  int64_t page_size = 16;
  int64_t staging_pages = 64;
};

struct sim_geometry {
  moebius::arena_geometry arena;
  moebius::kv_geometry kv;
  // KV bytes of one token of the run model, every layer, K and V, all heads (the clock scales
  // a switch's KV bytes by the priced model's over this).
  int64_t kv_bytes_per_token = 0;
  // The mode a static deployment serves in; a switching one serves in both.
  deployment_kind kind = deployment_kind::switching;
};

// Throws moebius::error (errc::invalid_argument) when the options are out of range
// (run_layers, page_size, staging_pages >= 1) or the deployment holds no page.
sim_geometry make_sim_geometry(const deployment& d, const sim_options& o = {});

// "static TP: 22,500 EP pages a rank of 16 tokens (TP: 1.44M tokens), run model 4 layers".
std::ostream& operator<<(std::ostream& os, const sim_geometry& g);

}  // namespace mini_engine
