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

// argmax with a check, split along the row so that one long row (a batch-1 decode step's logits,
// 150k entries) is read by many blocks: block (part, row) scans `chunk` entries and keeps its best
// (value, lowest index) and its first non-finite index; argmax_combine_kernel then folds a row's
// parts in order.  "Better" is a larger value, then a lower index, so the result is the first
// maximum, as one sequential scan would find it.
struct ArgmaxPart {
  float value;
  long long index, bad;  // -1: none
};

__device__ __forceinline__ bool argmax_better(float v, long long i, float w, long long j) {  // (w, j) over (v, i)?
  return j >= 0 && (i < 0 || w > v || (w == v && j < i));
}

__device__ __forceinline__ void argmax_fold(float& bv, long long& bi, long long& bad, float w, long long j, long long b2) {
  if (argmax_better(bv, bi, w, j)) bv = w, bi = j;
  if (b2 >= 0 && (bad < 0 || b2 < bad)) bad = b2;
}

__device__ __forceinline__ void argmax_warp(float& bv, long long& bi, long long& bad) {
  for (int o = 16; o > 0; o >>= 1)
    argmax_fold(bv, bi, bad, __shfl_xor_sync(0xffffffffu, bv, o), __shfl_xor_sync(0xffffffffu, bi, o),
                __shfl_xor_sync(0xffffffffu, bad, o));
}

template <typename T>
__global__ void argmax_part_kernel(const T* x, ArgmaxPart* parts, int64_t n, int64_t chunk) {
  __shared__ float best_v[32];
  __shared__ long long best_i[32], bad_i[32];
  const T* row = x + blockIdx.y * n;
  const int64_t lo = blockIdx.x * chunk, hi = lo + chunk < n ? lo + chunk : n;
  float bv = -INFINITY;
  long long bi = -1, bad = -1;
  // kLoads entries a thread loaded before the first is compared (they are independent), then folded in
  // index order.
  constexpr int kLoads = 4;
  for (int64_t i0 = lo + threadIdx.x; i0 < hi; i0 += kLoads * static_cast<int64_t>(blockDim.x)) {
    float v[kLoads];
#pragma unroll
    for (int u = 0; u < kLoads; ++u) {
      const int64_t i = i0 + u * static_cast<int64_t>(blockDim.x);
      v[u] = i < hi ? to_f32(row[i]) : 0.f;
    }
#pragma unroll
    for (int u = 0; u < kLoads; ++u) {
      const int64_t i = i0 + u * static_cast<int64_t>(blockDim.x);
      if (i >= hi) break;
      if (!isfinite(v[u])) {
        if (bad < 0) bad = i;  // i grows: the thread's first
      } else if (bi < 0 || v[u] > bv) {
        bv = v[u], bi = i;
      }
    }
  }
  argmax_warp(bv, bi, bad);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  if (lane == 0) best_v[warp] = bv, best_i[warp] = bi, bad_i[warp] = bad;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < warps; ++w) argmax_fold(bv, bi, bad, best_v[w], best_i[w], bad_i[w]);
    parts[blockIdx.y * gridDim.x + blockIdx.x] = {bv, bi, bad};
  }
}

// One warp per row: out[2 r] = the row's argmax (0 when no entry is finite), out[2 r + 1] = its
// first non-finite index or -1.
__global__ void argmax_combine_kernel(const ArgmaxPart* parts, int64_t* out, int64_t rows, int n_parts) {
  const int64_t r = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  if (r >= rows) return;
  float bv = -INFINITY;
  long long bi = -1, bad = -1;
  for (int p = threadIdx.x % 32; p < n_parts; p += 32) {
    const ArgmaxPart q = parts[r * n_parts + p];
    argmax_fold(bv, bi, bad, q.value, q.index, q.bad);
  }
  argmax_warp(bv, bi, bad);
  if (threadIdx.x % 32 == 0) {
    out[2 * r] = bi < 0 ? 0 : bi;
    out[2 * r + 1] = bad;
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
  // 1024 entries a block (4 a thread, loaded at once): a 150k-entry row is 149 blocks, about one an SM.
  constexpr int64_t kChunk = 1024;
  constexpr int kThreads = 256, kCombineWarps = 4;
  const int64_t n_parts = (n + kChunk - 1) / kChunk;
  const Tensor parts = Tensor::empty({rows * n_parts * static_cast<int64_t>(sizeof(ArgmaxPart))}, DType::u8, x.device());
  auto* p = static_cast<ArgmaxPart*>(parts.data());
  visit_cuda_float(x.dtype(), "argmax_checked", [&]<typename T>(std::type_identity<T>) {
    for (int64_t r0 = 0; r0 < rows; r0 += 65535) {  // the grid's y dimension holds 65535 rows
      const int64_t r = std::min<int64_t>(rows - r0, 65535);
      argmax_part_kernel<T><<<dim3(static_cast<unsigned>(n_parts), static_cast<unsigned>(r)), kThreads, 0,
                              kcpp::cuda::current_stream()>>>(static_cast<const T*>(x.data()) + r0 * n, p + r0 * n_parts, n,
                                                              kChunk);
    }
  });
  KCPP_CUDA_CHECK_LAUNCH("argmax_checked");
  argmax_combine_kernel<<<static_cast<unsigned>((rows + kCombineWarps - 1) / kCombineWarps), 32 * kCombineWarps, 0,
                          kcpp::cuda::current_stream()>>>(p, static_cast<int64_t*>(out.data()), rows,
                                                          static_cast<int>(n_parts));
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
