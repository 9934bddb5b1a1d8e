// Launch configurations of the CUDA RoPE, for the tuning sweep of bench/bench_kernels.cpp.  The
// ordinary entry points use the defaults.
#pragma once

#include "rope.h"

namespace kcpp::liger {

struct RopeConfig {
  int threads = 128;       // per block (one token at a time): 64, 128 or 256
  int blocks_per_sm = 16;  // grid cap, blocks striding over tokens; 0 = one block per token
};

#if KCPP_WITH_CUDA
const char* rope_forward_cuda_with(const RopeParams& p, cudaStream_t stream, const RopeConfig& c);
const char* rope_backward_cuda_with(const RopeParams& p, cudaStream_t stream, const RopeConfig& c);
#endif

}  // namespace kcpp::liger
