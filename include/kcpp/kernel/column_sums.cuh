// Deterministic column sums of a [rows, h] f32 matrix (rows of stride `row_stride` floats): the
// second step of a weight gradient that persistent blocks first summed into one workspace row each
// (RMSNorm's and LayerNorm's dw, db).  Bitwise reproducible: every column is added in a fixed order
// that depends only on `rows`, never on scheduling, and no atomics.
//
//   out[c] = sum_{g = 0}^{G - 1} ( sum_{b = g, g + G, g + 2G, ... < rows} part[b, c] )   G = kColumnSumGroups
//
// in the accumulator type Acc (float, or double where the caller wants the order's rounding out of
// the result), rounded once to T.  A block is 32 columns x G row groups: each warp reads 128
// contiguous bytes a row, G warps walk the rows in parallel with several loads in flight each (the
// sum is bound by load latency, not bandwidth: a few MB), and the G partial sums meet in shared
// memory.  It replaced one thread a column over all rows (16 blocks at h = 4096), which took 16 us of
// RMSNorm's 80 us backward on an H200 (bench/RESULTS.md).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "kcpp/kernel/cuda.cuh"

namespace kcpp::kernel::cuda {

constexpr int kColumnSumGroups = 32;
constexpr int kColumnSumUnroll = 8;  // rows a thread has in flight at once

template <typename T, typename Acc>
__global__ void __launch_bounds__(32 * kColumnSumGroups) column_sums_kernel(const float* part, int rows, int64_t row_stride,
                                                                            int64_t h, T* out) {
  __shared__ Acc partial[kColumnSumGroups][33];
  const int64_t c = int64_t(blockIdx.x) * 32 + threadIdx.x;
  const int g = static_cast<int>(threadIdx.y);
  Acc s = 0;
  if (c < h) {
    // Rows g, g + G, ...: kColumnSumUnroll loads issued together, then added in row order (the
    // order is the same for every launch: it depends on rows only).
    constexpr int kStep = kColumnSumGroups * kColumnSumUnroll;
    int b = g;
    for (; b + (kColumnSumUnroll - 1) * kColumnSumGroups < rows; b += kStep) {
      float v[kColumnSumUnroll];
#pragma unroll
      for (int u = 0; u < kColumnSumUnroll; ++u) v[u] = part[int64_t(b + u * kColumnSumGroups) * row_stride + c];
#pragma unroll
      for (int u = 0; u < kColumnSumUnroll; ++u) s += v[u];
    }
    for (; b < rows; b += kColumnSumGroups) s += part[int64_t(b) * row_stride + c];
  }
  partial[g][threadIdx.x] = s;
  __syncthreads();
  if (g == 0 && c < h) {
    Acc t = partial[0][threadIdx.x];
#pragma unroll
    for (int k = 1; k < kColumnSumGroups; ++k) t += partial[k][threadIdx.x];
    out[c] = from_f32<T>(static_cast<float>(t));
  }
}

// Enqueues out[0, h) = column sums of part (see above); launch errors are left for the caller's check.
template <typename T, typename Acc = float>
void column_sums(const float* part, int rows, int64_t row_stride, int64_t h, T* out, cudaStream_t stream) {
  const int64_t blocks = (h + 31) / 32;
  column_sums_kernel<T, Acc><<<static_cast<unsigned>(std::max<int64_t>(1, blocks)), dim3(32, kColumnSumGroups), 0, stream>>>(
      part, rows, row_stride, h, out);
}

}  // namespace kcpp::kernel::cuda
