// The persistent decode step (ops/nn/decode_persistent.h): one cooperative kernel, one block an SM,
// runs the layers of a decode step.
//
// A block is seven consumer warps and one producer warp.  The producer's first lane walks the
// block's share of every projection of every layer in the order the consumers use them (qkv, o,
// gate/up, down; layer after layer): rows [n b / G, n (b + 1) / G) of the projection's n, in groups
// of seven rows, each group in pieces of at most kPiece elements of K.  A piece of a group is one
// stage of a ring of p.stages (up to kMaxStages) in shared memory, filled by one bulk copy a row
// (one for a group of whole rows); `full[s]` completes when its bytes have landed, `empty[s]` when
// the seven consumer warps have read it.  Consumer warp w takes row w of each group: f32 sums over
// the pieces in order, then over its lanes.
//
// The consumers run the phases of a layer between grid-wide barriers (an arrival counter in global
// memory that each block's first thread raises and then waits on): norm + qkv, attention | merge +
// o | norm + gate/up (a block's gate and up rows are pairs, the gated activation their epilogue) |
// down.  Between qkv and attention there is no barrier: each block adds the number of q / k / v rows
// it made for each kv head to that head's count (qkv_ready), and an attention item waits for its
// head's count only.  Values another block wrote during the launch are read through L2 (ld.global.cg), never the
// non-coherent L1 path.  The producer never waits on a barrier, only on the ring, so the next
// weights stream in while the consumers wait.
//
// The attention of a (row, kv head) is split over its keys, kKeysPerSplit or more a split and at
// most smax splits, so that the items of a step fill the grid.  A block with item (row, kv head,
// split) makes the item's g query heads and the step's key and value (norm, RoPE, rounding as
// ops::qk_norm_rope_cache; split 0 writes them to the caches, and the split that holds the step's
// position takes them from shared memory), then keeps per lane an online softmax in base 2 for each
// query head over its keys: a key's D elements over D / 8 lanes, 8 each.  The lanes, then the
// warps, merge their (max, sum, weighted values) in a fixed order and the split's partial result
// goes to global memory; the o projection's blocks merge the splits as they build their input row.
// Every order of summation is fixed, so a step's result does not depend on timing.
#include <cuda/ptx>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <tuple>
#include <type_traits>
#include <vector>

#include "kcpp/kernel/bulk.cuh"
#include "ops/cuda/common.cuh"
#include "ops/cuda/launch.h"
#include "ops/math.h"

namespace kcpp::ops::cuda {
namespace {

namespace kc = kcpp::kernel::cuda;
using kc::from_f32;
using kc::load_f32;
using kc::round_to;
using kc::store_f32;
using kc::to_f32;
using kc::warp_sum;

// Seven consumer warps and the producer: 256 threads, so that a thread may hold up to 255 registers
// (the attention keeps about 200 live; a block of nine warps is allocated registers as twelve).
constexpr int kConsumerWarps = 7;
constexpr int kConsumers = 32 * kConsumerWarps;
constexpr int kThreads = kConsumers + 32;  // and the producer warp
constexpr int kRowsPerGroup = kConsumerWarps;
constexpr int kPiece = 1024;                                // elements of a row a stage holds
constexpr int kStageElems = kRowsPerGroup * kPiece;         // 14 KiB in 16-bit dtypes
constexpr int kMaxStages = 16;  // as many as shared memory holds beside the rest, 4 at least
constexpr int kMaxLayers = 32;                              // a launch's; more go in several launches
constexpr int kTraceSlots = 9;                              // a phase's in the trace (Tracer)

template <typename T> struct LayerPtrs {
  const T *input_norm, *post_norm, *wqkv, *q_norm, *k_norm, *wo, *w_gate_up, *w_down;
  T *k_cache, *v_cache;
  float scale_log2;  // the attention's scale times log2(e)
  int window;
};

template <typename T> struct Params {
  LayerPtrs<T> layer[kMaxLayers];
  int layers;
  const T* x_in;       // [M, H] the first layer's x
  const T* delta_in;   // [M, H] or null
  T* x_mid;            // [M, H] s of the input norm's add (x of the layer's second half)
  T* x_out;            // [M, H] s of the post norm's add
  T* delta;            // [M, H] the o and down projections' outputs
  T* qkv;              // [M, (Hq + 2 Hkv) D]
  T* gu;               // [M, I] the gated activation of the gate / up projection
  float* part_o;       // [M, Hq, smax, D] the splits' unnormalized outputs
  float* part_ml;      // [M, Hq, smax, 2] their maxima and sums (base 2)
  const T* cos;        // [M, rd]
  const T* sin;
  const int* rows;     // [M]
  const int* positions;
  const int* lengths;
  unsigned* arrived;   // the grid barrier's count, zero at launch
  unsigned* qkv_ready; // [Hkv] rows of each kv head's q / k / v made so far in this launch, zero at launch
  uint64_t* trace;     // null, or [layers, 5 phases, 5] (KCPP_DECODE_PERSISTENT_TRACE, Tracer)
  int h, inter, hq, hkv, d, rd, r_count, capacity, max_length, smax, union_bytes, stages;
  float eps, offset, qk_eps, qk_offset;
  bool gemma, qk_gemma;
  Unary act;
};

// The device code below is built for sm_90 only (bulk copies, mbarriers); the host never launches
// the kernel elsewhere, and its body is empty in other builds.
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900

constexpr int kMaxGroup = 8;  // query heads a kv head
constexpr int kKeysPerSplit = 48;
constexpr uint32_t kProducerSleepNs = 1000000;  // try_wait's suspend-time hint

// ---- synchronization -------------------------------------------------------------------------------

__device__ __forceinline__ void consumers_sync() { asm volatile("bar.sync 1, %0;" ::"n"(kConsumers) : "memory"); }

__device__ __forceinline__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Thread 0 polls *count with relaxed loads until it reaches target, then one acquire fence makes
// what the counted blocks wrote before their release adds visible (the PTX memory model's acquire
// pattern); an acquire load as the poll would invalidate the L1 cache at every poll.
__device__ __forceinline__ void poll_until(const unsigned* count, unsigned target) {
  unsigned seen = 0;
  do {
    asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(count) : "memory");
  } while (seen < target);
  asm volatile("fence.acq_rel.gpu;" ::: "memory");
}

// Every block's consumers have finished the phase before (their global writes visible to all): the
// block's barrier orders its threads' writes before its first thread's release add, which the
// other blocks' polls and fence order before their reads.
__device__ __forceinline__ void grid_sync(unsigned* arrived, unsigned& target) {
  consumers_sync();
  if (threadIdx.x == 0) {
    target += gridDim.x;
    asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(arrived) : "memory");
    poll_until(arrived, target);
  }
  consumers_sync();
}

