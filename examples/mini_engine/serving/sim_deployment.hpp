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
//   KV pages        a deployment that serves in EP attention (static EP, switching, switching
//                   DCP2): each rank's EP pool holds d.ep.tokens / P, and its TP view what d.tp
//                   says (P / H_kv times fewer tokens when H_kv < P, its heads replicated, dcp
//                   times more with dcp); one that serves in TP attention only (static TP,
//                   TP-DCP2, TEP-DCP2, experts only, dcp only): the TP view holds its tokens /
//                   dcp on each rank; with the deployment's dcp (kv_geometry::dcp; dcp only
//                   starts at 2, the same pages holding half the tokens at dcp 1)
//
//   Qwen3-235B-A22B, P = 8, 0.85 of an H200, 16-token pages, switching:
//     2.28M EP tokens: 17,838 EP pages a rank; its TP view 71,352 TP pages: 1.14M tokens
//   switching DCP2: the same pages; the TP view (dcp 2) holds 2.28M tokens

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
  // The deployment it simulates (what it serves in: deployment::modes()).
  deployment_kind kind = deployment_kind::switching;
};

// Throws moebius::error (errc::invalid_argument) when the options are out of range
// (run_layers, page_size, staging_pages >= 1) or the deployment holds no page.
sim_geometry make_sim_geometry(const deployment& d, const sim_options& o = {});

// "static TP: 22,500 EP pages a rank of 16 tokens (TP 1440000 tokens), run model 4 layers, ..."
// (TP-DCP2 and the dcp under a DCP2 kind).
std::ostream& operator<<(std::ostream& os, const sim_geometry& g);

}  // namespace mini_engine
