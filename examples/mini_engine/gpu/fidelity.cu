// How far the simulated runtime is from a run it simulates, per metric (DESIGN.md §8): on one
// GPU, the GPU runtime at P = 1, or P = 2 virtual ranks (Qwen3-30B-A3B layer shapes with
// MOEBIUS_FIDELITY_LAYERS layers, default 8; bf16 dense, experts and KV; random weights drawn on
// the device)
//   1. measures its own decode-step curves per mode: the wall clock of a step as the serving
//      loop waits for it (inputs, upload, graph replay, tokens back), the median of 7 after 2
//      warm-ups, at batches 1..512 and contexts 128, 512, 2048; and its prefill points per
//      mode: the same wall clock of a step that prefills one chunk of 16, 32, ..., 512 tokens
//      alone (one sequence, its first chunk; run eagerly, as every step that prefills);
//   2. warms up (one eager step at every row count 1..512 per mode, as an engine does at start;
//      MOEBIUS_FIDELITY_WARM=0 skips it), then serves a bursty trace on the measured clock
//      (every step timed); at P = 2 with a
//      stop-the-world switch forced every 400 steps (the virtual ranks' copies over the GPU's
//      own memory, each switch timed);
//   2b. then measures its mixed steps per mode: the same wall clock of a step that decodes b
//      sequences (a rank's own in EP; b = 0, 1, 4, 16, 64, 128, 256, up to 256 sequences in
//      the deployment) at context 128 beside one chunk of 16, 64, 256 or 512 tokens (cut to the
//      rank's 512-token budget left beside b), the median of 5 after 2 warm-ups; should it fail,
//      the pricing that needs it is left out and the rest is printed; and a few probes beside
//      it (mixed_probes in the JSON, used by no clock): a grid point's tokens as a prompt's
//      tail (after earlier tokens) and split over several prompts' chunks;
//   3. the simulated runtime serves the same trace with the same scheduler, pool and forced
//      switches, each switch priced by the cost model over the link measured on 2x H200
//      (h200_params) and each step by the curves of 1 (curves_step_clock), priced four ways:
//        "sim": as the paper-scale experiments price theirs by default: a decode step at its
//          own batch (interpolated between the measured batches), a prefill chunk as the
//          curve's extra rows at its smallest context;
//        "sim_buckets_prefill": a decode step at the runtime's CUDA-graph bucket (the batch
//          padded to it, as the replayed graph runs it), a prefill step's increment from the
//          prefill points measured alone;
//        "sim_buckets_mixed": at the buckets, a step that prefills priced whole from the
//          mixed-step grid (mixed_step_table.hpp);
//        "sim_rescaled": as "sim" with each kind of step (decode; prefill) times the measured
//          run's own steps' measured / priced by it: what remains once the step prices are
//          right on average;
//      and at P = 2 once more, "sim_switch_times": priced as "sim" with its switches forced at
//      the serving times the measured run switched at instead of the same step indices (the
//      simulated run takes other steps, so the same indices fall at other times and a burst
//      may be served in the other mode): what the switches' phase alone moves.
// Printed and written to $OUT/fidelity.json (or ./fidelity.json): each metric of the runs and
// each simulation's error (errors.<key>; error and error_buckets_prefill as before), separately:
// mean and p99 TTFT, mean and p99 TPOT, throughput, the run's length, and at P = 2 the
// switches' total time; and the measured run's own steps priced by each clock (priced /
// measured, by kind of step: decode, prefill filling the step's token budget, smaller prefill;
// at P = 2 also per mode, the EP steps by their recorded split over the ranks). What this does
// not check: collectives over NVLink (virtual ranks share one GPU's memory), and the paper's
// model and P.
// Environment: MOEBIUS_FIDELITY_LAYERS (8), MOEBIUS_FIDELITY_SEED (1: the trace),
// MOEBIUS_FIDELITY_P (1 or 2), MOEBIUS_FIDELITY_WARM (1: before the measured run, one eager
// step at every row count a step can have, as an engine warms up at start; 0: the run meets
// each row count cold, as every run before the warm-up was added did).

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <tuple>
#include <vector>

#include <nlohmann/json.hpp>

#include <moebius/transport/cuda_peer_transport.hpp>
#include <moebius/transport/dry_run_transport.hpp>