// Waits (the block's consumers) until *count reaches target: written with release adds by the
// blocks it counts, so their writes before the adds are visible after the wait.
__device__ __forceinline__ void wait_count(const unsigned* count, unsigned target) {
  if (threadIdx.x == 0) poll_until(count, target);
  consumers_sync();
}

// With a trace (KCPP_DECODE_PERSISTENT_TRACE), block 0's first thread stamps each phase of each
// layer: 0 when the barrier before it lets the block go, 1 when its input rows are made, 2 when its
// first stage of weights is ready, 3 when its work is done; slot 4 counts the phase's stages
// (low 32 bits) and those whose bytes had not landed when warp 0 reached them (high 32 bits).  In
// the attention phase, slots 4-8 stamp the steps of the block's first item (attention_item).
struct Tracer {
  uint64_t* t;
  __device__ __forceinline__ uint64_t* at(int layer, int phase, int k) const {
    return t != nullptr && blockIdx.x == 0 ? t + (layer * 5 + phase) * kTraceSlots + k : nullptr;
  }
  __device__ __forceinline__ void stamp(int layer, int phase, int k) const {
    if (uint64_t* w = at(layer, phase, k); w != nullptr && threadIdx.x == 0) *w = global_ns();
  }
};

__device__ __forceinline__ void ring_wait(uint64_t* bar, uint32_t parity) {
  while (!::cuda::ptx::mbarrier_try_wait_parity(bar, parity)) {
  }
}

// ---- loads of what other blocks wrote in this launch (through L2) -----------------------------------

template <typename T> __device__ __forceinline__ void load8_cg(const T* p, float (&v)[8]) {
  const uint4 u = __ldcg(reinterpret_cast<const uint4*>(p));
  kc::Vec<T, 8> w;
  memcpy(&w, &u, sizeof(w));
  kc::widen(w, v);
}

// Elements [0, n) of p widened to f32 (out[n..8) zero), n in {1, 2, 4, 8} and p aligned to n
// elements: one load of 2 n bytes, through L2 with kL2 (what other blocks wrote in this launch).
template <typename T, bool kL2> __device__ __forceinline__ void load_run(const T* p, int n, float (&out)[8]) {
  uint4 u = {0u, 0u, 0u, 0u};
  if (n == 8) {
    u = kL2 ? __ldcg(reinterpret_cast<const uint4*>(p)) : *reinterpret_cast<const uint4*>(p);
  } else if (n == 4) {
    const uint2 h = kL2 ? __ldcg(reinterpret_cast<const uint2*>(p)) : *reinterpret_cast<const uint2*>(p);
    u.x = h.x, u.y = h.y;
  } else if (n == 2) {
    u.x = kL2 ? __ldcg(reinterpret_cast<const unsigned*>(p)) : *reinterpret_cast<const unsigned*>(p);
  } else {
    u.x = kL2 ? __ldcg(reinterpret_cast<const unsigned short*>(p)) : *reinterpret_cast<const unsigned short*>(p);
  }
  kc::Vec<T, 8> w;
  memcpy(&w, &u, sizeof(w));
  kc::widen(w, out);
}

// ---- the projections ----------------------------------------------------------------------------------

template <typename T> struct Gemv {
  const T* w;  // [halves n, k]
  int n, k;
  int halves;  // 2: rows i and n + i are a gate / up pair and out[i] = r(r(act(r(gate))) r(up))
};

// Projection `phase` of layer l: 0 qkv, 1 o, 2 gate/up, 3 down.
template <typename T> __device__ __forceinline__ Gemv<T> gemv_of(const Params<T>& p, int l, int phase) {
  const LayerPtrs<T>& L = p.layer[l];
  switch (phase) {
    case 0: return {L.wqkv, (p.hq + 2 * p.hkv) * p.d, p.h, 1};
    case 1: return {L.wo, p.h, p.hq * p.d, 1};
    case 2: return {L.w_gate_up, p.inter, p.h, 2};
    default: return {L.w_down, p.h, p.inter, 1};
  }
}

// This block's rows of a projection of n rows.
__device__ __forceinline__ void rows_of(int n, int& r0, int& r1) {
  r0 = static_cast<int>(static_cast<int64_t>(n) * blockIdx.x / gridDim.x);
  r1 = static_cast<int>(static_cast<int64_t>(n) * (blockIdx.x + 1) / gridDim.x);
}

// The producer: every stage of every projection of the launch, in the consumers' order.
template <typename T> __device__ void produce(const Params<T>& p, T* ring, uint64_t* full, uint64_t* empty) {
  const int p_stages = p.stages;
  kc::RingCursor at;
  for (int l = 0; l < p.layers; ++l)
    for (int phase = 0; phase < 4; ++phase) {
      const Gemv<T> g = gemv_of(p, l, phase);
      int r0, r1;
      rows_of(g.n, r0, r1);
      for (int g0 = r0; g0 < r1; g0 += kRowsPerGroup) {
        const int rows = min(kRowsPerGroup, r1 - g0);
        for (int half = 0; half < g.halves; ++half)
          for (int e0 = 0; e0 < g.k; e0 += kPiece) {
            const int len = min(kPiece, g.k - e0);
            const T* src = g.w + (static_cast<int64_t>(half) * g.n + g0) * g.k + e0;
            // A fresh barrier's "previous phase" is complete.  The ring is mostly full: the producer
            // sleeps in the wait (woken when the stage frees) rather than taking issue slots from
            // the consumers on its scheduler.
            while (!::cuda::ptx::mbarrier_try_wait_parity(&empty[at.slot], at.parity ^ 1u, uint32_t{kProducerSleepNs})) {
            }
            kc::bulk_expect(&full[at.slot], static_cast<uint32_t>(rows * len * sizeof(T)));
            T* dst = ring + at.slot * kStageElems;
            if (len == g.k)  // whole rows: the group is contiguous, one copy
              kc::bulk_load(dst, src, static_cast<uint32_t>(rows * len * sizeof(T)), &full[at.slot]);
            else
              for (int j = 0; j < rows; ++j)
                kc::bulk_load(dst + j * len, src + static_cast<int64_t>(j) * g.k, static_cast<uint32_t>(len * sizeof(T)), &full[at.slot]);
            at.advance(p_stages);
          }
      }
    }
}

