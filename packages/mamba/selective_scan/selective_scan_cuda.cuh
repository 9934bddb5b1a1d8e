// What the two CUDA implementations of the selective scan share (selective_scan_cuda.cu, the chunked
// kernels, and selective_scan_legacy_cuda.cu, the sequential ones that KCPP_SCAN_LEGACY=1 selects):
// constants, the dtype dispatch, and the legacy kernels' entry points.  Both backward paths write the
// same workspace (selective_scan_cuda.cu: BackwardWorkspace), which the same two kernels reduce.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kcpp/kernel/types.h"
#include "selective_scan/selective_scan.h"

namespace kcpp::mamba::detail {

constexpr int kMaxStates = 16;  // N the CUDA kernels take
constexpr float kLog2e = 1.4426950408889634f;
constexpr unsigned kFull = 0xffffffffu;

__device__ __forceinline__ float step_of(const SelectiveScanParams& p, float raw) { return p.delta_softplus ? softplus(raw) : raw; }

// The sequential kernels (selective_scan_legacy_cuda.cu).  legacy_backward_blocks launches the kernel
// that writes the workspace's partial sums for `bpg` = legacy_blocks_per_group(p) blocks a group; the
// caller adds them up.
int64_t legacy_blocks_per_group(const SelectiveScanParams& p);
const char* legacy_forward(const SelectiveScanParams& p, cudaStream_t stream);
const char* legacy_backward_blocks(const SelectiveScanParams& p, int64_t bpg, float* ws_bc, float* ws_a, float* ws_d,
                                   float* ws_bias, cudaStream_t stream);

}  // namespace kcpp::mamba::detail
