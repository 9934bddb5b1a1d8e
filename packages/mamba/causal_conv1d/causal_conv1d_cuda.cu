// The causal depthwise convolution on CUDA (maths and layout in causal_conv1d.h), widths 1 to 4.
//   forward:  a thread per output (batch, channel, position), consecutive threads along the positions
//             (the W taps of neighbours come from the same cache lines).
//   backward: dx as the forward, each thread recomputing pre at the W positions its dx reads; dweight
//             and dbias in a block per channel, its threads striding over (batch, position) and the
//             block's partial sums added in a fixed tree (reproducible bit for bit).
//   update:   a thread per (batch, channel): the S outputs from [conv_state, x], then the state shifted
//             in place (oldest first, so each value is read before it is overwritten).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "causal_conv1d/causal_conv1d.h"
#include "kcpp/kernel/cuda.cuh"
#include "kcpp/kernel/error.h"

namespace kcpp::mamba {
namespace {

namespace kc = kernel::cuda;

constexpr int kThreads = 256;

// pre at position l of row x (zeros before position 0).
template <typename T, int W>
__device__ __forceinline__ float pre_at(const T* x, const float (&w)[W], float bias, int64_t l) {
  float s = bias;
#pragma unroll
  for (int k = 0; k < W; ++k) {
    const int64_t src = l - (W - 1) + k;
    if (src >= 0) s += w[k] * kc::to_f32(x[src]);
  }
  return s;
}

template <typename T, int W>
__device__ __forceinline__ void load_weights(const CausalConv1dParams& p, int64_t d, float (&w)[W], float* bias) {
#pragma unroll
  for (int k = 0; k < W; ++k) w[k] = kc::to_f32(static_cast<const T*>(p.weight)[d * W + k]);
  *bias = p.bias ? kc::to_f32(static_cast<const T*>(p.bias)[d]) : 0.0f;
}

template <typename T, int W>
__global__ void __launch_bounds__(kThreads) conv_forward_kernel(const CausalConv1dParams p) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x, L = p.seqlen;
  if (i >= p.batch * p.dim * L) return;
  const int64_t l = i % L, d = i / L % p.dim, b = i / (L * p.dim);
  float w[W], bias;
  load_weights<T, W>(p, d, w, &bias);
  const float pre = pre_at<T, W>(p.x.at<T>(b, d), w, bias, l);
  p.out.mut<T>(b, d)[l] = kc::from_f32<T>(p.silu ? silu(pre) : pre);
}

template <typename T, int W>
__global__ void __launch_bounds__(kThreads) conv_dx_kernel(const CausalConv1dParams p) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x, L = p.seqlen;
  if (i >= p.batch * p.dim * L) return;
  const int64_t l = i % L, d = i / L % p.dim, b = i / (L * p.dim);
  float w[W], bias;
  load_weights<T, W>(p, d, w, &bias);
  const T* x = p.x.at<T>(b, d);
  const T* dout = p.dout.at<T>(b, d);
  float s = 0.0f;
#pragma unroll
  for (int k = 0; k < W; ++k) {
    const int64_t m = l + (W - 1) - k;  // the output that tap k of x_l feeds
    if (m < L) {
      const float go = kc::to_f32(dout[m]);
      s += w[k] * (p.silu ? go * dsilu(pre_at<T, W>(x, w, bias, m)) : go);
    }
  }
  p.dx.mut<T>(b, d)[l] = kc::from_f32<T>(s);
}

