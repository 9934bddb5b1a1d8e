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

// One block per row: each thread keeps its best (value, index) and its first non-finite index, then
// the block combines them (larger value, then lower index; lower non-finite index).
template <typename T> __global__ void argmax_checked_kernel(const T* x, int64_t* out, int64_t n) {
  __shared__ float best_v[32];
  __shared__ long long best_i[32], bad_i[32];
  const T* row = x + blockIdx.x * n;
  float bv = -INFINITY;
  long long bi = -1, bad = -1;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const float v = to_f32(row[i]);
    if (!isfinite(v)) {
      if (bad < 0) bad = i;  // i grows: the thread's first
    } else if (bi < 0 || v > bv) {
      bv = v, bi = i;
    }
  }
  auto better = [](float v, long long i, float w, long long j) {  // is (w, j) better than (v, i)?
    return j >= 0 && (i < 0 || w > v || (w == v && j < i));
  };
  for (int o = 16; o > 0; o >>= 1) {
    const float w = __shfl_xor_sync(0xffffffffu, bv, o);
    const long long j = __shfl_xor_sync(0xffffffffu, bi, o);
    const long long b2 = __shfl_xor_sync(0xffffffffu, bad, o);
    if (better(bv, bi, w, j)) bv = w, bi = j;
    if (b2 >= 0 && (bad < 0 || b2 < bad)) bad = b2;
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  if (lane == 0) best_v[warp] = bv, best_i[warp] = bi, bad_i[warp] = bad;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < warps; ++w) {
      if (better(bv, bi, best_v[w], best_i[w])) bv = best_v[w], bi = best_i[w];
      if (bad_i[w] >= 0 && (bad < 0 || bad_i[w] < bad)) bad = bad_i[w];
    }
    out[2 * blockIdx.x] = bi < 0 ? 0 : bi;
    out[2 * blockIdx.x + 1] = bad;
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

void argmax_checked(const Tensor& out, const Tensor& x) {
  const int64_t n = x.size(-1), rows = rows_of(x);
  if (rows == 0) return;
  kcpp::cuda::DeviceGuard g(x.device().index);
  visit_cuda_float(x.dtype(), "argmax_checked", [&]<typename T>(std::type_identity<T>) {
    argmax_checked_kernel<T><<<static_cast<unsigned>(rows), block_for(n), 0, kcpp::cuda::current_stream()>>>(
        static_cast<const T*>(x.data()), static_cast<int64_t*>(out.data()), n);
  });
  KCPP_CUDA_CHECK_LAUNCH("argmax_checked");
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
