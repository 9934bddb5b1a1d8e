// GLU on CUDA (maths in glu.h): a grid-stride loop over 16-byte vectors when every pointer is
// aligned (scalar otherwise), several vectors a thread per iteration with all loads issued first;
// each thread reads its gate, up (and dout) before writing, so the in-place forms are safe.  The
// activation is a template parameter; 16-bit dtypes use the hardware exp and division.
#include "glu.h"
#include "glu_math.h"
#include "kcpp/kernel/cuda.cuh"

namespace kcpp::liger {
namespace {

using namespace kcpp::kernel::cuda;

// UNROLL vectors a thread per iteration, all loads issued before any use (bytes in flight).
constexpr int kUnroll = 4;

template <typename T> constexpr bool kFast = sizeof(T) == 2;  // fast exp / division for 16-bit outputs

template <typename T, int VEC, GluActivation A>
__global__ void __launch_bounds__(256) forward_kernel(const __grid_constant__ GluParams p) {
  const int64_t nvec = p.n / VEC, stride = int64_t(gridDim.x) * blockDim.x;
  const T* gp = static_cast<const T*>(p.gate);
  const T* up = static_cast<const T*>(p.up);
  T* op = static_cast<T*>(p.out);
  for (int64_t v0 = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; v0 < nvec; v0 += stride * kUnroll) {
    float g[kUnroll][VEC], u[kUnroll][VEC];
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
      const int64_t v = v0 + j * stride;
      if (v < nvec) {
        load_f32(gp + v * VEC, g[j]);
        load_f32(up + v * VEC, u[j]);
      }
    }
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
      const int64_t v = v0 + j * stride;
      if (v >= nvec) break;
      float o[VEC];
#pragma unroll
      for (int k = 0; k < VEC; ++k) o[k] = glu_math::act<A, kFast<T>>(g[j][k], nullptr) * u[j][k];
      store_f32(op + v * VEC, o);
    }
  }
}

template <typename T, int VEC, GluActivation A>
__global__ void __launch_bounds__(256) backward_kernel(const __grid_constant__ GluParams p) {
  const int64_t nvec = p.n / VEC, stride = int64_t(gridDim.x) * blockDim.x;
  const T* gp = static_cast<const T*>(p.gate);
  const T* up = static_cast<const T*>(p.up);
  const T* dp = static_cast<const T*>(p.dout);
  for (int64_t v0 = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; v0 < nvec; v0 += stride * kUnroll) {
    float g[kUnroll][VEC], u[kUnroll][VEC], d[kUnroll][VEC];
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
      const int64_t v = v0 + j * stride;
      if (v < nvec) {
        load_f32(gp + v * VEC, g[j]);
        load_f32(up + v * VEC, u[j]);
        load_f32(dp + v * VEC, d[j]);
      }
    }
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
      const int64_t v = v0 + j * stride;
      if (v >= nvec) break;
      float dg[VEC], du[VEC];
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        float da;
        const float a = glu_math::act<A, kFast<T>>(g[j][k], &da);
        dg[k] = d[j][k] * u[j][k] * da;
        du[k] = d[j][k] * a;
      }
      store_f32(static_cast<T*>(p.dgate) + v * VEC, dg);
      store_f32(static_cast<T*>(p.dup) + v * VEC, du);
    }
  }
}

bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15u) == 0; }

template <bool Backward> const char* run(const GluParams& p, cudaStream_t stream) {
  if (const char* e = glu_check(p, Backward)) return e;
  if (p.n == 0) return nullptr;
  int device = 0;
  cudaGetDevice(&device);
  const int vec_full = 16 / kcpp::kernel::dtype_bytes(p.dtype);
  bool vec_ok = p.n % vec_full == 0 && aligned16(p.gate) && aligned16(p.up);
  vec_ok = vec_ok && (Backward ? aligned16(p.dout) && aligned16(p.dgate) && aligned16(p.dup) : aligned16(p.out));
  const int vec = vec_ok ? vec_full : 1;
  const int64_t nvec = p.n / vec;
  // Enough blocks to fill the machine several times over; the grid-stride loop does the rest.
  const unsigned grid = static_cast<unsigned>(
      std::max<int64_t>(1, std::min<int64_t>((nvec + 256 * kUnroll - 1) / (256 * kUnroll), int64_t(sm_count(device)) * 8)));
  auto launch = [&]<typename T, int V, GluActivation A>() {
    if constexpr (Backward) backward_kernel<T, V, A><<<grid, 256, 0, stream>>>(p);
    else forward_kernel<T, V, A><<<grid, 256, 0, stream>>>(p);
  };
  auto by_act = [&]<typename T, int V>() {
    switch (p.act) {
      case GluActivation::Silu: launch.template operator()<T, V, GluActivation::Silu>(); break;
      case GluActivation::Gelu: launch.template operator()<T, V, GluActivation::Gelu>(); break;
      case GluActivation::GeluTanh: launch.template operator()<T, V, GluActivation::GeluTanh>(); break;
    }
  };
  auto by_vec = [&]<typename T>() {
    if (vec == 1) by_act.template operator()<T, 1>();
    else by_act.template operator()<T, 16 / sizeof(T)>();
  };
  switch (p.dtype) {
    case kernel::DType::f32: by_vec.template operator()<float>(); break;
    case kernel::DType::bf16: by_vec.template operator()<__nv_bfloat16>(); break;
    case kernel::DType::f16: by_vec.template operator()<__half>(); break;
  }
  return launch_error(Backward ? "glu backward" : "glu forward");
}

}  // namespace

const char* glu_forward_cuda(const GluParams& p, cudaStream_t stream) { return run<false>(p, stream); }
const char* glu_backward_cuda(const GluParams& p, cudaStream_t stream) { return run<true>(p, stream); }

}  // namespace kcpp::liger
