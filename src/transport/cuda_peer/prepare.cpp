// cuda_peer_transport::prepare_plan(): engine choice per op, device-resident descriptors of
// the fused kernel, and one CUDA graph per local rank.

#include <algorithm>
#include <utility>

#include "impl.hpp"
#include "moebius/cuda/check.hpp"
#include "moebius/error.hpp"

namespace moebius {

using cuda_peer::ce_op;
using cuda_peer::phase_work;
using cuda_peer::prepared_rank;
using cuda_peer::rank_state;

cuda_prepared_plan::cuda_prepared_plan(std::unique_ptr<impl> state) : impl_(std::move(state)) {}
cuda_prepared_plan::~cuda_prepared_plan() = default;
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

std::vector<bool> cuda_peer_transport::impl::choose_engines(
    const std::vector<const copy_op*>& ops) const {
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

std::byte* cuda_peer_transport::impl::pointer(int rank, memory_space s, int64_t offset) const {
  return ranks[static_cast<size_t>(rank)].memory.space(s).data() + offset;
}

std::shared_ptr<const cuda_prepared_plan> cuda_peer_transport::impl::prepare(const plan& p) {
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
  for (const int r : local) {
    const rank_state& rs = ranks[static_cast<size_t>(r)];
    prepared_rank pr;
    pr.rank = r;
    pr.device = rs.device();
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
      // Copy-engine ops: the remote ones, then the local ones (execute.cpp runs the local
      // ones on the side stream, on another copy engine, when both kinds are present).
      for (const bool local_pass : {false, true}) {
        if (local_pass) w.ce_local = pr.ce_ops.size();
        for (size_t i = 0; i < mine.size(); ++i) {
          const copy_op& op = *mine[i];
          if (!ce[i] || op.is_local() != local_pass) continue;
          pr.ce_ops.push_back(ce_op{pointer(op.dst_rank, op.dst_space, op.dst_offset),
                                    static_cast<size_t>(op.rows == 1 ? op.row_bytes : op.dst_pitch),
                                    pointer(op.src_rank, op.src_space, op.src_offset),
                                    static_cast<size_t>(op.rows == 1 ? op.row_bytes : op.src_pitch),
                                    static_cast<size_t>(op.row_bytes),
                                    static_cast<size_t>(op.rows)});
          ++pr.ce_count;
        }
      }
      // The rest: the fused kernel's descriptors.
      for (size_t i = 0; i < mine.size(); ++i) {
        if (ce[i]) continue;
        const copy_op& op = *mine[i];
        peer_copy_desc d;
        d.src = pointer(op.src_rank, op.src_space, op.src_offset);
        d.dst = pointer(op.dst_rank, op.dst_space, op.dst_offset);
        d.rows = op.rows;
        d.row_bytes = op.row_bytes;
        d.src_pitch = op.rows == 1 ? 0 : op.src_pitch;
        d.dst_pitch = op.rows == 1 ? 0 : op.dst_pitch;
        d.first_chunk = w.num_chunks;
        w.num_chunks += split_into_chunks(d, config.sm_chunk_bytes);
        descs.push_back(d);
        ++pr.sm_count;
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
      pr.d_descs = device_buffer::allocate(rs.device(), static_cast<int64_t>(bytes));
      device_guard guard(rs.device());
      // Stream-ordered and complete before `descs` dies (a pageable cudaMemcpy may return
      // before its DMA lands, and the legacy stream does not order our streams).
      MOEBIUS_CUDA_CHECK(cudaMemcpyAsync(pr.d_descs.get(), descs.data(), bytes,
                                         cudaMemcpyHostToDevice, rs.stream.get()));
      MOEBIUS_CUDA_CHECK(cudaStreamSynchronize(rs.stream.get()));
      st->descriptor_bytes += static_cast<int64_t>(bytes);
    }
    st->ranks.push_back(std::move(pr));
  }
  if (config.use_cuda_graphs) capture_graphs(*st);
  return std::make_shared<const cuda_prepared_plan>(std::move(st));
}

// Captures each local rank's whole plan (its phases, then the status readback) into a graph
// on a private stream. The graph is one node of whatever stream it is launched on, so caller
// streams order it like any other work; its side-stream branch forks and joins inside it. A
// capture that fails leaves the plan on direct enqueue (graphs == false); nothing else changes.
void cuda_peer_transport::impl::capture_graphs(cuda_prepared_plan::impl& st) {
  bool ok = true;
  for (size_t i = 0; i < st.ranks.size() && ok; ++i) {
    prepared_rank& pr = st.ranks[i];
    const rank_state& rs = ranks[static_cast<size_t>(pr.rank)];
    const size_t local_index = static_cast<size_t>(
        std::lower_bound(local.begin(), local.end(), pr.rank) - local.begin());
    const cuda_stream s = cuda_stream::create(rs.device());
    device_guard guard(rs.device());
    cudaError_t e = cudaStreamBeginCapture(s.get(), cudaStreamCaptureModeThreadLocal);
    if (e == cudaSuccess) {
      try {
        cuda_execute_stats ignored;
        for (int64_t k = 0; k < st.num_phases; ++k) enqueue_rank_phase(pr, k, s.get(), ignored);
        enqueue_status_readback(local_index, s.get());
      } catch (const moebius::error&) {
        e = cudaErrorStreamCaptureInvalidated;
      }
      cudaGraph_t g = nullptr;
      const cudaError_t end = cudaStreamEndCapture(s.get(), &g);
      if (e == cudaSuccess) e = end;
      if (g != nullptr) pr.graph = cuda_graph(g, rs.device());
      if (e == cudaSuccess) {
        cudaGraphExec_t exec = nullptr;
        e = cudaGraphInstantiate(&exec, g, 0);
        if (e == cudaSuccess) pr.graph_exec = cuda_graph_exec(exec, rs.device());
        // Upload now, so that the first enqueue costs a launch, not an upload.
        if (e == cudaSuccess) e = cudaGraphUpload(exec, rs.stream.get());
        if (e == cudaSuccess) e = cudaStreamSynchronize(rs.stream.get());
      }
    }
    if (e != cudaSuccess) {
      (void)cudaGetLastError();  // capture failures are not sticky; clear the last error
      ok = false;
    }
  }
  if (!ok) {
    for (prepared_rank& pr : st.ranks) {
      pr.graph_exec.reset();
      pr.graph.reset();
    }
  }
  st.graphs = ok && !st.ranks.empty();
}

std::shared_ptr<const cuda_prepared_plan> cuda_peer_transport::prepare_plan(const plan& p) {
  return impl_->prepare(p);
}

}  // namespace moebius