// out[m, row] = r(sum_k act[m, k] w[row, k]) for this block's rows (with halves = 2 the gated
// activation of the pair's two sums, as glu_packed rounds it): the consumer side of produce().
template <typename T, int M>
__device__ void gemv(const Gemv<T>& g, const T* act, T* out, const T* ring, uint64_t* full, uint64_t* empty, kc::RingCursor& at,
                     int p_stages, Unary fn, uint64_t* ready) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  uint64_t* stages_seen = ready != nullptr ? ready + 2 : nullptr;  // the trace's slot 4 (Tracer)
  uint64_t seen = 0;
  int r0, r1;
  rows_of(g.n, r0, r1);
  for (int g0 = r0; g0 < r1; g0 += kRowsPerGroup) {
    const bool mine = g0 + warp < r1;
    float acc[2][M] = {};
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      if (half >= g.halves) break;
      for (int e0 = 0; e0 < g.k; e0 += kPiece) {
        const int len = min(kPiece, g.k - e0);
        if (stages_seen != nullptr && threadIdx.x == 0)
          seen += 1 + (::cuda::ptx::mbarrier_test_wait_parity(&full[at.slot], at.parity) ? 0 : uint64_t{1} << 32);
        ring_wait(&full[at.slot], at.parity);
        if (ready != nullptr && threadIdx.x == 0) *ready = global_ns(), ready = nullptr;
        if (mine) {
          // U steps of 256 elements a pass (fewer with more rows, so the loaded values stay in registers).
          constexpr int U = M == 1 ? 4 : M == 2 ? 2 : 1;
          const T* w = ring + at.slot * kStageElems + warp * len;
          for (int base = lane * 8; base < len; base += 32 * 8 * U) {
#pragma unroll
            for (int u = 0; u < U; ++u) {
              const int e = base + u * 32 * 8;
              if (e >= len) break;
              float wv[8];
              load_f32<T, 8>(w + e, wv);
#pragma unroll
              for (int m = 0; m < M; ++m) {
                float av[8];
                load_f32<T, 8>(act + m * g.k + e0 + e, av);
#pragma unroll
                for (int i = 0; i < 8; ++i) acc[half][m] = fmaf(av[i], wv[i], acc[half][m]);
              }
            }
          }
        }
        __syncwarp();
        if (lane == 0) (void)::cuda::ptx::mbarrier_arrive(&empty[at.slot]);
        at.advance(p_stages);
      }
    }
    if (mine) {
      float v[M];
#pragma unroll
      for (int m = 0; m < M; ++m) {
        v[m] = warp_sum(acc[0][m]);
        if (g.halves == 2) {
          const float up = round_to<T>(warp_sum(acc[1][m]));
          v[m] = round_to<T>(math::gated<float>(fn, round_to<T>(v[m]))) * up;
        }
      }
      if (lane < M) {
        float o = v[0];
#pragma unroll
        for (int m = 1; m < M; ++m)
          if (lane == m) o = v[m];
        out[static_cast<int64_t>(lane) * g.n + g0 + warp] = from_f32<T>(o);
      }
    }
  }
  if (stages_seen != nullptr && threadIdx.x == 0) *stages_seen = seen;
}

// ---- the projections' input rows ---------------------------------------------------------------------

// act[m, :] = rms_norm(s) with s = r(x + delta) (s = x without delta); block 0 writes s to s_out.
template <typename T, int M>
__device__ void add_norm_rows(const T* x, const T* delta, const T* w, T* s_out, T* act, T* wbuf, int k, float eps, float offset,
                              bool gemma, float (*red)[M]) {
  const int t = threadIdx.x, warp = t / 32, lane = t % 32;
  float ss[M] = {};
  for (int e = t * 8; e < k; e += kConsumers * 8) {
    float v[M][8], dl[M][8];
    // Every load first: the norm's weight (to shared memory, for the second pass) and each row.
    *reinterpret_cast<uint4*>(wbuf + e) = *reinterpret_cast<const uint4*>(w + e);
#pragma unroll
    for (int m = 0; m < M; ++m) {
      load8_cg(x + static_cast<int64_t>(m) * k + e, v[m]);
      if (delta != nullptr) load8_cg(delta + static_cast<int64_t>(m) * k + e, dl[m]);
    }
#pragma unroll
    for (int m = 0; m < M; ++m) {
      const int64_t at = static_cast<int64_t>(m) * k + e;
      if (delta != nullptr)
#pragma unroll
        for (int i = 0; i < 8; ++i) v[m][i] = round_to<T>(v[m][i] + dl[m][i]);
      if (blockIdx.x == 0) store_f32<T, 8>(s_out + at, v[m]);
      store_f32<T, 8>(act + at, v[m]);
#pragma unroll
      for (int i = 0; i < 8; ++i) ss[m] += v[m][i] * v[m][i];
    }
  }
#pragma unroll
  for (int m = 0; m < M; ++m) {
    const float s = warp_sum(ss[m]);
    if (lane == 0) red[warp][m] = s;
  }
  consumers_sync();
  float rstd[M];
#pragma unroll
  for (int m = 0; m < M; ++m) {
    float s = 0.f;
#pragma unroll
    for (int j = 0; j < kConsumerWarps; ++j) s += red[j][m];
    rstd[m] = 1.f / sqrtf(s / static_cast<float>(k) + eps);
  }
  for (int e = t * 8; e < k; e += kConsumers * 8) {  // the elements this thread stored above
    float wt[8];
    load_f32<T, 8>(wbuf + e, wt);
#pragma unroll
    for (int i = 0; i < 8; ++i) wt[i] = norm_weight_value<T>(wt[i], offset, gemma);
#pragma unroll
    for (int m = 0; m < M; ++m) {
      float v[8];
      load_f32<T, 8>(act + static_cast<int64_t>(m) * k + e, v);
#pragma unroll
      for (int i = 0; i < 8; ++i) v[i] = norm_apply<T>(v[i], rstd[m], wt[i], gemma);
      store_f32<T, 8>(act + static_cast<int64_t>(m) * k + e, v);
    }
  }
  consumers_sync();
}

// act[m, :] = src[m, :] (rows of k elements another block wrote in this launch).
template <typename T, int M> __device__ void load_rows(const T* src, T* act, int k) {
  for (int e = threadIdx.x * 8; e < M * k; e += kConsumers * 8) {  // k % 8 == 0: a load stays in its row
    float v[8];
    load8_cg(src + e, v);
    store_f32<T, 8>(act + e, v);
  }
  consumers_sync();
}

// ---- attention --------------------------------------------------------------------------------------

