#pragma once

// The GPU runtime's state (gpu_runtime::impl) and the declarations of its parts, one file per
// concern (internal: included by the runtime's .cu files only):
//   setup.cu            construction: checks, geometries, per-rank buffers, NCCL, teardown
//   weights_upload.cu   weights into the buffers and the arena (or random ones on the device)
//   forward.cu          one forward pass: embedding, layers, hand-offs, LM head
//   attention_block.cu  a layer's attention (norm, q/k/v, RoPE, KV append, paged attention,
//                       o_proj)
//   moe_block.cu        a layer's MoE (router, pack, dispatch, permute, experts, combine)
//   collectives.cu      the collectives (all-reduce, dispatch all-gather, combine send/recv,
//                       hand-off all-gather): NCCL calls grouped over every rank, or (virtual
//                       ranks) those of device_collectives.cu
//   device_collectives.cu  virtual ranks: the same collectives over device memory (event
//                       barriers between the ranks' streams, pulls from peers' buffers, the
//                       sum_ranks kernel), the DCP set's q gather and partial-attention merge
//                       (dcp > 1), and the fork / join of the ranks' streams around one graph
//   graph_cache.cu      capturing the whole-model and per-layer graphs
//   step_inputs.cu      the device-side maps of a step (input blocks, hand-off maps)
//   gpu_runtime.cu      step(): choosing graphs or eager, launching, reading results; the
//                       public methods
//   options.cpp         options_from_env(): the environment, read once
// rank_buffers.hpp (where every buffer lies) and profiler.hpp (the stage profile) are
// self-contained.

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <nccl.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <moebius/cuda/check.hpp>
#include <moebius/memory/device_deployment_memory.hpp>
#include <moebius/switch/progressive.hpp>
#include <optional>
#include <moebius/kv/kv_geometry.hpp>
#include <moebius/kv/page_table.hpp>
#include <moebius/layout/arena_geometry.hpp>
#include <span>
#include <utility>
#include <vector>

#include "gemm.hpp"
#include "gpu_runtime.hpp"
#include "graph_cache.hpp"
#include "kernels/kernels.hpp"
#include "layer_schedule.hpp"
#include "model_config.hpp"
#include "profiler.hpp"
#include "rank_buffers.hpp"
#include "weights.hpp"

namespace mini_engine::gpu {

// One rank's device state. Every pointer is set once, in the constructor: the buffers are
// regions of `buffers` (rank_buffers.hpp), the arena and the KV pool allocations of their own.
struct rank_state {
  int device = 0;
  cudaStream_t stream = nullptr;
  cublasHandle_t blas = nullptr;
  ncclComm_t comm = nullptr;  // one rank per device, P > 1
  // Virtual ranks: recorded on `stream` where the ranks meet (device_collectives.cu).
  cudaEvent_t meet = nullptr;
  std::vector<void*> owned;  // cudaMalloc'd: the buffers, the arena, the KV pool

  std::byte* buffers = nullptr;           // every buffer below but the arena and KV pool
  std::byte* cublas_workspace = nullptr;  // cublas_workspace_bytes
  std::byte* arena = nullptr;
  std::byte* kv_pool = nullptr;

  // Non-expert weights. qkv: [(Hq + 2 Hkv) D, H] = q_proj; k_proj; v_proj (dense dtype).
  struct layer {
    std::byte* qkv = nullptr;
    std::byte* o = nullptr;   // [H, Hq D]
    float* router = nullptr;  // [E, H] fp32: routing decisions match the reference's
    float* ln1 = nullptr;     // [H]
    float* ln2 = nullptr;     // [H]
    float* q_norm = nullptr;  // [D]
    float* k_norm = nullptr;  // [D]
  };
  std::vector<layer> layers;
  std::byte* embed = nullptr;    // [V, H] dense dtype
  float* final_norm = nullptr;   // [H]
  std::byte* lm_head = nullptr;  // [V, H] dense dtype

