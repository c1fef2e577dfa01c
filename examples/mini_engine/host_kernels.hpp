#pragma once

// The host runtime's element loops, shared by its files (host_runtime.cpp: setup and the step;
// host_attention.cpp; host_moe.cpp). Internal: not part of host_runtime.hpp's interface. Every
// row is summed in double in a fixed order, so the same code rounds the same way wherever a
// row is computed (host_runtime.hpp says why that matters: TP and EP give equal tokens).

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <moebius/error.hpp>
#include <moebius/layout/dtype.hpp>
#include <vector>

#include "numerics.hpp"

namespace mini_engine::host_detail {

using moebius::dtype;
using moebius::errc;

// Eight partial sums in double, combined in a fixed order: the same code (and so the same
// rounding) wherever a row is computed. Products of two floats are exact in double, so a
// fused multiply-add, where the compiler contracts one, rounds exactly as the plain sum.
template <class W, class X>
inline double dot(const W* __restrict w, const X* __restrict x, int64_t n) {
  double a[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j)
      a[j] += static_cast<double>(w[i + j]) * static_cast<double>(x[i + j]);
  double s = ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
  for (; i < n; ++i) s += static_cast<double>(w[i]) * static_cast<double>(x[i]);
  return s;
}

// out = in / sqrt(mean(in^2) + eps) * w, rounded to float (and held as Out: activations
// that feed many dot products are kept as double, exactly the float they were rounded to,
// so that the loops convert only the weights).
template <class Out>
inline void rmsnorm(const float* in, const float* w, int64_t n, double eps, Out* out) {
  const double inv = 1.0 / std::sqrt(dot(in, in, n) / static_cast<double>(n) + eps);
  for (int64_t i = 0; i < n; ++i)
    out[i] = static_cast<float>(static_cast<double>(in[i]) * inv * static_cast<double>(w[i]));
}

inline std::vector<double> to_double(const std::vector<float>& v) {
  return {v.begin(), v.end()};
}

// rotate_half RoPE of x[0, D) with the position's cos/sin [D/2].
inline void rope(float* x, const double* cs, const double* sn, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < half; ++i) {
    const double x1 = x[i], x2 = x[i + half];
    x[i] = static_cast<float>(x1 * cs[i] - x2 * sn[i]);
    x[i + half] = static_cast<float>(x2 * cs[i] + x1 * sn[i]);
  }
}

inline const std::array<float, 256>& fp8_table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int i = 0; i < 256; ++i)
      t[static_cast<size_t>(i)] = from_fp8_e4m3(static_cast<uint8_t>(i));
    return t;
  }();
  return table;
}

// Decodes n elements of an expert row into double. fp8: code * scale[j / block] (exact in
// double: a 4-bit significand times a power of two).
inline void dequant_row(const std::byte* p, dtype t, const std::byte* scales, int64_t block,
                        int64_t n, double* out) {
  switch (t) {
    case dtype::fp32:
      for (int64_t j = 0; j < n; ++j) {
        float v;
        std::memcpy(&v, p + 4 * j, 4);
        out[j] = v;
      }
      break;
    case dtype::bf16:
      for (int64_t j = 0; j < n; ++j) {
        uint16_t v;
        std::memcpy(&v, p + 2 * j, 2);
        out[j] = from_bf16(v);
      }
      break;
    default: {
      const auto& table = fp8_table();
      for (int64_t b0 = 0; b0 < n; b0 += block) {
        float s;
        std::memcpy(&s, scales + 4 * (b0 / block), 4);
        const double scale = s;
        for (int64_t j = b0; j < b0 + block; ++j)
          out[j] = static_cast<double>(table[static_cast<uint8_t>(p[j])]) * scale;
      }
    }
  }
}

// fp32 expert rows are read in place: the arena is new[]-allocated (max-aligned) and every
// tensor offset is a multiple of 4 bytes (its alignment and element size).
inline const float* as_floats(const std::byte* p) {
  return reinterpret_cast<const float*>(p);
}

inline void store_kv(std::byte* p, const float* v, int64_t n, dtype t) {
  if (t == dtype::fp32) {
    std::memcpy(p, v, static_cast<size_t>(4 * n));
    return;
  }
  for (int64_t j = 0; j < n; ++j) {
    const uint16_t u = to_bf16(v[j]);
    std::memcpy(p + 2 * j, &u, 2);
  }
}

inline void load_kv(const std::byte* p, double* v, int64_t n, dtype t) {
  if (t == dtype::fp32) {
    for (int64_t j = 0; j < n; ++j) {
      float f;
      std::memcpy(&f, p + 4 * j, 4);
      v[j] = f;
    }
    return;
  }
  for (int64_t j = 0; j < n; ++j) {
    uint16_t u;
    std::memcpy(&u, p + 2 * j, 2);
    v[j] = from_bf16(u);
  }
}

template <class T>
inline void grow(std::vector<T>& v, int64_t n) {
  if (static_cast<int64_t>(v.size()) < n) v.resize(static_cast<size_t>(n));
}

}  // namespace mini_engine::host_detail
