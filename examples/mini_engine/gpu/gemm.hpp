#pragma once

// The mini-engine's GEMMs, all through cuBLAS, all graph-capturable (fixed pointers, fixed
// shapes per bucket, a workspace set once per handle).
//
// Dense layers: y[T, N] (fp32) = x[T, K] . W[N, K]^T, W row-major (a PyTorch Linear), in the
// weights' dtype (fp32: CUBLAS_COMPUTE_32F, no TF32; bf16: bf16 inputs, fp32 accumulate and
// output). A TP rank's head slice of a weight is a pointer into the whole tensor with its
// leading dimension: no second copy (DESIGN.md §3).
//
// Experts (why this shape). Token counts per expert change every step, but a captured graph
// fixes every GEMM's shape. cuBLAS has no GEMM whose sizes come from device memory, so the
// experts of a layer run as ONE cublasGemmBatchedEx over fixed-size tiles of `tile_rows`
// tokens: each batch entry is one tile of one expert, its A/B/C pointers written on the
// device each step (moe_tile_map) into pointer arrays at fixed addresses. A bucket of `pairs`
// (token, expert) pairs needs at most ceil(pairs / tile_rows) + min(experts, pairs) tiles
// (every expert's last tile may be partial); spare entries point at spare rows and expert 0,
// so they compute rows nobody reads. This bounds the padding by one tile per touched expert
// instead of a worst-case capacity per expert (which would be the whole bucket: 16x the work
// at 512 tokens, top-8 of 128). Weights are read straight from the arena slot of the layer
// in its mode: the pointers are fixed because no arena byte ever moves. fp8 block-scaled
// experts are first expanded into a fixed per-rank scratch (launch_dequant_fp8, only the
// experts with tokens) and the pointers point there: this batched API takes no scales (the
// cost and the alternatives: README.md).

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <moebius/layout/dtype.hpp>

#include "kernels/kernels.hpp"

namespace mini_engine::gpu {

// Throws moebius::error(errc::cuda) naming the call and cuBLAS's status.
void check_cublas(cublasStatus_t status, const char* call, const char* file, int line);
#define MINI_ENGINE_CUBLAS_CHECK(expr) \
  ::mini_engine::gpu::check_cublas((expr), #expr, __FILE__, __LINE__)

struct linear_args {
  const void* x = nullptr;  // [T] rows of K, ldx apart (weight dtype)
  int64_t ldx = 0;
  const void* w = nullptr;  // [N] rows of K, ldw apart
  int64_t ldw = 0;
  float* y = nullptr;  // [T] rows of N, ldy apart
  int64_t ldy = 0;
  int64_t tokens = 0, out_features = 0, in_features = 0;  // T, N, K
  moebius::dtype type = moebius::dtype::bf16;
  bool accumulate = false;  // y += instead of y =
};
void linear(cublasHandle_t handle, const linear_args& a, cudaStream_t stream);

// w13 GEMM, SiLU-and-mul, w2 GEMM over every tile slot of `p` (after launch_moe_permute):
// y rows of each tile = down(silu(gate) * up) of its tokens.
void expert_gemms(cublasHandle_t handle, const moe_plan& p, cudaStream_t stream);

// Bytes of cuBLAS workspace each handle gets (cublasSetWorkspace, before any capture).
inline constexpr int64_t cublas_workspace_bytes = int64_t{32} << 20;

}  // namespace mini_engine::gpu
