#pragma once

// A small model for the GPU runtime's tests, independent of the host model's code (only its
// data types, model_config and model_weights, which the runtime takes): seeded weights, a
// textbook float64 forward, and a page allocator over moebius::kv_state.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <moebius/error.hpp>
#include <moebius/kv/page_table.hpp>
#include <numeric>
#include <random>
#include <vector>

#include "gpu_runtime.hpp"
#include "gpu_test_util.hpp"

namespace mini_engine::gpu::testing {

using test_layer = mini_engine::layer_weights;
using test_weights = mini_engine::model_weights;

// fp8 block quantization of [E, rows, cols] (b x b blocks): per block the smallest power-of-two
// scale with amax / scale <= 448 (1 for an all-zero block), each value replaced by the nearest
// e4m3 value (fp8_e4m3_value, by search) times the scale, so the weights are exactly what an
// fp8 arena holds and the float64 reference uses them as they are.
inline void quantize_fp8(std::vector<float>& w, std::vector<float>& scale, int64_t E,
                         int64_t rows, int64_t cols, int64_t b) {
  std::vector<double> codes;  // every finite e4m3 value, ascending
  for (int v = 0; v < 256; ++v)
    if (!std::isnan(fp8_e4m3_value(static_cast<uint8_t>(v))))
      codes.push_back(fp8_e4m3_value(static_cast<uint8_t>(v)));
  std::sort(codes.begin(), codes.end());
  const int64_t br = rows / b, bc = cols / b;
  scale.assign(static_cast<size_t>(E * br * bc), 1.0f);
  for (int64_t e = 0; e < E; ++e)
    for (int64_t i = 0; i < br; ++i)
      for (int64_t j = 0; j < bc; ++j) {
        auto at = [&](int64_t r, int64_t k) -> float& {
          return w[static_cast<size_t>((e * rows + i * b + r) * cols + j * b + k)];
        };
        double amax = 0;
        for (int64_t r = 0; r < b; ++r)
          for (int64_t k = 0; k < b; ++k) amax = std::max(amax, std::fabs(double{at(r, k)}));
        double s = 1;
        if (amax > 0) s = std::ldexp(1.0, static_cast<int>(std::ceil(std::log2(amax / 448.0))));
        if (amax / s > 448.0) s *= 2;  // log2 rounding at an exact power of two
        scale[static_cast<size_t>((e * br + i) * bc + j)] = static_cast<float>(s);
        for (int64_t r = 0; r < b; ++r)
          for (int64_t k = 0; k < b; ++k) {
            const double x = at(r, k) / s;
            auto it = std::lower_bound(codes.begin(), codes.end(), x);
            double best = it == codes.end() ? codes.back() : *it;
            if (it != codes.begin() && std::fabs(*(it - 1) - x) < std::fabs(best - x))
              best = *(it - 1);
            at(r, k) = static_cast<float>(best * s);
          }
      }
}

// Uniform weights scaled by sqrt(3 / fan_in), norms 1 +- 0.1, LM head 2x. `round`: every
// tensor rounded to bf16 (so bf16 storage on the device is exact). fp8 experts
// (c.expert_dtype): w13 and w2 quantized with c.fp8_block blocks (quantize_fp8).
inline test_weights make_test_weights(const mini_engine::model_config& c, uint64_t seed, bool round) {
  std::mt19937_64 rng(seed);
  auto gen = [&](int64_t n, double scale, double offset = 0.0) {
    std::uniform_real_distribution<double> d(-1, 1);
    std::vector<float> v(static_cast<size_t>(n));
    for (float& x : v) {
      x = static_cast<float>(d(rng) * scale + offset);
      if (round) x = round_bf16(x);
    }
    return v;
  };
  const int64_t H = c.hidden, D = c.head_dim, E = c.num_experts, I = c.intermediate;
  const double sh = std::sqrt(3.0 / static_cast<double>(H));
  test_weights w;
  w.config = c;
  w.embed = gen(c.vocab * H, 1.0);
  for (int64_t l = 0; l < c.num_layers; ++l) {
    test_layer t;
    t.input_layernorm = gen(H, 0.1, 1.0);
    t.q_proj = gen(c.num_q_heads * D * H, sh);
    t.k_proj = gen(c.num_kv_heads * D * H, sh);
    t.v_proj = gen(c.num_kv_heads * D * H, sh);
    t.o_proj = gen(H * c.num_q_heads * D, std::sqrt(3.0 / static_cast<double>(c.num_q_heads * D)));
    t.q_norm = gen(D, 0.1, 1.0);
    t.k_norm = gen(D, 0.1, 1.0);
    t.post_attention_layernorm = gen(H, 0.1, 1.0);
    t.router = gen(E * H, sh);
    t.w13 = gen(E * 2 * I * H, sh);
    t.w2 = gen(E * H * I, std::sqrt(3.0 / static_cast<double>(I)));
    if (c.expert_dtype == moebius::dtype::fp8_e4m3) {
      quantize_fp8(t.w13, t.w13_scale, E, 2 * I, H, c.fp8_block);
      quantize_fp8(t.w2, t.w2_scale, E, H, I, c.fp8_block);
    }
    w.layers.push_back(std::move(t));
  }
  w.norm = gen(H, 0.1, 1.0);
  w.lm_head = gen(c.vocab * H, 2.0 * sh);
  return w;
}

// Logits [T][V] of every position of one sequence, in double; K and V rounded to kv_dtype.
inline std::vector<std::vector<double>> reference_logits(const mini_engine::model_config& c,
                                                         const test_weights& w,
                                                         const std::vector<int32_t>& tokens) {
  using vec = std::vector<double>;
  const int64_t T = static_cast<int64_t>(tokens.size()), H = c.hidden, D = c.head_dim;
  const int64_t Hq = c.num_q_heads, Hkv = c.num_kv_heads, E = c.num_experts, I = c.intermediate;
  auto at = [](auto& v, int64_t i) -> auto& {
    return v[static_cast<size_t>(i)];
  };
  auto matvec = [&](const std::vector<float>& W, int64_t rows, int64_t cols, const vec& x,
                    int64_t row0) {
    vec y(static_cast<size_t>(rows), 0.0);
    for (int64_t r = 0; r < rows; ++r) {
      double s = 0;
      for (int64_t k = 0; k < cols; ++k) s += double{at(W, (row0 + r) * cols + k)} * at(x, k);
      at(y, r) = s;
    }
    return y;
  };
  auto rmsnorm = [&](vec& x, int64_t off, int64_t n, const std::vector<float>& g) {
    double ss = 0;
    for (int64_t i = 0; i < n; ++i) ss += at(x, off + i) * at(x, off + i);
    const double inv = 1.0 / std::sqrt(ss / static_cast<double>(n) + c.rms_eps);
    for (int64_t i = 0; i < n; ++i) at(x, off + i) *= inv * at(g, i);
  };
  auto rope = [&](vec& x, int64_t off, int64_t pos) {
    for (int64_t i = 0; i < D / 2; ++i) {
      const double a =
          static_cast<double>(pos) *
          std::pow(c.rope_theta, -2.0 * static_cast<double>(i) / static_cast<double>(D));
      const double x1 = at(x, off + i), x2 = at(x, off + i + D / 2);
      at(x, off + i) = x1 * std::cos(a) - x2 * std::sin(a);
      at(x, off + i + D / 2) = x2 * std::cos(a) + x1 * std::sin(a);
    }
  };
  auto round_kv = [&](double v) {
    const float f = static_cast<float>(v);
    return c.kv_dtype == moebius::dtype::bf16 ? double{round_bf16(f)} : double{f};
  };
  std::vector<vec> h(static_cast<size_t>(T), vec(static_cast<size_t>(H)));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < H; ++i) at(at(h, t), i) = at(w.embed, at(tokens, t) * H + i);
  for (const test_layer& l : w.layers) {
    std::vector<vec> q(static_cast<size_t>(T)), k(static_cast<size_t>(T)),
        v(static_cast<size_t>(T));
    for (int64_t t = 0; t < T; ++t) {
      vec x = at(h, t);
      rmsnorm(x, 0, H, l.input_layernorm);
      at(q, t) = matvec(l.q_proj, Hq * D, H, x, 0);
      at(k, t) = matvec(l.k_proj, Hkv * D, H, x, 0);
      at(v, t) = matvec(l.v_proj, Hkv * D, H, x, 0);
      for (int64_t hd = 0; hd < Hq; ++hd) {
        rmsnorm(at(q, t), hd * D, D, l.q_norm);
        rope(at(q, t), hd * D, t);
      }
      for (int64_t hd = 0; hd < Hkv; ++hd) {
        rmsnorm(at(k, t), hd * D, D, l.k_norm);
        rope(at(k, t), hd * D, t);
      }
      for (double& e : at(k, t)) e = round_kv(e);
      for (double& e : at(v, t)) e = round_kv(e);
    }
    for (int64_t t = 0; t < T; ++t) {
      vec o(static_cast<size_t>(Hq * D), 0.0);
      for (int64_t hd = 0; hd < Hq; ++hd) {
        const int64_t kvh = hd / (Hq / Hkv);
        vec s(static_cast<size_t>(t + 1));
        for (int64_t j = 0; j <= t; ++j) {
          double d = 0;
          for (int64_t i = 0; i < D; ++i) d += at(at(q, t), hd * D + i) * at(at(k, j), kvh * D + i);
          at(s, j) = d / std::sqrt(static_cast<double>(D));
        }
        const double mx = *std::max_element(s.begin(), s.end());
        double sum = 0;
        for (double& e : s) sum += (e = std::exp(e - mx));
        for (int64_t j = 0; j <= t; ++j)
          for (int64_t i = 0; i < D; ++i)
            at(o, hd * D + i) += at(s, j) / sum * at(at(v, j), kvh * D + i);
      }
      const vec a = matvec(l.o_proj, H, Hq * D, o, 0);
      for (int64_t i = 0; i < H; ++i) at(at(h, t), i) += at(a, i);
    }
    for (int64_t t = 0; t < T; ++t) {
      vec x = at(h, t);
      rmsnorm(x, 0, H, l.post_attention_layernorm);
      vec p = matvec(l.router, E, H, x, 0);
      const double mx = *std::max_element(p.begin(), p.end());
      double sum = 0;
      for (double& e : p) sum += (e = std::exp(e - mx));
      for (double& e : p) e /= sum;
      std::vector<int64_t> order(static_cast<size_t>(E));
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(),
                       [&](int64_t a, int64_t b) { return at(p, a) > at(p, b); });
      double top = 0;
      for (int64_t j = 0; j < c.top_k; ++j) top += at(p, at(order, j));
      for (int64_t j = 0; j < c.top_k; ++j) {
        const int64_t e = at(order, j);
        const vec gu = matvec(l.w13, 2 * I, H, x, e * 2 * I);
        vec a(static_cast<size_t>(I));
        for (int64_t i = 0; i < I; ++i) {
          const double g = at(gu, i), u = at(gu, I + i);
          at(a, i) = g / (1.0 + std::exp(-g)) * u;
        }
        const vec y = matvec(l.w2, H, I, a, e * H);
        for (int64_t i = 0; i < H; ++i) at(at(h, t), i) += at(p, e) / top * at(y, i);
      }
    }
  }
  std::vector<vec> logits(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t) {
    vec x = at(h, t);
    rmsnorm(x, 0, H, w.norm);
    at(logits, t) = matvec(w.lm_head, c.vocab, H, x, 0);
  }
  return logits;
}

