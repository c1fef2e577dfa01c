#include "sim_deployment.hpp"

#include <algorithm>
#include <ostream>
#include <string>

#include <moebius/error.hpp>
#include <moebius/kv/kv_migration.hpp>

#include "step_clock.hpp"

namespace mini_engine {

using moebius::errc;
using moebius::parallel_mode;

sim_geometry make_sim_geometry(const deployment& d, const sim_options& o) {
  MOEBIUS_CHECK(o.run_layers >= 1 && o.page_size >= 1 && o.staging_pages >= 1,
                errc::invalid_argument, "make_sim_geometry: run_layers, page_size and "
                "staging_pages must be >= 1 (got ", o.run_layers, ", ", o.page_size, ", ",
                o.staging_pages, ")");
  const model_config& c = d.model;
  const int P = d.options.num_ranks;
  const moebius::kv_geometry one = moebius::make_kv_geometry(
      o.run_layers, c.num_kv_heads, c.head_dim, o.page_size, 1, P, moebius::dtype::bf16);
  const int64_t dcp = dcp_of(d.kind);
  const bool ep_attention = d.serves(parallel_mode::ep) && d.ep.attention() == parallel_mode::ep;
  int64_t ep_pages = 0;
  if (!ep_attention) {
    // The TP pool holds tokens / dcp on every rank: its pages in EP units (same bytes).
    const layout_capacity& l = d.serves(parallel_mode::tp) ? d.tp : d.ep;
    const int64_t tp_pages = l.tokens / l.config.dcp / o.page_size;
    ep_pages = tp_pages * one.tp_page_bytes() / one.ep_page_bytes();
  } else {
    ep_pages = d.ep.tokens / P / o.page_size;
  }
  MOEBIUS_CHECK(ep_pages >= 1, errc::invalid_argument, "make_sim_geometry: ",
                to_string(d.kind), " holds no KV page of ", o.page_size, " tokens");
  sim_geometry g;
  g.kind = d.kind;
  g.kv = moebius::with_dcp(moebius::make_kv_geometry(o.run_layers, c.num_kv_heads, c.head_dim,
                                                     o.page_size, ep_pages, P,
                                                     moebius::dtype::bf16),
                           dcp);
  g.kv_bytes_per_token = kv_bytes_per_token(g.kv);
  // Experts: E/P a rank in EP, each 3 x hidden x intermediate bf16; one slot (a layer's share)
  // stages staging_pages EP pages of every KV tensor: E/P x 6 x H x I >= that.
  const int64_t staging = o.staging_pages * moebius::kv_staging_slot_bytes(g.kv, parallel_mode::ep);
  moebius::expert_shape shape;
  shape.num_layers = o.run_layers;
  shape.num_experts = c.num_experts;
  shape.weight_dtype = moebius::dtype::bf16;
  shape.hidden = 256;
  const int64_t per_intermediate = c.num_experts / P * 3 * shape.hidden * 2;
  shape.intermediate = std::max<int64_t>(P, (staging + per_intermediate - 1) / per_intermediate);
  shape.intermediate = (shape.intermediate + P - 1) / P * P;  // TP splits it in P
  g.arena = moebius::make_arena_geometry(shape, P, 256, 4096);
  return g;
}

std::ostream& operator<<(std::ostream& os, const sim_geometry& g) {
  const int64_t tp_tokens = g.kv.max_tokens(parallel_mode::tp);
  const int64_t ep_tokens = g.kv.max_tokens(parallel_mode::ep);
  // What the kind serves in: EP attention, TP attention (with its dcp), or both.
  const bool ep = g.kind == deployment_kind::static_ep || g.kind == deployment_kind::switching ||
                  g.kind == deployment_kind::switching_dcp2;
  const bool tp = g.kind != deployment_kind::static_ep;
  os << to_string(g.kind) << ": " << g.kv.num_ep_pages << " EP pages a rank of "
     << g.kv.page_size << " tokens (";
  if (ep) os << "EP " << ep_tokens << " tokens";
  if (ep && tp) os << ", ";
  if (tp) os << (g.kv.dcp > 1 ? "TP-DCP" + std::to_string(g.kv.dcp) : std::string("TP")) << " "
             << tp_tokens << " tokens";
  if (g.kind == deployment_kind::dcp_only)
    os << ", TP " << moebius::with_dcp(g.kv, 1).max_tokens(parallel_mode::tp) << " tokens";
  return os << "), run model " << g.kv.num_layers << " layers, arena slot "
            << g.arena.slot_bytes / 1024 << " KiB";
}

}  // namespace mini_engine
