#include <moebius/error.hpp>

#include "gemm.hpp"

namespace mini_engine::gpu {

namespace {
cudaDataType_t cuda_type(moebius::dtype t) {
  MOEBIUS_CHECK(t == moebius::dtype::fp32 || t == moebius::dtype::bf16,
                moebius::errc::invalid_argument, "mini-engine GEMMs take fp32 or bf16, not ",
                moebius::to_string(t));
  return t == moebius::dtype::bf16 ? CUDA_R_16BF : CUDA_R_32F;
}
}  // namespace

void check_cublas(cublasStatus_t status, const char* call, const char* file, int line) {
  if (status != CUBLAS_STATUS_SUCCESS)
    moebius::detail::throw_error(moebius::errc::cuda, file, line, call,
                                 " failed: ", cublasGetStatusName(status), " (",
                                 cublasGetStatusString(status), ")");
}

// Column-major view: y^T [N x T] = (W as K x N)^T . (x as K x T).
void linear(cublasHandle_t handle, const linear_args& a, cudaStream_t stream) {
  if (a.tokens == 0 || a.out_features == 0) return;
  const cudaDataType_t t = cuda_type(a.type);
  const float alpha = 1.0f, beta = a.accumulate ? 1.0f : 0.0f;
  MINI_ENGINE_CUBLAS_CHECK(cublasSetStream(handle, stream));
  MINI_ENGINE_CUBLAS_CHECK(
      cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(a.out_features),
                   static_cast<int>(a.tokens), static_cast<int>(a.in_features), &alpha, a.w, t,
                   static_cast<int>(a.ldw), a.x, t, static_cast<int>(a.ldx), &beta, a.y, CUDA_R_32F,
                   static_cast<int>(a.ldy), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

void expert_gemms(cublasHandle_t handle, const moe_plan& p, cudaStream_t stream) {
  if (p.max_tiles == 0) return;
  const cudaDataType_t t = cuda_type(p.type);
  const float alpha = 1.0f, beta = 0.0f;
  const int H = static_cast<int>(p.hidden), I = static_cast<int>(p.inter);
  const int M = static_cast<int>(p.tile_rows), batch = static_cast<int>(p.max_tiles);
  MINI_ENGINE_CUBLAS_CHECK(cublasSetStream(handle, stream));
  // gu^T [2I x M] = (w13 as H x 2I)^T . (x as H x M)
  MINI_ENGINE_CUBLAS_CHECK(
      cublasGemmBatchedEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, 2 * I, M, H, &alpha, p.ptr_w13, t, H,
                          p.ptr_x, t, H, &beta, reinterpret_cast<void* const*>(p.ptr_gu),
                          CUDA_R_32F, 2 * I, batch, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  silu_and_mul_args s;
  s.in = p.gu;
  s.out = p.act;
  s.out_type = p.type;
  s.rows = p.max_tiles * p.tile_rows;
  s.inter = p.inter;
  launch_silu_and_mul(s, stream);
  // y^T [H x M] = (w2 as I x H)^T . (act as I x M)
  MINI_ENGINE_CUBLAS_CHECK(cublasGemmBatchedEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, H, M, I, &alpha,
                                               p.ptr_w2, t, I, p.ptr_act, t, I, &beta,
                                               reinterpret_cast<void* const*>(p.ptr_y), CUDA_R_32F,
                                               H, batch, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

}  // namespace mini_engine::gpu
