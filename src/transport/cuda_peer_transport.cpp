#include "moebius/transport/cuda_peer_transport.hpp"

#include <cuda.h>
#include <cuda_runtime_api.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <list>
#include <utility>

#include "moebius/cuda/check.hpp"
#include "moebius/cuda/peer_kernels.hpp"
#include "moebius/error.hpp"

namespace moebius {
namespace {
// Hardware queues (CUDA_DEVICE_MAX_CONNECTIONS) each device of this process has.
int hardware_queues() {
  const char* v = std::getenv("CUDA_DEVICE_MAX_CONNECTIONS");
  const int n = v != nullptr ? std::atoi(v) : 0;
  return n > 0 ? n : 8;  // the CUDA default
}

}  // namespace

void request_hardware_queues_for_virtual_ranks() {
  setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", /*overwrite=*/0);
}

const char* to_string(engine_policy policy) {
  switch (policy) {
    case engine_policy::automatic: return "automatic";
    case engine_policy::copy_engine: return "copy_engine";
    case engine_policy::sm_kernel: return "sm_kernel";
  }
  return "unknown";
}

namespace {

using clock_type = std::chrono::steady_clock;

double seconds_since(clock_type::time_point t0) {
  return std::chrono::duration<double>(clock_type::now() - t0).count();
}

// Restores the calling thread's current device when it goes out of scope.
class device_guard {
 public:
  device_guard() { MOEBIUS_CUDA_CHECK(cudaGetDevice(&saved_)); }
  ~device_guard() { (void)cudaSetDevice(saved_); }
  device_guard(const device_guard&) = delete;
  device_guard& operator=(const device_guard&) = delete;

 private:
  int saved_ = 0;
};

// Each barrier allocation: flags[num_ranks] (written by peers), then the rank's status.
size_t status_offset(int num_ranks) {
  return (static_cast<size_t>(num_ranks) * sizeof(uint64_t) + 255) / 256 * 256;
}
size_t barrier_alloc_bytes(int num_ranks) {
  return status_offset(num_ranks) + sizeof(barrier_status);
}

// One copy-engine call with resolved pointers.
struct ce_op {
  void* dst;
  size_t dst_pitch;
  const void* src;
  size_t src_pitch;
  size_t width;
  size_t height;
};

// Work of one rank in one phase.
struct phase_work {
  size_t ce_begin = 0;   // range in prepared impl's ce_ops of this rank
  size_t ce_end = 0;
  int64_t desc_offset = 0;  // first descriptor in the rank's device array
  int64_t num_descs = 0;
  int64_t num_chunks = 0;
  int blocks = 0;
};

struct prepared_rank {
  int rank = 0;
  int device = 0;
  std::vector<ce_op> ce_ops;
  std::vector<phase_work> phases;
  peer_copy_desc* d_descs = nullptr;  // all phases' descriptors, on `device`
  int64_t num_descs = 0;
  int64_t ce_count = 0;
  int64_t sm_count = 0;
  cudaGraph_t graph = nullptr;          // the rank's whole plan, captured (use_cuda_graphs)
  cudaGraphExec_t graph_exec = nullptr;
};

uint64_t mix(uint64_t h, uint64_t v) {
  h ^= v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
  return h;
}

uint64_t hash_plan(const plan& p) {
  uint64_t h = mix(0, static_cast<uint64_t>(p.num_ranks));
  for (const plan_phase& ph : p.phases) {
    h = mix(h, ph.ops.size());
    for (const copy_op& op : ph.ops) {
      h = mix(h, static_cast<uint64_t>(op.src_offset));
      h = mix(h, static_cast<uint64_t>(op.dst_offset));
      h = mix(h, static_cast<uint64_t>(op.rows));
      h = mix(h, static_cast<uint64_t>(op.row_bytes));
      h = mix(h, static_cast<uint64_t>(op.src_pitch));
      h = mix(h, static_cast<uint64_t>(op.dst_pitch));
      h = mix(h, (static_cast<uint64_t>(static_cast<uint32_t>(op.src_rank)) << 32) |
                     static_cast<uint32_t>(op.dst_rank));
      h = mix(h, (static_cast<uint64_t>(op.src_space) << 8) | static_cast<uint64_t>(op.dst_space));
    }
  }
  return h;
}

// What one rank publishes to its peers in multi_process mode.
struct ipc_rank_info {
  static constexpr uint32_t k_magic = 0x4d4f4542;  // "MOEB"
  static constexpr int k_handles = num_memory_spaces + 1;  // spaces, then barrier flags
  uint32_t magic = 0;
  int32_t rank = 0;
  int32_t num_ranks = 0;
  int32_t device = 0;
  int32_t pid = 0;
  uint32_t present = 0;  // bit i: handle i is valid
  int64_t offset[k_handles] = {};  // byte offset of the space inside its allocation
  int64_t bytes[k_handles] = {};
  cudaIpcMemHandle_t handle[k_handles] = {};
};
static_assert(sizeof(ipc_rank_info) <= cuda_ipc_rank_info_bytes,
              "ipc_rank_info must fit the advertised all-gather size");

}  // namespace

// ---------------------------------------------------------------------------------------------

struct cuda_prepared_plan::impl {
  const cuda_peer_transport::impl* owner = nullptr;
  int num_ranks = 0;
  int64_t num_phases = 0;
  int64_t num_ops = 0;
  std::vector<int64_t> ops_per_phase;
  std::vector<prepared_rank> ranks;  // local ranks only
  std::vector<int64_t> ce_ops_of_rank;  // [num_ranks]
  std::vector<int64_t> sm_ops_of_rank;  // [num_ranks]
  std::vector<std::vector<int>> blocks;  // [rank][phase], empty for remote ranks
  int max_blocks = 0;
  int64_t descriptor_bytes = 0;
  bool graphs = false;  // every rank has graph_exec

