// One rank of a P-rank deployment at full size on one GPU: the per-rank decode-step curves of
// TP and EP at the paper's scale (Qwen3-235B-A22B at P = 8; Qwen3-30B-A3B at P = 2 and 4),
// compute measured with the runtime's real kernels, collectives priced by a link model.
//
// What it runs. A P = 1 gpu_runtime whose model is the rank's share of the deployment:
//   TP rank   all E experts with I/P of each one's intermediate, Hq/P query heads and
//             max(1, Hkv/P) KV heads (a replicated head when Hkv < P, as TP runs it), the LM
//             head's V/P vocabulary slice; every one of the B sequences, each with its KV for
//             the rank's heads;
//   EP rank   E/P whole experts, the whole attention (data-parallel attention), the whole LM
//             head; its own ceil(B/P) sequences with all their KV heads. Each of its tokens is
//             routed to top-k' of its E/P experts, k' = min(E/P, round(k x skew)): the expert
//             pairs a rank computes are then ceil(B/P) k', the average rank's ceil(B/P) k under
//             uniform routing at skew 1, and the busiest rank's under a skewed router at skew > 1
//             (MOEBIUS_BENCH_SKEW, e.g. 1.25).
// What it does not run: the collectives. They are priced per layer by a link model,
//   latency + bytes / rate per collective:
//   TP  two all-reduces of T x H bf16 activations (ring: 2(P-1)/P of the bytes), T = B;
//   EP  a dispatch and a combine all-to-all of its tokens' pairs ((P-1)/P of ceil(B/P) k' x H
//       bf16 rows), the LM head needs none.
//   Rates: NVLink 389 GB/s per GPU per direction (the copy-engine ceiling measured on 2x H200
//   here, DESIGN.md §6) for all-reduce, NCCL all-to-all 332 GB/s (measured here at 1 GiB, 2x
//   H200; smaller messages are slower: 142 GB/s at 16 MiB); latency 10 us per collective
//   (h200_params::collective_us: assumed, not measured on 8 GPUs here). Both columns are
//   written: compute_ms (measured) and comm_priced_ms (priced), and their sum step_ms.
// So the emulation is exact for a rank's own kernels and shapes (weights, KV, attention over
// its heads or sequences, expert GEMMs over its pairs), and approximate where routing decides
// which of a rank's experts a token picks (a rank's local router over E/P experts instead of
// the global one over E), and wherever the collectives' real cost departs from the link model.
//
// Output: one JSON line per (mode, context, batch) in MOEBIUS_BENCH_SUMMARY, then per context
// the crossover (the smallest batch from which EP's step is shorter than TP's).
//
// Environment: MOEBIUS_BENCH_MODEL (qwen3_235b | qwen3_30b), MOEBIUS_BENCH_P (8),
// MOEBIUS_BENCH_MODES (tp,ep: a runtime each, one after the other), MOEBIUS_BENCH_BATCHES
// (1,2,4,...,1024: the deployment's batch B), MOEBIUS_BENCH_CONTEXTS (512,2048,8192),
// MOEBIUS_BENCH_SKEW (1), MOEBIUS_BENCH_LAYERS (the model's: fewer for a quick run; every
// figure then covers only those layers), MOEBIUS_BENCH_STEPS (10 timed steps per point),
// MOEBIUS_BENCH_SUMMARY. Combinations whose KV does not fit beside the weights are skipped.
// MINI_ENGINE_PROFILE=1 runs every step eagerly with the stage profile (profiler.hpp): each
// point then also prints, and writes as "stages_ms", its last step's time per stage.

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <moebius/cuda/check.hpp>

#include "bench_decode_batch.hpp"
#include "rank_share.hpp"
#include "gpu_runtime.hpp"

using namespace mini_engine;
using namespace mini_engine::gpu;
using mini_engine::gpu::bench::env_int;
using moebius::parallel_mode;

namespace {

struct point {
  double compute_ms = 0, comm_ms = 0;
};

// The runtime's stage profile of its last step as a JSON object of milliseconds ("" when it
// does not profile: MINI_ENGINE_PROFILE unset).
std::string stage_json(const gpu_runtime& rt) {
  std::string out;
  for (const auto& [name, seconds] : rt.stage_times()) {
    char field[96];
    std::snprintf(field, sizeof field, "%s\"%s\": %.4f", out.empty() ? "{" : ", ", name.c_str(),
                  seconds * 1e3);
    out += field;
  }
  return out.empty() ? out : out + "}";
}

}  // namespace

