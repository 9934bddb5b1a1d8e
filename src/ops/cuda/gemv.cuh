// The pieces of the few-row matrix product y [M, N] = a [M, K] w [N, K]^T that the plain gemv
// (ops/cuda/gemv.cu) and the fused decode projections (ops/cuda/decode_gemv.cu) share: one warp, or
// KS warps over slices of K, a weight row; each lane reads 8 consecutive elements of the row (one
// 16-byte load) kUnroll times before the first product, keeps them as loaded until their products,
// and keeps M f32 sums.
#pragma once

#include <cstdint>

#include "ops/cuda/common.cuh"

namespace kcpp::ops::cuda::gemv {

using kcpp::kernel::cuda::load_f32;

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kUnroll = 4;
constexpr int kStep = 32 * 8;  // elements a warp covers with one 16-byte load a lane

// Warps a column: enough warps in all (about 32 an SM of an H100's 132) while each keeps at least
// one full step of K.
inline int slices_for(int64_t n, int64_t k) {
  const int64_t want = 132 * 32;
  int ks = 1;
  while (ks < kWarps && n * ks < want && k / (kStep * ks * 2) >= 1) ks *= 2;
  return ks;
}

// A lane's weights stay as loaded until their products, 16 bytes (8 elements of the 16-bit T) in
// four registers: half of what they take widened to f32, so twice the loads fit in flight.
template <typename T> __device__ __forceinline__ void widen8(const uint4& raw, float (&out)[8]) {
  kcpp::kernel::cuda::Vec<T, 8> v;
  memcpy(&v, &raw, sizeof(v));
  kcpp::kernel::cuda::widen(v, out);
}

// The fewest slices a column (a power of two up to kWarps) whose warps each cover their slice of K
// with one pass of kUnroll loads, while the n * slices warps stay within warps_an_sm a multiprocessor
// of the current device; 0 where no such launch exists.
inline int one_pass_slices(int64_t n, int64_t k, int warps_an_sm) {
  int device = 0;
  KCPP_CUDA_CHECK(cudaGetDevice(&device));
  const int64_t most_warps = int64_t{warps_an_sm} * kcpp::kernel::cuda::sm_count(device);
  for (int ks = 1; ks <= kWarps; ks *= 2)
    if (k <= int64_t{ks} * kStep * kUnroll) return n * ks <= most_warps ? ks : 0;
  return 0;
}

// The U weight loads of one pass: slice `slice` of KS takes the warp steps slice, slice + KS, ...
// (each kStep elements); the pass starting at `base` reads base + u * kStep * KS.  Zeros past k.
template <typename T, int KS, int U>
__device__ __forceinline__ void load_pass(const T* row, int base, int k, int lane, uint4 (&wv)[U]) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int e = base + u * kStep * KS + lane * 8;
    wv[u] = e < k ? *reinterpret_cast<const uint4*>(row + e) : make_uint4(0, 0, 0, 0);
  }
}

// acc[m] += a[m, e..e+8) . wv for the pass at `base`; a's rows are `lda` apart (global or shared).
template <typename T, int M, int KS, int U>
__device__ __forceinline__ void dot_pass(const T* a, int64_t lda, int base, int k, int lane, const uint4 (&wv)[U],
                                         float (&acc)[M]) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int e = base + u * kStep * KS + lane * 8;
    if (e >= k) break;
    float w[8];
    widen8<T>(wv[u], w);
#pragma unroll
    for (int m = 0; m < M; ++m) {
      float av[8];
      load_f32<T, 8>(a + m * lda + e, av);
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[m] = fmaf(av[i], w[i], acc[m]);
    }
  }
}

// Adds each warp's sums over its lanes and over the KS slices of its column (through `part`): every
// lane of the column's first warp (warp % KS == 0) then holds the column's M sums.  Every thread of
// the block calls it (it synchronizes the block when KS > 1).
template <int M, int KS>
__device__ __forceinline__ void sum_column(int warp, int lane, float (&acc)[M], float (&part)[kWarps][M]) {
#pragma unroll
  for (int m = 0; m < M; ++m)
    for (int o = 16; o > 0; o >>= 1) acc[m] += __shfl_xor_sync(0xffffffffu, acc[m], o);
  if constexpr (KS > 1) {
    if (lane == 0)
#pragma unroll
      for (int m = 0; m < M; ++m) part[warp][m] = acc[m];
    __syncthreads();
    if (warp % KS == 0)
#pragma unroll
      for (int m = 0; m < M; ++m) {
        float s = 0.f;
#pragma unroll
        for (int j = 0; j < KS; ++j) s += part[warp + j][m];
        acc[m] = s;
      }
  }
}

// acc[lane] for lane < M (a register array indexed without local memory).
template <int M> __device__ __forceinline__ float lane_sum(const float (&acc)[M], int lane) {
  float v = acc[0];
#pragma unroll
  for (int m = 1; m < M; ++m)
    if (lane == m) v = acc[m];
  return v;
}

// sum_column, then lane m < M of the column's first warp writes out[m, col] rounded to T.
template <typename T, int M, int KS>
__device__ __forceinline__ void finish_column(T* out, int n, int col, int warp, int lane, float (&acc)[M],
                                              float (&part)[kWarps][M]) {
  sum_column<M, KS>(warp, lane, acc, part);
  if (warp % KS != 0 || col >= n || lane >= M) return;
  out[static_cast<int64_t>(lane) * n + col] = kcpp::kernel::cuda::from_f32<T>(lane_sum<M>(acc, lane));
}

}  // namespace kcpp::ops::cuda::gemv
