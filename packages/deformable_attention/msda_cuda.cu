// Multi-scale deformable attention on CUDA (maths and layout in msda.h).  Two sets of kernels, both a warp
// per item (b, q, m), i.e. per query and head with its L * P samples:
//
// Grouped kernels (the default).  Items in (b, m, q) order (the grid is (ceil(Q / 8), M, B)), so that the
// warps in flight at any time read one (batch, head) slice of value (S * C elements, e.g. 2.8 MB in f32
// at Deformable DETR's encoder dims), which stays in L2 while every query of that head samples it (in
// (b, q, m) order the slice is a whole batch, M times larger).  A lane holds V consecutive channels (V =
// 16 bytes / element size, or 1 when C is not a multiple of that or a pointer is not 16-byte aligned);
// the C / V lanes of a head's channels form a group of GP lanes (GP the power of two >= C / V; lanes
// t >= C / V of a group idle) and the warp's 32 / GP groups take different samples of the item, U = 2
// samples per group at a time, so a corner read is one 16-byte load per lane (GP * 16 contiguous bytes a
// group) and the 4 U corner loads of a step are all issued before their first use.  The sample set-up
// (level, bilinear corners and weights) is done once per sample: lane k sets up sample k (of each chunk
// of 32), and a group takes it with 5 shuffles (the corner-(i0, j0) row, W << 4 | the four in-map bits,
// fx, fy, a).  A step whose corners all lie in the map (a vote over the warp) reads and adds them
// unmasked; otherwise the corners outside read as zero and add nothing.
//   forward:  each lane sums a w_corner v_corner over its channels and samples; the groups' sums are
//             added across the warp by xor shuffles and the first group stores out.
//   backward: per sample and in-map corner each lane adds a w_corner g_c to its V channels of dvalue
//             (one red.global.add.v4.f32 per 4 channels on sm_90, f32 atomics elsewhere; into dvalue when
//             it is f32, else into an f32 workspace that a last pass rounds into dvalue), and forms its
//             channels' parts of sum_c g_c sample_c and of the two location slopes (linear in the four
//             corner sums d = sum_c g_c v_corner,c); those three are added over the group by xor
//             shuffles and handed back to the lane that set the sample up, which stores dattention_weights
//             and dsampling_locations (a W, a H times the slopes) for its sample, coalesced.
//   The grouped kernels need C <= 32 V (f32: 128, bf16 / f16: 256 with vectors), S < 2^27, Q < 2^31,
//   B and M <= 65535 (32-bit rows, the grid); msda_grouped_unsupported says which failed.
//
// Lane-per-channel kernels (MsdaCudaKernels::Legacy or KCPP_MSDA_LEGACY=1; also any shape the grouped
// ones do not take).  Items in (b, q, m) order; lane c takes channels c, c + 32, ... (up to kMaxChunks *
// 32 channels in registers, more in passes), and every lane computes each sample's corners itself.
//   forward:  each lane sums a w_corner v_corner over the samples for its channels.
//   backward: per sample each lane adds a g_c w to its channels of the four corners of dvalue with f32
//             atomicAdd (into the f32 accumulator as above), and the four sums_c g_c v_corner,c are reduced
//             over the warp for dattention_weights and dsampling_locations.
//
// The atomics' order varies between runs: dvalue is not bitwise reproducible (as flash_attn's dq).
// The index tensors are read on the device; a level with H or W < 1 or outside [0, S) samples zeros.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "kcpp/kernel/cuda.cuh"
#include "kcpp/kernel/error.h"
#include "msda.h"

