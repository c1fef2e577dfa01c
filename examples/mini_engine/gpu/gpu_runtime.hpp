#pragma once

// The mini-engine's GPU runtime: one process drives P ranks, each with an expert arena and a
// KV pool allocated once (cudaMalloc, never moved), the non-expert weights and every other
// buffer beside them (one allocation, rank_buffers.hpp), one stream and one cuBLAS handle. It
// runs the model of model_config.hpp with the weights of weights.hpp, in TP, EP, any arena
// cursor between them, and the hybrid steps of a progressive switch (step.hpp), with CUDA
// graphs captured once at construction.
//
// Where the ranks run (gpu_runtime_options::placement):
//   one rank per device: rank r on device r, collectives through NCCL (one communicator per
//     rank), one graph per rank per capture;
//   virtual ranks: all P ranks on device 0, each with its own arena, KV pool, buffers, stream
//     and cuBLAS handle exactly as a real rank; the collectives run over device memory
//     (device_collectives.cu: a cross-rank barrier of CUDA events, then each rank pulls from
//     its peers' buffers or sums them), since NCCL refuses two ranks of one communicator on
//     one device; each capture is ONE graph holding every rank's stream. What they emulate:
//     P ranks' steps, collectives and switch copies sharing one GPU's HBM and SMs, the
//     contention each of P GPUs would see from its own step and copies; not the link: every
//     "transfer" between ranks is a device-local copy at HBM rates, never NVLink's.
//
// Decode context parallelism (gpu_runtime_options::dcp, vLLM's -dcp; kv_geometry.hpp): with
// Hkv < P the P/Hkv TP ranks of one KV head form sets of dcp ranks that split every sequence's
// pages (logical page i on the set's rank of DCP index i % dcp) instead of each holding them
// all, so the TP view holds dcp x the tokens. A TP layer then runs as the host runtime's
// (host_runtime.hpp): each rank projects its own q heads and its KV head's k/v, stores a new
// token's K/V only where its page lies, the set's q heads are gathered on every member, each
// member attends them over the pages it holds (partial output + LSE), and each rank merges the
// set's partials of its own heads (dcp_merge) before o_proj and the usual all-reduce; EP
// layers are unchanged. Virtual ranks only: the gathers and the merge read the peers' buffers
// in device memory, inside the captured graphs (device_collectives.cu says how the partials
// travel and why); one rank per device refuses dcp > 1.
//
// Where the design is written down (gpu/README.md has the overview):
//   the layer's work in each mode   attention_block.cu, moe_block.cu (DESIGN.md §7)
//   CUDA graphs (whole-model and per-layer), expert capacity   graph_cache.hpp, moe_block.cu
//   hybrid steps and their hand-off                          step_inputs.cu, layer_schedule.hpp

#include <cstdint>
#include <functional>
#include <memory>
#include <moebius/kv/kv_geometry.hpp>
#include <moebius/kv/kv_pool_layout.hpp>
#include <moebius/layout/arena_geometry.hpp>
#include <moebius/memory/deployment_memory.hpp>
#include <moebius/memory/rank_memory.hpp>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "model_config.hpp"
#include "step.hpp"
#include "weight_sink.hpp"
#include "weights.hpp"

