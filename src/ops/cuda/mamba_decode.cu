// mamba_ssm_step (ops/nn/mamba_decode.h): dt_proj, the state update and the gate of a Mamba mixer's
// decoding step, in one kernel.
//
// A group of 16 lanes takes a channel c: the lanes split dt_proj's row c (R weights) for the
// product, then the N states of the channel (state n on lane n % 16), and lane 0 writes y.  Each
// block first stages in shared memory what all its channels read: dt_low (normalised for
// Falcon-Mamba) and B, C (normalised for Falcon-Mamba), f32, [M][R + 2N].  The grid is one group a
// channel up to one wave of blocks; a group walks its channels c, c + groups, ...  Programmatic
// dependent launch: the first channel's weights (dt_proj's row, A, D, dt_bias: nothing in the step
// writes them) are loaded before pdl_wait(), everything else after.
#include <cuda_runtime.h>

#include <algorithm>
#include <type_traits>

#include "ops/cuda/common.cuh"
#include "ops/cuda/launch.h"
#include "ops/cuda/pdl.cuh"
#include "ops/math.h"

namespace kcpp::ops::cuda {
namespace {

using kcpp::kernel::cuda::from_f32;
using kcpp::kernel::cuda::round_to;
using kcpp::kernel::cuda::to_f32;

constexpr int kThreads = 256;
constexpr int kLanes = 16;  // a channel's group
constexpr int kGroups = kThreads / kLanes;
constexpr int kHeld = 16;  // dt_proj weights a lane keeps in registers (R <= 256); the rest read as needed

template <typename T> struct SsmStepParams {
  T* y;                  // [M, D]
  float* state;          // [M, D, N]
  const T* xdbl;         // [M, R + 2N]: dt_low, B, C
  const T* w_dt;         // [D, R]
  const float* dt_bias;  // [D] or null
  const float* A;        // [D, N]
  const float* skip;     // D [D] or null
  const T* xc;           // [M, D]
  const T* xz;           // [M, 2D]: the convolution's new inputs x, then the gate z
  int m, d, r, n;
  float dt_eps, bc_eps;
  bool dt_norm, bc_norm, softplus;
};

__device__ __forceinline__ float group_sum(float v) {
#pragma unroll
  for (int o = kLanes / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// The sum of v over the block's threads, to every thread (`red` holds a float a warp).
__device__ __forceinline__ float block_sum(float v, float* red) {
  v = kcpp::kernel::cuda::warp_sum(v);
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = v;
  __syncthreads();
  float t = 0.f;
#pragma unroll
  for (int w = 0; w < kThreads / 32; ++w) t += red[w];
  __syncthreads();
  return t;
}

// A channel's weights, as a lane uses them: dt_proj's row (its elements lane, lane + 16, ...; the first
// kHeld in registers), A's elements lane, lane + 16, ... (the first one), D and the bias.
struct ChannelWeights {
  float w[kHeld];
  float a, skip, bias;
};

template <typename T>
__device__ __forceinline__ void load_channel(const SsmStepParams<T>& p, int c, int lane, ChannelWeights& cw) {
  const T* wr = p.w_dt + static_cast<int64_t>(c) * p.r;
#pragma unroll
  for (int j = 0; j < kHeld; ++j) {
    const int i = lane + j * kLanes;
    cw.w[j] = i < p.r ? to_f32(wr[i]) : 0.f;
  }
  cw.a = lane < p.n ? p.A[static_cast<int64_t>(c) * p.n + lane] : 0.f;
  cw.skip = p.skip != nullptr ? p.skip[c] : 0.f;
  cw.bias = p.dt_bias != nullptr ? p.dt_bias[c] : 0.f;
}

template <typename T> __global__ void __launch_bounds__(kThreads) ssm_step_kernel(const __grid_constant__ SsmStepParams<T> p) {
  extern __shared__ float stage[];  // [M][R + 2N]
  __shared__ float red[kThreads / 32];
  const int R = p.r, N = p.n, W = R + 2 * N;
  // A warp's two groups walk their channels together (the sums shuffle over the whole warp): a group
  // past the last channel computes nothing and stores nothing.
  const int lane = threadIdx.x % kLanes, groups = gridDim.x * kGroups;
  const int first = blockIdx.x * kGroups + (threadIdx.x / 32) * 2;
  ChannelWeights cw;
  load_channel(p, min(first + (threadIdx.x % 32) / kLanes, p.d - 1), lane, cw);
  pdl_wait();
  pdl_trigger();
  for (int m = 0; m < p.m; ++m) {
    float* row = stage + m * W;
    const T* src = p.xdbl + static_cast<int64_t>(m) * W;
    for (int i = threadIdx.x; i < W; i += kThreads) row[i] = to_f32(src[i]);
    __syncthreads();
    // Falcon-Mamba: dt_low through its weightless RMSNorm (rounded to T as that layer stores it);
    // B and C scaled by their rstd in f32 (SelectiveScan/1's bc_rms_eps).
    if (p.dt_norm) {
      float ss = 0.f;
      for (int i = threadIdx.x; i < R; i += kThreads) ss += row[i] * row[i];
      const float rstd = 1.f / sqrtf(block_sum(ss, red) / static_cast<float>(R) + p.dt_eps);
      for (int i = threadIdx.x; i < R; i += kThreads) row[i] = round_to<T>(1.f * round_to<T>(row[i] * rstd));
    }
    if (p.bc_norm) {
      float sb = 0.f, sc = 0.f;
      for (int i = threadIdx.x; i < N; i += kThreads) sb += row[R + i] * row[R + i], sc += row[R + N + i] * row[R + N + i];
      const float rb = 1.f / sqrtf(block_sum(sb, red) / static_cast<float>(N) + p.bc_eps);
      const float rc = 1.f / sqrtf(block_sum(sc, red) / static_cast<float>(N) + p.bc_eps);
      for (int i = threadIdx.x; i < N; i += kThreads) row[R + i] *= rb, row[R + N + i] *= rc;
    }
  }
  __syncthreads();
  for (int c0 = first; c0 < p.d; c0 += groups) {
    const int c = c0 + (threadIdx.x % 32) / kLanes;
    const bool active = c < p.d;
    if (c0 != first) load_channel(p, active ? c : 0, lane, cw);
    const T* wr = p.w_dt + static_cast<int64_t>(active ? c : 0) * R;
    const float* a = p.A + static_cast<int64_t>(active ? c : 0) * N;
    for (int m = 0; m < p.m; ++m) {
      const float* row = stage + m * W;
      float acc = 0.f;
#pragma unroll
      for (int j = 0; j < kHeld; ++j)
        if (lane + j * kLanes < R) acc = fmaf(row[lane + j * kLanes], cw.w[j], acc);
      for (int i = lane + kHeld * kLanes; i < R; i += kLanes) acc = fmaf(row[i], to_f32(wr[i]), acc);
      // dt as dt_proj's output stores it, then the bias and softplus in f32.
      const float raw = round_to<T>(group_sum(acc)) + cw.bias;
      const float dt = p.softplus ? (raw > 20.f ? raw : log1pf(expf(raw))) : raw;
      const int64_t mc = static_cast<int64_t>(m) * p.d + (active ? c : 0);
      const float x = to_f32(p.xc[mc]), dtx = dt * x;
      float* h = p.state + mc * N;
      float part = 0.f;
      if (active)
        for (int i = lane; i < N; i += kLanes) {
          const float hn = expf(dt * (i == lane ? cw.a : a[i])) * h[i] + dtx * row[R + i];
          h[i] = hn;
          part += row[R + N + i] * hn;
        }
      const float sum = group_sum(part);
      if (active && lane == 0) {
        float y = sum + cw.skip * x;
        y *= math::unary<float>(Unary::Silu, to_f32(p.xz[static_cast<int64_t>(m) * 2 * p.d + p.d + c]), 0.f);
        p.y[mc] = from_f32<T>(y);
      }
    }
  }
}

}  // namespace

void mamba_ssm_step(const Tensor& y, const MambaSsmStep& s) {
  constexpr const char* op = "mamba_ssm_step";
  kcpp::cuda::DeviceGuard guard(y.device().index);
  visit_cuda_float(y.dtype(), op, [&]<typename T>(std::type_identity<T>) {
    if constexpr (std::is_same_v<T, float>) {
      KCPP_FAIL("op {}: f32 has no fused CUDA kernel", op);
    } else {
      SsmStepParams<T> p{};
      p.y = static_cast<T*>(y.data());
      p.state = static_cast<float*>(s.ssm_state.data());
      p.xdbl = static_cast<const T*>(s.xdbl.data());
      p.w_dt = static_cast<const T*>(s.w_dt.data());
      p.dt_bias = s.dt_bias.defined() ? static_cast<const float*>(s.dt_bias.data()) : nullptr;
      p.A = static_cast<const float*>(s.A.data());
      p.skip = s.D.defined() ? static_cast<const float*>(s.D.data()) : nullptr;
      p.xc = static_cast<const T*>(s.xc.data());
      p.xz = static_cast<const T*>(s.xz.data());
      p.m = static_cast<int>(s.xz.size(0)), p.d = static_cast<int>(s.xc.size(1)), p.r = static_cast<int>(s.w_dt.size(1));
      p.n = static_cast<int>(s.A.size(1));
      p.dt_norm = s.dt_rms_eps.has_value(), p.bc_norm = s.bc_rms_eps.has_value(), p.softplus = s.dt_softplus;
      p.dt_eps = static_cast<float>(s.dt_rms_eps.value_or(0.0)), p.bc_eps = static_cast<float>(s.bc_rms_eps.value_or(0.0));
      const size_t smem = sizeof(float) * static_cast<size_t>(p.m) * (p.r + 2 * p.n);
      auto kernel = ssm_step_kernel<T>;
      const int want = (p.d + kGroups - 1) / kGroups;
      const int fit = std::max(1, resident_blocks(reinterpret_cast<const void*>(kernel), kThreads, smem));  // smem is checked
      launch_pdl(op, kernel, dim3(std::min(want, fit)), dim3(kThreads), smem, p);
    }
  });
}

}  // namespace kcpp::ops::cuda
