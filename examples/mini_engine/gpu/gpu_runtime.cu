#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <map>
#include <moebius/cuda/check.hpp>
#include <moebius/cuda/nccl_check.hpp>
#include <moebius/error.hpp>
#include <moebius/kv/page_table.hpp>

#include "gemm.hpp"
#include "gpu_runtime.hpp"
#include "kernels/kernels.hpp"
#include "layer_schedule.hpp"
#include "rank_buffers.hpp"
#include "model_config.hpp"
#include "numerics.hpp"
#include "weights.hpp"

namespace mini_engine::gpu {

using moebius::dtype;
using moebius::errc;
using moebius::parallel_mode;

namespace {

// Host floats as `t` bytes.
std::vector<std::byte> encode(std::span<const float> v, dtype t) {
  std::vector<std::byte> out(v.size() * static_cast<size_t>(moebius::dtype_bytes(t)));
  for (size_t i = 0; i < v.size(); ++i) {
    if (t == dtype::bf16) {
      const uint16_t b = to_bf16(v[i]);
      std::memcpy(out.data() + 2 * i, &b, 2);
    } else {
      std::memcpy(out.data() + 4 * i, &v[i], 4);
    }
  }
  return out;
}

template <class T>
T* device_alloc(int64_t count, std::vector<void*>& owned) {
  void* p = nullptr;
  const size_t bytes = static_cast<size_t>(std::max<int64_t>(count, 1)) * sizeof(T);
  MOEBIUS_CUDA_CHECK(cudaMalloc(&p, bytes));
  MOEBIUS_CUDA_CHECK(cudaMemset(p, 0, bytes));
  owned.push_back(p);
  return static_cast<T*>(p);
}

}  // namespace

// One rank's device state. Every pointer is allocated once, in the constructor.
struct rank_state {
  int device = 0;
  cudaStream_t stream = nullptr;
  cublasHandle_t blas = nullptr;
  ncclComm_t comm = nullptr;
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
  // MINI_ENGINE_PROFILE=1: events at the stage boundaries of a step (created as needed) and
  // the stage of the interval each one ends (-1: the start).
  std::vector<cudaEvent_t> prof_events;
  std::vector<int> prof_stage;
  size_t prof_used = 0;
  // Split-context attention: partial softmax states (paged_attention_workspace_floats).
  float* attn_work = nullptr;
  // Expert workspace, sized for the largest bucket of either mode.
  moe_plan moe;  // pointers only; shapes are filled per step
  // fp8 experts: the layer's local experts dequantized to the compute dtype, one layer at a
  // time (the tile map points the GEMMs here instead of at the arena). One rank holds the
  // same element count in EP ([E/P, 2I, H]) and TP ([E, 2I/P, H]), so one scratch fits both.
  std::byte* dq_w13 = nullptr;  // [local experts, local 2I, H] compute dtype
  std::byte* dq_w2 = nullptr;   // [local experts, H, local I]
};

struct gpu_runtime::impl {
  model_config c;
  gpu_runtime_options o;
  int P = 1;
  moebius::arena_geometry arena;
  moebius::kv_geometry kv;
  int64_t T_max = 0, qkv_ld = 0, max_pages = 0;
  moe_tokens row_layout;  // packed row layout (tokens set per use)
  // Dtype of the expert GEMMs' inputs (packed rows, x_perm, act) and weights: the expert
  // dtype, or for fp8 experts o.fp8_compute_dtype (the dequantized scratch's).
  dtype ct = dtype::fp32;
  bool fp8 = false;
  std::vector<rank_state> ranks;
  rank_buffer_sizes buffer_sizes;  // what they hold
  rank_buffer_layout buffers;      // where each rank's buffers lie in rank_state::buffers

  struct graph_set {
    std::vector<cudaGraphExec_t> exec;  // per rank
  };
  std::map<std::pair<int, int64_t>, graph_set> graphs;  // (mode, bucket)
  // Per-layer graphs of hybrid steps: (mode, bucket) -> one per layer (capture_all).
  std::map<std::pair<int, int64_t>, std::vector<graph_set>> layer_graphs;
  int64_t captures = 0, replays = 0, eager = 0, reruns = 0, hybrid_steps = 0,
          hybrid_graph_steps = 0;
  gpu_runtime::graph_stats gstats;
  // set_hybrid_eager(true): hybrid steps run eagerly although their graphs exist.
  bool hybrid_eager = false;
  double last_step_s = -1;  // device time of the last step (CUDA events)
  // MINI_ENGINE_SIMPLE_ATTENTION=1 or MINI_ENGINE_ATTENTION=simple: the simple attention
  // kernel; default (split): the
  // split-context GQA kernel, MINI_ENGINE_ATTENTION_SPLITS=n forcing n ranges, on tensor
  // cores from buckets of 16 tokens (bf16 KV, head_dim 64 or 128):
  // MINI_ENGINE_ATTENTION=split keeps the CUDA-core split kernel at every bucket,
  // MINI_ENGINE_ATTENTION=mma takes the tensor-core one at every bucket,
  // MINI_ENGINE_ATTENTION_MMA_MIN_TOKENS=n from buckets of n tokens.
  static bool env_is(const char* name, const char* value) {
    const char* v = std::getenv(name);
    return v != nullptr && std::strcmp(v, value) == 0;
  }
  bool simple_attention =
      env_is("MINI_ENGINE_SIMPLE_ATTENTION", "1") || env_is("MINI_ENGINE_ATTENTION", "simple");
  bool tensor_core_attention = !env_is("MINI_ENGINE_ATTENTION", "split");
  int64_t tensor_core_min_tokens = [] {
    if (env_is("MINI_ENGINE_ATTENTION", "mma")) return int64_t{1};
    const char* v = std::getenv("MINI_ENGINE_ATTENTION_MMA_MIN_TOKENS");
    return v != nullptr ? std::max<int64_t>(1, std::strtoll(v, nullptr, 10)) : int64_t{16};
  }();
  int64_t attention_splits = [] {
    const char* v = std::getenv("MINI_ENGINE_ATTENTION_SPLITS");
    return v != nullptr ? std::max<int64_t>(0, std::strtoll(v, nullptr, 10)) : int64_t{0};
  }();

  // MINI_ENGINE_MOE_TILE_SCALE=n (a power of two, default 1): expert tiles of n x the rows
  // moe_tile_rows() picks (an experiment: larger tiles re-read an expert's weights in fewer
  // batch entries at large batches, at the price of more padded rows).
  int64_t moe_tile_scale = [] {
    const char* v = std::getenv("MINI_ENGINE_MOE_TILE_SCALE");
    const int64_t n = v != nullptr ? std::strtoll(v, nullptr, 10) : 1;
    return n >= 1 && n <= 64 && (n & (n - 1)) == 0 ? n : int64_t{1};
  }();

  // ---- stage profile (MINI_ENGINE_PROFILE=1) ----------------------------------------------
  // Steps run eagerly and every rank's stream records a CUDA event at each stage boundary;
  // the intervals are summed per stage over the step (the longest rank per stage). Off, the
  // marks return at once and graphs replay as usual (nothing is captured differently).
  enum stage : int {
    st_upload,       // step inputs host -> device
    st_embed,        // embedding
    st_qkv,          // input norm, q/k/v GEMMs, q/k norms, RoPE, KV append
    st_attention,    // paged attention (and the split kernel's merge)
    st_o_proj,       // o_proj GEMM (and its input conversion)
    st_router,       // residual add, post-attention norm, router GEMM, top-k, pack
    st_permute,      // route, sort, tile map, gather
    st_dequant,      // fp8 experts: the touched experts expanded into the scratch
    st_experts,      // expert GEMMs and SiLU-and-mul
    st_combine,      // moe_combine, residual adds, local copies
    st_collectives,  // NCCL: all-reduces, dispatch all-gather, combine send/recv, hand-off
    st_hand_off,     // hybrid steps: row gathers at a mode change
    st_lm_head,      // final norm, LM-head GEMM, argmax
    st_download,     // next tokens device -> host
    st_count
  };
  static constexpr const char* stage_names[st_count] = {
      "upload",  "embed",   "qkv",      "attention",   "o_proj",   "router",  "permute",
      "dequant", "experts", "combine",  "collectives", "hand_off", "lm_head", "download"};
  bool profile = env_is("MINI_ENGINE_PROFILE", "1");
  bool prof_on = false;  // inside a profiled step
  std::vector<double> stage_s;  // last profiled step, seconds per stage

