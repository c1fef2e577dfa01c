#pragma once

// Collectives priced from cited measurements on one 8-GPU NVLink node, instead of the assumed
// 10 us + bytes / link rate (step_collectives.hpp's link_model), and EP's dispatch and combine
// over two such nodes (EP16: 8 GPUs a node, one 400 Gb/s InfiniBand NIC a GPU).
// step_collectives.hpp says which collectives a decode step runs and prices them with this
// table.
//
// Each (kind, implementation) with two or more cited sizes has a model
//   t(bytes) = latency + max(bytes, smallest cited bytes) / bandwidth
// fitted by ordinary least squares in (bytes, us) over its cited points (two points: the line
// through both). Outside the cited sizes:
//   below the smallest: clamped to the value at the smallest (small messages are latency-bound:
//                       the cited small-message all-reduces, <= 32 KB, take 11-23 us, and the
//                       fitted intercepts of some lines are below that or negative);
//   above the largest:  extrapolated along the line (bandwidth-bound).
// Every cited point is kept as data (collective_points()): its size, value, source,
// hardware and implementation.
//
// What `bytes_per_rank` means per kind (the cited benchmarks' own definitions):
//   tp_all_reduce   the buffer each rank all-reduces (vLLM: 64 tokens x 4096 x bf16 = 0.5 MiB);
//   ep_dispatch     the rows a rank dispatches, counted nominally: its tokens x top-k x the
//                   row's bytes (pplx-garden's bench_all_to_all dispatch_bytes; fp8 rows of
//                   7168 + 56 fp32 scales = 7,392 B in the cited runs; bf16 4096 = 8,192 B in
//                   Qwen3-235B);
//   ep_combine      the same rows returned, bf16 (tokens x top-k x hidden x 2 B);
//   dcp_all_gather  the gathered output per rank; dcp_reduce_scatter the input per rank.
// num_ranks: every cited point is at 8 ranks. Another P scales the bytes by the share that
// leaves the rank, ((P-1)/P) / (7/8) (ring all-reduce, all-to-all), before the 8-rank model
// prices them (an extrapolation, nothing cited); P = 1 costs 0.

#include <cstdint>
#include <iosfwd>
#include <span>
#include <string_view>

namespace mini_engine {

enum class collective_kind {
  tp_all_reduce,
  ep_dispatch,
  ep_combine,
  dcp_all_gather,
  dcp_reduce_scatter,
};

enum class collective_impl {
  vllm_custom,       // vLLM's custom one-stage all-reduce (IPC buffers, one kernel)
  symmetric_memory,  // PyTorch symmetric-memory all-reduce as vLLM selects it
  nccl,
  deepep,            // DeepEP (as pplx-garden's table names it; NVLink within the node)
  deepep_low_latency,  // DeepEP's low-latency kernels (RDMA)
  // DeepEP over two nodes (EP16, NVLink within a node, RDMA across): its low-latency kernels at
  // 128 tokens a rank and its normal kernels (NVLink and RDMA forwarding) at 4,096, the kernels
  // its README gives decode and prefill, fitted as one line.
  deepep_internode,
  pplx,              // pplx-garden's P2P all-to-all
  pplx_internode,    // pplx-garden's P2P all-to-all over two nodes (EP16, CX7)
  mixed,             // a range over several implementations (small-message all-reduce)
};

// One cited measurement. A range (small messages) has bytes the upper bound and us_low < us.
struct collective_point {
  collective_kind kind;
  collective_impl impl;
  int num_ranks;
  double bytes;   // bytes_per_rank as defined above
  double us;      // the measured time (a range's upper end)
  double us_low;  // = us for a point; a range's lower end
  std::string_view hardware;
  std::string_view source;  // repository/path, or PR/issue
  bool fitted;              // used by a fit (false: a reference checked by the tests)
};

// Every cited point, in the order of the table in docs/BENCHMARKS.md.
std::span<const collective_point> collective_points();

// A fitted model of one (kind, implementation) over its cited points.
struct collective_fit {
  collective_kind kind;
  collective_impl impl;
  int num_ranks = 8;          // the cited points' rank count (16: across two nodes)
  double latency_us = 0;      // the line's intercept (may be negative: see clamp_bytes)
  double bytes_per_us = 0;    // the line's bandwidth (bytes per microsecond = MB/s)
  double clamp_bytes = 0;     // the smallest cited size: smaller messages cost this much
  double largest_bytes = 0;   // the largest cited size: beyond it, extrapolated
  // us for `bytes` at num_ranks, clamped below clamp_bytes.
  double us_at(double bytes) const;
};

// The fit of (kind, impl) from collective_points(): computed once. Throws
// errc::invalid_argument naming both when fewer than two fitted points are cited for them.
const collective_fit& fit_of(collective_kind kind, collective_impl impl);
// Every fitted (kind, impl), TP all-reduce first.
std::span<const collective_fit> collective_fits();

// The implementation a well-configured engine uses for `kind` (for tp_all_reduce: the lower
// envelope of vllm_custom and symmetric_memory, as vLLM picks per message size on H100;
// EP: deepep; DCP's exchanges: nccl, vLLM running all-gather and reduce-scatter through it).
collective_impl default_impl(collective_kind kind);
// The same for a deployment of `num_ranks`: dispatch and combine over more than one node of 8
// (num_ranks > 8) take deepep_internode; everything else as default_impl(kind).
collective_impl default_impl(collective_kind kind, int num_ranks);

// Seconds one collective of `kind` takes with the default implementation:
//   tp_all_reduce      min(custom(b'), symmetric_memory(b'))
//   ep_dispatch        deepep dispatch fit (b')
//   ep_combine         deepep combine fit (b')
//   ep_dispatch, ep_combine at P = 16: the deepep_internode fit (bytes_per_rank as they are)
//   dcp_all_gather,
//   dcp_reduce_scatter an NCCL all-reduce of b'/2: half an all-reduce's bandwidth term (a ring
//                      all-reduce is a reduce-scatter then an all-gather), its fixed cost whole
//                      (no cited all-gather; a one-round exchange still synchronises once)
// with b' = bytes_per_rank x ((P-1)/P) / (7/8).
//   tp_all_reduce, 524,288 B, P 8: 13.43 us (vLLM custom; cited 13).
//   ep_dispatch, 8,388,608 B, P 16: 118 + 819,200 B / 182.6 GB/s = 122.49 us (DeepEP across two
//   nodes; its low-latency kernels cited 118 at 7,569,408 B).
// Throws errc::invalid_argument naming bytes_per_rank (negative or not finite) or num_ranks
// (< 1; dispatch and combine at more than 8 ranks other than 16: no figure across nodes cited).
double collective_s(collective_kind kind, double bytes_per_rank, int num_ranks);
// The same with a given implementation's fit (no envelope, no DCP halving rule: the fit itself
// at b', or for DCP kinds impl's all-reduce fit at b'/2). A fit cited at 16 ranks (across two
// nodes) prices num_ranks = 16 alone (errc::invalid_argument naming num_ranks otherwise).
double collective_s(collective_kind kind, collective_impl impl, double bytes_per_rank,
                    int num_ranks);

std::string_view name_of(collective_kind kind);
std::string_view name_of(collective_impl impl);
std::ostream& operator<<(std::ostream& os, const collective_fit& f);

}  // namespace mini_engine
