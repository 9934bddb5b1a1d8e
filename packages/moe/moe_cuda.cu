// Mixture-of-experts on CUDA (maths, layout and permutation in moe.h; the grouped GEMM in
// moe_gemm.cuh).  bf16 and f16 (the tensor-core GEMMs); f32 is refused by the package's supports().
// The experts' GEMMs run on the package's kernel (below) or on cuBLAS (moe.h: ExpertGemm; the
// section "the cuBLAS paths" says how, Padded's layout included); everything else is the same for both.
//
// Forward with the kernel, every launch on the caller's stream, no host synchronization:
//   router GEMM (logits rounded to the dtype) -> route (a warp per token: softmax or sigmoid, top-k by
//   warp arg-max, ties to the lower expert) -> count (a warp per chunk of 256 slots: per-chunk counts
//   of each expert, ranks by __match_any_sync) -> scan (a block per expert: each chunk's base within
//   the expert, over its counts; then one warp: offsets and the GEMM's tile offsets) -> scatter (the
//   same warps again: stable positions) ->
//   [Input: gather the scaled rows] -> gate/up GEMM grouped by expert with the gated activation in its
//   epilogue (h, and gate_up when saved) -> down GEMM (y by position) -> [shared expert: the same two
//   GEMMs over every token] -> combine (out_t = sum over slots in order, plus the shared part).
// Backward: the slots again (ids, weights as f32), the inverse permutation and tile offsets ->
//   [gate_up recomputed when not saved] -> q = dout Wd grouped, its epilogue making dgu, c h and the
//   per-block row sums of q h -> dx_s = dgu Wgu grouped -> weight gradients (grouped over each
//   expert's positions: the reduction dim) -> dw per slot (the row sums, or dx_s . x_t) -> dz per token
//   -> the router's two GEMMs and the shared expert -> dx_t summed over slots in order.
// Every reduction has a fixed order (no float atomics); integer counters only inside one warp.
#include <cublas_v2.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <utility>
#include <vector>

#include "kcpp/kernel/cuda.cuh"
#include "kcpp/kernel/error.h"
#include "moe.h"
#include "moe_gemm.cuh"
#include "moe_gemm_sm90.cuh"

namespace kcpp::moe {
namespace {

using kernel::DType;
using kernel::errorf;
using kernel::cuda::from_f32;
using kernel::cuda::to_f32;
using kernel::cuda::warp_sum;

constexpr int kChunk = 256;  // slots per warp of the counting sort (8 steps of a warp: its loop is latency-bound)
constexpr size_t kAlign = 256;
constexpr size_t kCublasWorkspace = size_t(32) << 20;  // cuBLAS's recommendation for Hopper
// cuBLAS calls of one forward or backward at most: in backward gate / up again (two when given apart),
// q, dx (two), ddown, dgate and dup.
constexpr int kMaxCublasGemms = 8;

struct Carve {
  unsigned char* base = nullptr;
  size_t used = 0;
  template <typename U> U* take(int64_t n) {
    const size_t bytes = (static_cast<size_t>(std::max<int64_t>(n, 1)) * sizeof(U) + kAlign - 1) / kAlign * kAlign;
    U* q = base ? reinterpret_cast<U*>(base + used) : nullptr;
    used += bytes;
    return q;
  }
};

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
int64_t chunks(int64_t slots) { return std::max<int64_t>(ceil_div(slots, kChunk), 1); }
int64_t ntiles(int64_t n) { return ceil_div(n, gemm::BN); }

// ---- workspace ------------------------------------------------------------------------------------

struct Bufs {
  int32_t *ids = nullptr, *offsets = nullptr, *sorted = nullptr, *pos = nullptr, *counts = nullptr, *base = nullptr,
          *tiles = nullptr;
  float* w = nullptr;
  void *logits = nullptr, *xs = nullptr, *h = nullptr, *y = nullptr, *sh = nullptr, *sm = nullptr;
  float* sigma = nullptr;
  // backward
  void *gu = nullptr, *dgu = nullptr, *ch = nullptr, *dxs = nullptr, *dz = nullptr, *sgu = nullptr, *sdgu = nullptr,
       *sch = nullptr;
  float *partial = nullptr, *dw = nullptr, *dxr = nullptr, *spartial = nullptr, *dl = nullptr;
  // the cuBLAS paths
  void** ptrs = nullptr;  // the grouped calls' pointer arrays on the device
  void* blas = nullptr;   // cuBLAS's workspace
  int64_t rows = 0;       // the rows of the buffers by row (layout's r): no path may use more
  int64_t h_elems = 0;     // forward: the elements b.h holds (fewer with Loop's windows or Padded's groups)
  int64_t ch_cols = 0;     // backward: the columns c h holds (I, or Loop's chunk: moe.h, loop_chunk_cols)
  int64_t group_rows = 0;  // Padded's groups of experts (moe.h, padded_group_rows; 0: none): rows they hold
  void* dgu_group = nullptr;  // backward: a group's [dg, du] by padded row, where dgu lies over the saved gate_up
  void* plan = nullptr;       // on cuBLAS: the layout planned on the device (Plan)
};

// `cublas`: room for the cuBLAS paths too (their buffers, by path in the forward's and backward's
// cuBLAS functions below); `padded_rows`: the rows the buffers by row (xs, h, y, gu, dgu, ch, partial,
// dxs) hold for the Padded path (workspace_padded_rows, moe.h; 0: not padded, S).  The kernel path runs
// within it all the same.  The cuBLAS backward (experts_backward_cublas) keeps x by row in dxs's
// buffer, gathered once dout by row is done with, unless the weights apply to the input (the kernel
// path then needs both at once).  dgu lies over the [g, u] the backward's GLU reads (moe.h: Backward
// memory): the recomputed gu (same rows on every path), or the saved gate_up by position when the host
// lets it be overwritten (Padded then copies a group's rows into dgu_group); else it has its own rows.
// The shared expert's sdgu lies over sgu likewise.  `loop` (the path is Loop whatever the counts):
// the training forward's h holds a window of rows, the backward's c h a chunk of I's columns (moe.h:
// Loop's smaller buffers).  Where Padded may run with gate_up saved, its forward's [g, u] / h and,
// with overwrite_gate_up, its backward's [dg, du] by padded row hold a group of experts at a time
// (moe.h: Padded's groups; the backward's dgu then lies over the saved gate_up by position).
Bufs layout(const MoeParams& p, bool bwd, Carve& cv, bool cublas, int64_t padded_rows, bool loop) {
  Bufs b;
  const int64_t t = p.tokens, h = p.hidden, e = p.experts, s = moe_slots(p), i = p.inter, si = p.shared_inter;
  const int64_t r = std::max(s, padded_rows);  // rows of the buffers by row
  b.rows = r;
  b.ch_cols = bwd && loop ? loop_chunk_cols(h, i) : i;
  b.group_rows = padded_rows > 0 && p.gate_up ? padded_group_rows(r) : 0;
  const int64_t eb = kernel::dtype_bytes(p.dtype);
  const bool router = p.routing != Routing::Given, input = p.weight_on == WeightOn::Input;
  const bool own_ids = bwd ? !router : !(router && p.topk_ids);
  if (own_ids) b.ids = cv.take<int32_t>(s);
  if (bwd ? !router : !(router && p.topk_weights)) b.w = cv.take<float>(s);
  if (!bwd && !p.expert_offsets) b.offsets = cv.take<int32_t>(e + 2);
  if (!bwd && !p.sorted_slots) b.sorted = cv.take<int32_t>(s);
  b.pos = cv.take<int32_t>(s);
  if (!bwd) b.counts = b.base = cv.take<int32_t>(chunks(s) * (e + 1));  // scan_chunks writes each base over its count
  b.tiles = cv.take<int32_t>(e + 1);
  if (router && !bwd && !p.router_logits) b.logits = cv.take<unsigned char>(t * e * eb);
  if (input) b.xs = cv.take<unsigned char>(r * h * eb);
  if (si > 0) b.sigma = cv.take<float>(t);
  if (!bwd) {
    // cuBLAS: [g, u] with h over g (Padded: also when gate_up is saved, which takes [g, u] by position)
    if (loop && p.gate_up) b.h_elems = loop_window_rows(r, h, i) * i;
    else if (b.group_rows > 0) b.h_elems = b.group_rows * 2 * i;
    else b.h_elems = r * i * (cublas && (!p.gate_up || padded_rows > 0) ? 2 : 1);
    b.h = cv.take<unsigned char>(b.h_elems * eb);
    b.y = cv.take<unsigned char>(r * h * eb);
    if (si > 0) {
      b.sh = cv.take<unsigned char>(t * si * eb);
      b.sm = cv.take<unsigned char>(t * h * eb);
    }
  } else {
    if (!p.gate_up) b.gu = b.dgu = cv.take<unsigned char>(r * 2 * i * eb);
    else if (p.overwrite_gate_up) b.dgu = p.gate_up;  // by position
    else b.dgu = cv.take<unsigned char>(r * 2 * i * eb);
    if (p.gate_up && p.overwrite_gate_up && b.group_rows > 0) b.dgu_group = cv.take<unsigned char>(b.group_rows * 2 * i * eb);
    b.ch = cv.take<unsigned char>(r * b.ch_cols * eb);
    if (!input) b.partial = cv.take<float>(std::max(s * ntiles(i), r));  // cuBLAS: one per row
    b.dxs = cv.take<unsigned char>(r * h * eb);
    if (cublas && !input) b.xs = b.dxs;
    b.dw = cv.take<float>(s);
    if (router) b.dz = cv.take<unsigned char>(t * e * eb);
    if (router || si > 0) b.dxr = cv.take<float>(t * h);
    if (si > 0) {
      b.sgu = b.sdgu = cv.take<unsigned char>(t * 2 * si * eb);
      b.sch = cv.take<unsigned char>(t * si * eb);
      b.spartial = cv.take<float>(t * ntiles(si));
      b.dl = cv.take<float>(t);
    }
  }
  if (cublas) {
    b.plan = cv.take<int32_t>(4);
    b.ptrs = cv.take<void*>(kMaxCublasGemms * 3 * e);
    b.blas = cv.take<unsigned char>(static_cast<int64_t>(kCublasWorkspace));
  }
  return b;
}

// ---- small kernels --------------------------------------------------------------------------------

__device__ __forceinline__ int bucket(int32_t id, int e) { return id >= 0 && id < e ? id : e; }

// The host's routing as i32 ids and f32 weights.
template <typename T>
__global__ void prepare_slots(int64_t s, const void* ids, bool i64, const void* w, bool wf32, int32_t* ids32, float* w32) {
  const int64_t q = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (q >= s) return;
  if (ids32) {
    const int64_t v = i64 ? static_cast<const int64_t*>(ids)[q] : static_cast<const int32_t*>(ids)[q];
    ids32[q] = v >= INT32_MIN && v <= INT32_MAX ? static_cast<int32_t>(v) : -1;
  }
  if (w32) w32[q] = wf32 ? static_cast<const float*>(w)[q] : to_f32(static_cast<const T*>(w)[q]);
}

// One warp per token: the top-k of the rounded logits (descending, ties to the lower expert) and the
// routing weights.  Each lane holds experts lane, lane + 32, ... (E <= 1024) as bits of `taken`.
template <typename T>
__global__ void route(int64_t tokens, int e, int k, const T* logits, Routing routing, bool normalize, int32_t* ids, float* w) {
  const int64_t t = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (t >= tokens) return;
  const T* z = logits + t * e;
  float m = -INFINITY;
  for (int x = lane; x < e; x += 32) m = fmaxf(m, to_f32(z[x]));
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  float sum = 0.0f;
  if (routing == Routing::Softmax) {
    for (int x = lane; x < e; x += 32) sum += expf(to_f32(z[x]) - m);
    sum = warp_sum(sum);
  }
  uint32_t taken = 0;
  float chosen_sum = 0.0f;
  for (int j = 0; j < k; ++j) {
    float best = -INFINITY;
    int bi = -1;
    for (int x = lane, bit = 0; x < e; x += 32, ++bit) {
      const float v = to_f32(z[x]);
      if (!(taken >> bit & 1u) && (bi < 0 || v > best)) best = v, bi = x;
    }
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, best, o);
      const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
      if (oi >= 0 && (bi < 0 || ov > best || (ov == best && oi < bi))) best = ov, bi = oi;
    }
    if ((bi & 31) == lane) taken |= 1u << (bi >> 5);
    const float wj = routing == Routing::Softmax ? expf(best - m) / sum : 1.0f / (1.0f + expf(-best));
    chosen_sum += wj;
    if (lane == 0) ids[t * k + j] = bi, w[t * k + j] = wj;
  }
  if (routing == Routing::Softmax && normalize) {
    __syncwarp();
    if (lane == 0)
      for (int j = 0; j < k; ++j) w[t * k + j] /= chosen_sum;
  }
}

// One warp per chunk of slots: the chunk's count of each bucket (experts, then E for invalid ids).
__global__ void count_slots(int64_t s, int e, const int32_t* ids, int32_t* counts) {
  extern __shared__ int32_t cnt[];
  const int lane = threadIdx.x;
  for (int b = lane; b <= e; b += 32) cnt[b] = 0;
  __syncwarp();
  const int64_t begin = static_cast<int64_t>(blockIdx.x) * kChunk;
  for (int64_t q0 = begin; q0 < std::min<int64_t>(begin + kChunk, s); q0 += 32) {
    const int64_t q = q0 + lane;
    const int b = q < s ? bucket(ids[q], e) : -1;
    const unsigned peers = __match_any_sync(0xffffffffu, b);
    if (b >= 0 && lane == __ffs(peers) - 1) cnt[b] += __popc(peers);
    __syncwarp();
  }
  for (int b = lane; b <= e; b += 32) counts[static_cast<int64_t>(blockIdx.x) * (e + 1) + b] = cnt[b];
}

// A block per bucket b: each chunk's first position of b among b's slots (an exclusive scan over
// the chunks, kScanThreads at a time, into base, which may be counts: each element is read, then
// written, by one thread) and b's total (into tot[b]).
constexpr int kScanThreads = 256;
__global__ void scan_chunks(int e, int nchunks, const int32_t* counts, int32_t* base, int32_t* tot) {
  __shared__ int32_t warp_tot[kScanThreads / 32];
  const int b = blockIdx.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int32_t run = 0;
  for (int c0 = 0; c0 < nchunks; c0 += kScanThreads) {
    const int c = c0 + static_cast<int>(threadIdx.x);
    const int32_t n = c < nchunks ? counts[static_cast<int64_t>(c) * (e + 1) + b] : 0;
    int32_t incl = n;
    for (int o = 1; o < 32; o <<= 1) {
      const int32_t v = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += v;
    }
    if (lane == 31) warp_tot[warp] = incl;
    __syncthreads();
    int32_t before = run;
    for (int w = 0; w < warp; ++w) before += warp_tot[w];
    if (c < nchunks) base[static_cast<int64_t>(c) * (e + 1) + b] = before + incl - n;
    for (int w = 0; w < kScanThreads / 32; ++w) run += warp_tot[w];
    __syncthreads();
  }
  if (threadIdx.x == 0) tot[b] = run;
}

// One warp: offsets (E + 2) from the bucket totals (in offsets[0 .. E] on entry), and the grouped
// GEMM's tile offsets (tiles of BM rows per expert).
__global__ void scan_buckets(int64_t s, int e, int32_t* offsets, int32_t* tiles) {
  const int lane = threadIdx.x;
  int32_t run = 0, tr = 0;
  for (int b0 = 0; b0 <= e; b0 += 32) {
    const int b = b0 + lane;
    const int32_t n = b <= e ? offsets[b] : 0, t = b < e ? (n + gemm::BM - 1) / gemm::BM : 0;
    int32_t incl = n, tincl = t;
    for (int o = 1; o < 32; o <<= 1) {
      const int32_t v = __shfl_up_sync(0xffffffffu, incl, o), tv = __shfl_up_sync(0xffffffffu, tincl, o);
      if (lane >= o) incl += v, tincl += tv;
    }
    if (b <= e) offsets[b] = run + incl - n;
    if (b < e) tiles[b] = tr + tincl - t;
    run += __shfl_sync(0xffffffffu, incl, 31), tr += __shfl_sync(0xffffffffu, tincl, 31);
  }
  if (lane == 0) {
    tiles[e] = tr;
    offsets[e + 1] = static_cast<int32_t>(s);
  }
}

