// Activations on CUDA (maths in activation_kernels.h).  A grid-stride loop over (row, vector) pairs,
// 16-byte vectors when every row start is aligned (scalar otherwise), `unroll` vectors a thread per
// iteration with all their loads issued before any store (which also makes the in-place forms safe).
// The launch configuration (ActConfig) was chosen by the sweep of bench/bench_kernels.cpp.
// 16-bit dtypes use the hardware exp and division (MathMode::Fast); f32 the accurate functions.
#include <algorithm>

#include "activation_kernels.h"
#include "kcpp/kernel/cuda.cuh"

namespace kcpp::activation {
namespace {

namespace kk = kcpp::kernel;
using namespace kcpp::kernel::cuda;

constexpr int kThreads = 256;

// I: the type of the (row, vector) index, 32-bit when it fits (its division is several times cheaper).
template <typename T, int VEC, kk::Activation A, bool Gated, bool Bwd, typename I, int kUnroll>
__global__ void __launch_bounds__(kThreads) act_kernel(const __grid_constant__ ActParams p) {
  constexpr kk::MathMode M = sizeof(T) == 2 ? kk::MathMode::Fast : kk::MathMode::Accurate;
  const I per_row = static_cast<I>(p.d / VEC), total = static_cast<I>(p.rows) * per_row;
  const I stride = static_cast<I>(gridDim.x) * blockDim.x;
  for (I i0 = static_cast<I>(blockIdx.x) * blockDim.x + threadIdx.x; i0 < total; i0 += stride * kUnroll) {
    float a[kUnroll][VEC], b[Gated ? kUnroll : 1][VEC], g[Bwd ? kUnroll : 1][VEC];
    int64_t row[kUnroll], col[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const I i = i0 + u * stride, r = p.rows == 1 ? I(0) : i / per_row;  // one row: no division
      row[u] = r;
      col[u] = static_cast<int64_t>(i - r * per_row) * VEC;
      if (i >= total) continue;
      const T* x = static_cast<const T*>(p.x) + row[u] * p.x_stride + col[u];
      load_f32(x, a[u]);
      if constexpr (Gated) load_f32(x + p.d, b[u]);
      if constexpr (Bwd) load_f32(static_cast<const T*>(p.dy) + row[u] * p.dy_stride + col[u], g[u]);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (i0 + u * stride >= total) continue;
      if constexpr (!Bwd) {
        float y[VEC];
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
          const float f = kk::activate<A, M>(a[u][k], nullptr);
          if constexpr (Gated) y[k] = f * b[u][k];
          else y[k] = f;
        }
        store_f32(static_cast<T*>(p.y) + row[u] * p.y_stride + col[u], y);
      } else {
        float d0[VEC], d1[VEC];
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
          float da;
          const float f = kk::activate<A, M>(a[u][k], &da);
          if constexpr (Gated) {
            d0[k] = g[u][k] * b[u][k] * da;
            d1[k] = g[u][k] * f;
          } else {
            d0[k] = g[u][k] * da;
          }
        }
        T* dx = static_cast<T*>(p.dx) + row[u] * p.dx_stride + col[u];
        store_f32(dx, d0);
        if constexpr (Gated) store_f32(dx + p.d, d1);
      }
    }
  }
}

template <bool Bwd> const char* run(const ActParams& p, cudaStream_t stream, const ActConfig& c) {
  if (const char* e = act_check(p, Bwd)) return e;
  KCPP_KERNEL_REQUIRE(c.unroll == 1 || c.unroll == 2 || c.unroll == 4, "activation: unroll %d not in {1, 2, 4}", c.unroll);
  KCPP_KERNEL_REQUIRE(c.blocks_per_sm >= 0, "activation: blocks_per_sm %d < 0", c.blocks_per_sm);
  if (p.rows == 0 || p.d == 0) return nullptr;
  int device = 0;
  cudaGetDevice(&device);
  const int vec_full = 16 / kk::dtype_bytes(p.dtype);
  // A vector never straddles two rows and every row start is 16-byte aligned.
  auto fits = [&](const void* ptr, int64_t stride) { return aligned16(ptr) && (p.rows == 1 || stride % vec_full == 0); };
  bool vec_ok = p.d % vec_full == 0 && fits(p.x, p.x_stride);
  vec_ok = vec_ok && (Bwd ? fits(p.dy, p.dy_stride) && fits(p.dx, p.dx_stride) : fits(p.y, p.y_stride));
  const int vec = vec_ok ? vec_full : 1;
  const int64_t total = p.rows * (p.d / vec), per_block = int64_t(kThreads) * c.unroll;
  const int64_t cap = c.blocks_per_sm > 0 ? int64_t(sm_count(device)) * c.blocks_per_sm : int64_t(1) << 31;
  const unsigned grid = static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>((total + per_block - 1) / per_block, cap)));
  // 32-bit indices when the last iteration's index (below total + grid * threads * unroll) fits.
  const bool small = total + int64_t(grid) * per_block < (int64_t(1) << 32);
  auto go_u = [&]<typename T, int V, bool G, kk::Activation A, int U>() {
    if (small) act_kernel<T, V, A, G, Bwd, uint32_t, U><<<grid, kThreads, 0, stream>>>(p);
    else act_kernel<T, V, A, G, Bwd, int64_t, U><<<grid, kThreads, 0, stream>>>(p);
  };
  auto go = [&]<typename T, int V, bool G, kk::Activation A>() {
    if (V == 1 || c.unroll == 1) go_u.template operator()<T, V, G, A, 1>();  // unaligned: the simple loop only
    else if (c.unroll == 2) go_u.template operator()<T, V, G, A, 2>();
    else go_u.template operator()<T, V, G, A, 4>();
  };
  auto launch = [&]<typename T, int V, bool G>() {
    switch (p.act) {
      case kk::Activation::Silu: go.template operator()<T, V, G, kk::Activation::Silu>(); break;
      case kk::Activation::Gelu: go.template operator()<T, V, G, kk::Activation::Gelu>(); break;
      case kk::Activation::GeluTanh: go.template operator()<T, V, G, kk::Activation::GeluTanh>(); break;
      case kk::Activation::QuickGelu: go.template operator()<T, V, G, kk::Activation::QuickGelu>(); break;
    }
  };
  auto by_gated = [&]<typename T, int V>() {
    if (p.gated) launch.template operator()<T, V, true>();
    else launch.template operator()<T, V, false>();
  };
  auto by_vec = [&]<typename T>() {
    if (vec == 1) by_gated.template operator()<T, 1>();
    else by_gated.template operator()<T, 16 / sizeof(T)>();
  };
  switch (p.dtype) {
    case kk::DType::f32: by_vec.template operator()<float>(); break;
    case kk::DType::bf16: by_vec.template operator()<__nv_bfloat16>(); break;
    case kk::DType::f16: by_vec.template operator()<__half>(); break;
  }
  return launch_error(Bwd ? "activation backward" : "activation forward");
}

}  // namespace

const char* act_forward_cuda(const ActParams& p, cudaStream_t stream) { return run<false>(p, stream, ActConfig{}); }
const char* act_backward_cuda(const ActParams& p, cudaStream_t stream) { return run<true>(p, stream, ActConfig{}); }
const char* act_forward_cuda_with(const ActParams& p, cudaStream_t stream, const ActConfig& c) {
  return run<false>(p, stream, c);
}
const char* act_backward_cuda_with(const ActParams& p, cudaStream_t stream, const ActConfig& c) {
  return run<true>(p, stream, c);
}

}  // namespace kcpp::activation
