#include "reference.hpp"

#include <algorithm>
#include <cmath>
#include <moebius/error.hpp>
#include <numeric>

#include "numerics.hpp"

namespace mini_engine {

namespace {

using vec = std::vector<double>;

// y = W x for W [rows, cols] row-major (float), x [cols].
vec matvec(const std::vector<float>& W, int64_t rows, int64_t cols, const vec& x,
           int64_t row0 = 0) {
  vec y(static_cast<size_t>(rows), 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    double s = 0;
    for (int64_t c = 0; c < cols; ++c)
      s += static_cast<double>(W[static_cast<size_t>((row0 + r) * cols + c)]) *
           x[static_cast<size_t>(c)];
    y[static_cast<size_t>(r)] = s;
  }
  return y;
}

// x / sqrt(mean(x^2) + eps) * w over x[off, off+n).
void rmsnorm(vec& x, int64_t off, int64_t n, const std::vector<float>& w, double eps) {
  double ss = 0;
  for (int64_t i = 0; i < n; ++i)
    ss += x[static_cast<size_t>(off + i)] * x[static_cast<size_t>(off + i)];
  const double inv = 1.0 / std::sqrt(ss / static_cast<double>(n) + eps);
  for (int64_t i = 0; i < n; ++i)
    x[static_cast<size_t>(off + i)] *= inv * static_cast<double>(w[static_cast<size_t>(i)]);
}

// Rotates x[off, off+D) for position `pos` (rotate_half: pairs (i, i + D/2)).
void rope(vec& x, int64_t off, int64_t D, int64_t pos, double theta) {
  for (int64_t i = 0; i < D / 2; ++i) {
    const double inv_freq = std::pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(D));
    const double a = static_cast<double>(pos) * inv_freq;
    const double c = std::cos(a), s = std::sin(a);
    const double x1 = x[static_cast<size_t>(off + i)], x2 = x[static_cast<size_t>(off + i + D / 2)];
    x[static_cast<size_t>(off + i)] = x1 * c - x2 * s;
    x[static_cast<size_t>(off + i + D / 2)] = x2 * c + x1 * s;
  }
}

double round_kv(double v, moebius::dtype t) {
  const float f = static_cast<float>(v);
  return t == moebius::dtype::bf16 ? round_bf16(f) : f;
}

}  // namespace