struct RowKeys {
  int lo, len, splits;
  bool bad;  // row or length out of range: the row's output is NaN
};

// step: the rows, positions and lengths [3][M], copied to shared memory at the kernel's start.
template <typename T> __device__ __forceinline__ RowKeys row_keys(const Params<T>& p, const int (*step)[4], int window, int m) {
  const int row = step[0][m], len = step[2][m];
  if (row < 0 || row >= p.r_count || len < 1 || len > p.max_length) return {0, 0, 1, true};
  const int lo = window > 0 ? ::max(0, len - window) : 0;
  const int splits = ::min(p.smax, ::max(1, (len - lo + kKeysPerSplit - 1) / kKeysPerSplit));
  return {lo, len, splits, false};
}

// softmax_merge (common.cuh) of one element.
__device__ __forceinline__ void merge(float& m, float& l, float& a, float m2, float l2, float a2) {
  float one[1] = {a};
  const float two[1] = {a2};
  softmax_merge(m, l, one, m2, l2, two);
  a = one[0];
}

// Item (row m, kv head kvh, split) of a layer's attention.  scratch: [warps, g, D + 2] floats; qf [g, D];
// kv_new [2, D].  The item's q / k / v rows are read once *ready reaches ready_target (the blocks
// that make them count them there); the cache's keys and values of the item's first pass are
// loaded before that wait, and every vector the heads need (norm weights, cos, sin) with its head.
template <typename T>
__device__ void attention_item(const Params<T>& p, const int (*step)[4], const LayerPtrs<T>& L, int m, int kvh, int split,
                               const RowKeys& rk, float* scratch, float* qf, float* kv_new, unsigned ready_target,
                               uint64_t* steps) {
  const int t = threadIdx.x, warp = t / 32, lane = t % 32, d = p.d, g = p.hq / p.hkv, h0 = kvh * g;
  auto mark = [&](int k) {
    if (steps != nullptr && t == 0) steps[k] = global_ns();
  };
  const int heads = p.hq + 2 * p.hkv;
  const T* src = p.qkv + static_cast<int64_t>(m) * heads * d;
  const int pos = step[1][m], crow = step[0][m];
  const bool row_ok = crow >= 0 && crow < p.r_count;
  const int64_t head_base = (static_cast<int64_t>(row_ok ? crow : 0) * p.hkv + kvh) * p.capacity;
  const int lpk = d / 8, kpi = 32 / lpk, sub = lane / lpk, e0 = (lane % lpk) * 8;
  const int chunk = rk.bad ? 0 : (rk.len - rk.lo + rk.splits - 1) / rk.splits;
  const int start = rk.lo + split * chunk, end = rk.bad ? start : ::min(rk.len, start + chunk);
  const T* kcache = L.k_cache + head_base * d;
  const T* vcache = L.v_cache + head_base * d;
  // A pass of the block covers `stride` keys, lane `sub` of a warp's kpi keys; a lane holds kPasses
  // passes' keys and values in registers, loaded together.
  constexpr int kPasses = 4;
  const int stride = kConsumerWarps * kpi, first = start + warp * kpi;
  uint4 kraw[kPasses], vraw[kPasses];
  auto load_passes = [&](int base) {
#pragma unroll
    for (int q = 0; q < kPasses; ++q) {
      const int key = base + q * stride + sub;
      if (key < end && key != pos) {  // the step's own key is made below
        kraw[q] = *reinterpret_cast<const uint4*>(kcache + static_cast<int64_t>(key) * d + e0);
        vraw[q] = *reinterpret_cast<const uint4*>(vcache + static_cast<int64_t>(key) * d + e0);
      }
    }
  };
  load_passes(first);
  wait_count(p.qkv_ready + kvh, ready_target);
  mark(0);
  // The item's query heads and the step's key and value: a warp a head, lane holding the E = D / 32
  // elements [lane E, lane E + E) (one element for D < 32), each vector it needs loaded at once.
  const int per = ::max(1, d / 32), e = lane * per;
  for (int j = warp; j < g + 2; j += kConsumerWarps) {
    const bool is_k = j == g, is_v = j == g + 1;
    const int head = is_v ? p.hq + p.hkv + kvh : is_k ? p.hq + kvh : h0 + j;
    float* dst = is_v ? kv_new + d : is_k ? kv_new : qf + j * d;
    const T* nw = is_v ? nullptr : is_k ? L.k_norm : L.q_norm;
    const T* c = p.cos + static_cast<int64_t>(m) * p.rd;
    const T* sn = p.sin + static_cast<int64_t>(m) * p.rd;
    const bool mine = e < d, rot = mine && !is_v && e < p.rd;
    float v[8] = {}, wt[8] = {}, cv[8] = {}, sv[8] = {};
    if (mine) {
      load_run<T, true>(src + head * d + e, per, v);
      if (nw != nullptr) load_run<T, false>(nw + e, per, wt);
    }
    if (rot && e + per <= p.rd && p.rd % per == 0) {
      load_run<T, false>(c + e, per, cv);
      load_run<T, false>(sn + e, per, sv);
    } else if (rot) {  // a run across the rotary width's end, or rows not aligned to a run
#pragma unroll
      for (int i = 0; i < 8; ++i)
        if (i < per && e + i < p.rd) cv[i] = to_f32(c[e + i]), sv[i] = to_f32(sn[e + i]);
    }
    if (nw != nullptr) {  // RMSNorm over the head, rstd in f32
      float ss = 0.f;
#pragma unroll
      for (int i = 0; i < 8; ++i) ss += v[i] * v[i];
      ss = warp_sum(ss);
      const float rstd = 1.f / sqrtf(ss / static_cast<float>(d) + p.qk_eps);
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        if (i >= per) break;
        const float w = norm_weight_value<T>(wt[i], p.qk_offset, p.qk_gemma);
        v[i] = p.qk_gemma ? round_to<T>(v[i] * rstd * w) : round_to<T>(w * round_to<T>(v[i] * rstd));
      }
    }
#pragma unroll
    for (int i = 0; i < 8; ++i)
      if (mine && i < per) dst[e + i] = v[i];
    __syncwarp();
    if (!is_v) {  // RoPE, rotate-half, on the first rd elements; each product rounded before the add
      const int half = p.rd / 2;
      float r[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        r[i] = v[i];
        if (rot && i < per && e + i < p.rd) {
          const int x = e + i;
          const float other = x < half ? -dst[x + half] : dst[x - half];
          r[i] = round_to<T>(__fadd_rn(round_to<T>(__fmul_rn(v[i], cv[i])), round_to<T>(__fmul_rn(other, sv[i]))));
        }
      }
      __syncwarp();
#pragma unroll
      for (int i = 0; i < 8; ++i)
        if (mine && i < per) dst[e + i] = r[i];
    }
  }
  consumers_sync();
  mark(1);
  if (split == 0 && row_ok && pos >= 0 && pos < p.capacity)
    for (int e = t; e < d; e += kConsumers) {
      L.k_cache[(head_base + pos) * d + e] = from_f32<T>(kv_new[e]);
      L.v_cache[(head_base + pos) * d + e] = from_f32<T>(kv_new[d + e]);
    }
  if (rk.bad) return;  // no partial result: the merge makes the row NaN

  float mx[kMaxGroup], sum[kMaxGroup], acc[kMaxGroup][8];
