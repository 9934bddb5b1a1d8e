// A matrix product with few rows, y [M, N] = a [M, K] w[N, K]^T for M <= 8 (a decode step's
// projections): the weights are streamed once at the copy rate, where cuBLAS's GEMM tiles, sized for
// many rows, leave most of each tile empty.
//
// One warp per output column n: each lane reads 8 consecutive elements of w's row n (one 16-byte
// load) and the same 8 elements of every row of a (through L1: a is small and every warp reads it),
// kUnroll loads in flight before the first product, and keeps M f32 sums; the warp's sums are added
// by shuffles and rounded once to the dtype, as cuBLAS rounds its f32 accumulator.
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "ops/cuda/common.cuh"
#include "ops/cuda/launch.h"

namespace kcpp::ops::cuda {
namespace {

using kcpp::kernel::cuda::from_f32;
using kcpp::kernel::cuda::load_f32;

constexpr int kWarps = 8;
constexpr int kUnroll = 4;

template <typename T, int M>
__global__ void __launch_bounds__(kWarps * 32) gemv_kernel(T* __restrict__ out, const T* __restrict__ a,
                                                           const T* __restrict__ w, int n, int k) {
  const int lane = threadIdx.x % 32;
  const int col = blockIdx.x * kWarps + threadIdx.x / 32;
  if (col >= n) return;
  const T* row = w + static_cast<int64_t>(col) * k;
  float acc[M] = {};
  constexpr int kStep = 32 * 8;  // elements a warp covers with one load a lane
  for (int base = 0; base < k; base += kStep * kUnroll) {
    float wv[kUnroll][8];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int e = base + u * kStep + lane * 8;
      if (e < k) {
        load_f32<T, 8>(row + e, wv[u]);
      } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) wv[u][i] = 0.f;
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int e = base + u * kStep + lane * 8;
      if (e >= k) break;
#pragma unroll
      for (int m = 0; m < M; ++m) {
        float av[8];
        load_f32<T, 8>(a + static_cast<int64_t>(m) * k + e, av);
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[m] = fmaf(av[i], wv[u][i], acc[m]);
      }
    }
  }
#pragma unroll
  for (int m = 0; m < M; ++m)
    for (int o = 16; o > 0; o >>= 1) acc[m] += __shfl_xor_sync(0xffffffffu, acc[m], o);
  if (lane < M) {
    float v = acc[0];
#pragma unroll
    for (int m = 1; m < M; ++m)
      if (lane == m) v = acc[m];
    out[static_cast<int64_t>(lane) * n + col] = from_f32<T>(v);
  }
}

template <typename T, int M> void launch(const Tensor& out, const Tensor& a, const Tensor& w, int n, int k) {
  gemv_kernel<T, M><<<(n + kWarps - 1) / kWarps, kWarps * 32, 0, kcpp::cuda::current_stream()>>>(
      static_cast<T*>(out.data()), static_cast<const T*>(a.data()), static_cast<const T*>(w.data()), n, k);
}

template <typename T> void dispatch(int64_t m, const Tensor& out, const Tensor& a, const Tensor& w, int n, int k) {
  switch (m) {
    case 1: launch<T, 1>(out, a, w, n, k); break;
    case 2: launch<T, 2>(out, a, w, n, k); break;
    case 3: launch<T, 3>(out, a, w, n, k); break;
    case 4: launch<T, 4>(out, a, w, n, k); break;
    case 5: launch<T, 5>(out, a, w, n, k); break;
    case 6: launch<T, 6>(out, a, w, n, k); break;
    case 7: launch<T, 7>(out, a, w, n, k); break;
    default: launch<T, 8>(out, a, w, n, k); break;
  }
}

}  // namespace

bool gemv_small_m(const Tensor& out, const Tensor& a, const Tensor& w, int64_t m, int64_t n, int64_t k) {
  static const bool enabled = [] {
    const char* e = std::getenv("KCPP_GEMV");
    return !(e && std::strcmp(e, "0") == 0);
  }();
  const DType t = out.dtype();
  if (!enabled || m < 1 || m > kGemvMaxRows || k % 8 != 0 || n > (1 << 30) || k > (1 << 30) ||
      (t != DType::bf16 && t != DType::f16) || !kcpp::kernel::cuda::aligned16(a.data()) ||
      !kcpp::kernel::cuda::aligned16(w.data()))
    return false;
  if (t == DType::bf16) dispatch<__nv_bfloat16>(m, out, a, w, static_cast<int>(n), static_cast<int>(k));
  else dispatch<__half>(m, out, a, w, static_cast<int>(n), static_cast<int>(k));
  KCPP_CUDA_CHECK_LAUNCH("matmul (gemv)");
  return true;
}

}  // namespace kcpp::ops::cuda
