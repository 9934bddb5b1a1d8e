// GLU on CUDA (maths in glu.h): a grid-stride loop over 16-byte vectors when every pointer is
// aligned (scalar otherwise), UNROLL vectors a thread per iteration with all loads issued first.
// Each thread reads its gate, up (and dout) before writing, so the in-place forms are safe.  The
// activation, the unroll and FAST (hardware exp / division, 16-bit dtypes only) are template
// parameters; the grid size is a run-time choice (glu_tuning.h, measured in bench/RESULTS.md).
#include "glu.h"
#include "kcpp/kernel/activation.h"
#include "glu_tuning.h"
#include "kcpp/kernel/cuda.cuh"

namespace kcpp::liger {
namespace {

using namespace kcpp::kernel::cuda;

// CHUNK: no loop; block b takes the UNROLL x blockDim.x vectors from b x blockDim.x x UNROLL on, one
// contiguous piece of each tensor (as a Triton program a row does).  Else a grid-stride loop.
template <typename T, int VEC, int UNROLL, GluActivation A, bool FAST, bool BWD, bool CHUNK>
__global__ void __launch_bounds__(256) glu_kernel(const __grid_constant__ GluParams p) {
  const int64_t nvec = p.n / VEC;
  const int64_t stride = CHUNK ? int64_t(blockDim.x) : int64_t(gridDim.x) * blockDim.x;
  const int64_t first = int64_t(CHUNK ? UNROLL : 1) * blockIdx.x * blockDim.x + threadIdx.x;
  const T* gp = static_cast<const T*>(p.gate);
  const T* up = static_cast<const T*>(p.up);
  const T* dp = static_cast<const T*>(p.dout);
  for (int64_t v0 = first; v0 < nvec; v0 += CHUNK ? nvec : stride * UNROLL) {
    float g[UNROLL][VEC], u[UNROLL][VEC], d[BWD ? UNROLL : 1][VEC];
#pragma unroll
    for (int r = 0; r < UNROLL; ++r) {
      const int64_t v = v0 + r * stride;
      if (v >= nvec) continue;
      load_f32(gp + v * VEC, g[r]);
      load_f32(up + v * VEC, u[r]);
      if constexpr (BWD) load_f32(dp + v * VEC, d[r]);
    }
#pragma unroll
    for (int r = 0; r < UNROLL; ++r) {
      const int64_t v = v0 + r * stride;
      if (v >= nvec) continue;
      if constexpr (BWD) {
        float dg[VEC], du[VEC];
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
          float da;
          const float a = kernel::activate<A, FAST ? kernel::MathMode::Fast : kernel::MathMode::Accurate>(g[r][k], &da);
          dg[k] = d[r][k] * u[r][k] * da;
          du[k] = d[r][k] * a;
        }
        store_f32(static_cast<T*>(p.dgate) + v * VEC, dg);
        store_f32(static_cast<T*>(p.dup) + v * VEC, du);
      } else {
        float o[VEC];
#pragma unroll
        for (int k = 0; k < VEC; ++k) o[k] = kernel::activate<A, FAST ? kernel::MathMode::Fast : kernel::MathMode::Accurate>(g[r][k], nullptr) * u[r][k];
        store_f32(static_cast<T*>(p.out) + v * VEC, o);
      }
    }
  }
}

template <bool BWD> const char* run(const GluParams& p, cudaStream_t stream, const GluConfig& c) {
  if (const char* e = glu_check(p, BWD)) return e;
  KCPP_KERNEL_REQUIRE(c.unroll == 1 || c.unroll == 2 || c.unroll == 4, "glu: unroll %d not in {1, 2, 4}", c.unroll);
  KCPP_KERNEL_REQUIRE(c.blocks_per_sm >= 0, "glu: blocks_per_sm %d < 0", c.blocks_per_sm);
  if (p.n == 0) return nullptr;
  int device = 0;
  cudaGetDevice(&device);
  const int vec_full = 16 / kcpp::kernel::dtype_bytes(p.dtype);
  bool vec_ok = p.n % vec_full == 0 && aligned16(p.gate) && aligned16(p.up);
  vec_ok = vec_ok && (BWD ? aligned16(p.dout) && aligned16(p.dgate) && aligned16(p.dup) : aligned16(p.out));
  const int vec = vec_ok ? vec_full : 1;
  const bool chunk = c.blocks_per_sm == 0 && vec != 1;
  const int64_t nvec = p.n / vec, per_block = int64_t(256) * (vec == 1 ? 1 : c.unroll);
  const int64_t blocks = (nvec + per_block - 1) / per_block;
  KCPP_KERNEL_REQUIRE(!chunk || blocks < (int64_t(1) << 31), "glu: %lld elements need too many blocks", (long long)p.n);
  const unsigned grid = static_cast<unsigned>(
      chunk ? blocks : std::max<int64_t>(1, std::min<int64_t>(blocks, int64_t(sm_count(device)) * std::max(c.blocks_per_sm, 1))));
  auto launch = [&]<typename T, int V, int U, GluActivation A>() {
    constexpr bool kCanFast = sizeof(T) == 2;
    auto go = [&]<bool CHUNK>() {
      if (kCanFast && c.fast_math) glu_kernel<T, V, U, A, kCanFast, BWD, CHUNK><<<grid, 256, 0, stream>>>(p);
      else glu_kernel<T, V, U, A, false, BWD, CHUNK><<<grid, 256, 0, stream>>>(p);
    };
    if (V > 1 && chunk) go.template operator()<true>();
    else go.template operator()<false>();
  };
  auto by_act = [&]<typename T, int V, int U>() {
    switch (p.act) {
      case GluActivation::Silu: launch.template operator()<T, V, U, GluActivation::Silu>(); break;
      case GluActivation::Gelu: launch.template operator()<T, V, U, GluActivation::Gelu>(); break;
      case GluActivation::GeluTanh: launch.template operator()<T, V, U, GluActivation::GeluTanh>(); break;
      case GluActivation::QuickGelu: launch.template operator()<T, V, U, GluActivation::QuickGelu>(); break;
    }
  };
  auto by_unroll = [&]<typename T, int V>() {
    if (c.unroll == 4) by_act.template operator()<T, V, 4>();
    else if (c.unroll == 2) by_act.template operator()<T, V, 2>();
    else by_act.template operator()<T, V, 1>();
  };
  auto by_vec = [&]<typename T>() {
    if (vec == 1) by_act.template operator()<T, 1, 1>();  // unaligned: the simple loop only
    else by_unroll.template operator()<T, 16 / sizeof(T)>();
  };
  switch (p.dtype) {
    case kernel::DType::f32: by_vec.template operator()<float>(); break;
    case kernel::DType::bf16: by_vec.template operator()<__nv_bfloat16>(); break;
    case kernel::DType::f16: by_vec.template operator()<__half>(); break;
  }
  return launch_error(BWD ? "glu backward" : "glu forward");
}

}  // namespace

const char* glu_forward_cuda(const GluParams& p, cudaStream_t stream) { return run<false>(p, stream, GluConfig{}); }
const char* glu_backward_cuda(const GluParams& p, cudaStream_t stream) { return run<true>(p, stream, GluConfig{}); }
const char* glu_forward_cuda_with(const GluParams& p, cudaStream_t stream, const GluConfig& c) {
  return run<false>(p, stream, c);
}
const char* glu_backward_cuda_with(const GluParams& p, cudaStream_t stream, const GluConfig& c) {
  return run<true>(p, stream, c);
}

}  // namespace kcpp::liger
