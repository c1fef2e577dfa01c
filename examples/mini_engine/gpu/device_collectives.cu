// Virtual ranks (gpu_runtime.hpp): all P ranks on one device, where NCCL refuses two ranks of
// one communicator, so the runtime's four collectives run over device memory. Each is
//   barrier: every rank's stream waits until every rank's stream has reached this point (its
//            sources are written);
//   work:    each rank, on its own stream, pulls what it needs from its peers' buffers
//            (cudaMemcpyAsync, device to device) or sums them (sum_ranks) into its scratch;
//   barrier: no rank goes on (and overwrites a source, or its sum's buffer) before every peer
//            has read it.
// A barrier is one event per rank, recorded on its stream, that every other rank's stream
// waits for: events only, no spinning kernel, so ranks sharing a hardware queue cannot
// deadlock. Under capture (graph_cache.cu: one graph holds every rank's stream) the same calls
// become edges of that graph. The host enqueues every record of a barrier before any wait,
// so one event per rank serves every barrier (a wait sees the record just made).
//
// Decode context parallelism (TP, dcp > 1; gpu_runtime.hpp) adds two exchanges within each
// DCP set (dcp consecutive ranks sharing one KV head): the set's q heads gathered on every
// member (device_dcp_gather_q), and each rank's merge of the members' partial attentions of
// its own heads (device_dcp_merge). How the partials travel, and why this way, is written
// there.

#include <moebius/error.hpp>

#include "runtime_impl.hpp"