namespace kcpp::msda {
namespace {

namespace kc = kernel::cuda;

constexpr int kThreads = 256, kWarps = kThreads / 32;
constexpr int kMaxChunks = 4;  // lane-per-channel kernels: channels a head held in registers, up to 128 in one pass
constexpr unsigned kFull = 0xffffffffu;
constexpr int kMaxLevels = 3072;  // grouped kernels: the level table, 16 bytes a level, in 48 KB of shared memory

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

// ---------------------------------------------------------------------------------------------------
// Grouped kernels.

// What the grouped kernels index with 32-bit integers, and the lane layout (grouped_of).  The grid is
// (ceil(Q / 8), M, B) blocks of 8 warps, a warp per query: blocks start in x-then-y-then-z order, i.e. in
// (b, m, q) order of their items.
struct Grouped {
  MsdaParams p;
  float* dvalue;  // backward: the f32 accumulator (dvalue itself, or the workspace)
  int queries, heads, seq, mc, lp, levels, channels;
  float inv_points;  // 1 / P, rounded
  int group_log;  // log2 GP: the lanes of a group
  int width;      // C / V: the lanes of a group that hold channels
};

// Lane k's sample as the kernels use it.  wf == 0 marks a sample that is 0 with zero gradients (outside
// the map, non-finite location, a level that does not fit in value, or no sample at all).
struct Sample {
  int r00 = 0;      // row of value of corner (i0, j0); not a row of the map when i0 or j0 is -1
  int wf = 0;       // W_l << 4 | bit c set when corner c (00, 01, 10, 11) lies in the map
  float fx = 0, fy = 0, a = 0;
};

// The levels as the grouped kernels keep them in shared memory: (H, W, start, 0), or all 0 for a level
// that level_at rejects (it then samples zeros).  W <= S < 2^27 (grouped_reason), so they fit in an int.
__device__ __forceinline__ int4 level_entry(const MsdaParams& p, int l) {
  const DevLevel lv = level_at(p, l);
  return lv.ok ? make_int4(static_cast<int>(lv.h), static_cast<int>(lv.w), static_cast<int>(lv.start), 0) : make_int4(0, 0, 0, 0);
}

// Fills the block's level table (every thread must call it, before any returns).
__device__ __forceinline__ void load_levels(const MsdaParams& p, int levels, int4* table) {
  for (int l = static_cast<int>(threadIdx.x); l < levels; l += static_cast<int>(blockDim.x)) table[l] = level_entry(p, l);
  __syncthreads();
}

// Sample k of the item (level k / P), from the level table.  h, w: the level's size (for the location
// gradients).  The same f32 operations as bilinear_at (msda.h), with 32-bit integers: |floor(x)|, |floor(y)|
// <= S < 2^27, so W << 4 and the rows fit in an int.
template <typename T>
__device__ __forceinline__ Sample sample_at(const int4* table, const T* loc, const T* attn, int k, float inv_points,
                                            float& h, float& w) {
  Sample s;
  // The level k / P: (k + 1/2) / P is at least 1 / (2P) from an integer, and its f32 product is within
  // (k + 1/2) 2^-23 / P of it, less than 1 / (2P) for k < 2^22 (grouped_reason keeps L P < 2^20).
  const int4 lv = table[static_cast<int>((static_cast<float>(k) + 0.5f) * inv_points)];
  if (lv.y == 0) return s;  // a level that does not fit in value
  h = static_cast<float>(lv.x), w = static_cast<float>(lv.y);
  const float x = kc::to_f32(loc[2 * k]) * w - 0.5f, y = kc::to_f32(loc[2 * k + 1]) * h - 0.5f;
  if (!(x >= -1.0f && x < w && y >= -1.0f && y < h)) return s;  // also for NaN
  const float x0 = floorf(x), y0 = floorf(y);
  const int j0 = static_cast<int>(x0), i0 = static_cast<int>(y0);
  const bool in_j0 = j0 >= 0, in_j1 = j0 + 1 < lv.y, in_i0 = i0 >= 0, in_i1 = i0 + 1 < lv.x;
  s.r00 = lv.z + i0 * lv.y + j0;
  s.wf = lv.y << 4 | (in_i0 && in_j0 ? 1 : 0) | (in_i0 && in_j1 ? 2 : 0) | (in_i1 && in_j0 ? 4 : 0) | (in_i1 && in_j1 ? 8 : 0);
  s.fx = x - x0, s.fy = y - y0, s.a = kc::to_f32(attn[k]);
  return s;
}

// Sample j of the chunk (set up by lane j), for this lane's group; none (wf = 0) when j >= n.
__device__ __forceinline__ Sample take(const Sample& s, int j, int n) {
  const int src = j & 31;
  Sample t;
  t.r00 = __shfl_sync(kFull, s.r00, src);
  t.wf = __shfl_sync(kFull, s.wf, src);
  t.fx = __shfl_sync(kFull, s.fx, src);
  t.fy = __shfl_sync(kFull, s.fy, src);
  t.a = __shfl_sync(kFull, s.a, src);
  if (j >= n) t.wf = 0;
  return t;
}

__device__ __forceinline__ bool in_map(const Sample& s, int c) { return (s.wf >> c & 1) != 0; }

// V elements of T as raw bits: one load of 2, 4 or 16 bytes.
template <int Bytes> struct RawOf;
template <> struct RawOf<2> { using type = unsigned short; };
template <> struct RawOf<4> { using type = unsigned int; };
template <> struct RawOf<16> { using type = uint4; };
template <typename T, int V> using Raw = typename RawOf<V * static_cast<int>(sizeof(T))>::type;

template <typename T, int V> __device__ __forceinline__ Raw<T, V> load_raw(const T* ptr) {
  return __ldg(reinterpret_cast<const Raw<T, V>*>(ptr));
}

__device__ __forceinline__ void half_pair(uint32_t w, float& lo, float& hi) {
  __half2 pair;
  memcpy(&pair, &w, sizeof(pair));
  const float2 f = __half22float2(pair);
  lo = f.x, hi = f.y;
}

// The raw bits widened to f32 (element i of the vector is at the lower address, the lower half of a word).
template <typename T, int V> __device__ __forceinline__ void widen_raw(const Raw<T, V>& r, float (&x)[V]) {
  if constexpr (std::is_same_v<T, float>) {
    if constexpr (V == 1) {
      x[0] = __uint_as_float(r);
    } else {
      x[0] = __uint_as_float(r.x), x[1] = __uint_as_float(r.y), x[2] = __uint_as_float(r.z), x[3] = __uint_as_float(r.w);
    }
  } else if constexpr (V == 1) {
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      x[0] = __uint_as_float(static_cast<uint32_t>(r) << 16);
    } else {
      x[0] = __half2float(__ushort_as_half(r));
    }
  } else {
    const uint32_t w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if constexpr (std::is_same_v<T, __nv_bfloat16>) {
        x[2 * i] = __uint_as_float(w[i] << 16), x[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
      } else {
        half_pair(w[i], x[2 * i], x[2 * i + 1]);
      }
    }
  }
}

// dst[i] += s g[i] for the V channels: 16-byte vector reductions on sm_90 (V a multiple of 4; dst then
// 16-byte aligned), f32 atomics elsewhere.
template <int V> __device__ __forceinline__ void add_to(float* dst, float s, const float (&g)[V]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr bool kVector = V % 4 == 0;
#else
  constexpr bool kVector = false;
#endif
  if constexpr (kVector) {
#pragma unroll
    for (int i = 0; i < V; i += 4)
      atomicAdd(reinterpret_cast<float4*>(dst + i), make_float4(s * g[i], s * g[i + 1], s * g[i + 2], s * g[i + 3]));
  } else {
#pragma unroll
    for (int i = 0; i < V; ++i) atomicAdd(dst + i, s * g[i]);
  }
}

__device__ __forceinline__ int64_t wide(int a, int b) { return static_cast<int64_t>(a) * static_cast<int64_t>(b); }

// The warp's item and its lane roles.
struct Lanes {
  int64_t item;   // (b * Q + q) * M + m: the row of loc, attn, out and dout
  int64_t vrow0;  // (b * S * M + m) * C: element of value (and dvalue) at row 0, channel 0 of the head
  int t, grp, ng;  // lane in its group, the group, groups in the warp
  bool holds;      // the lane holds channels (t < C / V)
};

__device__ __forceinline__ Lanes lanes_of(const Grouped& g, int q, int lane) {
  Lanes r;
  const int m = static_cast<int>(blockIdx.y), b = static_cast<int>(blockIdx.z);
  r.item = (wide(b, g.queries) + q) * g.heads + m;
  r.vrow0 = (wide(b, g.seq) * g.heads + m) * g.channels;
  r.t = lane & ((1 << g.group_log) - 1), r.grp = lane >> g.group_log, r.ng = 32 >> g.group_log;
  r.holds = r.t < g.width;
  return r;
}

// Whether every lane holds channels and every corner of the U samples the warp takes next lies in the
// map (so no corner needs masking); the same answer in every lane.
template <int U> __device__ __forceinline__ bool all_in_map(bool holds, const Sample (&tk)[U]) {
  bool in = holds;
#pragma unroll
  for (int u = 0; u < U; ++u) in = in && (tk[u].wf & 15) == 15;
  return __all_sync(kFull, in);
}

// This lane's channels of the corners of U samples, all loads issued before any use: with kAllIn every
// corner is read; else only the in-map corners of lanes that hold channels, the others are zero bits.
// p[u][c]: the address of corner c of sample u (value or dvalue); valid for in-map corners only.
template <typename T, int U>
__device__ __forceinline__ void corner_addresses(const T* base, int mc, const Sample (&tk)[U], const T* (&p)[U][4]) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    p[u][0] = base + wide(tk[u].r00, mc);
    p[u][1] = p[u][0] + mc;
    p[u][2] = p[u][0] + wide(tk[u].wf >> 4, mc);
    p[u][3] = p[u][2] + mc;
  }
}

