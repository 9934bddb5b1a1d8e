// Cross-entropy on CUDA (maths in cross_entropy.h).  Kernels, all on the caller's stream, none
// synchronizing with the host:
//  1. count_valid (Mean only): one block counts the non-ignored rows into the workspace;
//  2. rows: one block per row (blocks striding over rows): pass 1 reads the row once, keeping per
//     thread an online (max, sum of exp) pair and the sum of logits, combined over the block in a
//     fixed order; pass 2 re-reads the row (mostly from L2) and writes the gradient, scaled by
//     1 / count for Mean, possibly over the logits; the row's loss goes to the workspace;
//  3. reduce_loss (Mean, Sum): one block adds the rows' losses in a fixed order.
#include <cmath>

#include "cross_entropy.h"
#include "kcpp/kernel/cuda.cuh"

namespace kcpp::liger {
namespace {

using namespace kcpp::kernel::cuda;

constexpr int kThreads = 512;

__device__ __forceinline__ int64_t target_at(const CrossEntropyParams& p, int64_t i) {
  return p.targets_i32 ? static_cast<const int32_t*>(p.targets)[i] : static_cast<const int64_t*>(p.targets)[i];
}

// Online softmax state: the max m and sum s of exp(x - m).  Merge is exact up to rounding and handles
// the empty state (m = -inf, s = 0).
struct MS {
  float m, s;
};
__device__ __forceinline__ MS merge(MS a, MS b) {
  const float m = fmaxf(a.m, b.m);
  if (m == -INFINITY) return {m, 0.0f};
  return {m, a.s * expf(a.m - m) + b.s * expf(b.m - m)};
}

// Reduces (m, s) and a plain sum over the block; every thread gets the result.
__device__ void block_reduce(MS& ms, float& sum, float* sm, float* ss, float* sx) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const MS other{__shfl_xor_sync(0xffffffffu, ms.m, o), __shfl_xor_sync(0xffffffffu, ms.s, o)};
    ms = merge(ms, other);
    sum += __shfl_xor_sync(0xffffffffu, sum, o);
  }
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  __syncthreads();
  if (lane == 0) sm[warp] = ms.m, ss[warp] = ms.s, sx[warp] = sum;
  __syncthreads();
  ms = lane < warps ? MS{sm[lane], ss[lane]} : MS{-INFINITY, 0.0f};
  sum = lane < warps ? sx[lane] : 0.0f;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const MS other{__shfl_xor_sync(0xffffffffu, ms.m, o), __shfl_xor_sync(0xffffffffu, ms.s, o)};
    ms = merge(ms, other);
    sum += __shfl_xor_sync(0xffffffffu, sum, o);
  }
}

__global__ void count_valid(const __grid_constant__ CrossEntropyParams p, float* count) {
  __shared__ float scratch[32];
  float c = 0.0f;
  for (int64_t i = threadIdx.x; i < p.n; i += blockDim.x) c += target_at(p, i) != p.ignore_index ? 1.0f : 0.0f;
  c = block_sum(c, scratch);  // exact: integers far below 2^24 per thread, and the order is fixed
  if (threadIdx.x == 0) *count = c;
}

// Logits j .. j + VEC of a row in f32, the bias added.
template <typename T, int VEC> __device__ __forceinline__ void load_row(const T* x, const T* bias, int64_t j, float (&f)[VEC]) {
  load_f32(x + j, f);
  if (bias) {
    float b[VEC];
    load_f32(bias + j, b);
#pragma unroll
    for (int k = 0; k < VEC; ++k) f[k] += b[k];
  }
}

