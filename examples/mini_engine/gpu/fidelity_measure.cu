#include "fidelity_measure.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "bench_decode_batch.hpp"

namespace mini_engine::fidelity {

using moebius::parallel_mode;

// The wall clock of a step as the serving loop waits for it (runtime::step: inputs, upload,
// graph replay or eager launches, tokens back), the median of 7 after 2 warm-ups; `device_ms`
// (when given) the median of the runtime's own device time of the same steps (CUDA events, what
// the measured clock charges); `first_ms` (when given) the wall clock of the first warm-up.
double median_step_ms(gpu::gpu_runtime& rt, const step_layout& layout,
                      std::span<const step_item> items, double* device_ms, int runs,
                      double* first_ms) {
  for (int w = 0; w < 2; ++w) {
    const auto t0 = std::chrono::steady_clock::now();
    rt.step(layout, items);
    if (w == 0 && first_ms != nullptr)
      *first_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  }
  std::vector<double> ms, device;
  for (int i = 0; i < runs; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    rt.step(layout, items);
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    device.push_back(rt.measured_step_s() * 1e3);
  }
  std::sort(ms.begin(), ms.end());
  std::sort(device.begin(), device.end());
  const size_t mid = static_cast<size_t>(runs / 2);
  if (device_ms != nullptr) *device_ms = device[mid];
  return ms[mid];
}

std::vector<curve_batch> curve_batches(parallel_mode m, int P, std::span<const int64_t> buckets,
                                       int64_t largest) {
  const int64_t ranks = m == parallel_mode::ep ? P : 1;
  std::vector<curve_batch> out;
  for (size_t i = 0; i < buckets.size(); ++i) {
    if (ranks * buckets[i] > largest) break;
    out.push_back({ranks * buckets[i], false});
    // Past the bucket: the next bucket's graph, unless it is the same batch (buckets 1, 2).
    if (i + 1 < buckets.size() && buckets[i] + 1 < buckets[i + 1] &&
        ranks * (buckets[i] + 1) <= largest)
      out.push_back({ranks * (buckets[i] + 1), true});
  }
  return out;
}

// The decode step's wall clock in mode `m` at batch B and context C.
double measure_step_ms(gpu::gpu_runtime& rt, parallel_mode m, int64_t B, int64_t C, int64_t vocab,
                       int64_t layers) {
  const moebius::kv_state tables = gpu::bench::make_tables(rt.kv(), m, B, C + 1);
  std::vector<int32_t> tokens;
  const std::vector<step_item> items = gpu::bench::decode_items(B, C, vocab, tokens);
  const step_layout layout{&tables, moebius::arena_cursor{m == parallel_mode::tp ? layers : 0}};
  return median_step_ms(rt, layout, items);
}

// Runs one eager step at every row count a served step can have (1 .. k_max_tokens: a chunk of
// that many tokens, on every rank), in each mode the run serves in, and returns its seconds:
// the start-up warm-up an engine runs (vLLM's warm-up over its compile and capture sizes), so
// that the measured run meets no row count for the first time. Every shape the step's GEMMs
// take (the expert tiles included) follows from its row count. MOEBIUS_FIDELITY_WARM=0 skips it.
double warm_eager_rows(gpu::gpu_runtime& rt, int P, int64_t vocab, int64_t layers) {
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<int32_t> chunk(static_cast<size_t>(k_max_tokens));
  for (int64_t i = 0; i < k_max_tokens; ++i)
    chunk[static_cast<size_t>(i)] = static_cast<int32_t>((i * 7919 + 17) % vocab);
  for (const parallel_mode m : {parallel_mode::ep, parallel_mode::tp}) {
    if (P == 1 && m == parallel_mode::tp) break;  // at P = 1 the same kernels on the same shapes
    const int64_t sequences = m == parallel_mode::ep ? P : 1;  // EP: one on each rank
    for (int64_t T = 1; T <= k_max_tokens; ++T) {
      const moebius::kv_state tables = gpu::bench::make_tables(rt.kv(), m, sequences, T);
      std::vector<step_item> items;
      for (int64_t b = 0; b < sequences; ++b)
        items.push_back({b, std::span<const int32_t>(chunk).first(static_cast<size_t>(T)), 0, true});
      const step_layout layout{&tables, moebius::arena_cursor{m == parallel_mode::tp ? layers : 0}};
      rt.step(layout, items);
    }
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// The wall clock in mode `m` of a step that prefills one chunk of T tokens alone: sequence 0's
// first chunk (positions 0 .. T-1: its attention over the chunk's own tokens, the smallest
// context a chunk has), on rank 0 in EP (the others idle: the prefill table's key is the
// busiest rank's tokens), on every rank in TP. The runtime runs it eagerly (graphs are captured
// for decode steps only), as the serving loop's prefill steps.
double measure_prefill_ms(gpu::gpu_runtime& rt, parallel_mode m, int64_t T, int64_t vocab,
                          int64_t layers, double* device_ms, double* first_ms) {
  const moebius::kv_state tables = gpu::bench::make_tables(rt.kv(), m, 1, T);
  std::vector<int32_t> tokens(static_cast<size_t>(T));
  for (int64_t i = 0; i < T; ++i)
    tokens[static_cast<size_t>(i)] = static_cast<int32_t>((i * 7919 + 17) % vocab);
  const step_item items[] = {{0, tokens, 0, true}};
  const step_layout layout{&tables, moebius::arena_cursor{m == parallel_mode::tp ? layers : 0}};
  return median_step_ms(rt, layout, items, device_ms, 7, first_ms);
}

// The wall clock in mode `m` of a step that decodes `b` sequences at context C on every rank (EP:
// P x b sequences, round-robin over the ranks; TP: b, every rank running them) and prefills
// `chunks` beside them, each one more sequence's chunk at its start, on rank 0 in EP (the
// mixed-step table's key: the chunk's rank's own decode batch and chunk), on every rank in TP.
// Eager, as every step that prefills. The median of 5 after 2 warm-ups.
double measure_mixed_ms(gpu::gpu_runtime& rt, parallel_mode m, int64_t b, int64_t C,
                        std::span<const chunk_spec> chunks, int64_t vocab, int64_t layers,
                        double* device_ms) {
  const moebius::kv_geometry& g = rt.kv();
  const int P = static_cast<int>(g.num_ranks);
  const int64_t decodes = m == parallel_mode::ep ? b * P : b;
  gpu::bench::table_builder builder(g);  // EP: each on its owner; TP: on every rank
  const auto add = [&](int64_t id, int64_t tokens, int owner) {
    builder.add(id, tokens, m == parallel_mode::ep ? owner : -1);
  };
  for (int64_t i = 0; i < decodes; ++i) add(i, C + 1, static_cast<int>(i % P));
  for (size_t k = 0; k < chunks.size(); ++k)
    add(decodes + static_cast<int64_t>(k), chunks[k].start + chunks[k].tokens, 0);
  const moebius::kv_state tables = builder.build(m);
  std::vector<int32_t> decode_tokens;
  std::vector<step_item> items = gpu::bench::decode_items(decodes, C, vocab, decode_tokens);
  int64_t longest = 0;
  for (const chunk_spec& x : chunks) longest = std::max(longest, x.tokens);
  std::vector<int32_t> chunk(static_cast<size_t>(longest));
  for (int64_t i = 0; i < longest; ++i)
    chunk[static_cast<size_t>(i)] = static_cast<int32_t>((i * 7919 + 17) % vocab);
  for (size_t k = 0; k < chunks.size(); ++k) {
    items.push_back({decodes + static_cast<int64_t>(k),
                     std::span<const int32_t>(chunk).first(static_cast<size_t>(chunks[k].tokens)),
                     chunks[k].start, true});
  }
  const step_layout layout{&tables, moebius::arena_cursor{m == parallel_mode::tp ? layers : 0}};
  return median_step_ms(rt, layout, items, device_ms, 5);
}

// The mixed-step grid per mode (at P = 1 EP's stands for TP's, as the curves'), with its points
// printed and added to `out`. Each row's chunks cut to the rank's budget beside its batch
// (k_max_tokens - b); a cut chunk no larger than the row's previous one is left out.
mixed_step_table measure_mixed_grid(gpu::gpu_runtime& rt, int P, int64_t vocab, int64_t layers,
                                    nlohmann::json& out) {
  std::vector<mixed_step_grid> grids;
  for (const parallel_mode m : {parallel_mode::ep, parallel_mode::tp}) {
    if (P == 1 && m == parallel_mode::tp) break;
    mixed_step_grid grid{m, {}};
    for (const int64_t b : k_mixed_batches) {
      const int64_t in_deployment = m == parallel_mode::ep ? b * P : b;
      if (in_deployment > k_max_running || b >= k_max_tokens) continue;
      mixed_step_row row{b, {}, {}};
      for (const int64_t t : k_mixed_chunks) {
        const int64_t chunk = std::min(t, k_max_tokens - b);
        if (chunk < 1 || (!row.chunk_tokens.empty() && chunk <= row.chunk_tokens.back())) continue;
        double device_ms = 0;
        const chunk_spec one[] = {{chunk, 0}};
        const double ms = measure_mixed_ms(rt, m, b, k_mixed_context, one, vocab, layers,
                                           &device_ms);
        std::printf("  mixed %s: decode batch %3lld (a rank's) beside a chunk of %3lld tokens: "
                    "%8.3f ms (device %8.3f ms)\n",
                    moebius::to_string(m), static_cast<long long>(b),
                    static_cast<long long>(chunk), ms, device_ms);
        std::fflush(stdout);
        row.chunk_tokens.push_back(chunk);
        row.step_ms.push_back(ms);
        out.push_back({{"mode", moebius::to_string(m)}, {"decode_batch", b},
                       {"chunk_tokens", chunk}, {"step_ms", ms}, {"device_ms", device_ms}});
      }
      if (!row.chunk_tokens.empty()) grid.rows.push_back(std::move(row));
    }
    grids.push_back(grid);
    if (P == 1) {
      grid.mode = parallel_mode::tp;
      grids.push_back(std::move(grid));
    }
  }
  return mixed_step_table(std::move(grids), k_mixed_context,
                          "the GPU runtime's mixed steps (measured here)");
}

// What a served step that prefills carries and the grid's key (decode batch, chunk tokens) does
// not: the same decode batch and prefill tokens as a grid point, laid out as served steps lay
// them out: one chunk that is a prompt's tail (its attention over `start` earlier tokens), and
// the tokens split over several prompts' chunks. EP, a rank's own batch. Printed and added to
// `out`; a diagnostic of the small prefills' pricing, used by no clock.
void measure_mixed_probes(gpu::gpu_runtime& rt, int64_t vocab, int64_t layers,
                          nlohmann::json& out) {
  struct probe {
    int64_t b;
    std::vector<chunk_spec> chunks;
  };
  const std::vector<probe> probes = {
      {16, {{64, 0}}},  {16, {{64, 448}}},  {16, {{64, 1984}}}, {16, {{32, 0}, {32, 0}}},
      {16, {{16, 0}, {16, 0}, {16, 0}, {16, 0}}},               {64, {{256, 0}}},
      {64, {{256, 768}}}, {64, {{64, 0}, {64, 0}, {64, 0}, {64, 0}}}};
  for (const probe& x : probes) {
    double device_ms = 0;
    const double ms = measure_mixed_ms(rt, parallel_mode::ep, x.b, k_mixed_context, x.chunks,
                                       vocab, layers, &device_ms);
    nlohmann::json chunks = nlohmann::json::array();
    std::string shown;
    for (const chunk_spec& c : x.chunks) {
      chunks.push_back({{"tokens", c.tokens}, {"start", c.start}});
      shown.append(" ").append(std::to_string(c.tokens)).append("@").append(
          std::to_string(c.start));
    }
    std::printf("  probe EP: decode batch %3lld beside chunks (tokens@start)%s: %8.3f ms "
                "(device %8.3f ms)\n",
                static_cast<long long>(x.b), shown.c_str(), ms, device_ms);
    out.push_back({{"mode", "EP"}, {"decode_batch", x.b}, {"chunks", chunks}, {"step_ms", ms},
                   {"device_ms", device_ms}});
  }
}

}  // namespace mini_engine::fidelity