  ~impl() {
    for (prepared_rank& r : ranks) {
      (void)cudaSetDevice(r.device);
      if (r.graph_exec != nullptr) (void)cudaGraphExecDestroy(r.graph_exec);
      if (r.graph != nullptr) (void)cudaGraphDestroy(r.graph);
      if (r.d_descs != nullptr) (void)cudaFree(r.d_descs);
    }
  }
};

cuda_prepared_plan::cuda_prepared_plan(std::unique_ptr<impl> state) : impl_(std::move(state)) {}
cuda_prepared_plan::~cuda_prepared_plan() {
  int saved = 0;
  const bool have = cudaGetDevice(&saved) == cudaSuccess;
  impl_.reset();
  if (have) (void)cudaSetDevice(saved);
}
int64_t cuda_prepared_plan::num_phases() const { return impl_->num_phases; }
int64_t cuda_prepared_plan::num_ops() const { return impl_->num_ops; }
int64_t cuda_prepared_plan::copy_engine_ops(int rank) const {
  MOEBIUS_CHECK(rank >= 0 && rank < impl_->num_ranks, errc::out_of_range, "rank ", rank,
                " outside [0, ", impl_->num_ranks, ")");
  return impl_->ce_ops_of_rank[static_cast<size_t>(rank)];
}
int64_t cuda_prepared_plan::sm_kernel_ops(int rank) const {
  MOEBIUS_CHECK(rank >= 0 && rank < impl_->num_ranks, errc::out_of_range, "rank ", rank,
                " outside [0, ", impl_->num_ranks, ")");
  return impl_->sm_ops_of_rank[static_cast<size_t>(rank)];
}
int cuda_prepared_plan::sm_kernel_blocks(int rank, int64_t phase) const {
  MOEBIUS_CHECK(rank >= 0 && rank < impl_->num_ranks, errc::out_of_range, "rank ", rank,
                " outside [0, ", impl_->num_ranks, ")");
  MOEBIUS_CHECK(phase >= 0 && phase < impl_->num_phases, errc::out_of_range, "phase ", phase,
                " outside [0, ", impl_->num_phases, ")");
  const std::vector<int>& b = impl_->blocks[static_cast<size_t>(rank)];
  return b.empty() ? 0 : b[static_cast<size_t>(phase)];
}
int cuda_prepared_plan::max_sm_kernel_blocks() const { return impl_->max_blocks; }
int64_t cuda_prepared_plan::device_descriptor_bytes() const { return impl_->descriptor_bytes; }
bool cuda_prepared_plan::uses_cuda_graphs() const { return impl_->graphs; }

// ---------------------------------------------------------------------------------------------

struct cuda_peer_transport::impl {
  struct rank_state {
    int device = -1;                         // local ranks: CUDA ordinal
    void* base[num_memory_spaces] = {};      // pointer usable in this process
    int64_t bytes[num_memory_spaces] = {};
    bool local = false;
    cudaStream_t stream = nullptr;
    bool own_stream = false;
    // The fused kernel runs here, forked from `stream`, when a phase also has copy-engine
    // ops: the copy engines push the remote slabs while the SMs copy the local share. Only
    // for a rank alone on its device: a forked branch (inside a CUDA graph it runs on a
    // stream the driver picks) could share a hardware queue with another virtual rank's
    // spinning barrier and stall it.
    bool alone_on_device = true;
    cudaStream_t side_stream = nullptr;
    cudaEvent_t fork_event = nullptr;
    cudaEvent_t join_event = nullptr;
    void* barrier_alloc = nullptr;           // local ranks: flags + status (cudaMalloc)
    uint64_t* flags = nullptr;               // this rank's flags as mapped in this process
    barrier_status* status = nullptr;        // local ranks
    uint64_t** d_peer_flags = nullptr;       // local ranks: [P] on the rank's device
    int sm_count = 0;
  };
  struct cache_entry {
    uint64_t hash;
    plan key;
    std::shared_ptr<const cuda_prepared_plan> prepared;
  };

  cuda_peer_config config;
  int num_ranks = 0;
  int process_rank = -1;
  std::vector<rank_state> ranks;
  std::vector<std::pair<int, void*>> ipc_mappings;  // (device, pointer) to cudaIpcCloseMemHandle
  int64_t min_bytes[num_memory_spaces] = {};
  uint64_t epoch = 0;  // barrier arrivals used so far (all executes)
  int64_t completed = 0;
  std::optional<fault_point> fault;
  cuda_execute_stats stats;
  std::list<cache_entry> cache;  // most recently used first

  ~impl() {
    int saved = 0;
    const bool have = cudaGetDevice(&saved) == cudaSuccess;
    cache.clear();
    for (rank_state& r : ranks) {
      if (!r.local) continue;
      (void)cudaSetDevice(r.device);
      if (r.stream != nullptr) (void)cudaStreamSynchronize(r.stream);
      if (r.own_stream && r.stream != nullptr) (void)cudaStreamDestroy(r.stream);
      if (r.side_stream != nullptr) (void)cudaStreamDestroy(r.side_stream);
      if (r.fork_event != nullptr) (void)cudaEventDestroy(r.fork_event);
      if (r.join_event != nullptr) (void)cudaEventDestroy(r.join_event);
      if (r.d_peer_flags != nullptr) (void)cudaFree(r.d_peer_flags);
    }
    for (const auto& [device, p] : ipc_mappings) {
      (void)cudaSetDevice(device);
      (void)cudaIpcCloseMemHandle(p);
    }
    for (rank_state& r : ranks) {
      if (r.local && r.barrier_alloc != nullptr) {
        (void)cudaSetDevice(r.device);
        (void)cudaFree(r.barrier_alloc);
      }
    }
    if (have) (void)cudaSetDevice(saved);
  }

  void check_config() const {
    const cuda_peer_config& c = config;
    MOEBIUS_CHECK(c.sm_kernel_threads >= 32 && c.sm_kernel_threads <= peer_copy_max_threads &&
                      c.sm_kernel_threads % 32 == 0,
                  errc::invalid_argument, "sm_kernel_threads must be a multiple of 32 in [32, ",
                  peer_copy_max_threads, "] (sm_kernel_threads=", c.sm_kernel_threads, ")");
    MOEBIUS_CHECK(c.sm_kernel_blocks >= 0, errc::invalid_argument,
                  "sm_kernel_blocks must be >= 0 (sm_kernel_blocks=", c.sm_kernel_blocks, ")");
    MOEBIUS_CHECK(c.sm_chunk_bytes >= 16 && c.sm_chunk_bytes <= (int64_t{1} << 30) &&
                      (c.sm_chunk_bytes & (c.sm_chunk_bytes - 1)) == 0,
                  errc::invalid_argument,
                  "sm_chunk_bytes must be a power of two in [16, 2^30] (sm_chunk_bytes=",
                  c.sm_chunk_bytes, ")");
    MOEBIUS_CHECK(c.barrier_timeout_ns > 0, errc::invalid_argument,
                  "barrier_timeout_ns must be > 0 (barrier_timeout_ns=", c.barrier_timeout_ns, ")");
    MOEBIUS_CHECK(c.copy_engine_min_op_bytes >= 0 && c.copy_engine_max_ops_per_phase >= 0,
                  errc::invalid_argument,
                  "copy_engine_min_op_bytes and copy_engine_max_ops_per_phase must be >= 0 (",
                  c.copy_engine_min_op_bytes, ", ", c.copy_engine_max_ops_per_phase, ")");
    MOEBIUS_CHECK(c.max_cached_plans >= 0, errc::invalid_argument,
                  "max_cached_plans must be >= 0 (max_cached_plans=", c.max_cached_plans, ")");
  }

