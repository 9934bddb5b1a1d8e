// Fused linear cross-entropy on CUDA (maths and schedule in fused_linear_ce.h).  The GEMMs are cuBLAS
// (cublasGemmEx, f32 accumulation, no TF32) on the caller's stream with its workspace taken from the
// host's allocator (so graph capture and the host's memory accounting both hold); the rows are the
// cross-entropy kernel's (cross_entropy_cuda.cu).  Nothing synchronizes with the host.
//
// cuBLAS is column-major; a row-major [r, c] matrix with row stride ld is its column-major [c, r]
// transpose with leading dimension ld, so each row-major product below is written transposed:
//   logits_c [C, V] = X_c W^T      ->  L^T  [V, C] = (W as [H, V])^T (X_c as [H, C])
//   dX_c     [C, H] = G_c W        ->  dX^T [H, C] = (W as [H, V])   (G_c as [V, C])
//   dW      [V, H] += G_c^T X_c    ->  dW^T [H, V] = (X_c as [H, C]) (G_c as [V, C])^T
#include <cublas_v2.h>

#include <algorithm>
#include <cmath>

#include "fused_linear_ce.h"
#include "kcpp/kernel/cuda.cuh"

namespace kcpp::liger {
namespace {

using namespace kcpp::kernel::cuda;

constexpr size_t kCublasWorkspace = size_t(32) << 20;  // as fused_linear_ce_cpu.cpp's Layout
constexpr size_t kAlign = 256;

// One cuBLAS handle per device and thread (a handle must not be used by two threads at once).  They
// are never destroyed: destroying at thread or process exit can run after the CUDA context is gone.
const char* handle_for(cublasHandle_t* out) {
  thread_local cublasHandle_t handles[64] = {};
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= 64) return "fused_linear_ce: no usable CUDA device";
  if (!handles[device]) {
    const cublasStatus_t s = cublasCreate(&handles[device]);
    if (s != CUBLAS_STATUS_SUCCESS) {
      handles[device] = nullptr;
      return kernel::errorf("fused_linear_ce: cublasCreate failed: %s", cublasGetStatusString(s));
    }
  }
  *out = handles[device];
  return nullptr;
}

cudaDataType_t cuda_type(kernel::DType t) {
  switch (t) {
    case kernel::DType::f32: return CUDA_R_32F;
    case kernel::DType::bf16: return CUDA_R_16BF;
    case kernel::DType::f16: return CUDA_R_16F;
  }
  return CUDA_R_32F;
}

struct Gemm {
  cublasHandle_t handle;
  cudaDataType_t ab;  // the inputs' type
  const char* run(const char* what, cublasOperation_t ta, cublasOperation_t tb, int64_t m, int64_t n, int64_t k, const void* a,
                  int64_t lda, const void* b, int64_t ldb, float beta, void* c, cudaDataType_t ct, int64_t ldc) const {
    const float alpha = 1.0f;
    const cublasStatus_t s =
        cublasGemmEx(handle, ta, tb, static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), &alpha, a, ab,
                     static_cast<int>(lda), b, ab, static_cast<int>(ldb), &beta, c, ct, static_cast<int>(ldc),
                     CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    if (s != CUBLAS_STATUS_SUCCESS) return kernel::errorf("fused_linear_ce: GEMM %s failed: %s", what, cublasGetStatusString(s));
    return nullptr;
  }
};

// acc[i] = src ? src[i] : 0 (f32), i < count.
template <typename T> __global__ void load_acc(float* acc, const T* src, int64_t count) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < count; i += int64_t(gridDim.x) * blockDim.x)
    acc[i] = src ? to_f32(src[i]) : 0.0f;
}
// dst[i] = acc[i] rounded to T.
template <typename T> __global__ void store_acc(T* dst, const float* acc, int64_t count) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < count; i += int64_t(gridDim.x) * blockDim.x)
    dst[i] = from_f32<T>(acc[i]);
}
// acc[j] += sum_i g[i, j] over `rows` rows of width v: one thread per column, rows in order
// (deterministic), a warp reading 32 adjacent columns of a row at once.
template <typename T> __global__ void column_sum(const T* g, int64_t rows, int64_t v, float* acc) {
  const int64_t j = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (j >= v) return;
  float s = 0.0f;
  for (int64_t i = 0; i < rows; ++i) s += to_f32(g[i * v + j]);
  acc[j] += s;
}