// The same warps as count_slots: each slot's position, in slot order within a bucket.
__global__ void scatter_slots(int64_t s, int e, const int32_t* ids, const int32_t* offsets, const int32_t* base, int32_t* sorted,
                              int32_t* pos) {
  extern __shared__ int32_t run[];
  const int lane = threadIdx.x;
  for (int b = lane; b <= e; b += 32) run[b] = offsets[b] + base[static_cast<int64_t>(blockIdx.x) * (e + 1) + b];
  __syncwarp();
  const int64_t begin = static_cast<int64_t>(blockIdx.x) * kChunk;
  for (int64_t q0 = begin; q0 < std::min<int64_t>(begin + kChunk, s); q0 += 32) {
    const int64_t q = q0 + lane;
    const int b = q < s ? bucket(ids[q], e) : -1;
    const unsigned peers = __match_any_sync(0xffffffffu, b);
    if (b >= 0) {
      const int32_t at = run[b] + __popc(peers & ((1u << lane) - 1u));
      sorted[at] = static_cast<int32_t>(q);
      pos[q] = at;
    }
    __syncwarp();
    if (b >= 0 && lane == __ffs(peers) - 1) run[b] += __popc(peers);
    __syncwarp();
  }
}

__global__ void invert(int64_t s, const int32_t* sorted, int32_t* pos) {
  const int64_t q = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (q < s) pos[sorted[q]] = static_cast<int32_t>(q);
}

// Tile offsets from the saved offsets (backward).
__global__ void tile_offsets(int e, const int32_t* offsets, int32_t* tiles) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  int32_t tr = 0;
  for (int b = 0; b < e; ++b) {
    tiles[b] = tr;
    tr += (offsets[b + 1] - offsets[b] + gemm::BM - 1) / gemm::BM;
  }
  tiles[e] = tr;
}

// Input mode: xs[p] = round(w x_t) for the valid positions.
template <typename T>
__global__ void gather_scale(int64_t h, int k, const int32_t* valid, const int32_t* sorted, const float* w, const T* x,
                             int64_t ldx, T* xs) {
  const int64_t q = blockIdx.x;
  if (q >= *valid) return;
  const int32_t slot = sorted[q];
  const T* src = x + static_cast<int64_t>(slot / k) * ldx;
  const float wv = w[slot];
  for (int64_t c = threadIdx.x; c < h; c += blockDim.x) xs[q * h + c] = from_f32<T>(wv * to_f32(src[c]));
}

// acc[i] = sum_j c_s rows[pos s][c + i] over token t's slots s = t k + j in order (c_s = w[s], or 1
// without w), slots no expert takes (pos < 0 or >= nvalid) left out: the combines' sums.
template <typename T, int V>
__device__ __forceinline__ void sum_slot_rows(float (&acc)[V], int64_t t, int k, int64_t h, int64_t c, const int32_t* pos,
                                              int32_t nvalid, const float* w, const T* rows) {
#pragma unroll
  for (int i = 0; i < V; ++i) acc[i] = 0.0f;
  for (int j = 0; j < k; ++j) {
    const int64_t s = t * k + j;
    const int32_t q = pos[s];
    if (q < 0 || q >= nvalid) continue;
    const float cs = w ? w[s] : 1.0f;
    float v[V];
    kernel::cuda::load_f32<T, V>(rows + static_cast<int64_t>(q) * h + c, v);
#pragma unroll
    for (int i = 0; i < V; ++i) acc[i] += cs * v[i];
  }
}

// out_t = sum_j c_s y[pos s] (+ sigma_t m_t), slots in order; a block per token, V columns a thread
// a step (V = 8: 16-byte loads, the k rows' loads of a step in flight together).
// `valid` null: pos holds rows of y (Padded's), -1 for a slot no expert takes.
template <typename T, int V>
__global__ void combine_forward(int64_t h, int k, const int32_t* valid, const int32_t* pos, const float* w, bool output,
                                const T* y, const float* sigma, const T* m, T* out, int64_t ldo) {
  const int64_t t = blockIdx.x;
  const int32_t nvalid = valid ? *valid : INT32_MAX;
  for (int64_t c = static_cast<int64_t>(threadIdx.x) * V; c < h; c += static_cast<int64_t>(blockDim.x) * V) {
    float acc[V];
    sum_slot_rows<T, V>(acc, t, k, h, c, pos, nvalid, output ? w : nullptr, y);
    if (m) {
      float v[V];
      kernel::cuda::load_f32<T, V>(m + t * h + c, v);
#pragma unroll
      for (int i = 0; i < V; ++i) acc[i] += sigma[t] * v[i];
    }
    kernel::cuda::store_f32<T, V>(out + t * ldo + c, acc);
  }
}

template <typename T>
void launch_combine_forward(int64_t tokens, int64_t h, int k, const int32_t* valid, const int32_t* pos, const float* w, bool output,
                            const T* y, const float* sigma, const T* m, T* out, int64_t ldo, cudaStream_t st) {
  if (tokens <= 0) return;
  const bool vec = h % 8 == 0 && ldo % 8 == 0 && kernel::cuda::aligned16(y) && kernel::cuda::aligned16(m) && kernel::cuda::aligned16(out);
  if (vec)
    combine_forward<T, 8><<<static_cast<unsigned>(tokens), 256, 0, st>>>(h, k, valid, pos, w, output, y, sigma, m, out, ldo);
  else
    combine_forward<T, 1><<<static_cast<unsigned>(tokens), 256, 0, st>>>(h, k, valid, pos, w, output, y, sigma, m, out, ldo);
}

// sigma_t = sigmoid(x_t . gs), or 1 without a gate: a warp per token.
template <typename T>
__global__ void shared_sigma(int64_t tokens, int64_t h, const T* x, int64_t ldx, const T* gs, float* sigma) {
  const int64_t t = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (t >= tokens) return;
  if (!gs) {
    if (lane == 0) sigma[t] = 1.0f;
    return;
  }
  float d = 0.0f;
  for (int64_t c = lane; c < h; c += 32) d += to_f32(x[t * ldx + c]) * to_f32(gs[c]);
  d = warp_sum(d);
  if (lane == 0) sigma[t] = 1.0f / (1.0f + expf(-d));
}

// dw per slot: Output: the row sums of q h over the n tiles; Input: dx_s . x_t (a warp per slot).
// `valid` null: pos holds rows (Padded's), -1 for a slot no expert takes.
template <typename T>
__global__ void slot_dw(int64_t slots, int64_t h, int k, const int32_t* valid, const int32_t* pos, const float* partial,
                        int64_t nt, const T* dxs, const T* x, int64_t ldx, float* dw) {
  const int64_t s = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (s >= slots) return;
  const int32_t q = pos[s];
  if (q < 0 || (valid && q >= *valid)) {
    if (lane == 0) dw[s] = 0.0f;
    return;
  }
  if (partial) {
    if (lane == 0) {
      float acc = 0.0f;
      for (int64_t j = 0; j < nt; ++j) acc += partial[static_cast<int64_t>(q) * nt + j];
      dw[s] = acc;
    }
    return;
  }
  const T* a = dxs + static_cast<int64_t>(q) * h;
  const T* b = x + (s / k) * ldx;
  float d = 0.0f;
  for (int64_t c = lane; c < h; c += 32) d += to_f32(a[c]) * to_f32(b[c]);
  d = warp_sum(d);
  if (lane == 0) dw[s] = d;
}

// dz per token (a warp), rounded to the dtype, from its slots' dw and the forward's logits.
template <typename T>
__global__ void route_backward(int64_t tokens, int e, int k, const T* logits, Routing routing, bool normalize,
                               const int32_t* ids, const float* w, const float* dw, const void* extra, bool extra_f32,
                               T* dz) {
  const int64_t t = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (t >= tokens) return;
  const T* z = logits + t * e;
  const int32_t* it = ids + t * k;
  const float *wt = w + t * k, *dwt = dw + t * k;
  float m = -INFINITY, sum = 0.0f, dot = 0.0f;
  if (routing == Routing::Softmax && !normalize) {
    for (int x = lane; x < e; x += 32) m = fmaxf(m, to_f32(z[x]));
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    for (int x = lane; x < e; x += 32) sum += expf(to_f32(z[x]) - m);
    sum = warp_sum(sum);
    for (int j = 0; j < k; ++j) dot += expf(to_f32(z[it[j]]) - m) / sum * dwt[j];
  } else if (routing == Routing::Softmax) {
    for (int j = 0; j < k; ++j) dot += wt[j] * dwt[j];
  }
  for (int x = lane; x < e; x += 32) {
    float g = 0.0f;
    if (routing == Routing::Softmax && !normalize) {
      const float px = expf(to_f32(z[x]) - m) / sum;
      g = -px * dot;
      for (int j = 0; j < k; ++j)
        if (it[j] == x) g += px * dwt[j];
    } else {
      for (int j = 0; j < k; ++j)
        if (it[j] == x) g += routing == Routing::Sigmoid ? dwt[j] * wt[j] * (1.0f - wt[j]) : wt[j] * (dwt[j] - dot);
    }
    if (extra) g += extra_f32 ? static_cast<const float*>(extra)[t * e + x] : to_f32(static_cast<const T*>(extra)[t * e + x]);
    dz[t * e + x] = from_f32<T>(g);
  }
}

// dx_t = sum_j c'_s dx_s (slots in order) + dxr_t.  `valid` null: pos holds rows of dxs (Padded's),
// -1 for a slot no expert takes.
// A block per token, V columns a thread a step, as combine_forward.
template <typename T, int V>
__global__ void combine_backward(int64_t h, int k, const int32_t* valid, const int32_t* pos, const float* w, bool input,
                                 const T* dxs, const float* dxr, T* dx, int64_t ldd) {
  const int64_t t = blockIdx.x;
  const int32_t nvalid = valid ? *valid : INT32_MAX;
  for (int64_t c = static_cast<int64_t>(threadIdx.x) * V; c < h; c += static_cast<int64_t>(blockDim.x) * V) {
    float acc[V];
    sum_slot_rows<T, V>(acc, t, k, h, c, pos, nvalid, input ? w : nullptr, dxs);
    if (dxr) {
      const float* r = dxr + t * h + c;
#pragma unroll
      for (int i = 0; i < V; i += 4) {
        if constexpr (V % 4 == 0) {
          const float4 f = *reinterpret_cast<const float4*>(r + i);
          acc[i] += f.x, acc[i + 1] += f.y, acc[i + 2] += f.z, acc[i + 3] += f.w;
        } else {
          acc[i] += r[i];
        }
      }
    }
    kernel::cuda::store_f32<T, V>(dx + t * ldd + c, acc);
  }
}

template <typename T>
void launch_combine_backward(int64_t tokens, int64_t h, int k, const int32_t* valid, const int32_t* pos, const float* w, bool input,
                             const T* dxs, const float* dxr, T* dx, int64_t ldd, cudaStream_t st) {
  if (tokens <= 0) return;
  const bool vec = h % 8 == 0 && ldd % 8 == 0 && kernel::cuda::aligned16(dxs) && kernel::cuda::aligned16(dxr) && kernel::cuda::aligned16(dx);
  if (vec)
    combine_backward<T, 8><<<static_cast<unsigned>(tokens), 256, 0, st>>>(h, k, valid, pos, w, input, dxs, dxr, dx, ldd);
  else
    combine_backward<T, 1><<<static_cast<unsigned>(tokens), 256, 0, st>>>(h, k, valid, pos, w, input, dxs, dxr, dx, ldd);
}

// The shared expert's gate: dl_t = (sum of the row sums) sigma (1 - sigma); dxr += dl gs.
template <typename T>
__global__ void shared_gate_backward(int64_t tokens, int64_t h, const float* partial, int64_t nt, const float* sigma,
                                     const T* gs, float* dl, float* dxr) {
  const int64_t t = blockIdx.x;
  if (t >= tokens) return;
  float acc = 0.0f;
  for (int64_t j = 0; j < nt; ++j) acc += partial[t * nt + j];
  const float d = acc * sigma[t] * (1.0f - sigma[t]);
  if (threadIdx.x == 0) dl[t] = d;
  for (int64_t c = threadIdx.x; c < h; c += blockDim.x) dxr[t * h + c] += d * to_f32(gs[c]);
}

// dgs[c] = sum_t dl_t x[t, c], t in order.
template <typename T>
__global__ void shared_gate_grad(int64_t tokens, int64_t h, const float* dl, const T* x, int64_t ldx, T* dgs) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= h) return;
  float acc = 0.0f;
  for (int64_t t = 0; t < tokens; ++t) acc += dl[t] * to_f32(x[t * ldx + c]);
  dgs[c] = from_f32<T>(acc);
}

// ---- GEMM launches --------------------------------------------------------------------------------

bool vec_ok(std::initializer_list<const void*> ptrs, std::initializer_list<int64_t> nums) {
  for (const void* q : ptrs)
    if (q && (reinterpret_cast<uintptr_t>(q) & 15u)) return false;
  for (int64_t n : nums)
    if (n % 8) return false;
  return true;
}

template <typename T, bool AK, bool BKc, gemm::Epi E> void launch_one(const gemm::Args<T>& a, dim3 grid, cudaStream_t st) {
  auto* fn = gemm::grouped_gemm<T, AK, BKc, E>;
  cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, gemm::SMEM_BYTES);
  fn<<<grid, gemm::THREADS, gemm::SMEM_BYTES, st>>>(a);
}

template <typename T> void launch(const gemm::Args<T>& a, gemm::Epi e, int64_t gx, int64_t gy, int64_t gz, cudaStream_t st) {
  if (gx <= 0 || gy <= 0 || gz <= 0) return;
  const dim3 grid(static_cast<unsigned>(gx), static_cast<unsigned>(gy), static_cast<unsigned>(gz));
  using gemm::Epi;
  switch (e) {
    case Epi::Store:
      if (a.a_kcontig && a.b_kcontig) launch_one<T, true, true, Epi::Store>(a, grid, st);
      else if (a.a_kcontig) launch_one<T, true, false, Epi::Store>(a, grid, st);
      break;
    case Epi::Glu:
      if (a.b_kcontig) launch_one<T, true, true, Epi::Glu>(a, grid, st);
      else launch_one<T, true, false, Epi::Glu>(a, grid, st);
      break;
    case Epi::BwdGlu:
      if (a.b_kcontig) launch_one<T, true, true, Epi::BwdGlu>(a, grid, st);
      else launch_one<T, true, false, Epi::BwdGlu>(a, grid, st);
      break;
    case Epi::Wgrad: launch_one<T, false, false, Epi::Wgrad>(a, grid, st); break;
  }
}

// A weight Matrix as a GEMM's B (element (k, n) = W[n][k]: "the weight applied", x W^T) or (k, n) =
// W[k][n] ("the weight transposed applied", dy W).
template <typename T> void b_from(gemm::Args<T>& a, const Matrix& w, bool transposed_use) {
  const bool row_contig = w.col_stride == 1;  // rows of W contiguous (else its columns)
  a.b0 = static_cast<const T*>(w.data);
  a.b_gstride = w.expert_stride;
  a.ldb = row_contig ? w.row_stride : w.col_stride;
  a.b_kcontig = transposed_use ? !row_contig : row_contig;
}

// Grid of the grouped (MGroup) or single GEMMs over rows.
int64_t grid_y_rows(gemm::Grouping g, int64_t rows, int64_t groups) {
  return g == gemm::Grouping::MGroup ? ceil_div(rows, gemm::BM) + groups : ceil_div(rows, gemm::BM);
}

