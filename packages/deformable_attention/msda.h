// Multi-scale deformable attention (package deformable_attention, contract MultiScaleDeformableAttention/1,
// docs/contracts/MultiScaleDeformableAttention.md), forward and backward; CPU and CUDA.
//
// Shapes: value [B, S, M, C], spatial_shapes [L, 2] (H_l, W_l) int64, level_start [L] int64,
// loc [B, Q, M, L, P, 2] (x, y), attn [B, Q, M, L, P], out [B, Q, M*C]; all contiguous.
// Maths per (b, q, m, c), in f32, each output rounded once:
//   out = sum_{l,p} a_lp * sample_l(loc_lp)
//   sample_l: x = loc_x W_l - 1/2, y = loc_y H_l - 1/2 (grid_sample, align_corners=False), j0 = floor(x),
//   i0 = floor(y), fx = x - j0, fy = y - i0; bilinear over the corners (i0 | i0+1, j0 | j0+1), a corner
//   outside the map reads 0 (zero padding); outside -1 <= x < W_l, -1 <= y < H_l the sample is 0.
// Backward (nothing saved):
//   dattn = sum_c g_c sample_c;  dvalue[corner] += a g_c w_corner;
//   dloc_x = a W_l sum_c g_c ((1-fy)(v01 - v00) + fy (v11 - v10)),
//   dloc_y = a H_l sum_c g_c ((1-fx)(v10 - v00) + fx (v11 - v01)).
// Paths: CPU (msda_cpu.cpp): forward over (b, q) rows in parallel; backward over (b, m) in parallel, each
// owning dvalue[b, :, m, :] (an f32 copy, added in query order, rounded once at the end): reproducible.
// CUDA (msda_cuda.cu): a warp per (b, q, m) sample set; by default the grouped kernels (lane groups of
// 16-byte channel vectors, one sample per group; see msda_cuda.cu), else the lane-per-channel kernels
// (MsdaCudaKernels, KCPP_MSDA_LEGACY=1).  dvalue by f32 atomics (into an f32 workspace when dvalue is
// bf16 / f16), so not bitwise reproducible.
#pragma once

#include <cmath>
#include <cstdint>

#include "kcpp/kernel/types.h"

#if KCPP_WITH_CUDA
#include <cuda_runtime.h>
#endif

#if defined(__CUDACC__)
#define KCPP_MSDA_HD __host__ __device__ __forceinline__
#else
#define KCPP_MSDA_HD inline
#endif

namespace kcpp::msda {

struct MsdaParams {
  kernel::DType dtype = kernel::DType::f32;
  int64_t batch = 0, seq = 0, heads = 0, channels = 0, queries = 0, levels = 0, points = 0;
  const void* value = nullptr;              // [B, S, M, C]
  const int64_t* spatial_shapes = nullptr;  // [L, 2], on the device of the call
  const int64_t* level_start = nullptr;     // [L]
  const void* loc = nullptr;                // [B, Q, M, L, P, 2]
  const void* attn = nullptr;               // [B, Q, M, L, P]
  void* out = nullptr;                      // forward: [B, Q, M*C]
  // backward
  const void* dout = nullptr;  // [B, Q, M*C]
  void* dvalue = nullptr;      // [B, S, M, C]
  void* dloc = nullptr;        // [B, Q, M, L, P, 2]
  void* dattn = nullptr;       // [B, Q, M, L, P]
  // CUDA backward with a bf16 / f16 dvalue: B*S*M*C floats of scratch (msda_workspace_bytes), or null.
  float* workspace = nullptr;
};

// One sample's corners and weights.  `valid` is false when no corner can matter (then the sample and
// every gradient are 0); otherwise each corner has its weight and whether it lies inside the map.
struct Bilinear {
  bool valid = false;
  int64_t i0 = 0, j0 = 0;
  float fx = 0, fy = 0;
  bool in_i0 = false, in_i1 = false, in_j0 = false, in_j1 = false;
};

KCPP_MSDA_HD Bilinear bilinear_at(float lx, float ly, int64_t h, int64_t w) {
  Bilinear s;
  const float x = lx * static_cast<float>(w) - 0.5f, y = ly * static_cast<float>(h) - 0.5f;
  // Also false for NaN; the bounds keep floor's result within int64.
  if (!(x >= -1.0f && x < static_cast<float>(w) && y >= -1.0f && y < static_cast<float>(h))) return s;
  const float x0 = floorf(x), y0 = floorf(y);
  s.valid = true;
  s.j0 = static_cast<int64_t>(x0), s.i0 = static_cast<int64_t>(y0);
  s.fx = x - x0, s.fy = y - y0;
  s.in_j0 = s.j0 >= 0, s.in_j1 = s.j0 + 1 < w;
  s.in_i0 = s.i0 >= 0, s.in_i1 = s.i0 + 1 < h;
  return s;
}

// Scratch bytes the CUDA backward needs (0 for an f32 dvalue).
inline size_t msda_workspace_bytes(const MsdaParams& p) {
  return p.dtype == kernel::DType::f32 ? 0 : static_cast<size_t>(p.batch * p.seq * p.heads * p.channels) * sizeof(float);
}

// The CUDA kernels a call runs.  Auto: the grouped kernels where they take the call
// (msda_grouped_unsupported), unless the environment sets KCPP_MSDA_LEGACY=1; else the lane-per-channel
// ones.  Grouped: those, or an error saying why they do not take the call.  Legacy: the lane-per-channel
// kernels (any channel count), kept to compare against.
enum class MsdaCudaKernels { Auto, Grouped, Legacy };

// Shape and pointer checks (the index tensors' contents are checked by the CPU entry points only).
const char* msda_check(const MsdaParams& p, bool backward);
const char* msda_forward_cpu(const MsdaParams& p);
const char* msda_backward_cpu(const MsdaParams& p);
#if KCPP_WITH_CUDA
const char* msda_forward_cuda(const MsdaParams& p, cudaStream_t stream, MsdaCudaKernels k = MsdaCudaKernels::Auto);
const char* msda_backward_cuda(const MsdaParams& p, cudaStream_t stream, MsdaCudaKernels k = MsdaCudaKernels::Auto);
// Null when the grouped kernels take the call, else why not (a constant string).
const char* msda_grouped_unsupported(const MsdaParams& p, bool backward);
// The channels a lane of the grouped kernels holds for this call: 16 bytes' worth when C is a multiple of
// that and the pointers they vector-access are 16-byte aligned, else 1 (0 when they do not take it).
int msda_grouped_vector(const MsdaParams& p, bool backward);
#endif

}  // namespace kcpp::msda