  // Stream, barrier allocation, SM count of a local rank (its device is current).
  void init_local(rank_state& r, cudaStream_t user_stream) {
    r.local = true;
    MOEBIUS_CUDA_CHECK(cudaSetDevice(r.device));
    MOEBIUS_CUDA_CHECK(
        cudaDeviceGetAttribute(&r.sm_count, cudaDevAttrMultiProcessorCount, r.device));
    if (user_stream != nullptr) {
      r.stream = user_stream;
    } else {
      MOEBIUS_CUDA_CHECK(cudaStreamCreateWithFlags(&r.stream, cudaStreamNonBlocking));
      r.own_stream = true;
    }
    if (r.alone_on_device) {
      MOEBIUS_CUDA_CHECK(cudaStreamCreateWithFlags(&r.side_stream, cudaStreamNonBlocking));
      MOEBIUS_CUDA_CHECK(cudaEventCreateWithFlags(&r.fork_event, cudaEventDisableTiming));
      MOEBIUS_CUDA_CHECK(cudaEventCreateWithFlags(&r.join_event, cudaEventDisableTiming));
    }
    MOEBIUS_CUDA_CHECK(cudaMalloc(&r.barrier_alloc, barrier_alloc_bytes(num_ranks)));
    // On the rank's own (non-blocking) stream and waited for: a legacy-stream memset could
    // still be pending when a peer's first arrival lands.
    MOEBIUS_CUDA_CHECK(
        cudaMemsetAsync(r.barrier_alloc, 0, barrier_alloc_bytes(num_ranks), r.stream));
    MOEBIUS_CUDA_CHECK(cudaStreamSynchronize(r.stream));
    r.flags = static_cast<uint64_t*>(r.barrier_alloc);
    r.status = reinterpret_cast<barrier_status*>(static_cast<std::byte*>(r.barrier_alloc) +
                                                 status_offset(num_ranks));
  }