#pragma unroll
  for (int j = 0; j < kMaxGroup; ++j) {
    mx[j] = -INFINITY, sum[j] = 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[j][i] = 0.f;
  }
  for (int base = first; base < end; base += kPasses * stride) {
    if (base != first) load_passes(base);
#pragma unroll
    for (int q = 0; q < kPasses; ++q) {
      if (base + q * stride >= end) break;  // uniform in the warp
      const int key = base + q * stride + sub;
      const bool valid = key < end;
      float kv[8], vv[8];
      if (!valid) {
#pragma unroll
        for (int i = 0; i < 8; ++i) kv[i] = vv[i] = 0.f;
      } else if (key == pos) {  // the step's own key, written by split 0 meanwhile
#pragma unroll
        for (int i = 0; i < 8; ++i) kv[i] = kv_new[e0 + i], vv[i] = kv_new[d + e0 + i];
      } else {
        kc::Vec<T, 8> kw, vw;
        memcpy(&kw, &kraw[q], sizeof(kw));
        memcpy(&vw, &vraw[q], sizeof(vw));
        kc::widen(kw, kv);
        kc::widen(vw, vv);
      }
#pragma unroll
      for (int j = 0; j < kMaxGroup; ++j) {
        if (j >= g) break;
        float s = 0.f;
#pragma unroll
        for (int i = 0; i < 8; ++i) s = fmaf(qf[j * d + e0 + i], kv[i], s);
        for (int o = lpk / 2; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        if (valid) {
          s *= L.scale_log2;
          const float mn = fmaxf(mx[j], s);
          const float a = exp2f(mx[j] - mn), pe = exp2f(s - mn);
          sum[j] = sum[j] * a + pe;
#pragma unroll
          for (int i = 0; i < 8; ++i) acc[j][i] = fmaf(pe, vv[i], acc[j][i] * a);
          mx[j] = mn;
        }
      }
    }
  }
  mark(2);
  // The lanes holding the same elements of different keys, then the warps.
#pragma unroll
  for (int j = 0; j < kMaxGroup; ++j) {
    if (j >= g) break;
    for (int o = lpk; o < 32; o <<= 1) softmax_merge_lane(mx[j], sum[j], acc[j], o);
    if (sub == 0) {
      float* w = scratch + (warp * g + j) * (d + 2);
#pragma unroll
      for (int i = 0; i < 8; ++i) w[e0 + i] = acc[j][i];
      if (lane == 0) w[d] = mx[j], w[d + 1] = sum[j];
    }
  }
  consumers_sync();
  mark(3);
  for (int idx = t; idx < g * d; idx += kConsumers) {
    const int j = idx / d, e = idx % d;
    float mm = -INFINITY, l = 0.f, a = 0.f;
    for (int w = 0; w < kConsumerWarps; ++w) {
      const float* r = scratch + (w * g + j) * (d + 2);
      merge(mm, l, a, r[d], r[d + 1], r[e]);
    }
    const int64_t at = (static_cast<int64_t>(m) * p.hq + h0 + j) * p.smax + split;
    p.part_o[at * d + e] = a;
    if (e == 0) p.part_ml[at * 2] = mm, p.part_ml[at * 2 + 1] = l;
  }
  consumers_sync();  // scratch, qf and kv_new are free again
  mark(4);
}

template <typename T, int M>
__device__ void attention(const Params<T>& p, const int (*step)[4], const LayerPtrs<T>& L, float* scratch, float* qf, float* kv_new,
                          unsigned ready_target, uint64_t* steps) {
  RowKeys rk[M];
  int total = 0;
#pragma unroll
  for (int m = 0; m < M; ++m) {
    rk[m] = row_keys(p, step, L.window, m);
    total += p.hkv * rk[m].splits;
  }
  for (int it = blockIdx.x; it < total; it += gridDim.x) {
    int m = 0, r = it;
    while (r >= p.hkv * rk[m].splits) r -= p.hkv * rk[m].splits, ++m;
    attention_item(p, step, L, m, r / rk[m].splits, r % rk[m].splits, rk[m], scratch, qf, kv_new, ready_target,
                   it == blockIdx.x ? steps : nullptr);
  }
}

// After the block's qkv rows [r0, r1) are written: each kv head's count of its rows made (its g
// query heads, its key and its value head, D rows each) goes up by this block's share, with release.
template <typename T> __device__ void publish_qkv(const Params<T>& p) {
  consumers_sync();  // every consumer's rows written
  if (threadIdx.x != 0) return;
  int r0, r1;
  rows_of((p.hq + 2 * p.hkv) * p.d, r0, r1);
  const int g = p.hq / p.hkv;
  auto overlap = [&](int lo, int hi) { return ::max(0, ::min(r1, hi) - ::max(r0, lo)); };
  for (int kvh = 0; kvh < p.hkv; ++kvh) {
    const int n = overlap(kvh * g * p.d, (kvh + 1) * g * p.d) + overlap((p.hq + kvh) * p.d, (p.hq + kvh + 1) * p.d) +
                  overlap((p.hq + p.hkv + kvh) * p.d, (p.hq + p.hkv + kvh + 1) * p.d);
    if (n > 0) asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(p.qkv_ready + kvh), "r"(n) : "memory");
  }
}