template <typename T, int V, int U, bool kAllIn>
__device__ __forceinline__ void load_corners(const T* (&p)[U][4], bool holds, const Sample (&tk)[U], Raw<T, V> (&v)[U][4]) {
#pragma unroll
  for (int u = 0; u < U; ++u)
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      if constexpr (kAllIn) {
        v[u][c] = load_raw<T, V>(p[u][c]);
      } else {
        v[u][c] = Raw<T, V>{};
        if (holds && in_map(tk[u], c)) v[u][c] = load_raw<T, V>(p[u][c]);
      }
    }
}

// acc += a w_corner v_corner over U samples' corners (each sample's sum first, then into acc).
template <typename T, int V, int U, bool kAllIn>
__device__ __forceinline__ void forward_step(const T* vb, int mc, bool holds, const Sample (&tk)[U], float (&acc)[V]) {
  const T* p[U][4];
  corner_addresses<T, U>(vb, mc, tk, p);
  Raw<T, V> v[U][4];
  load_corners<T, V, U, kAllIn>(p, holds, tk, v);
  float sum[U][V];  // per sample: the chains of adds stay short and independent of the loads' order
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const float ay = tk[u].a * (1 - tk[u].fy), ayf = tk[u].a * tk[u].fy;
    const float wc[4] = {ay * (1 - tk[u].fx), ay * tk[u].fx, ayf * (1 - tk[u].fx), ayf * tk[u].fx};
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      // A corner outside the map adds nothing (its bits are zero; the weight too, for a = inf).
      const float wt = kAllIn || in_map(tk[u], c) ? wc[c] : 0.0f;
      float x[V];
      widen_raw<T, V>(v[u][c], x);
#pragma unroll
      for (int e = 0; e < V; ++e) sum[u][e] = c == 0 ? wt * x[e] : fmaf(wt, x[e], sum[u][e]);
    }
  }
