// Mixture-of-experts on CUDA (maths, layout and permutation in moe.h; the grouped GEMM in
// moe_gemm.cuh).  bf16 and f16 (the tensor-core GEMMs); f32 is refused by the package's supports().
//
// Forward, every launch on the caller's stream, no host synchronization:
//   router GEMM (logits rounded to the dtype) -> route (a warp per token: softmax or sigmoid, top-k by
//   warp arg-max, ties to the lower expert) -> count (a warp per chunk of 2048 slots: per-chunk counts
//   of each expert, ranks by __match_any_sync) -> scan (one block: offsets, each chunk's base per
//   expert, the GEMM's tile offsets) -> scatter (the same warps again: stable positions) ->
//   [Input: gather the scaled rows] -> gate/up GEMM grouped by expert with the gated activation in its
//   epilogue (h, and gate_up when saved) -> down GEMM (y by position) -> [shared expert: the same two
//   GEMMs over every token] -> combine (out_t = sum over slots in order, plus the shared part).
// Backward: the slots again (ids, weights as f32), the inverse permutation and tile offsets ->
//   [gate_up recomputed when not saved] -> q = dout Wd grouped, its epilogue making dgu, c h and the
//   per-block row sums of q h -> dx_s = dgu Wgu grouped -> weight gradients (grouped over each
//   expert's positions: the reduction dim) -> dw per slot (the row sums, or dx_s . x_t) -> dz per token
//   -> the router's two GEMMs and the shared expert -> dx_t summed over slots in order.
// Every reduction has a fixed order (no float atomics); integer counters only inside one warp.
#include <algorithm>
#include <cstdint>

#include "kcpp/kernel/cuda.cuh"
#include "kcpp/kernel/error.h"
#include "moe.h"
#include "moe_gemm.cuh"