// act[m, h D + e] = r(the merged softmax of row m's splits for query head h): the o projection's
// input.  A thread W elements of a head (one unit a thread at one row and D >= 16: the loads of every
// split in one round trip); the splits merged in their order, loads unrolled ahead.
template <typename T, int M, int W> __device__ void merge_rows(const Params<T>& p, const int (*step)[4], int window, T* act) {
  const int n = p.hq * p.d, units = M * n / W;
  for (int u = threadIdx.x; u < units; u += kConsumers) {
    const int idx = u * W, m = idx / n, h = (idx % n) / p.d, e = idx % p.d;
    const RowKeys rk = row_keys(p, step, window, m);
    float o[W];
    if (rk.bad) {
#pragma unroll
      for (int i = 0; i < W; ++i) o[i] = NAN;
    } else {
      const int64_t at = (static_cast<int64_t>(m) * p.hq + h) * p.smax;
      float mm = -INFINITY, l = 0.f, a[W] = {};
#pragma unroll 4
      for (int s = 0; s < rk.splits; ++s) {
        const float2 ml = __ldcg(reinterpret_cast<const float2*>(p.part_ml + (at + s) * 2));
        const float4* src = reinterpret_cast<const float4*>(p.part_o + (at + s) * p.d + e);
        float a2[W];
#pragma unroll
        for (int i = 0; i < W / 4; ++i) {
          const float4 f = __ldcg(src + i);
          a2[4 * i] = f.x, a2[4 * i + 1] = f.y, a2[4 * i + 2] = f.z, a2[4 * i + 3] = f.w;
        }
        softmax_merge(mm, l, a, ml.x, ml.y, a2);
      }
#pragma unroll
      for (int i = 0; i < W; ++i) o[i] = a[i] / l;
    }
#pragma unroll
    for (int i = 0; i < W; i += 8) {
      float o8[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) o8[j] = o[i + j];
      store_f32<T, 8>(act + idx + i, o8);
    }
  }
  consumers_sync();
}

#endif  // sm_90

// ---- the kernel ---------------------------------------------------------------------------------------

template <typename T, int M> __global__ void __launch_bounds__(kThreads, 1) decode_layers_kernel(const __grid_constant__ Params<T> p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(128) unsigned char smem[];
  T* ring = reinterpret_cast<T*>(smem);
  unsigned char* rest = smem + sizeof(T) * p.stages * kStageElems;
  T* act = reinterpret_cast<T*>(rest);            // a projection's input rows [M, K] ...
  float* scratch = reinterpret_cast<float*>(rest);  // ... or the attention's merge (not both at once)
  float* qf = reinterpret_cast<float*>(rest + p.union_bytes);
  float* kv_new = qf + (p.hq / p.hkv) * p.d;
  T* wbuf = reinterpret_cast<T*>(kv_new + 2 * p.d);  // a norm's weight [H]
  __shared__ int step[3][4];
  __shared__ uint64_t full[kMaxStages], empty[kMaxStages];
  __shared__ float red[kConsumerWarps][M];
  if (threadIdx.x < M) step[0][threadIdx.x] = p.rows[threadIdx.x], step[1][threadIdx.x] = p.positions[threadIdx.x],
                      step[2][threadIdx.x] = p.lengths[threadIdx.x];
  if (threadIdx.x == 0) {
    for (int s = 0; s < p.stages; ++s) {
      ::cuda::ptx::mbarrier_init(&full[s], 1);
      ::cuda::ptx::mbarrier_init(&empty[s], kConsumerWarps);
    }
    ::cuda::ptx::fence_mbarrier_init(::cuda::ptx::sem_release, ::cuda::ptx::scope_cluster);
  }
  __syncthreads();
  if (threadIdx.x >= kConsumers) {
    if (threadIdx.x == kConsumers) produce(p, ring, full, empty);
    return;
  }
  kc::RingCursor at;
  unsigned target = 0;
  const Tracer tr{p.trace};
  // Projection `phase` of layer l (gemv_of) from act into out; stamps 2 and 3 of trace phase tp.
  auto project = [&](int l, int phase, int tp, T* out) {
    gemv<T, M>(gemv_of(p, l, phase), act, out, ring, full, empty, at, p.stages, p.act, tr.at(l, tp, 2));
    if (p.trace != nullptr) consumers_sync();
    tr.stamp(l, tp, 3);
  };
  for (int l = 0; l < p.layers; ++l) {
    const LayerPtrs<T>& L = p.layer[l];
    if (l > 0) grid_sync(p.arrived, target);
    tr.stamp(l, 0, 0);
    add_norm_rows<T, M>(l == 0 ? p.x_in : p.x_out, l == 0 ? p.delta_in : p.delta, L.input_norm, p.x_mid, act, wbuf, p.h, p.eps,
                        p.offset, p.gemma, red);
    tr.stamp(l, 0, 1);
    project(l, 0, 0, p.qkv);
    publish_qkv(p);  // no grid barrier: an attention item waits for its kv head's rows only
    tr.stamp(l, 1, 0);
    attention<T, M>(p, step, L, scratch, qf, kv_new, static_cast<unsigned>((l + 1) * (p.hq / p.hkv + 2) * p.d), tr.at(l, 1, 4));
    tr.stamp(l, 1, 1), tr.stamp(l, 1, 2), tr.stamp(l, 1, 3);
    grid_sync(p.arrived, target);
    tr.stamp(l, 2, 0);
    if (p.d % 16 == 0)
      merge_rows<T, M, 16>(p, step, L.window, act);
    else
      merge_rows<T, M, 8>(p, step, L.window, act);
    tr.stamp(l, 2, 1);
    project(l, 1, 2, p.delta);
    grid_sync(p.arrived, target);
    tr.stamp(l, 3, 0);
    add_norm_rows<T, M>(p.x_mid, p.delta, L.post_norm, p.x_out, act, wbuf, p.h, p.eps, p.offset, p.gemma, red);
    tr.stamp(l, 3, 1);
    project(l, 2, 3, p.gu);
    grid_sync(p.arrived, target);
    tr.stamp(l, 4, 0);
    load_rows<T, M>(p.gu, act, p.inter);
    tr.stamp(l, 4, 1);
    project(l, 3, 4, p.delta);
  }
#endif
}

std::atomic<int64_t> launches{0};

struct GpuInfo {
  int sms = 0, optin = 0;
  bool hopper = false;  // compute capability 9.x with cooperative launches
};

