// Launch configurations of the CUDA RMSNorm, for the tuning sweep of bench/bench_kernels.cpp and
// for tests that cover every variant.  The ordinary entry points pick a configuration themselves.
#pragma once

#include <cstddef>

#include "rms_norm.h"

namespace kcpp::liger {

struct RMSNormConfig {
  int items = 0;            // 16-byte vectors a thread holds in registers; 0: loop path
  bool persistent = true;   // grid of resident blocks striding over rows (else one block per row;
                            // the backward and the bulk path are always persistent)
  int stages = 0;           // > 0: the backward's bulk path (sm_90, items > 0): rows in flight a
                            // block, loaded by the copy engine into shared memory (at most 8)
  int blocks_per_sm = 0;    // > 0: at most this many resident blocks an SM (persistent grids)
  int cluster = 0;          // the backward's bulk path: blocks whose dw sums are added in a cluster
                            // (distributed shared memory) before column_sums: 1 (none), 2, 4 or 8;
                            // 0: the default
};

#if KCPP_WITH_CUDA
// As the entry points of rms_norm.h, with the configuration given.  Items beyond the register
// budget (32 row elements a thread forward, 16 backward) take the loop path; stages where the bulk
// path does not apply (before sm_90, misaligned rows, a ring beyond shared memory) are ignored.
size_t rms_norm_backward_workspace_with(const RMSNormParams& p, int device, const RMSNormConfig& c);
const char* rms_norm_forward_cuda_with(const RMSNormParams& p, cudaStream_t stream, const RMSNormConfig& c);
const char* rms_norm_backward_cuda_with(const RMSNormParams& p, cudaStream_t stream, const RMSNormConfig& c);
#endif

}  // namespace kcpp::liger
