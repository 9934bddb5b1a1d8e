// The pieces of the few-row matrix product y [M, N] = a [M, K] w [N, K]^T that the plain gemv
// (ops/cuda/gemv.cu) and the fused decode projections (ops/cuda/decode_gemv.cu) share: one warp, or
// KS warps over slices of K, a weight row; each lane reads 8 consecutive elements of the row (one
// 16-byte load) up to U times a pass, and keeps M f32 sums.
//
// The weights are the only bytes that matter (a is a few K elements, read through L1 or shared
// memory), and a warp's loads are its only source of memory parallelism: a pass keeps its U loads as
// raw 16-byte vectors (4 registers each, widened at the product), and a warp with more work issues
// the next pass's loads (the column's next slice of K, or its next column) before this pass's
// products, so that a warp's row ends and its reduction overlap the next row's loads.  Each lane's
// sums run over its elements in increasing order whatever U and the lookahead: the results are the
// same bits.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "ops/cuda/common.cuh"

namespace kcpp::ops::cuda::gemv {

using kcpp::kernel::cuda::load_f32;
using kcpp::kernel::cuda::Vec;
using kcpp::kernel::cuda::widen;

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kStep = 32 * 8;  // elements a warp covers with one 16-byte load a lane

// Loads a lane keeps in flight a pass (U) and whether the next pass is loaded before this one's
// products (Ahead).  KCPP_GEMV_PIPE picks the scheme, for measurements side by side: 0 = 4 loads,
// no lookahead (the first gemv's); 1 = 8 with lookahead (the default); 2 = 4 with; 3 = 8 without.
inline int pipe_scheme() {
  static const int scheme = [] {
    const char* e = std::getenv("KCPP_GEMV_PIPE");
    const int v = e ? std::atoi(e) : 1;
    return v >= 0 && v <= 3 ? v : 1;
  }();
  return scheme;
}
// f.template operator()<U, Ahead>() for the scheme in use.
template <typename F> decltype(auto) with_scheme(F&& f) {
  switch (pipe_scheme()) {
    case 0: return f.template operator()<4, false>();
    case 2: return f.template operator()<4, true>();
    case 3: return f.template operator()<8, false>();
    default: return f.template operator()<8, true>();
  }
}

// Warps a column: enough warps in all (about 32 an SM of an H100's 132) while each keeps at least
// one full step of K.
inline int slices_for(int64_t n, int64_t k) {
  const int64_t want = 132 * 32;
  int ks = 1;
  while (ks < kWarps && n * ks < want && k / (kStep * ks * 2) >= 1) ks *= 2;
  return ks;
}

// One 16-byte load of weights: read once a step, so kept out of L1 (where the rows of a live).
__device__ __forceinline__ uint4 load_weights(const void* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}

// The U weight loads of one pass: slice `slice` of KS takes the warp steps slice, slice + KS, ...
// (each kStep elements); the pass starting at `base` reads base + u * kStep * KS.  Zeros past k.
template <typename T, int KS, int U>
__device__ __forceinline__ void load_pass(const T* row, int base, int k, int lane, uint4 (&wv)[U]) {
  static_assert(sizeof(T) == 2, "the gemv streams 16-bit weights, 8 a load");
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int e = base + u * kStep * KS + lane * 8;
    wv[u] = e < k ? load_weights(row + e) : make_uint4(0, 0, 0, 0);
  }
}

// acc[m] += a[m, e..e+8) . w for the pass at `base`; a's rows are `lda` apart (global or shared).
template <typename T, int M, int KS, int U>
__device__ __forceinline__ void dot_pass(const T* a, int64_t lda, int base, int k, int lane, const uint4 (&wv)[U],
                                         float (&acc)[M]) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int e = base + u * kStep * KS + lane * 8;
    if (e >= k) break;
    Vec<T, 8> raw;
    memcpy(&raw, &wv[u], sizeof(raw));
    float w[8];
    widen(raw, w);
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


// A warp's walk over its passes: the column groups g0, g0 + stride, ... below `groups`, each
// column's K in passes of kStep * KS * U from the slice's first step.  `cur` holds the first pass's
// loads on entry (issued by the caller, before its pdl_wait()); `row(g)` is the warp's weight row in
// group g, `start(g)` is called before a column's first products and `finish(g, acc)` after its
// last (once a group by every thread of the block, so that it may synchronize the block).  With
// Ahead the next pass is loaded before this pass's products; without, after its column's finish.
template <typename T, int M, int KS, int U, bool Ahead, typename Row, typename Start, typename Finish>
__device__ __forceinline__ void walk(const T* a, int64_t lda, int k, int lane, int slice, int g0, int stride, int groups,
                                     uint4 (&cur)[U], Row&& row, Start&& start, Finish&& finish) {
  const int first = slice * kStep;
  int g = g0, base = first;
  float acc[M] = {};
  while (g < groups) {
    int g2 = g, base2 = base + kStep * KS * U;
    if (base2 >= k) g2 += stride, base2 = first;
    if (base == first) start(g);
    if constexpr (Ahead) {
      uint4 next[U];
      if (g2 < groups) {
        load_pass<T, KS, U>(row(g2), base2, k, lane, next);
      } else {
#pragma unroll
        for (int u = 0; u < U; ++u) next[u] = make_uint4(0, 0, 0, 0);
      }
      dot_pass<T, M, KS, U>(a, lda, base, k, lane, cur, acc);
      if (g2 != g) {
        finish(g, acc);
#pragma unroll
        for (int m = 0; m < M; ++m) acc[m] = 0.f;
      }
#pragma unroll
      for (int u = 0; u < U; ++u) cur[u] = next[u];
    } else {
      dot_pass<T, M, KS, U>(a, lda, base, k, lane, cur, acc);
      if (g2 != g) {
        finish(g, acc);
#pragma unroll
        for (int m = 0; m < M; ++m) acc[m] = 0.f;
      }
      if (g2 < groups) load_pass<T, KS, U>(row(g2), base2, k, lane, cur);
    }
    g = g2, base = base2;
  }
}

}  // namespace kcpp::ops::cuda::gemv