template <typename T, int W>
__global__ void __launch_bounds__(kThreads) conv_dweight_kernel(const CausalConv1dParams p) {
  __shared__ float part[W + 1][kThreads];
  const int64_t d = blockIdx.x, L = p.seqlen;
  float w[W], bias, acc[W + 1] = {};
  load_weights<T, W>(p, d, w, &bias);
  for (int64_t i = threadIdx.x; i < p.batch * L; i += kThreads) {
    const int64_t b = i / L, l = i % L;
    const T* x = p.x.at<T>(b, d);
    const float go = kc::to_f32(p.dout.at<T>(b, d)[l]);
    const float dpre = p.silu ? go * dsilu(pre_at<T, W>(x, w, bias, l)) : go;
#pragma unroll
    for (int k = 0; k < W; ++k) {
      const int64_t src = l - (W - 1) + k;
      if (src >= 0) acc[k] += dpre * kc::to_f32(x[src]);
    }
    acc[W] += dpre;
  }
#pragma unroll
  for (int k = 0; k <= W; ++k) part[k][threadIdx.x] = acc[k];
  __syncthreads();
  for (int half = kThreads / 2; half > 0; half /= 2) {
    if (threadIdx.x < half)
#pragma unroll
      for (int k = 0; k <= W; ++k) part[k][threadIdx.x] += part[k][threadIdx.x + half];
    __syncthreads();
  }
  if (threadIdx.x == 0) {
#pragma unroll
    for (int k = 0; k < W; ++k) static_cast<T*>(p.dweight)[d * W + k] = kc::from_f32<T>(part[k][0]);
    if (p.dbias) static_cast<T*>(p.dbias)[d] = kc::from_f32<T>(part[W][0]);
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) conv_update_kernel(const ConvUpdateParams p) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x;
  if (i >= p.batch * p.dim) return;
  const int64_t b = i / p.dim, d = i % p.dim, K = p.state_len, S = p.seqlen, W = p.width;
  T* state = static_cast<T*>(p.conv_state) + b * p.state_sb + d * p.state_sd;
  const T* x = static_cast<const T*>(p.x) + b * p.x_sb + d * p.x_sd;
  const T* wt = static_cast<const T*>(p.weight) + d * W;
  // s_j = state_j for j < K, x_{j-K} after.
  auto s = [&](int64_t j) { return kc::to_f32(j < K ? state[j] : x[(j - K) * p.x_sl]); };
  const float bias = p.bias ? kc::to_f32(static_cast<const T*>(p.bias)[d]) : 0.0f;
  T* out = static_cast<T*>(p.out) + b * p.out_sb + d * p.out_sd;
  for (int64_t t = 0; t < S; ++t) {
    float acc = bias;
    for (int64_t k = 0; k < W; ++k) acc += kc::to_f32(wt[k]) * s(K + t - (W - 1) + k);
    out[t * p.out_sl] = kc::from_f32<T>(p.silu ? silu(acc) : acc);
  }
  // The new state: s_{S} .. s_{S+K-1}, copied as stored.
  for (int64_t k = 0; k < K; ++k) state[k] = S + k < K ? state[S + k] : x[(S + k - K) * p.x_sl];
}

// Calls f.template operator()<T, W>() for the params' dtype and width (1 to 4).
template <typename F>
const char* with_width(kernel::DType t, int64_t width, F&& f) {
  return kc::with_float_dtype(t, "causal_conv1d", [&]<typename T>(T*) -> const char* {
    switch (width) {
      case 1:
        return f.template operator()<T, 1>();
      case 2:
        return f.template operator()<T, 2>();
      case 3:
        return f.template operator()<T, 3>();
      case 4:
        return f.template operator()<T, 4>();
    }
    return kernel::errorf("causal_conv1d: the CUDA kernels take widths up to %lld, not %lld",
                          static_cast<long long>(kConvMaxWidthCuda), static_cast<long long>(width));
  });
}

unsigned blocks_for(int64_t n) { return static_cast<unsigned>((n + kThreads - 1) / kThreads); }

}  // namespace

const char* causal_conv1d_forward_cuda(const CausalConv1dParams& p, cudaStream_t stream) {
  if (const char* e = causal_conv1d_check(p, false)) return e;
  const int64_t n = p.batch * p.dim * p.seqlen;
  return with_width(p.dtype, p.width, [&]<typename T, int W>() -> const char* {
    if (n > 0) conv_forward_kernel<T, W><<<blocks_for(n), kThreads, 0, stream>>>(p);
    return kc::launch_error("causal_conv1d forward");
  });
}

const char* causal_conv1d_backward_cuda(const CausalConv1dParams& p, cudaStream_t stream) {
  if (const char* e = causal_conv1d_check(p, true)) return e;
  const int64_t n = p.batch * p.dim * p.seqlen;
  return with_width(p.dtype, p.width, [&]<typename T, int W>() -> const char* {
    if (n > 0) conv_dx_kernel<T, W><<<blocks_for(n), kThreads, 0, stream>>>(p);
    if (p.dim > 0) conv_dweight_kernel<T, W><<<static_cast<unsigned>(p.dim), kThreads, 0, stream>>>(p);
    return kc::launch_error("causal_conv1d backward");
  });
}

const char* causal_conv1d_update_cuda(const ConvUpdateParams& p, cudaStream_t stream) {
  if (const char* e = conv_update_check(p)) return e;
  if (p.width > kConvMaxWidthCuda)
    return kernel::errorf("causal_conv1d_update: the CUDA kernels take widths up to %lld, not %lld",
                          static_cast<long long>(kConvMaxWidthCuda), static_cast<long long>(p.width));
  const int64_t n = p.batch * p.dim;
  return kc::with_float_dtype(p.dtype, "causal_conv1d", [&]<typename T>(T*) -> const char* {
    if (n > 0) conv_update_kernel<T><<<blocks_for(n), kThreads, 0, stream>>>(p);
    return kc::launch_error("causal_conv1d_update");
  });
}

}  // namespace kcpp::mamba
