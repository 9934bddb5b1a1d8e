// Decoding attention over a ragged KV cache (ops/nn/decode_attention.h), split across the keys.
//
// Grid (split, query-head block, batch row); 4 warps a block.  Rows short enough (at most 16 keys a
// warp) that would be split instead run one block of 8 or 16 warps a query-head block, whose warps
// take the keys the splits' blocks would and merge in shared memory: no partial results in global
// memory and no second kernel.  A key's D elements are spread over LPK lanes, 8 consecutive elements
// each (one 16-byte load in 16-bit dtypes), so a warp reads 32 / LPK keys at a time, every element
// once for the `gc` query heads of the block (a divisor of the group size g = Hq / Hkv, at most
// GMAX).  Each lane keeps an online softmax per head in base 2 (scores pre-scaled by log2 e):
// running maximum m, sum l and the weighted sum of its 8 value elements.  At the end the lanes of a
// warp, then the warps, merge their (m, l, acc) exactly as two partial softmaxes merge: m = max(m1,
// m2), l = l1 2^(m1-m) + l2 2^(m2-m), acc likewise.  One split writes o = acc / l; several write
// (acc, m, l) and a second kernel merges the splits.
//
// qk_norm_rope_attention (ops/nn/decode_fused.h) runs the same kernel with a prologue wherever a head
// group is one block (the one-block path for short rows, or a single split) and holds a whole group
// of Hq / Hkv query heads: the block's lane groups take its query heads, its key head and its value
// head from the projection's output, apply the per-head norm and RoPE exactly as
// qk_norm_rope_cache's 16-byte kernel does (ops/cuda/decode_fused.cu: a head over LPK lanes of 8
// elements, the same sums and roundings), keep them in shared memory and write the key and value to
// the cache.  The new position's key and value are then taken from shared memory, not read back, and
// the first keys' loads are issued before the prologue so that they are in flight during it.
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <cmath>
#include <string>
#include <type_traits>

#include "ops/cuda/common.cuh"
#include "ops/cuda/launch.h"
#include "ops/cuda/pdl.cuh"