#pragma unroll
  for (int u = 0; u < U; ++u)
#pragma unroll
    for (int e = 0; e < V; ++e) acc[e] += sum[u][e];
}

// dvalue[corner] += a w_corner g over U samples' corners, and this lane's channels' parts of
// dattention_weights = sum_c g_c sample_c and of the x and y slopes (dsampling_locations without their
// factors a W, a H): part[u].
template <typename T, int V, int U, bool kAllIn>
__device__ __forceinline__ void backward_step(const T* vb, float* dvb, int mc, bool holds, const Sample (&tk)[U],
                                              const float (&go)[V], float (&part)[U][3]) {
  const T* p[U][4];
  corner_addresses<T, U>(vb, mc, tk, p);
  Raw<T, V> v[U][4];
  load_corners<T, V, U, kAllIn>(p, holds, tk, v);
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const float fx = tk[u].fx, fy = tk[u].fy;
    const float wt[4] = {(1 - fy) * (1 - fx), (1 - fy) * fx, fy * (1 - fx), fy * fx};
    float* dv00 = dvb + wide(tk[u].r00, mc);
    float* dv10 = dv00 + wide(tk[u].wf >> 4, mc);
    float* dq[4] = {dv00, dv00 + mc, dv10, dv10 + mc};
    float d[4];  // sum over this lane's channels of g_c v_corner,c (0 outside the map)
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      float x[V];
      widen_raw<T, V>(v[u][c], x);
      d[c] = 0.0f;
#pragma unroll
      for (int e = 0; e < V; ++e) d[c] = fmaf(go[e], x[e], d[c]);
      if (kAllIn || (holds && in_map(tk[u], c))) add_to<V>(dq[c], tk[u].a * wt[c], go);
    }
    part[u][0] = wt[0] * d[0] + wt[1] * d[1] + wt[2] * d[2] + wt[3] * d[3];
    part[u][1] = (1 - fy) * (d[1] - d[0]) + fy * (d[3] - d[2]);
    part[u][2] = (1 - fx) * (d[2] - d[0]) + fx * (d[3] - d[1]);
  }
}

