// GLU on CUDA (maths in glu.h): a grid-stride loop over 16-byte vectors when every pointer is
// aligned (scalar otherwise), UNROLL vectors a thread per iteration with all loads issued first;
// rows with strides of their own (a packed gate_up's halves) by glu_rows_kernel, a grid row a row.
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

// Rows of `cols` elements, each tensor's rows its own ld apart (glu.h): blockIdx.y walks the rows
// (gridDim.y at a time), blockIdx.x and the thread pick a VEC-element vector of the row.  Each
// thread reads its gate, up (and dout) before writing, as above.
template <typename T, int VEC, GluActivation A, bool FAST, bool BWD>
__global__ void __launch_bounds__(256) glu_rows_kernel(const __grid_constant__ GluParams p) {
  const int64_t rows = p.n / p.cols, v = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (v >= p.cols / VEC) return;
  constexpr auto kMode = FAST ? kernel::MathMode::Fast : kernel::MathMode::Accurate;
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    float g[VEC], u[VEC], d[BWD ? VEC : 1];
    load_f32(static_cast<const T*>(p.gate) + r * p.gate_ld + v * VEC, g);
    load_f32(static_cast<const T*>(p.up) + r * p.up_ld + v * VEC, u);
    if constexpr (BWD) {
      load_f32(static_cast<const T*>(p.dout) + r * p.dout_ld + v * VEC, d);
      float dg[VEC], du[VEC];
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        float da;
        const float a = kernel::activate<A, kMode>(g[k], &da);
        dg[k] = d[k] * u[k] * da;
        du[k] = d[k] * a;
      }
      store_f32(static_cast<T*>(p.dgate) + r * p.dgate_ld + v * VEC, dg);
      store_f32(static_cast<T*>(p.dup) + r * p.dup_ld + v * VEC, du);
    } else {
      float o[VEC];
#pragma unroll
      for (int k = 0; k < VEC; ++k) o[k] = kernel::activate<A, kMode>(g[k], nullptr) * u[k];
      store_f32(static_cast<T*>(p.out) + r * p.out_ld + v * VEC, o);
    }
  }
}

// True when the rows of `p` are not one contiguous run (a row stride other than cols somewhere).
bool strided(const GluParams& p, bool bwd) {
  if (p.cols <= 0 || p.n == p.cols) return false;
  const int64_t lds[] = {p.gate_ld, p.up_ld, bwd ? p.dout_ld : p.out_ld, bwd ? p.dgate_ld : p.cols, bwd ? p.dup_ld : p.cols};
  for (int64_t ld : lds)
    if (ld != p.cols) return true;
  return false;
}

template <bool BWD> const char* run_rows(const GluParams& p, cudaStream_t stream, bool fast_math) {
  const int bytes = kcpp::kernel::dtype_bytes(p.dtype), vec_full = 16 / bytes;
  // 16-byte vectors when every row of every tensor starts 16-byte aligned.
  auto ok = [&](const void* ptr, int64_t ld) { return aligned16(ptr) && (ld * bytes) % 16 == 0; };
  bool vec_ok = p.cols % vec_full == 0 && ok(p.gate, p.gate_ld) && ok(p.up, p.up_ld);
  vec_ok = vec_ok && (BWD ? ok(p.dout, p.dout_ld) && ok(p.dgate, p.dgate_ld) && ok(p.dup, p.dup_ld) : ok(p.out, p.out_ld));
  const int vec = vec_ok ? vec_full : 1;
  const int64_t nvec = p.cols / vec, rows = p.n / p.cols;
  const int threads = static_cast<int>(std::min<int64_t>(256, (nvec + 31) / 32 * 32));
  const dim3 grid(static_cast<unsigned>((nvec + threads - 1) / threads), static_cast<unsigned>(std::min<int64_t>(rows, 65535)));
  KCPP_KERNEL_REQUIRE(grid.x < (1u << 31), "glu: rows of %lld elements are too wide", (long long)p.cols);
  auto launch = [&]<typename T, int V, GluActivation A>() {
    constexpr bool kCanFast = sizeof(T) == 2;
    if (kCanFast && fast_math) glu_rows_kernel<T, V, A, kCanFast, BWD><<<grid, threads, 0, stream>>>(p);
    else glu_rows_kernel<T, V, A, false, BWD><<<grid, threads, 0, stream>>>(p);
  };
  auto by_act = [&]<typename T, int V>() {
    switch (p.act) {
      case GluActivation::Silu: launch.template operator()<T, V, GluActivation::Silu>(); break;
      case GluActivation::Gelu: launch.template operator()<T, V, GluActivation::Gelu>(); break;
      case GluActivation::GeluTanh: launch.template operator()<T, V, GluActivation::GeluTanh>(); break;
      case GluActivation::QuickGelu: launch.template operator()<T, V, GluActivation::QuickGelu>(); break;
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
  return launch_error(BWD ? "glu backward" : "glu forward");
}

template <bool BWD> const char* run(const GluParams& p, cudaStream_t stream, const GluConfig& c) {
  if (const char* e = glu_check(p, BWD)) return e;
  KCPP_KERNEL_REQUIRE(c.unroll == 1 || c.unroll == 2 || c.unroll == 4, "glu: unroll %d not in {1, 2, 4}", c.unroll);
  KCPP_KERNEL_REQUIRE(c.blocks_per_sm >= 0, "glu: blocks_per_sm %d < 0", c.blocks_per_sm);
  if (p.n == 0) return nullptr;
  if (strided(p, BWD)) return run_rows<BWD>(p, stream, c.fast_math);
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