  // Uploads every rank's flag pointer (as mapped here) to each local rank's device.
  void upload_peer_flags() {
    std::vector<uint64_t*> h(static_cast<size_t>(num_ranks));
    for (int j = 0; j < num_ranks; ++j) h[static_cast<size_t>(j)] = ranks[static_cast<size_t>(j)].flags;
    for (rank_state& r : ranks) {
      if (!r.local) continue;
      MOEBIUS_CUDA_CHECK(cudaSetDevice(r.device));
      MOEBIUS_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&r.d_peer_flags),
                                    h.size() * sizeof(uint64_t*)));
      MOEBIUS_CUDA_CHECK(cudaMemcpyAsync(r.d_peer_flags, h.data(), h.size() * sizeof(uint64_t*),
                                         cudaMemcpyHostToDevice, r.stream));
      MOEBIUS_CUDA_CHECK(cudaStreamSynchronize(r.stream));
    }
  }

  void compute_min_bytes() {
    for (int s = 0; s < num_memory_spaces; ++s) {
      min_bytes[s] = ranks[0].bytes[s];
      for (const rank_state& r : ranks) min_bytes[s] = std::min(min_bytes[s], r.bytes[s]);
    }
  }

  void validate(const plan& p) const {
    MOEBIUS_CHECK(p.num_ranks == num_ranks, errc::invalid_argument, "plan is for ", p.num_ranks,
                  " ranks but the transport has ", num_ranks);
    moebius::validate(p, min_bytes);
  }

  // Engine choice for the ops of rank `r` in one phase: true = copy engine.
  std::vector<bool> choose_engines(const std::vector<const copy_op*>& ops) const {
    std::vector<bool> ce(ops.size(), false);
    auto ce_capable = [](const copy_op& op) {
      // cudaMemcpy2D needs pitches >= width (a plan may read one source row repeatedly).
      return op.rows == 1 || (op.src_pitch >= op.row_bytes && op.dst_pitch >= op.row_bytes);
    };
    switch (config.engine) {
      case engine_policy::sm_kernel: break;
      case engine_policy::copy_engine:
        for (size_t i = 0; i < ops.size(); ++i) ce[i] = ce_capable(*ops[i]);
        break;
      case engine_policy::automatic: {
        // Large remote slabs go to the copy engines, which run at the link's ceiling without
        // SMs; local ops (1/P of a weight switch) go to the SM kernel, which overlaps them
        // with the remote copies at HBM speed. Many large ops would make the copy engines
        // host-bound: then the kernel takes them all.
        auto to_ce = [&](const copy_op& op) {
          return !op.is_local() && op.bytes() >= config.copy_engine_min_op_bytes && ce_capable(op);
        };
        int64_t large = 0;
        for (const copy_op* op : ops) large += to_ce(*op) ? 1 : 0;
        if (large <= config.copy_engine_max_ops_per_phase) {
          for (size_t i = 0; i < ops.size(); ++i) ce[i] = to_ce(*ops[i]);
        }
        break;
      }
    }
    return ce;
  }

  std::byte* pointer(int rank, memory_space s, int64_t offset) const {
    return static_cast<std::byte*>(ranks[static_cast<size_t>(rank)].base[static_cast<int>(s)]) +
           offset;
  }

  std::shared_ptr<const cuda_prepared_plan> prepare(const plan& p) {
    validate(p);
    auto st = std::make_unique<cuda_prepared_plan::impl>();
    st->owner = this;
    st->num_ranks = num_ranks;
    st->num_phases = static_cast<int64_t>(p.phases.size());
    st->num_ops = p.num_ops();
    st->ce_ops_of_rank.assign(static_cast<size_t>(num_ranks), 0);
    st->sm_ops_of_rank.assign(static_cast<size_t>(num_ranks), 0);
    st->blocks.resize(static_cast<size_t>(num_ranks));
    for (const plan_phase& ph : p.phases) {
      st->ops_per_phase.push_back(static_cast<int64_t>(ph.ops.size()));
    }
    device_guard guard;
    for (int r = 0; r < num_ranks; ++r) {
      const rank_state& rs = ranks[static_cast<size_t>(r)];
      if (!rs.local) continue;
      prepared_rank pr;
      pr.rank = r;
      pr.device = rs.device;
      std::vector<peer_copy_desc> descs;
      const int max_blocks = config.sm_kernel_blocks > 0 ? config.sm_kernel_blocks : rs.sm_count;
      const int64_t warps_per_block = config.sm_kernel_threads / 32;
      std::vector<const copy_op*> mine;
      for (const plan_phase& ph : p.phases) {
        mine.clear();
        for (const copy_op& op : ph.ops) {
          if (op.src_rank == r) mine.push_back(&op);
        }
        const std::vector<bool> ce = choose_engines(mine);
        phase_work w;
        w.ce_begin = pr.ce_ops.size();
        w.desc_offset = static_cast<int64_t>(descs.size());
        for (size_t i = 0; i < mine.size(); ++i) {
          const copy_op& op = *mine[i];
          const std::byte* src = pointer(op.src_rank, op.src_space, op.src_offset);
          std::byte* dst = pointer(op.dst_rank, op.dst_space, op.dst_offset);
          if (ce[i]) {
            pr.ce_ops.push_back(ce_op{dst, static_cast<size_t>(op.rows == 1 ? op.row_bytes : op.dst_pitch),
                                      src, static_cast<size_t>(op.rows == 1 ? op.row_bytes : op.src_pitch),
                                      static_cast<size_t>(op.row_bytes),
                                      static_cast<size_t>(op.rows)});
            ++pr.ce_count;
          } else {
            peer_copy_desc d;
            d.src = src;
            d.dst = dst;
            d.rows = op.rows;
            d.row_bytes = op.row_bytes;
            d.src_pitch = op.rows == 1 ? 0 : op.src_pitch;
            d.dst_pitch = op.rows == 1 ? 0 : op.dst_pitch;
            d.first_chunk = w.num_chunks;
            w.num_chunks += split_into_chunks(d, config.sm_chunk_bytes);
            descs.push_back(d);
            ++pr.sm_count;
          }
        }
        w.ce_end = pr.ce_ops.size();
        w.num_descs = static_cast<int64_t>(descs.size()) - w.desc_offset;
        if (w.num_chunks > 0) {
          const int64_t want = (w.num_chunks + warps_per_block - 1) / warps_per_block;
          w.blocks = static_cast<int>(std::min<int64_t>(want, max_blocks));
        }
        st->max_blocks = std::max(st->max_blocks, w.blocks);
        st->blocks[static_cast<size_t>(r)].push_back(w.blocks);
        pr.phases.push_back(w);
      }
      pr.num_descs = static_cast<int64_t>(descs.size());
      st->ce_ops_of_rank[static_cast<size_t>(r)] = pr.ce_count;
      st->sm_ops_of_rank[static_cast<size_t>(r)] = pr.sm_count;
      if (!descs.empty()) {
        const size_t bytes = descs.size() * sizeof(peer_copy_desc);
        MOEBIUS_CUDA_CHECK(cudaSetDevice(rs.device));
        // Owned by `st` from here on, so a later failure frees it.
        st->ranks.push_back(std::move(pr));
        prepared_rank& owned = st->ranks.back();
        MOEBIUS_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&owned.d_descs), bytes));
        // Stream-ordered and complete before `descs` dies (a pageable cudaMemcpy may return
        // before its DMA lands, and the legacy stream does not order our streams).
        MOEBIUS_CUDA_CHECK(cudaMemcpyAsync(owned.d_descs, descs.data(), bytes,
                                           cudaMemcpyHostToDevice, rs.stream));
        MOEBIUS_CUDA_CHECK(cudaStreamSynchronize(rs.stream));
        st->descriptor_bytes += static_cast<int64_t>(bytes);
      } else {
        st->ranks.push_back(std::move(pr));
      }
    }
    if (config.use_cuda_graphs) capture_graphs(*st);
    return std::make_shared<const cuda_prepared_plan>(std::move(st));
  }

  // Captures each local rank's whole plan into a graph on a private stream. A capture that
  // fails leaves the plan on direct enqueue (graphs == false); nothing else changes.
  void capture_graphs(cuda_prepared_plan::impl& st) {
    bool ok = true;
    for (prepared_rank& pr : st.ranks) {
      const rank_state& rs = ranks[static_cast<size_t>(pr.rank)];
      cudaStream_t s = nullptr;
      MOEBIUS_CUDA_CHECK(cudaSetDevice(rs.device));
      MOEBIUS_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
      cudaError_t e = cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal);
      if (e == cudaSuccess) {
        try {
          cuda_execute_stats ignored;
          for (int64_t k = 0; k < st.num_phases; ++k) enqueue_rank_phase(pr, k, s, ignored);
        } catch (const moebius::error&) {
          e = cudaErrorStreamCaptureInvalidated;
        }
        cudaGraph_t g = nullptr;
        const cudaError_t end = cudaStreamEndCapture(s, &g);
        if (e == cudaSuccess) e = end;
        if (e == cudaSuccess) {
          pr.graph = g;
          e = cudaGraphInstantiate(&pr.graph_exec, g, 0);
          // Upload now, so that the first execute() costs a launch, not an upload.
          if (e == cudaSuccess) e = cudaGraphUpload(pr.graph_exec, ranks[static_cast<size_t>(pr.rank)].stream);
        } else if (g != nullptr) {
          (void)cudaGraphDestroy(g);
        }
      }
      (void)cudaStreamDestroy(s);
      if (e != cudaSuccess) {
        (void)cudaGetLastError();  // capture failures are not sticky; clear the last error
        ok = false;
        break;
      }
    }
    if (!ok) {
      for (prepared_rank& pr : st.ranks) {
        if (pr.graph_exec != nullptr) (void)cudaGraphExecDestroy(pr.graph_exec);
        if (pr.graph != nullptr) (void)cudaGraphDestroy(pr.graph);
        pr.graph_exec = nullptr;
        pr.graph = nullptr;
      }
    }
    st.graphs = ok;
  }

  std::shared_ptr<const cuda_prepared_plan> lookup_or_prepare(const plan& p, bool& from_cache,
                                                              double& prepare_seconds) {
    const uint64_t h = hash_plan(p);
    for (auto it = cache.begin(); it != cache.end(); ++it) {
      if (it->hash == h && it->key == p) {
        cache.splice(cache.begin(), cache, it);
        from_cache = true;
        prepare_seconds = 0;
        return cache.front().prepared;
      }
    }
    const auto t0 = clock_type::now();
    std::shared_ptr<const cuda_prepared_plan> prepared = prepare(p);
    prepare_seconds = seconds_since(t0);
    from_cache = false;
    if (config.max_cached_plans > 0) {
      cache.push_front(cache_entry{h, p, prepared});
      while (static_cast<int>(cache.size()) > config.max_cached_plans) cache.pop_back();
    }
    return prepared;
  }

  // Waits for every local stream; returns the first CUDA error (cudaSuccess if none).
  cudaError_t sync_all() {
    cudaError_t first = cudaSuccess;
    for (rank_state& r : ranks) {
      if (!r.local) continue;
      cudaError_t e = cudaSetDevice(r.device);
      if (e == cudaSuccess) e = cudaStreamSynchronize(r.stream);
      if (first == cudaSuccess) first = e;
    }
    return first;
  }

  // Enqueues rank pr.rank's work of phase k on `stream`: the fused kernel, the copy-engine
  // ops, then the barrier closing the phase.
  void enqueue_rank_phase(const prepared_rank& pr, int64_t k, cudaStream_t stream,
                          cuda_execute_stats& counts) const {
    const rank_state& rs = ranks[static_cast<size_t>(pr.rank)];
    const phase_work& w = pr.phases[static_cast<size_t>(k)];
    // Both engines have work: fork the kernel onto the side stream, join before the barrier.
    const bool fork = rs.alone_on_device && w.num_chunks > 0 && w.ce_end > w.ce_begin;
    cudaStream_t kernel_stream = fork ? rs.side_stream : stream;
    if (fork) {
      MOEBIUS_CUDA_CHECK(cudaEventRecord(rs.fork_event, stream));
      MOEBIUS_CUDA_CHECK(cudaStreamWaitEvent(rs.side_stream, rs.fork_event, 0));
    }
    if (w.num_chunks > 0) {
      peer_copy_args a;
      a.descs = pr.d_descs + w.desc_offset;
      a.num_descs = w.num_descs;
      a.num_chunks = w.num_chunks;
      a.chunk_bytes = config.sm_chunk_bytes;
      a.status = rs.status;
      MOEBIUS_CUDA_CHECK(launch_peer_copy(a, w.blocks, config.sm_kernel_threads, kernel_stream));
      ++counts.kernel_launches;
    }
    if (fork) MOEBIUS_CUDA_CHECK(cudaEventRecord(rs.join_event, rs.side_stream));
    for (size_t i = w.ce_begin; i < w.ce_end; ++i) {
      const ce_op& c = pr.ce_ops[i];
      if (c.height == 1) {
        MOEBIUS_CUDA_CHECK(cudaMemcpyAsync(c.dst, c.src, c.width, cudaMemcpyDefault, stream));
      } else {
        MOEBIUS_CUDA_CHECK(cudaMemcpy2DAsync(c.dst, c.dst_pitch, c.src, c.src_pitch, c.width,
                                             c.height, cudaMemcpyDefault, stream));
      }
      ++counts.copy_engine_calls;
    }
    if (fork) MOEBIUS_CUDA_CHECK(cudaStreamWaitEvent(stream, rs.join_event, 0));
    counts.copy_engine_ops += static_cast<int64_t>(w.ce_end - w.ce_begin);
    counts.sm_kernel_ops += w.num_descs;
    barrier_args b;
    b.peer_flags = rs.d_peer_flags;
    b.my_flags = rs.flags;
    b.status = rs.status;
    b.rank = pr.rank;
    b.num_ranks = num_ranks;
    b.phase = k;
    b.timeout_ns = static_cast<uint64_t>(config.barrier_timeout_ns);
    MOEBIUS_CUDA_CHECK(launch_barrier(b, stream));
    ++counts.kernel_launches;
  }

  void execute(const cuda_prepared_plan& prepared, bool from_cache, double prepare_seconds) {
    const cuda_prepared_plan::impl& st = prepared.state();
    MOEBIUS_CHECK(st.owner == this, errc::invalid_argument,
                  "prepared plan was made by another cuda_peer_transport");
    completed = 0;
    stats = cuda_execute_stats{};
    stats.from_cache = from_cache;
    stats.prepare_seconds = prepare_seconds;
    stats.max_sm_kernel_blocks = st.max_blocks;

    // One arrival value per phase barrier; every rank advances by the same amount whatever
    // happens, so a later execute never mistakes a stale arrival for a fresh one.
    const uint64_t base = epoch;
    epoch += static_cast<uint64_t>(st.num_phases);

    int64_t limit = st.num_phases;
    bool fault_fires = false;
    if (fault) {
      const fault_point at = *fault;
      fault.reset();
      if (at.phase >= 0 && at.phase < st.num_phases && at.op >= 0 &&
          at.op < st.ops_per_phase[static_cast<size_t>(at.phase)]) {
        limit = at.phase;
        fault_fires = true;
      }
    }

    device_guard guard;
    const auto t0 = clock_type::now();
    try {
      const bool use_graphs = st.graphs && !fault_fires;
      for (const prepared_rank& pr : st.ranks) {
        if (pr.rank == config.debug_absent_rank) continue;
        const rank_state& rs = ranks[static_cast<size_t>(pr.rank)];
        MOEBIUS_CUDA_CHECK(cudaSetDevice(rs.device));
        MOEBIUS_CUDA_CHECK(launch_barrier_begin(rs.status, base, rs.stream));
        if (use_graphs) {
          MOEBIUS_CUDA_CHECK(cudaGraphLaunch(pr.graph_exec, rs.stream));
          ++stats.graph_launches;
          stats.copy_engine_ops += pr.ce_count;
          stats.sm_kernel_ops += pr.sm_count;
        }
      }
      // Direct enqueue goes phase by phase over the ranks, never one rank's whole plan first:
      // a full launch queue would block the host on a rank whose barrier waits for a rank
      // not yet enqueued.
      for (int64_t k = 0; !use_graphs && k < limit; ++k) {
        for (const prepared_rank& pr : st.ranks) {
          if (pr.rank == config.debug_absent_rank) continue;
          const rank_state& rs = ranks[static_cast<size_t>(pr.rank)];
          MOEBIUS_CUDA_CHECK(cudaSetDevice(rs.device));
          enqueue_rank_phase(pr, k, rs.stream, stats);
        }
      }
    } catch (...) {
      // Phases enqueued before the failure may have run: say how many passed on every rank
      // (0 when the statuses cannot be read back, e.g. after a sticky CUDA error).
      (void)sync_all();
      int64_t passed = limit;
      for (const prepared_rank& pr : st.ranks) {
        if (pr.rank == config.debug_absent_rank) continue;
        barrier_status s{};
        if (cudaSetDevice(ranks[static_cast<size_t>(pr.rank)].device) != cudaSuccess ||
            cudaMemcpy(&s, ranks[static_cast<size_t>(pr.rank)].status, sizeof(s),
                       cudaMemcpyDeviceToHost) != cudaSuccess) {
          passed = 0;
          break;
        }
        passed = std::min(passed, static_cast<int64_t>(s.passed));
      }
      completed = passed;
      throw;
    }
    stats.enqueue_seconds = seconds_since(t0);
    MOEBIUS_CUDA_CHECK(sync_all());

    // Read every local rank's barrier status.
    int64_t passed = limit;
    int failed_rank = -1;
    barrier_status failed{};
    for (const prepared_rank& pr : st.ranks) {
      if (pr.rank == config.debug_absent_rank) continue;
      const rank_state& rs = ranks[static_cast<size_t>(pr.rank)];
      barrier_status s;
      MOEBIUS_CUDA_CHECK(cudaSetDevice(rs.device));
      MOEBIUS_CUDA_CHECK(cudaMemcpy(&s, rs.status, sizeof(s), cudaMemcpyDeviceToHost));
      passed = std::min(passed, static_cast<int64_t>(s.passed));
      if (s.error != 0 && failed_rank < 0) {
        failed_rank = pr.rank;
        failed = s;
      }
    }
    if (config.debug_absent_rank >= 0 && config.debug_absent_rank < num_ranks &&
        ranks[static_cast<size_t>(config.debug_absent_rank)].local) {
      // The absent rank ran nothing; nobody can have passed a barrier without it.
      if (limit > 0 && failed_rank < 0) passed = 0;
    }
    completed = passed;
    if (failed_rank >= 0) {
      MOEBIUS_FAIL(errc::timeout, "rank ", failed_rank, " timed out after ",
                   config.barrier_timeout_ns, " ns at the barrier closing phase ",
                   failed.failed_phase, " waiting for rank ", failed.missing_rank, " (",
                   passed, " phases completed on every rank)");
    }
    if (fault_fires) {
      MOEBIUS_FAIL(errc::injected_fault, "injected fault before phase ", limit,
                   " (nothing of that phase was enqueued)");
    }
  }
};