// Blocks a multiprocessor should hold (__launch_bounds__' second argument, so at most 64 / 80 / 128
// registers a thread).  With these values nvcc 13.0 issues all 4 U corner loads of a step before their
// first use (check in the SASS: 8 LDG.E.128 in a row in each step); with others it interleaves loads and
// adds (fewer loads in flight) or spills in the inner loop.
template <typename T, int V> constexpr int forward_min_blocks() { return sizeof(T) == 4 || V == 1 ? 4 : 3; }
template <int V> constexpr int backward_min_blocks() { return V == 1 ? 2 : 3; }

template <typename T, int V, int U>
__global__ void __launch_bounds__(kThreads, forward_min_blocks<T, V>()) grouped_forward_kernel(const Grouped g) {
  const int lane = threadIdx.x & 31, q = static_cast<int>(blockIdx.x) * kWarps + static_cast<int>(threadIdx.x / 32);
  extern __shared__ int4 levels[];
  load_levels(g.p, g.levels, levels);
  if (q >= g.queries) return;  // the whole warp
  const Lanes ln = lanes_of(g, q, lane);
  const T* loc = static_cast<const T*>(g.p.loc) + ln.item * g.lp * 2;
  const T* attn = static_cast<const T*>(g.p.attn) + ln.item * g.lp;
  const T* vb = static_cast<const T*>(g.p.value) + ln.vrow0 + ln.t * V;
  float acc[V];
#pragma unroll
  for (int e = 0; e < V; ++e) acc[e] = 0.0f;
  for (int k0 = 0; k0 < g.lp; k0 += 32) {
    const int n = min(32, g.lp - k0);
    float h = 0, w = 0;  // not used here
    const Sample s = lane < n ? sample_at(levels, loc, attn, k0 + lane, g.inv_points, h, w) : Sample{};
    for (int j0 = 0; j0 < n; j0 += U * ln.ng) {
      Sample tk[U];
#pragma unroll
      for (int u = 0; u < U; ++u) tk[u] = take(s, j0 + u * ln.ng + ln.grp, n);
      if (all_in_map<U>(ln.holds, tk))
        forward_step<T, V, U, true>(vb, g.mc, ln.holds, tk, acc);
      else
        forward_step<T, V, U, false>(vb, g.mc, ln.holds, tk, acc);
    }
  }
  for (int o = 1 << g.group_log; o < 32; o <<= 1)
#pragma unroll
    for (int e = 0; e < V; ++e) acc[e] += __shfl_xor_sync(kFull, acc[e], o);
  if (ln.grp == 0 && ln.holds) kc::store_f32<T, V>(static_cast<T*>(g.p.out) + ln.item * g.channels + ln.t * V, acc);
}