template <typename T, int VEC>
__global__ void __launch_bounds__(kThreads) rows_kernel(const __grid_constant__ CrossEntropyParams p, float* row_loss,
                                                         const float* count) {
  __shared__ float sm[32], ss[32], sx[32];
  const int64_t v = p.v, step = int64_t(blockDim.x) * VEC;
  const float eps = p.label_smoothing;
  const float scale = p.reduction == CEReduction::Mean ? p.grad_scale / *count : p.grad_scale;
  const T* bias = static_cast<const T*>(p.bias);
  for (int64_t i = blockIdx.x; i < p.n; i += gridDim.x) {
    const int64_t t = target_at(p, i);
    const T* x = static_cast<const T*>(p.logits) + i * p.logits_stride;
    T* g = p.grad ? static_cast<T*>(p.grad) + i * p.grad_stride : nullptr;
    float* out_loss = p.reduction == CEReduction::None ? p.loss + i : row_loss + i;
    if (t == p.ignore_index) {
      if (g)
        for (int64_t j = threadIdx.x; j < v; j += blockDim.x) g[j] = from_f32<T>(0.0f);
      if (threadIdx.x == 0) {
        *out_loss = 0.0f;
        if (p.lse) p.lse[i] = 0.0f;
      }
      continue;
    }
    const bool bad = t < 0 || t >= v;
    MS ms{-INFINITY, 0.0f};
    float sum = 0.0f;
    for (int64_t j = threadIdx.x * VEC; j < v; j += step) {
      float f[VEC];
      load_row(x, bias, j, f);
      float vm = f[0];
#pragma unroll
      for (int k = 1; k < VEC; ++k) vm = fmaxf(vm, f[k]);
      float vs = 0.0f;
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        vs += expf(f[k] - vm);
        sum += f[k];
      }
      ms = merge(ms, MS{vm, vs});
    }
    block_reduce(ms, sum, sm, ss, sx);
    const float lse = ms.m + logf(ms.s);
    if (threadIdx.x == 0) {
      if (bad) {
        *out_loss = NAN;
        if (p.bad_targets) atomicAdd(p.bad_targets, 1);
      } else {
        const float xt = to_f32(x[t]) + (bias ? to_f32(bias[t]) : 0.0f);
        *out_loss = (1.0f - eps) * (lse - xt) + eps * (lse - sum / static_cast<float>(v));
      }
      if (p.lse) p.lse[i] = lse;
    }
    if (!g) continue;
    __syncthreads();  // in place: every thread has read the row before anyone overwrites x[t]
    const float smooth = eps / static_cast<float>(v), hot = 1.0f - eps;
    for (int64_t j = threadIdx.x * VEC; j < v; j += step) {
      float f[VEC];
      load_row(x, bias, j, f);
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        const float d = expf(f[k] - lse) - smooth - (j + k == t ? hot : 0.0f);
        f[k] = bad ? NAN : d * scale;
      }
      store_f32(g + j, f);
    }
  }
}

__global__ void reduce_loss(const __grid_constant__ CrossEntropyParams p, const float* row_loss, const float* count) {
  __shared__ float scratch[32];
  float s = 0.0f;
  for (int64_t i = threadIdx.x; i < p.n; i += blockDim.x) s += row_loss[i];
  s = block_sum(s, scratch);
  if (threadIdx.x == 0) p.loss[0] = p.reduction == CEReduction::Mean ? s / *count : s;
}

__global__ void empty_loss(float* loss, float value) { *loss = value; }

// dlogits = grad * dloss: blocks stride over rows, threads over VEC-element vectors of a row.
template <typename T, int VEC> __global__ void __launch_bounds__(256) scale_rows(const __grid_constant__ CEScaleParams p) {
  for (int64_t i = blockIdx.x; i < p.n; i += gridDim.x) {
    const float s = p.dloss ? p.dloss[p.per_row ? i : 0] : p.scale;
    const T* g = static_cast<const T*>(p.grad) + i * p.grad_stride;
    T* d = static_cast<T*>(p.dlogits) + i * p.dlogits_stride;
    for (int64_t j = threadIdx.x; j < p.v / VEC; j += blockDim.x) {
      float x[VEC];
      load_f32(g + j * VEC, x);
#pragma unroll
      for (int k = 0; k < VEC; ++k) x[k] *= s;
      store_f32(d + j * VEC, x);
    }
  }
}

}  // namespace