namespace kcpp::ops::cuda {
namespace {

using kcpp::kernel::cuda::from_f32;
using kcpp::kernel::cuda::round_to;
using kcpp::kernel::cuda::store_f32;
using kcpp::kernel::cuda::to_f32;

constexpr int kWarps = 4;
constexpr float kLog2e = 1.4426950408889634f;

template <typename T> __device__ __forceinline__ void load8(const T* p, float (&x)[8]) {
  if constexpr (std::is_same_v<T, float>) {
    const float4 a = *reinterpret_cast<const float4*>(p), b = *reinterpret_cast<const float4*>(p + 4);
    x[0] = a.x, x[1] = a.y, x[2] = a.z, x[3] = a.w, x[4] = b.x, x[5] = b.y, x[6] = b.z, x[7] = b.w;
  } else {
    const uint4 u = *reinterpret_cast<const uint4*>(p);
    const T* h = reinterpret_cast<const T*>(&u);
#pragma unroll
    for (int i = 0; i < 8; ++i) x[i] = to_f32(h[i]);
  }
}

template <typename T> __device__ __forceinline__ void store8(T* p, const float (&x)[8]) {
  if constexpr (std::is_same_v<T, float>) {
    reinterpret_cast<float4*>(p)[0] = make_float4(x[0], x[1], x[2], x[3]);
    reinterpret_cast<float4*>(p)[1] = make_float4(x[4], x[5], x[6], x[7]);
  } else {
    store_f32<T, 8>(p, x);
  }
}

// Eight consecutive elements as loaded (16-bit T: one 16-byte vector in four registers; f32: two),
// widened where they are used: the prologue's loads are all issued before the first is used.
template <typename T> struct Raw8 {
  static constexpr int kWords = sizeof(T) * 8 / 16;
  uint4 w[kWords];
};
template <typename T> __device__ __forceinline__ Raw8<T> load_raw8(const T* p) {
  Raw8<T> r;
#pragma unroll
  for (int i = 0; i < Raw8<T>::kWords; ++i) r.w[i] = reinterpret_cast<const uint4*>(p)[i];
  return r;
}
template <typename T> __device__ __forceinline__ void widen_raw8(const Raw8<T>& r, float (&x)[8]) {
  if constexpr (std::is_same_v<T, float>) {
#pragma unroll
    for (int i = 0; i < 8; ++i) x[i] = __uint_as_float(reinterpret_cast<const uint32_t*>(r.w)[i]);
  } else {
    const T* h = reinterpret_cast<const T*>(r.w);
#pragma unroll
    for (int i = 0; i < 8; ++i) x[i] = to_f32(h[i]);
  }
}
// Elements e0 .. e0 + 7 of a row of n (n - e0 may be below 8: zeros past it), as Raw8: one vector
// load where `vec` (the row 16-byte aligned and n % 8 == 0), else element by element.
template <typename T> __device__ __forceinline__ Raw8<T> load_row8(const T* row, int e0, int n, bool vec) {
  if (vec) return load_raw8(row + e0);
  Raw8<T> r;
  T* h = reinterpret_cast<T*>(r.w);
#pragma unroll
  for (int i = 0; i < 8; ++i) h[i] = e0 + i < n ? row[e0 + i] : T(0.f);
  return r;
}

// A row index outside the cache or a length outside [1, max_length]: the row's output is NaN.
__device__ __forceinline__ bool bad_row(const int* rows, const int* lengths, int b, int r_count, int max_length) {
  const int row = rows[b], len = lengths[b];
  return row < 0 || row >= r_count || len < 1 || len > max_length;
}


// qk_norm_rope_attention's prologue: where the block takes q, the new key and the new value from
// (ops/nn/decode_fused.h: qkv [B, Hq + 2 Hkv, D], the norms' weights [D] or null, cos / sin [B, rd]).
template <typename T> struct QkPrologue {
  const T* qkv = nullptr;
  const T* q_norm = nullptr;
  const T* k_norm = nullptr;
  const T* cos = nullptr;
  const T* sin = nullptr;
  const int* positions = nullptr;  // [B]: the new key's slot in the cache row
  T* k_cache = nullptr;            // where the new key and value are written (the caches read as kc, vc;
  T* v_cache = nullptr;            // the kernel never reads the slots it writes)
  int rd = 0;
  float eps = 0.f, offset = 0.f;
  bool gemma = false, interleaved = false;
  bool vec_norm = false, vec_rope = false;  // 16-byte loads of the norms' weights, of cos and sin
  // The caller's QkNormRopeCache::settled: rows, lengths, positions, cos / sin and the caches' other
  // keys are no output of the kernel just before, so they are read before the PDL wait.
  bool settled = false;
};

// Shared memory rows of the prologue: the block's query heads (GMAX), then the new key and value.
template <int GMAX> constexpr int kProKey = GMAX;
template <int GMAX> constexpr int kProValue = GMAX + 1;

// FUSED: the prologue (QkPrologue) makes q and the new key and value; q is unused.
template <typename T, int LPK, int GMAX, int W, bool FUSED>
__global__ void __launch_bounds__(W * 32)
    decode_kernel(const T* __restrict__ q, const T* __restrict__ kc, const T* __restrict__ vc, const int* __restrict__ rows,
                  const int* __restrict__ lengths, T* __restrict__ out, float* __restrict__ part_o,
                  float* __restrict__ part_ml, int hq, int hkv, int gc, int d, int r_count, int capacity, int max_length,
                  float scale_log2, int window, int splits, const __grid_constant__ QkPrologue<T> pro) {
  constexpr int KPI = 32 / LPK;  // keys a warp reads at a time
  __shared__ float sm_m[W][GMAX], sm_l[W][GMAX];
  __shared__ float sm_a[W][GMAX][LPK * 8];
  __shared__ float sm_pro[FUSED ? GMAX + 2 : 1][FUSED ? LPK * 8 : 1];
  const int split = blockIdx.x, hb = blockIdx.y, b = blockIdx.z;
  const int g = hq / hkv, h0 = hb * gc, kvh = h0 / g;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, sub = lane / LPK, sl = lane % LPK, e0 = sl * 8;
  const bool lane_on = e0 < d;
  // FUSED: a lane group (LPK lanes, 8 elements each) a head in rounds of W * KPI heads: the query heads
  // h0 .. h0 + gc - 1, then the key and the value head kvh.  The first round's loads are issued
  // together: its norm weights (no kernel's output) before the wait, its head and its cos / sin right
  // after it, beside the row's indices and the first keys.  With pro.settled the indices, cos / sin
  // and the first keys are loaded before the wait too, the head after it: only qkv is the previous
  // kernel's output, and every kernel before that one has finished when this one starts
  // (ops/cuda/pdl.cuh).
  const int heads = hq + 2 * hkv, tasks = gc + 2;
  Raw8<T> x_first{}, w_first{}, c_first{}, s_first{};
  auto norm_of = [&](int task) { return task == gc ? pro.k_norm : pro.q_norm; };
  auto roped = [&](int task) { return task < gc + 1 && lane_on && e0 < pro.rd; };
  const bool early = FUSED && pro.settled;
  auto load_head = [&] {  // the first round's head of qkv (FUSED)
    const int task = warp * KPI + sub;
    if (task < tasks && lane_on) {
      const int head = task < gc ? h0 + task : task == gc ? hq + kvh : hq + hkv + kvh;
      x_first = load_raw8(pro.qkv + (static_cast<size_t>(b) * heads + head) * d + e0);
    }
  };
  if constexpr (FUSED) {
    const int task = warp * KPI + sub;
    if (task < gc + 1 && lane_on && norm_of(task) != nullptr) w_first = load_row8(norm_of(task), e0, d, pro.vec_norm);
  }
  if (!early) {
    pdl_wait();  // q and the cache's new keys are the previous kernel's output (a no-op unless launched with PDL)
    pdl_trigger();
    if constexpr (FUSED) load_head();
  }
  if constexpr (FUSED) {
    const int task = warp * KPI + sub;
    if (roped(task)) {
      c_first = load_row8(pro.cos + static_cast<size_t>(b) * pro.rd, e0, pro.rd, pro.vec_rope);
      s_first = load_row8(pro.sin + static_cast<size_t>(b) * pro.rd, e0, pro.rd, pro.vec_rope);
    }
  }
  const bool bad = bad_row(rows, lengths, b, r_count, max_length);
  const int len = bad ? 0 : lengths[b];
  // The row's own keys [lo, len) split evenly over the splits, so that every split works whatever
  // bound the launch was sized for (a captured step is sized for the capacity).
  const int lo = window > 0 ? ::max(0, len - window) : 0;
  const int chunk = (len - lo + splits - 1) / splits;
  const int start = lo + split * chunk, end = ::min(len, start + chunk);
  const size_t base = bad ? 0 : (static_cast<size_t>(rows[b]) * hkv + kvh) * capacity;
  // FUSED: the new key's position where the prologue writes it to the cache (else -1); that key and
  // value come from shared memory.
  int fresh = -1;
  size_t fresh_at = 0;  // its element offset in the caches
  if constexpr (FUSED) {
    const int row = rows[b], pos = pro.positions[b];
    if (row >= 0 && row < r_count && pos >= 0 && pos < capacity)
      fresh = pos, fresh_at = ((static_cast<size_t>(row) * hkv + kvh) * capacity + pos) * d;
  }

  // Two keys a lane group per iteration, both loaded before either is used.
  constexpr int kStep = W * KPI;
  float kx[2][8], vx[2][8];
  auto load_keys = [&](int j0) {
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int j = j0 + u * kStep + sub;
      if (j < end && lane_on && j != fresh) {
        load8(kc + (base + j) * d + e0, kx[u]);
        load8(vc + (base + j) * d + e0, vx[u]);
      } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) kx[u][i] = 0.f, vx[u][i] = 0.f;
      }
    }
  };
  const int j_first = start + warp * KPI;
  load_keys(j_first);  // in flight during the prologue and q's loads
  if (early) {
    pdl_wait();  // qkv is the previous kernel's output
    pdl_trigger();
    load_head();
  }

  if constexpr (FUSED) {
    // Every lane of a warp runs each round (the norm's sums shuffle over the warp).
    for (int t0 = 0; t0 < tasks; t0 += W * KPI) {
      const int task = t0 + warp * KPI + sub;
      const bool on = task < tasks && lane_on;
      const bool is_k = task == gc, is_v = task == gc + 1;
      const int slot = task < gc ? task : is_k ? kProKey<GMAX> : kProValue<GMAX>;
      Raw8<T> xr = x_first, wr = w_first, cr = c_first, sr = s_first;
      if (t0 > 0) {  // rounds after the first (more heads than lane groups) load theirs here
        if (on) {
          const int head = task < gc ? h0 + task : is_k ? hq + kvh : hq + hkv + kvh;
          xr = load_raw8(pro.qkv + (static_cast<size_t>(b) * heads + head) * d + e0);
        }
        if (task < gc + 1 && lane_on && norm_of(task) != nullptr) wr = load_row8(norm_of(task), e0, d, pro.vec_norm);
        if (roped(task)) {
          cr = load_row8(pro.cos + static_cast<size_t>(b) * pro.rd, e0, pro.rd, pro.vec_rope);
          sr = load_row8(pro.sin + static_cast<size_t>(b) * pro.rd, e0, pro.rd, pro.vec_rope);
        }
      }
      float v[8];
      if (on) {
        widen_raw8(xr, v);
      } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = 0.f;
      }
      float ss = 0.f;
#pragma unroll
      for (int i = 0; i < 8; ++i) ss += v[i] * v[i];
#pragma unroll
      for (int o = LPK / 2; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);  // within the group
      if (on && !is_v && norm_of(task) != nullptr) {  // RMSNorm over the head, as qk_norm_rope_cache
        const float rstd = 1.f / sqrtf(ss / static_cast<float>(d) + pro.eps);
        float wt[8];
        widen_raw8(wr, wt);
#pragma unroll
        for (int i = 0; i < 8; ++i)
          v[i] = norm_apply<T>(v[i], rstd, norm_weight_value<T>(wt[i], pro.offset, pro.gemma), pro.gemma);
      }
      float* sh = sm_pro[on ? slot : 0];
      if (on) {
#pragma unroll
        for (int i = 0; i < 8; ++i) sh[e0 + i] = v[i];
      }
      __syncwarp();
      if (on && roped(task)) {  // RoPE, each element's partner from shared memory
        float cv[8], sv[8];
        widen_raw8(cr, cv);
        widen_raw8(sr, sv);
        const int half = pro.rd / 2;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const int e = e0 + i;
          if (e >= pro.rd) break;
          const float rot = pro.interleaved ? ((e & 1) ? sh[e - 1] : -sh[e + 1]) : (e < half ? -sh[e + half] : sh[e - half]);
          v[i] = round_to<T>(__fadd_rn(round_to<T>(__fmul_rn(v[i], cv[i])), round_to<T>(__fmul_rn(rot, sv[i]))));
        }
      }
      __syncwarp();  // every partner read before the rotated values replace them
      if (on) {
#pragma unroll
        for (int i = 0; i < 8; ++i) sh[e0 + i] = v[i];
        if (task >= gc && fresh >= 0) store8((is_k ? pro.k_cache : pro.v_cache) + fresh_at + e0, v);
      }
    }
    __syncthreads();
  }

  float qr[GMAX][8], acc[GMAX][8], m[GMAX], l[GMAX];
