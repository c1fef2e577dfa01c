// One rank of a P-rank deployment at full size on one GPU: the per-rank decode-step curves of
// every static layout an engine runs at the paper's scale (Qwen3-235B-A22B at P = 8; Qwen3-30B-
// A3B at P = 2 and 4), compute measured with the runtime's real kernels, collectives priced by a
// link model. The layouts (rank_share.hpp: rank_layout):
//   TP        TP attention (a KV head replicated on P/Hkv ranks when Hkv < P) + TP experts
//   TP-dcpD   TP attention with decode context parallel D (vLLM -dcp D): the D ranks sharing a
//             KV head each hold 1/D of every sequence's tokens (page-interleaved) + TP experts
//   EP        data-parallel attention + EP experts
//   TEP[-dcpD] TP attention (with dcp D) + EP experts (vLLM --enable-expert-parallel,
//             TensorRT-LLM's TEP): every rank has every token after attention, the experts'
//             dispatch is a local selection of the pairs routed to its E/P experts, the combine
//             is the all-reduce TP already does.
// (rank_layout builds on moebius::parallel_layout; its fourth, data-parallel attention over TP
// experts, is not emulated: rank_share.hpp says why.)
//
// What it runs. A P = 1 gpu_runtime whose model is the rank's share (rank_share_of):
//   TP attention   Hq/P query heads and max(1, Hkv/P) KV heads, the LM head's V/P vocabulary
//                  slice; every one of the B sequences, each with its KV for the rank's head;
//   data-parallel  the whole attention and LM head; its own ceil(B/P) sequences with all their
//                  KV heads;
//   TP experts     all E experts with I/P of each one's intermediate, every token's top-k;
//   EP experts     E/P whole experts. Each token is routed to top-k' of them:
//                  data-parallel attention: k' = min(E/P, round(k x skew)) over the rank's
//                  ceil(B/P) tokens, the average rank's ceil(B/P) k pairs under uniform routing
//                  at skew 1, the busiest rank's under a skewed router at skew > 1
//                  (MOEBIUS_BENCH_SKEW, e.g. 1.25);
//                  TP attention (TEP): k'' = min(E/P, max(1, round(k/P x skew))) over all B
//                  tokens: B k/P pairs, the uniform mean (Qwen3-235B at P = 8: top-1 of 16).
//   dcp D > 1      exactly, up to the merge (gpu_runtime_options::emulated_dcp): the q/k/v and
//                  o projections over the rank's Hq/P heads, the paged attention over the D x
//                  Hq/P q heads of its DCP set (the all-gathered q: copies of its own) and over
//                  the busiest DCP index's share of each sequence's pages (rank_tokens: 257 of
//                  513 tokens at page 16), and a conversion of all D x Hq/P partial outputs
//                  standing in for the merge kernel (which reads the same rows) before o_proj
//                  reads the rank's own.
// What it does not run: the collectives. They are priced (serving/step_collectives.hpp says which
// a decode step runs in each layout) from cited measurements on one 8-GPU NVLink node by
// default (serving/collective_table.hpp: vLLM's custom all-reduce and symmetric memory, DeepEP's
// dispatch and combine, NCCL for DCP's exchange), or with MOEBIUS_BENCH_COLLECTIVES=link by the
// link model the first curves were priced with (latency + bytes / rate per collective):
//   TP attention  two all-reduces of B x H bf16 activations (ring: 2(P-1)/P of the bytes), after
//                 o_proj and after the experts (TEP too: no dispatch); with dcp D the q
//                 all-gather ((D-1) B Hq/P D bf16 in), the LSE all-gather ((D-1) B D Hq/P fp32)
//                 and the outputs' reduce-scatter ((D-1) B Hq/P D bf16), as vLLM merges them;
//                 one all-reduce's latency for the LM head's candidates;
//   EP            a dispatch and a combine all-to-all of its tokens' pairs ((P-1)/P of ceil(B/P)
//                 k' x H bf16 rows), the LM head needs none.
//   Link rates: NVLink 389 GB/s per GPU per direction (the copy-engine ceiling measured on 2x
//   H200 here, DESIGN.md §6) for all-reduce, all-gather and reduce-scatter, NCCL all-to-all
//   332 GB/s (measured here at 1 GiB, 2x H200); latency 10 us per collective (assumed).
//   Both columns are written: compute_ms (measured) and comm_priced_ms (priced; "collectives"
//   says by what), and their sum step_ms.
// So the emulation is exact for a rank's own kernels and shapes (weights, KV, attention over
// its heads or sequences or DCP share, expert GEMMs over its pairs), and approximate
//   - where routing decides which of a rank's experts a token picks: EP and TEP ranks route
//     over their E/P experts instead of the global router over E. For EP that is ceil(B/P)
//     tokens' router; TEP's real router runs over all E for all B tokens (as TP's does), so
//     the emulation under-counts TEP's router GEMM by (E - E/P)/E of TP's router stage (see the
//     stage profile: TP's "router" against TEP's);
//   - for dcp, the merge of the exchanged partials (a conversion of the same rows stands in),
//     and the new token's K/V, which only one rank of the set appends (here the rank does);
//   - wherever the collectives' real cost departs from the link model.
//
// Output: one JSON line per (layout, context, batch) in MOEBIUS_BENCH_SUMMARY ("mode" the
// layout's name: "TP" and "EP" as serving/step_curves reads them, "TP-dcp2", "TEP",
// "TEP-dcp2"), then per context and layout the crossover against TP (the smallest batch from
// which the layout's step is shorter than TP's).
//
// Environment: MOEBIUS_BENCH_MODEL (qwen3_235b | qwen3_30b), MOEBIUS_BENCH_P (8),
// MOEBIUS_BENCH_LAYOUTS (tp,ep; any of tp, tp-dcpD, ep, tep, tep-dcpD: a runtime each, one after
// the other; MOEBIUS_BENCH_MODES is read when it is unset), MOEBIUS_BENCH_BATCHES
// (1,2,4,...,1024: the deployment's batch B), MOEBIUS_BENCH_CONTEXTS (512,2048,8192),
// MOEBIUS_BENCH_SKEW (1), MOEBIUS_BENCH_LAYERS (the model's: fewer for a quick run; every
// figure then covers only those layers), MOEBIUS_BENCH_STEPS (10 timed steps per point),
// MOEBIUS_BENCH_SUMMARY, MOEBIUS_BENCH_COLLECTIVES (cited | link). Combinations whose KV does
// not fit beside the weights are skipped.
// MINI_ENGINE_PROFILE=1 runs every step eagerly with the stage profile (profiler.hpp): each
// point then also prints, and writes as "stages_ms", its last step's time per stage.

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <sstream>
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
  std::vector<rank_layout> layouts;
  try {
    const char* v = std::getenv("MOEBIUS_BENCH_LAYOUTS");
    if (v == nullptr || *v == '\0') v = std::getenv("MOEBIUS_BENCH_MODES");
    std::stringstream list((v == nullptr || *v == '\0') ? "tp,ep" : v);
    std::string item;
    while (std::getline(list, item, ',')) {
      const rank_layout l = parse_rank_layout(item);
      validate(l, full, P);
      layouts.push_back(l);
    }
  } catch (const std::exception& e) {
    std::printf("%s P=%d: %s\n", model_name.c_str(), P, e.what());
    return 1;
  }
  std::FILE* json = nullptr;
  if (const char* path = std::getenv("MOEBIUS_BENCH_SUMMARY"); path != nullptr && *path != '\0')
    json = std::fopen(path, "w");
  const char* priced_by = std::getenv("MOEBIUS_BENCH_COLLECTIVES");
  const std::string pricing_name = priced_by != nullptr && *priced_by != '\0' ? priced_by : "cited";
  if (pricing_name != "cited" && pricing_name != "link") {
    std::printf("MOEBIUS_BENCH_COLLECTIVES=%s: expected cited or link\n", pricing_name.c_str());
    return 1;
  }
  const collective_pricing pricing =
      pricing_name == "cited" ? collective_pricing::cited : collective_pricing::link;
  std::map<std::pair<int64_t, int64_t>, std::map<std::string, point>> results;  // (context, B)
  for (const rank_layout& l : layouts) {
    const std::string name = name_of(l);
    const model_config c = rank_share_of(full, l, P, skew);
    std::vector<int64_t> buckets;
    for (const int64_t B : batches) buckets.push_back(rank_batch(l, B, P));
    std::sort(buckets.begin(), buckets.end());
    buckets.erase(std::unique(buckets.begin(), buckets.end()), buckets.end());
    const int64_t max_context = *std::max_element(contexts.begin(), contexts.end());
    // The page-table width: the rank's share of the longest sequence (+ 1 token of margin).
    gpu_runtime_options o =
        bench::decode_options(c, 1, buckets, rank_tokens(l, max_context + 1, c.page_size));
    o.hybrid_graphs = false;  // pure decode steps only
    o.emulated_dcp = l.dcp;
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
    std::printf("%s P=%d %s rank: E %lld top-%lld I %lld, Hq %lld Hkv %lld (attention over %lld "
                "q heads), V %lld; weights %.1f GB, KV pool %lld pages (%.1f GB)\n",
                model_name.c_str(), P, name.c_str(), static_cast<long long>(c.num_experts),
                static_cast<long long>(c.top_k), static_cast<long long>(c.intermediate),
                static_cast<long long>(c.num_q_heads), static_cast<long long>(c.num_kv_heads),
                static_cast<long long>(l.dcp * c.num_q_heads), static_cast<long long>(c.vocab),
                (experts + attention + head) / 1e9, static_cast<long long>(o.num_ep_pages),
                static_cast<double>(o.num_ep_pages) * page_bytes / 1e9);
    std::fflush(stdout);
    std::unique_ptr<gpu_runtime> rt;
    try {
      rt = std::make_unique<gpu_runtime>(c, uint64_t{12345}, o);
      rt->fill_kv_random(777);
    } catch (const std::exception& e) {
      std::printf("  could not build the runtime: %s\n", e.what());
      continue;
    }
    for (const int64_t context : contexts) {
      // The rank's tokens of each sequence, the decode token's slot included.
      const int64_t tokens = rank_tokens(l, context + 1, c.page_size);
      for (const int64_t B : batches) {
        const int64_t b = rank_batch(l, B, P);
        const int64_t pages = b * moebius::pages_for_tokens(tokens, c.page_size);
        if (pages > o.num_ep_pages) {
          std::printf("  ctx %lld B %lld: %lld sequences' KV (%lld tokens each) does not fit; "
                      "skipped\n",
                      static_cast<long long>(context), static_cast<long long>(B),
                      static_cast<long long>(b), static_cast<long long>(tokens));
          continue;
        }
        const moebius::kv_state tables =
            bench::make_tables(rt->kv(), parallel_mode::ep, b, tokens);
        std::vector<int32_t> ids;
        const std::vector<step_item> items = bench::decode_items(b, tokens - 1, c.vocab, ids);
        const step_layout layout{&tables, moebius::arena_cursor{0}};
        const int64_t reruns_before = rt->overflow_reruns();
        for (int i = 0; i < 3; ++i) rt->step(layout, items);  // warm-up
        std::vector<double> ms;
        for (int64_t i = 0; i < timed; ++i) {
          rt->step(layout, items);
          ms.push_back(rt->measured_step_s() * 1e3);
        }
        const int64_t reruns = rt->overflow_reruns() - reruns_before;
        std::sort(ms.begin(), ms.end());
        point p;
        p.compute_ms = ms[ms.size() / 2];
        p.comm_ms = priced_collectives_s(full, l, P, B, c.top_k, pricing) * 1e3;
        results[{context, B}][name] = p;
        std::printf("  ctx %5lld B %5lld (%lld on the rank, %lld tokens each): compute %.3f ms "
                    "(measured) + collectives %.3f ms (priced, %s) = %.3f ms%s\n",
                    static_cast<long long>(context), static_cast<long long>(B),
                    static_cast<long long>(b), static_cast<long long>(tokens), p.compute_ms,
                    p.comm_ms, pricing_name.c_str(), p.compute_ms + p.comm_ms,
                    reruns > 0 ? " (expert-capacity reruns)" : "");
        // MINI_ENGINE_PROFILE=1: the last timed step by stage (eager, no graphs: its compute
        // figure is the eager step's), each stage summed over the layers.
        const std::string stages = stage_json(*rt);
        if (!stages.empty()) std::printf("    stages (ms, last step, eager): %s\n", stages.c_str());
        std::fflush(stdout);
        if (json != nullptr) {
          std::fprintf(json,
                       "{\"model\": \"%s\", \"P\": %d, \"mode\": \"%s\", \"attention\": \"%s\", "
                       "\"experts\": \"%s\", \"dcp\": %lld, \"skew\": %.3f, \"layers\": %lld, "
                       "\"context\": %lld, \"batch\": %lld, \"rank_batch\": %lld, "
                       "\"rank_tokens\": %lld, \"top_k_local\": %lld, \"compute_ms\": %.4f, "
                       "\"comm_priced_ms\": %.4f, \"collectives\": \"%s\", \"step_ms\": %.4f, "
                       "\"graph_replays\": %lld, "
                       "\"overflow_reruns\": %lld%s%s}\n",
                       model_name.c_str(), P, name.c_str(),
                       l.attention == parallel_mode::tp ? "TP" : "DP",
                       moebius::to_string(l.experts), static_cast<long long>(l.dcp), skew,
                       static_cast<long long>(c.num_layers), static_cast<long long>(context),
                       static_cast<long long>(B), static_cast<long long>(b),
                       static_cast<long long>(tokens), static_cast<long long>(c.top_k),
                       p.compute_ms, p.comm_ms, pricing_name.c_str(), p.compute_ms + p.comm_ms,
                       static_cast<long long>(rt->graph_replays()),
                       static_cast<long long>(reruns), stages.empty() ? "" : ", \"stages_ms\": ",
                       stages.c_str());
          std::fflush(json);
        }
      }
    }
  }
  // The crossover per context and layout against TP: the smallest batch from which the layout
  // stays faster, walking down from the largest batch measured in both (larger ones may not
  // fit in one layout's KV).
  const std::string tp_name = name_of(rank_layout::tp());
  for (const rank_layout& l : layouts) {
    const std::string name = name_of(l);
    if (name == tp_name) continue;
    for (const int64_t context : contexts) {
      int64_t cross = -1;
      bool started = false;
      for (auto it = batches.rbegin(); it != batches.rend(); ++it) {
        const auto r = results.find({context, *it});
        const bool both = r != results.end() && r->second.count(tp_name) != 0 &&
                          r->second.count(name) != 0;
        if (!both && !started) continue;
        started = true;
        if (!both) break;
        const point& tp = r->second[tp_name];
        const point& other = r->second[name];
        if (other.compute_ms + other.comm_ms >= tp.compute_ms + tp.comm_ms) break;
        cross = *it;
      }
      if (cross > 0)
        std::printf("crossover at context %lld: %s faster than TP from batch %lld on\n",
                    static_cast<long long>(context), name.c_str(), static_cast<long long>(cross));
      else
        std::printf("crossover at context %lld: %s not faster than TP at the largest batch "
                    "measured in both (or none measured)\n",
                    static_cast<long long>(context), name.c_str());
    }
  }
  if (json != nullptr) std::fclose(json);
  return 0;
}