// ---- the cuBLAS paths ------------------------------------------------------------------------------
//
// The experts' GEMMs with the tokens already in expert order (positions): per expert e with n_e > 0
// positions [o_e, o_e + n_e), row-major,
//   forward   gu_e = xs_e [Wg_e; Wu_e]^T   h = round(act(g) u) (a kernel)   y_e = h_e Wd_e^T
//   backward  q_e = dout_e Wd_e   (dgu, c h, q . h: a kernel)   dWd_e = dout_e^T (c h)_e
//             dxs_e = dgu_e [Wg_e; Wu_e]   dWgu_e = dgu_e^T xs_e
// where xs (and dout_e, backward) are the token rows gathered by position first (cuBLAS reads no
// gather), and an expert without positions gets dW_e = 0 from a kernel (no GEMM with k = 0).  Gate
// and up are one [2I, H] product where up's rows follow gate's in memory (Transformers' gate_up_proj,
// Llama 4's seen transposed), else two, into / from the two halves of gu and dgu.
//
// cuBLAS is column-major: a row-major [r, c] matrix with row stride ld is its column-major [c, r]
// transpose with leading dimension ld, so the row-major C = A B runs as C^T = B^T A^T (cuBLAS's
// first operand is B, its m is our n).  f32 accumulation (CUBLAS_COMPUTE_32F) and f32 split-k
// reductions (CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION); results in the dtype.
//
// The group sizes come to the host once per call (cudaMemcpyAsync of the offsets into pinned memory,
// then a wait for the copy alone, Blas::read_back; for the stream where the backward gathers x by
// row into the buffer dout goes through).
// Loop: one cublasGemmEx per expert with positions.  Grouped: one cublasGemmGroupedBatchedEx per product, the experts with equal n_e one group (a group shares m, n,
// k, the leading dims and the scalars; its A, B, C pointers are device arrays, copied from pinned host
// memory into the workspace), cuBLAS 12.5 on.
//
// Padded (moe.h: PaddedLayout): the buffers by row hold row r = (e - first) M + j of expert e's j-th
// position when j < n_e, a zero row (xs, dout) or a row of zeros written by the kernels (h, dgu, c h)
// when j >= n_e; every product of the list above is one cublasGemmStridedBatchedEx over the experts
// first .. last (with gate_up saved, one a group of them: moe.h, Padded's groups) with m = M (k = M
// for the weight gradients), the batch strides M rows of the
// buffers and the weights' expert stride.  The gathers write the padded rows directly (zeros
// included), the GLU kernels copy [g, u] to the saved gate_up by position (forward) or read it from
// there (backward), and afterwards each slot's position becomes its padded row (pad_positions) for
// combine and dw.

enum class Path { Kernel, Loop, Grouped, Padded, Auto };  // Auto: Loop, Grouped or Padded, chosen from the counts

// The path asked for: p.expert_gemm, else KCPP_MOE_GEMM, else by size (moe.h), before the capture test.
const char* requested_path(const MoeParams& p, Path* out) {
  ExpertGemm g = p.expert_gemm;
  if (g == ExpertGemm::Auto) {
    const char* env = std::getenv("KCPP_MOE_GEMM");
    if (env && *env) {
      if (!std::strcmp(env, "kernel")) g = ExpertGemm::Kernel;
      else if (!std::strcmp(env, "loop")) g = ExpertGemm::Loop;
      else if (!std::strcmp(env, "grouped")) g = ExpertGemm::Grouped;
      else if (!std::strcmp(env, "padded")) g = ExpertGemm::Padded;
      else if (std::strcmp(env, "auto"))
        return errorf("moe: KCPP_MOE_GEMM='%.64s' is none of kernel, loop, grouped, padded, auto", env);
    }
  }
  switch (g) {
    case ExpertGemm::Kernel: *out = Path::Kernel; break;
    case ExpertGemm::Loop: *out = Path::Loop; break;
    case ExpertGemm::Grouped: *out = Path::Grouped; break;
    case ExpertGemm::Padded: *out = Path::Padded; break;
    default: *out = Path::Auto;
  }
  return nullptr;
}

// Whether the workspace holds the cuBLAS paths' buffers (an unknown KCPP_MOE_GEMM: the call fails).
bool cublas_workspace(const MoeParams& p) {
  Path path = Path::Kernel;
  return requested_path(p, &path) != nullptr || path != Path::Kernel;
}

// The rows of Padded's buffers the workspace holds (moe.h: workspace_padded_rows) for the path asked
// for, on the current device (its multiprocessors decide whether Auto can take Padded).
int64_t padded_workspace_rows(const MoeParams& p) {
  Path path = Path::Kernel;
  const bool unknown = requested_path(p, &path) != nullptr;
  if (!unknown && path != Path::Padded && path != Path::Auto) return 0;
  if (unknown || path == Path::Padded) return padded_rows_cap(moe_slots(p), p.experts, true);
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    cudaGetLastError();
    return padded_rows_cap(moe_slots(p), p.experts, false);
  }
  return workspace_padded_rows(ExpertGemm::Auto, moe_slots(p), p.experts, p.hidden, p.inter, kernel::cuda::sm_count(device));
}

// Whether this call's path is Loop whatever the counts (moe.h: Loop's smaller buffers): Loop asked
// for, or Auto where auto_always_loop on the current device.
bool loop_only(const MoeParams& p) {
  Path path = Path::Kernel;
  if (requested_path(p, &path) != nullptr) return false;
  if (path == Path::Loop) return true;
  if (path != Path::Auto) return false;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return auto_always_loop(p.hidden, p.inter, kernel::cuda::sm_count(device));
}

// Whether a forward under Auto takes the package's GEMM on its Hopper kernel (moe_gemm_sm90.cuh: no
// read-back of the counts, no padding, the activation in the epilogue) rather than cuBLAS: where that
// kernel can run (bf16 / f16 weights contiguous along K with 16-byte aligned bases and strides, and a
// 16-byte aligned saved gate_up), up to kSm90AutoRows slots an expert on average (moe.h), and where
// Auto's rule does not take Loop whatever the counts (a few large experts, each a GEMM that fills the
// GPU: there cuBLAS is ahead from 512 tokens on).
bool auto_sm90_forward(const MoeParams& p) {
  Path path = Path::Kernel;
  if (requested_path(p, &path) != nullptr || path != Path::Auto || !gemm::sm90::enabled()) return false;
  if (p.dtype != DType::bf16 && p.dtype != DType::f16) return false;
  if (p.hidden % 8 || p.inter % 8 || moe_slots(p) > kSm90AutoRows * p.experts) return false;
  for (const Matrix* m : {&p.gate, &p.up, &p.down})
    if (m->col_stride != 1 || m->row_stride % 8 || m->expert_stride % 8 || !kernel::cuda::aligned16(m->data)) return false;
  if (p.gate_up && !kernel::cuda::aligned16(p.gate_up)) return false;  // the kernel would refuse it
  return !auto_always_loop(p.hidden, p.inter, gemm::sm90::sm_count());
}

Bufs call_layout(const MoeParams& p, bool bwd, Carve& cv) {
  if (!bwd && auto_sm90_forward(p)) return layout(p, false, cv, false, 0, false);
  return layout(p, bwd, cv, cublas_workspace(p), padded_workspace_rows(p), loop_only(p));
}

// The package's GEMM (Kernel; under graph capture every path) needs whole [rows, I] buffers.
const char* kernel_fits(const Bufs& b, int64_t inter, bool bwd, const char* call) {
  if (bwd ? b.ch_cols >= inter : b.h_elems >= b.rows * inter) return nullptr;
  return errorf("moe %s: under CUDA graph capture the experts run on the package's GEMM, which needs the whole [%lld, %lld] "
                "buffers; this workspace holds the cuBLAS paths' smaller ones. Size the workspace of a call to be captured with "
                "expert_gemm = Kernel (or KCPP_MOE_GEMM=kernel)",
                call, static_cast<long long>(b.rows), static_cast<long long>(inter));
}

// This call's path: Kernel while `st` is being captured into a graph (no host read-back there).
const char* call_path(const MoeParams& p, cudaStream_t st, Path* out) {
  if (const char* e = requested_path(p, out)) return e;
  if (*out == Path::Kernel) return nullptr;
  cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(st, &cs) != cudaSuccess) {  // e.g. the legacy stream while another captures
    cudaGetLastError();
    cs = cudaStreamCaptureStatusActive;
  }
  if (cs != cudaStreamCaptureStatusNone) *out = Path::Kernel;
  return nullptr;
}

// Per device and host thread (a cuBLAS handle must not be used by two threads at once): the handle,
// pinned memory for the offsets read back and for the grouped calls' pointer arrays, and an event
// recorded after the last copy out of those arrays (a call waits on it before writing them again).
// Never destroyed: destroying at thread or process exit can run after the CUDA context is gone.
constexpr int kMaxExperts = 1024;  // moe_cuda_unsupported
constexpr int64_t kPtrSlots = int64_t(kMaxCublasGemms) * 3 * kMaxExperts;
struct HostSide {
  cublasHandle_t handle = nullptr;
  int32_t* offsets = nullptr;   // [kMaxExperts + 1]
  void** ptrs = nullptr;  // [kPtrSlots]
  cudaEvent_t copied = nullptr;
  bool pending = false;  // `copied` recorded since the last wait
  cudaEvent_t read = nullptr;  // recorded after the offsets' copy to the host (Blas::read_back)
};

const char* host_side(HostSide** out) {
  thread_local HostSide sides[64];
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= 64) return "moe: no usable CUDA device";
  HostSide& h = sides[device];
  if (!h.handle) {
    cublasHandle_t handle = nullptr;
    cublasStatus_t s = cublasCreate(&handle);
    if (s != CUBLAS_STATUS_SUCCESS) return errorf("moe: cublasCreate failed: %s", cublasGetStatusString(s));
    s = cublasSetMathMode(handle, static_cast<cublasMath_t>(CUBLAS_DEFAULT_MATH | CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION));
    if (s != CUBLAS_STATUS_SUCCESS) {
      cublasDestroy(handle);
      return errorf("moe: cublasSetMathMode failed: %s", cublasGetStatusString(s));
    }
    h.handle = handle;
  }
  if (!h.offsets) {
    void* q = nullptr;
    if (cudaMallocHost(&q, (kMaxExperts + 1) * sizeof(int32_t)) != cudaSuccess) {
      cudaGetLastError();
      return "moe: could not allocate pinned host memory for the expert offsets";
    }
    h.offsets = static_cast<int32_t*>(q);
  }
  if (!h.ptrs) {
    void* q = nullptr;
    if (cudaMallocHost(&q, static_cast<size_t>(kPtrSlots) * sizeof(void*)) != cudaSuccess) {
      cudaGetLastError();
      return "moe: could not allocate pinned host memory for the grouped GEMM's pointers";
    }
    h.ptrs = static_cast<void**>(q);
  }
  if (!h.copied && cudaEventCreateWithFlags(&h.copied, cudaEventDisableTiming) != cudaSuccess) {
    h.copied = nullptr;
    cudaGetLastError();
    return "moe: could not create a CUDA event";
  }
  if (!h.read && cudaEventCreateWithFlags(&h.read, cudaEventDisableTiming) != cudaSuccess) {
    h.read = nullptr;
    cudaGetLastError();
    return "moe: could not create a CUDA event";
  }
  *out = &h;
  return nullptr;
}

// A row-major operand: X(r, c) = p[r ld + c], or p[c ld + r] when t (the storage holds X^T).
struct Op {
  const void* p;
  int64_t ld;
  bool t;
};
Op tr(Op o) {
  o.t = !o.t;
  return o;
}
// Rows [row0, ...) of a row-major buffer.
Op rows_op(const void* base, int64_t row0, int64_t ld, int64_t eb) {
  return {static_cast<const char*>(base) + row0 * ld * eb, ld, false};
}
// Columns [col0, ...) of an operand.
Op cols_op(Op o, int64_t col0, int64_t eb) {
  o.p = static_cast<const char*>(o.p) + (o.t ? col0 * o.ld : col0) * eb;
  return o;
}
// Expert e's rows x cols matrix of a stack (a weight, or a weight gradient written).
Op matrix_op(const Matrix& m, int64_t e, int64_t rows, int64_t cols, int64_t eb) {
  bool cm = false;
  int64_t ld = 1;
  matrix_storage(rows, cols, m.row_stride, m.col_stride, &cm, &ld);
  return {static_cast<const char*>(m.data) + e * m.expert_stride * eb, ld, cm};
}

// Gate and up as one [2I, H] stack: up's rows follow gate's, with the same strides.
bool one_stack(const Matrix& g, const Matrix& u, int64_t inter, int64_t h, int64_t eb) {
  bool cm = false;
  int64_t ld = 0;
  return g.data && u.data && g.expert_stride == u.expert_stride && g.row_stride == u.row_stride &&
         g.col_stride == u.col_stride &&
         static_cast<const char*>(u.data) == static_cast<const char*>(g.data) + inter * g.row_stride * eb &&
         matrix_storage(2 * inter, h, g.row_stride, g.col_stride, &cm, &ld);
}

// One expert's row-major C [m, n] = A [m, k] B [k, n] + beta C.
struct Prod {
  int64_t m, n, k;
  Op a, b, c;  // c is written
  float beta;
};

// A Prod as cuBLAS's arguments (column-major C^T = B^T A^T; a C stored transposed first turns the
// product around: C^T = B^T A^T row-major).
struct BlasArgs {
  cublasOperation_t ta, tb;
  int64_t m, n, k;
  const void *a, *b;
  int64_t lda, ldb;
  void* c;
  int64_t ldc;
  float beta;
};
BlasArgs blas_args(Prod q) {
  if (q.c.t) q = Prod{q.n, q.m, q.k, tr(q.b), tr(q.a), tr(q.c), q.beta};
  return {q.b.t ? CUBLAS_OP_T : CUBLAS_OP_N, q.a.t ? CUBLAS_OP_T : CUBLAS_OP_N, q.n, q.m, q.k, q.b.p, q.a.p, q.b.ld, q.a.ld,
          const_cast<void*>(q.c.p), q.c.ld, q.beta};
}

cudaDataType_t blas_type(DType t) { return t == DType::f16 ? CUDA_R_16F : CUDA_R_16BF; }

// Padded's layout as the kernels see it: row r is expert first + r / m's (r % m)-th row; m == 0: no
// padding (row r is position r).
struct Pad {
  int64_t m = 0;
  int first = 0;
  const int32_t* offsets = nullptr;
};
// The position in row r, or -1 for a padding row.
__device__ __forceinline__ int32_t position_of(const Pad& pd, int64_t r) {
  if (pd.m == 0) return static_cast<int32_t>(r);
  const int e = pd.first + static_cast<int>(r / pd.m);
  const int64_t j = r % pd.m;
  const int32_t o = pd.offsets[e];
  return j < pd.offsets[e + 1] - o ? o + static_cast<int32_t>(j) : -1;
}