template <typename T, int V, int U>
__global__ void __launch_bounds__(kThreads, backward_min_blocks<V>()) grouped_backward_kernel(const Grouped g) {
  const int lane = threadIdx.x & 31, q = static_cast<int>(blockIdx.x) * kWarps + static_cast<int>(threadIdx.x / 32);
  extern __shared__ int4 levels[];
  load_levels(g.p, g.levels, levels);
  if (q >= g.queries) return;  // the whole warp
  const Lanes ln = lanes_of(g, q, lane);
  const T* loc = static_cast<const T*>(g.p.loc) + ln.item * g.lp * 2;
  const T* attn = static_cast<const T*>(g.p.attn) + ln.item * g.lp;
  T* dloc = static_cast<T*>(g.p.dloc) + ln.item * g.lp * 2;
  T* dattn = static_cast<T*>(g.p.dattn) + ln.item * g.lp;
  const T* vb = static_cast<const T*>(g.p.value) + ln.vrow0 + ln.t * V;
  float* dvb = g.dvalue + ln.vrow0 + ln.t * V;
  float go[V];
#pragma unroll
  for (int e = 0; e < V; ++e) go[e] = 0.0f;
  if (ln.holds) kc::load_f32<T, V>(static_cast<const T*>(g.p.dout) + ln.item * g.channels + ln.t * V, go);
  for (int k0 = 0; k0 < g.lp; k0 += 32) {
    const int n = min(32, g.lp - k0);
    float h = 0, w = 0;
    const Sample s = lane < n ? sample_at(levels, loc, attn, k0 + lane, g.inv_points, h, w) : Sample{};
    // For the lane's own sample: dattention_weights and the x and y slopes (part summed over the group).
    float own[3] = {0.0f, 0.0f, 0.0f};
    for (int j0 = 0; j0 < n; j0 += U * ln.ng) {
      Sample tk[U];
#pragma unroll
      for (int u = 0; u < U; ++u) tk[u] = take(s, j0 + u * ln.ng + ln.grp, n);
      float part[U][3];
      if (all_in_map<U>(ln.holds, tk))
        backward_step<T, V, U, true>(vb, dvb, g.mc, ln.holds, tk, go, part);
      else
        backward_step<T, V, U, false>(vb, dvb, g.mc, ln.holds, tk, go, part);
      for (int o = 1; o < (1 << g.group_log); o <<= 1)
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
          for (int i = 0; i < 3; ++i) part[u][i] += __shfl_xor_sync(kFull, part[u][i], o);
      // Group r of slot u took sample j0 + u * ng + r: this lane's sample when that is `lane`.
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int r = lane - j0 - u * ln.ng;
        const int src = (r & (ln.ng - 1)) << g.group_log;
#pragma unroll
        for (int i = 0; i < 3; ++i) {
          const float x = __shfl_sync(kFull, part[u][i], src);
          if (r >= 0 && r < ln.ng) own[i] = x;
        }
      }
    }
    if (lane < n) {
      const int k = k0 + lane;
      const bool live = s.wf != 0;
      dattn[k] = kc::from_f32<T>(live ? own[0] : 0.0f);
      dloc[2 * k] = kc::from_f32<T>(live ? s.a * w * own[1] : 0.0f);
      dloc[2 * k + 1] = kc::from_f32<T>(live ? s.a * h * own[2] : 0.0f);
    }
  }
}