  // Activations for up to T_max tokens (G = P * T_max gathered rows).
  float* h = nullptr;              // [T, H] residual stream
  float* xn = nullptr;             // [T, H] normed
  std::byte* xd = nullptr;         // [T, max(H, Hq D)] dense dtype GEMM input
  float* qkv = nullptr;            // [T, (Hq + 2 Hkv) D]
  float* attn = nullptr;           // [T, Hq D]
  float* proj = nullptr;           // [T, H] o_proj output / all-reduce buffer
  float* router_logits = nullptr;  // [T, E]
  int32_t* topk_ids = nullptr;     // [T, k]
  float* topk_w = nullptr;         // [T, k]
  std::byte* packed = nullptr;     // [T] packed rows
  std::byte* gathered = nullptr;   // [G] packed rows
  float* moe_out = nullptr;        // [G, H]
  float* recv = nullptr;           // [P, T, H]
  float* logits = nullptr;         // [T, vocab slice]: TP V/P columns of its slice, EP all V
  int32_t* next = nullptr;         // [T] argmax within the slice
  float* next_value = nullptr;     // [T] its logit
  // Inputs, one block per attention mode (index: mode_index): ids [T], pos [T], seq [T],
  // num_tokens [1] (+3 padding), map [T] (the hand-off's source row of each token, hybrid
  // steps), tables [T][max_pages]. Graphs of mode m read block m.
  int32_t* inputs[2] = {nullptr, nullptr};
  int32_t* pinned[2] = {nullptr, nullptr};  // host mirrors of `inputs`
  int64_t input_count = 0;
  // CUDA events around the last step (measured_step_s).
  cudaEvent_t step_begin = nullptr, step_end = nullptr;
  // A step asked for layer events (step_options::layer_events): layer_done[l] is recorded on
  // `stream` after layer l (moebius::step_layer_events; copies beside the step wait on them).
  std::vector<cudaEvent_t> layer_done;
  stage_marks prof;  // the stage profile's events (options.profile)
  // Split-context attention: partial softmax states (paged_attention_workspace_floats).
  float* attn_work = nullptr;
  // Expert workspace, sized for the largest bucket of either mode.
  moe_plan moe;  // pointers only; shapes are filled per step
  // fp8 experts: the layer's local experts dequantized to the compute dtype, one layer at a
  // time (the tile map points the GEMMs here instead of at the arena). One rank holds the
  // same element count in EP ([E/P, 2I, H]) and TP ([E, 2I/P, H]), so one scratch fits both.
  std::byte* dq_w13 = nullptr;  // [local experts, local 2I, H] compute dtype
  std::byte* dq_w2 = nullptr;   // [local experts, H, local I]
  // Virtual ranks' all-reduce: the ranks' sum, then copied back over the buffer.
  float* reduce_scratch = nullptr;  // [T, H] (null: one rank per device)
  // Decode context parallelism (options.dcp > 1; null otherwise): the DCP set's q heads
  // gathered, this rank's partial attention over them and its LSEs; the set's ranks read each
  // other's dcp_out and dcp_lse in the merge (device_collectives.cu).
  float* dcp_q = nullptr;    // [T, dcp hq D], member k's heads at columns k hq D
  float* dcp_out = nullptr;  // [T, dcp hq D]
  float* dcp_lse = nullptr;  // [T, dcp hq]
};

// One forward pass: layer l's attention (and, in a hybrid step, its MoE) in attn[l], over
// that mode's input block with rows[mode_index(mode)] rows per rank; experts per the cursor.
struct pass {
  std::vector<moebius::parallel_mode> attn;  // per layer
  moebius::arena_cursor cursor;
  int64_t rows[2] = {0, 0};  // rows per rank of each mode's token layout (mode_index)
};

// The step between impl::enqueue and impl::finish (one at a time).
struct in_flight_step {
  bool pending = false;
  int64_t serial = 0;          // steps enqueued so far (pending_step::serial)
  pass ps;
  std::vector<step_item> items;  // the caller keeps their tokens alive until finish
  std::vector<std::pair<int, int64_t>> sample_at;
  std::vector<std::vector<float>>* logits = nullptr;
  bool replayed = false;       // graphs launched: finish reads the overflow flags first
};

struct gpu_runtime::impl {
  model_config c;
  gpu_runtime_options o;
  int P = 1;
  // All P ranks on one device, collectives over device memory (gpu_runtime.hpp); P > 1 only.
  bool virt = false;
  moebius::arena_geometry arena;
  // The KV geometry every kernel, shape and table check reads: the constructed one
  // (kv_built, options.dcp) at the dcp the step being enqueued or captured serves
  // (serve_at_dcp). The pool's bytes do not depend on the dcp: only who holds which token.
  moebius::kv_geometry kv;
  moebius::kv_geometry kv_built;
  std::vector<int64_t> dcps;  // options.serve_dcps with options.dcp, ascending, unique
  // Every rank's arena and KV pool (ranks[r].arena and .kv_pool point into it). The pool is
  // in the present layout (kv_pool_layout.hpp): the attention kernels' vector loads read a
  // page head as one HND block at kv_geometry::offset, so a layout of another engine would
  // need kernels of that engine.
  std::unique_ptr<moebius::device_deployment_memory> memory;
  int64_t T_max = 0, qkv_ld = 0, max_pages = 0;
  moe_tokens row_layout;  // packed row layout (tokens set per use)
  // Dtype of the expert GEMMs' inputs (packed rows, x_perm, act) and weights: the expert
  // dtype, or for fp8 experts o.fp8_compute_dtype (the dequantized scratch's).
  moebius::dtype ct = moebius::dtype::fp32;
  bool fp8 = false;
  std::vector<rank_state> ranks;
  rank_buffer_sizes buffer_sizes;  // what they hold
  rank_buffer_layout buffers;      // where each rank's buffers lie in rank_state::buffers