// One call's cuBLAS state: the handle on the stream, the counts read back, the experts with
// positions (by count, descending, then by index), the runs of equal counts among them and the
// padded layout (Padded).
class Blas {
 public:
  const char* begin(Path path, const int32_t* offsets, int64_t experts, DType dt, const Bufs& b, int64_t h, int64_t inter,
                    int64_t slots, cudaStream_t st) {
    if (const char* e = host_side(&hs_)) return e;
    st_ = st, dt_ = blas_type(dt), dev_ptrs_ = b.ptrs, experts_ = experts;
    // cuBLAS's stream and workspace first: set while the GPU still works on what the read-back waits for.
    const bool blas_set = cublasSetStream(hs_->handle, st) == CUBLAS_STATUS_SUCCESS &&  // before the workspace: it resets it
                          cublasSetWorkspace(hs_->handle, b.blas, kCublasWorkspace) == CUBLAS_STATUS_SUCCESS;
    cudaError_t err = cudaSuccess;
    const bool enqueued = read_pending_;
    if (enqueued) {  // read_back enqueued the copy before the work that follows it on the stream
      err = cudaEventSynchronize(hs_->read);  // also on failure: no copy into the pinned offsets outlives the call
      read_pending_ = false;
    }
    if (!blas_set) return "moe: could not set cuBLAS's stream and workspace";
    if (!enqueued) {
      err = cudaMemcpyAsync(hs_->offsets, offsets, static_cast<size_t>(experts + 1) * sizeof(int32_t), cudaMemcpyDeviceToHost, st);
      if (err == cudaSuccess) err = cudaStreamSynchronize(st);
    }
    if (err != cudaSuccess) return errorf("moe: reading the expert offsets back failed: %s", cudaGetErrorString(err));
    off_.assign(hs_->offsets, hs_->offsets + experts + 1);
    if (!offsets_group_slots(off_.data(), experts, slots))  // the positions index sorted_slots [S]
      return errorf("moe: expert_offsets are not a grouping of the %lld slots: they must start at 0, never decrease and end "
                    "at most at %lld (expert_offsets[0] = %lld, expert_offsets[E] = %lld)",
                    static_cast<long long>(slots), static_cast<long long>(slots), static_cast<long long>(off_[0]),
                    static_cast<long long>(off_[experts]));
    order_.clear();
    for (int64_t e = 0; e < experts; ++e)
      if (count(e) > 0) order_.push_back(static_cast<int>(e));
    std::stable_sort(order_.begin(), order_.end(), [&](int x, int y) { return count(x) > count(y); });
    runs_.clear();
    for (size_t q = 0; q < order_.size(); ++q) {
      if (q == 0 || count(order_[q]) != count(order_[q - 1])) runs_.push_back(0);
      ++runs_.back();
    }
    if (path == Path::Loop || path == Path::Grouped) {
      path_ = path;
    } else {
      int device = 0;
      cudaGetDevice(&device);
      const ExpertGemm g = choose_expert_gemm(path == Path::Padded ? ExpertGemm::Padded : ExpertGemm::Auto, hs_->offsets, experts,
                                              h, inter, slots, kernel::cuda::sm_count(device));
      path_ = g == ExpertGemm::Padded ? Path::Padded : g == ExpertGemm::Loop ? Path::Loop : Path::Grouped;
      static std::atomic<bool> told{false};
      if (path == Path::Padded && path_ != Path::Padded && !told.exchange(true))
        std::fprintf(stderr, "kcpp moe: the padded layout needs more rows than the workspace holds (moe.h: padded_rows_cap); "
                             "running Grouped\n");
    }
    if (path_ == Path::Padded) pad_ = padded_layout(hs_->offsets, experts);
    if (path_ == Path::Padded && b.group_rows > 0 && pad_.rows > b.group_rows) {  // no expert fits a group
      path_ = Path::Grouped;
      static std::atomic<bool> told{false};
      if (!told.exchange(true))
        std::fprintf(stderr, "kcpp moe: an expert's %lld padded rows are more than a group of the workspace holds (%lld); "
                             "running Grouped\n", static_cast<long long>(pad_.rows), static_cast<long long>(b.group_rows));
    }
    group_ = {pad_.first, pad_.experts};
    return nullptr;
  }

  // Enqueues the offsets' copy to the host now; begin() then waits for that copy alone, so that
  // work enqueued in between (gather_before_read_back's planned gather) runs while the host waits and
  // decides.
  const char* read_back(const int32_t* offsets, int64_t experts, cudaStream_t st) {
    if (const char* e = host_side(&hs_)) return e;
    cudaError_t err = cudaMemcpyAsync(hs_->offsets, offsets, static_cast<size_t>(experts + 1) * sizeof(int32_t),
                                      cudaMemcpyDeviceToHost, st);
    if (err == cudaSuccess) err = cudaEventRecord(hs_->read, st);
    if (err != cudaSuccess) return errorf("moe: reading the expert offsets back failed: %s", cudaGetErrorString(err));
    read_pending_ = true;
    return nullptr;
  }

  int64_t count(int64_t e) const { return off_[e + 1] - off_[e]; }
  int64_t offset(int64_t e) const { return off_[e]; }
  int64_t valid() const { return off_[experts_]; }
  bool any_empty() const { return static_cast<int64_t>(order_.size()) < experts_; }
  bool padded() const { return path_ == Path::Padded; }
  // Expert e's rows in the buffers by row: its count from its first position, or Padded's M from
  // its block; the rows of those buffers in use; the layout for the kernels.
  int64_t rows(int64_t e) const { return padded() ? pad_.rows : count(e); }
  int64_t row0(int64_t e) const { return padded() ? (e - pad_.first) * pad_.rows : offset(e); }
  int64_t buffer_rows() const { return padded() ? pad_.experts * pad_.rows : valid(); }
  const char* path_name() const { return padded() ? "Padded" : path_ == Path::Loop ? "Loop" : "Grouped"; }
  Pad pad(const int32_t* offsets) const {
    Pad pd;
    if (padded()) pd.m = pad_.rows, pd.first = static_cast<int>(pad_.first), pd.offsets = offsets;
    return pd;
  }

  // The product `prod(e)` (a Prod) of every expert with positions.
  template <typename F> const char* run(const char* what, const F& prod) {
    if (order_.empty()) return nullptr;
    if (path_ == Path::Padded) {
      const cublasStatus_t s = strided(prod);
      if (s == CUBLAS_STATUS_SUCCESS) return nullptr;
      return errorf("moe: cublasGemmStridedBatchedEx (%s, %lld experts of %lld rows) failed: %s", what,
                    static_cast<long long>(group_.second), static_cast<long long>(pad_.rows), cublasGetStatusString(s));
    }
    if (path_ == Path::Grouped) {
      const cublasStatus_t s = grouped(prod);
      if (s == CUBLAS_STATUS_SUCCESS) return nullptr;
      if (s != CUBLAS_STATUS_NOT_SUPPORTED && s != CUBLAS_STATUS_INVALID_VALUE)
        return errorf("moe: cublasGemmGroupedBatchedEx (%s) failed: %s", what, cublasGetStatusString(s));
      static std::atomic<bool> told{false};  // refused: the loop below does the same products
      if (!told.exchange(true))
        std::fprintf(stderr, "kcpp moe: cublasGemmGroupedBatchedEx refused %s (%s); running it as cublasGemmEx per expert\n",
                     what, cublasGetStatusString(s));
    }
    for (int e : order_)
      if (const char* err = one(what, e, prod(e))) return err;
    return nullptr;
  }

  // One product of expert e (for its name in an error).
  const char* one(const char* what, int e, const Prod& prod) const {
    const float alpha = 1.0f;
    const BlasArgs g = blas_args(prod);
    const cublasStatus_t s = cublasGemmEx_64(hs_->handle, g.ta, g.tb, g.m, g.n, g.k, &alpha, g.a, dt_, g.lda, g.b, dt_, g.ldb,
                                             &g.beta, g.c, dt_, g.ldc, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    if (s == CUBLAS_STATUS_SUCCESS) return nullptr;
    return errorf("moe: cublasGemmEx (%s, expert %d: m %lld n %lld k %lld) failed: %s", what, e, static_cast<long long>(g.m),
                  static_cast<long long>(g.n), static_cast<long long>(g.k), cublasGetStatusString(s));
  }
  // Padded: the products of run() over the experts [e0, e1) of the padded range only (a group).
  void limit(int64_t e0, int64_t e1) { group_ = {e0, e1 - e0}; }
  void unlimit() { group_ = {pad_.first, pad_.experts}; }
  const PaddedLayout& layout() const { return pad_; }
  // The experts with positions, by count (descending), then index.
  const std::vector<int>& experts() const { return order_; }
  bool loop() const { return path_ == Path::Loop; }

 private:
  // Padded: the products of experts first and first + 1 give the batch strides (every operand's
  // address is affine in the expert: rows of a buffer by row0(), or a weight's expert stride).
  template <typename F> cublasStatus_t strided(const F& prod) {
    const int64_t nb = group_.second, eb = 2;  // bf16 / f16
    const BlasArgs a = blas_args(prod(static_cast<int>(group_.first)));
    long long sa = 0, sb = 0, sc = 0;
    if (nb > 1) {
      const BlasArgs z = blas_args(prod(static_cast<int>(group_.first + 1)));
      sa = (static_cast<const char*>(z.a) - static_cast<const char*>(a.a)) / eb;
      sb = (static_cast<const char*>(z.b) - static_cast<const char*>(a.b)) / eb;
      sc = (static_cast<const char*>(z.c) - static_cast<const char*>(a.c)) / eb;
    }
    const float one = 1.0f;
    return cublasGemmStridedBatchedEx_64(hs_->handle, a.ta, a.tb, a.m, a.n, a.k, &one, a.a, dt_, a.lda, sa, a.b, dt_, a.ldb, sb,
                                         &a.beta, a.c, dt_, a.ldc, sc, nb, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  }

  template <typename F> cublasStatus_t grouped(const F& prod) {
    const int64_t np = static_cast<int64_t>(order_.size()), ng = static_cast<int64_t>(runs_.size());
    if (used_ + 3 * np > int64_t(kMaxCublasGemms) * 3 * experts_) return CUBLAS_STATUS_NOT_SUPPORTED;  // (never: see there)
    if (used_ == 0 && hs_->pending) {  // an earlier call's copies out of the pinned arrays (this call's use other slots)
      if (cudaEventSynchronize(hs_->copied) != cudaSuccess) return CUBLAS_STATUS_EXECUTION_FAILED;
      hs_->pending = false;
    }
    std::vector<cublasOperation_t> ta(ng), tb(ng);
    std::vector<int64_t> m(ng), n(ng), k(ng), lda(ng), ldb(ng), ldc(ng), size(runs_.begin(), runs_.end());
    std::vector<float> alpha(ng, 1.0f), beta(ng);
    void** host = hs_->ptrs + used_;
    int64_t q = 0;
    for (int64_t g = 0; g < ng; ++g)
      for (int64_t j = 0; j < runs_[g]; ++j, ++q) {
        const BlasArgs a = blas_args(prod(order_[q]));
        if (j == 0) ta[g] = a.ta, tb[g] = a.tb, m[g] = a.m, n[g] = a.n, k[g] = a.k, lda[g] = a.lda, ldb[g] = a.ldb, ldc[g] = a.ldc, beta[g] = a.beta;
        host[q] = const_cast<void*>(a.a), host[np + q] = const_cast<void*>(a.b), host[2 * np + q] = a.c;
      }
    void** dev = dev_ptrs_ + used_;
    used_ += 3 * np;
    if (cudaMemcpyAsync(dev, host, static_cast<size_t>(3 * np) * sizeof(void*), cudaMemcpyHostToDevice, st_) != cudaSuccess ||
        cudaEventRecord(hs_->copied, st_) != cudaSuccess)
      return CUBLAS_STATUS_EXECUTION_FAILED;
    hs_->pending = true;
    return cublasGemmGroupedBatchedEx_64(hs_->handle, ta.data(), tb.data(), m.data(), n.data(), k.data(), alpha.data(), dev, dt_,
                                         lda.data(), dev + np, dt_, ldb.data(), beta.data(), dev + 2 * np, dt_, ldc.data(), ng,
                                         size.data(), CUBLAS_COMPUTE_32F);
  }

  HostSide* hs_ = nullptr;
  bool read_pending_ = false;
  cudaStream_t st_ = nullptr;
  cudaDataType_t dt_ = CUDA_R_16BF;
  void** dev_ptrs_ = nullptr;
  int64_t experts_ = 0, used_ = 0;
  Path path_ = Path::Loop;
  PaddedLayout pad_;
  std::pair<int64_t, int64_t> group_;  // Padded: the first expert and the count run() takes
  std::vector<int64_t> off_, runs_;
  std::vector<int> order_;
};

// Whether the rows by row of the path chosen (buffer_rows) fit the workspace's (Bufs::rows), checked
// on the host after the read-back: a layout the workspace was not sized for (a padded bound of
// choose_expert_gemm unlike the one layout() took) is refused by name, never written past.
const char* rows_fit(const Blas& blas, const Bufs& b, const char* call) {
  if (blas.buffer_rows() <= b.rows) return nullptr;
  return errorf("moe %s: the %s path needs %lld rows by row, the workspace holds %lld (moe.h: padded_rows_cap)", call,
                blas.path_name(), static_cast<long long>(blas.buffer_rows()), static_cast<long long>(b.rows));
}

// rows[r] = x_t of row r's position q (t = sorted[q] / k), or round(w x_t) with w = w[sorted[q]]
// when w is given (Input); a row of zeros for a padding row (Pad).  A warp per row, V elements a lane
// a step, four steps' loads issued together.
constexpr int kGatherWarps = 8;
template <typename T, int V>
__device__ __forceinline__ void gather_row(int64_t r, int64_t h, int k, const Pad& pd, const int32_t* sorted, const float* w, const T* x,
                                           int64_t ldx, T* rows) {
  const int lane = threadIdx.x & 31;
  const int32_t q = position_of(pd, r);
  T* dst = rows + r * h;
  constexpr int64_t step = 32 * V;
  if (q < 0) {
    const float zero[V] = {};
    for (int64_t c = lane * V; c < h; c += step) kernel::cuda::store_f32<T, V>(dst + c, zero);
    return;
  }
  const int32_t slot = sorted[q];
  const T* src = x + static_cast<int64_t>(slot / k) * ldx;
  const float wv = w ? w[slot] : 1.0f;
  int64_t c = lane * V;
  for (; c + 3 * step < h; c += 4 * step) {
    kernel::cuda::Vec<T, V> v[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) v[u] = *reinterpret_cast<const kernel::cuda::Vec<T, V>*>(src + c + u * step);
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      if (w) {
        float f[V];
        kernel::cuda::widen(v[u], f);
#pragma unroll
        for (int j = 0; j < V; ++j) f[j] *= wv;
        kernel::cuda::store_f32<T, V>(dst + c + u * step, f);
      } else {
        *reinterpret_cast<kernel::cuda::Vec<T, V>*>(dst + c + u * step) = v[u];
      }
    }
  }
  for (; c < h; c += step) {
    const kernel::cuda::Vec<T, V> v = *reinterpret_cast<const kernel::cuda::Vec<T, V>*>(src + c);
    if (w) {
      float f[V];
      kernel::cuda::widen(v, f);
#pragma unroll
      for (int j = 0; j < V; ++j) f[j] *= wv;
      kernel::cuda::store_f32<T, V>(dst + c, f);
    } else {
      *reinterpret_cast<kernel::cuda::Vec<T, V>*>(dst + c) = v;
    }
  }
}

template <typename T, int V>
__global__ void gather_rows(int64_t n, int64_t h, int k, Pad pd, const int32_t* sorted, const float* w, const T* x, int64_t ldx,
                            T* rows) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kGatherWarps + (threadIdx.x >> 5);
  if (r < n) gather_row<T, V>(r, h, k, pd, sorted, w, x, ldx, rows);
}

// The layout decided on the device from the counts, as Blas::begin decides it on the host once they
// are read back (the same functions, moe.h): plan = {padded, first, experts, rows}.
struct Plan {
  int32_t padded, first, experts, rows;  // padded -1: the offsets are no grouping of the slots
};
__global__ void plan_layout(const int32_t* offsets, int64_t experts, int64_t hidden, int64_t inter, int64_t slots, int64_t sms,
                            ExpertGemm asked, int64_t group_rows, Plan* plan) {
  // Offsets that are no grouping of the slots: no rows, so that the gather reads nothing past
  // sorted_slots before the host has refused them.
  if (!offsets_group_slots(offsets, experts, slots)) {
    *plan = Plan{-1, 0, 0, 0};
    return;
  }
  Plan q{0, 0, 0, 0};
  if (choose_expert_gemm(asked, offsets, experts, hidden, inter, slots, sms) == ExpertGemm::Padded) {
    const PaddedLayout l = padded_layout(offsets, experts);
    if (group_rows <= 0 || l.rows <= group_rows)  // else Grouped: no expert fits a group
      q = Plan{1, static_cast<int32_t>(l.first), static_cast<int32_t>(l.experts), static_cast<int32_t>(l.rows)};
  }
  *plan = q;
}

