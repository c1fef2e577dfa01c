#include "moebius/switch/pacing.hpp"

#include <algorithm>
#include <cmath>

#include "moebius/error.hpp"
#include "moebius/plan/plan.hpp"
#include "moebius/plan/weight_plan.hpp"
#include "layer_traffic.hpp"

namespace moebius {
namespace {

void check(const pacing_params& p) {
  MOEBIUS_CHECK(p.step_s > 0 && std::isfinite(p.step_s), errc::invalid_argument,
                "pacing: step_s must be > 0 (got ", p.step_s, ")");
  MOEBIUS_CHECK(p.link.bytes_per_s > 0 && std::isfinite(p.link.bytes_per_s),
                errc::invalid_argument, "pacing: the link rate must be > 0 B/s (got ",
                p.link.bytes_per_s, " B/s)");
  MOEBIUS_CHECK(p.link_fraction > 0 && p.link_fraction <= 1, errc::invalid_argument,
                "pacing: link_fraction must be in (0, 1] (got ", p.link_fraction, ")");
  MOEBIUS_CHECK(p.bytes_per_layer >= 0, errc::invalid_argument,
                "pacing: bytes_per_layer must be >= 0 (got ", p.bytes_per_layer, ")");
}

}  // namespace

int64_t layers_per_step(const pacing_params& p, int64_t max_layers) {
  check(p);
  MOEBIUS_CHECK(max_layers >= 1, errc::invalid_argument, "pacing: max_layers must be >= 1 (got ",
                max_layers, ")");
  if (p.bytes_per_layer == 0) return max_layers;
  const double budget = p.step_s * p.link.bytes_per_s * p.link_fraction;
  const double n = std::floor(budget / static_cast<double>(p.bytes_per_layer));
  if (!(n < static_cast<double>(max_layers))) return max_layers;  // also catches inf
  return std::max<int64_t>(1, static_cast<int64_t>(n));
}

double copy_seconds(const pacing_params& p, int64_t layers) {
  check(p);
  MOEBIUS_CHECK(layers >= 0, errc::invalid_argument, "pacing: layers must be >= 0 (got ", layers,
                ")");
  return static_cast<double>(layers) * static_cast<double>(p.bytes_per_layer) /
         (p.link.bytes_per_s * p.link_fraction);
}

int64_t layer_bytes::busiest() const {
  int64_t best = 0;
  for (size_t r = 0; r < weight_bytes_sent.size(); ++r)
    best = std::max(best, weight_bytes_sent[r] + (r < kv_bytes_sent.size() ? kv_bytes_sent[r] : 0));
  return best;
}

namespace detail {

layer_bytes layer_traffic(const arena_geometry& weights, parallel_mode target,
                          const plan* layer_kv) {
  // The first layer the switch moves: EP->TP takes layer 0 from cursor 0 to 1, TP->EP the
  // last layer from cursor L to L-1. Every layer's plan is this one shifted by slots.
  const int64_t L = weights.shape.num_layers;
  const plan w = target == parallel_mode::tp ? plan_weight_switch(weights, {0}, {1})
                                             : plan_weight_switch(weights, {L}, {L - 1});
  const auto P = static_cast<size_t>(weights.num_ranks);
  layer_bytes out;
  out.weight_bytes_sent = traffic_of(w).bytes_sent;
  out.weight_bytes_sent.resize(P, 0);
  out.kv_bytes_sent.assign(P, 0);
  if (layer_kv != nullptr) {
    out.kv_bytes_sent = traffic_of(*layer_kv).bytes_sent;
    out.kv_bytes_sent.resize(P, 0);
  }
  return out;
}

}  // namespace detail

layer_bytes switch_layer_bytes(const arena_geometry& weights, const kv_geometry& kv,
                               const kv_state& tables, parallel_mode target,
                               const kv_migration_options& kv_options) {
  return switch_layer_bytes(weights, kv, present_kv_layout(kv), tables, target, kv_options);
}

layer_bytes switch_layer_bytes(const arena_geometry& weights, const kv_geometry& kv,
                               const kv_pool_layout& layout, const kv_state& tables,
                               parallel_mode target, const kv_migration_options& kv_options) {
  MOEBIUS_CHECK(weights.num_ranks == kv.num_ranks, errc::invalid_argument,
                "switch_layer_bytes: the arena has ", weights.num_ranks, " ranks, the KV pool ",
                kv.num_ranks);
  MOEBIUS_CHECK(weights.shape.num_layers >= 1, errc::invalid_argument,
                "switch_layer_bytes: the arena has no layer");
  if (tables.mode == target) return detail::layer_traffic(weights, target, nullptr);
  kv_geometry one_layer = kv;
  one_layer.num_layers = 1;
  MOEBIUS_CHECK(layout.ep.layer == layout.tp.layer, errc::invalid_argument,
                "switch_layer_bytes: the KV layout's layers interleave inside a page (layer "
                "stride EP ", layout.ep.layer, ", TP ", layout.tp.layer,
                "): no layer's KV moves on its own");
  const kv_migration m = plan_kv_migration(one_layer, layout, tables, target, kv_options);
  return detail::layer_traffic(weights, target, &m.copies);
}

}  // namespace moebius
