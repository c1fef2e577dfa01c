#pragma once

// Element conversions and the seeded generator the mini-engine's model shares between its
// runtimes (host and GPU) and its reference: bf16 and OCP FP8 E4M3 encode/decode with
// round-to-nearest-even, and splitmix64 (a generator whose stream is the same everywhere,
// unlike std::normal_distribution).

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace mini_engine {

// bf16: the upper half of an fp32, rounded to nearest even (NaN stays NaN).
//   to_bf16(1.0f) = 0x3f80;  from_bf16(0x3f80) = 1.0f
inline uint16_t to_bf16(float f) {
  const uint32_t u = std::bit_cast<uint32_t>(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  const uint32_t rounding = 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>((u + rounding) >> 16);
}
inline float from_bf16(uint16_t b) {
  return std::bit_cast<float>(static_cast<uint32_t>(b) << 16);
}
inline float round_bf16(float f) {
  return from_bf16(to_bf16(f));
}

// IEEE fp16 (binary16) decode, exact in float: 1 sign, 5 exponent (bias 15), 10 mantissa bits.
//   from_fp16(0x3c00) = 1.0f;  from_fp16(0x7bff) = 65504.0f;  from_fp16(0x0001) = 2^-24
inline float from_fp16(uint16_t h) {
  const int sign = h >> 15, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  float mag;
  if (exp == 0x1f)
    mag = man ? NAN : INFINITY;
  else if (exp == 0)
    mag = std::ldexp(static_cast<float>(man), -24);
  else
    mag = std::ldexp(static_cast<float>(1024 + man), exp - 25);
  return sign ? -mag : mag;
}

// FP8 E4M3 (OCP, "fn"): 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities, max
// 448, 0x7f / 0xff are NaN; subnormals 2^-9 * m. Encoding saturates to +-448.
//   to_fp8_e4m3(1.0f) = 0x38;  from_fp8_e4m3(0x7e) = 448.0f
inline float from_fp8_e4m3(uint8_t v) {
  const int sign = v >> 7, exp = (v >> 3) & 0xf, man = v & 7;
  float mag;
  if (exp == 0xf && man == 7)
    mag = NAN;
  else if (exp == 0)
    mag = std::ldexp(static_cast<float>(man), -9);
  else
    mag = std::ldexp(static_cast<float>(8 + man), exp - 10);
  return sign ? -mag : mag;
}
inline uint8_t to_fp8_e4m3(float f) {
  const uint8_t sign = std::signbit(f) ? 0x80 : 0;
  float a = std::fabs(f);
  if (std::isnan(f)) return 0x7f;
  if (a >= 448.0f) return static_cast<uint8_t>(sign | 0x7e);
  // Step between representable values around a: 2^(e-3) for normals (e >= -6), 2^-9 below.
  int e;
  std::frexp(a, &e);  // a = m * 2^e, m in [0.5, 1)
  const int step_exp = (e - 1 >= -6) ? e - 1 - 3 : -9;
  const double q = std::nearbyint(std::ldexp(static_cast<double>(a), -step_exp));  // RNE
  const double v = std::ldexp(q, step_exp);
  // Re-encode v exactly (rounding may have carried into the next binade).
  if (v == 0) return sign;
  int ve;
  const double vm = std::frexp(v, &ve);  // v = vm * 2^ve, vm in [0.5, 1)
  const int exp_field = ve - 1 + 7;
  if (exp_field <= 0) return static_cast<uint8_t>(sign | static_cast<uint8_t>(std::ldexp(v, 9)));
  const int man = static_cast<int>(std::ldexp(vm, 4)) - 8;
  return static_cast<uint8_t>(sign | (exp_field << 3) | man);
}
inline float round_fp8_e4m3(float f) {
  return from_fp8_e4m3(to_fp8_e4m3(f));
}
inline constexpr float fp8_e4m3_max = 448.0f;

// splitmix64: a tiny generator with a portable stream (the GPU runtime and any other
// implementation regenerate the same weights from the same seed).
struct splitmix64 {
  uint64_t state;
  explicit splitmix64(uint64_t seed) : state(seed) {}
  uint64_t next() {
    uint64_t z = (state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  // Uniform in [-1, 1): 24 random bits, so the value is exact in float.
  float symmetric() {
    return static_cast<float>(static_cast<int64_t>(next() >> 40) - (int64_t{1} << 23)) *
           (1.0f / static_cast<float>(int64_t{1} << 23));
  }
};

}  // namespace mini_engine