// gather_rows over the layout of `plan`: its rows (the padded ones, or the valid positions), at most
// the grid's.
template <typename T, int V>
__global__ void gather_planned(const Plan* plan, int64_t max_rows, int64_t experts, int64_t h, int k, const int32_t* offsets,
                               const int32_t* sorted, const float* w, const T* x, int64_t ldx, T* rows) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kGatherWarps + (threadIdx.x >> 5);
  const Plan q = *plan;
  if (q.padded < 0) return;  // no grouping of the slots (plan_layout)
  const int64_t n = q.padded ? static_cast<int64_t>(q.experts) * q.rows : offsets[experts];
  if (r >= n || r >= max_rows) return;  // a layout past the workspace is refused by the host after the read-back
  Pad pd;
  if (q.padded) pd.m = q.rows, pd.first = q.first, pd.offsets = offsets;
  gather_row<T, V>(r, h, k, pd, sorted, w, x, ldx, rows);
}

template <typename T> void launch_gather(int64_t n, int64_t h, int64_t k, Pad pd, const int32_t* sorted, const float* w, const T* x,
                                         int64_t ldx, T* rows, cudaStream_t st) {
  if (n <= 0) return;
  const unsigned blocks = static_cast<unsigned>(ceil_div(n, kGatherWarps));
  if (h % 8 == 0 && ldx % 8 == 0 && kernel::cuda::aligned16(x) && kernel::cuda::aligned16(rows))
    gather_rows<T, 8><<<blocks, kGatherWarps * 32, 0, st>>>(n, h, static_cast<int>(k), pd, sorted, w, x, ldx, rows);
  else
    gather_rows<T, 1><<<blocks, kGatherWarps * 32, 0, st>>>(n, h, static_cast<int>(k), pd, sorted, w, x, ldx, rows);
}

// The planned gather over at most `max_rows` rows (the workspace's buffers by row).
template <typename T> void launch_gather_planned(int64_t max_rows, const Plan* plan, int64_t experts, int64_t h, int64_t k,
                                                 const int32_t* offsets, const int32_t* sorted, const float* w, const T* x,
                                                 int64_t ldx, T* rows, cudaStream_t st) {
  if (max_rows <= 0) return;
  const unsigned blocks = static_cast<unsigned>(ceil_div(max_rows, kGatherWarps));
  if (h % 8 == 0 && ldx % 8 == 0 && kernel::cuda::aligned16(x) && kernel::cuda::aligned16(rows))
    gather_planned<T, 8><<<blocks, kGatherWarps * 32, 0, st>>>(plan, max_rows, experts, h, static_cast<int>(k), offsets, sorted, w, x,
                                                                ldx, rows);
  else
    gather_planned<T, 1><<<blocks, kGatherWarps * 32, 0, st>>>(plan, max_rows, experts, h, static_cast<int>(k), offsets, sorted, w, x,
                                                                ldx, rows);
}

// Enqueues the copy of the offsets to the host (Blas::read_back), then plan_layout and the gather of
// src by row over the planned layout into `rows`, so that both run while Blas::begin waits for the
// copy and decides the same layout on the host.  w scales the rows (Input mode's x) or is null.
template <typename T>
const char* gather_before_read_back(Blas& blas, const MoeParams& p, const Bufs& b, Path path, const int32_t* offsets,
                                    const int32_t* sorted, const float* w, const T* src, int64_t ld, T* rows, const char* what,
                                    cudaStream_t st) {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return errorf("moe %s: no usable CUDA device", what);
  const ExpertGemm asked = path == Path::Loop ? ExpertGemm::Loop : path == Path::Grouped ? ExpertGemm::Grouped
                           : path == Path::Padded                ? ExpertGemm::Padded
                                                                 : ExpertGemm::Auto;
  if (const char* e = blas.read_back(offsets, p.experts, st)) return e;
  Plan* plan = static_cast<Plan*>(b.plan);
  plan_layout<<<1, 1, 0, st>>>(offsets, p.experts, p.hidden, p.inter, moe_slots(p), kernel::cuda::sm_count(device), asked,
                               b.group_rows, plan);
  launch_gather_planned<T>(b.rows, plan, p.experts, p.hidden, p.top_k, offsets, sorted, w, src, ld, rows, st);
  return nullptr;
}

// Padded: each slot's position becomes its padded row (Pad), -1 for a slot no expert takes.
__global__ void pad_positions(int64_t s, int e, const int32_t* ids, Pad pd, int32_t* pos) {
  const int64_t q = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (q >= s) return;
  const int32_t id = ids[q];
  pos[q] = id >= 0 && id < e ? static_cast<int32_t>((id - pd.first) * pd.m + (pos[q] - pd.offsets[id])) : -1;
}

// The forward's gated activation by row (a block per row): h[r, i] = round(act(g_i) u_i), [g, u] =
// gu[r] (2I wide), and 0 in a padding row (Pad); `save` (Padded): [g, u] also to save[q] for the
// row's position q.  h may lie over gu's gate half (ldh = 2I): each element is read and written by
// one thread.
template <typename T, int V>
__global__ void glu_rows(int64_t inter, kernel::Activation act, Pad pd, const T* gu, T* h, int64_t ldh, T* save) {
  const int64_t r = blockIdx.x;
  const int32_t q = position_of(pd, r);
  const T* row = gu + r * 2 * inter;
  for (int64_t i = static_cast<int64_t>(threadIdx.x) * V; i < inter; i += static_cast<int64_t>(blockDim.x) * V) {
    float g[V], u[V], out[V];
    if (q < 0) {
#pragma unroll
      for (int j = 0; j < V; ++j) out[j] = 0.0f;
    } else {
      kernel::cuda::load_f32<T, V>(row + i, g);
      kernel::cuda::load_f32<T, V>(row + inter + i, u);
      if (save) {
        kernel::cuda::store_f32<T, V>(save + static_cast<int64_t>(q) * 2 * inter + i, g);
        kernel::cuda::store_f32<T, V>(save + static_cast<int64_t>(q) * 2 * inter + inter + i, u);
      }
#pragma unroll
      for (int j = 0; j < V; ++j) out[j] = gemm::act_eval<T>(act, g[j], nullptr) * u[j];
    }
    kernel::cuda::store_f32<T, V>(h + r * ldh + i, out);
  }
}

template <typename T>
void launch_glu_rows(int64_t rows, int64_t inter, kernel::Activation act, Pad pd, const T* gu, T* h, int64_t ldh, T* save,
                     cudaStream_t st) {
  if (rows <= 0) return;
  if (inter % 8 == 0 && kernel::cuda::aligned16(gu) && kernel::cuda::aligned16(h) && kernel::cuda::aligned16(save))
    glu_rows<T, 8><<<static_cast<unsigned>(rows), 128, 0, st>>>(inter, act, pd, gu, h, ldh, save);
  else
    glu_rows<T, 1><<<static_cast<unsigned>(rows), 128, 0, st>>>(inter, act, pd, gu, h, ldh, save);
}

// The backward's GLU by row r (a block per row) of position p (Pad), over the columns [col0, col0 +
// cols) of I (Loop's chunks, moe.h; else all of them), with q read from ch (the q GEMM's output,
// rounded to the dtype; cols wide), [g, u] = gu[p] (gu_by_position: the saved gate_up) or gu[r], and
// c = w[sorted[p]] (Output; Input: 1):
//   a = act(g), h = round(a u), dh = round(c q), dgu = round([dh u act'(g), dh a]), ch = round(c h),
//   rowsum[r] (+)= sum_i q_i h_i (Output: the slot's dw; `add`: onto the earlier chunks' sum), in a
//   fixed order;
// in a padding row ch and rowsum are 0, and so is dgu's row (none where dgu is by position).  dgu
// lies by row, or by position (dgu_by_position) over the saved gate_up [g, u] is read from: each
// element is read, then written, by one thread; likewise over the recomputed gu by row.
template <typename T, int V>
__global__ void glu_backward_rows(int64_t inter, int64_t col0, int64_t cols, kernel::Activation act, Pad pd, const T* gu,
                                  bool gu_by_position, const float* w, const int32_t* sorted, T* ch, T* dgu, bool dgu_by_position,
                                  float* rowsum, bool add) {
  __shared__ float red[32];
  const int64_t r = blockIdx.x;
  const int32_t p = position_of(pd, r);
  T* chr = ch + r * cols;
  T* dr = dgu + (dgu_by_position ? static_cast<int64_t>(p < 0 ? 0 : p) : r) * 2 * inter + col0;  // unused if p < 0 by position
  if (p < 0) {  // the whole block returns together
    const float zero[V] = {};
    for (int64_t i = static_cast<int64_t>(threadIdx.x) * V; i < cols; i += static_cast<int64_t>(blockDim.x) * V) {
      if (!dgu_by_position) {
        kernel::cuda::store_f32<T, V>(dr + i, zero);
        kernel::cuda::store_f32<T, V>(dr + inter + i, zero);
      }
      kernel::cuda::store_f32<T, V>(chr + i, zero);
    }
    if (rowsum && threadIdx.x == 0) rowsum[r] = 0.0f;
    return;
  }
  const float c = w ? w[sorted[p]] : 1.0f;
  const T* row = gu + (gu_by_position ? static_cast<int64_t>(p) : r) * 2 * inter + col0;
  float acc = 0.0f;
  for (int64_t i = static_cast<int64_t>(threadIdx.x) * V; i < cols; i += static_cast<int64_t>(blockDim.x) * V) {
    float qv[V], g[V], u[V], dg[V], du[V], hc[V];
    kernel::cuda::load_f32<T, V>(chr + i, qv);
    kernel::cuda::load_f32<T, V>(row + i, g);
    kernel::cuda::load_f32<T, V>(row + inter + i, u);
#pragma unroll
    for (int j = 0; j < V; ++j) {
      float da = 0.0f;
      const float a = gemm::act_eval<T>(act, g[j], &da);
      const float hv = kernel::cuda::round_to<T>(a * u[j]);
      acc += qv[j] * hv;
      const float dh = kernel::cuda::round_to<T>(c * qv[j]);
      dg[j] = dh * u[j] * da, du[j] = dh * a, hc[j] = c * hv;
    }
    kernel::cuda::store_f32<T, V>(dr + i, dg);
    kernel::cuda::store_f32<T, V>(dr + inter + i, du);
    kernel::cuda::store_f32<T, V>(chr + i, hc);
  }
  if (rowsum) {
    acc = kernel::cuda::block_sum(acc, red);
    if (threadIdx.x == 0) rowsum[r] = add ? rowsum[r] + acc : acc;
  }
}

// dst[r] = src[p] for the position p in row r (Pad), a row of zeros in a padding row: `width`
// elements a row, a block per row.  Padded's groups: a group's [dg, du] by padded row from the saved
// gate_up they were written over by position.
template <typename T, int V>
__global__ void rows_by_position(int64_t width, Pad pd, const T* src, T* dst) {
  const int64_t r = blockIdx.x;
  const int32_t p = position_of(pd, r);
  T* d = dst + r * width;
  const T* q = src + static_cast<int64_t>(p < 0 ? 0 : p) * width;  // unread in a padding row
  for (int64_t c = static_cast<int64_t>(threadIdx.x) * V; c < width; c += static_cast<int64_t>(blockDim.x) * V) {
    if (p < 0) {
      const float zero[V] = {};
      kernel::cuda::store_f32<T, V>(d + c, zero);
    } else {
      *reinterpret_cast<kernel::cuda::Vec<T, V>*>(d + c) = *reinterpret_cast<const kernel::cuda::Vec<T, V>*>(q + c);
    }
  }
}

// Zeroes the rows x cols matrix of every expert without positions (its weight gradient); the
// contiguous dim innermost.
template <typename T>
__global__ void zero_empty_experts(const int32_t* offsets, T* m, int64_t es, int64_t rs, int64_t cs, int64_t rows, int64_t cols) {
  const int64_t e = blockIdx.y;
  if (offsets[e + 1] != offsets[e]) return;
  const bool by_cols = cs != 1;  // columns contiguous: rows innermost
  const int64_t inner = by_cols ? rows : cols, total = rows * cols;
  const int64_t si = by_cols ? rs : cs, so = by_cols ? cs : rs;
  T* base = m + e * es;
  for (int64_t q = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; q < total;
       q += static_cast<int64_t>(gridDim.x) * blockDim.x)
    base[(q / inner) * so + (q % inner) * si] = from_f32<T>(0.0f);
}

template <typename T>
void zero_empty(const Blas& blas, const int32_t* offsets, int64_t experts, const Matrix& m, int64_t rows, int64_t cols,
                cudaStream_t st) {
  if (!m.data || !blas.any_empty()) return;
  const int64_t blocks = std::min<int64_t>(ceil_div(rows * cols, 256), 256);
  zero_empty_experts<T><<<dim3(static_cast<unsigned>(blocks), static_cast<unsigned>(experts)), 256, 0, st>>>(
      offsets, static_cast<T*>(m.data), m.expert_stride, m.row_stride, m.col_stride, rows, cols);
}

// gu = xs [Wg; Wu]^T of every expert run() takes, by row (2I wide; gu's rows `shift` before the
// buffers' by row: a group's buffer): one product where gate and up are one stack, else one a half.
template <typename T> const char* gate_up_products(const MoeParams& p, Blas& blas, const T* xs, T* gu, int64_t shift = 0) {
  const int64_t h = p.hidden, I = p.inter, eb = sizeof(T);
  if (one_stack(p.gate, p.up, I, h, eb))
    return blas.run("gate_up = x W_gate_up^T", [&](int ex) {
      return Prod{blas.rows(ex), 2 * I, h, rows_op(xs, blas.row0(ex), h, eb), tr(matrix_op(p.gate, ex, 2 * I, h, eb)),
                  rows_op(gu, blas.row0(ex) - shift, 2 * I, eb), 0.0f};
    });
  for (int half = 0; half < 2; ++half)
    if (const char* e = blas.run(half ? "up = x W_up^T" : "gate = x W_gate^T", [&](int ex) {
          return Prod{blas.rows(ex), I, h, rows_op(xs, blas.row0(ex), h, eb), tr(matrix_op(half ? p.up : p.gate, ex, I, h, eb)),
                      rows_op(gu + half * I, blas.row0(ex) - shift, 2 * I, eb), 0.0f};
        }))
      return e;
  return nullptr;
}

