// The mean and variance of values spread over a CUDA block, in one reduction.
//
// Each thread summarises its n values as (n, mean, m2), m2 being the sum of squared deviations from
// its own mean (computed in two passes over its registers: no cancellation), and the summaries are
// merged pairwise with the update of Chan, Golub and LeVeque ("Updating formulae and a pairwise
// algorithm for computing sample variances", 1979), here for equal counts on both sides:
//   n = 2 na,  d = mean_b - mean_a,  mean = (mean_a + mean_b) / 2,  m2 = m2_a + m2_b + d^2 na / 2.
// Unlike sum(x^2) / n - mean^2, nothing cancels when the mean is large against the spread, and a
// block needs one reduction (one pair of barriers) where the two-pass form needs two.  The rounding
// of the partial means does reach m2 at first order through d, in the share of the variance that lies
// between threads (about 1 / n of it): give each thread at least 8 values.
// Each merge is symmetric in its operands, so both lanes of a butterfly step get the same bits, and
// every thread the same result, run after run.
#pragma once

#include <cuda_runtime.h>

namespace kcpp::kernel::cuda {

struct Moments {
  float n = 0.0f, mean = 0.0f, m2 = 0.0f;
};

__device__ __forceinline__ Moments merge_equal(const Moments& a, const Moments& b) {
  const float d = b.mean - a.mean;
  return {2.0f * a.n, 0.5f * (a.mean + b.mean), fmaf(d * d, 0.5f * a.n, a.m2 + b.m2)};
}

// Merges over lanes lane ^ 1, ^ 2, ... ^ (width / 2) (width a power of two up to 32).
__device__ __forceinline__ Moments butterfly(Moments m, int width) {
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    if (o >= width) break;
    Moments other;
    other.n = m.n;
    other.mean = __shfl_xor_sync(0xffffffffu, m.mean, o);
    other.m2 = __shfl_xor_sync(0xffffffffu, m.m2, o);
    m = merge_equal(m, other);
  }
  return m;
}

// The block's summary, returned to every thread.  Every thread summarises the same number of values
// and the block has a power-of-two number of warps.  `scratch`: 64 floats of shared memory, which the
// call leaves free for reuse.
__device__ __forceinline__ Moments block_moments(Moments m, float* scratch) {
  m = butterfly(m, 32);
  if (blockDim.x <= 32) return m;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = static_cast<int>(blockDim.x >> 5);
  if (lane == 0) scratch[warp] = m.mean, scratch[32 + warp] = m.m2;
  __syncthreads();
  // Each aligned group of `warps` lanes reads every warp's summary once and merges them the same way.
  const int k = lane & (warps - 1);
  Moments w{m.n, scratch[k], scratch[32 + k]};
  w = butterfly(w, warps);
  __syncthreads();
  return w;
}

}  // namespace kcpp::kernel::cuda