  // Ends the current interval of rank rs's stream as `st` (-1: starts the step).
  void mark(rank_state& rs, int st) {
    if (!prof_on) return;
    if (rs.prof_used == rs.prof_events.size()) {
      cudaEvent_t e = nullptr;
      MOEBIUS_CUDA_CHECK(cudaEventCreate(&e));
      rs.prof_events.push_back(e);
      rs.prof_stage.push_back(-1);
    }
    MOEBIUS_CUDA_CHECK(cudaEventRecord(rs.prof_events[rs.prof_used], rs.stream));
    rs.prof_stage[rs.prof_used++] = st;
  }
  void mark_all(int st) {
    if (!prof_on) return;
    each_rank([&](int, rank_state& rs) { mark(rs, st); });
  }
  // After the step's streams are synchronised: the intervals summed per stage.
  void collect_profile() {
    stage_s.assign(st_count, 0.0);
    for (rank_state& rs : ranks) {
      std::vector<double> mine(st_count, 0.0);
      for (size_t i = 1; i < rs.prof_used; ++i) {
        float ms = 0;
        MOEBIUS_CUDA_CHECK(cudaEventElapsedTime(&ms, rs.prof_events[i - 1], rs.prof_events[i]));
        if (rs.prof_stage[i] >= 0) mine[static_cast<size_t>(rs.prof_stage[i])] += ms * 1e-3;
      }
      for (size_t k = 0; k < mine.size(); ++k) stage_s[k] = std::max(stage_s[k], mine[k]);
      rs.prof_used = 0;
    }
  }

  // ---- shape helpers ----------------------------------------------------------------------
  static int mode_index(parallel_mode m) { return m == parallel_mode::tp ? 1 : 0; }
  // Offsets of the input block's parts (rank_state::inputs).
  int64_t off_pos() const { return T_max; }
  int64_t off_seq() const { return 2 * T_max; }
  int64_t off_num() const { return 3 * T_max; }
  int64_t off_map() const { return 3 * T_max + 4; }
  int64_t off_tables() const { return 4 * T_max + 4; }
  int32_t* in_ids(rank_state& r, parallel_mode m) const { return r.inputs[mode_index(m)]; }
  int32_t* in_pos(rank_state& r, parallel_mode m) const {
    return r.inputs[mode_index(m)] + off_pos();
  }
  int32_t* in_seq(rank_state& r, parallel_mode m) const {
    return r.inputs[mode_index(m)] + off_seq();
  }
  int32_t* in_num(rank_state& r, parallel_mode m) const {
    return r.inputs[mode_index(m)] + off_num();
  }
  int32_t* in_map(rank_state& r, parallel_mode m) const {
    return r.inputs[mode_index(m)] + off_map();
  }
  int32_t* in_tables(rank_state& r, parallel_mode m) const {
    return r.inputs[mode_index(m)] + off_tables();
  }

  // The LM head's vocab slice of rank r: TP splits the vocabulary (when P | V), each rank
  // computing V/P logits of every token and its best candidate; EP computes all V for its
  // own tokens.
  std::pair<int64_t, int64_t> vocab_slice(parallel_mode attn, int r) const {
    if (attn == parallel_mode::tp && c.vocab % P == 0) return {r * (c.vocab / P), c.vocab / P};
    return {0, c.vocab};
  }

  int64_t q_heads_local(parallel_mode m) const {
    return m == parallel_mode::ep ? c.num_q_heads : c.num_q_heads / P;
  }
  int64_t kv_heads_local(parallel_mode m) const {
    return m == parallel_mode::ep ? kv.heads_per_ep_page() : kv.heads_per_tp_page();
  }

  struct moe_shape {
    int64_t num_local, first, inter, tile_rows, max_tiles;
  };
  // `optimistic` (graphs): capacity for 1.25x the expected pairs (moe_pair_capacity); a step
  // whose routing needs more sets the overflow flag and is rerun eagerly with the worst case.
  moe_shape moe_shape_of(parallel_mode layer_mode, int rank, int64_t src_tokens,
                         bool optimistic) const {
    moe_shape s{};
    if (layer_mode == parallel_mode::ep) {
      s.num_local = c.num_experts / P;
      s.first = rank * s.num_local;
      s.inter = c.intermediate;
    } else {
      s.num_local = c.num_experts;
      s.first = 0;
      s.inter = c.intermediate / P;
    }
    const int64_t pairs =
        moe_pair_capacity(src_tokens, c.top_k, c.num_experts, s.num_local, optimistic);
    s.tile_rows = std::min<int64_t>(moe_tile_rows(pairs, s.num_local) * moe_tile_scale, 1024);
    s.max_tiles = moe_max_tiles(pairs, s.num_local, s.tile_rows);
    return s;
  }

  void set_device(const rank_state& r) const { MOEBIUS_CUDA_CHECK(cudaSetDevice(r.device)); }

