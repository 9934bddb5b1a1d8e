// Launch configurations of the CUDA GLU kernels, for the tuning sweep of bench/bench_kernels.cpp
// (and tests that cover every variant).  The ordinary entry points use the defaults.
#pragma once

#include "glu.h"

namespace kcpp::liger {

// Defaults: the best of the sweep on an H200 at [8192, 14336] bf16 (bench/RESULTS.md, "SwiGLU one
// vector a thread"): no loop, one 16-byte vector of each tensor a thread, accurate maths: forward
// 0.1659 ms, backward 0.2765 ms (99.4% of copy both), against 0.1735 / 0.2875 ms for the earlier
// default (unroll 2, 32 blocks per SM, fast maths); fast maths no longer buys anything there.  Fast maths
// is still the default for 16-bit dtypes (as glu.h says): exact GeGLU is bound by erff's instructions
// otherwise (normal_cdf_fast in kcpp/kernel/activation.h; bench/RESULTS.md, "Every activation").
struct GluConfig {
  int unroll = 1;          // vectors a thread (loads issued first): 1, 2 or 4
  int blocks_per_sm = 0;   // 0: no grid-stride loop, one block per 256 x unroll vectors (a contiguous
                           // piece of each tensor); else a grid of this many blocks of 256 a multiprocessor
  bool fast_math = true;   // MathMode::Fast: hardware exp / division, GELU's normal_cdf_fast (16-bit dtypes only)
};

#if KCPP_WITH_CUDA
const char* glu_forward_cuda_with(const GluParams& p, cudaStream_t stream, const GluConfig& c);
const char* glu_backward_cuda_with(const GluParams& p, cudaStream_t stream, const GluConfig& c);
#endif

}  // namespace kcpp::liger
