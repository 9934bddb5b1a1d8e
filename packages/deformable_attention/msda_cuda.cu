// Multi-scale deformable attention on CUDA (maths and layout in msda.h).
//   forward:  a warp per (batch, query, head); its lanes take channels c = lane, lane + 32, ... (up to
//             kMaxChunks * 32 channels in registers), each lane computing the sample's corners itself;
//             a corner's C channels are one contiguous read of the warp.
//   backward: the same warp layout; per sample each lane adds a g_c w to its channels of the four
//             corners of dvalue with f32 atomicAdd (straight into an f32 dvalue, else into an f32
//             workspace rounded into dvalue by a last pass), and the four sums_c g_c v_corner,c are
//             reduced over the warp for dattention_weights and dsampling_locations.  The atomics' order
//             varies between runs: dvalue is not bitwise reproducible (as flash_attn's dq).
// The index tensors are read on the device; a level with H or W < 1 or outside [0, S) samples zeros.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kcpp/kernel/cuda.cuh"
#include "kcpp/kernel/error.h"
#include "msda.h"

namespace kcpp::msda {
namespace {

namespace kc = kernel::cuda;

constexpr int kThreads = 256, kWarps = kThreads / 32;
constexpr int kMaxChunks = 4;  // channels a head held in registers: up to 128 in one pass

struct DevLevel {
  int64_t h, w, start;
  bool ok;
};

__device__ __forceinline__ DevLevel level_at(const MsdaParams& p, int64_t l) {
  DevLevel lv;
  lv.h = p.spatial_shapes[2 * l], lv.w = p.spatial_shapes[2 * l + 1], lv.start = p.level_start[l];
  lv.ok = lv.h >= 1 && lv.w >= 1 && lv.start >= 0 && lv.h <= p.seq && lv.w <= p.seq && lv.start + lv.h * lv.w <= p.seq;
  return lv;
}

// Rows of the four corners in value (-1 outside the map) and their weights.
__device__ __forceinline__ void corners(const Bilinear& s, const DevLevel& lv, int64_t (&row)[4], float (&wt)[4]) {
  const int64_t r0 = lv.start + s.i0 * lv.w, r1 = r0 + lv.w;
  row[0] = s.in_i0 && s.in_j0 ? r0 + s.j0 : -1;
  row[1] = s.in_i0 && s.in_j1 ? r0 + s.j0 + 1 : -1;
  row[2] = s.in_i1 && s.in_j0 ? r1 + s.j0 : -1;
  row[3] = s.in_i1 && s.in_j1 ? r1 + s.j0 + 1 : -1;
  wt[0] = (1 - s.fy) * (1 - s.fx), wt[1] = (1 - s.fy) * s.fx, wt[2] = s.fy * (1 - s.fx), wt[3] = s.fy * s.fx;
}

template <typename T, int CH>
__global__ void __launch_bounds__(kThreads) forward_kernel(const MsdaParams p) {
  const int64_t item = blockIdx.x * static_cast<int64_t>(kWarps) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int64_t M = p.heads, C = p.channels, LP = p.levels * p.points;
  if (item >= p.batch * p.queries * M) return;
  const int64_t m = item % M, b = item / (p.queries * M);
  const T* loc = static_cast<const T*>(p.loc) + item * LP * 2;
  const T* attn = static_cast<const T*>(p.attn) + item * LP;
  const T* vbase = static_cast<const T*>(p.value) + (b * p.seq * M + m) * C;
  for (int64_t c0 = 0; c0 < C; c0 += 32 * CH) {
    float acc[CH];
#pragma unroll
    for (int k = 0; k < CH; ++k) acc[k] = 0.0f;
    for (int64_t l = 0; l < p.levels; ++l) {
      const DevLevel lv = level_at(p, l);
      if (!lv.ok) continue;
      for (int64_t pt = 0; pt < p.points; ++pt) {
        const int64_t i = l * p.points + pt;
        const Bilinear s = bilinear_at(kc::to_f32(loc[2 * i]), kc::to_f32(loc[2 * i + 1]), lv.h, lv.w);
        if (!s.valid) continue;
        int64_t row[4];
        float wt[4];
        corners(s, lv, row, wt);
        const float a = kc::to_f32(attn[i]);
#pragma unroll
        for (int corner = 0; corner < 4; ++corner) {
          if (row[corner] < 0) continue;
          const T* v = vbase + row[corner] * M * C;
          const float wa = a * wt[corner];
#pragma unroll
          for (int k = 0; k < CH; ++k) {
            const int64_t c = c0 + k * 32 + lane;
            if (c < C) acc[k] += wa * kc::to_f32(v[c]);
          }
        }
      }
    }
    T* o = static_cast<T*>(p.out) + item * C;
#pragma unroll
    for (int k = 0; k < CH; ++k) {
      const int64_t c = c0 + k * 32 + lane;
      if (c < C) o[c] = kc::from_f32<T>(acc[k]);
    }
  }
}

template <typename T, int CH>
__global__ void __launch_bounds__(kThreads) backward_kernel(const MsdaParams p, float* dvalue) {
  const int64_t item = blockIdx.x * static_cast<int64_t>(kWarps) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int64_t M = p.heads, C = p.channels, LP = p.levels * p.points;
  if (item >= p.batch * p.queries * M) return;
  const int64_t m = item % M, b = item / (p.queries * M);
  const T* loc = static_cast<const T*>(p.loc) + item * LP * 2;
  const T* attn = static_cast<const T*>(p.attn) + item * LP;
  T* dloc = static_cast<T*>(p.dloc) + item * LP * 2;
  T* dattn = static_cast<T*>(p.dattn) + item * LP;
  const int64_t vofs = (b * p.seq * M + m) * C;
  const T* vbase = static_cast<const T*>(p.value) + vofs;
  float* dvbase = dvalue + vofs;
  const T* dout = static_cast<const T*>(p.dout) + item * C;
  for (int64_t l = 0; l < p.levels; ++l) {
    const DevLevel lv = level_at(p, l);
    for (int64_t pt = 0; pt < p.points; ++pt) {
      const int64_t i = l * p.points + pt;
      const Bilinear s = lv.ok ? bilinear_at(kc::to_f32(loc[2 * i]), kc::to_f32(loc[2 * i + 1]), lv.h, lv.w) : Bilinear{};
      if (!s.valid) {  // uniform over the warp
        if (lane == 0) dattn[i] = kc::from_f32<T>(0.0f), dloc[2 * i] = dloc[2 * i + 1] = kc::from_f32<T>(0.0f);
        continue;
      }
      int64_t row[4];
      float wt[4];
      corners(s, lv, row, wt);
      const float a = kc::to_f32(attn[i]);
      float d[4] = {0, 0, 0, 0};
      for (int64_t c0 = 0; c0 < C; c0 += 32 * CH) {
        float g[CH];
#pragma unroll
        for (int k = 0; k < CH; ++k) {
          const int64_t c = c0 + k * 32 + lane;
          g[k] = c < C ? kc::to_f32(dout[c]) : 0.0f;
        }
#pragma unroll
        for (int corner = 0; corner < 4; ++corner) {
          if (row[corner] < 0) continue;
          const T* v = vbase + row[corner] * M * C;
          float* dv = dvbase + row[corner] * M * C;
          const float wa = a * wt[corner];
#pragma unroll
          for (int k = 0; k < CH; ++k) {
            const int64_t c = c0 + k * 32 + lane;
            if (c < C) {
              d[corner] += g[k] * kc::to_f32(v[c]);
              atomicAdd(dv + c, wa * g[k]);
            }
          }
        }
      }
#pragma unroll
      for (int corner = 0; corner < 4; ++corner) d[corner] = kc::warp_sum(d[corner]);
      if (lane == 0) {
        dattn[i] = kc::from_f32<T>(wt[0] * d[0] + wt[1] * d[1] + wt[2] * d[2] + wt[3] * d[3]);
        const float gx = (1 - s.fy) * (d[1] - d[0]) + s.fy * (d[3] - d[2]);
        const float gy = (1 - s.fx) * (d[2] - d[0]) + s.fx * (d[3] - d[1]);
        dloc[2 * i] = kc::from_f32<T>(a * static_cast<float>(lv.w) * gx);
        dloc[2 * i + 1] = kc::from_f32<T>(a * static_cast<float>(lv.h) * gy);
      }
    }
  }
}

template <typename T>
__global__ void round_kernel(const float* src, T* dst, int64_t n) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n) dst[i] = kc::from_f32<T>(src[i]);
}