unsigned grid_for(int64_t count, int threads) {
  int device = 0;
  cudaGetDevice(&device);
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>((count + threads - 1) / threads, int64_t(sm_count(device)) * 16)));
}

template <typename T> const char* run(const FusedLinearCEParams& p, cudaStream_t stream) {
  const int64_t n = p.n, h = p.h, v = p.v;
  const bool grads = fused_linear_ce_grads(p);
  const int64_t chunk = fused_linear_ce_chunk_rows(p, true);
  const size_t es = sizeof(T);
  const bool narrow = p.dtype != kernel::DType::f32;

  // The workspace, in fused_linear_ce_cpu.cpp's Layout order: count, logits, row losses, db, dW (f32), cuBLAS.
  auto* base = static_cast<unsigned char*>(p.workspace);
  auto take = [&](size_t bytes) {
    void* q = bytes ? base : nullptr;
    base += (bytes + kAlign - 1) / kAlign * kAlign;
    return q;
  };
  float* count = static_cast<float*>(take(4 * sizeof(float)));
  T* logits = static_cast<T*>(take(static_cast<size_t>(chunk * v) * es));
  float* row_loss = static_cast<float*>(take(p.reduction == CEReduction::None ? 0 : static_cast<size_t>(n) * sizeof(float)));
  float* dbias_acc = static_cast<float*>(take(grads && p.dbias ? static_cast<size_t>(v) * sizeof(float) : 0));
  float* dweight_acc =
      static_cast<float*>(take(grads && p.dweight && p.accum_f32 && narrow ? static_cast<size_t>(v * h) * sizeof(float) : 0));
  void* cublas_ws = take(kCublasWorkspace);

  cublasHandle_t handle = nullptr;
  if (const char* e = handle_for(&handle)) return e;
  // cublasSetStream resets the workspace to cuBLAS's own pool, so the workspace is set after it.
  if (cublasSetStream(handle, stream) != CUBLAS_STATUS_SUCCESS ||
      cublasSetWorkspace(handle, cublas_ws, kCublasWorkspace) != CUBLAS_STATUS_SUCCESS)
    return "fused_linear_ce: could not set cuBLAS's stream and workspace";
  const Gemm gemm{handle, cuda_type(p.dtype)};

  const CrossEntropyParams ce = fused_linear_ce_loss_params(p);
  if ((p.reduction == CEReduction::Mean || p.class_weight) && n > 0)
    if (const char* e = cross_entropy_count_cuda(ce, count, stream)) return e;

  T* dweight = static_cast<T*>(p.dweight);
  if (dbias_acc) load_acc<<<grid_for(v, 256), 256, 0, stream>>>(dbias_acc, p.accumulate ? static_cast<const T*>(p.dbias) : nullptr, v);
  if (dweight_acc)
    load_acc<<<grid_for(v * h, 256), 256, 0, stream>>>(dweight_acc, p.accumulate ? static_cast<const T*>(dweight) : nullptr, v * h);
  if (grads && dweight && !dweight_acc && !p.accumulate && n == 0)
    cudaMemsetAsync(dweight, 0, static_cast<size_t>(v * h) * es, stream);
  if (const char* e = launch_error("fused_linear_ce init")) return e;

  const int64_t hs = std::max(p.hidden_stride, h), wsd = std::max(p.weight_stride, h), dhs = std::max(p.dhidden_stride, h);
  for (int64_t r0 = 0; r0 < n; r0 += chunk) {
    const int64_t c = std::min(chunk, n - r0);
    const T* x = static_cast<const T*>(p.hidden) + r0 * hs;
    const cudaDataType_t lt = cuda_type(p.dtype);
    if (const char* e = gemm.run("logits = hidden @ weight^T", CUBLAS_OP_T, CUBLAS_OP_N, v, c, h, p.weight, wsd, x, hs, 0.0f,
                                 logits, lt, v))
      return e;
    CrossEntropyParams rows = ce;
    rows.n = c;
    rows.logits = logits;
    rows.logits_stride = v;
    rows.targets = p.targets_i32 ? static_cast<const void*>(static_cast<const int32_t*>(p.targets) + r0)
                                 : static_cast<const void*>(static_cast<const int64_t*>(p.targets) + r0);
    rows.loss = p.reduction == CEReduction::None ? p.loss + r0 : p.loss;
    rows.grad = grads ? logits : nullptr;
    rows.grad_stride = v;
    rows.lse = p.lse ? p.lse + r0 : nullptr;
    rows.token_weight = p.token_weight ? p.token_weight + r0 : nullptr;
    if (const char* e = cross_entropy_rows_cuda(rows, row_loss ? row_loss + r0 : nullptr, count, stream)) return e;
    if (!grads) continue;
    if (dbias_acc) {
      column_sum<T><<<static_cast<unsigned>((v + 255) / 256), 256, 0, stream>>>(logits, c, v, dbias_acc);
      if (const char* e = launch_error("fused_linear_ce dbias")) return e;
    }
    T* dx = static_cast<T*>(p.dhidden) + r0 * dhs;
    if (const char* e = gemm.run("dhidden = grad @ weight", CUBLAS_OP_N, CUBLAS_OP_N, h, c, v, p.weight, wsd, logits, v, 0.0f, dx,
                                 lt, dhs))
      return e;
    if (dweight) {
      const bool first = r0 == 0 && !p.accumulate;
      void* dw = dweight_acc ? static_cast<void*>(dweight_acc) : static_cast<void*>(dweight);
      const cudaDataType_t dwt = dweight_acc ? CUDA_R_32F : lt;
      if (const char* e = gemm.run("dweight += grad^T @ hidden", CUBLAS_OP_N, CUBLAS_OP_T, h, v, c, x, hs, logits, v,
                                   first && !dweight_acc ? 0.0f : 1.0f, dw, dwt, h))
        return e;
    }
  }
  if (p.reduction != CEReduction::None)
    if (const char* e = cross_entropy_reduce_cuda(ce, row_loss, count, stream)) return e;
  if (dbias_acc) store_acc<<<grid_for(v, 256), 256, 0, stream>>>(static_cast<T*>(p.dbias), dbias_acc, v);
  if (dweight_acc) store_acc<<<grid_for(v * h, 256), 256, 0, stream>>>(dweight, dweight_acc, v * h);
  return launch_error("fused_linear_ce");
}

}  // namespace

const char* fused_linear_ce_cuda(const FusedLinearCEParams& p, cudaStream_t stream) {
  if (const char* e = fused_linear_ce_check(p)) return e;
  KCPP_KERNEL_REQUIRE(p.workspace != nullptr, "fused_linear_ce: argument 'workspace' is null (see fused_linear_ce_workspace)");
  KCPP_KERNEL_REQUIRE((reinterpret_cast<uintptr_t>(p.workspace) & (kAlign - 1)) == 0,
                      "fused_linear_ce: the workspace must be 256-byte aligned");
  switch (p.dtype) {
    case kernel::DType::f32: return run<float>(p, stream);
    case kernel::DType::bf16: return run<__nv_bfloat16>(p, stream);
    case kernel::DType::f16: return run<__half>(p, stream);
  }
  return nullptr;
}

}  // namespace kcpp::liger
