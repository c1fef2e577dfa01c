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

#include "../numerics.hpp"
#include "gemm.hpp"
#include "gpu_runtime.hpp"
#include "kernels/kernels.hpp"

namespace mini_engine::gpu {

using moebius::dtype;
using moebius::errc;
using moebius::parallel_mode;

gpu_model_config qwen3_30b_a3b_config() {
  gpu_model_config c;
  c.num_layers = 48;
  c.hidden = 2048;
  c.num_q_heads = 32;
  c.num_kv_heads = 4;
  c.head_dim = 128;
  c.num_experts = 128;
  c.top_k = 8;
  c.intermediate = 768;
  c.vocab = 151936;
  c.rope_theta = 1e6;
  c.rms_eps = 1e-6;
  c.expert_dtype = dtype::bf16;
  c.kv_dtype = dtype::bf16;
  c.page_size = 16;
  return c;
}

namespace {

uint16_t host_to_bf16(float f) {
  const uint32_t u = std::bit_cast<uint32_t>(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// Host floats as `t` bytes.
std::vector<std::byte> encode(std::span<const float> v, dtype t) {
  std::vector<std::byte> out(v.size() * static_cast<size_t>(moebius::dtype_bytes(t)));
  for (size_t i = 0; i < v.size(); ++i) {
    if (t == dtype::bf16) {
      const uint16_t b = host_to_bf16(v[i]);
      std::memcpy(out.data() + 2 * i, &b, 2);
    } else {
      std::memcpy(out.data() + 4 * i, &v[i], 4);
    }
  }
  return out;
}

// fp8 experts ([experts, rows, cols], each value a code times its block's scale, as
// round_experts leaves them) as e4m3 codes. Throws errc::invalid_argument naming the tensor
// and element when a value is not exactly code x scale (the arena could not hold it).
std::vector<std::byte> encode_fp8(std::span<const float> v, std::span<const float> scale,
                                  int64_t experts, int64_t rows, int64_t cols, int64_t block,
                                  const char* what) {
  std::vector<std::byte> out(v.size());
  const int64_t sr = rows / block, sc = cols / block;
  for (int64_t e = 0; e < experts; ++e)
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t k = 0; k < cols; ++k) {
        const int64_t i = (e * rows + r) * cols + k;
        const float s = scale[static_cast<size_t>((e * sr + r / block) * sc + k / block)];
        const float x = v[static_cast<size_t>(i)];
        const uint8_t code = to_fp8_e4m3(x / s);
        MOEBIUS_CHECK(s > 0 && std::isfinite(s) && from_fp8_e4m3(code) * s == x,
                      errc::invalid_argument, "gpu_runtime: fp8 ", what, "[", e, ", ", r, ", ",
                      k, "] = ", x, " is not an e4m3 code times its block scale ", s,
                      " (round the experts first: round_experts)");
        out[static_cast<size_t>(i)] = static_cast<std::byte>(code);
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
  std::vector<void*> owned;

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
  gpu_model_config c;
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

  // The paged attention of layer li in mode m over T rows of rank rs (q rows in qkv).
  paged_attention_args attention_args(rank_state& rs, parallel_mode m, int64_t li, int64_t T,
                                      const float* q, float* out) const {
    const int64_t D = c.head_dim, hq = q_heads_local(m);
    paged_attention_args pa;
    pa.q = q;
    pa.q_stride = qkv_ld;
    pa.q_heads = hq;
    pa.group = c.num_q_heads / c.num_kv_heads;
    pa.out = out;
    pa.out_stride = hq * D;
    pa.pool = rs.kv_pool;
    pa.geometry = kv;
    pa.mode = m;
    pa.layer = li;
    pa.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));
    pa.tok = {in_seq(rs, m), in_pos(rs, m), in_tables(rs, m), max_pages, T, in_num(rs, m)};
    pa.simple = simple_attention;
    pa.workspace = rs.attn_work;
    pa.splits = attention_splits;
    pa.tensor_cores = tensor_core_attention;
    pa.tensor_core_min_tokens = tensor_core_min_tokens;
    return pa;
  }

  // ---- construction -----------------------------------------------------------------------
  void setup(const gpu_model_config& config, const gpu_runtime_options& options) {
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
    moebius::expert_shape shape;
    shape.num_layers = c.num_layers;
    shape.num_experts = c.num_experts;
    shape.hidden = c.hidden;
    shape.intermediate = c.intermediate;
    shape.weight_dtype = c.expert_dtype;
    if (fp8) {  // expert_shape's validation (below) requires whole blocks in every TP slice
      shape.block_scales = true;
      shape.scale_block_n = c.fp8_block;
      shape.scale_block_k = c.fp8_block;
      shape.scale_dtype = dtype::fp32;
    }
    arena = moebius::make_arena_geometry(shape, P, o.tensor_alignment, o.slot_alignment);
    moebius::validate(arena, o.cursor);
    kv = moebius::make_kv_geometry(c.num_layers, c.num_kv_heads, c.head_dim, c.page_size,
                                   o.num_ep_pages, P, c.kv_dtype, moebius::kv_layout::hnd);
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

    ranks.resize(static_cast<size_t>(P));
    std::vector<int> devs(static_cast<size_t>(P));
    for (int r = 0; r < P; ++r) {
      rank_state& rs = ranks[static_cast<size_t>(r)];
      rs.device = r;
      devs[static_cast<size_t>(r)] = r;
      set_device(rs);
      MOEBIUS_CUDA_CHECK(cudaStreamCreateWithFlags(&rs.stream, cudaStreamNonBlocking));
      MINI_ENGINE_CUBLAS_CHECK(cublasCreate(&rs.blas));
      void* ws = device_alloc<std::byte>(cublas_workspace_bytes, rs.owned);
      MINI_ENGINE_CUBLAS_CHECK(cublasSetWorkspace(rs.blas, ws, cublas_workspace_bytes));
      MINI_ENGINE_CUBLAS_CHECK(cublasSetStream(rs.blas, rs.stream));
      rs.arena = device_alloc<std::byte>(arena.total_bytes(), rs.owned);
      rs.kv_pool = device_alloc<std::byte>(kv.pool_bytes(), rs.owned);
      rs.layers.resize(static_cast<size_t>(c.num_layers));
      const int64_t D = c.head_dim, qd = c.num_q_heads * D;
      for (auto& l : rs.layers) {
        l.qkv = device_alloc<std::byte>(qkv_ld * H * ds, rs.owned);
        l.o = device_alloc<std::byte>(H * qd * ds, rs.owned);
        l.router = device_alloc<float>(c.num_experts * H, rs.owned);
        l.ln1 = device_alloc<float>(H, rs.owned);
        l.ln2 = device_alloc<float>(H, rs.owned);
        l.q_norm = device_alloc<float>(D, rs.owned);
        l.k_norm = device_alloc<float>(D, rs.owned);
      }
      rs.embed = device_alloc<std::byte>(c.vocab * H * ds, rs.owned);
      rs.final_norm = device_alloc<float>(H, rs.owned);
      rs.lm_head = device_alloc<std::byte>(c.vocab * H * ds, rs.owned);

      rs.h = device_alloc<float>(T_max * H, rs.owned);
      rs.xn = device_alloc<float>(T_max * H, rs.owned);
      rs.xd = device_alloc<std::byte>(T_max * std::max(H, qd) * ds, rs.owned);
      rs.qkv = device_alloc<float>(T_max * qkv_ld, rs.owned);
      rs.attn = device_alloc<float>(T_max * qd, rs.owned);
      rs.proj = device_alloc<float>(T_max * H, rs.owned);
      rs.router_logits = device_alloc<float>(T_max * c.num_experts, rs.owned);
      rs.topk_ids = device_alloc<int32_t>(T_max * c.top_k, rs.owned);
      rs.topk_w = device_alloc<float>(T_max * c.top_k, rs.owned);
      rs.packed = device_alloc<std::byte>(T_max * row_layout.row_bytes, rs.owned);
      rs.gathered = device_alloc<std::byte>(G * row_layout.row_bytes, rs.owned);
      rs.moe_out = device_alloc<float>(G * H, rs.owned);
      rs.recv = device_alloc<float>(G * H, rs.owned);
      rs.logits = device_alloc<float>(T_max * c.vocab, rs.owned);
      rs.next = device_alloc<int32_t>(T_max, rs.owned);
      rs.next_value = device_alloc<float>(T_max, rs.owned);
      rs.input_count = off_tables() + T_max * max_pages;
      for (int m = 0; m < 2; ++m) {
        rs.inputs[m] = device_alloc<int32_t>(rs.input_count, rs.owned);
        MOEBIUS_CUDA_CHECK(cudaMallocHost(&rs.pinned[m], static_cast<size_t>(rs.input_count) * 4));
        std::memset(rs.pinned[m], 0, static_cast<size_t>(rs.input_count) * 4);
      }
      MOEBIUS_CUDA_CHECK(cudaEventCreate(&rs.step_begin));
      MOEBIUS_CUDA_CHECK(cudaEventCreate(&rs.step_end));

      moe_plan& p = rs.moe;
      p.keys = device_alloc<int32_t>(max_pairs, rs.owned);
      p.values = device_alloc<int32_t>(max_pairs, rs.owned);
      p.keys_sorted = device_alloc<int32_t>(max_pairs, rs.owned);
      p.values_sorted = device_alloc<int32_t>(max_pairs, rs.owned);
      p.expert_info = device_alloc<int32_t>(3 * c.num_experts + 1, rs.owned);
      p.pair_row = device_alloc<int32_t>(max_pairs, rs.owned);
      p.x_perm = device_alloc<std::byte>(max_rows * H * es, rs.owned);
      p.gu = device_alloc<float>(max_rows * 2 * max_inter, rs.owned);
      p.act = device_alloc<std::byte>(max_rows * max_inter * es, rs.owned);
      p.y = device_alloc<float>(max_rows * H, rs.owned);
      p.ptr_w13 = device_alloc<const void*>(max_tiles, rs.owned);
      p.ptr_x = device_alloc<const void*>(max_tiles, rs.owned);
      p.ptr_gu = device_alloc<void*>(max_tiles, rs.owned);
      p.ptr_w2 = device_alloc<const void*>(max_tiles, rs.owned);
      p.ptr_act = device_alloc<const void*>(max_tiles, rs.owned);
      p.ptr_y = device_alloc<void*>(max_tiles, rs.owned);
      p.sort_temp_bytes = moe_sort_temp_bytes(max_pairs);
      p.sort_temp = device_alloc<std::byte>(static_cast<int64_t>(p.sort_temp_bytes), rs.owned);
      p.overflow = device_alloc<int32_t>(1, rs.owned);
      p.hidden = H;
      p.type = ct;
      if (fp8) {  // one fp8 byte per element in the arena: tensor_bytes elements per rank
        rs.dq_w13 = device_alloc<std::byte>(
            arena.tensor_bytes[static_cast<int>(moebius::weight_tensor::w13)] * es, rs.owned);
        rs.dq_w2 = device_alloc<std::byte>(
            arena.tensor_bytes[static_cast<int>(moebius::weight_tensor::w2)] * es, rs.owned);
      }
      // Split attention: the largest workspace any token count and mode needs.
      int64_t attn_floats = 0;
      for (parallel_mode m : {parallel_mode::ep, parallel_mode::tp})
        for (int64_t t = 1; t <= T_max; ++t)
          attn_floats = std::max(attn_floats, paged_attention_workspace_floats(
                                                  attention_args(rs, m, 0, t, nullptr, nullptr)));
      rs.attn_work = device_alloc<float>(attn_floats, rs.owned);
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

  void upload_weights(const host_weights_view& w) {
    const int64_t H = c.hidden, D = c.head_dim, E = c.num_experts, I = c.intermediate;
    MOEBIUS_CHECK(static_cast<int64_t>(w.layers.size()) == c.num_layers, errc::invalid_argument,
                  "gpu_runtime: ", w.layers.size(), " layers of weights for a model of ",
                  c.num_layers);
    auto need = [](std::span<const float> s, int64_t n, const char* what) {
      MOEBIUS_CHECK(static_cast<int64_t>(s.size()) == n, errc::invalid_argument,
                    "gpu_runtime: ", what, " has ", s.size(), " elements, expected ", n);
    };
    need(w.embed, c.vocab * H, "embed");
    need(w.norm, H, "norm");
    need(w.lm_head, c.vocab * H, "lm_head");
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
      const host_layer_view& l = w.layers[static_cast<size_t>(li)];
      need(l.q_proj, c.num_q_heads * D * H, "q_proj");
      need(l.k_proj, c.num_kv_heads * D * H, "k_proj");
      need(l.v_proj, c.num_kv_heads * D * H, "v_proj");
      need(l.o_proj, H * c.num_q_heads * D, "o_proj");
      need(l.router, E * H, "router");
      need(l.w13, E * 2 * I * H, "w13");
      need(l.w2, E * H * I, "w2");
      need(l.input_layernorm, H, "input_layernorm");
      need(l.post_attention_layernorm, H, "post_attention_layernorm");
      need(l.q_norm, D, "q_norm");
      need(l.k_norm, D, "k_norm");
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
      // Experts: every element to its home in the layer's mode (weight_view.locate); fp8:
      // each weight as its code under its block's scale, the scales beside them.
      const parallel_mode m = moebius::arena_geometry::mode_of(o.cursor, li);
      if (fp8) {
        const int64_t b = c.fp8_block;
        need(l.w13_scale, E * (2 * I / b) * (H / b), "w13_scale");
        need(l.w2_scale, E * (H / b) * (I / b), "w2_scale");
      }
      for (moebius::weight_tensor t : moebius::all_weight_tensors) {
        const bool is_scale =
            t == moebius::weight_tensor::w13_scale || t == moebius::weight_tensor::w2_scale;
        if (is_scale && !fp8) continue;
        const std::span<const float> src = t == moebius::weight_tensor::w13   ? l.w13
                                           : t == moebius::weight_tensor::w2  ? l.w2
                                           : t == moebius::weight_tensor::w13_scale ? l.w13_scale
                                                                                    : l.w2_scale;
        const auto g = moebius::geometry_of(arena.shape, t);
        const dtype td = is_scale ? dtype::fp32 : c.expert_dtype;
        const int64_t es = moebius::dtype_bytes(td);
        const int64_t bytes = arena.tensor_bytes[static_cast<int>(t)];
        std::vector<std::vector<std::byte>> img(static_cast<size_t>(P),
                                                std::vector<std::byte>(static_cast<size_t>(bytes)));
        const auto encoded =
            td == dtype::fp8_e4m3
                ? encode_fp8(src,
                             t == moebius::weight_tensor::w13 ? l.w13_scale : l.w2_scale,
                             g.num_experts, g.rows, g.cols, c.fp8_block, moebius::to_string(t))
                : encode(src, td);
        const auto ep = moebius::make_view<parallel_mode::ep>(arena.shape, t, P);
        const auto tp = moebius::make_view<parallel_mode::tp>(arena.shape, t, P);
        int64_t idx = 0;
        for (int64_t e = 0; e < g.num_experts; ++e)
          for (int64_t row = 0; row < g.rows; ++row)
            for (int64_t col = 0; col < g.cols; ++col, ++idx) {
              const moebius::element_location at =
                  m == parallel_mode::ep ? ep.locate(e, row, col) : tp.locate(e, row, col);
              std::memcpy(img[static_cast<size_t>(at.rank)].data() + at.offset * es,
                          encoded.data() + idx * es, static_cast<size_t>(es));
            }
        for (int r = 0; r < P; ++r) {
          rank_state& rs = ranks[static_cast<size_t>(r)];
          set_device(rs);
          put(rs.arena + arena.tensor_base(m, li, t), img[static_cast<size_t>(r)]);
        }
      }
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
  // One mode's token layout of a step: per rank, the first row of each item (-1: not there)
  // and the rows used. TP: every rank holds every item, in item order; EP: each rank its own
  // sequences (their EP owner), in item order.
  struct token_layout {
    std::vector<std::vector<int64_t>> first;  // [rank][item]
    std::vector<int64_t> count;               // [rank]
  };

  // Writes mode m's pinned input block of every rank from `tables` (ids, positions, rows,
  // page tables; num_tokens, map and padding are the caller's) and returns the layout.
  token_layout build_inputs(parallel_mode m, const moebius::kv_state& tables,
                            std::span<const step_item> items) {
    MOEBIUS_CHECK(tables.mode == m && static_cast<int>(tables.ranks.size()) == P,
                  errc::invalid_argument, "gpu_runtime::step: ", moebius::to_string(m),
                  " tables for ", P, " ranks expected, got ", moebius::to_string(tables.mode),
                  " tables for ", tables.ranks.size());
    token_layout lay;
    lay.first.assign(static_cast<size_t>(P), std::vector<int64_t>(items.size(), -1));
    lay.count.assign(static_cast<size_t>(P), 0);
    const int mi = mode_index(m);
    for (int r = 0; r < P; ++r) {
      rank_state& rs = ranks[static_cast<size_t>(r)];
      int32_t* ids = rs.pinned[mi];
      int32_t* pos = rs.pinned[mi] + off_pos();
      int32_t* seq = rs.pinned[mi] + off_seq();
      int32_t* tab = rs.pinned[mi] + off_tables();
      const auto& seqs = tables.ranks[static_cast<size_t>(r)].sequences;
      int64_t row = 0, t = 0;
      for (size_t i = 0; i < items.size(); ++i) {
        const step_item& it = items[i];
        auto found = std::lower_bound(
            seqs.begin(), seqs.end(), it.seq_id,
            [](const moebius::kv_sequence& s, int64_t id) { return s.seq_id < id; });
        if (found == seqs.end() || found->seq_id != it.seq_id) continue;  // not on this rank
        const auto n = static_cast<int64_t>(it.tokens.size());
        MOEBIUS_CHECK(found->num_tokens >= it.start_position + n, errc::invalid_argument,
                      "gpu_runtime::step: sequence ", it.seq_id, " holds ", found->num_tokens,
                      " tokens in the ", moebius::to_string(m), " tables, the step needs ",
                      it.start_position + n);
        MOEBIUS_CHECK(found->num_pages() <= max_pages, errc::capacity,
                      "gpu_runtime::step: sequence ", it.seq_id, " has ", found->num_pages(),
                      " pages, max_pages_per_seq is ", max_pages);
        MOEBIUS_CHECK(t + n <= T_max, errc::capacity, "gpu_runtime::step: more than max_tokens=",
                      T_max, " tokens on rank ", r, " in ", moebius::to_string(m));
        for (int64_t p = 0; p < found->num_pages(); ++p)
          tab[row * max_pages + p] = static_cast<int32_t>(found->pages[static_cast<size_t>(p)]);
        lay.first[static_cast<size_t>(r)][i] = t;
        for (int64_t j = 0; j < n; ++j, ++t) {
          ids[t] = it.tokens[static_cast<size_t>(j)];
          pos[t] = static_cast<int32_t>(it.start_position + j);
          seq[t] = static_cast<int32_t>(row);
        }
        ++row;
      }
      lay.count[static_cast<size_t>(r)] = t;
    }
    for (size_t i = 0; i < items.size(); ++i) {
      int64_t holders = 0;
      for (int r = 0; r < P; ++r) holders += lay.first[static_cast<size_t>(r)][i] >= 0;
      MOEBIUS_CHECK(m == parallel_mode::tp ? holders == P : holders == 1, errc::invalid_argument,
                    "gpu_runtime::step: sequence ", items[i].seq_id, " is on ", holders,
                    " ranks of the ", moebius::to_string(m), " tables");
    }
    return lay;
  }

  // The EP owner of item i (its one rank in the EP layout).
  static int owner_of(const token_layout& ep, size_t i) {
    for (size_t r = 0; r < ep.first.size(); ++r)
      if (ep.first[r][i] >= 0) return static_cast<int>(r);
    return -1;
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
    for (int64_t l = 0; l < c.num_layers; ++l) ps.attn.push_back(layout.attention_mode(l));
    bool used[2] = {false, false};
    token_layout lay[2];
    for (int64_t l = 0; l < c.num_layers; ++l) {
      const parallel_mode m = ps.attn[static_cast<size_t>(l)];
      if (used[mode_index(m)]) continue;
      used[mode_index(m)] = true;
      lay[mode_index(m)] = build_inputs(m, layout.tables_of_layer(l), items);
      int64_t need = 1;
      for (int64_t n : lay[mode_index(m)].count) need = std::max(need, n);
      ps.rows[mode_index(m)] = need;
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
    // Hand-off maps (both modes in one step): the EP block's map gives each EP row its row in
    // the TP layout (TP -> EP: a rank keeps its own rows); the TP block's map gives each TP
    // row its row in the all-gathered EP blocks, owner * rows_ep + its EP row (EP -> TP).
    if (used[0] && used[1]) {
      const token_layout& ep = lay[mode_index(parallel_mode::ep)];
      const token_layout& tp = lay[mode_index(parallel_mode::tp)];
      const int64_t rows_ep = ps.rows[mode_index(parallel_mode::ep)];
      for (int r = 0; r < P; ++r) {
        rank_state& rs = ranks[static_cast<size_t>(r)];
        int32_t* map_ep = rs.pinned[mode_index(parallel_mode::ep)] + off_map();
        int32_t* map_tp = rs.pinned[mode_index(parallel_mode::tp)] + off_map();
        for (size_t i = 0; i < items.size(); ++i) {
          const auto n = static_cast<int64_t>(items[i].tokens.size());
          const int owner = owner_of(ep, i);
          const int64_t e0 = ep.first[static_cast<size_t>(owner)][i];
          const int64_t t0 = tp.first[static_cast<size_t>(r)][i];
          for (int64_t j = 0; j < n; ++j) {
            if (owner == r) map_ep[e0 + j] = static_cast<int32_t>(t0 + j);
            map_tp[t0 + j] = static_cast<int32_t>(owner * rows_ep + e0 + j);
          }
        }
      }
    }
    // The row each sampled item's logits come from, in the last layer's layout: (rank, row).
    std::vector<std::pair<int, int64_t>> sample_at(items.size(), {-1, -1});
    for (size_t i = 0; i < items.size(); ++i) {
      const token_layout& ll = lay[mode_index(last)];
      const int r = last == parallel_mode::ep ? owner_of(ll, i) : 0;
      sample_at[i] = {r, ll.first[static_cast<size_t>(r)][i] +
                             static_cast<int64_t>(items[i].tokens.size()) - 1};
    }
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

gpu_runtime::gpu_runtime(const gpu_model_config& config, const host_weights_view& weights,
                         const gpu_runtime_options& options)
    : impl_(std::make_unique<impl>()) {
  impl_->setup(config, options);
  impl_->upload_weights(weights);
  if (impl_->o.capture_graphs) impl_->capture_all();
}

gpu_runtime::gpu_runtime(const gpu_model_config& config, uint64_t seed,
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
