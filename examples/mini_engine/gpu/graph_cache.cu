// Capturing the graphs (graph_cache.hpp) at construction: each is what forward() (or one
// layer of it) enqueues, captured on every rank's stream at once (their NCCL calls pair up
// across ranks; virtual ranks: into one graph, their barriers its edges), instantiated and
// uploaded; capture_all measures their time and memory. launch() replays one.

#include <algorithm>
#include <chrono>

#include "runtime_impl.hpp"

namespace mini_engine::gpu {

using moebius::dtype;
using moebius::errc;
using moebius::parallel_mode;

void graph_cache::release() {
  for (auto& [key, gs] : whole_model)
    for (cudaGraphExec_t e : gs.exec) cudaGraphExecDestroy(e);
  for (auto& [key, layers] : per_layer)
    for (graph_set& gs : layers)
      for (cudaGraphExec_t e : gs.exec) cudaGraphExecDestroy(e);
  whole_model.clear();
  per_layer.clear();
}

namespace {

int64_t largest_drop(const std::vector<size_t>& before, const std::vector<size_t>& after) {
  int64_t d = 0;
  for (size_t r = 0; r < before.size(); ++r)
    d = std::max(d, static_cast<int64_t>(before[r]) - static_cast<int64_t>(after[r]));
  return d;
}

}  // namespace

// Captures what `enqueue` puts on every rank's stream as one graph per rank (virtual ranks:
// one graph of every rank's stream), instantiated and uploaded.
template <class F>
graph_set gpu_runtime::impl::capture(F&& enqueue) {
  if (virt) return capture_virtual(enqueue);
  graph_set gs;
  each_rank([&](int, rank_state& rs) {
    MOEBIUS_CUDA_CHECK(cudaStreamBeginCapture(rs.stream, cudaStreamCaptureModeRelaxed));
  });
  enqueue();
  each_rank([&](int, rank_state& rs) {
    cudaGraph_t g = nullptr;
    MOEBIUS_CUDA_CHECK(cudaStreamEndCapture(rs.stream, &g));
    cudaGraphExec_t exec = nullptr;
    MOEBIUS_CUDA_CHECK(cudaGraphInstantiate(&exec, g, 0));
    MOEBIUS_CUDA_CHECK(cudaGraphUpload(exec, rs.stream));
    MOEBIUS_CUDA_CHECK(cudaGraphDestroy(g));
    gs.exec.push_back(exec);
  });
  return gs;
}

// Virtual ranks: a graph captured on one rank's stream cannot wait for another capture's
// events, so every rank's stream goes into ONE graph: capture on rank 0's stream, fork every
// other rank's stream from it (an event) before `enqueue`, join them back after; the
// collectives' barriers between the ranks' streams become edges inside the graph.
template <class F>
graph_set gpu_runtime::impl::capture_virtual(F&& enqueue) {
  rank_state& first = ranks[0];
  set_device(first);
  MOEBIUS_CUDA_CHECK(cudaStreamBeginCapture(first.stream, cudaStreamCaptureModeRelaxed));
  fork_from_first();
  enqueue();
  join_into_first();
  cudaGraph_t g = nullptr;
  MOEBIUS_CUDA_CHECK(cudaStreamEndCapture(first.stream, &g));
  cudaGraphExec_t exec = nullptr;
  MOEBIUS_CUDA_CHECK(cudaGraphInstantiate(&exec, g, 0));
  MOEBIUS_CUDA_CHECK(cudaGraphUpload(exec, first.stream));
  MOEBIUS_CUDA_CHECK(cudaGraphDestroy(g));
  graph_set gs;
  gs.exec.push_back(exec);
  return gs;
}

// Replays `gs` in every rank's stream order: rank r's graph on rank r's stream; virtual ranks'
// one graph on rank 0's stream, after every rank's stream (join) and before it (fork).
void gpu_runtime::impl::launch(const graph_set& gs) {
  if (!virt) {
    each_rank([&](int r, rank_state& rs) {
      MOEBIUS_CUDA_CHECK(cudaGraphLaunch(gs.exec[static_cast<size_t>(r)], rs.stream));
    });
    return;
  }
  join_into_first();
  set_device(ranks[0]);
  MOEBIUS_CUDA_CHECK(cudaGraphLaunch(gs.exec[0], ranks[0].stream));
  fork_from_first();
}

// Free device memory per rank (graph_stats: what the captures took).
std::vector<size_t> gpu_runtime::impl::free_bytes() {
  std::vector<size_t> f(static_cast<size_t>(P), 0);
  each_rank([&](int r, rank_state& rs) {
    MOEBIUS_CUDA_CHECK(cudaStreamSynchronize(rs.stream));
    size_t total = 0;
    MOEBIUS_CUDA_CHECK(cudaMemGetInfo(&f[static_cast<size_t>(r)], &total));
  });
  return f;
}

// The (mode, dcp) pairs graphs are captured for: TP at each serve dcp, then EP once.
std::vector<std::pair<parallel_mode, int64_t>> gpu_runtime::impl::graph_modes() const {
  std::vector<std::pair<parallel_mode, int64_t>> out;
  for (int64_t d : dcps) out.emplace_back(parallel_mode::tp, d);
  out.emplace_back(parallel_mode::ep, 1);
  return out;
}

// The whole-model graphs (mode x dcp x bucket) and, with o.hybrid_graphs, the per-layer
// graphs (the same x layer; gpu_runtime.hpp): layer l of (m, d), bucket b is the same code as
// layer l of the whole-model graph (m, d, b), layer 0's with the embedding before it, layer
// L-1's with the LM head after it. Each (TP, d) is captured serving at d (serve_at_dcp); the
// constructed dcp is served again after.
void gpu_runtime::impl::capture_all() {
  using clock = std::chrono::steady_clock;
  std::vector<size_t> free0 = free_bytes();
  auto t0 = clock::now();
  for (const auto& [m, d] : graph_modes()) {
    if (m == parallel_mode::tp) serve_at_dcp(d);  // EP's graphs read no dcp
    const moebius::arena_cursor cursor{m == parallel_mode::tp ? c.num_layers : 0};
    for (int64_t b : o.buckets) {
      graphs.whole_model[graph_cache::key_of(m, d, b)] =
          capture([&] { forward(m, cursor, b, true); });
      ++graphs.captures;
      ++graphs.stats.whole_model;
    }
  }
  std::vector<size_t> free1 = free_bytes();
  graphs.stats.whole_model_s = std::chrono::duration<double>(clock::now() - t0).count();
  graphs.stats.whole_model_bytes = largest_drop(free0, free1);
  if (o.hybrid_graphs) {
    t0 = clock::now();
    for (const auto& [m, d] : graph_modes()) {
      if (m == parallel_mode::tp) serve_at_dcp(d);
      pass ps;
      ps.attn.assign(static_cast<size_t>(c.num_layers), m);
      ps.cursor = moebius::arena_cursor{m == parallel_mode::tp ? c.num_layers : 0};
      for (int64_t b : o.buckets) {
        ps.rows[mode_index(m)] = b;
        std::vector<graph_set>& per_layer = graphs.per_layer[graph_cache::key_of(m, d, b)];
        for (int64_t li = 0; li < c.num_layers; ++li) {
          per_layer.push_back(capture([&] {
            if (li == 0) embed(ps);
            layer(ps, li, true);
            if (li == c.num_layers - 1) lm_head(ps);
          }));
          ++graphs.captures;
          ++graphs.stats.per_layer;
        }
      }
    }
    const std::vector<size_t> free2 = free_bytes();
    graphs.stats.per_layer_s = std::chrono::duration<double>(clock::now() - t0).count();
    graphs.stats.per_layer_bytes = largest_drop(free1, free2);
  }
  serve_at_dcp(o.dcp);
}

}  // namespace mini_engine::gpu