#pragma unroll
  for (int gi = 0; gi < GMAX; ++gi) {
    m[gi] = -INFINITY, l[gi] = 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[gi][i] = 0.f, qr[gi][i] = 0.f;
    if (gi < gc && lane_on) {
      if constexpr (FUSED) {
#pragma unroll
        for (int i = 0; i < 8; ++i) qr[gi][i] = sm_pro[gi][e0 + i];
      } else {
        load8(q + (static_cast<size_t>(b) * hq + h0 + gi) * d + e0, qr[gi]);
      }
#pragma unroll
      for (int i = 0; i < 8; ++i) qr[gi][i] *= scale_log2;
    }
  }
  for (int j0 = j_first; j0 < end; j0 += 2 * kStep) {
    const int j[2] = {j0 + sub, j0 + kStep + sub};
    if (j0 != j_first) load_keys(j0);
    if constexpr (FUSED) {
#pragma unroll
      for (int u = 0; u < 2; ++u)
        if (j[u] == fresh && lane_on)
#pragma unroll
          for (int i = 0; i < 8; ++i) kx[u][i] = sm_pro[kProKey<GMAX>][e0 + i], vx[u][i] = sm_pro[kProValue<GMAX>][e0 + i];
    }
#pragma unroll
    for (int u = 0; u < 2; ++u) {
#pragma unroll
      for (int gi = 0; gi < GMAX; ++gi) {
        if (gi >= gc) break;
        float s = 0.f;
#pragma unroll
        for (int i = 0; i < 8; ++i) s = fmaf(qr[gi][i], kx[u][i], s);
#pragma unroll
        for (int o = LPK / 2; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        if (j[u] < end) {
          const float mm = fmaxf(m[gi], s), alpha = exp2f(m[gi] - mm), p = exp2f(s - mm);
          l[gi] = l[gi] * alpha + p;
#pragma unroll
          for (int i = 0; i < 8; ++i) acc[gi][i] = fmaf(acc[gi][i], alpha, p * vx[u][i]);
          m[gi] = mm;
        }
      }
    }
  }
  // Merge the lane groups of the warp (lanes sl, sl + LPK, ...), then the warps.
#pragma unroll
  for (int o = LPK; o < 32; o <<= 1) {
#pragma unroll
    for (int gi = 0; gi < GMAX; ++gi) softmax_merge_lane(m[gi], l[gi], acc[gi], o);
  }
  if (sub == 0) {
#pragma unroll
    for (int gi = 0; gi < GMAX; ++gi) {
      if (sl == 0) sm_m[warp][gi] = m[gi], sm_l[warp][gi] = l[gi];
#pragma unroll
      for (int i = 0; i < 8; ++i) sm_a[warp][gi][e0 + i] = acc[gi][i];
    }
  }
  __syncthreads();
  for (int t = threadIdx.x; t < gc * d; t += blockDim.x) {
    const int gi = t / d, e = t % d;
    float mm = -INFINITY;
    for (int w = 0; w < W; ++w) mm = fmaxf(mm, sm_m[w][gi]);
    float ls = 0.f, as = 0.f;
    for (int w = 0; w < W; ++w) {
      const float s = sm_m[w][gi] == -INFINITY ? 0.f : exp2f(sm_m[w][gi] - mm);
      ls += sm_l[w][gi] * s, as += sm_a[w][gi][e] * s;
    }
    const size_t bh = static_cast<size_t>(b) * hq + h0 + gi;
    if (splits == 1) {
      out[bh * d + e] = from_f32<T>(bad || ls == 0.f ? NAN : as / ls);
    } else {
      part_o[(bh * splits + split) * d + e] = as;
      if (e == 0) part_ml[(bh * splits + split) * 2] = mm, part_ml[(bh * splits + split) * 2 + 1] = ls;
    }
  }
}