namespace kcpp::moe {
namespace {

using kernel::DType;
using kernel::errorf;
using kernel::cuda::from_f32;
using kernel::cuda::to_f32;
using kernel::cuda::warp_sum;

constexpr int kChunk = 2048;  // slots per warp of the counting sort
constexpr size_t kAlign = 256;

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
};

Bufs layout(const MoeParams& p, bool bwd, Carve& cv) {
  Bufs b;
  const int64_t t = p.tokens, h = p.hidden, e = p.experts, s = moe_slots(p), i = p.inter, si = p.shared_inter;
  const int64_t eb = kernel::dtype_bytes(p.dtype);
  const bool router = p.routing != Routing::Given, input = p.weight_on == WeightOn::Input;
  const bool own_ids = bwd ? !router : !(router && p.topk_ids);
  if (own_ids) b.ids = cv.take<int32_t>(s);
  if (bwd ? !router : !(router && p.topk_weights)) b.w = cv.take<float>(s);
  if (!bwd && !p.expert_offsets) b.offsets = cv.take<int32_t>(e + 2);
  if (!bwd && !p.sorted_slots) b.sorted = cv.take<int32_t>(s);
  b.pos = cv.take<int32_t>(s);
  if (!bwd) {
    b.counts = cv.take<int32_t>(chunks(s) * (e + 1));
    b.base = cv.take<int32_t>(chunks(s) * (e + 1));
  }
  b.tiles = cv.take<int32_t>(e + 1);
  if (router && !bwd && !p.router_logits) b.logits = cv.take<unsigned char>(t * e * eb);
  if (input) b.xs = cv.take<unsigned char>(s * h * eb);
  if (si > 0) b.sigma = cv.take<float>(t);
  if (!bwd) {
    b.h = cv.take<unsigned char>(s * i * eb);
    b.y = cv.take<unsigned char>(s * h * eb);
    if (si > 0) {
      b.sh = cv.take<unsigned char>(t * si * eb);
      b.sm = cv.take<unsigned char>(t * h * eb);
    }
    return b;
  }
  if (!p.gate_up) b.gu = cv.take<unsigned char>(s * 2 * i * eb);
  b.dgu = cv.take<unsigned char>(s * 2 * i * eb);
  b.ch = cv.take<unsigned char>(s * i * eb);
  if (!input) b.partial = cv.take<float>(s * ntiles(i));
  b.dxs = cv.take<unsigned char>(s * h * eb);
  b.dw = cv.take<float>(s);
  if (router) b.dz = cv.take<unsigned char>(t * e * eb);
  if (router || si > 0) b.dxr = cv.take<float>(t * h);
  if (si > 0) {
    b.sgu = cv.take<unsigned char>(t * 2 * si * eb);
    b.sdgu = cv.take<unsigned char>(t * 2 * si * eb);
    b.sch = cv.take<unsigned char>(t * si * eb);
    b.spartial = cv.take<float>(t * ntiles(si));
    b.dl = cv.take<float>(t);
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

// One block: offsets (E + 2), each chunk's first position per bucket, and the grouped GEMM's tile
// offsets (tiles of BM rows per expert).
__global__ void scan_slots(int64_t s, int e, int nchunks, const int32_t* counts, int32_t* offsets, int32_t* base,
                           int32_t* tiles) {
  extern __shared__ int32_t tot[];  // [e + 1]
  for (int b = threadIdx.x; b <= e; b += blockDim.x) {
    int32_t acc = 0;
    for (int c = 0; c < nchunks; ++c) acc += counts[static_cast<int64_t>(c) * (e + 1) + b];
    tot[b] = acc;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int32_t run = 0, tr = 0;
    for (int b = 0; b <= e; ++b) {
      const int32_t n = tot[b];
      tot[b] = run;
      offsets[b] = run;
      if (b < e) {
        tiles[b] = tr;
        tr += (n + gemm::BM - 1) / gemm::BM;
      }
      run += n;
    }
    tiles[e] = tr;
    offsets[e + 1] = static_cast<int32_t>(s);
  }
  __syncthreads();
  for (int b = threadIdx.x; b <= e; b += blockDim.x) {
    int32_t run = tot[b];
    for (int c = 0; c < nchunks; ++c) {
      base[static_cast<int64_t>(c) * (e + 1) + b] = run;
      run += counts[static_cast<int64_t>(c) * (e + 1) + b];
    }
  }
}

// The same warps as count_slots: each slot's position, in slot order within a bucket.
__global__ void scatter_slots(int64_t s, int e, const int32_t* ids, const int32_t* base, int32_t* sorted, int32_t* pos) {
  extern __shared__ int32_t run[];
  const int lane = threadIdx.x;
  for (int b = lane; b <= e; b += 32) run[b] = base[static_cast<int64_t>(blockIdx.x) * (e + 1) + b];
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

// out_t = sum_j c_s y[pos s] (+ sigma_t m_t), slots in order.
template <typename T>
__global__ void combine_forward(int64_t h, int k, const int32_t* valid, const int32_t* pos, const float* w, bool output,
                                const T* y, const float* sigma, const T* m, T* out, int64_t ldo) {
  const int64_t t = blockIdx.x;
  const int32_t nvalid = *valid;
  for (int64_t c = threadIdx.x; c < h; c += blockDim.x) {
    float acc = 0.0f;
    for (int j = 0; j < k; ++j) {
      const int64_t s = t * k + j;
      const int32_t q = pos[s];
      if (q >= nvalid) continue;
      acc += (output ? w[s] : 1.0f) * to_f32(y[static_cast<int64_t>(q) * h + c]);
    }
    if (m) acc += sigma[t] * to_f32(m[t * h + c]);
    out[t * ldo + c] = from_f32<T>(acc);
  }
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
template <typename T>
__global__ void slot_dw(int64_t slots, int64_t h, int k, const int32_t* valid, const int32_t* pos, const float* partial,
                        int64_t nt, const T* dxs, const T* x, int64_t ldx, float* dw) {
  const int64_t s = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (s >= slots) return;
  const int32_t q = pos[s];
  if (q >= *valid) {
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

// dx_t = sum_j c'_s dx_s (slots in order) + dxr_t.
template <typename T>
__global__ void combine_backward(int64_t h, int k, const int32_t* valid, const int32_t* pos, const float* w, bool input,
                                 const T* dxs, const float* dxr, T* dx, int64_t ldd) {
  const int64_t t = blockIdx.x;
  const int32_t nvalid = *valid;
  for (int64_t c = threadIdx.x; c < h; c += blockDim.x) {
    float acc = 0.0f;
    for (int j = 0; j < k; ++j) {
      const int64_t s = t * k + j;
      const int32_t q = pos[s];
      if (q >= nvalid) continue;
      acc += (input ? w[s] : 1.0f) * to_f32(dxs[static_cast<int64_t>(q) * h + c]);
    }
    if (dxr) acc += dxr[t * h + c];
    dx[t * ldd + c] = from_f32<T>(acc);
  }
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

template <typename T> const char* forward(const MoeParams& p, cudaStream_t st) {
  using namespace gemm;
  const int64_t tk = p.tokens, h = p.hidden, ne = p.experts, k = p.top_k, I = p.inter, si = p.shared_inter;
  const int64_t s = moe_slots(p);
  Carve cv{static_cast<unsigned char*>(p.workspace)};
  const Bufs b = layout(p, false, cv);
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
  scan_slots<<<1, 256, cnt_bytes, st>>>(s, static_cast<int>(ne), static_cast<int>(nch), b.counts, offsets, b.base, b.tiles);
  if (s > 0) scatter_slots<<<static_cast<unsigned>(nch), 32, cnt_bytes, st>>>(s, static_cast<int>(ne), ids, b.base, sorted, b.pos);
  const int32_t* valid = offsets + ne;
  if (s == 0) return kernel::cuda::launch_error("moe forward");

  // Experts: gate / up with the activation, then down.
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
    a.vec = vec_ok({a_in, p.gate.data, p.up.data}, {h, lda, I, a.ldb, a.b_gstride});
    launch<T>(a, Epi::Glu, ceil_div(I, BN / 2), grid_y_rows(Grouping::MGroup, s, ne), 1, st);
  }
  {
    Args<T> a;
    a.grouping = Grouping::MGroup, a.groups = static_cast<int>(ne), a.offsets = offsets, a.tile_offsets = b.tiles;
    a.N = h, a.K = I;
    a.a = static_cast<const T*>(b.h), a.lda = I;
    b_from(a, p.down, false);
    a.c = b.y, a.ldc = h;
    a.vec = vec_ok({b.h, p.down.data}, {h, I, a.ldb, a.b_gstride});
    launch<T>(a, Epi::Store, ntiles(h), grid_y_rows(Grouping::MGroup, s, ne), 1, st);
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
  combine_forward<T><<<static_cast<unsigned>(tk), 256, 0, st>>>(h, static_cast<int>(k), valid, b.pos, w, !input,
                                                                static_cast<const T*>(b.y), b.sigma,
                                                                static_cast<const T*>(b.sm), static_cast<T*>(p.out), p.out_stride);
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

template <typename T> const char* backward(const MoeParams& p, cudaStream_t st) {
  using namespace gemm;
  const int64_t tk = p.tokens, h = p.hidden, ne = p.experts, k = p.top_k, I = p.inter, si = p.shared_inter;
  const int64_t s = moe_slots(p);
  Carve cv{static_cast<unsigned char*>(p.workspace)};
  const Bufs b = layout(p, true, cv);
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
  // dw per slot.
  if (s > 0)
    slot_dw<T><<<static_cast<unsigned>(ceil_div(s * 32, 256)), 256, 0, st>>>(
        s, h, static_cast<int>(k), valid, b.pos, input ? nullptr : b.partial, ntiles(I), static_cast<const T*>(b.dxs), x,
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
  if (tk > 0)
    combine_backward<T><<<static_cast<unsigned>(tk), 256, 0, st>>>(h, static_cast<int>(k), valid, b.pos, w, input,
                                                                   static_cast<const T*>(b.dxs), b.dxr, static_cast<T*>(p.dx),
                                                                   p.dx_stride);
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

size_t moe_workspace_cuda(const MoeParams& p, bool backward) {
  Carve cv;
  layout(p, backward, cv);
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