// The forward's experts on cuBLAS: the expert inputs by row (gathered, or Input's scaled rows), gu,
// h, then y by row into b.y (which held the gathered inputs until then, in Output mode).  Padded:
// the rows are padded ones, and b.pos then holds each slot's row (*padded set).
//
// The rows are gathered before the host has the counts: the copy of the offsets to the host is
// enqueued, then plan_layout decides the layout on the device with the functions Blas::begin runs on
// the host once the counts are read back (the same decision), then the gather over the planned
// layout, so that the plan and the gather run while the host waits for the copy and decides.
template <typename T>
const char* experts_forward_cublas(const MoeParams& p, const Bufs& b, Path path, const int32_t* offsets, const int32_t* sorted,
                                   const int32_t* ids, const float* w, bool* padded, cudaStream_t st) {
  const int64_t h = p.hidden, I = p.inter, ne = p.experts, eb = sizeof(T), s = moe_slots(p);
  const bool input = p.weight_on == WeightOn::Input;
  const T* x = static_cast<const T*>(p.x);
  T* xs = static_cast<T*>(input ? b.xs : b.y);
  Blas blas;
  if (const char* e = gather_before_read_back<T>(blas, p, b, path, offsets, sorted, input ? w : nullptr, x, p.x_stride, xs, "forward", st))
    return e;
  if (const char* e = blas.begin(path, offsets, ne, p.dtype, b, h, I, s, st)) return e;
  if (const char* e = rows_fit(blas, b, "forward")) return e;
  if (blas.valid() == 0) return nullptr;
  const int64_t n = blas.buffer_rows();
  const Pad pd = blas.pad(offsets);
  // gu: the saved gate_up, or b.h with h over its gate half; Padded: always b.h (padded rows), the
  // GLU kernel copying [g, u] to the saved gate_up by position.
  const bool direct = p.gate_up && !blas.padded();
  T* gu = static_cast<T*>(direct ? p.gate_up : b.h);
  T* hb = direct ? static_cast<T*>(b.h) : gu;
  const int64_t ldh = direct ? I : 2 * I;
  T* save = blas.padded() ? static_cast<T*>(p.gate_up) : nullptr;
  if (b.h_elems < n * ldh && blas.padded()) {  // Padded's groups of experts (moe.h), [g, u] and h a group at a time
    const PaddedLayout& lay = blas.layout();
    const int64_t per = std::max<int64_t>(b.group_rows / lay.rows, 1), end = lay.first + lay.experts;
    T* grp = static_cast<T*>(b.h);
    for (int64_t g0 = lay.first; g0 < end; g0 += per) {
      const int64_t g1 = std::min(g0 + per, end), base = blas.row0(g0), m = (g1 - g0) * lay.rows;
      blas.limit(g0, g1);
      if (const char* e = gate_up_products(p, blas, xs, grp, base)) return e;
      Pad pg = pd;
      pg.first = static_cast<int>(g0);
      launch_glu_rows<T>(m, I, p.act, pg, grp, grp, 2 * I, save, st);
      if (const char* e = blas.run("y = h W_down^T", [&](int ex) {
            return Prod{blas.rows(ex), h, I, rows_op(grp, blas.row0(ex) - base, 2 * I, eb), tr(matrix_op(p.down, ex, h, I, eb)),
                        rows_op(b.y, blas.row0(ex), h, eb), 0.0f};
          }))
        return e;
    }
    blas.unlimit();
  } else if (b.h_elems < n * ldh) {  // Loop's windows (moe.h; Loop's or Padded's buffer, any path but Padded): gate_up
    // whole into the saved one, then h and y a window of an expert's rows at a time
    if (!direct)
      return "moe forward: the workspace was sized for a call that saves gate_up; size it with moe_workspace() for this call";
    const int64_t window = b.h_elems / I;
    if (const char* e = gate_up_products(p, blas, xs, gu)) return e;
    for (int ex : blas.experts())
      for (int64_t a0 = 0; a0 < blas.rows(ex); a0 += window) {
        const int64_t m = std::min(window, blas.rows(ex) - a0), r0 = blas.row0(ex) + a0;
        launch_glu_rows<T>(m, I, p.act, Pad{}, gu + r0 * 2 * I, hb, I, static_cast<T*>(nullptr), st);
        if (const char* e = blas.one("y = h W_down^T", ex, Prod{m, h, I, rows_op(hb, 0, I, eb), tr(matrix_op(p.down, ex, h, I, eb)),
                                                                 rows_op(b.y, r0, h, eb), 0.0f}))
          return e;
      }
  } else {
    if (const char* e = gate_up_products(p, blas, xs, gu)) return e;
    launch_glu_rows<T>(n, I, p.act, pd, gu, hb, ldh, save, st);
    if (const char* e = blas.run("y = h W_down^T", [&](int ex) {
          return Prod{blas.rows(ex), h, I, rows_op(hb, blas.row0(ex), ldh, eb), tr(matrix_op(p.down, ex, h, I, eb)),
                      rows_op(b.y, blas.row0(ex), h, eb), 0.0f};
        }))
      return e;
  }
  if (blas.padded()) {
    pad_positions<<<static_cast<unsigned>(ceil_div(s, 256)), 256, 0, st>>>(s, static_cast<int>(ne), ids, pd, b.pos);
    *padded = true;
  }
  return nullptr;
}

// The backward's experts on cuBLAS, through dxs, the weight gradients and (Output) the row sums of
// q h in b.partial (one per row).  One buffer by row of width H, b.dxs, holds in turn dout by row
// (until dW_down), x by row (until dW_gate_up; b.xs is that buffer unless the weights apply to the
// input) and dx by row, so x is gathered after dout is done with (and once more first when gate_up is
// recomputed).  Padded: the rows are padded ones, and b.pos then holds each slot's row (*padded set).
template <typename T>
const char* experts_backward_cublas(const MoeParams& p, const Bufs& b, Path path, const int32_t* offsets, const int32_t* sorted,
                                    const int32_t* ids, const float* w, bool* padded, cudaStream_t st) {
  const int64_t h = p.hidden, I = p.inter, k = p.top_k, ne = p.experts, eb = sizeof(T), s = moe_slots(p);
  const bool input = p.weight_on == WeightOn::Input;
  T* rows_h = static_cast<T*>(b.dxs);  // dout, then (when xs is this buffer) x, then dx, by row
  // dout by row is gathered before the host has the counts, as the forward gathers x (over the layout
  // plan_layout decides on the device), unless x by row must pass through the same buffer first (gate_up
  // recomputed from x gathered into it).
  const bool dout_early = p.gate_up || b.xs != b.dxs;
  Blas blas;
  if (dout_early)
    if (const char* e = gather_before_read_back<T>(blas, p, b, path, offsets, sorted, nullptr, static_cast<const T*>(p.dout),
                                                   p.dout_stride, rows_h, "backward", st))
      return e;
  if (const char* e = blas.begin(path, offsets, ne, p.dtype, b, h, I, s, st)) return e;
  if (const char* e = rows_fit(blas, b, "backward")) return e;
  // Experts without positions: zero here (Padded: those between first and last get exact zeros
  // from the products again).
  zero_empty<T>(blas, offsets, ne, p.ddown, h, I, st);
  zero_empty<T>(blas, offsets, ne, p.dgate, I, h, st);
  zero_empty<T>(blas, offsets, ne, p.dup, I, h, st);
  if (blas.valid() == 0) return nullptr;
  const int64_t n = blas.buffer_rows();
  const Pad pd = blas.pad(offsets);
  const T* x = static_cast<const T*>(p.x);
  T* xs = static_cast<T*>(b.xs);
  const bool shared_xs = xs == rows_h;
  bool xs_ready = false;  // xs holds x by row
  auto gather_xs = [&] {
    launch_gather<T>(n, h, k, pd, sorted, input ? w : nullptr, x, p.x_stride, xs, st);
    xs_ready = true;
  };
  const bool gate_up_grad = p.dgate.data || p.dup.data;
  const bool stacked = one_stack(p.gate, p.up, I, h, eb);
  const T* gu = static_cast<const T*>(p.gate_up);  // by position
  if (!gu) {  // gate_up again, by row
    gather_xs();
    if (const char* e = gate_up_products(p, blas, xs, static_cast<T*>(b.gu))) return e;
  }
  T* dout = rows_h;
  if (!dout_early) launch_gather<T>(n, h, k, pd, sorted, nullptr, static_cast<const T*>(p.dout), p.dout_stride, dout, st);
  if (shared_xs) xs_ready = false;  // x by row, if gathered, is overwritten
  T* ch = static_cast<T*>(b.ch);
  T* dgu = static_cast<T*>(b.dgu);
  const bool dgu_by_position = b.dgu == p.gate_up;  // over the saved gate_up (overwrite_gate_up)
  if (dgu_by_position && blas.padded() && !b.dgu_group)
    return "moe backward: the workspace was sized for other parameters; size it with moe_workspace() for this call";
  const float* coef = input ? nullptr : w;
  float* rowsum = input ? nullptr : b.partial;
  const T* gu_rows = gu ? gu : static_cast<const T*>(b.gu);
  // q, dgu, c h and dW_down by chunks of I's columns (one chunk of I but on Loop's smaller buffers).
  if (b.ch_cols < I && !blas.loop())  // KCPP_MOE_GEMM or the device changed between sizing and the call
    return "moe backward: the workspace was sized for the Loop path, this call runs another; size it with moe_workspace() for "
           "this call (KCPP_MOE_GEMM and the device as at the call)";
  for (int64_t c0 = 0; c0 < I; c0 += b.ch_cols) {
    const int64_t nc = std::min(b.ch_cols, I - c0);
    if (const char* e = blas.run("q = dout W_down", [&](int ex) {
          return Prod{blas.rows(ex), nc, h, rows_op(dout, blas.row0(ex), h, eb), cols_op(matrix_op(p.down, ex, h, I, eb), c0, eb),
                      rows_op(ch, blas.row0(ex), nc, eb), 0.0f};
        }))
      return e;
    if (I % 8 == 0 && c0 % 8 == 0 && nc % 8 == 0 && kernel::cuda::aligned16(gu_rows) && kernel::cuda::aligned16(dgu))
      glu_backward_rows<T, 8><<<static_cast<unsigned>(n), 128, 0, st>>>(I, c0, nc, p.act, pd, gu_rows, gu != nullptr, coef, sorted,
                                                                        ch, dgu, dgu_by_position, rowsum, c0 > 0);
    else
      glu_backward_rows<T, 1><<<static_cast<unsigned>(n), 128, 0, st>>>(I, c0, nc, p.act, pd, gu_rows, gu != nullptr, coef, sorted,
                                                                        ch, dgu, dgu_by_position, rowsum, c0 > 0);
    if (p.ddown.data)
      if (const char* e = blas.run("dW_down = dout^T (c h)", [&](int ex) {
            return Prod{h, nc, blas.rows(ex), tr(rows_op(dout, blas.row0(ex), h, eb)), rows_op(ch, blas.row0(ex), nc, eb),
                        cols_op(matrix_op(p.ddown, ex, h, I, eb), c0, eb), 0.0f};
          }))
        return e;
  }
  // dout is done with: the gate / up weights' gradients from x by row, then dx by row over it.  x by
  // row is gathered only when dgate or dup is asked for.  Output mode with gate_up recomputed (not
  // saved) thus gathers x twice, for gate_up above and again here (dout overwrote it): an extra n x H
  // gather, the price of not holding x and dout by row at once (n x H elements of workspace saved).
  if (gate_up_grad && !xs_ready) gather_xs();
  T* dxs = rows_h;
  // dW_gate_up = dgu^T xs, then dxs = dgu [Wg; Wu], of the experts run() takes, with dgu's rows `shift`
  // before the buffers' by row (a group's buffer).
  auto gate_up_grads = [&](const T* dg, int64_t shift) -> const char* {
    if (one_stack(p.dgate, p.dup, I, h, eb)) {
      if (const char* e = blas.run("dW_gate_up = dgu^T xs", [&](int ex) {
            return Prod{2 * I, h, blas.rows(ex), tr(rows_op(dg, blas.row0(ex) - shift, 2 * I, eb)), rows_op(xs, blas.row0(ex), h, eb),
                        matrix_op(p.dgate, ex, 2 * I, h, eb), 0.0f};
          }))
        return e;
    } else {
      for (int half = 0; half < 2; ++half) {
        const Matrix& g = half ? p.dup : p.dgate;
        if (!g.data) continue;
        if (const char* e = blas.run(half ? "dW_up = du^T xs" : "dW_gate = dg^T xs", [&](int ex) {
              return Prod{I, h, blas.rows(ex), tr(rows_op(dg + half * I, blas.row0(ex) - shift, 2 * I, eb)),
                          rows_op(xs, blas.row0(ex), h, eb), matrix_op(g, ex, I, h, eb), 0.0f};
            }))
          return e;
      }
    }
    if (stacked)
      return blas.run("dxs = dgu W_gate_up", [&](int ex) {
        return Prod{blas.rows(ex), h, 2 * I, rows_op(dg, blas.row0(ex) - shift, 2 * I, eb), matrix_op(p.gate, ex, 2 * I, h, eb),
                    rows_op(dxs, blas.row0(ex), h, eb), 0.0f};
      });
    for (int half = 0; half < 2; ++half)
      if (const char* e = blas.run(half ? "dxs += du W_up" : "dxs = dg W_gate", [&](int ex) {
            return Prod{blas.rows(ex), h, I, rows_op(dg + half * I, blas.row0(ex) - shift, 2 * I, eb),
                        matrix_op(half ? p.up : p.gate, ex, I, h, eb), rows_op(dxs, blas.row0(ex), h, eb), half ? 1.0f : 0.0f};
          }))
        return e;
    return nullptr;
  };
  if (blas.padded() && b.group_rows > 0) {
    // Padded's groups (moe.h): a group's dgu by padded row (copied from the saved gate_up it lies over
    // by position), then its products.  Without overwrite_gate_up dgu has its padded rows and the
    // products run by the same groups (the same cuBLAS calls: the same bits either way).
    const PaddedLayout& lay = blas.layout();
    const int64_t per = std::max<int64_t>(b.group_rows / lay.rows, 1), end = lay.first + lay.experts;
    T* grp = static_cast<T*>(b.dgu_group);
    for (int64_t g0 = lay.first; g0 < end; g0 += per) {
      const int64_t g1 = std::min(g0 + per, end), m = (g1 - g0) * lay.rows;
      if (dgu_by_position) {
        Pad pg = pd;
        pg.first = static_cast<int>(g0);
        if (I % 4 == 0 && kernel::cuda::aligned16(dgu) && kernel::cuda::aligned16(grp))
          rows_by_position<T, 8><<<static_cast<unsigned>(m), 128, 0, st>>>(2 * I, pg, dgu, grp);
        else
          rows_by_position<T, 1><<<static_cast<unsigned>(m), 128, 0, st>>>(2 * I, pg, dgu, grp);
      }
      blas.limit(g0, g1);
      if (const char* e = dgu_by_position ? gate_up_grads(grp, blas.row0(g0)) : gate_up_grads(dgu, 0)) return e;
    }
    blas.unlimit();
  } else {
    if (const char* e = gate_up_grads(dgu, 0)) return e;
  }
  if (blas.padded()) {
    pad_positions<<<static_cast<unsigned>(ceil_div(s, 256)), 256, 0, st>>>(s, static_cast<int>(ne), ids, pd, b.pos);
    *padded = true;
  }
  return nullptr;
}

// The forward's experts on the package's GEMM: gate / up with the activation in its epilogue, then down.
// Each product runs on the Hopper kernel (moe_gemm_sm90.cuh) where it takes it, its A then the rows by
// position in a buffer of their own (the tokens gathered into b.y, which the down product writes y over
// afterwards, or Input's scaled rows in b.xs); else on the mma.sync kernel, which gathers while it loads
// (or reads the gathered rows, where the Hopper kernel was refused after the gather).
// With KCPP_MOE_SM90=1 a product the Hopper kernel does not take is an error (sm90::mode).
template <typename T>
const char* experts_forward_kernel(const MoeParams& p, const Bufs& b, const int32_t* offsets, const int32_t* sorted,
                                   const float* w, cudaStream_t st) {
  using namespace gemm;
  const int64_t h = p.hidden, ne = p.experts, k = p.top_k, I = p.inter, s = moe_slots(p);
  const bool input = p.weight_on == WeightOn::Input;
  const T* x = static_cast<const T*>(p.x);
  const int32_t* valid = offsets + ne;
  const T* a_in = x;
  int64_t lda = p.x_stride;
  if (input) {
    gather_scale<T><<<static_cast<unsigned>(s), 128, 0, st>>>(h, static_cast<int>(k), valid, sorted, w, x, p.x_stride,
                                                              static_cast<T*>(b.xs));
    a_in = static_cast<const T*>(b.xs), lda = h;
  }
  {
    Args<T> a;
    a.grouping = Grouping::MGroup, a.groups = static_cast<int>(ne), a.offsets = offsets, a.tile_offsets = b.tiles;
    a.N = 2 * I, a.K = h;
    a.a = a_in, a.lda = lda;
    if (!input) a.a_gather = sorted, a.a_div = static_cast<int>(k);
    b_from(a, p.gate, false);
    a.b1 = static_cast<const T*>(p.up.data);
    a.split = Split::Dual, a.inter = I, a.act = p.act;
    a.h = static_cast<T*>(b.h), a.gu_out = static_cast<T*>(p.gate_up);
    Args<T> rows = a;  // A as rows by position (the Hopper kernel reads no gather)
    if (!input) rows.a = static_cast<const T*>(b.y), rows.lda = h, rows.a_gather = nullptr, rows.a_div = 1;
    bool done = false;
    const char* why = sm90::unsupported(rows, Epi::Glu, s);
    if (!why) {
      if (!input) launch_gather<T>(s, h, k, Pad{}, sorted, nullptr, x, p.x_stride, static_cast<T*>(b.y), st);
      why = sm90::launch(rows, Epi::Glu, s, st);
      done = why == nullptr;
      if (!done && !input) a = rows;  // gathered already: the mma.sync kernel reads the rows
    }
    if (!done && sm90::mode() == sm90::Mode::Required)
      return errorf("moe forward: KCPP_MOE_SM90=1 asks for the Hopper grouped GEMM, which cannot run the gate / up product: %s. "
                    "Unset KCPP_MOE_SM90 to let the package's other GEMM run it", why);
    if (!done) {
      a.vec = vec_ok({a.a, p.gate.data, p.up.data}, {h, a.lda, I, a.ldb, a.b_gstride});
      launch<T>(a, Epi::Glu, ceil_div(I, BN / 2), grid_y_rows(Grouping::MGroup, s, ne), 1, st);
    }
  }
  {
    Args<T> a;
    a.grouping = Grouping::MGroup, a.groups = static_cast<int>(ne), a.offsets = offsets, a.tile_offsets = b.tiles;
    a.N = h, a.K = I;
    a.a = static_cast<const T*>(b.h), a.lda = I;
    b_from(a, p.down, false);
    a.c = b.y, a.ldc = h;
    const char* why = sm90::unsupported(a, Epi::Store, s);
    if (!why) why = sm90::launch(a, Epi::Store, s, st);
    if (why && sm90::mode() == sm90::Mode::Required)
      return errorf("moe forward: KCPP_MOE_SM90=1 asks for the Hopper grouped GEMM, which cannot run the down product: %s. "
                    "Unset KCPP_MOE_SM90 to let the package's other GEMM run it", why);
    if (why) {
      a.vec = vec_ok({b.h, p.down.data}, {h, I, a.ldb, a.b_gstride});
      launch<T>(a, Epi::Store, ntiles(h), grid_y_rows(Grouping::MGroup, s, ne), 1, st);
    }
  }
  return nullptr;
}

