#pragma once

// The CUDA graphs the runtime captures at construction and replays (gpu_runtime.hpp):
// whole-model graphs per (mode, bucket), and per-layer graphs per (mode, bucket, layer) for
// the decode steps of a progressive switch (hybrid steps). Nothing is captured after
// construction: every buffer a graph reads or writes keeps its address (rank_buffers.hpp),
// and the arena and KV pool never move.

#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <utility>
#include <vector>

#include "gpu_runtime.hpp"

namespace mini_engine::gpu {

// One captured graph, instantiated on every rank (exec[r] on rank r's stream).
struct graph_set {
  std::vector<cudaGraphExec_t> exec;
};

struct graph_cache {
  // Key: (static_cast<int>(mode), bucket).
  std::map<std::pair<int, int64_t>, graph_set> whole_model;
  // One graph per layer, layer 0's with the embedding, layer L-1's with the LM head.
  std::map<std::pair<int, int64_t>, std::vector<graph_set>> per_layer;
  int64_t captures = 0;  // both kinds
  gpu_runtime::graph_stats stats;

  // The smallest bucket >= need among `buckets` with graphs of mode m in `table`
  // (whole_model or per_layer); 0: none.
  template <class Table>
  static int64_t bucket_for(const Table& table, const std::vector<int64_t>& buckets,
                            moebius::parallel_mode m, int64_t need) {
    int64_t best = 0;
    for (int64_t b : buckets)
      if (b >= need && (best == 0 || b < best) && table.count({static_cast<int>(m), b}) != 0)
        best = b;
    return best;
  }

  // Destroys every instantiated graph.
  void release();
};

}  // namespace mini_engine::gpu
