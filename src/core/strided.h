// Strided iteration shared by host loops and CUDA kernels.
//
// make_layout() merges adjacent dimensions that are contiguous for every operand, so a contiguous
// tensor of any rank iterates as one flat dimension, and describes the rest as plain arrays that a
// kernel can take by value.  Element i (row-major over the shape) of operand k sits at
// offsets(i)[k], counted in elements.
#pragma once

#include <array>
#include <cstdint>

#include "core/tensor.h"

#if defined(__CUDACC__)
#define KCPP_HD __host__ __device__ __forceinline__
#else
#define KCPP_HD inline
#endif

namespace kcpp {

inline constexpr int kMaxDims = 8;

template <int N> struct StridedLayout {
  int ndim = 0;
  int64_t sizes[kMaxDims] = {};
  int64_t strides[N][kMaxDims] = {};

  // Offsets of element `i` for each operand.
  KCPP_HD void offsets(int64_t i, int64_t (&off)[N]) const {
    for (int k = 0; k < N; ++k) off[k] = 0;
    for (int d = ndim - 1; d >= 0; --d) {
      const int64_t q = i / sizes[d], r = i - q * sizes[d];
      for (int k = 0; k < N; ++k) off[k] += r * strides[k][d];
      i = q;
    }
  }
};

// Layout for operands of one shape (each operand's strides given; broadcast operands use stride 0).
template <int N> StridedLayout<N> make_layout(const Shape& shape, const std::array<const Shape*, N>& strides) {
  StridedLayout<N> L;
  // Walk from the innermost dim outwards, merging dim d into the current one when every operand
  // steps through d exactly as if the two were one dimension.
  for (int d = static_cast<int>(shape.size()) - 1; d >= 0; --d) {
    if (shape[d] == 1) continue;  // size-1 dims contribute nothing
    if (L.ndim > 0) {
      bool merge = true;
      const int cur = L.ndim - 1;
      for (int k = 0; k < N; ++k)
        merge = merge && (*strides[k])[d] == L.strides[k][cur] * L.sizes[cur];
      if (merge) {
        L.sizes[cur] *= shape[d];
        continue;
      }
    }
    KCPP_CHECK(L.ndim < kMaxDims, "strided iteration: more than {} dimensions that cannot be merged in shape {}",
               kMaxDims, shape_str(shape));
    L.sizes[L.ndim] = shape[d];
    for (int k = 0; k < N; ++k) L.strides[k][L.ndim] = (*strides[k])[d];
    ++L.ndim;
  }
  // Built innermost-first; flip to row-major order.
  for (int a = 0, b = L.ndim - 1; a < b; ++a, --b) {
    std::swap(L.sizes[a], L.sizes[b]);
    for (int k = 0; k < N; ++k) std::swap(L.strides[k][a], L.strides[k][b]);
  }
  return L;
}

// Host loop: calls f(off) for every element, off[k] the offset in operand k; chunks run in
// parallel under OpenMP when there are many elements.  Within a chunk the innermost dimension is
// walked incrementally (no division per element).
template <int N, typename F> void host_for_each(const StridedLayout<N>& L, int64_t numel, F&& f) {
  if (numel <= 0) return;
  constexpr int64_t kGrain = 1 << 15;
  const int64_t chunks = (numel + kGrain - 1) / kGrain;
#pragma omp parallel for schedule(static) if (chunks > 1)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t begin = c * kGrain, end = std::min(numel, begin + kGrain);
    int64_t off[N];
    L.offsets(begin, off);
    if (L.ndim == 0) {  // a single element
      f(off);
      continue;
    }
    const int last = L.ndim - 1;
    int64_t idx[kMaxDims];
    {
      int64_t i = begin;
      for (int d = last; d >= 0; --d) {
        idx[d] = i % L.sizes[d];
        i /= L.sizes[d];
      }
    }
    for (int64_t i = begin; i < end; ++i) {
      f(off);
      // advance the multi-index by one, carrying outwards
      for (int d = last; d >= 0; --d) {
        for (int k = 0; k < N; ++k) off[k] += L.strides[k][d];
        if (++idx[d] < L.sizes[d]) break;
        for (int k = 0; k < N; ++k) off[k] -= L.strides[k][d] * L.sizes[d];
        idx[d] = 0;
      }
    }
  }
}

}  // namespace kcpp
