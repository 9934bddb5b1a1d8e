// The mean and variance of values spread over a CUDA block, in one reduction.
//
// Each thread summarises its values as (n, mean, m2), m2 being the sum of squared deviations from
// its own mean (computed in two passes over its registers: no cancellation), and the summaries are
// merged pairwise with the update of Chan, Golub and LeVeque ("Updating formulae and a pairwise
// algorithm for computing sample variances", 1979):
//   n = na + nb,  d = mean_b - mean_a,  mean = (na mean_a + nb mean_b) / n,  m2 = m2_a + m2_b + d^2 na nb / n.
// Unlike sum(x^2) / n - mean^2, nothing cancels when the mean is large against the spread, and a
// block needs one reduction (one pair of barriers) where the two-pass form needs two.
// Each merge is written symmetric in its two operands (no fused multiply-add across them), so both
// lanes of a butterfly step get the same bits, and every thread the same result, run after run.
// Cost: a merge is ~15 instructions where a sum is 2; when every thread holds the same count (a row
// that fills the block) the counts need not travel and a merge halves exactly: ~7 (`Uniform`).
#pragma once

#include <cuda_runtime.h>

namespace kcpp::kernel::cuda {

struct Moments {
  float n = 0.0f, mean = 0.0f, m2 = 0.0f;
};

// Either operand may be empty (n = 0: threads past the end of a short row).
__device__ __forceinline__ Moments merge(const Moments& a, const Moments& b) {
  const float n = a.n + b.n, r = __frcp_rn(fmaxf(n, 1.0f)), d = b.mean - a.mean;
  // __fmul_rn: no contraction into an fma, which would not be symmetric.
  const float mean = (__fmul_rn(a.n, a.mean) + __fmul_rn(b.n, b.mean)) * r;
  return {n, mean, (a.m2 + b.m2) + (d * d) * ((a.n * b.n) * r)};
}

// Equal counts on both sides.
__device__ __forceinline__ Moments merge_equal(const Moments& a, const Moments& b) {
  const float d = b.mean - a.mean;
  return {2.0f * a.n, 0.5f * (a.mean + b.mean), fmaf(d * d, 0.5f * a.n, a.m2 + b.m2)};
}

// Merges over lanes lane ^ 1, ^ 2, ... ^ (width / 2) (width a power of two up to 32).
template <bool EQUAL> __device__ __forceinline__ Moments butterfly(Moments m, int width) {
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    if (o >= width) break;
    Moments other;
    if constexpr (!EQUAL) other.n = __shfl_xor_sync(0xffffffffu, m.n, o);
    else other.n = m.n;
    other.mean = __shfl_xor_sync(0xffffffffu, m.mean, o);
    other.m2 = __shfl_xor_sync(0xffffffffu, m.m2, o);
    m = EQUAL ? merge_equal(m, other) : merge(m, other);
  }
  return m;
}

// The block's summary, returned to every thread.  UNIFORM: every thread summarises the same
// number of values and the block has a power-of-two number of warps.  `scratch`: 96 floats of
// shared memory, which the call leaves free for reuse.
template <bool UNIFORM> __device__ __forceinline__ Moments block_moments(Moments m, float* scratch) {
  m = butterfly<UNIFORM>(m, 32);
  if (blockDim.x <= 32) return m;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = static_cast<int>(blockDim.x >> 5);
  if (lane == 0) scratch[warp] = m.n, scratch[32 + warp] = m.mean, scratch[64 + warp] = m.m2;
  __syncthreads();
  Moments w;
  if (UNIFORM) {
    // Each aligned group of `warps` lanes reads every warp's summary once and merges them the same way.
    const int k = lane & (warps - 1);
    w = {scratch[k], scratch[32 + k], scratch[64 + k]};
    w = butterfly<true>(w, warps);
  } else {
    if (lane < warps) w = {scratch[lane], scratch[32 + lane], scratch[64 + lane]};
    w = butterfly<false>(w, 32);
  }
  __syncthreads();
  return w;
}

}  // namespace kcpp::kernel::cuda
