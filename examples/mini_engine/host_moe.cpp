// The host runtime's mixture of experts: routing, one expert's slice on one rank, and the
// layer's MoE in EP (whole experts on their owner) and TP (every expert's slice on every rank)
// (host_runtime.hpp).
#include <algorithm>
#include <cmath>
#include <moebius/error.hpp>
#include <moebius/kv/page_table.hpp>
#include <moebius/layout/weight_view.hpp>

#include "host_kernels.hpp"
#include "host_runtime.hpp"
#include "kv_pages.hpp"

namespace mini_engine {

using namespace host_detail;
using moebius::dtype;
using moebius::errc;
using moebius::kv_tensor;
using moebius::parallel_mode;
using moebius::weight_tensor;

void host_runtime::route(int64_t layer, int64_t T) {
  const model_config& c = weights_.config;
  const dense_layer& dw = dense_[static_cast<size_t>(layer)];
  const int64_t H = c.hidden, E = c.num_experts, K = c.top_k;
  grow(probs_, E);
  for (int64_t t = 0; t < T; ++t) {
    const double* x = &x_[static_cast<size_t>(t * H)];
    double mx = -INFINITY;
    for (int64_t e = 0; e < E; ++e) {
      probs_[static_cast<size_t>(e)] = dot(&dw.router[static_cast<size_t>(e * H)], x, H);
      mx = std::max(mx, probs_[static_cast<size_t>(e)]);
    }
    double sum = 0;
    for (int64_t e = 0; e < E; ++e)
      sum += (probs_[static_cast<size_t>(e)] = std::exp(probs_[static_cast<size_t>(e)] - mx));
    for (int64_t e = 0; e < E; ++e) probs_[static_cast<size_t>(e)] /= sum;
    // Top-k by probability, the lower expert first on ties; weights renormalised to sum to 1
    // (norm_topk_prob) or the softmax probabilities as they are.
    double top = 0;
    for (int64_t k = 0; k < K; ++k) {
      int64_t best = -1;
      for (int64_t e = 0; e < E; ++e) {
        bool taken = false;
        for (int64_t j = 0; j < k; ++j) taken |= topk_expert_[static_cast<size_t>(t * K + j)] == e;
        if (!taken &&
            (best < 0 || probs_[static_cast<size_t>(e)] > probs_[static_cast<size_t>(best)]))
          best = e;
      }
      topk_expert_[static_cast<size_t>(t * K + k)] = static_cast<int32_t>(best);
      top += probs_[static_cast<size_t>(best)];
    }
    for (int64_t k = 0; k < K; ++k)
      topk_weight_[static_cast<size_t>(t * K + k)] =
          probs_[static_cast<size_t>(topk_expert_[static_cast<size_t>(t * K + k)])] /
          (c.norm_topk_prob ? top : 1.0);
  }
  // Tokens per expert: pairs (t, k) as indices t*K + k, grouped by expert.
  expert_first_.assign(static_cast<size_t>(E + 1), 0);
  for (int64_t p = 0; p < T * K; ++p)
    ++expert_first_[static_cast<size_t>(topk_expert_[static_cast<size_t>(p)] + 1)];
  for (int64_t e = 0; e < E; ++e)
    expert_first_[static_cast<size_t>(e + 1)] += expert_first_[static_cast<size_t>(e)];
  grow(pairs_, T * K);
  std::vector<int64_t>& fill = expert_fill_;
  fill.assign(expert_first_.begin(), expert_first_.end() - 1);
  for (int64_t p = 0; p < T * K; ++p)
    pairs_[static_cast<size_t>(fill[static_cast<size_t>(topk_expert_[static_cast<size_t>(p)])]++)] =
        p;
}

// One expert's slice on one rank: SiLU(gate)*up for rows [i0, i1) of each half, then the
// down projection over those columns. `mode` picks the view (and so the slot and the rank
// whose arena holds them); the loops are the same in both modes.
void host_runtime::run_expert(int64_t layer, parallel_mode mode, int rank, int64_t e, int64_t i0,
                              int64_t i1) {
  const model_config& c = weights_.config;
  const moebius::arena_geometry& ag = arena_geometry_;
  const int64_t H = c.hidden, I = c.intermediate, K = c.top_k, b = c.fp8_block;
  const int64_t p0 = expert_first_[static_cast<size_t>(e)],
                p1 = expert_first_[static_cast<size_t>(e + 1)];
  const std::byte* arena = arena_of(rank);
  const bool fp8 = c.fp8_experts();
  const bool f32 = c.expert_dtype == dtype::fp32;  // read in place, no decode
  const int64_t eb = moebius::dtype_bytes(c.expert_dtype);
  auto locate = [&](weight_tensor t, int64_t row, int64_t col) -> const std::byte* {
    const moebius::element_location at =
        mode == parallel_mode::ep
            ? moebius::make_view<parallel_mode::ep>(ag.shape, t, ag.num_ranks).locate(e, row, col)
            : moebius::make_view<parallel_mode::tp>(ag.shape, t, ag.num_ranks).locate(e, row, col);
    MOEBIUS_CHECK(at.rank == rank, errc::internal, "expert ", e, " row ", row, " col ", col, " of ",
                  moebius::to_string(t), " is on rank ", at.rank, ", not ", rank);
    const int64_t elem = (t == weight_tensor::w13 || t == weight_tensor::w2) ? eb : 4;
    return arena + ag.tensor_base(mode, layer, t) + at.offset * elem;
  };
  // Gate rows [i0, i1), then up rows [I + i0, I + i1).
  for (int half = 0; half < 2; ++half)
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t row = half * I + i;
      const std::byte* w = locate(weight_tensor::w13, row, 0);
      if (!f32)
        dequant_row(w, c.expert_dtype, fp8 ? locate(weight_tensor::w13_scale, row / b, 0) : nullptr,
                    b, H, row_.data());
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t pair = pairs_[static_cast<size_t>(p)];
        const double* x = &x_[static_cast<size_t>((pair / K) * H)];
        const double v = f32 ? dot(as_floats(w), x, H) : dot(row_.data(), x, H);
        if (half == 0) {
          gate_[static_cast<size_t>(pair * I + i)] = v;
        } else {
          const double gt = gate_[static_cast<size_t>(pair * I + i)];
          act_[static_cast<size_t>(pair * I + i)] =
              static_cast<float>(gt / (1.0 + std::exp(-gt)) * v);
        }
      }
    }
  // Down: y[pair][h] = w2[h, i0:i1] . act[pair][i0:i1].
  const int64_t len = i1 - i0;
  for (int64_t h = 0; h < H; ++h) {
    const std::byte* w = locate(weight_tensor::w2, h, i0);
    if (!f32)
      dequant_row(w, c.expert_dtype, fp8 ? locate(weight_tensor::w2_scale, h / b, i0 / b) : nullptr,
                  b, len, row_.data());
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t pair = pairs_[static_cast<size_t>(p)];
      const double* a = &act_[static_cast<size_t>(pair * I + i0)];
      y_[static_cast<size_t>(pair * H + h)] =
          f32 ? dot(as_floats(w), a, len) : dot(row_.data(), a, len);
    }
  }
}