std::vector<std::vector<double>> reference_logits(const model_weights& w,
                                                  std::span<const int32_t> tokens) {
  const model_config& c = w.config;
  validate(w);
  const int64_t T = static_cast<int64_t>(tokens.size());
  const int64_t H = c.hidden, D = c.head_dim, Hq = c.num_q_heads, Hkv = c.num_kv_heads;
  const int64_t E = c.num_experts, I = c.intermediate, K = c.top_k;
  for (int32_t t : tokens)
    MOEBIUS_CHECK(t >= 0 && t < c.vocab, moebius::errc::invalid_argument,
                  "reference_logits: token ", t, " outside the vocab of ", c.vocab);

  std::vector<vec> h(static_cast<size_t>(T), vec(static_cast<size_t>(H)));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < H; ++i)
      h[static_cast<size_t>(t)][static_cast<size_t>(i)] =
          w.embed[static_cast<size_t>(tokens[static_cast<size_t>(t)] * H + i)];

  for (const layer_weights& l : w.layers) {
    // Attention: projections, per-head norms, RoPE, then causal softmax attention.
    std::vector<vec> q(static_cast<size_t>(T)), k(static_cast<size_t>(T)),
        v(static_cast<size_t>(T));
    for (int64_t t = 0; t < T; ++t) {
      vec x = h[static_cast<size_t>(t)];
      rmsnorm(x, 0, H, l.input_layernorm, c.rms_eps);
      q[static_cast<size_t>(t)] = matvec(l.q_proj, Hq * D, H, x);
      k[static_cast<size_t>(t)] = matvec(l.k_proj, Hkv * D, H, x);
      v[static_cast<size_t>(t)] = matvec(l.v_proj, Hkv * D, H, x);
      for (int64_t hd = 0; hd < Hq; ++hd) {
        rmsnorm(q[static_cast<size_t>(t)], hd * D, D, l.q_norm, c.rms_eps);
        rope(q[static_cast<size_t>(t)], hd * D, D, t, c.rope_theta);
      }
      for (int64_t hd = 0; hd < Hkv; ++hd) {
        rmsnorm(k[static_cast<size_t>(t)], hd * D, D, l.k_norm, c.rms_eps);
        rope(k[static_cast<size_t>(t)], hd * D, D, t, c.rope_theta);
      }
      for (double& e : k[static_cast<size_t>(t)]) e = round_kv(e, c.kv_dtype);
      for (double& e : v[static_cast<size_t>(t)]) e = round_kv(e, c.kv_dtype);
    }
    const int64_t group = Hq / Hkv;
    for (int64_t t = 0; t < T; ++t) {
      vec o(static_cast<size_t>(Hq * D), 0.0);
      for (int64_t hd = 0; hd < Hq; ++hd) {
        const int64_t kvh = hd / group;
        vec score(static_cast<size_t>(t + 1));
        for (int64_t s = 0; s <= t; ++s) {
          double d = 0;
          for (int64_t i = 0; i < D; ++i)
            d += q[static_cast<size_t>(t)][static_cast<size_t>(hd * D + i)] *
                 k[static_cast<size_t>(s)][static_cast<size_t>(kvh * D + i)];
          score[static_cast<size_t>(s)] = d / std::sqrt(static_cast<double>(D));
        }
        const double mx = *std::max_element(score.begin(), score.end());
        double sum = 0;
        for (double& e : score) sum += (e = std::exp(e - mx));
        for (int64_t s = 0; s <= t; ++s)
          for (int64_t i = 0; i < D; ++i)
            o[static_cast<size_t>(hd * D + i)] +=
                score[static_cast<size_t>(s)] / sum *
                v[static_cast<size_t>(s)][static_cast<size_t>(kvh * D + i)];
      }
      const vec a = matvec(l.o_proj, H, Hq * D, o);
      for (int64_t i = 0; i < H; ++i)
        h[static_cast<size_t>(t)][static_cast<size_t>(i)] += a[static_cast<size_t>(i)];
    }
    // MoE: softmax router, top-k (renormalised when norm_topk_prob), SiLU(gate) * up, down.
    for (int64_t t = 0; t < T; ++t) {
      vec x = h[static_cast<size_t>(t)];
      rmsnorm(x, 0, H, l.post_attention_layernorm, c.rms_eps);
      vec p = matvec(l.router, E, H, x);
      const double mx = *std::max_element(p.begin(), p.end());
      double sum = 0;
      for (double& e : p) sum += (e = std::exp(e - mx));
      for (double& e : p) e /= sum;
      std::vector<int64_t> order(static_cast<size_t>(E));
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
        return p[static_cast<size_t>(a)] > p[static_cast<size_t>(b)];
      });
      double top = 0;
      for (int64_t j = 0; j < K; ++j) top += p[static_cast<size_t>(order[static_cast<size_t>(j)])];
      for (int64_t j = 0; j < K; ++j) {
        const int64_t e = order[static_cast<size_t>(j)];
        const double weight = p[static_cast<size_t>(e)] / (c.norm_topk_prob ? top : 1.0);
        const vec gu = matvec(l.w13, 2 * I, H, x, e * 2 * I);
        vec a(static_cast<size_t>(I));
        for (int64_t i = 0; i < I; ++i) {
          const double g = gu[static_cast<size_t>(i)], u = gu[static_cast<size_t>(I + i)];
          a[static_cast<size_t>(i)] = g / (1.0 + std::exp(-g)) * u;
        }
        const vec y = matvec(l.w2, H, I, a, e * H);
        for (int64_t i = 0; i < H; ++i)
          h[static_cast<size_t>(t)][static_cast<size_t>(i)] += weight * y[static_cast<size_t>(i)];
      }
    }
  }
  std::vector<vec> logits(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t) {
    vec x = h[static_cast<size_t>(t)];
    rmsnorm(x, 0, H, w.norm, c.rms_eps);
    logits[static_cast<size_t>(t)] = matvec(w.lm_head, c.vocab, H, x);
  }
  return logits;
}

std::vector<int32_t> reference_generate(const model_weights& w, std::span<const int32_t> prompt,
                                        int64_t steps) {
  std::vector<int32_t> seq(prompt.begin(), prompt.end()), out;
  for (int64_t s = 0; s < steps; ++s) {
    const vec last = reference_logits(w, seq).back();
    const auto best =
        static_cast<int32_t>(std::max_element(last.begin(), last.end()) - last.begin());
    out.push_back(best);
    seq.push_back(best);
  }
  return out;
}

}  // namespace mini_engine