#include "bench_decode_batch.hpp"
#include "engine.hpp"
#include "gpu_runtime.hpp"
#include "run_report.hpp"
#include "sim_runtime.hpp"
#include "step_curves.hpp"
#include "trace.hpp"

using namespace mini_engine;
using moebius::parallel_mode;

namespace {

constexpr int64_t k_max_tokens = 512;     // tokens a step (decode and prefill chunks)
constexpr int64_t k_max_running = 256;    // sequences at once
constexpr int64_t k_page_size = 16;       // the runtime's (kv geometry)
constexpr int64_t k_longest = 2560;       // tokens of the longest request (prompt + output)
// The prefill points' chunks (tokens): up to the step's budget.
constexpr int64_t k_prefill_chunks[] = {16, 32, 64, 128, 256, 512};
// The mixed-step grid (mixed_step_table.hpp): decode batches beside the chunk (a rank's own in
// EP; those above k_max_running sequences in the deployment are left out: the trace never runs
// them) by chunk tokens (each cut to the rank's token budget left beside the batch); the decode
// sequences at the curves' smallest context.
constexpr int64_t k_mixed_batches[] = {0, 1, 4, 16, 64, 128, 256};
constexpr int64_t k_mixed_chunks[] = {16, 64, 256, 512};
constexpr int64_t k_mixed_context = 128;

// The wall clock of a step as the serving loop waits for it (runtime::step: inputs, upload,
// graph replay or eager launches, tokens back), the median of 7 after 2 warm-ups; `device_ms`
// (when given) the median of the runtime's own device time of the same steps (CUDA events, what
// the measured clock charges); `first_ms` (when given) the wall clock of the first warm-up.
double median_step_ms(gpu::gpu_runtime& rt, const step_layout& layout,
                      std::span<const step_item> items, double* device_ms = nullptr,
                      int runs = 7, double* first_ms = nullptr) {
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
                          int64_t layers, double* device_ms, double* first_ms = nullptr) {
  const moebius::kv_state tables = gpu::bench::make_tables(rt.kv(), m, 1, T);
  std::vector<int32_t> tokens(static_cast<size_t>(T));
  for (int64_t i = 0; i < T; ++i)
    tokens[static_cast<size_t>(i)] = static_cast<int32_t>((i * 7919 + 17) % vocab);
  const step_item items[] = {{0, tokens, 0, true}};
  const step_layout layout{&tables, moebius::arena_cursor{m == parallel_mode::tp ? layers : 0}};
  return median_step_ms(rt, layout, items, device_ms, 7, first_ms);
}

// A prefill chunk of a mixed step: `tokens` new tokens after `start` already cached.
struct chunk_spec {
  int64_t tokens = 0, start = 0;
};

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
  std::vector<std::vector<moebius::kv_sequence>> per_rank(static_cast<size_t>(P));
  std::vector<int64_t> next_page(static_cast<size_t>(P), 0);
  // Sequence `id` of `tokens` tokens on rank `owner` (EP) or every rank (TP).
  const auto add = [&](int64_t id, int64_t tokens, int owner) {
    const int64_t pages = moebius::pages_for_tokens(tokens, g.page_size);
    for (int r = 0; r < P; ++r) {
      if (m == parallel_mode::ep && r != owner) continue;
      moebius::kv_sequence s;
      s.seq_id = id;
      s.num_tokens = tokens;
      s.last_page_len = tokens - (pages - 1) * g.page_size;
      for (int64_t p = 0; p < pages; ++p) s.pages.push_back(next_page[static_cast<size_t>(r)]++);
      per_rank[static_cast<size_t>(r)].push_back(std::move(s));
    }
  };
  for (int64_t i = 0; i < decodes; ++i) add(i, C + 1, static_cast<int>(i % P));
  for (size_t k = 0; k < chunks.size(); ++k)
    add(decodes + static_cast<int64_t>(k), chunks[k].start + chunks[k].tokens, 0);
  const moebius::kv_state tables = moebius::make_kv_state(g, m, std::move(per_rank));
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

// A bursty trace the P = 1 runtime crosses its batch range on: quiet at 4 requests/s, bursts of
// 1 s at 150/s, prompts 32-1024 and outputs 16-512 tokens (within k_longest).
std::vector<request> fidelity_trace(uint64_t seed, int64_t vocab) {
  bursty_options t;
  t.duration_s = 24;
  t.quiet_s = 5;
  t.quiet_rate = 4;
  t.burst_s = 1;
  t.burst_rate = 150;
  t.prompt_min = 32;
  t.prompt_max = 1024;
  t.output_min = 16;
  t.output_max = 512;
  t.vocab = static_cast<int32_t>(std::min<int64_t>(vocab, 1 << 20));
  return bursty_trace(seed, t);
}

nlohmann::json metrics(const run_summary& s, const run_result& r) {
  return {{"mean_ttft_ms", s.mean_ttft_ms}, {"p99_ttft_ms", s.p99_ttft_ms},
          {"mean_tpot_ms", s.mean_tpot_ms}, {"p99_tpot_ms", s.p99_tpot_ms},
          {"tokens_per_s", s.tokens_per_s}, {"end_s", r.end_s},
          {"steps", static_cast<int64_t>(r.steps.size())}, {"preemptions", r.preemptions},
          {"switches", s.switches}, {"switch_total_ms", s.switch_total_ms}};
}

// The measured run's own steps priced by `clock`, summed per kind (decode; prefill filling the
// step's token budget; smaller prefill): steps, measured ms, priced ms and their ratio. An EP
// step at P > 1 is priced by its recorded split over the ranks (step_record::ranks), as the
// clock was given it; one without a split is skipped (counted).
nlohmann::json price_own_steps(const run_result& r, const step_clock& clock, int P) {
  struct sums {
    int64_t steps = 0;
    double measured_ms = 0, priced_ms = 0;
  };
  sums decode, full, small;
  sums by_mode[2][3];  // [EP, TP][decode, full, small]
  int64_t skipped = 0;
  for (const step_record& s : r.steps) {
    if (s.sequences <= 0 || s.in_switch) continue;
    step_cost cost;
    cost.set(s.config);
    cost.num_ranks = P;
    cost.num_sequences = s.sequences;
    cost.new_tokens = s.decode_tokens + s.prefill_tokens;
    cost.context_tokens = s.context_tokens;
    if (cost.mode == parallel_mode::ep) {
      if (P > 1 && static_cast<int>(s.ranks.size()) != P) {
        ++skipped;  // no split recorded (a step of a progressive switch): not priced
        continue;
      }
      cost.ranks = P > 1 ? s.ranks
                         : std::vector<rank_work>{
                               rank_work{cost.num_sequences, cost.new_tokens, cost.context_tokens}};
    }
    const int kind = s.prefill_tokens == 0 ? 0 : cost.new_tokens >= k_max_tokens ? 1 : 2;
    sums& to = kind == 0 ? decode : kind == 1 ? full : small;
    sums& in_mode = by_mode[cost.mode == parallel_mode::ep ? 0 : 1][kind];
    const double priced_ms = clock.step_s(cost, s.measured_ms * 1e-3) * 1e3;
    for (sums* x : {&to, &in_mode}) {
      ++x->steps;
      x->measured_ms += s.measured_ms;
      x->priced_ms += priced_ms;
    }
  }
  const auto out = [](const sums& x) {
    return nlohmann::json{{"steps", x.steps},
                          {"measured_ms", x.measured_ms},
                          {"priced_ms", x.priced_ms},
                          {"ratio", x.measured_ms > 0 ? x.priced_ms / x.measured_ms : 0.0}};
  };
  nlohmann::json modes;
  for (int mi = 0; mi < 2; ++mi) {
    modes[mi == 0 ? "EP" : "TP"] = {{"decode", out(by_mode[mi][0])},
                                    {"prefill_full", out(by_mode[mi][1])},
                                    {"prefill_small", out(by_mode[mi][2])}};
  }
  return {{"decode", out(decode)}, {"prefill_full", out(full)}, {"prefill_small", out(small)},
          {"by_mode", modes}, {"skipped", skipped}};
}

// A clock whose steps are `base`'s times a factor per kind (decode; a step that prefills):
// `base` with the error of its step prices taken out, each kind at the measured run's own steps'
// measured / priced. A diagnostic: what the step prices alone move in each metric (TTFT is
// queueing: a burst's queue grows by arrivals less service, so a few percent on the service
// moves it by more).
class rescaled_clock final : public step_clock {
 public:
  rescaled_clock(const step_clock& base, double decode_factor, double prefill_factor)
      : base_(base), decode_(decode_factor), prefill_(prefill_factor) {}
  double step_s(const step_cost& cost, double measured_s) const override {
    const bool prefills = cost.new_tokens > cost.num_sequences;  // a decode item is one token
    return base_.step_s(cost, measured_s) * (prefills ? prefill_ : decode_);
  }
  double switch_s(const moebius::switch_report& r) const override { return base_.switch_s(r); }
  const char* name() const override { return "as before, each kind of step rescaled"; }
  bool needs_measurement() const override { return base_.needs_measurement(); }
  int64_t layer_bytes(const moebius::layer_bytes& run, int64_t layers) const override {
    return base_.layer_bytes(run, layers);
  }
  moebius::link_rate link() const override { return base_.link(); }
  double copies_s(const switch_copies& c) const override { return base_.copies_s(c); }
  double predicted_switch_s(const moebius::layer_bytes& run, int64_t layers) const override {
    return base_.predicted_switch_s(run, layers);
  }
  double predicted_kv_switch_s(const moebius::layer_bytes& run, int64_t layers) const override {
    return base_.predicted_kv_switch_s(run, layers);
  }
  overlap_slowdown slowdown() const override { return base_.slowdown(); }