// Cached a device: a decode step asks every step, and under CUDA graph capture too.
GpuInfo gpu_info() {
  static std::mutex mu;
  static std::map<int, GpuInfo> known;
  int dev = 0;
  KCPP_CUDA_CHECK(cudaGetDevice(&dev));
  const std::lock_guard<std::mutex> lock(mu);
  const auto [it, fresh] = known.try_emplace(dev);
  if (!fresh) return it->second;
  GpuInfo& d = it->second;
  int major = 0, coop = 0;
  KCPP_CUDA_CHECK(cudaDeviceGetAttribute(&d.sms, cudaDevAttrMultiProcessorCount, dev));
  KCPP_CUDA_CHECK(cudaDeviceGetAttribute(&d.optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  KCPP_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  KCPP_CUDA_CHECK(cudaDeviceGetAttribute(&coop, cudaDevAttrCooperativeLaunch, dev));
  d.hopper = major == 9 && coop != 0;
  return d;
}

// Whether `kernel` runs a block an SM with `smem` bytes of dynamic shared memory on the current
// device (its sm_90 body built, the limit raised); cached a (device, kernel, smem).
bool fits(const void* kernel, size_t smem) {
  static std::mutex mu;
  static std::map<std::tuple<int, const void*, size_t>, bool> known;
  int dev = 0;
  KCPP_CUDA_CHECK(cudaGetDevice(&dev));
  const std::lock_guard<std::mutex> lock(mu);
  const auto [it, fresh] = known.try_emplace({dev, kernel, smem}, false);
  if (!fresh) return it->second;
  cudaFuncAttributes attr{};
  KCPP_CUDA_CHECK(cudaFuncGetAttributes(&attr, kernel));
  if (attr.binaryVersion < 90) return false;  // the kernel's sm_90 body is not in this build
  KCPP_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  int per_sm = 0;
  KCPP_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, smem));
  return it->second = per_sm >= 1;
}

// KCPP_DECODE_PERSISTENT_TRACE=1: block 0 stamps its phases (Tracer); each launch made outside a CUDA
// graph capture waits for the kernel and prints its time per phase, summed over the layers, to
// standard error.
uint64_t* trace_buffer(cudaStream_t stream) {
  const char* e = std::getenv("KCPP_DECODE_PERSISTENT_TRACE");
  if (!e || std::strcmp(e, "1") != 0) return nullptr;
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  KCPP_CUDA_CHECK(cudaStreamIsCapturing(stream, &capturing));
  if (capturing != cudaStreamCaptureStatusNone) return nullptr;
  static uint64_t* buf = nullptr;  // one device's, for a diagnosis
  if (buf == nullptr) KCPP_CUDA_CHECK(cudaMalloc(&buf, sizeof(uint64_t) * 5 * kTraceSlots * kMaxLayers));
  return buf;
}

void print_trace(const uint64_t* trace, int layers, cudaStream_t stream) {
  std::vector<uint64_t> t(static_cast<size_t>(5 * kTraceSlots * layers));
  KCPP_CUDA_CHECK(cudaMemcpyAsync(t.data(), trace, sizeof(uint64_t) * t.size(), cudaMemcpyDeviceToHost, stream));
  KCPP_CUDA_CHECK(cudaStreamSynchronize(stream));
  static const char* names[5] = {"norm+qkv", "attention", "merge+o", "norm+gate/up+act", "down"};
  double part[5][3] = {}, wait = 0;
  uint64_t stages[5] = {}, late[5] = {};
  auto slot = [&](int l, int ph, int k) { return t[static_cast<size_t>((l * 5 + ph) * kTraceSlots + k)]; };
  for (int l = 0; l < layers; ++l)
    for (int ph = 0; ph < 5; ++ph) {
      for (int k = 0; k < 3; ++k) part[ph][k] += static_cast<double>(slot(l, ph, k + 1) - slot(l, ph, k)) / 1e3;
      if (l > 0 || ph > 0) wait += static_cast<double>(slot(l, ph, 0) - (ph > 0 ? slot(l, ph - 1, 3) : slot(l - 1, 4, 3))) / 1e3;
      if (ph != 1) stages[ph] += slot(l, ph, 4) & 0xffffffffu, late[ph] += slot(l, ph, 4) >> 32;
    }
  std::fprintf(stderr, "decode_layers_persistent: %d layers %.1f us (block 0; summed over the layers: rows made / weights "
               "awaited / the rest; stages whose bytes had not landed when reached / stages)\n", layers,
               static_cast<double>(slot(layers - 1, 4, 3) - slot(0, 0, 0)) / 1e3);
  for (int ph = 0; ph < 5; ++ph)
    std::fprintf(stderr, "  %-17s %7.1f %7.1f %7.1f   %llu / %llu\n", names[ph], part[ph][0], part[ph][1], part[ph][2],
                 static_cast<unsigned long long>(late[ph]), static_cast<unsigned long long>(stages[ph]));
  std::fprintf(stderr, "  %-17s %7.1f\n", "barriers and waits", wait);
  double item[5] = {};
  for (int l = 0; l < layers; ++l)
    for (int k = 0; k < 5; ++k) item[k] += static_cast<double>(slot(l, 1, 4 + k) - (k == 0 ? slot(l, 1, 0) : slot(l, 1, 3 + k))) / 1e3;
  std::fprintf(stderr, "  attention item: q/k/v awaited %.1f, heads made %.1f, keys %.1f, lanes and warps merged %.1f, "
               "splits written %.1f\n", item[0], item[1], item[2], item[3], item[4]);
}

template <typename T, int M> bool run(Params<T> p, const std::vector<PersistentDecodeLayer>& layers, size_t smem, int sms) {
  auto kernel = decode_layers_kernel<T, M>;
  if (!fits(reinterpret_cast<const void*>(kernel), smem)) return false;
  cudaStream_t stream = kcpp::cuda::current_stream();
  p.trace = trace_buffer(stream);
  const T* x_in = p.x_in;
  const T* delta_in = p.delta_in;
  for (size_t first = 0; first < layers.size(); first += kMaxLayers) {
    const size_t count = std::min<size_t>(kMaxLayers, layers.size() - first);
    p.layers = static_cast<int>(count);
    p.x_in = first == 0 ? x_in : p.x_out;
    p.delta_in = first == 0 ? delta_in : p.delta;
    for (size_t i = 0; i < count; ++i) {
      const PersistentDecodeLayer& l = layers[first + i];
      LayerPtrs<T>& L = p.layer[i];
      auto in = [](const Tensor& t) { return t.defined() ? static_cast<const T*>(t.data()) : nullptr; };
      L.input_norm = in(l.input_norm), L.post_norm = in(l.post_norm), L.wqkv = in(l.wqkv);
      L.q_norm = in(l.q_norm), L.k_norm = in(l.k_norm), L.wo = in(l.wo), L.w_gate_up = in(l.w_gate_up), L.w_down = in(l.w_down);
      L.k_cache = static_cast<T*>(l.k_cache.data()), L.v_cache = static_cast<T*>(l.v_cache.data());
      const double scale = l.scale != 0.0 ? l.scale : 1.0 / std::sqrt(static_cast<double>(p.d));
      L.scale_log2 = static_cast<float>(scale * 1.4426950408889634);
      L.window = static_cast<int>(std::min<int64_t>(l.window, INT32_MAX));
    }
    KCPP_CUDA_CHECK(cudaMemsetAsync(p.arrived, 0, sizeof(unsigned) * (1 + p.hkv), stream));
    cudaLaunchAttribute la{};
    la.id = cudaLaunchAttributeCooperative;
    la.val.cooperative = 1;
    const cudaError_t err =
        kcpp::kernel::cuda::launch_ex(&la, 1, kernel, dim3(static_cast<unsigned>(sms)), dim3(kThreads), smem, stream, p);
    if (err != cudaSuccess)
      KCPP_FAIL("op decode_layers_persistent: kernel launch failed: {}: {}", cudaGetErrorName(err), cudaGetErrorString(err));
    if (p.trace != nullptr) print_trace(p.trace, p.layers, stream);
  }
  return true;
}

}  // namespace