namespace mini_engine::gpu {

// Where the P ranks run (gpu_runtime.hpp, top). automatic: virtual ranks when P exceeds the
// visible devices, else one rank per device.
enum class rank_placement { automatic, one_per_device, virtual_ranks };

struct gpu_runtime_options {
  int num_ranks = 1;  // P: ranks on devices 0 .. P-1, or all on device 0 (virtual ranks)
  rank_placement placement = rank_placement::automatic;
  int64_t num_ep_pages = 64;       // KV pages per rank in EP (TP: x tp_pages_per_ep_page)
  int64_t max_pages_per_seq = 64;  // page-table width: longest sequence = this * page_size
  int64_t max_tokens = 512;        // tokens per rank per step (decode and prefill)
  std::vector<int64_t> buckets = {1, 2, 4, 8, 16, 32, 64, 128, 256, 512};  // graph buckets
  bool capture_graphs = true;
  // Per-layer graphs of both modes for hybrid steps (with capture_graphs): 2 x buckets x L
  // more captures at construction.
  bool hybrid_graphs = true;
  moebius::dtype dense_dtype = moebius::dtype::fp32;  // attention/embedding/LM-head weights
  // fp8 experts are dequantized to this before the expert GEMMs: bf16 (the GEMMs then run as
  // with bf16 experts: bf16 inputs, fp32 accumulate) or fp32 (activations stay fp32: exact
  // against a float64 model up to the fp32 GEMMs' rounding; tests).
  moebius::dtype fp8_compute_dtype = moebius::dtype::bf16;
  moebius::arena_cursor cursor{0};  // where the experts are placed initially (0: EP, L: TP)
  // KV-parallel degree of the TP view (kv_geometry::dcp; above): the TP ranks of one KV head
  // split each sequence's pages in sets of dcp, and the TP page tables a step gets must be that
  // view's (each rank its share). 1: every TP rank holds every token of its head slice (the
  // runtime as it was without dcp, kernel for kernel). Must divide P/Hkv (Hkv < P; 1 when Hkv
  // >= P: moebius::with_dcp refuses anything else, naming dcp), and dcp > 1 needs virtual
  // ranks (so P > 1: it never meets emulated_dcp, which needs P = 1).
  int64_t dcp = 1;
  // Every dcp a step may serve at (step_layout::dcp: the switcher's after a dcp change,
  // switcher::plan_dcp), `dcp` among them whether listed or not; each must be one the KV
  // geometry allows (as `dcp`). The TP graphs are captured once per dcp here (so with {1, 2}
  // TP's graphs are twice today's) and the DCP buffers sized for the largest; a step at a dcp
  // not listed is refused by name. Empty: `dcp` alone.
  std::vector<int64_t> serve_dcps;
  int64_t tensor_alignment = moebius::default_tensor_alignment;
  int64_t slot_alignment = moebius::default_slot_alignment;