  graph_cache graphs;
  int64_t replays = 0, eager = 0, reruns = 0, hybrid_steps = 0, hybrid_graph_steps = 0;
  // set_hybrid_eager(true): hybrid steps run eagerly although their graphs exist.
  bool hybrid_eager = false;
  double last_step_s = -1;  // device time of the last step (CUDA events)
  in_flight_step flight;
  // While a step asked for layer events is enqueued: its layers record layer_done.
  bool record_events = false;
  std::optional<moebius::step_layer_events> layer_events;  // every rank's layer_done

  bool prof_on = false;         // inside a profiled step (o.profile)
  std::vector<double> stage_s;  // last profiled step, seconds per stage

  // ---- setup.cu ----------------------------------------------------------------------------
  void setup(const model_config& config, const gpu_runtime_options& options);
  void check_supported() const;
  void lay_out_buffers();
  void init_rank(int r);
  void init_nccl();
  bool place_virtual(int devices) const;
  void carve(rank_state& rs) const;
  ~impl();

  // ---- weights_upload.cu -------------------------------------------------------------------
  void upload_weights(const model_weights& w);
  void random_weights(uint64_t seed);
  void stream_weights(const std::function<void(weight_sink&)>& load);

  // ---- the stage profile (profiler.hpp) ----------------------------------------------------
  // Ends the current interval of rank rs's stream as `st` (-1: starts the step).
  void mark(rank_state& rs, int st) {
    if (!prof_on) return;
    rs.prof.record(rs.stream, st);
  }
  void mark_all(int st) {
    if (!prof_on) return;
    each_rank([&](int, rank_state& rs) { mark(rs, st); });
  }
  // After the step's streams are synchronised: the intervals summed per stage.
  void collect_profile() {
    std::vector<stage_marks*> m;
    for (rank_state& rs : ranks) m.push_back(&rs.prof);
    stage_s = stage_times_of(m);
  }

  // ---- shape helpers -----------------------------------------------------------------------
  static int mode_index(moebius::parallel_mode m) {
    return m == moebius::parallel_mode::tp ? 1 : 0;
  }
  // Offsets of the input block's parts (rank_state::inputs).
  int64_t off_pos() const { return T_max; }
  int64_t off_seq() const { return 2 * T_max; }
  int64_t off_num() const { return 3 * T_max; }
  int64_t off_map() const { return 3 * T_max + 4; }
  int64_t off_tables() const { return 4 * T_max + 4; }
  int32_t* in_ids(rank_state& r, moebius::parallel_mode m) const { return r.inputs[mode_index(m)]; }
  int32_t* in_pos(rank_state& r, moebius::parallel_mode m) const {
    return r.inputs[mode_index(m)] + off_pos();
  }
  int32_t* in_seq(rank_state& r, moebius::parallel_mode m) const {
    return r.inputs[mode_index(m)] + off_seq();
  }
  int32_t* in_num(rank_state& r, moebius::parallel_mode m) const {
    return r.inputs[mode_index(m)] + off_num();
  }
  int32_t* in_map(rank_state& r, moebius::parallel_mode m) const {
    return r.inputs[mode_index(m)] + off_map();
  }
  int32_t* in_tables(rank_state& r, moebius::parallel_mode m) const {
    return r.inputs[mode_index(m)] + off_tables();
  }

