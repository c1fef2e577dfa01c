// Construction and teardown of the GPU runtime: the checks, the arena and KV geometries, each
// rank's stream, cuBLAS handle, buffers (one allocation, rank_buffers.hpp), arena and KV pool,
// and the NCCL communicators (one rank per device) or the ranks' meeting events (virtual
// ranks).

#include <algorithm>
#include <cstring>
#include <moebius/cuda/nccl_check.hpp>
#include <moebius/error.hpp>

#include "runtime_impl.hpp"

namespace mini_engine::gpu {

using moebius::dtype;
using moebius::errc;
using moebius::parallel_mode;

namespace {

// count elements of T, at least one, zeroed (kernels read nothing uninitialised).
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

// ---- construction -----------------------------------------------------------------------
void gpu_runtime::impl::setup(const model_config& config, const gpu_runtime_options& options) {
  c = config;
  o = options;
  if (o.profile) o.capture_graphs = false;  // profiled steps run eagerly: nothing to replay
  if (!o.capture_graphs) o.hybrid_graphs = false;
  MOEBIUS_CHECK(o.moe_tile_scale >= 1 && o.moe_tile_scale <= 64 &&
                    (o.moe_tile_scale & (o.moe_tile_scale - 1)) == 0,
                errc::invalid_argument,
                "gpu_runtime: moe_tile_scale must be a power of two in [1, 64], not ",
                o.moe_tile_scale);
  P = o.num_ranks;
  MOEBIUS_CHECK(o.emulated_dcp == 1 ||
                    (o.emulated_dcp > 1 && o.num_ranks == 1 && c.num_kv_heads == 1 &&
                     o.emulated_dcp * c.num_q_heads * c.head_dim <= c.hidden),
                errc::invalid_argument, "gpu_runtime: emulated_dcp=", o.emulated_dcp,
                " needs P=1 (not ", o.num_ranks, "), Hkv=1 (not ", c.num_kv_heads,
                ") and dcp x Hq x D = ", o.emulated_dcp * c.num_q_heads * c.head_dim,
                " <= H = ", c.hidden);
  int devices = 0;
  MOEBIUS_CUDA_CHECK(cudaGetDeviceCount(&devices));
  virt = place_virtual(devices);
  fp8 = c.expert_dtype == dtype::fp8_e4m3;
  ct = fp8 ? o.fp8_compute_dtype : c.expert_dtype;
  check_supported();
  // The model's arena and KV pool, as the host runtime lays them out (model_config.hpp);
  // expert_shape's validation requires whole fp8 blocks in every TP slice. The TP view's dcp:
  // the library's rule (dcp | P/Hkv, 1 when Hkv >= P) refuses another, naming it.
  arena = moebius::make_arena_geometry(expert_shape_of(c), P, o.tensor_alignment, o.slot_alignment);
  moebius::validate(arena, o.cursor);
  kv_built = moebius::with_dcp(kv_geometry_of(c, P, o.num_ep_pages), o.dcp);
  dcps = o.serve_dcps;
  dcps.push_back(o.dcp);
  std::sort(dcps.begin(), dcps.end());
  dcps.erase(std::unique(dcps.begin(), dcps.end()), dcps.end());
  for (int64_t d : dcps) {
    (void)moebius::with_dcp(kv_built, d);  // refuses a dcp the geometry does not allow, by name
    // dcp > 1: the q gather and the merge of the partial attentions read the peers' buffers in
    // device memory (device_collectives.cu); over NCCL they are not written (they would be two
    // grouped send/recv exchanges within each DCP set of strided q and partial blocks).
    MOEBIUS_CHECK(d == 1 || virt, errc::invalid_argument, "gpu_runtime: dcp=", d,
                  " runs on virtual ranks only (placement virtual_ranks, or automatic with more "
                  "ranks than devices); one rank per device (P=", P, ") supports dcp=1 only");
  }
  kv = kv_built;
  T_max = o.max_tokens;
  for (int64_t b : o.buckets)
    MOEBIUS_CHECK(b >= 1 && b <= T_max, errc::invalid_argument, "gpu_runtime: bucket ", b,
                  " outside [1, max_tokens=", T_max, "]");
  max_pages = o.max_pages_per_seq;
  qkv_ld = (c.num_q_heads + 2 * c.num_kv_heads) * c.head_dim;
  row_layout = moe_token_layout(0, c.hidden, c.top_k, ct);
  lay_out_buffers();
  // The arena and KV pool of every rank from the library's memory owner: allocated once, never
  // moved (the captured graphs read their addresses), zero-filled.
  std::vector<int> devices_of_ranks(static_cast<size_t>(P));
  for (int r = 0; r < P; ++r) devices_of_ranks[static_cast<size_t>(r)] = virt ? 0 : r;
  memory = std::make_unique<moebius::device_deployment_memory>(arena, kv_built, devices_of_ranks,
                                                               std::vector<int>{}, moebius::memory_fill::zero,
                                                               o.cursor);
  ranks.resize(static_cast<size_t>(P));
  for (int r = 0; r < P; ++r) init_rank(r);
  if (P > 1 && !virt) init_nccl();
  // The layer events a step asked for them hands out (step_options::layer_events), local rank r
  // = rank r.
  layer_events.emplace(c.num_layers, static_cast<size_t>(P));
  for (int r = 0; r < P; ++r)
    for (int64_t l = 0; l < c.num_layers; ++l)
      layer_events->set(l, static_cast<size_t>(r), ranks[static_cast<size_t>(r)].layer_done[static_cast<size_t>(l)]);
}

// Whether the P ranks are virtual (gpu_runtime_options::placement): asked for, or (automatic)
// more ranks than `devices`. One rank is never virtual: it has no collectives.
bool gpu_runtime::impl::place_virtual(int devices) const {
  if (P == 1) return false;
  switch (o.placement) {
    case rank_placement::virtual_ranks:
      return true;
    case rank_placement::one_per_device:
      return false;
    case rank_placement::automatic:
      break;
  }
  return P > devices;
}

// Throws errc::invalid_argument for a model or options this runtime cannot run: dtypes, P
// not dividing the heads, one rank per device with more ranks than devices, more virtual ranks
// than the all-reduce sums (sum_ranks_args::max_parts).
void gpu_runtime::impl::check_supported() const {
  MOEBIUS_CHECK(c.expert_dtype == dtype::fp32 || c.expert_dtype == dtype::bf16 ||
                    c.expert_dtype == dtype::fp8_e4m3,
                errc::invalid_argument, "gpu_runtime: experts must be fp32, bf16 or fp8_e4m3, not ",
                moebius::to_string(c.expert_dtype));
  MOEBIUS_CHECK(o.fp8_compute_dtype == dtype::fp32 || o.fp8_compute_dtype == dtype::bf16,
                errc::invalid_argument, "gpu_runtime: fp8 experts compute in fp32 or bf16, not ",
                moebius::to_string(o.fp8_compute_dtype));
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
  MOEBIUS_CHECK(virt || P <= devices, errc::invalid_argument, "gpu_runtime: ", P, " ranks need ", P,
                " devices, found ", devices,
                " (one rank per device: NCCL allows no two ranks of a "
                "communicator on one device; virtual ranks run them all on one)");
  MOEBIUS_CHECK(!virt || (devices >= 1 && P <= sum_ranks_args::max_parts), errc::invalid_argument,
                "gpu_runtime: ", P, " virtual ranks need a device and at most ",
                sum_ranks_args::max_parts, " ranks (found ", devices, " devices)");
}

// The sizes of every per-rank buffer and their layout in one allocation (rank_buffers.hpp),
// the same on every rank, large enough for every bucket and mode.
void gpu_runtime::impl::lay_out_buffers() {
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
  // Split attention: the largest workspace any token count, mode and serve dcp needs.
  for (int64_t d : dcps) {
    serve_at_dcp(d);
    for (parallel_mode m : {parallel_mode::ep, parallel_mode::tp})
      for (int64_t t = 1; t <= T_max; ++t)
        bs.attention_floats = std::max(bs.attention_floats,
                                       paged_attention_workspace_floats(attention_shape(m, 0, t)));
  }
  serve_at_dcp(o.dcp);
  if (fp8) {  // one fp8 byte per element in the arena: tensor_bytes elements per rank
    bs.dequant_w13_bytes = arena.tensor_bytes[static_cast<int>(moebius::weight_tensor::w13)] * es;
    bs.dequant_w2_bytes = arena.tensor_bytes[static_cast<int>(moebius::weight_tensor::w2)] * es;
  }
  bs.cublas_workspace_bytes = cublas_workspace_bytes;
  if (virt) bs.reduce_scratch_floats = T_max * H;  // the all-reduces: [T, H] at most
  if (dcps.back() > 1) {  // the largest DCP set's q heads, partials, LSEs
    const int64_t set_heads = dcps.back() * q_heads_local(parallel_mode::tp);
    bs.dcp_head_floats = T_max * set_heads * c.head_dim;
    bs.dcp_lse_floats = T_max * set_heads;
  }
  buffer_sizes = bs;
  buffers = make_rank_buffer_layout(bs);
}

// Rank r on device r (virtual ranks: on device 0): its stream, cuBLAS handle (workspace and
// stream set), buffers, arena, KV pool, pinned input mirrors, step events (and the virtual
// ranks' meeting event). A virtual rank owns all of these as a real one does.
void gpu_runtime::impl::init_rank(int r) {
  rank_state& rs = ranks[static_cast<size_t>(r)];
  rs.device = virt ? 0 : r;
  set_device(rs);
  MOEBIUS_CUDA_CHECK(cudaStreamCreateWithFlags(&rs.stream, cudaStreamNonBlocking));
  MINI_ENGINE_CUBLAS_CHECK(cublasCreate(&rs.blas));
  rs.buffers = device_alloc<std::byte>(buffers.num_bytes(), rs.owned);
  carve(rs);
  MINI_ENGINE_CUBLAS_CHECK(
      cublasSetWorkspace(rs.blas, rs.cublas_workspace, cublas_workspace_bytes));
  MINI_ENGINE_CUBLAS_CHECK(cublasSetStream(rs.blas, rs.stream));
  rs.arena = memory->memory(r).space(moebius::memory_space::arena).data();
  rs.kv_pool = memory->memory(r).space(moebius::memory_space::kv_pool).data();
  rs.input_count = buffer_sizes.input_count;
  for (int m = 0; m < 2; ++m) {
    MOEBIUS_CUDA_CHECK(cudaMallocHost(&rs.pinned[m], static_cast<size_t>(rs.input_count) * 4));
    std::memset(rs.pinned[m], 0, static_cast<size_t>(rs.input_count) * 4);
  }
  MOEBIUS_CUDA_CHECK(cudaEventCreate(&rs.step_begin));
  MOEBIUS_CUDA_CHECK(cudaEventCreate(&rs.step_end));
  if (virt) MOEBIUS_CUDA_CHECK(cudaEventCreateWithFlags(&rs.meet, cudaEventDisableTiming));
  rs.layer_done.assign(static_cast<size_t>(c.num_layers), nullptr);
  for (cudaEvent_t& e : rs.layer_done)
    MOEBIUS_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
}

// One NCCL communicator per rank (P > 1), all created at once by this one process.
void gpu_runtime::impl::init_nccl() {
  std::vector<int> devs(static_cast<size_t>(P));
  for (int r = 0; r < P; ++r) devs[static_cast<size_t>(r)] = r;
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

// Points every buffer of rank rs at its region of rs.buffers (rank_buffers.hpp).
void gpu_runtime::impl::carve(rank_state& rs) const {
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
  if (b.reduce_scratch.bytes > 0) rs.reduce_scratch = b.reduce_scratch.in<float>(base);
  if (b.dcp_q.bytes > 0) {
    rs.dcp_q = b.dcp_q.in<float>(base);
    rs.dcp_out = b.dcp_out.in<float>(base);
    rs.dcp_lse = b.dcp_lse.in<float>(base);
  }
}

gpu_runtime::impl::~impl() {
  graphs.release();
  for (rank_state& rs : ranks) {
    cudaSetDevice(rs.device);
    if (rs.comm != nullptr) ncclCommDestroy(rs.comm);
    if (rs.blas != nullptr) cublasDestroy(rs.blas);
    for (int32_t* p : rs.pinned)
      if (p != nullptr) cudaFreeHost(p);
    if (rs.step_begin != nullptr) cudaEventDestroy(rs.step_begin);
    if (rs.step_end != nullptr) cudaEventDestroy(rs.step_end);
    if (rs.meet != nullptr) cudaEventDestroy(rs.meet);
    for (cudaEvent_t e : rs.layer_done)
      if (e != nullptr) cudaEventDestroy(e);
    rs.prof.release();
    for (void* p : rs.owned) cudaFree(p);
    if (rs.stream != nullptr) cudaStreamDestroy(rs.stream);
  }
}

}  // namespace mini_engine::gpu