template <typename T> const char* forward(const MoeParams& p, cudaStream_t st) {
  using namespace gemm;
  const int64_t tk = p.tokens, h = p.hidden, ne = p.experts, k = p.top_k, si = p.shared_inter;
  const int64_t s = moe_slots(p);
  Path path = Path::Kernel;
  if (const char* e = call_path(p, st, &path)) return e;
  if (path == Path::Auto && auto_sm90_forward(p)) path = Path::Kernel;
  Carve cv{static_cast<unsigned char*>(p.workspace)};
  const Bufs b = call_layout(p, false, cv);
  if (path == Path::Kernel)
    if (const char* e = kernel_fits(b, p.inter, false, "forward")) return e;
  const T* x = static_cast<const T*>(p.x);
  const bool router = p.routing != Routing::Given, input = p.weight_on == WeightOn::Input;
  int32_t* ids = (router && p.topk_ids) ? static_cast<int32_t*>(p.topk_ids) : b.ids;
  float* w = (router && p.topk_weights) ? static_cast<float*>(p.topk_weights) : b.w;
  int32_t* offsets = p.expert_offsets ? p.expert_offsets : b.offsets;
  int32_t* sorted = p.sorted_slots ? p.sorted_slots : b.sorted;
  T* logits = static_cast<T*>(p.router_logits ? p.router_logits : b.logits);
  if (s > 0) {
    if (router) {
      Args<T> a;
      a.grouping = Grouping::Single;
      a.M = tk, a.N = ne, a.K = h;
      a.a = x, a.lda = p.x_stride;
      a.b0 = static_cast<const T*>(p.router), a.ldb = h, a.b_kcontig = true;
      a.c = logits, a.ldc = ne;
      a.vec = vec_ok({x, p.router}, {h, p.x_stride});
      launch<T>(a, Epi::Store, ntiles(ne), grid_y_rows(Grouping::Single, tk, 1), 1, st);
      route<T><<<static_cast<unsigned>(ceil_div(tk * 32, 256)), 256, 0, st>>>(tk, static_cast<int>(ne), static_cast<int>(k),
                                                                             logits, p.routing, p.normalize, ids, w);
    } else {
      prepare_slots<T><<<static_cast<unsigned>(ceil_div(s, 256)), 256, 0, st>>>(s, p.topk_ids, p.ids_i64, p.topk_weights,
                                                                               p.weights_f32, ids, w);
    }
  }
  // The permutation.
  const int64_t nch = chunks(s);
  const size_t cnt_bytes = static_cast<size_t>(ne + 1) * sizeof(int32_t);
  count_slots<<<static_cast<unsigned>(nch), 32, cnt_bytes, st>>>(s, static_cast<int>(ne), ids, b.counts);
  scan_chunks<<<static_cast<unsigned>(ne + 1), kScanThreads, 0, st>>>(static_cast<int>(ne), static_cast<int>(nch), b.counts, b.base,
                                                                     offsets);
  scan_buckets<<<1, 32, 0, st>>>(s, static_cast<int>(ne), offsets, b.tiles);
  if (s > 0)
    scatter_slots<<<static_cast<unsigned>(nch), 32, cnt_bytes, st>>>(s, static_cast<int>(ne), ids, offsets, b.base, sorted, b.pos);
  const int32_t* valid = offsets + ne;
  if (s == 0) return kernel::cuda::launch_error("moe forward");

  // Experts: gate / up with the activation, then down.
  bool padded = false;  // b.pos holds padded rows
  if (path != Path::Kernel) {
    if (const char* e = experts_forward_cublas<T>(p, b, path, offsets, sorted, ids, w, &padded, st)) return e;
  } else {
    if (const char* e = experts_forward_kernel<T>(p, b, offsets, sorted, w, st)) return e;
  }
  // The shared expert.
  if (si > 0) {
    Args<T> a;
    a.grouping = Grouping::Single, a.M = tk, a.N = 2 * si, a.K = h;
    a.a = x, a.lda = p.x_stride;
    b_from(a, p.shared_gate, false);
    a.b1 = static_cast<const T*>(p.shared_up.data);
    a.split = Split::Dual, a.inter = si, a.act = p.act;
    a.h = static_cast<T*>(b.sh);
    a.vec = vec_ok({x, p.shared_gate.data, p.shared_up.data}, {h, p.x_stride, si, a.ldb});
    launch<T>(a, Epi::Glu, ceil_div(si, BN / 2), grid_y_rows(Grouping::Single, tk, 1), 1, st);
    Args<T> d;
    d.grouping = Grouping::Single, d.M = tk, d.N = h, d.K = si;
    d.a = static_cast<const T*>(b.sh), d.lda = si;
    b_from(d, p.shared_down, false);
    d.c = b.sm, d.ldc = h;
    d.vec = vec_ok({b.sh, p.shared_down.data}, {h, si, d.ldb});
    launch<T>(d, Epi::Store, ntiles(h), grid_y_rows(Grouping::Single, tk, 1), 1, st);
    shared_sigma<T><<<static_cast<unsigned>(ceil_div(tk * 32, 256)), 256, 0, st>>>(
        tk, h, x, p.x_stride, static_cast<const T*>(p.shared_expert_gate), b.sigma);
  }
  launch_combine_forward<T>(tk, h, static_cast<int>(k), padded ? nullptr : valid, b.pos, w, !input, static_cast<const T*>(b.y), b.sigma,
                            static_cast<const T*>(b.sm), static_cast<T*>(p.out), p.out_stride, st);
  return kernel::cuda::launch_error("moe forward");
}

// A weight gradient of every expert: dW[e] (M x N) = A^T B over the expert's positions.
template <typename T> void weight_grad(gemm::Args<T> a, const Matrix& g0, const Matrix& g1, int64_t split, int64_t groups,
                                       cudaStream_t st) {
  a.w0 = static_cast<T*>(g0.data), a.w1 = static_cast<T*>(g1.data ? g1.data : g0.data);
  a.w_gstride = g0.expert_stride, a.w_rs = g0.row_stride, a.w_cs = g0.col_stride, a.w_split = split;
  a.a_kcontig = false, a.b_kcontig = false;
  launch<T>(a, gemm::Epi::Wgrad, ntiles(a.N), ceil_div(a.M, gemm::BM), groups, st);
}

// The backward's experts on the package's GEMM, through dxs, the weight gradients and (Output) the
// per-tile row sums of q h in b.partial.
template <typename T>
void experts_backward_kernel(const MoeParams& p, const Bufs& b, const int32_t* offsets, const int32_t* sorted, const float* w,
                             cudaStream_t st) {
  using namespace gemm;
  const int64_t h = p.hidden, ne = p.experts, k = p.top_k, I = p.inter, s = moe_slots(p);
  const bool input = p.weight_on == WeightOn::Input;
  const T* x = static_cast<const T*>(p.x);
  const T* dout = static_cast<const T*>(p.dout);
  const int32_t* valid = offsets + ne;
  tile_offsets<<<1, 1, 0, st>>>(static_cast<int>(ne), offsets, b.tiles);
  const int64_t gy = grid_y_rows(Grouping::MGroup, s, ne);
  const T* xs = x;  // the experts' inputs: gathered token rows, or the scaled rows by position
  if (input && s > 0) {
    gather_scale<T><<<static_cast<unsigned>(s), 128, 0, st>>>(h, static_cast<int>(k), valid, sorted, w, x, p.x_stride,
                                                              static_cast<T*>(b.xs));
    xs = static_cast<const T*>(b.xs);
  }
  auto expert_inputs = [&](Args<T>& a) {  // A of the gate / up GEMM
    a.a = xs, a.lda = input ? h : p.x_stride;
    if (!input) a.a_gather = sorted, a.a_div = static_cast<int>(k);
  };
  // gate_up, recomputed when forward did not save it.
  const T* gu = static_cast<const T*>(p.gate_up);
  if (!gu && s > 0) {
    Args<T> a;
    a.grouping = Grouping::MGroup, a.groups = static_cast<int>(ne), a.offsets = offsets, a.tile_offsets = b.tiles;
    a.N = 2 * I, a.K = h;
    expert_inputs(a);
    b_from(a, p.gate, false);
    a.b1 = static_cast<const T*>(p.up.data);
    a.split = Split::Dual, a.inter = I, a.act = p.act;
    a.gu_out = static_cast<T*>(b.gu);
    a.vec = vec_ok({a.a, p.gate.data, p.up.data}, {h, a.lda, I, a.ldb, a.b_gstride});
    launch<T>(a, Epi::Glu, ceil_div(I, BN / 2), gy, 1, st);
    gu = static_cast<const T*>(b.gu);
  }
  if (s > 0) {
    // q = dout Wd, grouped; dgu, c h and the row sums of q h.
    Args<T> a;
    a.grouping = Grouping::MGroup, a.groups = static_cast<int>(ne), a.offsets = offsets, a.tile_offsets = b.tiles;
    a.N = I, a.K = h;
    a.a = dout, a.lda = p.dout_stride, a.a_gather = sorted, a.a_div = static_cast<int>(k);
    b_from(a, p.down, true);
    a.inter = I, a.act = p.act, a.gu_in = gu;
    if (!input) a.coef = w, a.coef_index = sorted;
    a.dgu = static_cast<T*>(b.dgu), a.ch = static_cast<T*>(b.ch);
    a.partial = b.partial, a.partial_ld = ntiles(I);
    a.vec = vec_ok({dout, p.down.data}, {h, p.dout_stride, I, a.ldb, a.b_gstride});
    launch<T>(a, Epi::BwdGlu, ntiles(I), gy, 1, st);
    // dx_s = dgu [Wg; Wu], grouped, K = 2I split between gate and up.
    Args<T> d;
    d.grouping = Grouping::MGroup, d.groups = static_cast<int>(ne), d.offsets = offsets, d.tile_offsets = b.tiles;
    d.N = h, d.K = 2 * I;
    d.a = static_cast<const T*>(b.dgu), d.lda = 2 * I;
    b_from(d, p.gate, true);
    d.b1 = static_cast<const T*>(p.up.data);
    d.split = Split::K, d.b_split = I;
    d.c = b.dxs, d.ldc = h;
    d.vec = vec_ok({b.dgu, p.gate.data, p.up.data}, {h, I, d.ldb, d.b_gstride});
    launch<T>(d, Epi::Store, ntiles(h), gy, 1, st);
  }
  // Weight gradients, grouped over each expert's positions.
  if (p.ddown.data) {  // dWd[e] (H x I) = dout_g^T round(c h)
    Args<T> a;
    a.grouping = Grouping::KGroup, a.groups = static_cast<int>(ne), a.offsets = offsets;
    a.M = h, a.N = I;
    a.a = dout, a.lda = p.dout_stride, a.a_gather = sorted, a.a_div = static_cast<int>(k);
    a.b0 = static_cast<const T*>(b.ch), a.ldb = I;
    a.vec = vec_ok({dout, b.ch}, {h, p.dout_stride, I});
    weight_grad<T>(a, p.ddown, Matrix{}, h, ne, st);
  }
  if (p.dgate.data || p.dup.data) {  // dWgu[e] (2I x H) = dgu^T x_s, rows split at I
    Args<T> a;
    a.grouping = Grouping::KGroup, a.groups = static_cast<int>(ne), a.offsets = offsets;
    a.M = 2 * I, a.N = h;
    a.a = static_cast<const T*>(b.dgu), a.lda = 2 * I;
    a.b0 = xs, a.ldb = input ? h : p.x_stride;
    if (!input) a.b_gather = sorted, a.b_div = static_cast<int>(k);
    a.vec = vec_ok({b.dgu, xs}, {I, h, a.ldb});
    const bool same_layout = p.dgate.expert_stride == p.dup.expert_stride && p.dgate.row_stride == p.dup.row_stride &&
                             p.dgate.col_stride == p.dup.col_stride;
    if (p.dgate.data && p.dup.data && same_layout) {  // one launch, its rows split at I between the two
      weight_grad<T>(a, p.dgate, p.dup, I, ne, st);
    } else {  // each half on its own (one of them only, or the two in different layouts)
      a.M = I;
      if (p.dgate.data) weight_grad<T>(a, p.dgate, Matrix{}, I, ne, st);
      if (p.dup.data) {
        a.a = static_cast<const T*>(b.dgu) + I;
        weight_grad<T>(a, p.dup, Matrix{}, I, ne, st);
      }
    }
  }
}