  // The LM head's vocab slice of rank r: TP splits the vocabulary (when P | V), each rank
  // computing V/P logits of every token and its best candidate; EP computes all V for its
  // own tokens.
  std::pair<int64_t, int64_t> vocab_slice(moebius::parallel_mode attn, int r) const {
    if (attn == moebius::parallel_mode::tp && c.vocab % P == 0)
      return {r * (c.vocab / P), c.vocab / P};
    return {0, c.vocab};
  }

  int64_t q_heads_local(moebius::parallel_mode m) const {
    return m == moebius::parallel_mode::ep ? c.num_q_heads : c.num_q_heads / P;
  }
  int64_t kv_heads_local(moebius::parallel_mode m) const {
    return m == moebius::parallel_mode::ep ? kv.heads_per_ep_page() : kv.heads_per_tp_page();
  }
  // Ranks whose q heads a rank attends in mode m: its DCP set (TP with dcp > 1), the emulated
  // set (options.emulated_dcp, P = 1), else itself.
  int64_t attention_set(moebius::parallel_mode m) const {
    if (o.emulated_dcp > 1) return o.emulated_dcp;
    return m == moebius::parallel_mode::tp ? kv.dcp : 1;
  }
  // Whether mode m's attention splits each sequence over a DCP set (TP with dcp > 1).
  bool dcp_split(moebius::parallel_mode m) const {
    return m == moebius::parallel_mode::tp && kv.dcp > 1;
  }
  // Serves (or captures) at TP dcp `d` from here on: kv = kv_built at d. Throws
  // errc::invalid_argument for a d not in dcps, naming it and them.
  void serve_at_dcp(int64_t d);

  void set_device(const rank_state& r) const { MOEBIUS_CUDA_CHECK(cudaSetDevice(r.device)); }

  // f(rank, state) for every rank in rank order, with the rank's device current. One thread
  // drives every device, so collectives of all ranks are grouped (collectives.cu).
  template <class F>
  void each_rank(F&& f) {
    for (int r = 0; r < P; ++r) {
      rank_state& rs = ranks[static_cast<size_t>(r)];
      set_device(rs);
      f(r, rs);
    }
  }

  // ---- forward.cu --------------------------------------------------------------------------
  // A pure pass: every layer's attention in `attn`, T rows per rank (graphs, static steps).
  void forward(moebius::parallel_mode attn, moebius::arena_cursor cursor, int64_t T,
               bool optimistic);
  // The whole pass: embedding, the layers with a hand-off wherever the mode changes, LM head.
  void forward(const pass& ps, bool optimistic);
  void embed(const pass& ps);
  void layer(const pass& ps, int64_t li, bool optimistic);
  void hand_off(moebius::parallel_mode from, moebius::parallel_mode to, const pass& p);
  void lm_head(const pass& ps);

  // ---- attention_block.cu ------------------------------------------------------------------
  paged_attention_args attention_shape(moebius::parallel_mode m, int64_t li, int64_t T) const;
  paged_tokens tokens_of(rank_state& rs, int r, moebius::parallel_mode m, int64_t T) const;
  paged_attention_args attention_args(rank_state& rs, int r, moebius::parallel_mode m,
                                      int64_t li, int64_t T, const float* q, float* out) const;
  void attention(const pass& ps, int64_t li);
  void dcp_attention(int64_t li, int64_t T);
  std::pair<int64_t, int64_t> head_slice(moebius::parallel_mode attn, int r) const;
  void emulated_dcp_gather_q(rank_state& rs, moebius::parallel_mode attn, int64_t T);
  void project_qkv(rank_state& rs, int r, moebius::parallel_mode attn, int64_t li, int64_t T);
  void project_o(rank_state& rs, int r, moebius::parallel_mode attn, int64_t li, int64_t T);