template <typename F>
const char* with_dtype(kernel::DType t, F&& f) {
  switch (t) {
    case kernel::DType::f32:
      return f(static_cast<float*>(nullptr));
    case kernel::DType::bf16:
      return f(static_cast<__nv_bfloat16*>(nullptr));
    case kernel::DType::f16:
      return f(static_cast<__half*>(nullptr));
  }
  return kernel::errorf("multi_scale_deformable_attention: unsupported dtype %d", static_cast<int>(t));
}

// The channel chunks in registers: the fewest that hold C (C > 128 takes several passes of 128).
template <typename F>
const char* with_chunks(int64_t channels, F&& f) {
  if (channels <= 32) return f.template operator()<1>();
  if (channels <= 64) return f.template operator()<2>();
  return f.template operator()<kMaxChunks>();
}

unsigned warp_blocks(int64_t items) { return static_cast<unsigned>((items + kWarps - 1) / kWarps); }

}  // namespace

const char* msda_forward_cuda(const MsdaParams& p, cudaStream_t stream) {
  if (const char* e = msda_check(p, false)) return e;
  const int64_t items = p.batch * p.queries * p.heads;
  if (items == 0 || p.channels == 0) return nullptr;
  return with_dtype(p.dtype, [&]<typename T>(T*) -> const char* {
    return with_chunks(p.channels, [&]<int CH>() -> const char* {
      forward_kernel<T, CH><<<warp_blocks(items), kThreads, 0, stream>>>(p);
      return kc::launch_error("multi_scale_deformable_attention forward");
    });
  });
}