bool decode_layers_persistent(const Tensor& x_out, const Tensor& delta_out, const Tensor& x, const Tensor& delta_in,
                              const std::vector<PersistentDecodeLayer>& layers, const PersistentDecodeOptions& opt,
                              const Tensor& cos, const Tensor& sin, const Tensor& rows, const Tensor& positions,
                              const Tensor& lengths) {
  kcpp::cuda::DeviceGuard guard(x.device().index);
  const GpuInfo dev = gpu_info();
  if (!dev.hopper) return false;
  const int64_t b = x.size(0), h = x.size(1), hq = opt.q_heads, hkv = opt.kv_heads;
  const int64_t d = layers[0].k_cache.size(3), inter = layers[0].w_gate_up.size(0) / 2, g = hq / hkv;
  const int64_t kmax = std::max({h, hq * d, inter});
  const int64_t elem = static_cast<int64_t>(x.element_size());
  const int64_t union_bytes = (std::max(b * kmax * elem, int64_t{kConsumerWarps} * g * (d + 2) * 4) + 15) / 16 * 16;
  // The ring takes what the rest leaves (1 KiB kept for the static part: barriers, the norms' sums).
  const int64_t rest = union_bytes + (g + 2) * d * 4 + (h * elem + 15) / 16 * 16, stage_bytes = elem * kStageElems;
  const int64_t stages = std::min<int64_t>(kMaxStages, (dev.optin - 1024 - rest) / stage_bytes);
  if (stages < 4) return false;
  const int64_t smem = stages * stage_bytes + rest;
  const int64_t smax = std::max<int64_t>(1, dev.sms / (b * hkv));
  const Tensor x_mid = Tensor::empty({b, h}, x.dtype(), x.device());
  const Tensor qkv = Tensor::empty({b, (hq + 2 * hkv) * d}, x.dtype(), x.device());
  const Tensor gu = Tensor::empty({b, inter}, x.dtype(), x.device());
  const Tensor part_o = Tensor::empty({b, hq, smax, d}, DType::f32, x.device());
  const Tensor part_ml = Tensor::empty({b, hq, smax, 2}, DType::f32, x.device());
  const Tensor arrived = Tensor::empty({1 + hkv}, DType::i32, x.device());  // the barrier's count, then qkv_ready
  const int64_t max_length = opt.max_length > 0 ? std::min(opt.max_length, layers[0].k_cache.size(2)) : layers[0].k_cache.size(2);
  bool done = false;
  visit_cuda_float(x.dtype(), "decode_layers_persistent", [&]<typename T>(std::type_identity<T>) {
    if constexpr (std::is_same_v<T, float>) {
      KCPP_FAIL("op decode_layers_persistent: f32 has no persistent kernel (the caller composes the fused ops)");
    } else {
      Params<T> p{};
      p.x_in = static_cast<const T*>(x.data());
      p.delta_in = delta_in.defined() ? static_cast<const T*>(delta_in.data()) : nullptr;
      p.x_mid = static_cast<T*>(x_mid.data());
      p.x_out = static_cast<T*>(x_out.data());
      p.delta = static_cast<T*>(delta_out.data());
      p.qkv = static_cast<T*>(qkv.data());
      p.gu = static_cast<T*>(gu.data());
      p.part_o = static_cast<float*>(part_o.data());
      p.part_ml = static_cast<float*>(part_ml.data());
      p.cos = static_cast<const T*>(cos.data());
      p.sin = static_cast<const T*>(sin.data());
      p.rows = static_cast<const int*>(rows.data());
      p.positions = static_cast<const int*>(positions.data());
      p.lengths = static_cast<const int*>(lengths.data());
      p.arrived = static_cast<unsigned*>(arrived.data());
      p.qkv_ready = p.arrived + 1;
      p.h = static_cast<int>(h), p.inter = static_cast<int>(inter), p.hq = static_cast<int>(hq), p.hkv = static_cast<int>(hkv);
      p.d = static_cast<int>(d), p.rd = static_cast<int>(b > 0 ? cos.numel() / b : 0);
      p.r_count = static_cast<int>(layers[0].k_cache.size(0)), p.capacity = static_cast<int>(layers[0].k_cache.size(2));
      p.max_length = static_cast<int>(max_length), p.smax = static_cast<int>(smax), p.union_bytes = static_cast<int>(union_bytes);
      p.stages = static_cast<int>(stages);
      p.eps = static_cast<float>(opt.norm.eps), p.offset = static_cast<float>(opt.norm.offset);
      p.gemma = opt.norm.casting == RMSNormCasting::Gemma;
      p.qk_eps = static_cast<float>(opt.qk_norm.eps), p.qk_offset = static_cast<float>(opt.qk_norm.offset);
      p.qk_gemma = opt.qk_norm.casting == RMSNormCasting::Gemma;
      p.act = opt.act == GluActivation::Silu ? Unary::Silu : opt.act == GluActivation::Gelu ? Unary::Gelu : Unary::GeluTanh;
      switch (b) {
        case 1: done = run<T, 1>(p, layers, static_cast<size_t>(smem), dev.sms); break;
        case 2: done = run<T, 2>(p, layers, static_cast<size_t>(smem), dev.sms); break;
        case 3: done = run<T, 3>(p, layers, static_cast<size_t>(smem), dev.sms); break;
        default: done = run<T, 4>(p, layers, static_cast<size_t>(smem), dev.sms); break;
      }
    }
  });
  if (done) launches.fetch_add(1, std::memory_order_relaxed);
  return done;
}

int64_t decode_persistent_launches() { return launches.load(std::memory_order_relaxed); }

}  // namespace kcpp::ops::cuda