  // Kernel choices and diagnostics; options_from_env() sets them from the environment.
  // Decode attention: the split-context GQA kernel on tensor cores from buckets of
  // tensor_core_min_tokens (bf16 KV, head_dim 64 or 128; default every bucket), on CUDA cores
  // below that, or the simple kernel.
  bool simple_attention = false;
  bool tensor_core_attention = true;
  int64_t tensor_core_min_tokens = 1;
  int64_t attention_splits = 0;  // > 0: that many context ranges (0: from the shape)
  // Expert tiles of n x the rows moe_tile_rows() picks (a power of two, 1..64; experiment:
  // larger tiles re-read an expert's weights in fewer batch entries at large batches, at the
  // price of more padded rows).
  int64_t moe_tile_scale = 1;
  // The stage profile: every step eagerly (no graphs are captured) with CUDA events at each
  // stage boundary (gpu_runtime::stage_times()).
  bool profile = false;
  // Benchmarks only (bench_rank_share.cu): one rank of a decode-context-parallel set of this
  // many ranks (vLLM -dcp), emulated at P = 1 over a model with one KV head. The q/k/v and o
  // projections stay over the model's Hq heads; the paged attention runs over dcp x Hq q
  // heads (the set's all-gathered q: here dcp copies of the rank's own, in the normed-input
  // buffer `xn`, free between the q/k/v GEMMs and the MoE) into the o_proj buffer `proj` (free
  // until o_proj writes it), and all dcp x Hq heads are converted to the GEMM input, standing
  // in for the merge of the exchanged partial outputs, before o_proj reads the rank's Hq. The
  // caller gives each sequence the rank's share of its tokens (kv_geometry::dcp_tokens_held).
  // Needs P = 1, Hkv = 1 and dcp x Hq x D <= H. 1: off. (The real thing at P > 1: dcp.)
  int64_t emulated_dcp = 1;
};

// The defaults above with the environment's settings, the one place the runtime's
// environment variables are read (the tests, benchmarks and demo construct their options
// from it, so the variables act on every runtime they start):
//   MINI_ENGINE_NO_GRAPHS=1          capture_graphs = false (every step eager: tells a graph
//                                    problem from a numerics one)
//   MINI_ENGINE_HYBRID_EAGER=1       hybrid_graphs = false (hybrid steps eager)
//   MINI_ENGINE_PROFILE=1            profile = true (implies no graphs)
//   MINI_ENGINE_SIMPLE_ATTENTION=1   simple_attention = true
//   MINI_ENGINE_ATTENTION=simple     simple_attention = true
//                        =split      tensor_core_attention = false (CUDA-core split kernel at
//                                    every bucket)
//                        =mma        tensor_core_min_tokens = 1 (tensor cores at every bucket,
//                                    the default)
//   MINI_ENGINE_ATTENTION_MMA_MIN_TOKENS=n   tensor_core_min_tokens = max(1, n) (unless mma)
//   MINI_ENGINE_ATTENTION_SPLITS=n   attention_splits = max(0, n)
//   MINI_ENGINE_MOE_TILE_SCALE=n     moe_tile_scale = n when n is a power of two in [1, 64]
//   MINI_ENGINE_VIRTUAL_RANKS=1      placement = virtual_ranks (all ranks on device 0)
//                            =0      placement = one_per_device (P > devices: refused)
gpu_runtime_options options_from_env();

class gpu_runtime : public runtime {
 public:
  // Uploads `weights` (the model: weights.config; experts placed into the arena at
  // options.cursor by place_experts, the rest per rank) and captures the graphs. Throws
  // moebius::error for a model it cannot run (dtype, P not dividing heads/experts, one rank
  // per device with more ranks than devices, more than 8 virtual ranks, a dcp the KV geometry
  // or the placement refuses) or weights of the wrong shapes.
  gpu_runtime(const model_weights& weights, const gpu_runtime_options& options);
  // The model `config` with its weights streamed in by `load` (hf_checkpoint::load: every
  // tensor once), each converted once and copied to every rank's device buffers: dense
  // tensors in chunks of at most 64 MiB of host staging, experts through place_expert_part
  // into one slot-sized host image per rank of each layer in flight, uploaded (and freed)
  // when the layer's last expert arrives. Host memory: the mapped shard, the staging chunk
  // and P slot images of the layers being filled (one or two: checkpoints store layers in
  // order). Throws what `load` throws, or errc::invalid_argument for a missing tensor.
  //   hf_checkpoint ck(dir);  model_config m = ck.config().model;  m.kv_dtype = bf16;
  //   gpu_runtime rt(m, o, [&](weight_sink& s) { ck.load(m, s); });
  gpu_runtime(const model_config& config, const gpu_runtime_options& options,
              const std::function<void(weight_sink&)>& load);
  // The model `config` with weights drawn on the device from `seed` (benchmarks: values do
  // not matter).
  gpu_runtime(const model_config& config, uint64_t seed, const gpu_runtime_options& options);
  ~gpu_runtime() override;
  gpu_runtime(const gpu_runtime&) = delete;
  gpu_runtime& operator=(const gpu_runtime&) = delete;

  // One step in two phases (step.hpp). enqueue() launches it on every rank's stream (graph
  // replay, or eagerly) and returns; with step_options::layer_events a hybrid step records,
  // after each layer, every rank's event (pending_step::layer_events), so that an advance
  // enqueued beside it runs its copies while it computes; a static layout runs as one piece
  // (no events: copies follow finish()). finish() waits for it, reads the tokens back and
  // its device time (CUDA events from its first upload to its last download on every rank's
  // stream, the longest rank); after a graph replay whose routing overflowed the graphs'
  // expert capacity it says so (step_result::overflowed) and the caller reruns it eagerly
  // (step_options::rerun, timed from the first pass's start).
  pending_step enqueue(const step_layout& layout, std::span<const step_item> items,
                       const step_options& options = {}) override;
  step_result finish(const pending_step& p) override;
  bool overlaps_copies() const override { return true; }
  // The model's vocabulary (step.hpp: token ids a step accepts).
  int64_t vocab_size() const override;

