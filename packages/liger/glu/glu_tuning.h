// Launch configurations of the CUDA GLU kernels, for the tuning sweep of bench/bench_kernels.cpp
// (and tests that cover every variant).  The ordinary entry points use the defaults.
#pragma once

#include "glu.h"

namespace kcpp::liger {

struct GluConfig {
  int unroll = 1;          // vectors a thread per loop iteration (loads issued first): 1, 2 or 4
  int blocks_per_sm = 16;  // grid size, in blocks of 256 threads per multiprocessor
  bool fast_math = false;  // hardware exp / division (16-bit dtypes only; f32 always accurate)
};

#if KCPP_WITH_CUDA
const char* glu_forward_cuda_with(const GluParams& p, cudaStream_t stream, const GluConfig& c);
const char* glu_backward_cuda_with(const GluParams& p, cudaStream_t stream, const GluConfig& c);
#endif

}  // namespace kcpp::liger
