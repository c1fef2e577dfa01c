#pragma once

// Helpers for the mini-engine's GPU tests: device buffers, uploads, poisoned outputs, bf16
// rounding on the host, a seed that MOEBIUS_TEST_SEED overrides.

#include <cuda_runtime_api.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <moebius/cuda/check.hpp>
#include <random>
#include <vector>

namespace mini_engine::gpu::testing {

inline uint64_t seed(uint64_t fallback) {
  const char* s = std::getenv("MOEBIUS_TEST_SEED");
  return s != nullptr ? std::strtoull(s, nullptr, 10) : fallback;
}

// A device allocation of `bytes`, poisoned with 0xff (NaN in fp32 and bf16).
struct device_buffer {
  void* ptr = nullptr;
  int64_t bytes = 0;
  device_buffer() = default;
  explicit device_buffer(int64_t b) : bytes(b) {
    MOEBIUS_CUDA_CHECK(cudaMalloc(&ptr, static_cast<size_t>(b > 0 ? b : 1)));
    MOEBIUS_CUDA_CHECK(cudaMemset(ptr, 0xff, static_cast<size_t>(b > 0 ? b : 1)));
  }
  device_buffer(const device_buffer&) = delete;
  device_buffer& operator=(const device_buffer&) = delete;
  device_buffer(device_buffer&& o) noexcept : ptr(o.ptr), bytes(o.bytes) { o.ptr = nullptr; }
  ~device_buffer() { cudaFree(ptr); }
  template <class T>
  T* as() const {
    return static_cast<T*>(ptr);
  }
};

template <class T>
void upload(const device_buffer& d, const std::vector<T>& h) {
  MOEBIUS_CUDA_CHECK(cudaMemcpy(d.ptr, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
}
template <class T>
std::vector<T> download(const device_buffer& d, size_t n) {
  std::vector<T> h(n);
  MOEBIUS_CUDA_CHECK(cudaDeviceSynchronize());
  MOEBIUS_CUDA_CHECK(cudaMemcpy(h.data(), d.ptr, n * sizeof(T), cudaMemcpyDeviceToHost));
  return h;
}
template <class T>
device_buffer to_device(const std::vector<T>& h) {
  device_buffer d(static_cast<int64_t>(h.size() * sizeof(T)));
  upload(d, h);
  return d;
}

inline uint16_t to_bf16(float f) {
  const uint32_t u = std::bit_cast<uint32_t>(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
inline float from_bf16(uint16_t b) {
  return std::bit_cast<float>(static_cast<uint32_t>(b) << 16);
}
inline float round_bf16(float f) {
  return from_bf16(to_bf16(f));
}

// OCP FP8 E4M3 ("fn") code -> value, from the bit fields (no table shared with the code under
// test): 1 sign, 4 exponent bits (bias 7), 3 mantissa bits; subnormals m * 2^-9; 0x7f and 0xff
// are NaN (no infinities).
//   0x38 -> 1, 0x7e -> 448, 0x01 -> 2^-9, 0xb8 -> -1
inline double fp8_e4m3_value(uint8_t v) {
  const int sign = v >> 7, exp = (v >> 3) & 0xf, man = v & 7;
  if (exp == 0xf && man == 7) return std::nan("");
  const double mag = exp == 0 ? std::ldexp(static_cast<double>(man), -9)
                              : std::ldexp(static_cast<double>(8 + man), exp - 10);
  return sign ? -mag : mag;
}

inline std::vector<float> random_floats(std::mt19937_64& rng, size_t n, float lo = -1.0f,
                                        float hi = 1.0f) {
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

inline int64_t uniform(std::mt19937_64& rng, int64_t lo, int64_t hi) {
  return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
}

}  // namespace mini_engine::gpu::testing
