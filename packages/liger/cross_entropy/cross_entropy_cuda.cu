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

// count[0] = the mean's divisor D (non-ignored rows, or the sum of their targets' class weights);
// count[1] = W, the sum of the class weights (with class weights).  One block, a fixed order.
__global__ void count_valid(const __grid_constant__ CrossEntropyParams p, float* count) {
  __shared__ float scratch[32];
  float c = 0.0f;
  for (int64_t i = threadIdx.x; i < p.n; i += blockDim.x) {
    const int64_t t = target_at(p, i);
    if (t == p.ignore_index) continue;
    c += p.class_weight && t >= 0 && t < p.v ? p.class_weight[t] : 1.0f;  // a bad target's row is NaN anyway
  }
  c = block_sum(c, scratch);  // without class weights exact: integers far below 2^24 per thread
  float w = 0.0f;
  if (p.class_weight) {
    for (int64_t j = threadIdx.x; j < p.v; j += blockDim.x) w += p.class_weight[j];
    w = block_sum(w, scratch);
  }
  if (threadIdx.x == 0) count[0] = c, count[1] = w;
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

// Softcap (EXT only): z = c tanh(x / c).
template <bool EXT, int VEC> __device__ __forceinline__ void cap_row(float cap, float (&f)[VEC]) {
  if (EXT && cap > 0.0f) {
#pragma unroll
    for (int k = 0; k < VEC; ++k) f[k] = cap * tanhf(f[k] / cap);
  }
}

// EXT: the per-element options (softcap, class weights) are compiled in; the per-row ones (z-loss,
// token weights) cost nothing and are always there.
template <typename T, int VEC, bool EXT>
__global__ void __launch_bounds__(kThreads, 2048 / kThreads) rows_kernel(const __grid_constant__ CrossEntropyParams p, float* row_loss,
                                                         const float* count) {
  __shared__ float sm[32], ss[32], sx[32];
  const int64_t v = p.v, step = int64_t(blockDim.x) * VEC;
  const float eps = p.label_smoothing, cap = p.softcap, beta = p.lse_square_scale;
  const float* cw = EXT ? p.class_weight : nullptr;
  const float wsum = cw ? count[1] : static_cast<float>(v);
  const float scale = p.reduction == CEReduction::Mean ? p.grad_scale / count[0] : p.grad_scale;
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
    const float tau = p.token_weight ? p.token_weight[i] : 1.0f;
    MS ms{-INFINITY, 0.0f};
    float sum = 0.0f;  // sum_j w_j z_j
    for (int64_t j = threadIdx.x * VEC; j < v; j += step) {
      float f[VEC];
      load_row(x, bias, j, f);
      cap_row<EXT>(cap, f);
      float vm = f[0];
#pragma unroll
      for (int k = 1; k < VEC; ++k) vm = fmaxf(vm, f[k]);
      float vs = 0.0f;
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        vs += expf(f[k] - vm);
        sum += cw ? cw[j + k] * f[k] : f[k];
      }
      ms = merge(ms, MS{vm, vs});
    }
    block_reduce(ms, sum, sm, ss, sx);
    const float lse = ms.m + logf(ms.s);
    const float wt = bad ? 0.0f : cw ? cw[t] : 1.0f;
    if (threadIdx.x == 0) {
      if (bad) {
        *out_loss = NAN;
        if (p.bad_targets) atomicAdd(p.bad_targets, 1);
      } else {
        float zt[1] = {to_f32(x[t]) + (bias ? to_f32(bias[t]) : 0.0f)};
        cap_row<EXT>(cap, zt);
        const float ce = (1.0f - eps) * wt * (lse - zt[0]) + eps / static_cast<float>(v) * (wsum * lse - sum);
        *out_loss = tau * (ce + beta * lse * lse);
      }
      if (p.lse) p.lse[i] = lse;
    }
    if (!g) continue;
    __syncthreads();  // in place: every thread has read the row before anyone overwrites x[t]
    const float smooth = eps / static_cast<float>(v), hot = (1.0f - eps) * wt, s_row = tau * scale;
    const float a = hot + smooth * wsum + 2.0f * beta * lse;  // the factor of p_j
    for (int64_t j = threadIdx.x * VEC; j < v; j += step) {
      float f[VEC];
      load_row(x, bias, j, f);
      cap_row<EXT>(cap, f);
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        float d = expf(f[k] - lse) * a - smooth * (cw ? cw[j + k] : 1.0f) - (j + k == t ? hot : 0.0f);
        if (EXT && cap > 0.0f) d *= 1.0f - (f[k] / cap) * (f[k] / cap);
        f[k] = bad ? NAN : d * s_row;
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
  if (threadIdx.x == 0) p.loss[0] = p.reduction == CEReduction::Mean ? s / count[0] : s;
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
  const bool ext = p.softcap > 0.0f || p.class_weight;
  auto go = [&]<typename T>(T*) {
    constexpr int kVec = 16 / sizeof(T);
    if (ext) {
      if (vec_ok) rows_kernel<T, kVec, true><<<grid, kThreads, 0, stream>>>(p, row_loss, count);
      else rows_kernel<T, 1, true><<<grid, kThreads, 0, stream>>>(p, row_loss, count);
    } else {
      if (vec_ok) rows_kernel<T, kVec, false><<<grid, kThreads, 0, stream>>>(p, row_loss, count);
      else rows_kernel<T, 1, false><<<grid, kThreads, 0, stream>>>(p, row_loss, count);
    }
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
  if ((p.reduction == CEReduction::Mean || p.class_weight) && p.n > 0)
    if (const char* e = cross_entropy_count_cuda(p, count, stream)) return e;
  if (const char* e = cross_entropy_rows_cuda(p, row_loss, count, stream)) return e;
  if (p.reduction != CEReduction::None) return cross_entropy_reduce_cuda(p, row_loss, count, stream);
  return nullptr;
}

}  // namespace kcpp::liger