// Grows sequence `seq_id` to `num_tokens` tokens: EP on `owner` (a new sequence) or where it
// lives; TP on every rank, each taking its DCP share with g.dcp > 1 (the logical pages k,
// k + dcp, .. on a rank of DCP index k = rank % dcp). Pages from the front of the free lists.
inline void reserve_tokens(const moebius::kv_geometry& g, moebius::kv_state& s, int64_t seq_id,
                           int64_t num_tokens, int owner) {
  for (size_t r = 0; r < s.ranks.size(); ++r) {
    auto& rank = s.ranks[r];
    auto it = std::find_if(rank.sequences.begin(), rank.sequences.end(),
                           [&](const moebius::kv_sequence& q) { return q.seq_id == seq_id; });
    if (it == rank.sequences.end()) {
      if (s.mode == moebius::parallel_mode::ep && static_cast<int>(r) != owner) continue;
      bool elsewhere = false;
      for (const auto& other : s.ranks)
        for (const auto& q : other.sequences) elsewhere |= q.seq_id == seq_id;
      if (s.mode == moebius::parallel_mode::ep && elsewhere) continue;
      moebius::kv_sequence q;
      q.seq_id = seq_id;
      rank.sequences.push_back(q);
      std::sort(rank.sequences.begin(), rank.sequences.end(),
                [](const auto& a, const auto& b) { return a.seq_id < b.seq_id; });
      it = std::find_if(rank.sequences.begin(), rank.sequences.end(),
                        [&](const moebius::kv_sequence& x) { return x.seq_id == seq_id; });
    }
    const int64_t logical = moebius::pages_for_tokens(num_tokens, g.page_size);
    int64_t pages = logical;  // of them on this rank
    if (s.mode == moebius::parallel_mode::tp && g.dcp > 1) {
      const int64_t k = static_cast<int64_t>(r) % g.dcp;
      pages = logical > k ? (logical - k + g.dcp - 1) / g.dcp : 0;
    }
    while (it->num_pages() < pages) {
      MOEBIUS_CHECK(!rank.free_pages.empty(), moebius::errc::capacity, "test pool full");
      it->pages.push_back(rank.free_pages.front());
      rank.free_pages.erase(rank.free_pages.begin());
    }
    it->num_tokens = num_tokens;
    it->last_page_len = num_tokens - (logical - 1) * g.page_size;
  }
}

inline moebius::kv_state empty_kv_state(const moebius::kv_geometry& g, moebius::parallel_mode m) {
  return moebius::make_kv_state(
      g, m, std::vector<std::vector<moebius::kv_sequence>>(static_cast<size_t>(g.num_ranks)));
}

}  // namespace mini_engine::gpu::testing