// ---------------------------------------------------------------------------------------------

cuda_peer_transport::cuda_peer_transport(std::unique_ptr<impl> state) : impl_(std::move(state)) {}
cuda_peer_transport::cuda_peer_transport(cuda_peer_transport&&) noexcept = default;
cuda_peer_transport& cuda_peer_transport::operator=(cuda_peer_transport&&) noexcept = default;
cuda_peer_transport::~cuda_peer_transport() = default;

cuda_peer_transport cuda_peer_transport::single_process(std::vector<cuda_rank_memory> ranks,
                                                        const cuda_peer_config& config) {
  MOEBIUS_CHECK(!ranks.empty(), errc::invalid_argument,
                "cuda_peer_transport needs at least one rank");
  MOEBIUS_CHECK(ranks.size() <= 1024, errc::invalid_argument,
                "cuda_peer_transport supports at most 1024 ranks (ranks=", ranks.size(), ")");
  auto st = std::make_unique<impl>();
  st->config = config;
  st->check_config();
  st->num_ranks = static_cast<int>(ranks.size());
  int num_devices = 0;
  MOEBIUS_CUDA_CHECK(cudaGetDeviceCount(&num_devices));

  // Spaces of different ranks must not alias (a copy would overwrite its own source).
  std::vector<std::pair<uintptr_t, uintptr_t>> extents;
  for (size_t r = 0; r < ranks.size(); ++r) {
    const cuda_rank_memory& m = ranks[r];
    MOEBIUS_CHECK(m.device >= 0 && m.device < num_devices, errc::invalid_argument, "rank ", r,
                  " names device ", m.device, " but this process sees ", num_devices,
                  " devices");
    for (int s = 0; s < num_memory_spaces; ++s) {
      MOEBIUS_CHECK(m.bytes[s] >= 0 && (m.bytes[s] == 0 || m.base[s] != nullptr),
                    errc::invalid_argument, "rank ", r, " space ",
                    to_string(static_cast<memory_space>(s)), " has bytes=", m.bytes[s],
                    " and base=", m.base[s]);
      if (m.bytes[s] > 0) {
        const auto b = reinterpret_cast<uintptr_t>(m.base[s]);
        extents.emplace_back(b, b + static_cast<uintptr_t>(m.bytes[s]));
      }
    }
  }
  std::sort(extents.begin(), extents.end());
  for (size_t i = 1; i < extents.size(); ++i) {
    MOEBIUS_CHECK(extents[i - 1].second <= extents[i].first, errc::invalid_argument,
                  "cuda_peer_transport rank memories overlap");
  }

  device_guard guard;
  // Peer access between every pair of distinct devices.
  std::vector<int> devices;
  for (const cuda_rank_memory& m : ranks) devices.push_back(m.device);
  std::sort(devices.begin(), devices.end());
  devices.erase(std::unique(devices.begin(), devices.end()), devices.end());
  for (int a : devices) {
    for (int b : devices) {
      if (a == b) continue;
      int can = 0;
      MOEBIUS_CUDA_CHECK(cudaDeviceCanAccessPeer(&can, a, b));
      MOEBIUS_CHECK(can != 0, errc::cuda, "device ", a, " cannot access device ", b,
                    " (no peer access: ranks on these devices cannot write each other's memory)");
      MOEBIUS_CUDA_CHECK(cudaSetDevice(a));
      const cudaError_t e = cudaDeviceEnablePeerAccess(b, 0);
      if (e == cudaErrorPeerAccessAlreadyEnabled) {
        (void)cudaGetLastError();  // clear the non-sticky error
      } else {
        MOEBIUS_CUDA_CHECK(e);
      }
    }
  }

  // Virtual ranks spin in barriers waiting for each other: two ranks' streams sharing a
  // hardware queue would deadlock until the barrier timeout.
  std::vector<int> per_device;
  for (const cuda_rank_memory& m : ranks) {
    if (m.device < 0) continue;  // rejected below with its own message
    if (m.device >= static_cast<int>(per_device.size())) per_device.resize(static_cast<size_t>(m.device) + 1, 0);
    ++per_device[static_cast<size_t>(m.device)];
  }
  for (size_t d = 0; d < per_device.size(); ++d) {
    MOEBIUS_CHECK(per_device[d] <= hardware_queues(),
                  errc::invalid_argument, per_device[d], " virtual ranks on device ", d,
                  " need ", per_device[d], " hardware queues but CUDA_DEVICE_MAX_CONNECTIONS "
                  "gives ", hardware_queues(), ": call request_hardware_queues_for_virtual_ranks() "
                  "(or set CUDA_DEVICE_MAX_CONNECTIONS, at most 32) before the first CUDA call");
  }

  st->ranks.resize(ranks.size());
  for (size_t r = 0; r < ranks.size(); ++r) {
    impl::rank_state& rs = st->ranks[r];
    rs.device = ranks[r].device;
    rs.alone_on_device = per_device[static_cast<size_t>(rs.device)] == 1;
    for (int s = 0; s < num_memory_spaces; ++s) {
      rs.base[s] = ranks[r].base[s];
      rs.bytes[s] = ranks[r].bytes[s];
    }
    st->init_local(rs, ranks[r].stream);
  }
  st->upload_peer_flags();
  st->compute_min_bytes();
  return cuda_peer_transport(std::move(st));
}

