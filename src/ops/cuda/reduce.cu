// Reference row reductions and softmax: one block per row of [rows, n], f32 accumulation, the
// row read once per pass (max, sum, write), as PyTorch's generic kernels do.
#include "ops/cuda/common.cuh"
#include "ops/cuda/launch.h"

namespace kcpp::ops::cuda {
namespace {

using kcpp::kernel::cuda::from_f32;
using kcpp::kernel::cuda::to_f32;

int block_for(int64_t n) { return n >= 512 ? 512 : n >= 128 ? 128 : 32; }

template <typename T> __global__ void reduce_kernel(const T* x, T* out, int64_t n, Reduce op) {
  __shared__ float scratch[32];
  const T* row = x + blockIdx.x * n;
  float v;
  if (op == Reduce::Max) {
    v = -INFINITY;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) v = combine<BlockOp::Max>(to_f32(row[i]), v);
    v = block_reduce<BlockOp::Max>(v, scratch);
  } else {
    v = 0.0f;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) v += to_f32(row[i]);
    v = block_reduce<BlockOp::Sum>(v, scratch);
    if (op == Reduce::Mean) v /= static_cast<float>(n);
  }
  if (threadIdx.x == 0) out[blockIdx.x] = from_f32<T>(v);
}

template <typename T> __global__ void softmax_kernel(const T* x, T* out, int64_t n, bool log) {
  __shared__ float scratch[32];
  const T* row = x + blockIdx.x * n;
  T* orow = out + blockIdx.x * n;
  float mx = -INFINITY;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) mx = combine<BlockOp::Max>(to_f32(row[i]), mx);
  mx = block_reduce<BlockOp::Max>(mx, scratch);
  if (isinf(mx) && mx < 0) mx = 0.0f;
  float s = 0.0f;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) s += expf(to_f32(row[i]) - mx);
  s = block_reduce<BlockOp::Sum>(s, scratch);
  const float lse = mx + logf(s);
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const float v = to_f32(row[i]);
    orow[i] = from_f32<T>(log ? v - lse : expf(v - mx) / s);
  }
}

template <typename T> __global__ void softmax_backward_kernel(const T* dy, const T* y, T* dx, int64_t n, bool log) {
  __shared__ float scratch[32];
  const int64_t base = blockIdx.x * n;
  float s = 0.0f;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x)
    s += log ? to_f32(dy[base + i]) : to_f32(dy[base + i]) * to_f32(y[base + i]);
  s = block_reduce<BlockOp::Sum>(s, scratch);
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const float g = to_f32(dy[base + i]), v = to_f32(y[base + i]);
    dx[base + i] = from_f32<T>(log ? g - expf(v) * s : v * (g - s));
  }
}

int64_t rows_of(const Tensor& x) {
  const int64_t n = x.dim() == 0 ? 1 : x.size(-1);
  return n == 0 ? 0 : x.numel() / n;
}

}  // namespace

void reduce_last(Reduce op, const Tensor& out, const Tensor& x) {
  const int64_t n = x.size(-1), rows = rows_of(x);
  if (out.numel() == 0) return;
  kcpp::cuda::DeviceGuard g(x.device().index);
  if (n == 0) {  // sums of nothing are 0; means of nothing NaN
    out.fill_(op == Reduce::Mean ? NAN : 0.0);
    return;
  }
  visit_cuda_float(x.dtype(), "reduce", [&]<typename T>(std::type_identity<T>) {
    reduce_kernel<T><<<static_cast<unsigned>(rows), block_for(n), 0, kcpp::cuda::current_stream()>>>(
        static_cast<const T*>(x.data()), static_cast<T*>(out.data()), n, op);
  });
  KCPP_CUDA_CHECK_LAUNCH("reduce");
}

void softmax(Softmax kind, const Tensor& out, const Tensor& x) {
  const int64_t n = x.size(-1), rows = rows_of(x);
  if (rows == 0) return;
  kcpp::cuda::DeviceGuard g(x.device().index);
  visit_cuda_float(x.dtype(), "softmax", [&]<typename T>(std::type_identity<T>) {
    softmax_kernel<T><<<static_cast<unsigned>(rows), block_for(n), 0, kcpp::cuda::current_stream()>>>(
        static_cast<const T*>(x.data()), static_cast<T*>(out.data()), n, kind == Softmax::LogSoftmax);
  });
  KCPP_CUDA_CHECK_LAUNCH("softmax");
}

void softmax_backward(Softmax kind, const Tensor& dx, const Tensor& dy, const Tensor& y) {
  const int64_t n = y.size(-1), rows = rows_of(y);
  if (rows == 0) return;
  kcpp::cuda::DeviceGuard g(y.device().index);
  visit_cuda_float(y.dtype(), "softmax_backward", [&]<typename T>(std::type_identity<T>) {
    softmax_backward_kernel<T><<<static_cast<unsigned>(rows), block_for(n), 0, kcpp::cuda::current_stream()>>>(
        static_cast<const T*>(dy.data()), static_cast<const T*>(y.data()), static_cast<T*>(dx.data()), n,
        kind == Softmax::LogSoftmax);
  });
  KCPP_CUDA_CHECK_LAUNCH("softmax_backward");
}

}  // namespace kcpp::ops::cuda