int main() {
  if (!bench::prepare_gpu_bench()) return 0;
  const std::string model_name =
      std::getenv("MOEBIUS_BENCH_MODEL") ? std::getenv("MOEBIUS_BENCH_MODEL") : "qwen3_235b";
  model_config full;
  if (model_name == "qwen3_235b") {
    full = qwen3_235b_a22b();
  } else if (model_name == "qwen3_30b") {
    full = qwen3_30b_a3b();
  } else {
    std::printf("MOEBIUS_BENCH_MODEL=%s: expected qwen3_235b or qwen3_30b\n", model_name.c_str());
    return 1;
  }
  full.num_layers = env_int("MOEBIUS_BENCH_LAYERS", full.num_layers);
  const int P = static_cast<int>(env_int("MOEBIUS_BENCH_P", 8));
  const double skew = bench::env_list("MOEBIUS_BENCH_SKEW", {1.0}).front();
  const int64_t timed = std::max<int64_t>(1, env_int("MOEBIUS_BENCH_STEPS", 10));
  std::vector<int64_t> batches, contexts;
  for (double b : bench::env_list("MOEBIUS_BENCH_BATCHES", {1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024}))
    batches.push_back(static_cast<int64_t>(b));
  for (double x : bench::env_list("MOEBIUS_BENCH_CONTEXTS", {512, 2048, 8192}))
    contexts.push_back(static_cast<int64_t>(x));
  std::vector<parallel_mode> modes;
  {
    const char* v = std::getenv("MOEBIUS_BENCH_MODES");
    const std::string s = v ? v : "tp,ep";
    if (s.find("tp") != std::string::npos) modes.push_back(parallel_mode::tp);
    if (s.find("ep") != std::string::npos) modes.push_back(parallel_mode::ep);
  }
  if (full.num_q_heads % P != 0 || full.num_experts % P != 0 || full.intermediate % P != 0) {
    std::printf("P=%d does not split %s (Hq %lld, E %lld, I %lld)\n", P, model_name.c_str(),
                static_cast<long long>(full.num_q_heads), static_cast<long long>(full.num_experts),
                static_cast<long long>(full.intermediate));
    return 1;
  }
  std::FILE* json = nullptr;
  if (const char* path = std::getenv("MOEBIUS_BENCH_SUMMARY"); path != nullptr && *path != '\0')
    json = std::fopen(path, "w");
  const link_model link;
  std::map<std::pair<int64_t, int64_t>, std::map<int, point>> results;  // (context, B) -> mode
  for (const parallel_mode m : modes) {
    const model_config c = rank_share_of(full, m, P, skew);
    std::vector<int64_t> buckets;
    for (const int64_t B : batches) buckets.push_back(rank_batch(m, B, P));
    std::sort(buckets.begin(), buckets.end());
    buckets.erase(std::unique(buckets.begin(), buckets.end()), buckets.end());
    const int64_t max_context = *std::max_element(contexts.begin(), contexts.end());
    gpu_runtime_options o = bench::decode_options(c, 1, buckets, max_context + 1);
    o.hybrid_graphs = false;  // pure decode steps only
    // The KV pool: what the free memory holds beside the weights (estimated before building,
    // with 12 GiB left for graphs, workspaces and activations).
    size_t free_b = 0, total_b = 0;
    MOEBIUS_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
    const double wb = 2;  // bf16
    const double experts = static_cast<double>(c.num_layers * c.num_experts) * 3.0 *
                           static_cast<double>(c.hidden * c.intermediate) * wb;
    const double attention = static_cast<double>(c.num_layers) *
                             static_cast<double>((c.num_q_heads * 2 + c.num_kv_heads * 2) *
                                                 c.head_dim * c.hidden) * wb;
    const double head = 2.0 * static_cast<double>(c.vocab * c.hidden) * wb;
    const double page_bytes = static_cast<double>(c.num_layers * 2 * c.num_kv_heads *
                                                  c.head_dim * c.page_size) * wb;
    const double spare = static_cast<double>(free_b) - experts - attention - head -
                         12.0 * double(int64_t{1} << 30);
    o.num_ep_pages = std::max<int64_t>(1, static_cast<int64_t>(spare / page_bytes));
    std::printf("%s P=%d %s rank: E %lld top-%lld I %lld, Hq %lld Hkv %lld, V %lld; weights "
                "%.1f GB, KV pool %lld pages (%.1f GB)\n",
                model_name.c_str(), P, moebius::to_string(m),
                static_cast<long long>(c.num_experts), static_cast<long long>(c.top_k),
                static_cast<long long>(c.intermediate), static_cast<long long>(c.num_q_heads),
                static_cast<long long>(c.num_kv_heads), static_cast<long long>(c.vocab),
                (experts + attention + head) / 1e9, static_cast<long long>(o.num_ep_pages),
                static_cast<double>(o.num_ep_pages) * page_bytes / 1e9);
    std::unique_ptr<gpu_runtime> rt;
    try {
      rt = std::make_unique<gpu_runtime>(c, uint64_t{12345}, o);
      rt->fill_kv_random(777);
    } catch (const std::exception& e) {
      std::printf("  could not build the runtime: %s\n", e.what());
      continue;
    }
    for (const int64_t context : contexts) {
      for (const int64_t B : batches) {
        const int64_t b = rank_batch(m, B, P);
        const int64_t pages = b * moebius::pages_for_tokens(context + 1, c.page_size);
        if (pages > o.num_ep_pages) {
          std::printf("  ctx %lld B %lld: %lld sequences' KV does not fit; skipped\n",
                      static_cast<long long>(context), static_cast<long long>(B),
                      static_cast<long long>(b));
          continue;
        }
        const moebius::kv_state tables =
            bench::make_tables(rt->kv(), parallel_mode::ep, b, context + 1);
        std::vector<int32_t> tokens;
        const std::vector<step_item> items = bench::decode_items(b, context, c.vocab, tokens);
        const step_layout layout{&tables, moebius::arena_cursor{0}};
        for (int i = 0; i < 3; ++i) rt->step(layout, items);  // warm-up
        std::vector<double> ms;
        for (int64_t i = 0; i < timed; ++i) {
          rt->step(layout, items);
          ms.push_back(rt->measured_step_s() * 1e3);
        }
        std::sort(ms.begin(), ms.end());
        point p;
        p.compute_ms = ms[ms.size() / 2];
        p.comm_ms = priced_collectives_s(full, m, P, B, c.top_k, link) * 1e3;
        results[{context, B}][static_cast<int>(m)] = p;
        std::printf("  ctx %5lld B %5lld (%lld on the rank): compute %.3f ms (measured) + "
                    "collectives %.3f ms (priced) = %.3f ms\n",
                    static_cast<long long>(context), static_cast<long long>(B),
                    static_cast<long long>(b), p.compute_ms, p.comm_ms, p.compute_ms + p.comm_ms);
        // MINI_ENGINE_PROFILE=1: the last timed step by stage (eager, no graphs: its compute
        // figure is the eager step's), each stage summed over the layers.
        const std::string stages = stage_json(*rt);
        if (!stages.empty()) std::printf("    stages (ms, last step, eager): %s\n", stages.c_str());
        if (json != nullptr) {
          std::fprintf(json,
                       "{\"model\": \"%s\", \"P\": %d, \"mode\": \"%s\", \"skew\": %.3f, "
                       "\"layers\": %lld, \"context\": %lld, \"batch\": %lld, \"rank_batch\": "
                       "%lld, \"compute_ms\": %.4f, \"comm_priced_ms\": %.4f, \"step_ms\": %.4f, "
                       "\"graph_replays\": %lld%s%s}\n",
                       model_name.c_str(), P, moebius::to_string(m), skew,
                       static_cast<long long>(c.num_layers), static_cast<long long>(context),
                       static_cast<long long>(B), static_cast<long long>(b), p.compute_ms,
                       p.comm_ms, p.compute_ms + p.comm_ms,
                       static_cast<long long>(rt->graph_replays()),
                       stages.empty() ? "" : ", \"stages_ms\": ", stages.c_str());
          std::fflush(json);
        }
      }
    }
  }
  // The crossover per context: the smallest batch from which EP stays faster, walking down
  // from the largest batch measured in both modes (larger ones may not fit in one mode's KV).
  for (const int64_t context : contexts) {
    int64_t cross = -1;
    bool started = false;
    for (auto it = batches.rbegin(); it != batches.rend(); ++it) {
      const auto r = results.find({context, *it});
      const bool both = r != results.end() && r->second.size() == 2;
      if (!both && !started) continue;
      started = true;
      if (!both) break;
      const point& tp = r->second[static_cast<int>(parallel_mode::tp)];
      const point& ep = r->second[static_cast<int>(parallel_mode::ep)];
      if (ep.compute_ms + ep.comm_ms >= tp.compute_ms + tp.comm_ms) break;
      cross = *it;
    }
    if (cross > 0)
      std::printf("crossover at context %lld: EP faster from batch %lld on (paper: 128-256)\n",
                  static_cast<long long>(context), static_cast<long long>(cross));
    else
      std::printf("crossover at context %lld: none among the batches measured in both modes\n",
                  static_cast<long long>(context));
  }
  if (json != nullptr) std::fclose(json);
  return 0;
}