namespace {

// cuMemGetAddressRange, found through the runtime: linking libcuda would stop every Moebius
// binary from loading on a machine without a GPU driver (CI, build hosts).
CUresult mem_get_address_range(CUdeviceptr* base, size_t* size, CUdeviceptr p) {
  using fn_t = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);
  static const fn_t fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult found{};
    MOEBIUS_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &f, 12000,
                                                        cudaEnableDefault, &found));
    MOEBIUS_CHECK(found == cudaDriverEntryPointSuccess && f != nullptr, errc::cuda,
                  "the CUDA driver has no cuMemGetAddressRange");
    return reinterpret_cast<fn_t>(f);
  }();
  return fn(base, size, p);
}

// Handle and offset of `p` inside its cudaMalloc allocation (IPC exports whole allocations).
void export_pointer(void* p, cudaIpcMemHandle_t& handle, int64_t& offset) {
  CUdeviceptr alloc_base = 0;
  size_t alloc_size = 0;
  MOEBIUS_CU_CHECK(mem_get_address_range(&alloc_base, &alloc_size, reinterpret_cast<CUdeviceptr>(p)));
  offset = static_cast<int64_t>(reinterpret_cast<CUdeviceptr>(p) - alloc_base);
  MOEBIUS_CUDA_CHECK(cudaIpcGetMemHandle(&handle, reinterpret_cast<void*>(alloc_base)));
}

}  // namespace

