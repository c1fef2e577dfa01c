#pragma once

// Element types of expert weights and their scale tensors. A reshard moves bytes, never
// converts them, so all a plan needs from a dtype is its size.

#include <cstdint>

#include "moebius/detail/host_device.hpp"

namespace moebius {

enum class dtype : uint8_t {
  bf16,
  fp16,
  fp32,
  fp8_e4m3,  // OCP FP8 E4M3 (weights of block-scaled FP8 checkpoints)
  fp8_e5m2,  // OCP FP8 E5M2
};

inline constexpr dtype all_dtypes[] = {dtype::bf16, dtype::fp16, dtype::fp32, dtype::fp8_e4m3,
                                       dtype::fp8_e5m2};

// False for a value cast from an integer that names no dtype (detail/enum_check.hpp).
MOEBIUS_HOST_DEVICE constexpr bool is_valid(dtype t) {
  return static_cast<uint8_t>(t) <= static_cast<uint8_t>(dtype::fp8_e5m2);
}

// Bytes per element: bf16 -> 2, fp8_e4m3 -> 1.
MOEBIUS_HOST_DEVICE constexpr int64_t dtype_bytes(dtype t) {
  switch (t) {
    case dtype::bf16:
    case dtype::fp16: return 2;
    case dtype::fp32: return 4;
    case dtype::fp8_e4m3:
    case dtype::fp8_e5m2: return 1;
  }
  return 0;
}

constexpr const char* to_string(dtype t) {
  switch (t) {
    case dtype::bf16: return "bf16";
    case dtype::fp16: return "fp16";
    case dtype::fp32: return "fp32";
    case dtype::fp8_e4m3: return "fp8_e4m3";
    case dtype::fp8_e5m2: return "fp8_e5m2";
  }
  return "unknown";
}

}  // namespace moebius
