// GLU on CUDA (maths in glu.h): a grid-stride loop over 16-byte vectors when every pointer is
// aligned (scalar otherwise); each thread reads its gate, up (and dout) before writing, so the
// in-place forms are safe.  The activation is a template parameter.
#include "glu.h"
#include "glu_math.h"
#include "kcpp/kernel/cuda.cuh"

namespace kcpp::liger {
namespace {

using namespace kcpp::kernel::cuda;

template <typename T, int VEC, GluActivation A>
__global__ void __launch_bounds__(256) forward_kernel(const __grid_constant__ GluParams p) {
  const int64_t nvec = p.n / VEC, stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t v = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; v < nvec; v += stride) {
    float g[VEC], u[VEC], o[VEC];
    load_f32(static_cast<const T*>(p.gate) + v * VEC, g);
    load_f32(static_cast<const T*>(p.up) + v * VEC, u);
#pragma unroll
    for (int k = 0; k < VEC; ++k) o[k] = glu_math::act<A>(g[k], nullptr) * u[k];
    store_f32(static_cast<T*>(p.out) + v * VEC, o);
  }
}

template <typename T, int VEC, GluActivation A>
__global__ void __launch_bounds__(256) backward_kernel(const __grid_constant__ GluParams p) {
  const int64_t nvec = p.n / VEC, stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t v = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; v < nvec; v += stride) {
    float g[VEC], u[VEC], d[VEC], dg[VEC], du[VEC];
    load_f32(static_cast<const T*>(p.gate) + v * VEC, g);
    load_f32(static_cast<const T*>(p.up) + v * VEC, u);
    load_f32(static_cast<const T*>(p.dout) + v * VEC, d);
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      float da;
      const float a = glu_math::act<A>(g[k], &da);
      dg[k] = d[k] * u[k] * da;
      du[k] = d[k] * a;
    }
    store_f32(static_cast<T*>(p.dgate) + v * VEC, dg);
    store_f32(static_cast<T*>(p.dup) + v * VEC, du);
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
  const unsigned grid = static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>((nvec + 255) / 256, int64_t(sm_count(device)) * 16)));
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