cuda_peer_transport cuda_peer_transport::multi_process(int rank, int num_ranks,
                                                       const cuda_rank_memory& local,
                                                       const all_gather_fn& all_gather,
                                                       const cuda_peer_config& config) {
  MOEBIUS_CHECK(num_ranks >= 1 && num_ranks <= 1024 && rank >= 0 && rank < num_ranks,
                errc::invalid_argument, "multi_process needs 0 <= rank < num_ranks <= 1024 (rank=",
                rank, ", num_ranks=", num_ranks, ")");
  MOEBIUS_CHECK(static_cast<bool>(all_gather), errc::invalid_argument,
                "multi_process needs an all-gather callback");
  auto st = std::make_unique<impl>();
  st->config = config;
  st->check_config();
  st->num_ranks = num_ranks;
  st->process_rank = rank;
  st->ranks.resize(static_cast<size_t>(num_ranks));
  int num_devices = 0;
  MOEBIUS_CUDA_CHECK(cudaGetDeviceCount(&num_devices));
  MOEBIUS_CHECK(local.device >= 0 && local.device < num_devices, errc::invalid_argument,
                "rank ", rank, " names device ", local.device, " but this process sees ",
                num_devices, " devices");

  device_guard guard;
  impl::rank_state& me = st->ranks[static_cast<size_t>(rank)];
  me.device = local.device;
  for (int s = 0; s < num_memory_spaces; ++s) {
    MOEBIUS_CHECK(local.bytes[s] >= 0 && (local.bytes[s] == 0 || local.base[s] != nullptr),
                  errc::invalid_argument, "rank ", rank, " space ",
                  to_string(static_cast<memory_space>(s)), " has bytes=", local.bytes[s],
                  " and base=", local.base[s]);
    me.base[s] = local.base[s];
    me.bytes[s] = local.bytes[s];
  }
  st->init_local(me, local.stream);

  // Publish handles of the spaces and of the barrier flags.
  std::vector<std::byte> send(cuda_ipc_rank_info_bytes);
  std::vector<std::byte> recv(cuda_ipc_rank_info_bytes * static_cast<size_t>(num_ranks));
  {
    ipc_rank_info info;
    info.magic = ipc_rank_info::k_magic;
    info.rank = rank;
    info.num_ranks = num_ranks;
    info.device = local.device;
    info.pid = static_cast<int32_t>(getpid());
    for (int s = 0; s < num_memory_spaces; ++s) {
      if (local.bytes[s] == 0) continue;
      export_pointer(local.base[s], info.handle[s], info.offset[s]);
      info.bytes[s] = local.bytes[s];
      info.present |= 1u << s;
    }
    export_pointer(me.flags, info.handle[num_memory_spaces], info.offset[num_memory_spaces]);
    info.bytes[num_memory_spaces] = static_cast<int64_t>(barrier_alloc_bytes(num_ranks));
    info.present |= 1u << num_memory_spaces;
    std::memcpy(send.data(), &info, sizeof(info));
  }
  all_gather(send.data(), recv.data(), cuda_ipc_rank_info_bytes);

  MOEBIUS_CUDA_CHECK(cudaSetDevice(local.device));
  for (int j = 0; j < num_ranks; ++j) {
    ipc_rank_info info;
    std::memcpy(&info, recv.data() + static_cast<size_t>(j) * cuda_ipc_rank_info_bytes,
                sizeof(info));
    MOEBIUS_CHECK(info.magic == ipc_rank_info::k_magic && info.rank == j &&
                      info.num_ranks == num_ranks,
                  errc::invalid_argument, "all-gather slot ", j,
                  " does not hold rank ", j, "'s cuda_peer_transport info (magic=", info.magic,
                  ", rank=", info.rank, ", num_ranks=", info.num_ranks,
                  "): is the all-gather ordered by rank and are all ranks using num_ranks=",
                  num_ranks, "?");
    if (j == rank) continue;
    impl::rank_state& peer = st->ranks[static_cast<size_t>(j)];
    peer.device = -1;
    // Open each distinct allocation once (two spaces may share one cudaMalloc).
    void* opened[ipc_rank_info::k_handles] = {};
    for (int h = 0; h < ipc_rank_info::k_handles; ++h) {
      if ((info.present & (1u << h)) == 0) continue;
      for (int g = 0; g < h; ++g) {
        if ((info.present & (1u << g)) != 0 &&
            std::memcmp(&info.handle[g], &info.handle[h], sizeof(cudaIpcMemHandle_t)) == 0) {
          opened[h] = opened[g];
        }
      }
      if (opened[h] == nullptr) {
        const cudaError_t e =
            cudaIpcOpenMemHandle(&opened[h], info.handle[h], cudaIpcMemLazyEnablePeerAccess);
        MOEBIUS_CHECK(e == cudaSuccess, errc::cuda, "rank ", rank, " (device ", local.device,
                      ") cannot open the CUDA IPC handle of rank ", j, " (pid ", info.pid,
                      ", device ", info.device, ") for ",
                      h < num_memory_spaces ? to_string(static_cast<memory_space>(h)) : "barrier flags",
                      ": ", cudaGetErrorName(e), " (", cudaGetErrorString(e), ")");
        st->ipc_mappings.emplace_back(local.device, opened[h]);
      }
      std::byte* p = static_cast<std::byte*>(opened[h]) + info.offset[h];
      if (h < num_memory_spaces) {
        peer.base[h] = p;
        peer.bytes[h] = info.bytes[h];
      } else {
        peer.flags = reinterpret_cast<uint64_t*>(p);
      }
    }
  }
  st->upload_peer_flags();
  st->compute_min_bytes();
  return cuda_peer_transport(std::move(st));
}

