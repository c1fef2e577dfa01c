#pragma once

// Pacing of a progressive switch (switcher::begin / advance, DESIGN.md §7): how many layers
// to advance per decode step so that each step's copies finish inside the step. The copies
// run on the copy engines beside the step's kernels; if they took longer than the step, the
// next advance would have to wait for them (poll() before advance()) and the step would
// stretch. So per step
//
//   layers = max(1, floor(step_s * link.bytes_per_s * link_fraction / bytes_per_layer))
//
// where bytes_per_layer is what the busiest rank sends for one layer (its expert weights and
// that layer's KV pages; every layer of a model moves alike) and link_fraction the share of
// the link the copies may take (the step's own collectives use the rest). At least 1 layer,
// so a switch always ends; when even one layer exceeds the step's budget, that step is longer
// than normal by the excess (the serving loop charges max(step, copies)).
//
// Worked example: Qwen3-30B-A3B (48 layers, 128 experts, H=2048, I=768, bf16) at P=2. Each
// layer's experts are 128 x 3 x 2048 x 768 x 2 B = 1,207,959,552 B; a rank holds half
// (603,979,776 B) and sends half of its share to the other rank in either direction:
// 301,989,888 B per layer (plus the layer's KV, small at decode batch sizes). At 389 GB/s per
// GPU with 55% of it for the copies and a 10 ms step: 0.010 x 389e9 x 0.55 = 2,139,500,000 B
// per step -> floor(2,139,500,000 / 301,989,888) = 7 layers per step: the switch takes
// ceil(48 / 7) = 7 steps, each step's copies 7 x 301,989,888 B / 213.95 GB/s = 9.88 ms.

#include <cstdint>
#include <vector>

#include "moebius/kv/kv_geometry.hpp"
#include "moebius/kv/kv_migration.hpp"
#include "moebius/kv/kv_pool_layout.hpp"
#include "moebius/kv/page_table.hpp"
#include "moebius/layout/arena_geometry.hpp"
#include "moebius/transport/link_rate.hpp"

namespace moebius {

struct pacing_params {
  double step_s = 0;            // measured time of a decode step, seconds (> 0)
  link_rate link{};             // per GPU per direction (> 0), e.g. link_rate::gb_per_s(389)
  double link_fraction = 1.0;   // (0, 1]: the share of the link the copies may use
  int64_t bytes_per_layer = 0;  // busiest rank's bytes sent per layer (>= 0; 0: nothing moves)
};

// Layers to advance per step (>= 1; see the formula above). Throws errc::invalid_argument for
// step_s <= 0, link.bytes_per_s <= 0, link_fraction outside (0, 1] or bytes_per_layer < 0.
// bytes_per_layer == 0 gives `max_layers`' default: everything in one step.
int64_t layers_per_step(const pacing_params& p, int64_t max_layers = INT64_MAX);

// Seconds the copies of `layers` layers take at the paced rate (link x fraction).
double copy_seconds(const pacing_params& p, int64_t layers);

// What one layer of a progressive switch sends, per rank: the expert weights of one layer
// (the one-layer weight plan) and one layer's KV migration from `tables` to `target` (both
// come from plans, traffic_of, so they are the bytes the switcher will move: every layer
// moves alike). `kv_options`: as the switcher plans it (staging in the arena's free slot).
struct layer_bytes {
  std::vector<int64_t> weight_bytes_sent;  // [P] bytes leaving rank r for other ranks
  std::vector<int64_t> kv_bytes_sent;      // [P]
  // The busiest rank's weights + KV: pacing_params::bytes_per_layer.
  int64_t busiest() const;
};

// Throws what plan_kv_migration throws (errc::capacity when the target cannot hold the live
// KV) and errc::invalid_argument when the geometries disagree on the rank or layer count.
layer_bytes switch_layer_bytes(const arena_geometry& weights, const kv_geometry& kv,
                               const kv_state& tables, parallel_mode target,
                               const kv_migration_options& kv_options = {});
// The same over a pool in another layout (kv_pool_layout.hpp), as a switcher given it as
// switcher_options::kv_layout plans: layer 0 of the layout. Throws errc::invalid_argument also
// when the layout's layers interleave inside a page (no layer moves on its own).
layer_bytes switch_layer_bytes(const arena_geometry& weights, const kv_geometry& kv,
                               const kv_pool_layout& layout, const kv_state& tables,
                               parallel_mode target, const kv_migration_options& kv_options = {});

}  // namespace moebius
