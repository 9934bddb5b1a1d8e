// Reference gathers and scatters.  Indices are checked on the device; a bad one is reported
// through DataCheck (which synchronizes) and the op throws instead of reading out of bounds.
#include "ops/cuda/common.cuh"
#include "ops/cuda/launch.h"

namespace kcpp::ops::cuda {
namespace {

using kcpp::cuda::load_as_f64;
using kcpp::cuda::load_as_i64;
using kcpp::cuda::store_f64;

// One block per id: copies row ids[i] of w [V, H] (elements of `es` bytes, as 16-bit words or bytes).
__global__ void embedding_kernel(char* out, const char* w, const void* ids, DType id_t, int64_t n, int64_t v,
                                 int64_t row_bytes, unsigned long long* flag) {
  for (int64_t i = blockIdx.x; i < n; i += gridDim.x) {
    const int64_t id = load_as_i64(ids, id_t, i);
    if (id < 0 || id >= v) {
      if (threadIdx.x == 0) report_bad(flag, i, id);
      continue;
    }
    const char* src = w + id * row_bytes;
    char* dst = out + i * row_bytes;
    if (row_bytes % 4 == 0) {
      for (int64_t j = threadIdx.x; j < row_bytes / 4; j += blockDim.x)
        reinterpret_cast<uint32_t*>(dst)[j] = reinterpret_cast<const uint32_t*>(src)[j];
    } else {
      for (int64_t j = threadIdx.x; j < row_bytes; j += blockDim.x) dst[j] = src[j];
    }
  }
}

__global__ void embedding_backward_kernel(float* acc, const float* g, const void* ids, DType id_t, int64_t n,
                                          int64_t v, int64_t h, unsigned long long* flag) {
  for (int64_t i = blockIdx.x; i < n; i += gridDim.x) {
    const int64_t id = load_as_i64(ids, id_t, i);
    if (id < 0 || id >= v) {
      if (threadIdx.x == 0) report_bad(flag, i, id);
      continue;
    }
    for (int64_t j = threadIdx.x; j < h; j += blockDim.x) atomicAdd(acc + id * h + j, g[i * h + j]);
  }
}

__global__ void gather_kernel(void* out, const void* x, DType t, const void* idx, DType id_t, int64_t n, int64_t v,
                              int64_t ignore, unsigned long long* flag) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t c = load_as_i64(idx, id_t, i);
    double val = 0.0;
    if (c != ignore) {
      if (c < 0 || c >= v) report_bad(flag, i, c);
      else val = load_as_f64(x, t, i * v + c);
    }
    store_f64(out, t, i, val);
  }
}

__global__ void scatter_kernel(void* out, const void* values, DType t, const void* idx, DType id_t, int64_t n,
                               int64_t v, int64_t ignore, unsigned long long* flag) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t c = load_as_i64(idx, id_t, i);
    if (c == ignore) continue;
    if (c < 0 || c >= v) report_bad(flag, i, c);
    else store_f64(out, t, i * v + c, load_as_f64(values, t, i));
  }
}

__global__ void valid_kernel(void* out, DType t, const void* idx, DType id_t, int64_t n, int64_t ignore) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    store_f64(out, t, i, load_as_i64(idx, id_t, i) != ignore ? 1.0 : 0.0);
}

}  // namespace

void embedding(const Tensor& out, const Tensor& weight, const Tensor& ids) {
  const int64_t n = ids.numel();
  if (n == 0) return;
  kcpp::cuda::DeviceGuard g(out.device().index);
  DataCheck check(out.device());
  const int64_t row_bytes = weight.size(1) * static_cast<int64_t>(weight.element_size());
  embedding_kernel<<<kcpp::cuda::grid_for(n, 1, 65535 * 16), 128, 0, kcpp::cuda::current_stream()>>>(
      static_cast<char*>(out.data()), static_cast<const char*>(weight.data()), ids.data(), ids.dtype(), n,
      weight.size(0), row_bytes, check.ptr());
  KCPP_CUDA_CHECK_LAUNCH("embedding");
  check.check("embedding", "ids", weight.size(0));
}

void embedding_backward(const Tensor& acc, const Tensor& grad, const Tensor& ids) {
  const int64_t n = ids.numel();
  if (n == 0) return;
  kcpp::cuda::DeviceGuard g(acc.device().index);
  KCPP_CHECK(acc.dtype() == DType::f32, "op embedding_backward: f32 accumulator expected on CUDA");
  DataCheck check(acc.device());
  embedding_backward_kernel<<<kcpp::cuda::grid_for(n, 1, 65535 * 16), 128, 0, kcpp::cuda::current_stream()>>>(
      static_cast<float*>(acc.data()), static_cast<const float*>(grad.data()), ids.data(), ids.dtype(), n,
      acc.size(0), acc.size(1), check.ptr());
  KCPP_CUDA_CHECK_LAUNCH("embedding_backward");
  check.check("embedding_backward", "ids", acc.size(0));
}

void gather_last(const Tensor& out, const Tensor& x, const Tensor& idx, int64_t ignore_index) {
  const int64_t n = idx.numel();
  if (n == 0) return;
  kcpp::cuda::DeviceGuard g(out.device().index);
  DataCheck check(out.device());
  gather_kernel<<<kcpp::cuda::grid_for(n, 256), 256, 0, kcpp::cuda::current_stream()>>>(
      out.data(), x.data(), x.dtype(), idx.data(), idx.dtype(), n, x.size(1), ignore_index, check.ptr());
  KCPP_CUDA_CHECK_LAUNCH("gather_last");
  check.check("gather_last", "idx", x.size(1));
}

void scatter_last(const Tensor& out, const Tensor& values, const Tensor& idx, int64_t ignore_index) {
  const int64_t n = idx.numel();
  if (n == 0) return;
  kcpp::cuda::DeviceGuard g(out.device().index);
  DataCheck check(out.device());
  scatter_kernel<<<kcpp::cuda::grid_for(n, 256), 256, 0, kcpp::cuda::current_stream()>>>(
      out.data(), values.data(), values.dtype(), idx.data(), idx.dtype(), n, out.size(1), ignore_index, check.ptr());
  KCPP_CUDA_CHECK_LAUNCH("scatter_last");
  check.check("scatter_last", "idx", out.size(1));
}

void valid_mask(const Tensor& out, const Tensor& idx, int64_t ignore_index) {
  const int64_t n = idx.numel();
  if (n == 0) return;
  kcpp::cuda::DeviceGuard g(out.device().index);
  valid_kernel<<<kcpp::cuda::grid_for(n, 256), 256, 0, kcpp::cuda::current_stream()>>>(
      out.data(), out.dtype(), idx.data(), idx.dtype(), n, ignore_index);
  KCPP_CUDA_CHECK_LAUNCH("valid_mask");
}

}  // namespace kcpp::ops::cuda
