#include "deployment.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <moebius/error.hpp>
#include <moebius/layout/arena_geometry.hpp>
#include <moebius/memory/memory_budget.hpp>
#include <ostream>

namespace mini_engine {

using moebius::errc;
using moebius::parallel_mode;

namespace {

// KV bytes a rank stores per token it holds: every layer, K and V, the KV heads of the layout
// (EP attention: all H_kv; TP: H_kv / P, or one replicated head when H_kv < P; dcp changes
// which tokens a rank holds, not what one costs).
int64_t kv_bytes_per_token(const model_config& c, parallel_mode attention, int P) {
  const int64_t heads = attention == parallel_mode::ep ? c.num_kv_heads
                                                       : std::max<int64_t>(1, c.num_kv_heads / P);
  return c.num_layers * 2 * heads * c.head_dim * moebius::dtype_bytes(c.kv_dtype);
}

layout_capacity capacity_of(const model_config& c, const deployment_options& o,
                            const configuration& config, int64_t weight_bytes) {
  layout_capacity l;
  l.config = config;
  l.num_ranks = o.num_ranks;
  l.max_running = o.max_running;
  l.weight_bytes = weight_bytes;
  const double budget = o.memory_fraction * o.device_bytes - static_cast<double>(weight_bytes);
  l.kv_pool_bytes = budget > 0 ? static_cast<int64_t>(budget) : 0;
  l.kv_bytes_per_token = kv_bytes_per_token(c, config.layout.attention, o.num_ranks);
  const int64_t per_rank = l.kv_pool_bytes / l.kv_bytes_per_token;
  l.tokens = config.layout.attention == parallel_mode::ep ? per_rank * o.num_ranks
                                                          : per_rank * config.dcp;
  return l;
}

}  // namespace

const char* to_string(deployment_kind k) {
  switch (k) {
    case deployment_kind::static_tp:
      return "static TP";
    case deployment_kind::static_ep:
      return "static EP";
    case deployment_kind::switching:
      return "switching";
    case deployment_kind::static_tp_dcp2:
      return "static TP-DCP2";
    case deployment_kind::static_tep_dcp2:
      return "static TEP-DCP2";
    case deployment_kind::switching_dcp2:
      return "switching DCP2";
    case deployment_kind::experts_only:
      return "experts only";
    case deployment_kind::dcp_only:
      return "dcp only";
  }
  return "unknown";
}

int64_t dcp_of(deployment_kind k) {
  switch (k) {
    case deployment_kind::static_tp_dcp2:
    case deployment_kind::static_tep_dcp2:
    case deployment_kind::switching_dcp2:
    case deployment_kind::experts_only:
    case deployment_kind::dcp_only:
      return 2;
    default:
      return 1;
  }
}

int64_t layout_capacity::sequences(int64_t context) const {
  MOEBIUS_CHECK(context >= 1, errc::invalid_argument, "sequences: context must be >= 1 (got ",
                context, ")");
  const int64_t per_rank_tokens = kv_pool_bytes / kv_bytes_per_token;
  const int64_t fit = attention() == parallel_mode::ep
                          ? (per_rank_tokens / context) * num_ranks
                          : per_rank_tokens * config.dcp / context * replicas;
  return std::min(fit, max_running);
}

std::vector<layout_capacity> deployment::layouts() const {
  std::vector<layout_capacity> out;
  for (const parallel_mode m : {parallel_mode::ep, parallel_mode::tp})
    if (serves(m)) out.push_back(in(m));
  return out;
}

mode_layouts deployment::modes() const {
  mode_layouts m;
  if (serves(parallel_mode::ep)) m.ep = ep.config.layout;
  if (serves(parallel_mode::tp)) m.tp = tp.config.layout;
  // A mode's own dcp only where the two differ in it alone (dcp only); every other design
  // serves at its KV geometry's.
  if (serves(parallel_mode::ep) && serves(parallel_mode::tp) && m.ep == m.tp &&
      ep.config.dcp != tp.config.dcp) {
    m.ep_dcp = ep.config.dcp;
    m.tp_dcp = tp.config.dcp;
  }
  return m;
}

parallel_mode deployment::start_mode() const {
  return serves(parallel_mode::ep) ? parallel_mode::ep : parallel_mode::tp;
}

deployment make_deployment(const model_config& model, deployment_kind kind,
                           const deployment_options& o) {
  validate(model, o.num_ranks);
  MOEBIUS_CHECK(o.memory_fraction > 0 && o.memory_fraction <= 1, errc::invalid_argument,
                "deployment: memory_fraction must be in (0, 1] (got ", o.memory_fraction, ")");
  MOEBIUS_CHECK(o.device_bytes > 0 && std::isfinite(o.device_bytes), errc::invalid_argument,
                "deployment: device_bytes must be finite and > 0 (got ", o.device_bytes, ")");
  MOEBIUS_CHECK(o.max_running >= 1, errc::invalid_argument,
                "deployment: max_running must be >= 1 (got ", o.max_running, ")");
  const int64_t dcp = dcp_of(kind);
  if (dcp > 1) {
    // kv_geometry's rule: dcp divides the ranks that replicate one KV head slice.
    const int64_t replicas =
        model.num_kv_heads < o.num_ranks ? o.num_ranks / std::max<int64_t>(1, model.num_kv_heads) : 1;
    MOEBIUS_CHECK(replicas % dcp == 0, errc::invalid_argument, "deployment: ", to_string(kind),
                  " needs dcp ", dcp, " to divide the ranks sharing a KV head (P / H_kv = ",
                  o.num_ranks, " / ", model.num_kv_heads, ": ", replicas, ")");
  }
  const moebius::arena_geometry arena =
      moebius::make_arena_geometry(expert_shape_of(model), o.num_ranks, 256, 4096);
  moebius::attention_shape a;
  a.num_layers = model.num_layers;
  a.hidden = model.hidden;
  a.num_q_heads = model.num_q_heads;
  a.num_kv_heads = model.num_kv_heads;
  a.head_dim = model.head_dim;
  a.weight_dtype = moebius::dtype::bf16;
  moebius::dense_shape dense;
  dense.vocab = model.vocab;
  dense.num_experts = model.num_experts;
  const moebius::memory_budget b = moebius::make_memory_budget(arena, a, dense, 0, {});
  // EP holds the whole attention and dense weights; TP its head slice and, vocab-parallel as
  // SGLang and vLLM shard them, 1/P of the embedding and LM head (and of the rest of the dense
  // weights, a rounding error beside them); TEP TP's (E/P whole experts weigh what every
  // expert's I/P slice does); the paper's switching designs EP's and the arena's spare slot;
  // experts only TP's attention and dense weights and the arena's spare slot; dcp only static
  // TP's (no expert moves).
  const int64_t ep = b.expert_bytes + b.attention_bytes + b.dense_bytes;
  const int64_t tp = b.expert_bytes + b.static_tp_attention_bytes + b.dense_bytes / o.num_ranks;
  const int64_t sw = b.arena_bytes + b.attention_bytes + b.dense_bytes;
  const int64_t experts_only =
      b.arena_bytes + b.static_tp_attention_bytes + b.dense_bytes / o.num_ranks;
  deployment d;
  d.kind = kind;
  d.model = model;
  d.options = o;
  switch (kind) {
    case deployment_kind::static_ep:
      d.ep = capacity_of(model, o, k_ep, ep);
      break;
    case deployment_kind::static_tp:
      d.tp = capacity_of(model, o, k_tp, tp);
      break;
    case deployment_kind::switching:
      d.ep = capacity_of(model, o, k_ep, sw);
      d.tp = capacity_of(model, o, k_tp, sw);
      break;
    case deployment_kind::static_tp_dcp2:
      d.tp = capacity_of(model, o, k_tp_dcp2, tp);
      break;
    case deployment_kind::static_tep_dcp2:
      d.ep = capacity_of(model, o, k_tep_dcp2, tp);
      break;
    case deployment_kind::switching_dcp2:
      d.ep = capacity_of(model, o, k_ep, sw);
      d.tp = capacity_of(model, o, k_tp_dcp2, sw);
      break;
    case deployment_kind::experts_only:
      d.ep = capacity_of(model, o, k_tep_dcp2, experts_only);
      d.tp = capacity_of(model, o, k_tp_dcp2, experts_only);
      break;
    case deployment_kind::dcp_only:
      d.ep = capacity_of(model, o, k_tp_dcp2, tp);
      d.tp = capacity_of(model, o, k_tp, tp);
      break;
  }
  return d;
}

std::ostream& operator<<(std::ostream& os, const deployment& d) {
  char buf[400];
  std::snprintf(buf, sizeof buf, "%s (P=%d, %.0f%% of %.1f GB): ", to_string(d.kind),
                d.options.num_ranks, d.options.memory_fraction * 100, d.options.device_bytes / 1e9);
  os << buf;
  bool first = true;
  for (const parallel_mode m : {parallel_mode::tp, parallel_mode::ep}) {
    const layout_capacity& l = d.in(m);
    if (!d.serves(m)) continue;  // a static deployment's other layout
    std::snprintf(
        buf, sizeof buf,
        "%s%s %.1f GB of weights and %.1f GB of KV a rank, %.1f KB a token: %.2fM "
        "tokens%s, sequences of 4k / 16k / 32k: %lld / %lld / %lld",
        first ? "" : "; ", name_of(l.config).c_str(), static_cast<double>(l.weight_bytes) / 1e9,
        static_cast<double>(l.kv_pool_bytes) / 1e9, static_cast<double>(l.kv_bytes_per_token) / 1e3,
        static_cast<double>(l.tokens) / 1e6,
        l.attention() == parallel_mode::ep ? " in all"
        : l.config.dcp > 1                 ? " (every replica set holds every sequence, each rank 1/dcp of its tokens)"
                                           : " (every rank holds every sequence)",
        static_cast<long long>(l.sequences(4096)), static_cast<long long>(l.sequences(16384)),
        static_cast<long long>(l.sequences(32768)));
    os << buf;
    first = false;
  }
  return os;
}

}  // namespace mini_engine