 private:
  const step_clock& base_;
  double decode_, prefill_;
};

// measured / priced of the measured run's own steps by `clock`: {decode, steps that prefill}.
std::pair<double, double> own_step_factors(const run_result& r, const step_clock& clock, int P) {
  const nlohmann::json x = price_own_steps(r, clock, P);
  const auto factor = [&](std::initializer_list<const char*> kinds) {
    double measured = 0, priced = 0;
    for (const char* k : kinds) {
      measured += x[k]["measured_ms"].get<double>();
      priced += x[k]["priced_ms"].get<double>();
    }
    return priced > 0 ? measured / priced : 1.0;
  };
  return {factor({"decode"}), factor({"prefill_full", "prefill_small"})};
}

}  // namespace

int main() {
  moebius::request_hardware_queues_for_virtual_ranks();  // before the first CUDA call
  if (!gpu::bench::prepare_gpu_bench()) return 0;
  model_config c = qwen3_30b_a3b();
  c.num_layers = gpu::bench::env_int("MOEBIUS_FIDELITY_LAYERS", 8);
  const uint64_t seed = static_cast<uint64_t>(gpu::bench::env_int("MOEBIUS_FIDELITY_SEED", 1));
  const int64_t P_env = gpu::bench::env_int("MOEBIUS_FIDELITY_P", 1);
  if (P_env != 1 && P_env != 2) {
    std::printf("MOEBIUS_FIDELITY_P=%s: 1 or 2\n", std::getenv("MOEBIUS_FIDELITY_P"));
    return 2;
  }
  const int P = static_cast<int>(P_env);
  const int64_t model_layers = qwen3_30b_a3b().num_layers;
  if (c.num_layers < 1 || c.num_layers > model_layers) {
    std::printf("MOEBIUS_FIDELITY_LAYERS=%s: 1 to %lld (the model's layers)\n",
                std::getenv("MOEBIUS_FIDELITY_LAYERS"), static_cast<long long>(model_layers));
    return 2;
  }
  if (gpu::bench::env_int("MOEBIUS_FIDELITY_SEED", 1) < 0) {
    std::printf("MOEBIUS_FIDELITY_SEED=%s: a number >= 0\n", std::getenv("MOEBIUS_FIDELITY_SEED"));
    return 2;
  }

  gpu::gpu_runtime_options o = gpu::options_from_env();
  o.num_ranks = P;  // P = 2 on one GPU: virtual ranks
  o.dense_dtype = moebius::dtype::bf16;
  o.hybrid_graphs = false;  // stop-the-world switches only: no hybrid step
  o.max_tokens = k_max_tokens;
  o.buckets = {1, 2, 4, 8, 16, 32, 64, 128, 256, 512};
  o.max_pages_per_seq = (k_longest + k_page_size - 1) / k_page_size;
  // The curves' largest point: 512 sequences of 2,049 tokens.
  o.num_ep_pages = 512 * ((2048 + 1 + k_page_size - 1) / k_page_size);
  std::printf("fidelity: GPU runtime P=%d%s, Qwen3-30B-A3B layer shapes, %lld layers, bf16\n",
              P, P > 1 ? " (virtual ranks on one GPU)" : "", static_cast<long long>(c.num_layers));
  gpu::gpu_runtime rt(c, uint64_t{12345}, o);
  rt.fill_kv_random(777);

  // 1. The curves, per mode (at P = 1 TP runs the same kernels on the same shapes: EP's points
  // stand for both, as step_curves needs both modes).
  std::vector<step_curve_point> points;
  for (const parallel_mode m : {parallel_mode::ep, parallel_mode::tp}) {
    if (P == 1 && m == parallel_mode::tp) break;
    for (const int64_t C : {128, 512, 2048}) {
      for (int64_t B = 1; B <= 512; B *= 2) {
        const double ms = measure_step_ms(rt, m, B, C, c.vocab, c.num_layers);
        std::printf("  curve %s: context %5lld batch %4lld: %8.3f ms\n", moebius::to_string(m),
                    static_cast<long long>(C), static_cast<long long>(B), ms);
        points.push_back({m, C, B, ms});
        if (P == 1) points.push_back({parallel_mode::tp, C, B, ms});
      }
    }
  }
  step_curves curves(points, "the GPU runtime's own (measured here)");

  // 1b. The prefill points, per mode (at P = 1 EP's stand for TP's, as the curves').
  std::vector<prefill_point> prefill;
  nlohmann::json prefill_json = nlohmann::json::array();
  for (const parallel_mode m : {parallel_mode::ep, parallel_mode::tp}) {
    if (P == 1 && m == parallel_mode::tp) break;
    for (const int64_t T : k_prefill_chunks) {
      double device_ms = 0;
      const double ms = measure_prefill_ms(rt, m, T, c.vocab, c.num_layers, &device_ms);
      std::printf("  prefill %s: chunk %4lld tokens alone: %8.3f ms (device %8.3f ms)\n",
                  moebius::to_string(m), static_cast<long long>(T), ms, device_ms);
      prefill.push_back({m, T, ms});
      if (P == 1) prefill.push_back({parallel_mode::tp, T, ms});
      prefill_json.push_back({{"mode", moebius::to_string(m)}, {"tokens", T}, {"step_ms", ms},
                              {"device_ms", device_ms}});
    }
  }
  const prefill_table prefill_points(prefill, "the GPU runtime's prefill steps (measured here)");

  // 1c. A token count the eager path has not run yet: its first step against the same step
  // again (prefill chunks of counts no step above used). A diagnostic (cold_prefill in the
  // JSON), used by no clock: what a served step pays the first time it meets a shape.
  nlohmann::json cold_json = nlohmann::json::array();
  for (const int64_t T : {333, 177, 99}) {
    double device_ms = 0, first_ms = 0;
    const double ms = measure_prefill_ms(rt, parallel_mode::ep, T, c.vocab, c.num_layers,
                                         &device_ms, &first_ms);
    std::printf("  cold prefill EP: chunk %4lld tokens alone: first step %8.3f ms, then %8.3f ms "
                "(device %8.3f ms)\n",
                static_cast<long long>(T), first_ms, ms, device_ms);
    cold_json.push_back({{"tokens", T}, {"first_ms", first_ms}, {"step_ms", ms},
                         {"device_ms", device_ms}});
  }

  // 1d. The start-up warm-up (warm_eager_rows), unless MOEBIUS_FIDELITY_WARM=0.
  const bool warm = gpu::bench::env_int("MOEBIUS_FIDELITY_WARM", 1) != 0;
  if (warm) {
    const double s = warm_eager_rows(rt, P, c.vocab, c.num_layers);
    std::printf("  warm-up: one eager step at each of 1..%lld rows per mode, %.1f s\n",
                static_cast<long long>(k_max_tokens), s);
  }

  // 2. The GPU runtime serves the trace on the measured clock.
  const std::vector<request> trace = fidelity_trace(seed, c.vocab);
  engine_options eo;
  eo.record_rank_split = true;  // the measured run's steps are priced again below
  eo.scheduler.max_running = k_max_running;
  eo.scheduler.max_step_tokens = k_max_tokens;
  eo.scheduler.admission = admission_policy::known;
  eo.start_mode = parallel_mode::ep;
  if (P > 1) {
    eo.how = switching::forced;
    for (int64_t step = 400; step < 100000; step += 400) eo.forced_steps.push_back(step);
  }
  const measured_clock measured;
  run_result gpu_run;
  {
    moebius::cuda_peer_transport copies = moebius::cuda_peer_transport::single_process(rt.memory());
    engine e(rt, copies, rt.arena(), rt.kv(), measured, moebius::arena_cursor{0});
    gpu_run = e.run(trace, eo, "GPU runtime (measured)");
  }

  // 2b. The mixed-step grid, measured after the run (a failure here loses nothing above; the
  // third pricing is then left out and says why).
  nlohmann::json mixed_json = nlohmann::json::array();
  std::optional<mixed_step_table> mixed_grid;
  std::string mixed_error;
  try {
    const auto t0 = std::chrono::steady_clock::now();
    mixed_grid = measure_mixed_grid(rt, P, c.vocab, c.num_layers, mixed_json);
    std::printf("  mixed-step grid: %zu points in %.1f s\n", mixed_json.size(),
                std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  } catch (const std::exception& e) {
    mixed_error = e.what();
    std::printf("  the mixed-step grid could not be measured (%s): its pricing is left out\n",
                e.what());
  }
  nlohmann::json probes_json = nlohmann::json::array();
  try {
    measure_mixed_probes(rt, c.vocab, c.num_layers, probes_json);
  } catch (const std::exception& e) {
    std::printf("  the mixed-step probes could not be measured (%s)\n", e.what());
  }

  // 3. The simulated runtime on the same geometry, priced by the curves: as before, at the
  // runtime's graph buckets with the measured prefill points, and at the buckets with the
  // mixed-step grid (a step that prefills priced whole from it; the prefill points where it
  // has no grid).
  priced_model m;
  m.num_layers = c.num_layers;
  m.context_scale = 1;
  m.hidden = c.hidden;
  m.num_q_heads = c.num_q_heads;
  m.num_kv_heads = c.num_kv_heads;
  m.head_dim = c.head_dim;
  m.num_experts = c.num_experts;
  m.top_k = c.top_k;
  m.intermediate = c.intermediate;
  m.vocab = c.vocab;
  const h200_step_model model(m, h200_params{}, P, kv_bytes_per_token(rt.kv()));
  const curves_step_clock priced(curves, model);
  curves_clock_options with;
  with.graph_buckets = o.buckets;  // the runtime's own (gpu_runtime_options::buckets)
  with.prefill = prefill_points;
  const curves_step_clock priced_new(curves, model, with);
  std::optional<curves_step_clock> priced_mixed;
  if (mixed_grid) {
    curves_clock_options mixed = with;
    mixed.mixed = *mixed_grid;
    priced_mixed.emplace(curves, model, mixed);
  }
  const auto simulate = [&](const step_clock& clock, const char* label,
                            const engine_options& opts) {
    sim_runtime sim(rt.arena(), rt.kv(), static_cast<int32_t>(c.vocab));
    moebius::dry_run_transport dry(P, sim.spaces());
    engine s(sim, dry, rt.arena(), rt.kv(), clock, moebius::arena_cursor{0});
    return s.run(trace, opts, label);
  };
  // The pricings, each a simulated run: key in fidelity.json, what it prices, its clock.
  struct pricing {
    std::string key, what;
    const step_clock* clock = nullptr;
    run_result run;
    run_summary summary;
  };
  std::vector<pricing> wanted;
  wanted.push_back({"sim", "as before", &priced, {}, {}});
  wanted.push_back({"sim_buckets_prefill", "buckets + prefill alone", &priced_new, {}, {}});
  if (priced_mixed)
    wanted.push_back({"sim_buckets_mixed", "buckets + mixed grid", &*priced_mixed, {}, {}});
  // As before with each kind of step rescaled to the measured run's own (rescaled_clock): what
  // is left of each metric's error once the step prices are right on average.
  double decode_factor = 1, prefill_factor = 1;
  std::optional<rescaled_clock> rescaled;
  try {
    std::tie(decode_factor, prefill_factor) = own_step_factors(gpu_run, priced, P);
    rescaled.emplace(priced, decode_factor, prefill_factor);
    std::printf("  rescaled: as before x %.4f a decode step, x %.4f a step that prefills\n",
                decode_factor, prefill_factor);
    wanted.push_back({"sim_rescaled", "as before, rescaled", &*rescaled, {}, {}});
  } catch (const std::exception& e) {
    std::printf("  the rescaled pricing is left out: %s\n", e.what());
  }
  // At P = 2 once more: the forced switches at the measured run's switch times instead of its
  // step indices (the simulated run takes other steps, so the same indices fall at other times
  // and a burst may be served in the other mode), priced as before: what the phase of the
  // switches alone moves.
  engine_options at_times = eo;
  at_times.forced_steps.clear();
  for (const switch_record& x : gpu_run.switches)
    if (x.step > 0) at_times.forced_at_s.push_back(x.start_s);  // not a failed first switch
  if (P > 1 && !at_times.forced_at_s.empty())
    wanted.push_back({"sim_switch_times", "as before, switches at the measured times", &priced,
                      {}, {}});
  // Each run on its own: one that fails is left out, and says why, the others kept.
  std::vector<pricing> runs;
  nlohmann::json run_errors;
  for (pricing& x : wanted) {
    try {
      x.run = simulate(*x.clock, ("simulated (" + x.what + ")").c_str(),
                       x.key == "sim_switch_times" ? at_times : eo);
      x.summary = summarize(x.run);
      runs.push_back(std::move(x));
    } catch (const std::exception& e) {
      std::printf("  the simulated run %s (%s) failed: %s\n", x.key.c_str(), x.what.c_str(),
                  e.what());
      run_errors[x.key] = e.what();
    }
  }

  const run_summary a = summarize(gpu_run);
  nlohmann::json pricing_names, errors;
  for (const pricing& x : runs) pricing_names[x.key] = x.clock->name();
  nlohmann::json j = {{"layers", c.num_layers},
                      {"P", P},
                      {"requests", static_cast<int64_t>(trace.size())},
                      {"seed", seed},
                      {"curves", points.size() / 2},
                      {"graph_buckets", o.buckets},
                      {"prefill_points", prefill_json},
                      {"mixed_grid", mixed_json},
                      {"mixed_probes", probes_json},
                      {"cold_prefill", cold_json},
                      {"warm_eager_rows", warm},
                      {"rescaled_factors", {{"decode", decode_factor}, {"prefill", prefill_factor}}},
                      {"pricing", pricing_names},
                      {"gpu", metrics(a, gpu_run)}};
  if (!mixed_error.empty()) j["mixed_grid_error"] = mixed_error;
  if (!run_errors.is_null()) j["run_errors"] = run_errors;
  for (const pricing& x : runs) j[x.key] = metrics(x.summary, x.run);
  std::printf("\n  %d requests; metric: GPU runtime (measured), then each simulated run and its "
              "error:",
              static_cast<int>(trace.size()));
  for (const pricing& x : runs) std::printf(" %s (%s);", x.key.c_str(), x.what.c_str());
  std::printf("\n");
  for (const auto& [name, g_json] : j["gpu"].items()) {
    const double g = g_json.get<double>();
    std::printf("  %-16s %12.3f", name.c_str(), g);
    for (const pricing& x : runs) {
      const double v = j[x.key][name].get<double>();
      const double e = g != 0 ? (v - g) / g : 0;
      errors[x.key][name] = e;
      std::printf(" %12.3f %+7.1f%%", v, 100 * e);
    }
    std::printf("\n");
  }
  // The errors, each pricing's under its own key; the two first also where earlier files had
  // them.
  j["errors"] = errors;
  for (const auto& [key, name] : {std::pair<const char*, const char*>{"sim", "error"},
                                  {"sim_buckets_prefill", "error_buckets_prefill"},
                                  {"sim_buckets_mixed", "error_buckets_mixed"}}) {
    if (errors.contains(key)) j[name] = errors[key];
  }
  const char* out = std::getenv("OUT");
  const std::string dir = out != nullptr && *out != '\0' ? out : ".";
  const std::string path = dir + "/fidelity.json";
  std::ofstream csv(dir + "/fidelity_steps.csv");
  write_steps_csv(csv, gpu_run);
  for (const pricing& x : runs) {
    const std::string name = x.key == "sim" ? "/fidelity_sim_steps.csv"
                                            : "/fidelity_" + x.key + "_steps.csv";
    std::ofstream f(dir + name);
    write_steps_csv(f, x.run);
  }
  // Each committed switch: measured against priced (the same switch in each run when they
  // committed the same ones).
  const auto committed = [](const run_result& r) {
    std::vector<double> ms;
    for (const switch_record& x : r.switches)
      if (x.outcome == moebius::switch_outcome::committed) ms.push_back(x.clock_ms);
    return ms;
  };
  const std::vector<double> gpu_switch = committed(gpu_run);
  if (!gpu_switch.empty() && !runs.empty()) {
    const std::vector<double> sim_switch = committed(runs.front().run);
    std::printf("  switches committed: %zu measured;", gpu_switch.size());
    for (const pricing& x : runs) std::printf(" %zu %s;", committed(x.run).size(), x.key.c_str());
    std::printf(" ms each, measured / priced (%s):", runs.front().key.c_str());
    for (size_t i = 0; i < std::min(gpu_switch.size(), sim_switch.size()); ++i)
      std::printf(" %.1f/%.1f", gpu_switch[i], sim_switch[i]);
    std::printf("\n");
    j["switches_each"] = {{"measured_ms", gpu_switch}};
    for (const pricing& x : runs) j["switches_each"]["priced_ms_" + x.key] = committed(x.run);
  }
  std::ofstream(path) << j.dump(2) << "\n";
  // The measured run's own steps priced by each clock: where the error comes from. A
  // diagnostic: should it fail, the runs' results above are written already.
  try {
    // One per clock, whether its simulated run succeeded or not (the switch-time run shares
    // sim's clock).
    std::vector<pricing> clock_list;
    clock_list.push_back({"sim", "as before", &priced, {}, {}});
    clock_list.push_back({"sim_buckets_prefill", "buckets + prefill alone", &priced_new, {}, {}});
    if (priced_mixed)
      clock_list.push_back({"sim_buckets_mixed", "buckets + mixed grid", &*priced_mixed, {}, {}});
    std::vector<const pricing*> clocks;
    for (const pricing& x : clock_list) clocks.push_back(&x);
    for (const pricing* x : clocks) j["own_steps"][x->key] = price_own_steps(gpu_run, *x->clock, P);
    std::printf("  the measured run's own steps, priced / measured (summed):");
    for (const pricing* x : clocks) std::printf(" %s /", x->what.c_str());
    std::printf("\n");
    for (const char* kind : {"decode", "prefill_full", "prefill_small"}) {
      const nlohmann::json& x = j["own_steps"]["sim"][kind];
      std::printf("    %-14s %6lld steps, %10.1f ms measured:", kind,
                  static_cast<long long>(x["steps"].get<int64_t>()),
                  x["measured_ms"].get<double>());
      for (const pricing* p : clocks)
        std::printf(" %.3f", j["own_steps"][p->key][kind]["ratio"].get<double>());
      std::printf("\n");
    }
    if (P > 1) {
      for (const char* mode : {"EP", "TP"}) {
        for (const char* kind : {"decode", "prefill_full", "prefill_small"}) {
          const nlohmann::json& x = j["own_steps"]["sim"]["by_mode"][mode][kind];
          std::printf("    %s %-11s %6lld steps, %10.1f ms measured:", mode, kind,
                      static_cast<long long>(x["steps"].get<int64_t>()),
                      x["measured_ms"].get<double>());
          for (const pricing* p : clocks)
            std::printf(" %.3f", j["own_steps"][p->key]["by_mode"][mode][kind]["ratio"].get<double>());
          std::printf("\n");
        }
      }
    }
    if (j["own_steps"]["sim"]["skipped"].get<int64_t>() > 0)
      std::printf("    (%lld EP steps not priced: at P = %d their rank split was not recorded)\n",
                  static_cast<long long>(j["own_steps"]["sim"]["skipped"].get<int64_t>()), P);
    std::ofstream(path) << j.dump(2) << "\n";
  } catch (const std::exception& e) {
    std::printf("  the measured run's own steps could not be priced: %s\n", e.what());
  }
  std::printf("  wrote %s\n", path.c_str());
  return 0;
}