// One block per (row, query head), a thread per element of D: merges the splits' partial softmaxes.
template <typename T>
__global__ void combine_kernel(const float* __restrict__ part_o, const float* __restrict__ part_ml, const int* rows,
                               const int* lengths, T* __restrict__ out, int hq, int d, int r_count, int max_length,
                               int splits) {
  const int bh = blockIdx.x, b = bh / hq;
  const bool bad = bad_row(rows, lengths, b, r_count, max_length);
  const float* ml = part_ml + static_cast<size_t>(bh) * splits * 2;
  float mm = -INFINITY;
  for (int s = 0; s < splits; ++s) mm = fmaxf(mm, ml[2 * s]);
  for (int e = threadIdx.x; e < d; e += blockDim.x) {
    float ls = 0.f, as = 0.f;
    for (int s = 0; s < splits; ++s) {
      const float w = ml[2 * s] == -INFINITY ? 0.f : exp2f(ml[2 * s] - mm);
      ls += ml[2 * s + 1] * w, as += part_o[(static_cast<size_t>(bh) * splits + s) * d + e] * w;
    }
    out[static_cast<size_t>(bh) * d + e] = from_f32<T>(bad || ls == 0.f ? NAN : as / ls);
  }
}

template <typename T>
__global__ void cache_write_kernel(T* __restrict__ kc, T* __restrict__ vc, const T* __restrict__ k, const T* __restrict__ v,
                                   const int* rows, const int* positions, int hkv, int d, int r_count, int capacity) {
  const int b = blockIdx.y, h = blockIdx.x;
  const int row = rows[b], pos = positions[b];
  if (row < 0 || row >= r_count || pos < 0 || pos >= capacity) return;  // decode_attention reports the row as NaN
  const size_t dst = ((static_cast<size_t>(row) * hkv + h) * capacity + pos) * d, src = (static_cast<size_t>(b) * hkv + h) * d;
  for (int e = threadIdx.x; e < d; e += blockDim.x) kc[dst + e] = k[src + e], vc[dst + e] = v[src + e];
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// The shared memory of decode_kernel's merge buffers for W warps, and of the fused prologue's rows,
// in bytes.
template <int GMAX, int LPK> constexpr int merge_bytes(int w) { return w * GMAX * (2 + LPK * 8) * 4; }
template <int GMAX, int LPK> constexpr int kPrologueBytes = (GMAX + 2) * LPK * 8 * 4;
// The warps of the one-block path for short rows: 16 where the merge buffers fit a block's 48 KiB of
// static shared memory and a thread's 128 registers hold 4 heads' state (8 heads spill there), else 8
// where the buffers fit, else none (the split path).
template <int GMAX, int LPK>
constexpr int kShortWarps = GMAX <= 4 && merge_bytes<GMAX, LPK>(16) <= 48 * 1024 ? 16
                            : merge_bytes<GMAX, LPK>(8) <= 48 * 1024         ? 8
                                                                              : 0;
// The fused kernel of W warps fits the 48 KiB.
template <int GMAX, int LPK, int W>
constexpr bool kFusedFits = W > 0 && merge_bytes<GMAX, LPK>(W) + kPrologueBytes<GMAX, LPK> <= 48 * 1024;

// KCPP_ATTN_SHORT=0: short rows split over blocks as long ones are (for comparison).
bool short_off() {
  static const bool off = [] {
    const char* e = std::getenv("KCPP_ATTN_SHORT");
    return e && std::string(e) == "0";
  }();
  return off;
}

// The largest divisor of the group size g that fits a block's 8 heads: the query heads a block takes.
int heads_a_block(int g) {
  int gc = std::min(g, 8);
  while (g % gc != 0) --gc;
  return gc;
}

// out [B, Hq, D]: the attention of the call, q from `q`, or (pro != nullptr) made by the fused
// prologue.  The prologue needs one block a head group holding the whole group (gc == g) and the
// shared memory for its rows; false, with nothing launched, where the call does not allow it.
template <typename T, int LPK, int GMAX>
bool launch(const Tensor& out, const Tensor& q, const Tensor& kc, const Tensor& vc, const Tensor& rows, const Tensor& lengths,
            double scale, int64_t window, int64_t max_length, int gc, const QkPrologue<T>* pro) {
  const int b = static_cast<int>(out.size(0)), hq = static_cast<int>(out.size(1)), d = static_cast<int>(out.size(2));
  const int r_count = static_cast<int>(kc.size(0)), hkv = static_cast<int>(kc.size(1)), capacity = static_cast<int>(kc.size(2));
  const int blocks_per_split = b * (hq / gc);
  // Enough blocks for two waves over the SMs, and at least 32 keys a split at the longest length.
  const int64_t want = (2 * kcpp::kernel::cuda::sm_count(out.device().index) + blocks_per_split - 1) / blocks_per_split;
  const int splits = static_cast<int>(std::clamp<int64_t>(want, 1, std::max<int64_t>(1, max_length / 32)));
  const T* qp = pro != nullptr ? nullptr : static_cast<const T*>(q.data());
  const float scale_log2 = static_cast<float>(scale) * kLog2e;
  const int win = static_cast<int>(std::min<int64_t>(window, INT32_MAX));
  // One block a head group: no partials; a programmatic dependent of the kernel before
  // (ops/cuda/pdl.cuh; KCPP_PDL=0: an ordinary launch).
  auto one_block = [&]<int W, bool FUSED>() {
    launch_pdl("decode_attention", decode_kernel<T, LPK, GMAX, W, FUSED>, dim3(1, hq / gc, b), dim3(W * 32), 0, qp,
               static_cast<const T*>(kc.data()), static_cast<const T*>(vc.data()), static_cast<const int*>(rows.data()),
               static_cast<const int*>(lengths.data()), static_cast<T*>(out.data()), static_cast<float*>(nullptr),
               static_cast<float*>(nullptr), hq, hkv, gc, d, r_count, capacity, static_cast<int>(max_length), scale_log2, win, 1,
               pro != nullptr ? *pro : QkPrologue<T>{});
  };
  // Short rows that would be split (at most 16 keys a warp): one block of kShortWarps<GMAX, LPK> warps a
  // head group instead, merged in shared memory (no partials, no second kernel).
  constexpr int short_warps = kShortWarps<GMAX, LPK>;
  const bool short_rows = short_warps > 0 && splits > 1 && max_length <= 16 * short_warps && !short_off();
  if (pro != nullptr) {
    if (gc != hq / hkv) return false;
    if (short_rows) {
      if constexpr (kFusedFits<GMAX, LPK, short_warps>) {
        one_block.template operator()<short_warps, true>();
        return true;
      }
    } else if (splits == 1) {
      if constexpr (kFusedFits<GMAX, LPK, kWarps>) {
        one_block.template operator()<kWarps, true>();
        return true;
      }
    }
    return false;
  }
  if constexpr (short_warps > 0) {
    if (short_rows) {
      one_block.template operator()<short_warps, false>();
      return true;
    }
  }
  Tensor part_o, part_ml;
  if (splits > 1) {
    part_o = Tensor::empty({b, hq, splits, d}, DType::f32, out.device());
    part_ml = Tensor::empty({b, hq, splits, 2}, DType::f32, out.device());
  }
  const cudaStream_t stream = kcpp::cuda::current_stream();
  decode_kernel<T, LPK, GMAX, kWarps, false><<<dim3(splits, hq / gc, b), kWarps * 32, 0, stream>>>(
      qp, static_cast<const T*>(kc.data()), static_cast<const T*>(vc.data()), static_cast<const int*>(rows.data()),
      static_cast<const int*>(lengths.data()), static_cast<T*>(out.data()),
      splits > 1 ? static_cast<float*>(part_o.data()) : nullptr, splits > 1 ? static_cast<float*>(part_ml.data()) : nullptr,
      hq, hkv, gc, d, r_count, capacity, static_cast<int>(max_length), scale_log2, win, splits, QkPrologue<T>{});
  KCPP_CUDA_CHECK_LAUNCH("decode_attention");
  if (splits > 1) {
    combine_kernel<T><<<b * hq, std::min(d, 256), 0, stream>>>(
        static_cast<const float*>(part_o.data()), static_cast<const float*>(part_ml.data()),
        static_cast<const int*>(rows.data()), static_cast<const int*>(lengths.data()), static_cast<T*>(out.data()), hq, d,
        r_count, static_cast<int>(max_length), splits);
    KCPP_CUDA_CHECK_LAUNCH("decode_attention (combine)");
  }
  return true;
}

template <typename T, int LPK>
bool launch_lpk(const Tensor& out, const Tensor& q, const Tensor& kc, const Tensor& vc, const Tensor& rows,
                const Tensor& lengths, double scale, int64_t window, int64_t max_length, const QkPrologue<T>* pro) {
  const int gc = heads_a_block(static_cast<int>(out.size(1) / kc.size(1)));
  if (gc <= 4) return launch<T, LPK, 4>(out, q, kc, vc, rows, lengths, scale, window, max_length, gc, pro);
  return launch<T, LPK, 8>(out, q, kc, vc, rows, lengths, scale, window, max_length, gc, pro);
}

// By the head dim: LPK lanes a key.
template <typename T>
bool launch_d(const Tensor& out, const Tensor& q, const Tensor& kc, const Tensor& vc, const Tensor& rows,
              const Tensor& lengths, double scale, int64_t window, int64_t max_length, const QkPrologue<T>* pro) {
  const int64_t d = out.size(2);
  if (d <= 32) return launch_lpk<T, 4>(out, q, kc, vc, rows, lengths, scale, window, max_length, pro);
  if (d <= 64) return launch_lpk<T, 8>(out, q, kc, vc, rows, lengths, scale, window, max_length, pro);
  if (d <= 128) return launch_lpk<T, 16>(out, q, kc, vc, rows, lengths, scale, window, max_length, pro);
  return launch_lpk<T, 32>(out, q, kc, vc, rows, lengths, scale, window, max_length, pro);
}

}  // namespace