void host_runtime::moe_ep(int64_t layer, int64_t T) {
  const model_config& c = weights_.config;
  const int64_t E = c.num_experts, H = c.hidden, K = c.top_k;
  const int64_t per_rank = E / num_ranks();
  // Dispatch: each expert runs whole on its owner over the tokens routed to it.
  for (int64_t e = 0; e < E; ++e)
    if (expert_first_[static_cast<size_t>(e + 1)] > expert_first_[static_cast<size_t>(e)])
      run_expert(layer, parallel_mode::ep, static_cast<int>(e / per_rank), e, 0, c.intermediate);
  // Combine on the token's home, in top-k order.
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h) {
      double s = 0;
      for (int64_t k = 0; k < K; ++k)
        s += topk_weight_[static_cast<size_t>(t * K + k)] *
             y_[static_cast<size_t>((t * K + k) * H + h)];
      acc_[static_cast<size_t>(t * H + h)] = s;
    }
}

void host_runtime::moe_tp(int64_t layer, int64_t T) {
  const model_config& c = weights_.config;
  const int P = num_ranks();
  const int64_t E = c.num_experts, H = c.hidden, K = c.top_k, slice = c.intermediate / P;
  std::fill(acc_.begin(), acc_.begin() + T * H, 0.0);
  for (int r = 0; r < P; ++r) {
    for (int64_t e = 0; e < E; ++e)
      if (expert_first_[static_cast<size_t>(e + 1)] > expert_first_[static_cast<size_t>(e)])
        run_expert(layer, parallel_mode::tp, r, e, r * slice, (r + 1) * slice);
    // This rank's partial over the token's experts (top-k order), then the all-reduce.
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < H; ++h) {
        double s = 0;
        for (int64_t k = 0; k < K; ++k)
          s += topk_weight_[static_cast<size_t>(t * K + k)] *
               y_[static_cast<size_t>((t * K + k) * H + h)];
        acc_[static_cast<size_t>(t * H + h)] += s;
      }
  }
}

}  // namespace mini_engine
