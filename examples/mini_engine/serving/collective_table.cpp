#include "collective_table.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <ostream>
#include <vector>

#include <moebius/error.hpp>

namespace mini_engine {
namespace {

using moebius::errc;
using kind = collective_kind;
using impl = collective_impl;

constexpr double k_mib = 1024.0 * 1024.0;
// pplx-garden's bench_all_to_all defaults (benchmarks/bench_all_to_all.py): hidden 7168, top-8,
// fp8 dispatch rows with 56 fp32 scales (7,392 B), bf16 combine rows (14,336 B); tokens per rank.
// DeepEP's low-latency benchmark uses the same shape (hidden 7168, top-8, fp8 dispatch, bf16
// combine).
constexpr double k_dispatch_row = 7168 + 56 * 4, k_combine_row = 7168 * 2, k_top_k = 8;
constexpr double dispatch_bytes(double tokens) { return tokens * k_top_k * k_dispatch_row; }
constexpr double combine_bytes(double tokens) { return tokens * k_top_k * k_combine_row; }

constexpr std::string_view k_vllm = "vllm-project/vllm PR #24111";
constexpr std::string_view k_h100 = "8x H100, NVLink, bf16";
constexpr std::string_view k_pplx = "perplexityai/pplx-garden docs/fabric-lib.md";
constexpr std::string_view k_pplx_hw =
    "EP8 in one node over NVLink (--nvlink 8); 128 tokens/rank, hidden 7168, top-8";

constexpr collective_point point(kind k, impl i, double bytes, double us, std::string_view hw,
                                 std::string_view src, bool fitted = true) {
  return {k, i, 8, bytes, us, us, hw, src, fitted};
}

// Across two nodes of 8 GPUs (EP16).
constexpr std::string_view k_deepep = "deepseek-ai/DeepEP docs/legacy.md (the V1 README's tables)";
constexpr std::string_view k_deepep_ll_hw =
    "H800, EP16 over two nodes, CX7 InfiniBand 400 Gb/s a GPU; low-latency kernels (pure RDMA), "
    "128 tokens/rank, hidden 7168, top-8";
constexpr std::string_view k_deepep_normal_hw =
    "H800, EP16 over two nodes, CX7 InfiniBand 400 Gb/s a GPU; normal kernels (NVLink and RDMA "
    "forwarding), 4,096 tokens/rank, hidden 7168, top-8: 43 GB/s (RDMA) both ways";
constexpr std::string_view k_pplx_ep16_hw =
    "EP16 over two nodes, NVLink within and CX7 RDMA across; 128 or 4,096 tokens/rank, hidden "
    "7168, top-8";
constexpr collective_point point16(kind k, impl i, double bytes, double us, std::string_view hw,
                                   std::string_view src, bool fitted = true) {
  return {k, i, 16, bytes, us, us, hw, src, fitted};
}
// DeepEP's normal-kernel table gives a "bottleneck bandwidth" instead of a time: its
// tests/test_internode.py divides the RDMA bytes, one row per (token, node its experts touch,
// its own node included) of hidden x 2 B x (1 + 4/128) / 2 in fp8 (7,392 B) or x 2 B in bf16
// (14,336 B) for combine, by the time. With 256 experts over 2 nodes and top-8 of uniform
// scores (its default top-k groups: min(nodes, 4) = 2, every expert allowed) a token touches
// 2 (1 - C(128,8) / C(256,8)) = 1.993020 nodes on average; so 4,096 tokens take
//   dispatch 4,096 x 1.993020 x 7,392 B / 43 GB/s = 1,403.35 us,
//   combine  4,096 x 1.993020 x 14,336 B / 43 GB/s = 2,721.64 us.
constexpr double k_ep16_nodes_per_token = 1.9930201154318212;
constexpr double deepep_normal_us(double tokens, double row_bytes) {
  return tokens * k_ep16_nodes_per_token * row_bytes / 43e9 * 1e6;
}

// The cited points (one 8-GPU NVLink node unless the hardware says otherwise).
const collective_point k_points[] = {
    // TP8 all-reduce, bf16, 8x H100: vLLM PR #24111's table.
    point(kind::tp_all_reduce, impl::vllm_custom, 0.5 * k_mib, 13, k_h100, k_vllm),
    point(kind::tp_all_reduce, impl::vllm_custom, 1 * k_mib, 20, k_h100, k_vllm),
    point(kind::tp_all_reduce, impl::vllm_custom, 2 * k_mib, 31, k_h100, k_vllm),
    point(kind::tp_all_reduce, impl::symmetric_memory, 0.5 * k_mib, 16, k_h100, k_vllm),
    point(kind::tp_all_reduce, impl::symmetric_memory, 1 * k_mib, 17, k_h100, k_vllm),
    point(kind::tp_all_reduce, impl::symmetric_memory, 2 * k_mib, 20, k_h100, k_vllm),
    point(kind::tp_all_reduce, impl::symmetric_memory, 4 * k_mib, 26, k_h100, k_vllm),
    point(kind::tp_all_reduce, impl::nccl, 0.5 * k_mib, 28, k_h100, k_vllm),
    point(kind::tp_all_reduce, impl::nccl, 1 * k_mib, 30, k_h100, k_vllm),
    point(kind::tp_all_reduce, impl::nccl, 2 * k_mib, 34, k_h100, k_vllm),
    point(kind::tp_all_reduce, impl::nccl, 4 * k_mib, 54, k_h100, k_vllm),
    // Small all-reduces (<= 32 KB), 11-23 us over the implementations reported: a range, not
    // fitted (ByteDance-Seed/Triton-distributed issue #57; deepseek-ai/DeepEP issue #303).
    {kind::tp_all_reduce, impl::mixed, 8, 32 * 1024, 23, 11, "8 GPUs, NVLink",
     "ByteDance-Seed/Triton-distributed issue #57; deepseek-ai/DeepEP issue #303", false},
    // EP8 dispatch and combine, decode (128 tokens/rank) and prefill (4,096 tokens/rank):
    // pplx-garden's tables, the DeepEP-CX7 and pplx-EFA columns (NVLink within the node).
    point(kind::ep_dispatch, impl::deepep, dispatch_bytes(128), 42.6, k_pplx_hw, k_pplx),
    point(kind::ep_dispatch, impl::deepep, dispatch_bytes(4096), 1810.3, k_pplx_hw, k_pplx),
    point(kind::ep_combine, impl::deepep, combine_bytes(128), 72.0, k_pplx_hw, k_pplx),
    point(kind::ep_combine, impl::deepep, combine_bytes(4096), 962.9, k_pplx_hw, k_pplx),
    point(kind::ep_dispatch, impl::pplx, dispatch_bytes(128), 49.7, k_pplx_hw, k_pplx),
    point(kind::ep_dispatch, impl::pplx, dispatch_bytes(4096), 1052.4, k_pplx_hw, k_pplx),
    point(kind::ep_combine, impl::pplx, combine_bytes(128), 64.2, k_pplx_hw, k_pplx),
    point(kind::ep_combine, impl::pplx, combine_bytes(4096), 1396.7, k_pplx_hw, k_pplx),
    // DeepEP's low-latency kernels over RDMA (H800, EP8, 128 tokens): one size each, so not
    // fitted; a reference the NVLink fits must beat.
    point(kind::ep_dispatch, impl::deepep_low_latency, dispatch_bytes(128), 77,
          "H800, RDMA (CX7 IB), EP8, 128 tokens/rank", "deepseek-ai/DeepEP docs/legacy.md", false),
    point(kind::ep_combine, impl::deepep_low_latency, combine_bytes(128), 114,
          "H800, RDMA (CX7 IB), EP8, 128 tokens/rank", "deepseek-ai/DeepEP docs/legacy.md", false),
    // EP16 over two nodes, DeepEP's own tables: the low-latency kernels at 128 tokens a rank
    // (118 us dispatch, 195 us combine) and the normal kernels at 4,096 (43 GB/s of RDMA bytes
    // each way, converted above): the kernels DeepEP gives decode and prefill, one line.
    point16(kind::ep_dispatch, impl::deepep_internode, dispatch_bytes(128), 118, k_deepep_ll_hw,
            k_deepep),
    point16(kind::ep_dispatch, impl::deepep_internode, dispatch_bytes(4096),
            deepep_normal_us(4096, k_dispatch_row), k_deepep_normal_hw, k_deepep),
    point16(kind::ep_combine, impl::deepep_internode, combine_bytes(128), 195, k_deepep_ll_hw,
            k_deepep),
    point16(kind::ep_combine, impl::deepep_internode, combine_bytes(4096),
            deepep_normal_us(4096, k_combine_row), k_deepep_normal_hw, k_deepep),
    // EP16 over two nodes, pplx-garden's tables: its P2P all-to-all (pplx-CX7, fitted) and
    // DeepEP as it measured it (DeepEP-CX7; a reference: within 5% of DeepEP's own figures at
    // 128 tokens, 0.57x and 1.46x them at 4,096).
    point16(kind::ep_dispatch, impl::pplx_internode, dispatch_bytes(128), 110.2, k_pplx_ep16_hw,
            k_pplx),
    point16(kind::ep_dispatch, impl::pplx_internode, dispatch_bytes(4096), 2734.8, k_pplx_ep16_hw,
            k_pplx),
    point16(kind::ep_combine, impl::pplx_internode, combine_bytes(128), 185.5, k_pplx_ep16_hw,
            k_pplx),
    point16(kind::ep_combine, impl::pplx_internode, combine_bytes(4096), 1062.2, k_pplx_ep16_hw,
            k_pplx),
    point16(kind::ep_dispatch, impl::deepep_internode, dispatch_bytes(128), 123.9, k_pplx_ep16_hw,
            k_pplx, false),
    point16(kind::ep_dispatch, impl::deepep_internode, dispatch_bytes(4096), 2481.9,
            k_pplx_ep16_hw, k_pplx, false),
    point16(kind::ep_combine, impl::deepep_internode, combine_bytes(128), 203.0, k_pplx_ep16_hw,
            k_pplx, false),
    point16(kind::ep_combine, impl::deepep_internode, combine_bytes(4096), 1863.9,
            k_pplx_ep16_hw, k_pplx, false),
};

collective_fit fit(kind k, impl i) {
  std::vector<const collective_point*> pts;
  for (const collective_point& p : k_points)
    if (p.kind == k && p.impl == i && p.fitted) pts.push_back(&p);
  MOEBIUS_CHECK(pts.size() >= 2, errc::invalid_argument, "collective table: ", name_of(k), " ",
                name_of(i), " has ", pts.size(), " fitted cited points (two needed)");
  // Ordinary least squares of us on bytes (MiB for conditioning).
  double sx = 0, sy = 0;
  for (const collective_point* p : pts) sx += p->bytes / k_mib, sy += p->us;
  const double n = static_cast<double>(pts.size()), mx = sx / n, my = sy / n;
  double sxx = 0, sxy = 0;
  for (const collective_point* p : pts) {
    const double dx = p->bytes / k_mib - mx;
    sxx += dx * dx;
    sxy += dx * (p->us - my);
  }
  const double us_per_mib = sxy / sxx;
  collective_fit f{k, i};
  f.num_ranks = pts.front()->num_ranks;
  for (const collective_point* p : pts)
    MOEBIUS_CHECK(p->num_ranks == f.num_ranks, errc::invalid_argument, "collective table: ",
                  name_of(k), " ", name_of(i), " mixes points at ", f.num_ranks, " and ",
                  p->num_ranks, " ranks");
  f.latency_us = my - us_per_mib * mx;
  f.bytes_per_us = k_mib / us_per_mib;
  f.clamp_bytes = pts.front()->bytes;
  f.largest_bytes = pts.front()->bytes;
  for (const collective_point* p : pts) {
    f.clamp_bytes = std::min(f.clamp_bytes, p->bytes);
    f.largest_bytes = std::max(f.largest_bytes, p->bytes);
  }
  MOEBIUS_CHECK(us_per_mib > 0, errc::invalid_argument, "collective table: ", name_of(k), " ",
                name_of(i), " fits a line falling with the bytes");
  return f;
}

const std::vector<collective_fit>& fits() {
  static const std::vector<collective_fit> all = {
      fit(kind::tp_all_reduce, impl::vllm_custom), fit(kind::tp_all_reduce, impl::symmetric_memory),
      fit(kind::tp_all_reduce, impl::nccl),        fit(kind::ep_dispatch, impl::deepep),
      fit(kind::ep_dispatch, impl::pplx),          fit(kind::ep_combine, impl::deepep),
      fit(kind::ep_combine, impl::pplx),
      fit(kind::ep_dispatch, impl::deepep_internode), fit(kind::ep_combine, impl::deepep_internode),
      fit(kind::ep_dispatch, impl::pplx_internode), fit(kind::ep_combine, impl::pplx_internode),
  };
  return all;
}

// bytes_per_rank at num_ranks as the 8-rank models see them; checks the arguments.
double scaled_bytes(kind k, double bytes_per_rank, int num_ranks) {
  MOEBIUS_CHECK(std::isfinite(bytes_per_rank) && bytes_per_rank >= 0, errc::invalid_argument,
                "collective_s(", name_of(k), "): bytes_per_rank must be finite and >= 0 (got ",
                bytes_per_rank, ")");
  MOEBIUS_CHECK(num_ranks >= 1, errc::invalid_argument, "collective_s(", name_of(k),
                "): num_ranks must be >= 1 (got ", num_ranks, ")");
  const double P = num_ranks;
  return bytes_per_rank * ((P - 1) / P) / (7.0 / 8.0);
}

bool is_dcp(kind k) { return k == kind::dcp_all_gather || k == kind::dcp_reduce_scatter; }
bool is_ep(kind k) { return k == kind::ep_dispatch || k == kind::ep_combine; }
bool is_internode(impl i) { return i == impl::deepep_internode || i == impl::pplx_internode; }

}  // namespace

std::span<const collective_point> collective_points() { return k_points; }
std::span<const collective_fit> collective_fits() { return fits(); }

double collective_fit::us_at(double bytes) const {
  return latency_us + std::max(bytes, clamp_bytes) / bytes_per_us;
}

const collective_fit& fit_of(collective_kind k, collective_impl i) {
  for (const collective_fit& f : fits())
    if (f.kind == k && f.impl == i) return f;
  MOEBIUS_FAIL(errc::invalid_argument, "collective table: no fit of ", name_of(k), " with ",
               name_of(i), " (fewer than two cited sizes)");
}

collective_impl default_impl(collective_kind k, int num_ranks) {
  return is_ep(k) && num_ranks > 8 ? impl::deepep_internode : default_impl(k);
}

collective_impl default_impl(collective_kind k) {
  switch (k) {
    case kind::tp_all_reduce: return impl::vllm_custom;  // and symmetric_memory (envelope)
    case kind::ep_dispatch:
    case kind::ep_combine: return impl::deepep;
    case kind::dcp_all_gather:
    case kind::dcp_reduce_scatter: return impl::nccl;
  }
  MOEBIUS_FAIL(errc::invalid_argument, "collective table: unknown collective kind");
}

double collective_s(collective_kind k, collective_impl i, double bytes_per_rank, int num_ranks) {
  const double b = scaled_bytes(k, bytes_per_rank, num_ranks);
  if (is_internode(i)) {
    // Cited across two nodes of 8: no rule takes them to another layout of ranks.
    MOEBIUS_CHECK(num_ranks == 16, errc::invalid_argument, "collective_s(", name_of(k), ", ",
                  name_of(i), "): cited at 16 ranks over two nodes only (num_ranks ", num_ranks,
                  ")");
    return fit_of(k, i).us_at(bytes_per_rank) * 1e-6;
  }
  if (num_ranks == 1) return 0;
  if (is_dcp(k)) return fit_of(kind::tp_all_reduce, i).us_at(b / 2) * 1e-6;
  return fit_of(k, i).us_at(b) * 1e-6;
}

double collective_s(collective_kind k, double bytes_per_rank, int num_ranks) {
  const double b = scaled_bytes(k, bytes_per_rank, num_ranks);
  if (num_ranks == 1) return 0;
  if (k == kind::tp_all_reduce) {
    return std::min(fit_of(k, impl::vllm_custom).us_at(b),
                    fit_of(k, impl::symmetric_memory).us_at(b)) * 1e-6;
  }
  return collective_s(k, default_impl(k, num_ranks), bytes_per_rank, num_ranks);
}

std::string_view name_of(collective_kind k) {
  switch (k) {
    case kind::tp_all_reduce: return "TP all-reduce";
    case kind::ep_dispatch: return "EP dispatch";
    case kind::ep_combine: return "EP combine";
    case kind::dcp_all_gather: return "DCP all-gather";
    case kind::dcp_reduce_scatter: return "DCP reduce-scatter";
  }
  return "?";
}

std::string_view name_of(collective_impl i) {
  switch (i) {
    case impl::vllm_custom: return "vLLM custom";
    case impl::symmetric_memory: return "symmetric memory";
    case impl::nccl: return "NCCL";
    case impl::deepep: return "DeepEP";
    case impl::deepep_low_latency: return "DeepEP low-latency";
    case impl::deepep_internode: return "DeepEP across nodes";
    case impl::pplx: return "pplx";
    case impl::pplx_internode: return "pplx across nodes";
    case impl::mixed: return "several";
  }
  return "?";
}

std::ostream& operator<<(std::ostream& os, const collective_fit& f) {
  os << name_of(f.kind) << " (" << name_of(f.impl) << "): " << f.latency_us << " us + bytes / "
     << f.bytes_per_us * 1e-3 << " GB/s, clamped below " << f.clamp_bytes << " B";
  if (f.num_ranks != 8) os << ", at " << f.num_ranks << " ranks";
  return os;
}

}  // namespace mini_engine
