// Matrix products through cuBLAS (a few rows times a weight go to ops/cuda/gemv.cu).  Row-major
// C[M,N] = A[M,K] B[K,N] is computed as the column-major product C^T = B^T A^T, so the operands swap places and no data moves.  f32 uses
// CUBLAS_COMPUTE_32F (no TF32, as PyTorch's default); bf16 and f16 accumulate in f32.
#include <cublas_v2.h>

#include <mutex>
#include <vector>

#include "core/cuda_runtime.h"
#include "ops/cuda/launch.h"

#define KCPP_CUBLAS_CHECK(expr)                                                                         \
  do {                                                                                                  \
    const cublasStatus_t kcpp_st_ = (expr);                                                             \
    KCPP_CHECK(kcpp_st_ == CUBLAS_STATUS_SUCCESS, "cuBLAS error {}: {}", static_cast<int>(kcpp_st_),    \
               cublasGetStatusString(kcpp_st_));                                                        \
  } while (0)

namespace kcpp::ops::cuda {
namespace {

cublasHandle_t handle_for(int device) {
  static std::mutex mu;
  static std::vector<cublasHandle_t> handles;  // one per device, kept for the process lifetime
  std::lock_guard lock(mu);
  if (static_cast<int>(handles.size()) <= device) handles.resize(device + 1, nullptr);
  if (!handles[device]) {
    kcpp::cuda::DeviceGuard g(device);
    KCPP_CUBLAS_CHECK(cublasCreate(&handles[device]));
  }
  return handles[device];
}

cudaDataType_t cuda_type(DType t) {
  switch (t) {
    case DType::f32: return CUDA_R_32F;
    case DType::bf16: return CUDA_R_16BF;
    case DType::f16: return CUDA_R_16F;
    default: KCPP_FAIL("op matmul: dtype {} is not supported on CUDA", dtype_name(t));
  }
}

}  // namespace

void matmul(const Tensor& out, const Tensor& a, const Tensor& b, bool trans_a, bool trans_b, int64_t batch, int64_t m,
            int64_t n, int64_t k, bool broadcast_b) {
  kcpp::cuda::DeviceGuard g(out.device().index);
  cublasHandle_t h = handle_for(out.device().index);
  KCPP_CUBLAS_CHECK(cublasSetStream(h, kcpp::cuda::current_stream()));
  const cudaDataType_t t = cuda_type(out.dtype());
  const float alpha = 1.0f, beta = 0.0f;
  // Column-major view: C^T [N, M] = op(B)^T [N, K] * op(A)^T [K, M].
  const int64_t ldb = trans_b ? k : n, lda = trans_a ? m : k;
  const cublasOperation_t opb = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, opa = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  if (broadcast_b && !trans_a) {  // fold the batch into M: one large GEMM
    m *= batch;
    batch = 1;
  }
  // A few rows times a weight [N, K]: a decode step's projection, streamed by ops/cuda/gemv.cu.
  if (batch == 1 && !trans_a && trans_b && m <= kGemvMaxRows && gemv_small_m(out, a, b, m, n, k)) return;
  KCPP_CUBLAS_CHECK(cublasGemmStridedBatchedEx(h, opb, opa, static_cast<int>(n), static_cast<int>(m),
                                               static_cast<int>(k), &alpha, b.data(), t, static_cast<int>(ldb),
                                               broadcast_b ? 0 : k * n, a.data(), t, static_cast<int>(lda), m * k,
                                               &beta, out.data(), t, static_cast<int>(n), m * n,
                                               static_cast<int>(batch), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

}  // namespace kcpp::ops::cuda