  // ---- moe_block.cu ------------------------------------------------------------------------
  struct moe_shape {
    int64_t num_local, first, inter, tile_rows, max_tiles;
  };
  moe_shape moe_shape_of(moebius::parallel_mode layer_mode, int rank, int64_t src_tokens,
                         bool optimistic) const;
  void moe(const pass& ps, int64_t li, bool optimistic);
  void route(int64_t li, moebius::parallel_mode attn, int64_t T);
  void run_experts(int64_t li, moebius::parallel_mode lm, bool dispatch, int64_t src_tokens,
                   bool optimistic);
  void combine(moebius::parallel_mode attn, bool dispatch, int64_t T);

  // ---- collectives.cu ----------------------------------------------------------------------
  void all_reduce(float* rank_state::*buf, int64_t count);
  void dispatch_all_gather(int64_t T);
  void combine_exchange(int64_t T);
  void hand_off_all_gather(int64_t rows);

  // ---- device_collectives.cu (virtual ranks) -----------------------------------------------
  // No rank's stream passes until every rank's stream reached it.
  void barrier();
  // Rank 0's stream waits for every other rank's (before a graph launch on it), and every
  // other rank's for rank 0's (after): the one graph of virtual ranks in stream order.
  void join_into_first();
  void fork_from_first();
  void device_all_reduce(float* rank_state::*buf, int64_t count);
  void device_dispatch_all_gather(int64_t T);
  void device_combine_exchange(int64_t T);
  void device_hand_off_all_gather(int64_t rows);
  // Decode context parallelism (TP, dcp > 1): every rank gathers its DCP set's q heads
  // (qkv -> dcp_q); each rank merges the set's partials of its own heads (dcp_out, dcp_lse ->
  // attn). Each starts with a barrier; the merge ends with one.
  void device_dcp_gather_q(int64_t T);
  void device_dcp_merge(int64_t T);

  // ---- graph_cache.cu ----------------------------------------------------------------------
  template <class F>
  graph_set capture(F&& enqueue);
  template <class F>
  graph_set capture_virtual(F&& enqueue);
  void launch(const graph_set& gs);
  std::vector<size_t> free_bytes();
  std::vector<std::pair<moebius::parallel_mode, int64_t>> graph_modes() const;
  void capture_all();

  // ---- step_inputs.cu ----------------------------------------------------------------------
  token_layout build_inputs(moebius::parallel_mode m, const moebius::kv_state& tables,
                            std::span<const step_item> items);
  void write_hand_off_maps(const token_layout& tp, const token_layout& ep,
                           std::span<const step_item> items, int64_t rows_ep);
  void upload_inputs(rank_state& rs, int r, const bool used[2], const token_layout lay[2],
                     const int64_t rows[2]);

  // ---- gpu_runtime.cu ----------------------------------------------------------------------
  pending_step enqueue(const step_layout& layout, std::span<const step_item> items,
                       const step_options& opts);
  step_result finish(const pending_step& p);
  // With record_events: layer li's event on every rank's stream (after its work there).
  void record_layer_done(int64_t li);
  const graph_set* whole_model_graph(pass& ps);
  std::vector<const graph_set*> layer_graphs_of(pass& ps, const bool used[2]);
  void launch_graphs(const graph_set* gs, const std::vector<const graph_set*>& layer_gs,
                     const pass& ps);
  // Waits for a replayed step; true when some rank's routing overflowed the graphs' expert
  // capacity (the step must run again, eagerly: step_options::rerun).
  bool replay_overflowed();
  std::vector<int32_t> read_results(const pass& ps, std::span<const step_item> items,
                                    const std::vector<std::pair<int, int64_t>>& sample_at,
                                    std::vector<std::vector<float>>* logits_out);
  void download(const pass& ps, std::vector<std::vector<int32_t>>& next,
                std::vector<std::vector<float>>& next_value);
  std::vector<int32_t> pick_tokens(const pass& ps, std::span<const step_item> items,
                                   const std::vector<std::pair<int, int64_t>>& sample_at,
                                   const std::vector<std::vector<int32_t>>& next,
                                   const std::vector<std::vector<float>>& next_value,
                                   std::vector<std::vector<float>>* logits_out);
};

}  // namespace mini_engine::gpu
