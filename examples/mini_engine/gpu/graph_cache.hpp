#pragma once

// The CUDA graphs the runtime captures at construction and replays (gpu_runtime.hpp):
// whole-model graphs per (mode, dcp, bucket), and per-layer graphs per (mode, dcp, bucket,
// layer) for the decode steps of a progressive switch (hybrid steps). TP's are captured once
// per dcp the runtime serves (gpu_runtime_options::serve_dcps: the DCP set's exchanges, its
// tables' shares and the attention's shape are in the graph); EP's read no dcp (key dcp 1). Nothing is captured after
// construction: every buffer a graph reads or writes keeps its address (rank_buffers.hpp),
// and the arena and KV pool never move.
//
// CUDA graphs: at construction, for each mode (all-TP: TP tables and cursor L; all-EP: EP
// tables and cursor 0) and each bucket (default 1, 2, 4, ..., 512 tokens per rank), one decode
// step is captured on every rank's stream (NCCL calls included) and instantiated (whole-model
// graphs; virtual ranks: every rank's stream in one graph, graph_cache.cu). A decode step (every item one token) in a pure mode picks the smallest bucket
// >= its tokens per rank, uploads the step's inputs (token ids, positions, page tables: fixed
// device addresses) and replays; nothing is ever re-captured, because the weights (arena
// slots), the KV pool and every buffer keep their addresses across switches. Prefill steps,
// static layouts with cursors strictly between 0 and L and batches beyond the largest bucket
// run the same code eagerly.
//
// Graphs of hybrid steps (per-layer graphs). A switch lasts L / (layers per step) steps and
// sees each cursor about once, so a whole-step graph per cursor would be captured for about
// one replay. Instead, at construction, for each mode m and bucket b, layer l's forward pass
// in mode m (attention over m's input block, experts in m's arena view, b rows) is captured
// once as its own graph: 2 x buckets x L graphs (Qwen3-30B-A3B, 10 buckets: 960 per rank),
// the same kernels as the whole-model graphs cut at layer boundaries. Layer 0's graph starts
// with the embedding (in layer 0's mode: the step's first mode) and layer L-1's ends with the
// LM head and argmax (the last mode), so no graph exists for them alone. A hybrid decode step
// = upload both input blocks + layers [0, c) from TP's graphs (TP's bucket) + the hand-off
// (eager: a row gather and a copy, P > 1 EP -> TP an all-gather) + layers [c, L) from EP's
// graphs (EP's bucket, chosen on its own) + download: L graph launches where a pure step has
// one. Why per layer and not per group of layers: a cursor can stop at any layer (advance(n)
// with any n), and a group straddling the cursor would run eagerly; launches of 48 graphs
// cost a few microseconds each and overlap the previous layer's kernels. Prefill hybrid steps
// and hybrid batches beyond the largest bucket run eagerly; MINI_ENGINE_HYBRID_EAGER=1 in the
// environment (or options.hybrid_graphs = false) captures no per-layer graphs and runs every
// hybrid step eagerly, set_hybrid_eager(true) runs them eagerly although captured (comparison
// in one process). bench_hybrid_step.cu measures both against whole-model graph replays.

#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <tuple>
#include <utility>
#include <vector>

#include "gpu_runtime.hpp"

namespace mini_engine::gpu {

// One captured graph, instantiated on every rank (exec[r] on rank r's stream); virtual ranks:
// one graph holding every rank's stream (exec[0], launched on rank 0's stream).
struct graph_set {
  std::vector<cudaGraphExec_t> exec;
};

struct graph_cache {
  // (static_cast<int>(mode), dcp: TP's, 1 for EP, bucket).
  using key = std::tuple<int, int64_t, int64_t>;
  static key key_of(moebius::parallel_mode m, int64_t tp_dcp, int64_t bucket) {
    return {static_cast<int>(m), m == moebius::parallel_mode::tp ? tp_dcp : 1, bucket};
  }
  std::map<key, graph_set> whole_model;
  // One graph per layer, layer 0's with the embedding, layer L-1's with the LM head.
  std::map<key, std::vector<graph_set>> per_layer;
  int64_t captures = 0;  // both kinds
  gpu_runtime::graph_stats stats;

  // The smallest bucket >= need among `buckets` with graphs of mode m at TP dcp `tp_dcp` in
  // `table` (whole_model or per_layer); 0: none.
  template <class Table>
  static int64_t bucket_for(const Table& table, const std::vector<int64_t>& buckets,
                            moebius::parallel_mode m, int64_t tp_dcp, int64_t need) {
    int64_t best = 0;
    for (int64_t b : buckets)
      if (b >= need && (best == 0 || b < best) && table.count(key_of(m, tp_dcp, b)) != 0)
        best = b;
    return best;
  }

  // Destroys every instantiated graph.
  void release();
};

}  // namespace mini_engine::gpu
