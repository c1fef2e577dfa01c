#pragma once

// The GPU runtime's own step times, as mini_engine_fidelity measures them on one GPU (P = 1,
// or P = 2 virtual ranks): decode-step curves, prefill chunks alone, the mixed-step grid and its
// probes, and a start-up warm-up. Each time is the wall clock of runtime::step as the serving
// loop waits for it (inputs, upload, graph replay or eager launches, tokens back).

#include <cstdint>
#include <span>
#include <vector>

#include <nlohmann/json.hpp>

#include "gpu_runtime.hpp"
#include "mixed_step_table.hpp"

namespace mini_engine::fidelity {

constexpr int64_t k_max_tokens = 512;     // tokens a step (decode and prefill chunks)
constexpr int64_t k_max_running = 256;    // sequences at once
constexpr int64_t k_page_size = 16;       // the runtime's (kv geometry)
constexpr int64_t k_longest = 2560;       // tokens of the longest request (prompt + output)
constexpr int64_t k_curve_largest = 512;  // sequences of the curves' largest batch
// The prefill points' chunks (tokens): up to the step's budget.
constexpr int64_t k_prefill_chunks[] = {16, 32, 64, 128, 256, 512};
// The mixed-step grid (mixed_step_table.hpp): decode batches beside the chunk (a rank's own in
// EP; those above k_max_running sequences in the deployment are left out: the trace never runs
// them) by chunk tokens (each cut to the rank's token budget left beside the batch); the decode
// sequences at the curves' smallest context.
constexpr int64_t k_mixed_batches[] = {0, 1, 4, 16, 64, 128, 256};
constexpr int64_t k_mixed_chunks[] = {16, 64, 256, 512};
constexpr int64_t k_mixed_context = 128;

// A prefill chunk of a mixed step: `tokens` new tokens after `start` already cached.
struct chunk_spec {
  int64_t tokens = 0, start = 0;
};

// The median of 7 (or `runs`) steps after 2 warm-ups, in ms; `device_ms` (when given) the median
// of the runtime's own device time of the same steps (CUDA events, what the measured clock
// charges); `first_ms` (when given) the wall clock of the first warm-up.
double median_step_ms(gpu::gpu_runtime& rt, const step_layout& layout,
                      std::span<const step_item> items, double* device_ms = nullptr,
                      int runs = 7, double* first_ms = nullptr);
// The decode-step curves' batches in mode `m` (the deployment's: P x a rank's in EP, a rank's
// in TP), ascending, up to `largest`: every graph bucket, and the first batch past each bucket
// but the last. The replayed graph runs the bucket's rows (gpu_runtime pads a step to it) while
// attention and the experts skip the padding, so a decode step's cost jumps just past a bucket
// and is nearly flat up to the next: on every point (curves_clock_options::replayed_decode) a
// decode step priced at its own batch carries the padding as served. On the buckets' points
// alone it was priced 3.7% short on average (up to 10% at 5 or 65 sequences), at its bucket
// 2.7% long (one H100, docs/results/fidelity_h100x1_warm_up). A step that prefills runs eagerly
// (no padding): its extra rows stay on the buckets' points, which the plateaus would misprice.
struct curve_batch {
  int64_t batch = 0;
  bool past_bucket = false;  // the first batch past a bucket (else a bucket's own)
};
std::vector<curve_batch> curve_batches(moebius::parallel_mode m, int P,
                                       std::span<const int64_t> buckets, int64_t largest);
// The decode step in mode `m` at batch B and context C.
double measure_step_ms(gpu::gpu_runtime& rt, moebius::parallel_mode m, int64_t B, int64_t C,
                       int64_t vocab, int64_t layers);
// One eager step at every row count 1 .. k_max_tokens in each mode the run serves in; seconds.
double warm_eager_rows(gpu::gpu_runtime& rt, int P, int64_t vocab, int64_t layers);
// A step that prefills one chunk of T tokens alone (sequence 0's first chunk).
double measure_prefill_ms(gpu::gpu_runtime& rt, moebius::parallel_mode m, int64_t T,
                          int64_t vocab, int64_t layers, double* device_ms,
                          double* first_ms = nullptr);
// A step that decodes `b` sequences (a rank's own in EP) at context C beside `chunks`.
double measure_mixed_ms(gpu::gpu_runtime& rt, moebius::parallel_mode m, int64_t b, int64_t C,
                        std::span<const chunk_spec> chunks, int64_t vocab, int64_t layers,
                        double* device_ms);
// The mixed-step grid per mode, its points printed and added to `out`.
mixed_step_table measure_mixed_grid(gpu::gpu_runtime& rt, int P, int64_t vocab, int64_t layers,
                                    nlohmann::json& out);
// The probes beside the grid (a grid point's tokens as a prompt's tail and over several
// prompts), printed and added to `out`.
void measure_mixed_probes(gpu::gpu_runtime& rt, int64_t vocab, int64_t layers,
                          nlohmann::json& out);

}  // namespace mini_engine::fidelity