namespace mini_engine::gpu {

using moebius::errc;

namespace {

void copy_on(cudaStream_t s, void* dst, const void* src, int64_t bytes) {
  if (bytes <= 0) return;
  MOEBIUS_CUDA_CHECK(
      cudaMemcpyAsync(dst, src, static_cast<size_t>(bytes), cudaMemcpyDeviceToDevice, s));
}

}  // namespace

void gpu_runtime::impl::barrier() {
  each_rank([&](int, rank_state& rs) { MOEBIUS_CUDA_CHECK(cudaEventRecord(rs.meet, rs.stream)); });
  each_rank([&](int r, rank_state& rs) {
    for (int q = 0; q < P; ++q)
      if (q != r)
        MOEBIUS_CUDA_CHECK(cudaStreamWaitEvent(rs.stream, ranks[static_cast<size_t>(q)].meet, 0));
  });
}

void gpu_runtime::impl::join_into_first() {
  rank_state& first = ranks[0];
  each_rank([&](int r, rank_state& rs) {
    if (r > 0) MOEBIUS_CUDA_CHECK(cudaEventRecord(rs.meet, rs.stream));
  });
  each_rank([&](int r, rank_state& rs) {
    if (r > 0) MOEBIUS_CUDA_CHECK(cudaStreamWaitEvent(first.stream, rs.meet, 0));
  });
}

void gpu_runtime::impl::fork_from_first() {
  rank_state& first = ranks[0];
  set_device(first);
  MOEBIUS_CUDA_CHECK(cudaEventRecord(first.meet, first.stream));
  each_rank([&](int r, rank_state& rs) {
    if (r > 0) MOEBIUS_CUDA_CHECK(cudaStreamWaitEvent(rs.stream, first.meet, 0));
  });
}

// In place: every rank's `buf` becomes sum over q = 0..P-1 of rank q's `buf` (sum_ranks: the
// same order on every rank, so TP ranks hold the same bits).
void gpu_runtime::impl::device_all_reduce(float* rank_state::*buf, int64_t count) {
  MOEBIUS_CHECK(count <= buffer_sizes.reduce_scratch_floats, errc::internal,
                "gpu_runtime: an all-reduce of ", count, " floats, scratch for ",
                buffer_sizes.reduce_scratch_floats);
  sum_ranks_args a;
  a.num_parts = P;
  a.n = count;
  for (int q = 0; q < P; ++q) a.parts[q] = ranks[static_cast<size_t>(q)].*buf;
  barrier();
  each_rank([&](int, rank_state& rs) {
    a.out = rs.reduce_scratch;
    launch_sum_ranks(a, rs.stream);
  });
  barrier();
  each_rank(
      [&](int, rank_state& rs) { copy_on(rs.stream, rs.*buf, rs.reduce_scratch, count * 4); });
}

// Rank r's gathered block q = rank q's T packed rows (the NCCL all-gather's layout).
void gpu_runtime::impl::device_dispatch_all_gather(int64_t T) {
  const int64_t bytes = T * row_layout.row_bytes;
  barrier();
  each_rank([&](int, rank_state& rs) {
    for (int q = 0; q < P; ++q)
      copy_on(rs.stream, rs.gathered + q * bytes, ranks[static_cast<size_t>(q)].packed, bytes);
  });
  barrier();
}

// Rank r's recv block p (p != r) = rank p's moe_out block r: p's partial sums for r's T rows.
void gpu_runtime::impl::device_combine_exchange(int64_t T) {
  const int64_t n = T * c.hidden;
  barrier();
  each_rank([&](int r, rank_state& rs) {
    for (int p = 0; p < P; ++p)
      if (p != r)
        copy_on(rs.stream, rs.recv + p * n, ranks[static_cast<size_t>(p)].moe_out + r * n, n * 4);
  });
  barrier();
}

// Rank r's recv block q = rank q's first `rows` rows of the residual stream h.
void gpu_runtime::impl::device_hand_off_all_gather(int64_t rows) {
  const int64_t n = rows * c.hidden;
  barrier();
  each_rank([&](int, rank_state& rs) {
    for (int q = 0; q < P; ++q)
      copy_on(rs.stream, rs.recv + q * n, ranks[static_cast<size_t>(q)].h, n * 4);
  });
  barrier();
}

// ---- decode context parallelism ---------------------------------------------------------
// How the partials travel: vLLM's way (its decode context parallelism, which the host runtime
// simulates: host_runtime.hpp), q gathered within the set, each member's partial output and
// LSE over the set's heads, then per rank the merge of its own heads' parts (vLLM: an
// all-gather of the LSEs and a reduce-scatter of the weighted outputs). Why this one:
//   - each q head is projected once, on its own rank, by the same q/k/v GEMMs as at dcp 1, and
//     the merged head output is formed and rounded on its own rank before o_proj, so o_proj,
//     its all-reduce and everything after are TP's unchanged and the only numerical change
//     from dcp 1 is the softmax split (the host runtime's rounding points, one more reason);
//   - what moves is small: q (T x dcp hq x D floats per rank) and, per rank, the dcp parts of
//     its hq heads (T x hq x (D + 1) floats each), against the o_proj all-reduce's T x H;
//   - on virtual ranks the merge kernel reads the peers' parts where they lie (dcp_merge
//     takes one pointer per part), so the reduce-scatter costs no copy at all.
// Helix's alternative (every member projects q of the set's heads itself, no q gather; the
// partials swapped in one all-to-all) trades the gather (a barrier and the q copies) for dcp x
// the q projection, whose GEMM shape then differs from dcp 1's; folding the merge into
// o_proj's all-reduce (each member's o_proj over the set's heads, its part scaled by its
// weight, summed by the all-reduce) skips the merged head output, a rounding point dcp 1 has,
// still needs the LSEs gathered first and multiplies the o_proj GEMM by dcp.

// Rank r's dcp_q block k (columns k hq D of each row) = the q heads of member k of its set
// (rank r - r % dcp + k): the first hq D columns of that rank's qkv rows. One barrier first
// (every member's q is written); the members' next write of qkv comes after the merge's
// barriers, which every rank reaches only once its copies are done.
void gpu_runtime::impl::device_dcp_gather_q(int64_t T) {
  MOEBIUS_CHECK(virt, errc::internal, "gpu_runtime: the DCP q gather runs on virtual ranks");
  const int64_t dcp = kv.dcp, width = q_heads_local(moebius::parallel_mode::tp) * c.head_dim;
  barrier();
  each_rank([&](int r, rank_state& rs) {
    const int first = r - static_cast<int>(kv.dcp_rank(r));
    for (int64_t k = 0; k < dcp; ++k) {
      const rank_state& member = ranks[static_cast<size_t>(first + k)];
      MOEBIUS_CUDA_CHECK(cudaMemcpy2DAsync(rs.dcp_q + k * width,
                                           static_cast<size_t>(dcp * width) * 4, member.qkv,
                                           static_cast<size_t>(qkv_ld) * 4,
                                           static_cast<size_t>(width) * 4, static_cast<size_t>(T),
                                           cudaMemcpyDeviceToDevice, rs.stream));
    }
  });
}

// Rank r's attn = the merge (dcp_merge) of its set's parts of r's own heads: member k's
// dcp_out columns and dcp_lse entries of r's heads (block dcp_rank(r) of each row), read in
// place. A barrier first (every member's part is written), and one after (no member writes
// its parts, or the q the parts came from, before every rank has read them).
void gpu_runtime::impl::device_dcp_merge(int64_t T) {
  MOEBIUS_CHECK(virt, errc::internal, "gpu_runtime: the DCP merge runs on virtual ranks");
  const int64_t dcp = kv.dcp, hq = q_heads_local(moebius::parallel_mode::tp), D = c.head_dim;
  barrier();
  each_rank([&](int r, rank_state& rs) {
    const int first = r - static_cast<int>(kv.dcp_rank(r));
    const int64_t own = kv.dcp_rank(r);
    dcp_merge_args a;
    a.num_parts = static_cast<int>(dcp);
    for (int64_t k = 0; k < dcp; ++k) {
      const rank_state& member = ranks[static_cast<size_t>(first + k)];
      a.parts[k] = member.dcp_out + own * hq * D;
      a.part_lse[k] = member.dcp_lse + own * hq;
    }
    a.part_stride = dcp * hq * D;
    a.lse_stride = dcp * hq;
    a.tokens = T;
    a.heads = hq;
    a.head_dim = D;
    a.num_tokens = in_num(rs, moebius::parallel_mode::tp);
    a.out = rs.attn;
    a.out_stride = hq * D;
    launch_dcp_merge(a, rs.stream);
  });
  barrier();
}

}  // namespace mini_engine::gpu
