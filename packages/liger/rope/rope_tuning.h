// Launch configurations of the CUDA RoPE, for the tuning sweep of bench/bench_kernels.cpp.  The
// ordinary entry points use the defaults.
#pragma once

#include "rope.h"

namespace kcpp::liger {

// Defaults: the sweep on an H200 at q [4, 32, 2048, 128], k [4, 8, 2048, 128] bf16 (commit 64946f9):
// 128 threads, one block per token: forward 0.0490 ms (80.9% of copy) against 0.0516 ms at 16
// blocks per SM.
struct RopeConfig {
  int threads = 128;      // per block (one token at a time): 64, 128 or 256
  int blocks_per_sm = 0;  // grid cap, blocks striding over tokens; 0 = one block per token
};

#if KCPP_WITH_CUDA
const char* rope_forward_cuda_with(const RopeParams& p, cudaStream_t stream, const RopeConfig& c);
const char* rope_backward_cuda_with(const RopeParams& p, cudaStream_t stream, const RopeConfig& c);
#endif

}  // namespace kcpp::liger
