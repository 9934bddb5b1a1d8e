// Launch configurations of the CUDA RoPE, for the tuning sweep of bench/bench_kernels.cpp.  The
// ordinary entry points use the defaults.
#pragma once

#include "rope.h"

namespace kcpp::liger {

// Defaults: the sweeps of bench_kernels.cpp on an H200 at q [4, 32, 2048, 128], k [4, 8, 2048, 128]
// bf16 (HF's [B, H, S, D]; bench/RESULTS.md, 2026-11-23): the column-group kernel at 2 heads a thread
// and 128 threads took the forward from 0.0479-0.0488 ms (the token kernel, 128 threads, one block
// a token) to 0.0473-0.0476; every column-group configuration from 64 to 160 threads and 1 to 4 heads
// a thread was within 1.5% of it, either order.
struct RopeConfig {
  int threads = 128;      // per block: 64, 128 or 256 (160 too with heads_per_thread)
  int blocks_per_sm = 0;  // token kernel: grid cap, blocks striding over tokens; 0 = one block per token
  int heads_per_thread = 2;  // > 0: the column-group kernel (rope_cuda.cu), 1 to 4 heads a thread; where
                             // it does not apply (element access, a tail to copy, threads not a
                             // multiple of the groups a head has) the token kernel runs; 0: the
                             // token kernel
  int order = 0;  // column-group kernel: 1 a warp on neighbouring heads of a token, 2 on neighbouring
                  // tokens of a head, 0 whichever q's strides make contiguous
};

#if KCPP_WITH_CUDA
const char* rope_forward_cuda_with(const RopeParams& p, cudaStream_t stream, const RopeConfig& c);
const char* rope_backward_cuda_with(const RopeParams& p, cudaStream_t stream, const RopeConfig& c);
#endif

}  // namespace kcpp::liger