  // The shape of the paged attention of layer li in mode m over T rows (no pointers: what
  // the workspace size depends on).
  paged_attention_args attention_shape(parallel_mode m, int64_t li, int64_t T) const {
    const int64_t D = c.head_dim, hq = q_heads_local(m);
    paged_attention_args pa;
    pa.q_stride = qkv_ld;
    pa.q_heads = hq;
    pa.group = c.num_q_heads / c.num_kv_heads;
    pa.out_stride = hq * D;
    pa.geometry = kv;
    pa.mode = m;
    pa.layer = li;
    pa.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));
    pa.tok.table_stride = max_pages;
    pa.tok.tokens = T;
    pa.simple = simple_attention;
    pa.splits = attention_splits;
    pa.tensor_cores = tensor_core_attention;
    pa.tensor_core_min_tokens = tensor_core_min_tokens;
    return pa;
  }
  // The paged attention of layer li in mode m over T rows of rank rs (q rows in qkv).
  paged_attention_args attention_args(rank_state& rs, parallel_mode m, int64_t li, int64_t T,
                                      const float* q, float* out) const {
    paged_attention_args pa = attention_shape(m, li, T);
    pa.q = q;
    pa.out = out;
    pa.pool = rs.kv_pool;
    pa.tok = {in_seq(rs, m), in_pos(rs, m), in_tables(rs, m), max_pages, T, in_num(rs, m)};
    pa.workspace = rs.attn_work;
    return pa;
  }

  // ---- construction -----------------------------------------------------------------------
  void setup(const model_config& config, const gpu_runtime_options& options) {
    c = config;
    o = options;
    if (const char* v = std::getenv("MINI_ENGINE_NO_GRAPHS"); v != nullptr && *v == '1')
      o.capture_graphs = false;
    if (profile) o.capture_graphs = false;  // profiled steps run eagerly: nothing to replay
    if (env_is("MINI_ENGINE_HYBRID_EAGER", "1")) o.hybrid_graphs = false;
    if (!o.capture_graphs) o.hybrid_graphs = false;
    P = o.num_ranks;
    MOEBIUS_CHECK(c.expert_dtype == dtype::fp32 || c.expert_dtype == dtype::bf16 ||
                      c.expert_dtype == dtype::fp8_e4m3,
                  errc::invalid_argument, "gpu_runtime: experts must be fp32, bf16 or fp8_e4m3, not ",
                  moebius::to_string(c.expert_dtype));
    MOEBIUS_CHECK(o.fp8_compute_dtype == dtype::fp32 || o.fp8_compute_dtype == dtype::bf16,
                  errc::invalid_argument, "gpu_runtime: fp8 experts compute in fp32 or bf16, not ",
                  moebius::to_string(o.fp8_compute_dtype));
    fp8 = c.expert_dtype == dtype::fp8_e4m3;
    ct = fp8 ? o.fp8_compute_dtype : c.expert_dtype;
    MOEBIUS_CHECK(c.kv_dtype == dtype::fp32 || c.kv_dtype == dtype::bf16, errc::invalid_argument,
                  "gpu_runtime: KV must be fp32 or bf16");
    MOEBIUS_CHECK(o.dense_dtype == dtype::fp32 || o.dense_dtype == dtype::bf16,
                  errc::invalid_argument, "gpu_runtime: dense weights must be fp32 or bf16");
    MOEBIUS_CHECK(P >= 1 && c.num_q_heads % P == 0 && c.num_kv_heads >= 1 &&
                      c.num_q_heads % c.num_kv_heads == 0,
                  errc::invalid_argument, "gpu_runtime: P=", P, " must divide Hq=", c.num_q_heads,
                  " and Hkv=", c.num_kv_heads, " must divide Hq");
    MOEBIUS_CHECK(c.top_k <= c.num_experts && c.head_dim % 2 == 0, errc::invalid_argument,
                  "gpu_runtime: top_k <= E and an even head_dim needed");
    int devices = 0;
    MOEBIUS_CUDA_CHECK(cudaGetDeviceCount(&devices));
    MOEBIUS_CHECK(P <= devices, errc::invalid_argument, "gpu_runtime: ", P, " ranks need ", P,
                  " devices, found ", devices,
                  " (one rank per device: NCCL allows no two ranks of a "
                  "communicator on one device)");
    // The model's arena and KV pool, as the host runtime lays them out (model_config.hpp);
    // expert_shape's validation requires whole fp8 blocks in every TP slice.
    arena = moebius::make_arena_geometry(expert_shape_of(c), P, o.tensor_alignment,
                                         o.slot_alignment);
    moebius::validate(arena, o.cursor);
    kv = kv_geometry_of(c, P, o.num_ep_pages);
    T_max = o.max_tokens;
    for (int64_t b : o.buckets)
      MOEBIUS_CHECK(b >= 1 && b <= T_max, errc::invalid_argument, "gpu_runtime: bucket ", b,
                    " outside [1, max_tokens=", T_max, "]");
    max_pages = o.max_pages_per_seq;
    qkv_ld = (c.num_q_heads + 2 * c.num_kv_heads) * c.head_dim;
    row_layout = moe_token_layout(0, c.hidden, c.top_k, ct);

    // The expert workspace must hold the largest shape any token count up to T_max needs,
    // in either attention mode and either layer mode (tile rows change with the count).
    int64_t max_rows = 0, max_tiles = 0;
    for (int64_t t = 1; t <= T_max; ++t)
      for (int64_t src : {t, t * P})
        for (parallel_mode lm : {parallel_mode::ep, parallel_mode::tp}) {
          const moe_shape s = moe_shape_of(lm, 0, src, false);
          max_tiles = std::max(max_tiles, s.max_tiles);
          max_rows = std::max(max_rows, s.max_tiles * s.tile_rows);
        }
    const int64_t G = P * T_max, max_pairs = G * c.top_k;
    const int64_t H = c.hidden, es = moebius::dtype_bytes(ct);
    const int64_t ds = moebius::dtype_bytes(o.dense_dtype);
    const int64_t max_inter = c.intermediate;  // EP: I (TP: I/P)

    // Every per-rank buffer in one allocation (rank_buffers.hpp), the same on every rank.
    rank_buffer_sizes bs;
    bs.num_layers = c.num_layers;
    bs.hidden = H;
    bs.head_dim = c.head_dim;
    bs.q_dim = c.num_q_heads * c.head_dim;
    bs.qkv_rows = qkv_ld;
    bs.num_experts = c.num_experts;
    bs.top_k = c.top_k;
    bs.vocab = c.vocab;
    bs.dense_bytes = ds;
    bs.expert_bytes = es;
    bs.max_tokens = T_max;
    bs.gathered_rows = G;
    bs.packed_row_bytes = row_layout.row_bytes;
    bs.input_count = off_tables() + T_max * max_pages;
    bs.max_pairs = max_pairs;
    bs.max_rows = max_rows;
    bs.max_tiles = max_tiles;
    bs.max_inter = max_inter;
    bs.sort_temp_bytes = static_cast<int64_t>(moe_sort_temp_bytes(max_pairs));
    // Split attention: the largest workspace any token count and mode needs.
    for (parallel_mode m : {parallel_mode::ep, parallel_mode::tp})
      for (int64_t t = 1; t <= T_max; ++t)
        bs.attention_floats = std::max(bs.attention_floats,
                                       paged_attention_workspace_floats(attention_shape(m, 0, t)));
    if (fp8) {  // one fp8 byte per element in the arena: tensor_bytes elements per rank
      bs.dequant_w13_bytes = arena.tensor_bytes[static_cast<int>(moebius::weight_tensor::w13)] * es;
      bs.dequant_w2_bytes = arena.tensor_bytes[static_cast<int>(moebius::weight_tensor::w2)] * es;
    }
    bs.cublas_workspace_bytes = cublas_workspace_bytes;
    buffer_sizes = bs;
    buffers = make_rank_buffer_layout(bs);

    ranks.resize(static_cast<size_t>(P));
    std::vector<int> devs(static_cast<size_t>(P));
    for (int r = 0; r < P; ++r) {
      rank_state& rs = ranks[static_cast<size_t>(r)];
      rs.device = r;
      devs[static_cast<size_t>(r)] = r;
      set_device(rs);
      MOEBIUS_CUDA_CHECK(cudaStreamCreateWithFlags(&rs.stream, cudaStreamNonBlocking));
      MINI_ENGINE_CUBLAS_CHECK(cublasCreate(&rs.blas));
      rs.buffers = device_alloc<std::byte>(buffers.num_bytes(), rs.owned);
      carve(rs);
      MINI_ENGINE_CUBLAS_CHECK(cublasSetWorkspace(rs.blas, rs.cublas_workspace,
                                                  cublas_workspace_bytes));
      MINI_ENGINE_CUBLAS_CHECK(cublasSetStream(rs.blas, rs.stream));
      rs.arena = device_alloc<std::byte>(arena.total_bytes(), rs.owned);
      rs.kv_pool = device_alloc<std::byte>(kv.pool_bytes(), rs.owned);
      rs.input_count = bs.input_count;
      for (int m = 0; m < 2; ++m) {
        MOEBIUS_CUDA_CHECK(cudaMallocHost(&rs.pinned[m], static_cast<size_t>(rs.input_count) * 4));
        std::memset(rs.pinned[m], 0, static_cast<size_t>(rs.input_count) * 4);
      }
      MOEBIUS_CUDA_CHECK(cudaEventCreate(&rs.step_begin));
      MOEBIUS_CUDA_CHECK(cudaEventCreate(&rs.step_end));
    }
    if (P > 1) {
      std::vector<ncclComm_t> comms(static_cast<size_t>(P));
      MOEBIUS_NCCL_CHECK(ncclCommInitAll(comms.data(), P, devs.data()));
      for (int r = 0; r < P; ++r) {
        ranks[static_cast<size_t>(r)].comm = comms[static_cast<size_t>(r)];
        // A non-sticky error NCCL may leave behind (peer access already enabled) would be
        // taken for our first kernel launch's failure by check_launch().
        set_device(ranks[static_cast<size_t>(r)]);
        (void)cudaGetLastError();
      }
    }
  }

  // Points every buffer of rank rs at its region of rs.buffers (rank_buffers.hpp).
  void carve(rank_state& rs) const {
    std::byte* base = rs.buffers;
    const rank_buffer_layout& b = buffers;
    rs.cublas_workspace = b.cublas_workspace.in<std::byte>(base);
    rs.layers.resize(static_cast<size_t>(c.num_layers));
    for (size_t li = 0; li < rs.layers.size(); ++li) {
      const rank_buffer_layout::layer_regions& from = b.layers[li];
      rank_state::layer& l = rs.layers[li];
      l.qkv = from.qkv.in<std::byte>(base);
      l.o = from.o.in<std::byte>(base);
      l.router = from.router.in<float>(base);
      l.ln1 = from.ln1.in<float>(base);
      l.ln2 = from.ln2.in<float>(base);
      l.q_norm = from.q_norm.in<float>(base);
      l.k_norm = from.k_norm.in<float>(base);
    }
    rs.embed = b.embed.in<std::byte>(base);
    rs.final_norm = b.final_norm.in<float>(base);
    rs.lm_head = b.lm_head.in<std::byte>(base);
    rs.h = b.h.in<float>(base);
    rs.xn = b.xn.in<float>(base);
    rs.xd = b.xd.in<std::byte>(base);
    rs.qkv = b.qkv.in<float>(base);
    rs.attn = b.attn.in<float>(base);
    rs.proj = b.proj.in<float>(base);
    rs.router_logits = b.router_logits.in<float>(base);
    rs.topk_ids = b.topk_ids.in<int32_t>(base);
    rs.topk_w = b.topk_w.in<float>(base);
    rs.packed = b.packed.in<std::byte>(base);
    rs.gathered = b.gathered.in<std::byte>(base);
    rs.moe_out = b.moe_out.in<float>(base);
    rs.recv = b.recv.in<float>(base);
    rs.logits = b.logits.in<float>(base);
    rs.next = b.next.in<int32_t>(base);
    rs.next_value = b.next_value.in<float>(base);
    for (int m = 0; m < 2; ++m) rs.inputs[m] = b.inputs[m].in<int32_t>(base);
    moe_plan& p = rs.moe;
    p.keys = b.keys.in<int32_t>(base);
    p.values = b.values.in<int32_t>(base);
    p.keys_sorted = b.keys_sorted.in<int32_t>(base);
    p.values_sorted = b.values_sorted.in<int32_t>(base);
    p.expert_info = b.expert_info.in<int32_t>(base);
    p.pair_row = b.pair_row.in<int32_t>(base);
    p.x_perm = b.x_perm.in<std::byte>(base);
    p.gu = b.gu.in<float>(base);
    p.act = b.act.in<std::byte>(base);
    p.y = b.y.in<float>(base);
    p.ptr_w13 = b.ptr_w13.in<const void*>(base);
    p.ptr_x = b.ptr_x.in<const void*>(base);
    p.ptr_gu = b.ptr_gu.in<void*>(base);
    p.ptr_w2 = b.ptr_w2.in<const void*>(base);
    p.ptr_act = b.ptr_act.in<const void*>(base);
    p.ptr_y = b.ptr_y.in<void*>(base);
    p.sort_temp_bytes = static_cast<size_t>(buffer_sizes.sort_temp_bytes);
    p.sort_temp = b.sort_temp.in<std::byte>(base);
    p.overflow = b.overflow.in<int32_t>(base);
    p.hidden = c.hidden;
    p.type = ct;
    if (fp8) {
      rs.dq_w13 = b.dequant_w13.in<std::byte>(base);
      rs.dq_w2 = b.dequant_w2.in<std::byte>(base);
    }
    rs.attn_work = b.attention_workspace.in<float>(base);
  }

  // Dense weights replicated on every rank in the dense dtype; experts placed by the core
  // library (place_experts: every element to its home in its layer's mode at o.cursor, fp8
  // as codes under their block scales with the scales beside them) into a host image of each
  // rank's arena, then copied whole (what placement leaves unwritten is zero, as cudaMalloc'd
  // and cleared).
  void upload_weights(const model_weights& w) {
    validate(w);
    MOEBIUS_CHECK(w.config.num_layers == c.num_layers, errc::invalid_argument, "gpu_runtime: ",
                  w.config.num_layers, " layers of weights for a model of ", c.num_layers);
    const dtype dd = o.dense_dtype;
    auto put = [](void* dst, const std::vector<std::byte>& b) {
      MOEBIUS_CUDA_CHECK(cudaMemcpy(dst, b.data(), b.size(), cudaMemcpyHostToDevice));
    };
    auto put_f = [](float* dst, std::span<const float> s) {
      MOEBIUS_CUDA_CHECK(cudaMemcpy(dst, s.data(), s.size() * 4, cudaMemcpyHostToDevice));
    };
    const auto embed = encode(w.embed, dd), lm = encode(w.lm_head, dd);
    for (rank_state& rs : ranks) {
      set_device(rs);
      put(rs.embed, embed);
      put(rs.lm_head, lm);
      put_f(rs.final_norm, w.norm);
    }
    for (int64_t li = 0; li < c.num_layers; ++li) {
      const layer_weights& l = w.layers[static_cast<size_t>(li)];
      std::vector<float> qkv(l.q_proj.begin(), l.q_proj.end());
      qkv.insert(qkv.end(), l.k_proj.begin(), l.k_proj.end());
      qkv.insert(qkv.end(), l.v_proj.begin(), l.v_proj.end());
      const auto qkv_b = encode(qkv, dd), o_b = encode(l.o_proj, dd);
      for (rank_state& rs : ranks) {
        set_device(rs);
        const auto& dl = rs.layers[static_cast<size_t>(li)];
        put(dl.qkv, qkv_b);
        put(dl.o, o_b);
        put_f(dl.router, l.router);
        put_f(dl.ln1, l.input_layernorm);
        put_f(dl.ln2, l.post_attention_layernorm);
        put_f(dl.q_norm, l.q_norm);
        put_f(dl.k_norm, l.k_norm);
      }
    }
    std::vector<std::vector<std::byte>> images(
        static_cast<size_t>(P), std::vector<std::byte>(static_cast<size_t>(arena.total_bytes())));
    std::vector<std::span<std::byte>> spans(images.begin(), images.end());
    place_experts(w, arena, o.cursor, spans);
    for (int r = 0; r < P; ++r) {
      rank_state& rs = ranks[static_cast<size_t>(r)];
      set_device(rs);
      put(rs.arena, images[static_cast<size_t>(r)]);
    }
  }

  void random_weights(uint64_t seed) {
    const int64_t H = c.hidden, D = c.head_dim, E = c.num_experts;
    const dtype dd = o.dense_dtype;
    uint64_t s = seed;
    auto fill = [&](rank_state& rs, void* p, dtype t, int64_t n, float scale, float offset = 0.0f) {
      launch_fill_random({p, t, n, s += 0x1234567ull, scale, offset}, rs.stream);
    };
    for (rank_state& rs : ranks) {
      set_device(rs);
      fill(rs, rs.embed, dd, c.vocab * H, 1.0f);
      fill(rs, rs.lm_head, dd, c.vocab * H, 2.0f * std::sqrt(3.0f / static_cast<float>(H)));
      fill(rs, rs.final_norm, dtype::fp32, H, 0.1f, 1.0f);
      for (auto& l : rs.layers) {
        fill(rs, l.qkv, dd, qkv_ld * H, std::sqrt(3.0f / static_cast<float>(H)));
        fill(rs, l.o, dd, H * c.num_q_heads * D,
             std::sqrt(3.0f / static_cast<float>(c.num_q_heads * D)));
        fill(rs, l.router, dtype::fp32, E * H, std::sqrt(3.0f / static_cast<float>(H)));
        fill(rs, l.ln1, dtype::fp32, H, 0.1f, 1.0f);
        fill(rs, l.ln2, dtype::fp32, H, 0.1f, 1.0f);
        fill(rs, l.q_norm, dtype::fp32, D, 0.1f, 1.0f);
        fill(rs, l.k_norm, dtype::fp32, D, 0.1f, 1.0f);
      }
      // The whole arena: every slot holds plausible weights in either view. fp8: codes
      // uniform over [-448, 448) and every scale one power of two near sqrt(3/H) / 448, so the
      // weights have the usual size.
      if (fp8) {
        fill(rs, rs.arena, dtype::fp8_e4m3, arena.total_bytes(), 448.0f);
        const float sc = std::exp2(
            std::round(std::log2(std::sqrt(3.0f / static_cast<float>(H)) / fp8_e4m3_max)));
        for (int64_t slot = 0; slot < arena.num_slots(); ++slot)
          for (moebius::weight_tensor t :
               {moebius::weight_tensor::w13_scale, moebius::weight_tensor::w2_scale}) {
            const int ti = static_cast<int>(t);
            launch_fill_random({rs.arena + arena.slot_offset(slot) + arena.tensor_offset[ti],
                                dtype::fp32, arena.tensor_bytes[ti] / 4, 0, 0.0f, sc},
                               rs.stream);
          }
      } else {
        fill(rs, rs.arena, c.expert_dtype,
             arena.total_bytes() / moebius::dtype_bytes(c.expert_dtype),
             std::sqrt(3.0f / static_cast<float>(H)));
      }
      MOEBIUS_CUDA_CHECK(cudaStreamSynchronize(rs.stream));
    }
  }

  // ---- one forward pass, enqueued on every rank's stream ----------------------------------
  // T rows per rank (a bucket, or the exact count when eager); attention in `attn`, layer l's
  // experts in cursor.mode_of(l). Collectives of all ranks are grouped (one thread drives
  // every device).
  template <class F>
  void each_rank(F&& f) {
    for (int r = 0; r < P; ++r) {
      rank_state& rs = ranks[static_cast<size_t>(r)];
      set_device(rs);
      f(r, rs);
    }
  }

  void all_reduce(float* rank_state::*buf, int64_t count) {
    if (P == 1) return;
    MOEBIUS_NCCL_CHECK(ncclGroupStart());
    for (rank_state& rs : ranks) {
      float* b = rs.*buf;
      MOEBIUS_NCCL_CHECK(
          ncclAllReduce(b, b, static_cast<size_t>(count), ncclFloat, ncclSum, rs.comm, rs.stream));
    }
    MOEBIUS_NCCL_CHECK(ncclGroupEnd());
  }

  // One forward pass: layer l's attention (and, in a hybrid step, its MoE) in attn[l], over
  // that mode's input block with rows[mode_index(mode)] rows per rank; experts per the cursor.
  struct pass {
    std::vector<parallel_mode> attn;  // per layer
    moebius::arena_cursor cursor;
    int64_t rows[2] = {0, 0};  // rows per rank of each mode's token layout (mode_index)
  };

  // A pure pass: every layer's attention in `attn`, T rows per rank (graphs, static steps).
  void forward(parallel_mode attn, moebius::arena_cursor cursor, int64_t T, bool optimistic) {
    pass p;
    p.attn.assign(static_cast<size_t>(c.num_layers), attn);
    p.cursor = cursor;
    p.rows[mode_index(attn)] = T;
    forward(p, optimistic);
  }

  // The activation hand-off between two layers of different attention modes (hybrid steps):
  // the residual stream h goes from `from`'s token layout to `to`'s, through the map of
  // `to`'s input block (step() fills it).
  //   TP -> EP: every rank holds every token; it keeps its own sequences' rows.
  //   EP -> TP: every owner's rows are all-gathered ([P, T_ep] blocks in recv), then each
  //             token's row is picked out in item order.
  void hand_off(parallel_mode from, parallel_mode to, const pass& p) {
    const int64_t H = c.hidden, T_to = p.rows[mode_index(to)];
    const bool gather = from == parallel_mode::ep && P > 1;
    if (gather) {
      const size_t n = static_cast<size_t>(p.rows[mode_index(from)] * H);
      MOEBIUS_NCCL_CHECK(ncclGroupStart());
      for (rank_state& rs : ranks)
        MOEBIUS_NCCL_CHECK(ncclAllGather(rs.h, rs.recv, n, ncclFloat, rs.comm, rs.stream));
      MOEBIUS_NCCL_CHECK(ncclGroupEnd());
      mark_all(st_collectives);
    }
    each_rank([&](int, rank_state& rs) {
      launch_gather_rows({gather ? rs.recv : rs.h, in_map(rs, to), in_num(rs, to), rs.xn, T_to, H},
                         rs.stream);
      MOEBIUS_CUDA_CHECK(cudaMemcpyAsync(rs.h, rs.xn, static_cast<size_t>(T_to * H) * 4,
                                         cudaMemcpyDeviceToDevice, rs.stream));
      mark(rs, st_hand_off);
    });
  }

  // The whole pass: embedding, the layers with a hand-off wherever the mode changes, LM head.
  void forward(const pass& ps, bool optimistic) {
    MOEBIUS_CHECK(static_cast<int64_t>(ps.attn.size()) == c.num_layers, errc::internal,
                  "gpu_runtime: a pass of ", ps.attn.size(), " layers");
    embed(ps);
    for (int64_t li = 0; li < c.num_layers; ++li) {
      if (li > 0 && ps.attn[static_cast<size_t>(li)] != ps.attn[static_cast<size_t>(li - 1)])
        hand_off(ps.attn[static_cast<size_t>(li - 1)], ps.attn[static_cast<size_t>(li)], ps);
      layer(ps, li, optimistic);
    }
    lm_head(ps);
  }

  // The embedding, in the first layer's mode (its input block and rows).
  void embed(const pass& ps) {
    const parallel_mode m0 = ps.attn.front();
    const int64_t T = ps.rows[mode_index(m0)];
    each_rank([&](int, rank_state& rs) {
      launch_embedding(
          {rs.embed, o.dense_dtype, c.vocab, c.hidden, in_ids(rs, m0), T, in_num(rs, m0), rs.h},
          rs.stream);
      mark(rs, st_embed);
    });
  }

  // Layer li: attention in ps.attn[li] over that mode's input block and rows, experts in
  // ps.cursor's mode of the layer. Reads and writes only buffers fixed at construction (the
  // residual stream h in the mode's token layout), so a capture replays for any step whose
  // inputs sit in the same input block.
  void layer(const pass& ps, int64_t li, bool optimistic) {
    const int64_t H = c.hidden, D = c.head_dim, E = c.num_experts, K = c.top_k;
    const int64_t es = moebius::dtype_bytes(ct),
                  ds = moebius::dtype_bytes(o.dense_dtype);
    const dtype dd = o.dense_dtype;
    const float eps = static_cast<float>(c.rms_eps);
    {
      const parallel_mode attn = ps.attn[static_cast<size_t>(li)];
      const int64_t T = ps.rows[mode_index(attn)];
      const int64_t hq = q_heads_local(attn), hkv = kv_heads_local(attn);
      const moebius::arena_cursor cursor = ps.cursor;
      // ---- attention
      each_rank([&](int r, rank_state& rs) {
        const auto& l = rs.layers[static_cast<size_t>(li)];
        rmsnorm_args n{rs.h, H, rs.xn, H, l.ln1, T, H, 1, 0, eps};
        launch_rmsnorm(n, rs.stream);
        launch_convert({rs.xn, dtype::fp32, rs.xd, dd, T * H}, rs.stream);
        // q, k, v of this rank's heads: row slices of the whole fused weight.
        const int64_t q0 = attn == parallel_mode::ep ? 0 : r * hq;
        const int64_t kv0 = attn == parallel_mode::ep ? 0 : kv.tp_slice_of_rank(r) * hkv;
        struct part {
          int64_t w_row, rows, out_col;
        };
        const part parts[3] = {
            {q0 * D, hq * D, 0},
            {(c.num_q_heads + kv0) * D, hkv * D, hq * D},
            {(c.num_q_heads + c.num_kv_heads + kv0) * D, hkv * D, (hq + hkv) * D}};
        for (const part& pt : parts) {
          linear_args a;
          a.x = rs.xd;
          a.ldx = H;
          a.w = l.qkv + pt.w_row * H * ds;
          a.ldw = H;
          a.y = rs.qkv + pt.out_col;
          a.ldy = qkv_ld;
          a.tokens = T;
          a.out_features = pt.rows;
          a.in_features = H;
          a.type = dd;
          linear(rs.blas, a, rs.stream);
        }
        float* q = rs.qkv;
        float* k = rs.qkv + hq * D;
        float* v = rs.qkv + (hq + hkv) * D;
        launch_rmsnorm({q, qkv_ld, q, qkv_ld, l.q_norm, T * hq, D, hq, D, eps}, rs.stream);
        launch_rmsnorm({k, qkv_ld, k, qkv_ld, l.k_norm, T * hkv, D, hkv, D, eps}, rs.stream);
        launch_rope({q, qkv_ld, T, hq, D, in_pos(rs, attn), in_num(rs, attn), c.rope_theta},
                    rs.stream);
        launch_rope({k, qkv_ld, T, hkv, D, in_pos(rs, attn), in_num(rs, attn), c.rope_theta},
                    rs.stream);
        const paged_tokens tok{in_seq(rs, attn), in_pos(rs, attn), in_tables(rs, attn),
                               max_pages,          T,                 in_num(rs, attn)};
        kv_append_args ka;
        ka.k = k;
        ka.v = v;
        ka.stride = qkv_ld;
        ka.heads = hkv;
        ka.head0 = 0;
        ka.pool = rs.kv_pool;
        ka.geometry = kv;
        ka.mode = attn;
        ka.layer = li;
        ka.tok = tok;
        launch_kv_append(ka, rs.stream);
        mark(rs, st_qkv);
        launch_paged_attention(attention_args(rs, attn, li, T, q, rs.attn), rs.stream);
        mark(rs, st_attention);
        launch_convert({rs.attn, dtype::fp32, rs.xd, dd, T * hq * D}, rs.stream);
        linear_args a;  // o_proj: this rank's columns (its heads) of the whole weight
        a.x = rs.xd;
        a.ldx = hq * D;
        a.w = l.o + q0 * D * ds;
        a.ldw = c.num_q_heads * D;
        a.y = rs.proj;
        a.ldy = H;
        a.tokens = T;
        a.out_features = H;
        a.in_features = hq * D;
        a.type = dd;
        linear(rs.blas, a, rs.stream);
        mark(rs, st_o_proj);
      });
      if (attn == parallel_mode::tp && P > 1) {
        all_reduce(&rank_state::proj, T * H);
        mark_all(st_collectives);
      }
      // ---- MoE
      const parallel_mode lm = moebius::arena_geometry::mode_of(cursor, li);
      each_rank([&](int, rank_state& rs) {
        const auto& l = rs.layers[static_cast<size_t>(li)];
        launch_residual_add({rs.h, rs.proj, 1, 0, T, H}, rs.stream);
        launch_rmsnorm({rs.h, H, rs.xn, H, l.ln2, T, H, 1, 0, eps}, rs.stream);
        linear_args a;
        a.x = rs.xn;
        a.ldx = H;
        a.w = l.router;
        a.ldw = H;
        a.y = rs.router_logits;
        a.ldy = E;
        a.tokens = T;
        a.out_features = E;
        a.in_features = H;
        a.type = dtype::fp32;
        linear(rs.blas, a, rs.stream);
        launch_router_topk({rs.router_logits, T, E, K, in_num(rs, attn), rs.topk_ids, rs.topk_w},
                           rs.stream);
        moe_pack_args pk;
        pk.x = rs.xn;
        pk.ids = rs.topk_ids;
        pk.weights = rs.topk_w;
        pk.dst = row_layout;
        pk.dst.tokens = T;
        pk.rows = rs.packed;
        pk.hidden = H;
        pk.type = ct;
        launch_moe_pack(pk, rs.stream);
        mark(rs, st_router);
      });
      const bool dispatch = attn == parallel_mode::ep && P > 1;
      if (dispatch) {  // every rank gets every rank's packed tokens
        const size_t bytes = static_cast<size_t>(T * row_layout.row_bytes);
        MOEBIUS_NCCL_CHECK(ncclGroupStart());
        for (rank_state& rs : ranks)
          MOEBIUS_NCCL_CHECK(
              ncclAllGather(rs.packed, rs.gathered, bytes, ncclUint8, rs.comm, rs.stream));
        MOEBIUS_NCCL_CHECK(ncclGroupEnd());
        mark_all(st_collectives);
      }
      const int64_t src_tokens = dispatch ? P * T : T;
      each_rank([&](int r, rank_state& rs) {
        moe_tokens src = row_layout;
        src.rows = dispatch ? rs.gathered : rs.packed;
        src.tokens = src_tokens;
        const moe_shape s = moe_shape_of(lm, r, src_tokens, optimistic);
        moe_plan p = rs.moe;
        p.num_local = s.num_local;
        p.first_expert = s.first;
        p.tile_rows = s.tile_rows;
        p.max_tiles = s.max_tiles;
        p.inter = s.inter;
        auto arena_at = [&](moebius::weight_tensor t) {
          return rs.arena + arena.tensor_base(lm, li, t);
        };
        // fp8: the tile map points the GEMMs at the scratch, which the dequantization fills
        // (after the permutation has counted each expert's tokens) for the touched experts.
        p.w13 = fp8 ? rs.dq_w13 : arena_at(moebius::weight_tensor::w13);
        p.w2 = fp8 ? rs.dq_w2 : arena_at(moebius::weight_tensor::w2);
        launch_moe_permute(p, src, rs.stream);
        mark(rs, st_permute);
        if (fp8) {
          dequant_fp8_args dq;
          dq.out_type = ct;
          dq.experts = s.num_local;
          dq.block_n = c.fp8_block;
          dq.block_k = c.fp8_block;
          dq.counts = p.expert_info + p.num_local;  // moe_tile_map's per-expert counts
          dq.w = reinterpret_cast<const uint8_t*>(arena_at(moebius::weight_tensor::w13));
          dq.scale = reinterpret_cast<const float*>(arena_at(moebius::weight_tensor::w13_scale));
          dq.out = rs.dq_w13;
          dq.rows = 2 * s.inter;
          dq.cols = H;
          launch_dequant_fp8(dq, rs.stream);
          dq.w = reinterpret_cast<const uint8_t*>(arena_at(moebius::weight_tensor::w2));
          dq.scale = reinterpret_cast<const float*>(arena_at(moebius::weight_tensor::w2_scale));
          dq.out = rs.dq_w2;
          dq.rows = H;
          dq.cols = s.inter;
          launch_dequant_fp8(dq, rs.stream);
          mark(rs, st_dequant);
        }
        expert_gemms(rs.blas, p, rs.stream);
        mark(rs, st_experts);
        moe_combine_args cb;
        cb.y = p.y;
        cb.pair_row = p.pair_row;
        cb.src = src;
        cb.out = rs.moe_out;
        cb.hidden = H;
        launch_moe_combine(cb, rs.stream);
        mark(rs, st_combine);
        (void)es;
      });
      if (attn == parallel_mode::tp) {
        if (P > 1) {
          all_reduce(&rank_state::moe_out, T * H);
          mark_all(st_collectives);
        }
        each_rank([&](int, rank_state& rs) {
          launch_residual_add({rs.h, rs.moe_out, 1, 0, T, H}, rs.stream);
          mark(rs, st_combine);
        });
      } else if (!dispatch) {
        each_rank([&](int, rank_state& rs) {
          launch_residual_add({rs.h, rs.moe_out, 1, 0, T, H}, rs.stream);
          mark(rs, st_combine);
        });
      } else {  // combine: partial sums back to the tokens' owners, summed in rank order
        const size_t n = static_cast<size_t>(T * H);
        MOEBIUS_NCCL_CHECK(ncclGroupStart());
        for (int r = 0; r < P; ++r) {
          rank_state& rs = ranks[static_cast<size_t>(r)];
          for (int peer = 0; peer < P; ++peer) {
            if (peer == r) continue;
            MOEBIUS_NCCL_CHECK(
                ncclSend(rs.moe_out + peer * T * H, n, ncclFloat, peer, rs.comm, rs.stream));
            MOEBIUS_NCCL_CHECK(
                ncclRecv(rs.recv + peer * T * H, n, ncclFloat, peer, rs.comm, rs.stream));
          }
        }
        MOEBIUS_NCCL_CHECK(ncclGroupEnd());
        mark_all(st_collectives);
        each_rank([&](int r, rank_state& rs) {
          MOEBIUS_CUDA_CHECK(cudaMemcpyAsync(rs.recv + r * T * H, rs.moe_out + r * T * H, n * 4,
                                             cudaMemcpyDeviceToDevice, rs.stream));
          launch_residual_add({rs.h, rs.recv, P, T * H, T, H}, rs.stream);
          mark(rs, st_combine);
        });
      }
    }
  }

  // Final norm, LM head and argmax, in the last layer's mode.
  void lm_head(const pass& ps) {
    const int64_t H = c.hidden, ds = moebius::dtype_bytes(o.dense_dtype);
    const dtype dd = o.dense_dtype;
    const float eps = static_cast<float>(c.rms_eps);
    const parallel_mode attn = ps.attn.back();
    const int64_t T = ps.rows[mode_index(attn)];
    each_rank([&](int r, rank_state& rs) {
      const auto [v0, vn] = vocab_slice(attn, r);
      launch_rmsnorm({rs.h, H, rs.xn, H, rs.final_norm, T, H, 1, 0, eps}, rs.stream);
      launch_convert({rs.xn, dtype::fp32, rs.xd, dd, T * H}, rs.stream);
      linear_args a;
      a.x = rs.xd;
      a.ldx = H;
      a.w = rs.lm_head + v0 * H * ds;
      a.ldw = H;
      a.y = rs.logits;
      a.ldy = vn;
      a.tokens = T;
      a.out_features = vn;
      a.in_features = H;
      a.type = dd;
      linear(rs.blas, a, rs.stream);
      launch_argmax({rs.logits, T, vn, rs.next, rs.next_value}, rs.stream);
      mark(rs, st_lm_head);
    });
  }

  // Captures what `enqueue` puts on every rank's stream as one graph per rank, instantiated
  // and uploaded.
  template <class F>
  graph_set capture(F&& enqueue) {
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

  // Free device memory per rank (graph_stats: what the captures took).
  std::vector<size_t> free_bytes() {
    std::vector<size_t> f(static_cast<size_t>(P), 0);
    each_rank([&](int r, rank_state& rs) {
      MOEBIUS_CUDA_CHECK(cudaStreamSynchronize(rs.stream));
      size_t total = 0;
      MOEBIUS_CUDA_CHECK(cudaMemGetInfo(&f[static_cast<size_t>(r)], &total));
    });
    return f;
  }
  static int64_t largest_drop(const std::vector<size_t>& before, const std::vector<size_t>& after) {
    int64_t d = 0;
    for (size_t r = 0; r < before.size(); ++r)
      d = std::max(d, static_cast<int64_t>(before[r]) - static_cast<int64_t>(after[r]));
    return d;
  }

  // The whole-model graphs (mode x bucket) and, with o.hybrid_graphs, the per-layer graphs
  // (mode x bucket x layer; gpu_runtime.hpp): layer l of mode m, bucket b is the same code
  // as layer l of the whole-model graph (m, b), layer 0's with the embedding before it, layer
  // L-1's with the LM head after it.
  void capture_all() {
    using clock = std::chrono::steady_clock;
    std::vector<size_t> free0 = free_bytes();
    auto t0 = clock::now();
    for (parallel_mode m : {parallel_mode::tp, parallel_mode::ep}) {
      const moebius::arena_cursor cursor{m == parallel_mode::tp ? c.num_layers : 0};
      for (int64_t b : o.buckets) {
        graphs[{static_cast<int>(m), b}] = capture([&] { forward(m, cursor, b, true); });
        ++captures;
        ++gstats.whole_model;
      }
    }
    std::vector<size_t> free1 = free_bytes();
    gstats.whole_model_s = std::chrono::duration<double>(clock::now() - t0).count();
    gstats.whole_model_bytes = largest_drop(free0, free1);
    if (!o.hybrid_graphs) return;
    t0 = clock::now();
    for (parallel_mode m : {parallel_mode::tp, parallel_mode::ep}) {
      pass ps;
      ps.attn.assign(static_cast<size_t>(c.num_layers), m);
      ps.cursor = moebius::arena_cursor{m == parallel_mode::tp ? c.num_layers : 0};
      for (int64_t b : o.buckets) {
        ps.rows[mode_index(m)] = b;
        std::vector<graph_set>& per_layer = layer_graphs[{static_cast<int>(m), b}];
        for (int64_t li = 0; li < c.num_layers; ++li) {
          per_layer.push_back(capture([&] {
            if (li == 0) embed(ps);
            layer(ps, li, true);
            if (li == c.num_layers - 1) lm_head(ps);
          }));
          ++captures;
          ++gstats.per_layer;
        }
      }
    }
    const std::vector<size_t> free2 = free_bytes();
    gstats.per_layer_s = std::chrono::duration<double>(clock::now() - t0).count();
    gstats.per_layer_bytes = largest_drop(free1, free2);
  }

  // The smallest bucket >= need with graphs in `table` for mode m (0: none).
  template <class Table>
  int64_t bucket_for(const Table& table, parallel_mode m, int64_t need) const {
    int64_t best = 0;
    for (int64_t b : o.buckets)
      if (b >= need && (best == 0 || b < best) && table.count({static_cast<int>(m), b}) != 0)
        best = b;
    return best;
  }

  // ---- step ---------------------------------------------------------------------------------
  // Writes mode m's pinned input block of every rank from `tables` (ids, positions, rows,
  // page tables; num_tokens, map and padding are the caller's) and returns its token layout
  // (layer_schedule.hpp: TP every item on every rank, EP each rank its own sequences, in item
  // order).
  token_layout build_inputs(parallel_mode m, const moebius::kv_state& tables,
                            std::span<const step_item> items) {
    MOEBIUS_CHECK(tables.mode == m && static_cast<int>(tables.ranks.size()) == P,
                  errc::invalid_argument, "gpu_runtime::step: ", moebius::to_string(m),
                  " tables for ", P, " ranks expected, got ", moebius::to_string(tables.mode),
                  " tables for ", tables.ranks.size());
    const token_layout lay = token_layout_of(tables, P, items);
    const int mi = mode_index(m);
    for (int r = 0; r < P; ++r) {
      rank_state& rs = ranks[static_cast<size_t>(r)];
      int32_t* ids = rs.pinned[mi];
      int32_t* pos = rs.pinned[mi] + off_pos();
      int32_t* seq = rs.pinned[mi] + off_seq();
      int32_t* tab = rs.pinned[mi] + off_tables();
      MOEBIUS_CHECK(lay.count[static_cast<size_t>(r)] <= T_max, errc::capacity,
                    "gpu_runtime::step: more than max_tokens=", T_max, " tokens on rank ", r,
                    " in ", moebius::to_string(m));
      int64_t row = 0;  // the item's page-table row on this rank
      for (size_t i = 0; i < items.size(); ++i) {
        const moebius::kv_sequence* found = lay.sequence[static_cast<size_t>(r)][i];
        if (found == nullptr) continue;  // not on this rank
        const step_item& it = items[i];
        MOEBIUS_CHECK(found->num_pages() <= max_pages, errc::capacity,
                      "gpu_runtime::step: sequence ", it.seq_id, " has ", found->num_pages(),
                      " pages, max_pages_per_seq is ", max_pages);
        for (int64_t p = 0; p < found->num_pages(); ++p)
          tab[row * max_pages + p] = static_cast<int32_t>(found->pages[static_cast<size_t>(p)]);
        int64_t t = lay.first[static_cast<size_t>(r)][i];
        for (int64_t j = 0; j < static_cast<int64_t>(it.tokens.size()); ++j, ++t) {
          ids[t] = it.tokens[static_cast<size_t>(j)];
          pos[t] = static_cast<int32_t>(it.start_position + j);
          seq[t] = static_cast<int32_t>(row);
        }
        ++row;
      }
    }
    return lay;
  }

  std::vector<int32_t> step(const step_layout& layout, std::span<const step_item> items,
                            std::vector<std::vector<float>>* logits_out) {
    const bool hybrid = layout.hybrid();
    MOEBIUS_CHECK(hybrid || layout.tables != nullptr, errc::invalid_argument,
                  "gpu_runtime::step: no page tables");
    moebius::validate(arena, layout.cursor);
    bool decode = true;
    for (size_t i = 0; i < items.size(); ++i) {
      MOEBIUS_CHECK(!items[i].tokens.empty(), errc::invalid_argument, "gpu_runtime::step: item ",
                    i, " has no tokens");
      decode = decode && items[i].tokens.size() == 1;
    }
    // The mode of every layer (static: the tables' mode; hybrid: TP below the cursor).
    pass ps;
    ps.cursor = layout.cursor;
    ps.attn = layer_modes(layout, c.num_layers);
    bool used[2] = {false, false};
    token_layout lay[2];
    for (int64_t l = 0; l < c.num_layers; ++l) {
      const parallel_mode m = ps.attn[static_cast<size_t>(l)];
      if (used[mode_index(m)]) continue;
      used[mode_index(m)] = true;
      lay[mode_index(m)] = build_inputs(m, layout.tables_of_layer(l), items);
      ps.rows[mode_index(m)] = lay[mode_index(m)].max_count();
    }
    const parallel_mode first = ps.attn.front(), last = ps.attn.back();
    const bool pure =
        !hybrid && ((first == parallel_mode::tp && layout.cursor.tp_layers == c.num_layers) ||
                    (first == parallel_mode::ep && layout.cursor.tp_layers == 0));
    const graph_set* gs = nullptr;
    // A hybrid decode step through per-layer graphs: layer l's graph, from the graphs of its
    // mode at that mode's bucket (each mode picks its own: TP holds every token, EP a rank's).
    std::vector<const graph_set*> layer_gs;
    prof_on = profile;  // a profiled step runs eagerly (events between the stages)
    for (rank_state& rs : ranks) rs.prof_used = 0;
    if (decode && pure && o.capture_graphs && !profile) {
      const int64_t T = bucket_for(graphs, first, ps.rows[mode_index(first)]);
      if (T != 0) {
        gs = &graphs.at({static_cast<int>(first), T});
        ps.rows[mode_index(first)] = T;
      }
    }
    if (decode && hybrid && o.hybrid_graphs && !hybrid_eager && !profile) {
      int64_t T[2] = {0, 0};
      bool fits = true;
      for (parallel_mode m : {parallel_mode::ep, parallel_mode::tp}) {
        if (!used[mode_index(m)]) continue;
        T[mode_index(m)] = bucket_for(layer_graphs, m, ps.rows[mode_index(m)]);
        fits = fits && T[mode_index(m)] != 0;
      }
      if (fits) {  // else (a batch beyond the largest bucket) eagerly
        for (int mi = 0; mi < 2; ++mi)
          if (used[mi]) ps.rows[mi] = T[mi];
        for (int64_t l = 0; l < c.num_layers; ++l) {
          const parallel_mode m = ps.attn[static_cast<size_t>(l)];
          layer_gs.push_back(
              &layer_graphs.at({static_cast<int>(m), T[mode_index(m)]})[static_cast<size_t>(l)]);
        }
      }
    }
    // Hand-off maps (both modes in one step; layer_schedule.hpp): the EP block's map gives
    // each EP row its row in the TP layout (TP -> EP: a rank keeps its own rows); the TP
    // block's map gives each TP row its row in the all-gathered EP blocks, owner * rows_ep +
    // its EP row (EP -> TP), rows_ep being the EP rows per rank this step runs (its bucket).
    if (used[0] && used[1]) {
      const hand_off_maps maps =
          hand_off_maps_of(lay[mode_index(parallel_mode::tp)], lay[mode_index(parallel_mode::ep)],
                           items, ps.rows[mode_index(parallel_mode::ep)]);
      for (int r = 0; r < P; ++r) {
        rank_state& rs = ranks[static_cast<size_t>(r)];
        const auto& to_ep = maps.to_ep[static_cast<size_t>(r)];
        const auto& to_tp = maps.to_tp[static_cast<size_t>(r)];
        std::copy(to_ep.begin(), to_ep.end(), rs.pinned[mode_index(parallel_mode::ep)] + off_map());
        std::copy(to_tp.begin(), to_tp.end(), rs.pinned[mode_index(parallel_mode::tp)] + off_map());
      }
    }
    // The row each sampled item's logits come from, in the last layer's layout: (rank, row).
    const std::vector<std::pair<int, int64_t>> sample_at =
        last_token_rows(lay[mode_index(last)], items);
    // Inputs: padding rows get token 0, position 0, row 0, map 0 (num_tokens makes kernels
    // skip them).
    each_rank([&](int r, rank_state& rs) {
      MOEBIUS_CUDA_CHECK(cudaEventRecord(rs.step_begin, rs.stream));
      mark(rs, -1);
      for (int mi = 0; mi < 2; ++mi) {
        if (!used[mi]) continue;
        int32_t* in = rs.pinned[mi];
        const int64_t n = lay[mi].count[static_cast<size_t>(r)];
        for (int64_t t = n; t < ps.rows[mi]; ++t) {
          in[t] = 0;
          in[off_pos() + t] = 0;
          in[off_seq() + t] = 0;
          in[off_map() + t] = 0;
        }
        in[off_num()] = static_cast<int32_t>(n);
        MOEBIUS_CUDA_CHECK(cudaMemcpyAsync(rs.inputs[mi], in,
                                           static_cast<size_t>(rs.input_count) * 4,
                                           cudaMemcpyHostToDevice, rs.stream));
      }
      mark(rs, st_upload);
    });
    if (hybrid) ++hybrid_steps;
    if (gs != nullptr || !layer_gs.empty()) {
      // Every rank's graph is launched before anything waits: the graphs' NCCL calls need
      // all ranks running (a copy to pageable memory would block the host on rank 0 first).
      each_rank([&](int r, rank_state& rs) {
        MOEBIUS_CUDA_CHECK(cudaMemsetAsync(rs.moe.overflow, 0, 4, rs.stream));
        if (gs != nullptr)
          MOEBIUS_CUDA_CHECK(cudaGraphLaunch(gs->exec[static_cast<size_t>(r)], rs.stream));
      });
      // Hybrid: layer by layer, each layer's graph on every rank before the next layer's (the
      // order of the NCCL calls inside them is the same on every rank), the hand-off eagerly
      // where the mode changes (its maps and row counts are this step's: the buckets above).
      for (size_t l = 0; l < layer_gs.size(); ++l) {
        if (l > 0 && ps.attn[l] != ps.attn[l - 1]) hand_off(ps.attn[l - 1], ps.attn[l], ps);
        each_rank([&](int r, rank_state& rs) {
          MOEBIUS_CUDA_CHECK(cudaGraphLaunch(layer_gs[l]->exec[static_cast<size_t>(r)], rs.stream));
        });
      }
      if (hybrid) ++hybrid_graph_steps;
      std::vector<int32_t> overflow(static_cast<size_t>(P), 0);
      each_rank([&](int r, rank_state& rs) {
        MOEBIUS_CUDA_CHECK(cudaStreamSynchronize(rs.stream));
        MOEBIUS_CUDA_CHECK(cudaMemcpy(&overflow[static_cast<size_t>(r)], rs.moe.overflow, 4,
                                      cudaMemcpyDeviceToHost));
      });
      ++replays;
      // Routing beyond the graph's expert capacity on some rank: the step's outputs are
      // incomplete. Run it again eagerly with the worst-case capacity: it writes every
      // layer's K/V of the step's positions again (the first pass's values after the
      // overflow were wrong), and reads nothing else the first pass wrote.
      if (std::any_of(overflow.begin(), overflow.end(), [](int32_t f) { return f != 0; })) {
        forward(ps, false);
        ++reruns;
      }
    } else {
      forward(ps, false);
      ++eager;
    }
    // Results (every rank's work is enqueued: waiting on one rank at a time is safe now).
    const int64_t T = ps.rows[mode_index(last)];
    std::vector<std::vector<int32_t>> next(static_cast<size_t>(P));
    std::vector<std::vector<float>> next_value(static_cast<size_t>(P));
    each_rank([&](int r, rank_state& rs) {
      next[static_cast<size_t>(r)].resize(static_cast<size_t>(T));
      next_value[static_cast<size_t>(r)].resize(static_cast<size_t>(T));
      MOEBIUS_CUDA_CHECK(cudaMemcpyAsync(next[static_cast<size_t>(r)].data(), rs.next,
                                         static_cast<size_t>(T) * 4, cudaMemcpyDeviceToHost,
                                         rs.stream));
      MOEBIUS_CUDA_CHECK(cudaMemcpyAsync(next_value[static_cast<size_t>(r)].data(), rs.next_value,
                                         static_cast<size_t>(T) * 4, cudaMemcpyDeviceToHost,
                                         rs.stream));
      mark(rs, st_download);
      MOEBIUS_CUDA_CHECK(cudaEventRecord(rs.step_end, rs.stream));
    });
    each_rank([&](int, rank_state& rs) { MOEBIUS_CUDA_CHECK(cudaStreamSynchronize(rs.stream)); });
    if (prof_on) {
      collect_profile();
      prof_on = false;
    }
    // The step's device time: the longest rank, from its first upload to its last download.
    last_step_s = 0;
    each_rank([&](int, rank_state& rs) {
      float ms = 0;
      MOEBIUS_CUDA_CHECK(cudaEventElapsedTime(&ms, rs.step_begin, rs.step_end));
      last_step_s = std::max(last_step_s, static_cast<double>(ms) * 1e-3);
    });
    std::vector<int32_t> out(items.size(), -1);
    if (logits_out != nullptr) logits_out->clear();
    const bool split_vocab = vocab_slice(last, 0).second != c.vocab;
    for (size_t i = 0; i < items.size(); ++i) {
      if (!items[i].sample) continue;
      const auto [owner, t] = sample_at[i];
      // TP with a split vocabulary: every rank's candidate for token t; the largest logit
      // wins, ties to the lower vocab id (slices ascend with the rank).
      const int lo = split_vocab ? 0 : owner, hi = split_vocab ? P - 1 : owner;
      float best = 0.0f;
      for (int r = lo; r <= hi; ++r) {
        const float v = next_value[static_cast<size_t>(r)][static_cast<size_t>(t)];
        const int32_t id = static_cast<int32_t>(vocab_slice(last, r).first) +
                           next[static_cast<size_t>(r)][static_cast<size_t>(t)];
        if (r == lo || v > best) {
          best = v;
          out[i] = id;
        }
      }
      if (logits_out != nullptr) {
        std::vector<float> row(static_cast<size_t>(c.vocab));
        for (int r = lo; r <= hi; ++r) {
          rank_state& rs = ranks[static_cast<size_t>(r)];
          const auto [v0, vn] = vocab_slice(last, r);
          set_device(rs);
          MOEBIUS_CUDA_CHECK(cudaMemcpy(row.data() + v0, rs.logits + t * vn,
                                        static_cast<size_t>(vn) * 4, cudaMemcpyDeviceToHost));
        }
        logits_out->push_back(std::move(row));
      }
    }
    return out;
  }

  ~impl() {
    for (auto& [key, gs] : graphs)
      for (cudaGraphExec_t e : gs.exec) cudaGraphExecDestroy(e);
    for (auto& [key, per_layer] : layer_graphs)
      for (graph_set& gs : per_layer)
        for (cudaGraphExec_t e : gs.exec) cudaGraphExecDestroy(e);
    for (rank_state& rs : ranks) {
      cudaSetDevice(rs.device);
      if (rs.comm != nullptr) ncclCommDestroy(rs.comm);
      if (rs.blas != nullptr) cublasDestroy(rs.blas);
      for (int32_t* p : rs.pinned)
        if (p != nullptr) cudaFreeHost(p);
      if (rs.step_begin != nullptr) cudaEventDestroy(rs.step_begin);
      if (rs.step_end != nullptr) cudaEventDestroy(rs.step_end);
      for (cudaEvent_t e : rs.prof_events) cudaEventDestroy(e);
      for (void* p : rs.owned) cudaFree(p);
      if (rs.stream != nullptr) cudaStreamDestroy(rs.stream);
    }
  }
};

