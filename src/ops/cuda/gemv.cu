// A matrix product with few rows, y [M, N] = a [M, K] w[N, K]^T for M <= 8 (a decode step's
// projections): the weights are streamed once at the copy rate, where cuBLAS's GEMM tiles, sized for
// many rows, leave most of each tile empty.
//
// One warp (or KS warps over slices of K, for narrow weights) per output column n: each lane reads 8
// consecutive elements of w's row n (one 16-byte load) and the same 8 elements of every row of a
// (through L1: a is small and every warp reads it), kUnroll loads in flight before the first
// product, and keeps M f32 sums; the sums are added by shuffles (and across the slices in shared
// memory) and rounded once to the dtype, as cuBLAS rounds its f32 accumulator.
#include <cuda_runtime.h>

#include <algorithm>
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
constexpr int kStep = 32 * 8;  // elements a warp covers with one 16-byte load a lane

// KS warps of a block share a column, each over its own K / KS slice (8 / KS columns a block), so
// that narrow weights still put enough loads in flight; their sums meet in shared memory.
template <typename T, int M, int KS>
__global__ void __launch_bounds__(kWarps * 32) gemv_kernel(T* __restrict__ out, const T* __restrict__ a,
                                                           const T* __restrict__ w, int n, int k) {
  __shared__ float part[kWarps][M];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, slice = warp % KS;
  const int col = blockIdx.x * (kWarps / KS) + warp / KS;
  const T* row = w + static_cast<int64_t>(min(col, n - 1)) * k;
  float acc[M] = {};
  // Slice `slice` takes the warp steps slice, slice + KS, ... (each 256 elements).
  for (int base = slice * kStep; base < k; base += kStep * KS * kUnroll) {
    float wv[kUnroll][8];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int e = base + u * kStep * KS + lane * 8;
      if (e < k) {
        load_f32<T, 8>(row + e, wv[u]);
      } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) wv[u][i] = 0.f;
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int e = base + u * kStep * KS + lane * 8;
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
  if constexpr (KS > 1) {
    if (lane == 0)
#pragma unroll
      for (int m = 0; m < M; ++m) part[warp][m] = acc[m];
    __syncthreads();
    if (slice != 0) return;
#pragma unroll
    for (int m = 0; m < M; ++m) {
      float s = 0.f;
#pragma unroll
      for (int j = 0; j < KS; ++j) s += part[warp + j][m];
      acc[m] = s;
    }
  }
  if (col >= n) return;
  if (lane < M) {
    float v = acc[0];
#pragma unroll
    for (int m = 1; m < M; ++m)
      if (lane == m) v = acc[m];
    out[static_cast<int64_t>(lane) * n + col] = from_f32<T>(v);
  }
}

template <typename T, int M, int KS> void launch(const Tensor& out, const Tensor& a, const Tensor& w, int n, int k) {
  constexpr int cols = kWarps / KS;
  gemv_kernel<T, M, KS><<<(n + cols - 1) / cols, kWarps * 32, 0, kcpp::cuda::current_stream()>>>(
      static_cast<T*>(out.data()), static_cast<const T*>(a.data()), static_cast<const T*>(w.data()), n, k);
}

// Warps a column: enough warps in all (about 32 an SM of an H100's 132) while each keeps at least
// one full step of K.
template <typename T, int M> void launch_split(const Tensor& out, const Tensor& a, const Tensor& w, int n, int k) {
  const int64_t want = 132 * 32;
  int ks = 1;
  while (ks < kWarps && static_cast<int64_t>(n) * ks < want && k / (kStep * ks * 2) >= 1) ks *= 2;
  switch (ks) {
    case 1: launch<T, M, 1>(out, a, w, n, k); break;
    case 2: launch<T, M, 2>(out, a, w, n, k); break;
    case 4: launch<T, M, 4>(out, a, w, n, k); break;
    default: launch<T, M, 8>(out, a, w, n, k); break;
  }
}

template <typename T> void dispatch(int64_t m, const Tensor& out, const Tensor& a, const Tensor& w, int n, int k) {
  switch (m) {
    case 1: launch_split<T, 1>(out, a, w, n, k); break;
    case 2: launch_split<T, 2>(out, a, w, n, k); break;
    case 3: launch_split<T, 3>(out, a, w, n, k); break;
    case 4: launch_split<T, 4>(out, a, w, n, k); break;
    case 5: launch_split<T, 5>(out, a, w, n, k); break;
    case 6: launch_split<T, 6>(out, a, w, n, k); break;
    case 7: launch_split<T, 7>(out, a, w, n, k); break;
    default: launch_split<T, 8>(out, a, w, n, k); break;
  }
}

}  // namespace

bool gemv_small_m(const Tensor& out, const Tensor& a, const Tensor& w, int64_t m, int64_t n, int64_t k) {
  // KCPP_GEMV: the most rows this path takes (0: none).  One by default: at eight rows it measured
  // slower than cuBLAS inside a decode step (bench/RESULTS.md, 2026-11-26).
  static const int64_t max_rows = [] {
    const char* e = std::getenv("KCPP_GEMV");
    if (!e || !*e) return int64_t{1};
    return std::clamp<int64_t>(std::atoll(e), 0, kGemvMaxRows);
  }();
  const DType t = out.dtype();
  if (m < 1 || m > max_rows || k % 8 != 0 || n > (1 << 30) || k > (1 << 30) ||
      (t != DType::bf16 && t != DType::f16) || !kcpp::kernel::cuda::aligned16(a.data()) ||
      !kcpp::kernel::cuda::aligned16(w.data()))
    return false;
  if (t == DType::bf16) dispatch<__nv_bfloat16>(m, out, a, w, static_cast<int>(n), static_cast<int>(k));
  else dispatch<__half>(m, out, a, w, static_cast<int>(n), static_cast<int>(k));
  KCPP_CUDA_CHECK_LAUNCH("matmul (gemv)");
  return true;
}

}  // namespace kcpp::ops::cuda