int cuda_peer_transport::num_ranks() const { return impl_->num_ranks; }
void cuda_peer_transport::validate(const plan& p) const { impl_->validate(p); }

std::vector<int> cuda_peer_transport::local_ranks() const {
  std::vector<int> local;
  for (int r = 0; r < impl_->num_ranks; ++r) {
    if (is_local(r)) local.push_back(r);
  }
  return local;
}

void cuda_peer_transport::enqueue(const plan& p, std::span<const stream_handle> streams) {
  MOEBIUS_CHECK(!outstanding_, errc::invalid_argument,
                "cuda_peer_transport::enqueue: a plan is still outstanding; call wait() first");
  MOEBIUS_CHECK(streams.empty(), errc::invalid_argument,
                "cuda_peer_transport::enqueue: caller streams are not supported yet");
  validate(p);
  outstanding_ = true;
  failure_ = nullptr;
  try {
    bool from_cache = false;
    double prepare_seconds = 0;
    impl_->completed = 0;
    std::shared_ptr<const cuda_prepared_plan> prepared =
        impl_->lookup_or_prepare(p, from_cache, prepare_seconds);
    impl_->execute(*prepared, from_cache, prepare_seconds);
  } catch (...) {
    failure_ = std::current_exception();
  }
}

void cuda_peer_transport::wait() {
  outstanding_ = false;
  if (failure_) std::rethrow_exception(std::exchange(failure_, nullptr));
}

void cuda_peer_transport::execute(const cuda_prepared_plan& prepared) {
  impl_->execute(prepared, false, 0);
}

std::shared_ptr<const cuda_prepared_plan> cuda_peer_transport::prepare_plan(const plan& p) {
  return impl_->prepare(p);
}

void cuda_peer_transport::prepare(const plan& p) {
  bool from_cache = false;
  double prepare_seconds = 0;
  (void)impl_->lookup_or_prepare(p, from_cache, prepare_seconds);
}

int64_t cuda_peer_transport::completed_phases() const { return impl_->completed; }
void cuda_peer_transport::inject_fault(std::optional<fault_point> at) { impl_->fault = at; }
int cuda_peer_transport::process_rank() const { return impl_->process_rank; }

bool cuda_peer_transport::is_local(int rank) const {
  return rank >= 0 && rank < impl_->num_ranks && impl_->ranks[static_cast<size_t>(rank)].local;
}

int cuda_peer_transport::device_of(int rank) const {
  MOEBIUS_CHECK(is_local(rank), errc::invalid_argument, "rank ", rank,
                " is not driven by this process");
  return impl_->ranks[static_cast<size_t>(rank)].device;
}

cudaStream_t cuda_peer_transport::stream_of(int rank) const {
  MOEBIUS_CHECK(is_local(rank), errc::invalid_argument, "rank ", rank,
                " is not driven by this process");
  return impl_->ranks[static_cast<size_t>(rank)].stream;
}

const cuda_peer_config& cuda_peer_transport::config() const { return impl_->config; }
const cuda_execute_stats& cuda_peer_transport::last_execute_stats() const { return impl_->stats; }
void cuda_peer_transport::clear_plan_cache() { impl_->cache.clear(); }

}  // namespace moebius