const char* cross_entropy_scale_cuda(const CEScaleParams& p, cudaStream_t stream) {
  if (const char* e = cross_entropy_scale_check(p)) return e;
  if (p.n == 0) return nullptr;
  int device = 0;
  cudaGetDevice(&device);
  const int vec_full = 16 / kcpp::kernel::dtype_bytes(p.dtype);
  const bool vec_ok = p.v % vec_full == 0 && aligned16(p.grad) && aligned16(p.dlogits) &&
                      p.grad_stride % vec_full == 0 && p.dlogits_stride % vec_full == 0;
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>(p.n, int64_t(sm_count(device)) * 8));
  auto go = [&]<typename T>(T*) {
    if (vec_ok) scale_rows<T, 16 / sizeof(T)><<<grid, 256, 0, stream>>>(p);
    else scale_rows<T, 1><<<grid, 256, 0, stream>>>(p);
  };
  switch (p.dtype) {
    case kernel::DType::f32: go(static_cast<float*>(nullptr)); break;
    case kernel::DType::bf16: go(static_cast<__nv_bfloat16*>(nullptr)); break;
    case kernel::DType::f16: go(static_cast<__half*>(nullptr)); break;
  }
  return launch_error("cross_entropy backward");
}

size_t cross_entropy_workspace(const CrossEntropyParams& p) {
  return (static_cast<size_t>(p.n) + 4) * sizeof(float);  // [count, pad x3, row losses...]
}

const char* cross_entropy_count_cuda(const CrossEntropyParams& p, float* count, cudaStream_t stream) {
  count_valid<<<1, 1024, 0, stream>>>(p, count);
  return launch_error("cross_entropy count");
}

const char* cross_entropy_rows_cuda(const CrossEntropyParams& p, float* row_loss, const float* count, cudaStream_t stream) {
  if (p.n == 0) return nullptr;
  int device = 0;
  cudaGetDevice(&device);
  const int vec_full = 16 / kcpp::kernel::dtype_bytes(p.dtype);
  const bool vec_ok = p.v % vec_full == 0 && aligned16(p.logits) && p.logits_stride % vec_full == 0 &&
                      (!p.grad || (aligned16(p.grad) && p.grad_stride % vec_full == 0)) && (!p.bias || aligned16(p.bias));
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>(p.n, int64_t(sm_count(device)) * 4));
  auto go = [&]<typename T>(T*) {
    if (vec_ok) rows_kernel<T, 16 / sizeof(T)><<<grid, kThreads, 0, stream>>>(p, row_loss, count);
    else rows_kernel<T, 1><<<grid, kThreads, 0, stream>>>(p, row_loss, count);
  };
  switch (p.dtype) {
    case kernel::DType::f32: go(static_cast<float*>(nullptr)); break;
    case kernel::DType::bf16: go(static_cast<__nv_bfloat16*>(nullptr)); break;
    case kernel::DType::f16: go(static_cast<__half*>(nullptr)); break;
  }
  return launch_error("cross_entropy");
}

const char* cross_entropy_reduce_cuda(const CrossEntropyParams& p, const float* row_loss, const float* count,
                                      cudaStream_t stream) {
  if (p.n == 0) empty_loss<<<1, 1, 0, stream>>>(p.loss, p.reduction == CEReduction::Mean ? NAN : 0.0f);
  else reduce_loss<<<1, 1024, 0, stream>>>(p, row_loss, count);
  return launch_error("cross_entropy reduce");
}

const char* cross_entropy_cuda(const CrossEntropyParams& p, cudaStream_t stream) {
  if (const char* e = cross_entropy_check(p)) return e;
  KCPP_KERNEL_REQUIRE(p.workspace != nullptr, "cross_entropy: argument 'workspace' is null (see cross_entropy_workspace)");
  float* count = static_cast<float*>(p.workspace);
  float* row_loss = count + 4;
  // The mean of no rows is NaN (as PyTorch), their sum 0: written by a kernel, so graph capture is safe.
  if (p.reduction == CEReduction::Mean && p.n > 0)
    if (const char* e = cross_entropy_count_cuda(p, count, stream)) return e;
  if (const char* e = cross_entropy_rows_cuda(p, row_loss, count, stream)) return e;
  if (p.reduction != CEReduction::None) return cross_entropy_reduce_cuda(p, row_loss, count, stream);
  return nullptr;
}

}  // namespace kcpp::liger