const char* msda_backward_cuda(const MsdaParams& p, cudaStream_t stream) {
  if (const char* e = msda_check(p, true)) return e;
  const int64_t nv = p.batch * p.seq * p.heads * p.channels, items = p.batch * p.queries * p.heads;
  const bool f32 = p.dtype == kernel::DType::f32;
  KCPP_KERNEL_REQUIRE(f32 || nv == 0 || p.workspace,
                      "multi_scale_deformable_attention backward: a bf16 / f16 'dvalue' needs %zu bytes of f32 workspace",
                      msda_workspace_bytes(p));
  float* dv = f32 ? static_cast<float*>(p.dvalue) : p.workspace;
  if (nv > 0 && cudaMemsetAsync(dv, 0, static_cast<size_t>(nv) * sizeof(float), stream) != cudaSuccess)
    return kc::launch_error("multi_scale_deformable_attention backward (zeroing dvalue)");
  return with_dtype(p.dtype, [&]<typename T>(T*) -> const char* {
    if (items > 0 && p.levels * p.points > 0)
      if (const char* e = with_chunks(p.channels, [&]<int CH>() -> const char* {
            backward_kernel<T, CH><<<warp_blocks(items), kThreads, 0, stream>>>(p, dv);
            return nullptr;
          }))
        return e;
    if (!f32 && nv > 0)
      round_kernel<T><<<static_cast<unsigned>((nv + 255) / 256), 256, 0, stream>>>(dv, static_cast<T*>(p.dvalue), nv);
    return kc::launch_error("multi_scale_deformable_attention backward");
  });
}

}  // namespace kcpp::msda