template <typename T> const char* backward(const MoeParams& p, cudaStream_t st) {
  using namespace gemm;
  const int64_t tk = p.tokens, h = p.hidden, ne = p.experts, k = p.top_k, I = p.inter, si = p.shared_inter;
  const int64_t s = moe_slots(p);
  Path path = Path::Kernel;
  if (const char* e = call_path(p, st, &path)) return e;
  Carve cv{static_cast<unsigned char*>(p.workspace)};
  const Bufs b = call_layout(p, true, cv);
  if (path == Path::Kernel)
    if (const char* e = kernel_fits(b, p.inter, true, "backward")) return e;
  const T* x = static_cast<const T*>(p.x);
  const T* dout = static_cast<const T*>(p.dout);
  const bool router = p.routing != Routing::Given, input = p.weight_on == WeightOn::Input;
  const int32_t* ids = router ? static_cast<const int32_t*>(p.topk_ids) : b.ids;
  const float* w = router ? static_cast<const float*>(p.topk_weights) : b.w;
  const int32_t* offsets = p.expert_offsets;
  const int32_t* sorted = p.sorted_slots;
  const int32_t* valid = offsets + ne;
  if (!router && s > 0)
    prepare_slots<T><<<static_cast<unsigned>(ceil_div(s, 256)), 256, 0, st>>>(s, p.topk_ids, p.ids_i64, p.topk_weights,
                                                                             p.weights_f32, b.ids, b.w);
  if (s > 0) invert<<<static_cast<unsigned>(ceil_div(s, 256)), 256, 0, st>>>(s, sorted, b.pos);
  bool padded = false;  // b.pos holds padded rows
  if (path != Path::Kernel) {
    if (const char* e = experts_backward_cublas<T>(p, b, path, offsets, sorted, ids, w, &padded, st)) return e;
  } else {
    experts_backward_kernel<T>(p, b, offsets, sorted, w, st);
  }
  // dw per slot.
  if (s > 0)
    slot_dw<T><<<static_cast<unsigned>(ceil_div(s * 32, 256)), 256, 0, st>>>(
        s, h, static_cast<int>(k), padded ? nullptr : valid, b.pos, input ? nullptr : b.partial, path == Path::Kernel ? ntiles(I) : 1,
        static_cast<const T*>(b.dxs), x,
        p.x_stride, b.dw);
  if (p.dtopk_weights && s > 0) cudaMemcpyAsync(p.dtopk_weights, b.dw, static_cast<size_t>(s) * sizeof(float), cudaMemcpyDeviceToDevice, st);
  // The router.
  if (router) {
    if (tk > 0)
      route_backward<T><<<static_cast<unsigned>(ceil_div(tk * 32, 256)), 256, 0, st>>>(
          tk, static_cast<int>(ne), static_cast<int>(k), static_cast<const T*>(p.router_logits), p.routing, p.normalize, ids,
          w, b.dw, p.drouter_logits, p.drouter_logits_f32, static_cast<T*>(b.dz));
    Args<T> a;  // dxr = dz Wr
    a.grouping = Grouping::Single, a.M = tk, a.N = h, a.K = ne;
    a.a = static_cast<const T*>(b.dz), a.lda = ne;
    a.b0 = static_cast<const T*>(p.router), a.ldb = h, a.b_kcontig = false;
    a.c = b.dxr, a.ldc = h, a.c_f32 = true;
    a.vec = vec_ok({b.dz, p.router}, {ne, h});
    launch<T>(a, Epi::Store, ntiles(h), grid_y_rows(Grouping::Single, tk, 1), 1, st);
    if (p.drouter) {  // dWr (E x H) = dz^T x
      Args<T> g;
      g.grouping = Grouping::Single, g.M = ne, g.N = h, g.K = tk;
      g.a = static_cast<const T*>(b.dz), g.lda = ne;
      g.b0 = x, g.ldb = p.x_stride;
      g.vec = vec_ok({b.dz, x}, {ne, h, p.x_stride});
      Matrix dr;
      dr.data = p.drouter, dr.row_stride = h, dr.col_stride = 1;
      weight_grad<T>(g, dr, Matrix{}, ne, 1, st);
    }
  } else if (si > 0) {
    cudaMemsetAsync(b.dxr, 0, static_cast<size_t>(tk * h) * sizeof(float), st);
  }
  // The shared expert.
  if (si > 0) {
    Args<T> a;  // its gate_up again
    a.grouping = Grouping::Single, a.M = tk, a.N = 2 * si, a.K = h;
    a.a = x, a.lda = p.x_stride;
    b_from(a, p.shared_gate, false);
    a.b1 = static_cast<const T*>(p.shared_up.data);
    a.split = Split::Dual, a.inter = si, a.act = p.act;
    a.gu_out = static_cast<T*>(b.sgu);
    a.vec = vec_ok({x, p.shared_gate.data, p.shared_up.data}, {h, p.x_stride, si, a.ldb});
    launch<T>(a, Epi::Glu, ceil_div(si, BN / 2), grid_y_rows(Grouping::Single, tk, 1), 1, st);
    shared_sigma<T><<<static_cast<unsigned>(ceil_div(std::max<int64_t>(tk, 1) * 32, 256)), 256, 0, st>>>(
        tk, h, x, p.x_stride, static_cast<const T*>(p.shared_expert_gate), b.sigma);
    Args<T> q;  // q = dout Wsd with c = sigma
    q.grouping = Grouping::Single, q.M = tk, q.N = si, q.K = h;
    q.a = dout, q.lda = p.dout_stride;
    b_from(q, p.shared_down, true);
    q.inter = si, q.act = p.act, q.gu_in = static_cast<const T*>(b.sgu), q.coef = b.sigma;
    q.dgu = static_cast<T*>(b.sdgu), q.ch = static_cast<T*>(b.sch);
    q.partial = b.spartial, q.partial_ld = ntiles(si);
    q.vec = vec_ok({dout, p.shared_down.data}, {h, p.dout_stride, si, q.ldb});
    launch<T>(q, Epi::BwdGlu, ntiles(si), grid_y_rows(Grouping::Single, tk, 1), 1, st);
    Args<T> d;  // dxr += dsgu [Wsg; Wsu]
    d.grouping = Grouping::Single, d.M = tk, d.N = h, d.K = 2 * si;
    d.a = static_cast<const T*>(b.sdgu), d.lda = 2 * si;
    b_from(d, p.shared_gate, true);
    d.b1 = static_cast<const T*>(p.shared_up.data);
    d.split = Split::K, d.b_split = si;
    d.c = b.dxr, d.ldc = h, d.c_f32 = true, d.c_add = true;
    d.vec = vec_ok({b.sdgu, p.shared_gate.data, p.shared_up.data}, {h, si, d.ldb});
    launch<T>(d, Epi::Store, ntiles(h), grid_y_rows(Grouping::Single, tk, 1), 1, st);
    if (p.dshared_down.data) {  // (H x Is) = dout^T round(sigma h)
      Args<T> g;
      g.grouping = Grouping::Single, g.M = h, g.N = si, g.K = tk;
      g.a = dout, g.lda = p.dout_stride;
      g.b0 = static_cast<const T*>(b.sch), g.ldb = si;
      g.vec = vec_ok({dout, b.sch}, {h, p.dout_stride, si});
      weight_grad<T>(g, p.dshared_down, Matrix{}, h, 1, st);
    }
    if (p.dshared_gate.data || p.dshared_up.data) {  // (2Is x H) = dsgu^T x
      Args<T> g;
      g.grouping = Grouping::Single, g.M = 2 * si, g.N = h, g.K = tk;
      g.a = static_cast<const T*>(b.sdgu), g.lda = 2 * si;
      g.b0 = x, g.ldb = p.x_stride;
      g.vec = vec_ok({b.sdgu, x}, {si, h, p.x_stride});
      const bool same_layout = p.dshared_gate.row_stride == p.dshared_up.row_stride && p.dshared_gate.col_stride == p.dshared_up.col_stride;
      if (p.dshared_gate.data && p.dshared_up.data && same_layout) {
        weight_grad<T>(g, p.dshared_gate, p.dshared_up, si, 1, st);
      } else {  // each half on its own (one of them only, or the two in different layouts)
        g.M = si;
        if (p.dshared_gate.data) weight_grad<T>(g, p.dshared_gate, Matrix{}, si, 1, st);
        if (p.dshared_up.data) {
          g.a = static_cast<const T*>(b.sdgu) + si;
          weight_grad<T>(g, p.dshared_up, Matrix{}, si, 1, st);
        }
      }
    }
    if (p.shared_expert_gate && tk > 0) {
      shared_gate_backward<T><<<static_cast<unsigned>(tk), 256, 0, st>>>(tk, h, b.spartial, ntiles(si), b.sigma,
                                                                        static_cast<const T*>(p.shared_expert_gate), b.dl, b.dxr);
    }
    if (p.dshared_expert_gate) {
      if (tk > 0) {
        shared_gate_grad<T><<<static_cast<unsigned>(ceil_div(h, 256)), 256, 0, st>>>(tk, h, b.dl, x, p.x_stride,
                                                                                    static_cast<T*>(p.dshared_expert_gate));
      } else {
        cudaMemsetAsync(p.dshared_expert_gate, 0, static_cast<size_t>(h) * sizeof(T), st);
      }
    }
  }
  launch_combine_backward<T>(tk, h, static_cast<int>(k), padded ? nullptr : valid, b.pos, w, input, static_cast<const T*>(b.dxs), b.dxr,
                             static_cast<T*>(p.dx), p.dx_stride, st);
  return kernel::cuda::launch_error("moe backward");
}

// ---- load-balancing loss --------------------------------------------------------------------------

constexpr int kLbRows = 64;  // rows per block
constexpr int kLbWarps = 8;

__device__ __forceinline__ float lb_mask(const LoadBalancingParams& p, int64_t r) {
  if (p.mask_type == MaskType::None) return 1.0f;
  const int64_t i = r % p.mask_len;
  switch (p.mask_type) {
    case MaskType::U8: return static_cast<const uint8_t*>(p.mask)[i] != 0 ? 1.0f : 0.0f;
    case MaskType::I32: return static_cast<const int32_t*>(p.mask)[i] != 0 ? 1.0f : 0.0f;
    case MaskType::I64: return static_cast<const int64_t*>(p.mask)[i] != 0 ? 1.0f : 0.0f;
    case MaskType::F32: return static_cast<const float*>(p.mask)[i];
    default: return 1.0f;
  }
}

// p of row r (rounded to T) for expert x, given the row's max and sum.
template <typename T> __device__ __forceinline__ float lb_p(const T* z, int x, float m, float sum) {
  return to_f32(from_f32<T>(expf(to_f32(z[x]) - m) / sum));
}

template <typename T> __device__ __forceinline__ void lb_row_stats(const T* z, int e, int lane, float& m, float& sum) {
  m = -INFINITY;
  for (int x = lane; x < e; x += 32) m = fmaxf(m, to_f32(z[x]));
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  sum = 0.0f;
  for (int x = lane; x < e; x += 32) sum += expf(to_f32(z[x]) - m);
  sum = warp_sum(sum);
}

// Per block: counts and probability sums of each expert and the mask total over its rows.
template <typename T> __global__ void lb_partial(const LoadBalancingParams p, float* part) {
  extern __shared__ float acc[];  // [kLbWarps][2 E + 1]
  const int e = static_cast<int>(p.experts), k = static_cast<int>(p.top_k);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  float* mine = acc + warp * (2 * e + 1);
  for (int x = lane; x < 2 * e + 1; x += 32) mine[x] = 0.0f;
  __syncwarp();
  const T* base = static_cast<const T*>(p.logits);
  for (int i = warp; i < kLbRows; i += kLbWarps) {
    const int64_t r = static_cast<int64_t>(blockIdx.x) * kLbRows + i;
    if (r >= p.rows) break;
    const T* z = base + r * p.logits_stride;
    const float mk = lb_mask(p, r);
    float m, sum;
    lb_row_stats(z, e, lane, m, sum);
    uint32_t taken = 0;
    for (int j = 0; j < k; ++j) {
      float best = -INFINITY;
      int bi = -1;
      for (int x = lane, bit = 0; x < e; x += 32, ++bit) {
        const float v = lb_p(z, x, m, sum);
        if (!(taken >> bit & 1u) && (bi < 0 || v > best)) best = v, bi = x;
      }
      for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, best, o);
        const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (oi >= 0 && (bi < 0 || ov > best || (ov == best && oi < bi))) best = ov, bi = oi;
      }
      if ((bi & 31) == lane) {
        taken |= 1u << (bi >> 5);
        mine[bi] += mk;
      }
    }
    for (int x = lane; x < e; x += 32) mine[e + x] += mk * lb_p(z, x, m, sum);
    if (lane == 0) mine[2 * e] += mk;
    __syncwarp();
  }
  __syncthreads();
  for (int x = threadIdx.x; x < 2 * e + 1; x += blockDim.x) {
    float v = 0.0f;
    for (int wv = 0; wv < kLbWarps; ++wv) v += acc[wv * (2 * e + 1) + x];
    part[static_cast<int64_t>(blockIdx.x) * (2 * e + 1) + x] = v;
  }
}

// One block: the totals (f_e = count_e / R into tot[0..E), R into tot[2E]) and the loss.
__global__ void lb_total(const LoadBalancingParams p, int nblocks, const float* part, float* tot) {
  __shared__ float red[32];
  const int e = static_cast<int>(p.experts);
  __shared__ float rows;
  if (threadIdx.x == 0) {
    float r = 0.0f;
    for (int b = 0; b < nblocks; ++b) r += part[static_cast<int64_t>(b) * (2 * e + 1) + 2 * e];
    rows = r;
    tot[2 * e] = r;
  }
  __syncthreads();
  float loss = 0.0f;
  for (int x = threadIdx.x; x < e; x += blockDim.x) {
    float c = 0.0f, pr = 0.0f;
    for (int b = 0; b < nblocks; ++b) {
      c += part[static_cast<int64_t>(b) * (2 * e + 1) + x];
      pr += part[static_cast<int64_t>(b) * (2 * e + 1) + e + x];
    }
    tot[x] = c / rows;
    loss += (c / rows) * (pr / rows);
  }
  loss = kernel::cuda::block_sum(loss, red);
  if (threadIdx.x == 0) *p.loss = loss * static_cast<float>(e);
}

// The gradient: a warp per row.
template <typename T> __global__ void lb_grad(const LoadBalancingParams p, const float* tot) {
  const int64_t r = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31, e = static_cast<int>(p.experts);
  if (r >= p.rows) return;
  const T* z = static_cast<const T*>(p.logits) + r * p.logits_stride;
  float m, sum;
  lb_row_stats(z, e, lane, m, sum);
  const float rows = tot[2 * e];
  const float scale = p.grad_scale * static_cast<float>(e) * lb_mask(p, r) / rows;
  float dot = 0.0f;
  for (int x = lane; x < e; x += 32) dot += lb_p(z, x, m, sum) * scale * tot[x];
  dot = warp_sum(dot);
  for (int x = lane; x < e; x += 32) {
    const float pv = lb_p(z, x, m, sum);
    const float g = pv * (scale * tot[x] - dot);
    if (p.dlogits_f32) static_cast<float*>(p.dlogits)[r * e + x] = g;
    else static_cast<T*>(p.dlogits)[r * e + x] = from_f32<T>(g);
  }
}

template <typename T> const char* load_balancing_run(const LoadBalancingParams& p, cudaStream_t st) {
  const int64_t nb = std::max<int64_t>(ceil_div(p.rows, kLbRows), 1);
  Carve cv{static_cast<unsigned char*>(p.workspace)};
  float* part = cv.take<float>(nb * (2 * p.experts + 1));
  float* tot = cv.take<float>(2 * p.experts + 1);
  const size_t smem = static_cast<size_t>(kLbWarps) * (2 * p.experts + 1) * sizeof(float);
  if (smem > 48 * 1024) cudaFuncSetAttribute(lb_partial<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  lb_partial<T><<<static_cast<unsigned>(nb), kLbWarps * 32, smem, st>>>(p, part);
  lb_total<<<1, 256, 0, st>>>(p, static_cast<int>(nb), part, tot);
  if (p.dlogits && p.rows > 0) lb_grad<T><<<static_cast<unsigned>(ceil_div(p.rows * 32, 256)), 256, 0, st>>>(p, tot);
  return kernel::cuda::launch_error("load_balancing_loss");
}

}  // namespace

const char* moe_sm90_unavailable() { return gemm::sm90::device_unavailable(); }

size_t moe_workspace_cuda(const MoeParams& p, bool backward) {
  Carve cv;
  call_layout(p, backward, cv);
  return cv.used;
}

const char* moe_forward_cuda(const MoeParams& p, cudaStream_t stream) {
  if (const char* e = moe_check(p, false)) return e;
  switch (p.dtype) {
    case DType::bf16: return forward<__nv_bfloat16>(p, stream);
    case DType::f16: return forward<__half>(p, stream);
    default: return "moe forward: CUDA takes bf16 or f16";
  }
}

const char* moe_backward_cuda(const MoeParams& p, cudaStream_t stream) {
  if (const char* e = moe_check(p, true)) return e;
  switch (p.dtype) {
    case DType::bf16: return backward<__nv_bfloat16>(p, stream);
    case DType::f16: return backward<__half>(p, stream);
    default: return "moe backward: CUDA takes bf16 or f16";
  }
}

size_t load_balancing_workspace_cuda(const LoadBalancingParams& p) {
  Carve cv;
  const int64_t nb = std::max<int64_t>(ceil_div(p.rows, kLbRows), 1);
  cv.take<float>(nb * (2 * p.experts + 1));
  cv.take<float>(2 * p.experts + 1);
  return cv.used;
}

const char* load_balancing_cuda(const LoadBalancingParams& p, cudaStream_t stream) {
  if (const char* e = load_balancing_check(p)) return e;
  switch (p.dtype) {
    case DType::f32: return load_balancing_run<float>(p, stream);
    case DType::bf16: return load_balancing_run<__nv_bfloat16>(p, stream);
    case DType::f16: return load_balancing_run<__half>(p, stream);
  }
  return "load_balancing_loss: unknown dtype";
}

}  // namespace kcpp::moe
