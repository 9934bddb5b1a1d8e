// Launch configurations of the CUDA RMSNorm, for the tuning sweep of bench/bench_kernels.cpp and
// for tests that cover every variant.  The ordinary entry points pick a configuration themselves.
#pragma once

#include <cstddef>

#include "rms_norm.h"

namespace kcpp::liger {

struct RMSNormConfig {
  int items = 0;            // 16-byte vectors a thread holds in registers; 0: loop path
  bool prefetch = false;    // issue the next row's loads before this row's reduction
  bool persistent = true;   // grid of resident blocks striding over rows (else one block per row)
  bool smem_dw = false;     // backward: sum dw in shared memory rather than registers
  bool warp_rows = false;   // forward: one warp per row, two passes (items is then ignored)
};

#if KCPP_WITH_CUDA
// As the entry points of rms_norm.h, with the configuration given.  Options a dtype was not built
// with (only bf16 has all of them) or that do not fit (items beyond the register budget) fall back
// to the loop path or the defaults; results are the same either way.
size_t rms_norm_backward_workspace_with(const RMSNormParams& p, int device, const RMSNormConfig& c);
const char* rms_norm_forward_cuda_with(const RMSNormParams& p, cudaStream_t stream, const RMSNormConfig& c);
const char* rms_norm_backward_cuda_with(const RMSNormParams& p, cudaStream_t stream, const RMSNormConfig& c);
#endif

}  // namespace kcpp::liger