gpu_runtime::gpu_runtime(const model_weights& weights, const gpu_runtime_options& options)
    : impl_(std::make_unique<impl>()) {
  impl_->setup(weights.config, options);
  impl_->upload_weights(weights);
  if (impl_->o.capture_graphs) impl_->capture_all();
}

gpu_runtime::gpu_runtime(const model_config& config, uint64_t seed,
                         const gpu_runtime_options& options)
    : impl_(std::make_unique<impl>()) {
  impl_->setup(config, options);
  impl_->random_weights(seed);
  if (impl_->o.capture_graphs) impl_->capture_all();
}

gpu_runtime::~gpu_runtime() = default;

std::vector<int32_t> gpu_runtime::step(const step_layout& layout, std::span<const step_item> items,
                                       std::vector<std::vector<float>>* logits) {
  return impl_->step(layout, items, logits);
}

std::vector<moebius::rank_memory> gpu_runtime::memory() const {
  std::vector<moebius::rank_memory> m;
  for (const rank_state& rs : impl_->ranks)
    m.push_back(moebius::rank_memory::on_device(rs.device, rs.arena, impl_->arena.total_bytes(),
                                                rs.kv_pool, impl_->kv.pool_bytes()));
  return m;
}
const moebius::arena_geometry& gpu_runtime::arena() const {
  return impl_->arena;
}
const moebius::kv_geometry& gpu_runtime::kv() const {
  return impl_->kv;
}
int gpu_runtime::num_ranks() const {
  return impl_->P;
}
bool gpu_runtime::graphs_enabled() const {
  return impl_->o.capture_graphs;
}
int64_t gpu_runtime::captures() const {
  return impl_->captures;
}
int64_t gpu_runtime::graph_replays() const {
  return impl_->replays;
}
int64_t gpu_runtime::eager_steps() const {
  return impl_->eager;
}
int64_t gpu_runtime::overflow_reruns() const {
  return impl_->reruns;
}
int64_t gpu_runtime::hybrid_steps() const {
  return impl_->hybrid_steps;
}
int64_t gpu_runtime::hybrid_graph_steps() const {
  return impl_->hybrid_graph_steps;
}
bool gpu_runtime::hybrid_graphs_enabled() const {
  return impl_->o.hybrid_graphs;
}
void gpu_runtime::set_hybrid_eager(bool eager) {
  impl_->hybrid_eager = eager;
}
gpu_runtime::graph_stats gpu_runtime::graph_statistics() const {
  return impl_->gstats;
}
double gpu_runtime::measured_step_s() const {
  return impl_->last_step_s;
}
bool gpu_runtime::profiling() const {
  return impl_->profile;
}
std::vector<std::pair<std::string, double>> gpu_runtime::stage_times() const {
  std::vector<std::pair<std::string, double>> out;
  for (size_t k = 0; k < impl_->stage_s.size(); ++k)
    out.emplace_back(impl::stage_names[k], impl_->stage_s[k]);
  return out;
}

void gpu_runtime::fill_kv_random(uint64_t seed) {
  for (rank_state& rs : impl_->ranks) {
    MOEBIUS_CUDA_CHECK(cudaSetDevice(rs.device));
    launch_fill_random({rs.kv_pool, impl_->c.kv_dtype,
                        impl_->kv.pool_bytes() / moebius::dtype_bytes(impl_->c.kv_dtype),
                        seed + static_cast<uint64_t>(rs.device), 1.0f, 0.0f},
                       rs.stream);
    MOEBIUS_CUDA_CHECK(cudaStreamSynchronize(rs.stream));
  }
}

}  // namespace mini_engine::gpu
