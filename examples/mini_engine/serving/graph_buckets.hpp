#pragma once

// CUDA-graph buckets: the batch sizes an engine captured decode graphs for. A decode step of B
// rows (a rank's: every TP rank runs the step's B sequences, a data-parallel rank its own)
// replays the graph of the smallest bucket >= B, its rows padded to it, so it costs what a step
// of the bucket costs; beyond the largest bucket it runs eagerly (kernel by kernel). Steps that
// prefill run eagerly at any size in the GPU runtime (gpu_runtime.cu: graphs are captured for
// decode steps only), as in vLLM's piecewise mode for mixed batches.
//
//   buckets 1, 2, 4, 8: batch 3 -> 4, batch 5 -> 8, batch 9 -> 0 (eager)

#include <cstdint>
#include <span>
#include <vector>

namespace mini_engine {

// Throws errc::invalid_argument naming the first bucket that is not positive or not above the
// one before it (buckets must ascend strictly). An empty list is valid: no graphs.
void validate_graph_buckets(std::span<const int64_t> buckets);

// The smallest bucket >= batch, or 0 when batch is above the largest (or the list is empty):
// the step runs eagerly. `buckets` ascending (validate_graph_buckets).
int64_t graph_bucket(std::span<const int64_t> buckets, int64_t batch);

// vLLM's default capture sizes at max_num_seqs >= 256: 1, 2, 4, then 8 to 512 in steps of 8
// (67 sizes). vLLM v0.10 (vllm/config/__init__.py, VllmConfig._set_cudagraph_sizes): one
// cuda_graph_sizes value N gives [1, 2, 4] + range(8, N + 1, 8), and SchedulerConfig's
// default is N = min(2 x max_num_seqs, 512); a padded batch beyond the largest runs eagerly.
// (Later versions capture 256 to 512 in steps of 16 instead of 8.)
std::vector<int64_t> vllm_capture_sizes();

}  // namespace mini_engine
