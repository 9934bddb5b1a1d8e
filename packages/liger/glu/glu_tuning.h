// Launch configurations of the CUDA GLU kernels, for the tuning sweep of bench/bench_kernels.cpp
// (and tests that cover every variant).  The ordinary entry points use the defaults.
#pragma once

#include "glu.h"

namespace kcpp::liger {

// Defaults: the best forward + backward of the sweep on an H200 at [8192, 14336] bf16 (commit 3bd90ee,
// bench/RESULTS.md): forward 0.1723 ms, backward 0.2882 ms, against 0.1934 / 0.3004 ms for
// unroll 1, 16 blocks per SM, accurate math.
struct GluConfig {
  int unroll = 2;          // vectors a thread per loop iteration (loads issued first): 1, 2 or 4
  int blocks_per_sm = 32;  // grid size, in blocks of 256 threads per multiprocessor
  bool fast_math = true;   // hardware exp / division (16-bit dtypes only; f32 always accurate)
};

#if KCPP_WITH_CUDA
const char* glu_forward_cuda_with(const GluParams& p, cudaStream_t stream, const GluConfig& c);
const char* glu_backward_cuda_with(const GluParams& p, cudaStream_t stream, const GluConfig& c);
#endif

}  // namespace kcpp::liger