void decode_attention(const Tensor& out, const Tensor& q, const Tensor& kc, const Tensor& vc, const Tensor& rows,
                      const Tensor& lengths, double scale, int64_t window, int64_t max_length) {
  KCPP_CHECK(aligned16(kc.data()) && aligned16(vc.data()),
             "op decode_attention: the cache storage must start on a 16-byte boundary (a view of a row at an odd offset?)");
  KCPP_CHECK(q.size(0) <= 65535, "op decode_attention: at most 65535 rows a call on CUDA, got {}", q.size(0));
  kcpp::cuda::DeviceGuard guard(q.device().index);
  visit_cuda_float(q.dtype(), "decode_attention", [&]<typename T>(std::type_identity<T>) {
    launch_d<T>(out, q, kc, vc, rows, lengths, scale, window, max_length, nullptr);
  });
}

bool qk_norm_rope_attention(const Tensor& out, const Tensor& qkv, const QkNormRopeCache& opt, const Tensor& cos,
                            const Tensor& sin, const Tensor& kc, const Tensor& vc, const Tensor& rows, const Tensor& positions,
                            const Tensor& lengths, double scale, int64_t window, int64_t max_length) {
  if (!aligned16(kc.data()) || !aligned16(vc.data()) || !aligned16(qkv.data()) || qkv.size(0) > 65535) return false;
  kcpp::cuda::DeviceGuard guard(qkv.device().index);
  bool done = false;
  visit_cuda_float(qkv.dtype(), "qk_norm_rope_attention", [&]<typename T>(std::type_identity<T>) {
    QkPrologue<T> pro;
    pro.qkv = static_cast<const T*>(qkv.data());
    if (opt.q_norm.defined())
      pro.q_norm = static_cast<const T*>(opt.q_norm.data()), pro.k_norm = static_cast<const T*>(opt.k_norm.data());
    pro.cos = static_cast<const T*>(cos.data()), pro.sin = static_cast<const T*>(sin.data());
    pro.positions = static_cast<const int*>(positions.data());
    pro.settled = opt.settled;
    pro.k_cache = static_cast<T*>(kc.data()), pro.v_cache = static_cast<T*>(vc.data());
    pro.rd = static_cast<int>(cos.size(2));
    pro.eps = static_cast<float>(opt.norm.eps), pro.offset = static_cast<float>(opt.norm.offset);
    pro.gemma = opt.norm.casting == RMSNormCasting::Gemma, pro.interleaved = opt.layout == RopeLayout::Interleaved;
    pro.vec_norm = pro.q_norm == nullptr || (aligned16(pro.q_norm) && aligned16(pro.k_norm));  // D % 8 == 0 here
    pro.vec_rope = pro.rd % 8 == 0 && aligned16(pro.cos) && aligned16(pro.sin);
    done = launch_d<T>(out, Tensor(), kc, vc, rows, lengths, scale, window, max_length, &pro);
  });
  return done;
}

void cache_write(const Tensor& kc, const Tensor& vc, const Tensor& k, const Tensor& v, const Tensor& rows,
                 const Tensor& positions) {
  kcpp::cuda::DeviceGuard guard(k.device().index);
  const int b = static_cast<int>(k.size(0)), hkv = static_cast<int>(k.size(1)), d = static_cast<int>(k.size(2));
  KCPP_CHECK(b <= 65535, "op cache_write: at most 65535 rows a call on CUDA, got {}", b);
  visit_cuda_float(k.dtype(), "cache_write", [&]<typename T>(std::type_identity<T>) {
    cache_write_kernel<T><<<dim3(hkv, b), std::min(d, 256), 0, kcpp::cuda::current_stream()>>>(
        static_cast<T*>(kc.data()), static_cast<T*>(vc.data()), static_cast<const T*>(k.data()),
        static_cast<const T*>(v.data()), static_cast<const int*>(rows.data()), static_cast<const int*>(positions.data()),
        hkv, d, static_cast<int>(kc.size(0)), static_cast<int>(kc.size(2)));
  });
  KCPP_CUDA_CHECK_LAUNCH("cache_write");
}

}  // namespace kcpp::ops::cuda