// ---------------------------------------------------------------------------------------------------
// Lane-per-channel kernels.

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
__global__ void __launch_bounds__(kThreads) legacy_forward_kernel(const MsdaParams p) {
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
__global__ void __launch_bounds__(kThreads) legacy_backward_kernel(const MsdaParams p, float* dvalue) {
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

// ---------------------------------------------------------------------------------------------------
// Host side.

// Lane-per-channel kernels: the channel chunks in registers, the fewest that hold C (C > 128 takes
// several passes of 128).
template <typename F>
const char* with_chunks(int64_t channels, F&& f) {
  if (channels <= 32) return f.template operator()<1>();
  if (channels <= 64) return f.template operator()<2>();
  return f.template operator()<kMaxChunks>();
}

unsigned warp_blocks(int64_t items) { return static_cast<unsigned>((items + kWarps - 1) / kWarps); }

// Samples a group of the grouped kernels takes at a time (4 U corner loads in flight per lane).
constexpr int kUnroll = 2;

float* accumulator(const MsdaParams& p) { return p.dtype == kernel::DType::f32 ? static_cast<float*>(p.dvalue) : p.workspace; }

// The grouped kernels' vector width for p (see msda_grouped_vector), ignoring their other limits.
int vector_of(const MsdaParams& p, bool backward) {
  const int full = p.dtype == kernel::DType::f32 ? 4 : 8;
  const bool aligned = kc::aligned16(p.value) &&
                       (backward ? kc::aligned16(p.dout) && kc::aligned16(accumulator(p)) : kc::aligned16(p.out));
  return p.channels % full == 0 && aligned ? full : 1;
}

const char* grouped_reason(const MsdaParams& p, bool backward) {
  const int v = vector_of(p, backward);
  if (p.channels > 32 * v)
    return v > 1 ? "more channels a head than 32 lanes of 16-byte vectors hold"
                 : "more than 32 channels a head without 16-byte vectors (channels not a multiple of 16 bytes, or a "
                   "pointer not 16-byte aligned)";
  if (p.seq >= (int64_t{1} << 27)) return "value has 2^27 rows or more";
  if (p.heads * p.channels > INT32_MAX) return "heads * channels is 2^31 or more";
  if (p.queries > INT32_MAX - kWarps) return "2^31 queries or more";
  if (p.batch > 65535 || p.heads > 65535) return "batch or heads above 65535 (the grid's y and z)";
  if (p.levels * p.points >= (int64_t{1} << 20)) return "levels * points is 2^20 or more";
  if (p.levels > kMaxLevels) return "more than 3072 levels (the shared-memory level table)";
  return nullptr;
}

Grouped grouped_of(const MsdaParams& p, float* dvalue, int v) {
  Grouped g;
  g.p = p, g.dvalue = dvalue;
  g.queries = static_cast<int>(p.queries), g.heads = static_cast<int>(p.heads), g.seq = static_cast<int>(p.seq);
  g.mc = static_cast<int>(p.heads * p.channels);
  g.lp = static_cast<int>(p.levels * p.points), g.levels = static_cast<int>(p.levels);
  g.inv_points = 1.0f / static_cast<float>(p.points);
  g.channels = static_cast<int>(p.channels);
  g.width = static_cast<int>(p.channels / v);
  g.group_log = 0;
  while ((1 << g.group_log) < g.width) ++g.group_log;
  return g;
}

size_t level_bytes(const MsdaParams& p) { return static_cast<size_t>(p.levels) * sizeof(int4); }

dim3 grouped_grid(const MsdaParams& p) {
  return dim3(static_cast<unsigned>((p.queries + kWarps - 1) / kWarps), static_cast<unsigned>(p.heads), static_cast<unsigned>(p.batch));
}

// Whether this call takes the grouped kernels; *error is set when it cannot as asked.
bool use_grouped(const MsdaParams& p, bool backward, MsdaCudaKernels k, const char** error) {
  *error = nullptr;
  if (k == MsdaCudaKernels::Legacy) return false;
  const char* why = grouped_reason(p, backward);
  if (k == MsdaCudaKernels::Grouped) {
    if (why)
      *error = kernel::errorf("multi_scale_deformable_attention %s: the grouped kernels do not take this call: %s",
                              backward ? "backward" : "forward", why);
    return true;
  }
  const char* env = std::getenv("KCPP_MSDA_LEGACY");
  if (env && std::strcmp(env, "1") == 0) return false;
  return why == nullptr;
}

}  // namespace

const char* msda_grouped_unsupported(const MsdaParams& p, bool backward) { return grouped_reason(p, backward); }

int msda_grouped_vector(const MsdaParams& p, bool backward) { return grouped_reason(p, backward) ? 0 : vector_of(p, backward); }

const char* msda_forward_cuda(const MsdaParams& p, cudaStream_t stream, MsdaCudaKernels kernels) {
  if (const char* e = msda_check(p, false)) return e;
  const int64_t items = p.batch * p.queries * p.heads;
  if (items == 0 || p.channels == 0) return nullptr;
  const char* error;
  const bool grouped = use_grouped(p, false, kernels, &error);
  if (error) return error;
  return kc::with_float_dtype(p.dtype, "multi_scale_deformable_attention", [&]<typename T>(T*) -> const char* {
    if (grouped) {
      const int v = vector_of(p, false);
      const Grouped g = grouped_of(p, nullptr, v);
      if (v > 1)
        grouped_forward_kernel<T, 16 / sizeof(T), kUnroll><<<grouped_grid(p), kThreads, level_bytes(p), stream>>>(g);
      else
        grouped_forward_kernel<T, 1, kUnroll><<<grouped_grid(p), kThreads, level_bytes(p), stream>>>(g);
      return kc::launch_error("multi_scale_deformable_attention forward");
    }
    return with_chunks(p.channels, [&]<int CH>() -> const char* {
      legacy_forward_kernel<T, CH><<<warp_blocks(items), kThreads, 0, stream>>>(p);
      return kc::launch_error("multi_scale_deformable_attention forward");
    });
  });
}

const char* msda_backward_cuda(const MsdaParams& p, cudaStream_t stream, MsdaCudaKernels kernels) {
  if (const char* e = msda_check(p, true)) return e;
  const int64_t nv = p.batch * p.seq * p.heads * p.channels, items = p.batch * p.queries * p.heads;
  const bool f32 = p.dtype == kernel::DType::f32;
  KCPP_KERNEL_REQUIRE(f32 || nv == 0 || p.workspace,
                      "multi_scale_deformable_attention backward: a bf16 / f16 'dvalue' needs %zu bytes of f32 workspace",
                      msda_workspace_bytes(p));
  const char* error;
  const bool grouped = use_grouped(p, true, kernels, &error);
  if (error) return error;
  float* dv = accumulator(p);
  if (nv > 0 && cudaMemsetAsync(dv, 0, static_cast<size_t>(nv) * sizeof(float), stream) != cudaSuccess)
    return kc::launch_error("multi_scale_deformable_attention backward (zeroing dvalue)");
  return kc::with_float_dtype(p.dtype, "multi_scale_deformable_attention", [&]<typename T>(T*) -> const char* {
    if (items > 0 && p.levels * p.points > 0) {
      if (grouped) {
        const int v = vector_of(p, true);
        const Grouped g = grouped_of(p, dv, v);
        if (v > 1)
          grouped_backward_kernel<T, 16 / sizeof(T), kUnroll><<<grouped_grid(p), kThreads, level_bytes(p), stream>>>(g);
        else
          grouped_backward_kernel<T, 1, kUnroll><<<grouped_grid(p), kThreads, level_bytes(p), stream>>>(g);
      } else {
        with_chunks(p.channels, [&]<int CH>() -> const char* {
          legacy_backward_kernel<T, CH><<<warp_blocks(items), kThreads, 0, stream>>>(p, dv);
          return nullptr;
        });
      }
    }
    if (!f32 && nv > 0)
      round_kernel<T><<<static_cast<unsigned>((nv + 255) / 256), 256, 0, stream>>>(dv, static_cast<T*>(p.dvalue), nv);
    return kc::launch_error("multi_scale_deformable_attention backward");
  });
}

}  // namespace kcpp::msda