  // Rank r's arena and KV pool on its device (r, or 0 for virtual ranks; moebius transports:
  // cuda_peer_transport::single_process takes both, virtual ranks after
  // request_hardware_queues_for_virtual_ranks()).
  std::vector<moebius::rank_memory> memory() const;
  // The library's owner of that memory (moebius::device_deployment_memory): typed views of
  // the arena and the pool.
  const moebius::deployment_memory& deployment() const;
  const moebius::arena_geometry& arena() const;
  // The KV geometry, with options.dcp as its TP view's dcp (the switcher and the TP page
  // tables take it from here). A step at another of options.serve_dcps reads the same pool
  // through with_dcp(kv(), that dcp).
  const moebius::kv_geometry& kv() const;
  // The dcp values a step may serve at (options.serve_dcps with options.dcp), ascending.
  const std::vector<int64_t>& serve_dcps() const;
  // The pool's layout, for switcher_options::kv_layout: the present one, which is what the
  // attention kernels read (runtime_impl.hpp says why no other).
  moebius::kv_pool_layout kv_layout() const;
  int num_ranks() const;
  // Whether the ranks are virtual (all on device 0, collectives over device memory; P > 1).
  bool virtual_ranks() const;

  // Whether decode steps replay graphs: options.capture_graphs and not options.profile.
  bool graphs_enabled() const;
  // Whether hybrid decode steps can replay per-layer graphs: graphs_enabled() and
  // options.hybrid_graphs.
  bool hybrid_graphs_enabled() const;
  // Runs hybrid steps eagerly although their graphs were captured (true), or replays them
  // again (false, the default). For benchmarks comparing both in one process (a second
  // Qwen3-30B-A3B runtime does not fit beside the first on one GPU).
  void set_hybrid_eager(bool eager);
  // Graphs captured, all at construction: whole-model (mode x bucket; TP once per serve dcp)
  // plus per-layer (the same x layer, hybrid steps). Never changes afterwards.
  int64_t captures() const;
  int64_t graph_replays() const;  // steps that replayed graphs (whole-model or per-layer)
  int64_t eager_steps() const;    // steps that ran without a graph
  // Graph steps whose routing overflowed the graph's expert capacity (1.25x the expected
  // pairs per rank) and were rerun eagerly with the worst-case capacity.
  int64_t overflow_reruns() const;
  // Hybrid steps run (a progressive switch in progress: step_layout::hybrid()), and those of
  // them that replayed per-layer graphs (the rest ran eagerly).
  int64_t hybrid_steps() const;
  int64_t hybrid_graph_steps() const;
  // What the graphs cost at construction. Bytes: the device memory cudaMemGetInfo saw
  // disappear while capturing, instantiating and uploading them (the largest rank; the
  // driver allocates in chunks, so a coarse figure).
  struct graph_stats {
    int64_t whole_model = 0;  // (EP + TP at each serve dcp) x buckets
    int64_t per_layer = 0;    // (EP + TP at each serve dcp) x buckets x L (0: no hybrid graphs)
    double whole_model_s = 0, per_layer_s = 0;  // host wall clock of their capture
    int64_t whole_model_bytes = 0, per_layer_bytes = 0;
  };
  graph_stats graph_statistics() const;

  // Stage profile: with options.profile (MINI_ENGINE_PROFILE=1 through options_from_env())
  // every step runs eagerly (as with MINI_ENGINE_NO_GRAPHS=1: nothing is captured,
  // graphs_enabled() is false, so the runtime tests hold as they are) and each rank's stream
  // records a CUDA event at every stage boundary of every layer; stage_times() gives the last
  // step's device time per stage summed over the layers (the longest rank per stage), in
  // seconds, in step order: upload, embed, qkv (input norm, q/k/v GEMMs, q/k norms, RoPE, KV
  // append), attention (paged attention), o_proj, router (residual add, norm, router GEMM,
  // top-k, pack), permute, dequant (fp8 experts: the touched experts expanded; 0 otherwise),
  // experts (GEMMs, SiLU-and-mul), combine (moe_combine, residual adds), collectives (NCCL,
  // or device memory with virtual ranks), hand_off, lm_head (final norm, GEMM, argmax),
  // download. Eager launches: where the GPU outruns the host, an interval also holds the
  // launch gaps.
  // Without it nothing is recorded and stage_times() is empty.
  bool profiling() const;
  std::vector<std::pair<std::string, double>> stage_times() const;

  // Fills every rank's KV pool with random values (benchmarks: a context to attend over).
  void fill_kv_random(uint64_t seed);

  struct impl;

 private:
  std::unique_ptr<impl> impl_;
};

}  // namespace mini_engine::gpu
