// What the three CUDA implementations of the selective scan share (selective_scan_lanes_cuda.cu, the
// state-lane kernels, the default; selective_scan_cuda.cu, the chunked kernels that KCPP_SCAN_CHUNKED=1
// selects, and the entry points; selective_scan_legacy_cuda.cu, the sequential ones that
// KCPP_SCAN_LEGACY=1 selects): constants, the gate's fast maths, and the other files' entry points.
// Every backward path writes the same workspace (selective_scan_cuda.cu: BackwardWorkspace), which the
// same two kernels reduce.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kcpp/kernel/fast_math.h"
#include "kcpp/kernel/types.h"
#include "selective_scan/selective_scan.h"

namespace kcpp::mamba::detail {

constexpr int kMaxStates = 16;  // N the CUDA kernels take
constexpr float kLog2e = 1.4426950408889634f;
constexpr unsigned kFull = 0xffffffffu;

__device__ __forceinline__ float step_of(const SelectiveScanParams& p, float raw) { return p.delta_softplus ? softplus(raw) : raw; }
// The same with softplus_fast (selective_scan.h), as the state-lane and chunked kernels compute it.
__device__ __forceinline__ float step_fast(const SelectiveScanParams& p, float raw) {
  return p.delta_softplus ? softplus_fast(raw) : raw;
}

// The gate's sigmoid from ex2.approx and rcp.approx (each within a few units in the last place).  e^-x
// also carries the rounding of -x log2(e), about |x| units, which moves sigmoid(x) by that much only
// where it is below ~e^-|x| (negligible against the other values).
__device__ __forceinline__ float fast_sigmoid(float x) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(1.0f + kernel::exp2_approx(-x * kLog2e)));
  return r;
}
__device__ __forceinline__ float fast_silu(float x) { return x * fast_sigmoid(x); }
__device__ __forceinline__ float fast_dsilu(float x) {
  const float s = fast_sigmoid(x);
  return s * fmaf(x, 1.0f - s, 1.0f);
}
__device__ __forceinline__ float fast_dsoftplus(float x) { return x > 20.0f ? 1.0f : fast_sigmoid(x); }

// A block's place in the grid of (batch, group, block of the group's channels), cpb channels a block:
// batch b, group g, its block cb of the group, channels [d0, d0 + kc) (kc <= cpb, fewer in the group's
// last block).
struct Place {
  int64_t b, g, cb, d0;
  int kc;
};
__device__ __forceinline__ Place place(const SelectiveScanParams& p, int64_t bpg, int cpb) {
  const int64_t blk = blockIdx.x, per_group = p.dim / p.groups;
  Place w;
  w.b = blk / (p.groups * bpg);
  w.g = blk / bpg % p.groups;
  w.cb = blk % bpg;
  w.d0 = w.g * per_group + w.cb * cpb;
  const int64_t left = per_group - w.cb * cpb;
  w.kc = static_cast<int>(left < cpb ? left : cpb);
  return w;
}

// The sequential kernels (selective_scan_legacy_cuda.cu).  legacy_backward_blocks launches the kernel
// that writes the workspace's partial sums for `bpg` = legacy_blocks_per_group(p) blocks a group; the
// caller adds them up.
int64_t legacy_blocks_per_group(const SelectiveScanParams& p);
const char* legacy_forward(const SelectiveScanParams& p, cudaStream_t stream);
const char* legacy_backward_blocks(const SelectiveScanParams& p, int64_t bpg, float* ws_bc, float* ws_a, float* ws_d,
                                   float* ws_bias, cudaStream_t stream);

// The state-lane kernels (selective_scan_lanes_cuda.cu), the default path; the backward's blocks as the
// legacy ones'.
int64_t lanes_blocks_per_group(const SelectiveScanParams& p);
// Whether the current device gives a block the state-lane backward's shared memory (Hopper does; an
// A100 does not).
bool lanes_backward_fits();
const char* lanes_forward(const SelectiveScanParams& p, cudaStream_t stream);
const char* lanes_backward_blocks(const SelectiveScanParams& p, int64_t bpg, float* ws_bc, float* ws_a, float* ws_d,
                                  float* ws_bias, cudaStream_t stream);

}  // namespace kcpp::mamba::detail
