// Cross-entropy on CUDA (maths in cross_entropy.h).  Kernels, all on the caller's stream, none
// synchronizing with the host:
//  1. count_valid (Mean only): one block counts the non-ignored rows into the workspace;
//  2. rows: one block per row (blocks striding over rows): pass 1 reads the row once, keeping per
//     thread an online (max, sum of exp) pair and the sum of logits, combined over the block in a
//     fixed order; pass 2 re-reads the row (mostly from L2) and writes the gradient, scaled by
//     1 / count for Mean, possibly over the logits; the row's loss goes to the workspace;
//  3. reduce_loss (Mean, Sum): one block adds the rows' losses in a fixed order.
#include <algorithm>
#include <climits>
#include <cstdint>
#include <cmath>
#include <mutex>

#include "cross_entropy.h"
#include "cross_entropy_tuning.h"
#include <cooperative_groups.h>
#include <cuda/ptx>

#include "kcpp/kernel/cuda.cuh"
#include "kcpp/kernel/fast_math.h"

namespace kcpp::liger {
namespace {

using namespace kcpp::kernel::cuda;

constexpr int kThreads = 512;

__device__ __forceinline__ int64_t target_at(const CrossEntropyParams& p, int64_t i) {
  return p.targets_i32 ? static_cast<const int32_t*>(p.targets)[i] : static_cast<const int64_t*>(p.targets)[i];
}

// Online softmax state: the max m and sum s of exp(x - m).  Merge is exact up to rounding and handles
// the empty state (m = -inf, s = 0).
struct MS {
  float m, s;
};
// LOG2: m is in base 2 (the state of log2(e) z), s a sum of 2^(y - m).
template <bool LOG2 = false> __device__ __forceinline__ MS merge(MS a, MS b) {
  const float m = fmaxf(a.m, b.m);
  if (m == -INFINITY) return {m, 0.0f};
  if (LOG2) return {m, a.s * exp2f(a.m - m) + b.s * exp2f(b.m - m)};
  return {m, a.s * expf(a.m - m) + b.s * expf(b.m - m)};
}

// 2^x with the special-function unit alone (kcpp/kernel/fast_math.h; results below 2^-126 flush to
// 0, far under what a probability of f32 accumulation can hold anyway).
using kernel::exp2_approx;
[[maybe_unused]] constexpr float kLog2e = 1.44269504088896340736f;

// Reduces (m, s) and a plain sum over the block; every thread gets the result (the loop path; the
// cluster path reduces its max first and then plain sums).
__device__ void block_reduce(MS& ms, float& sum, float* sm, float* ss, float* sx) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const MS other{__shfl_xor_sync(0xffffffffu, ms.m, o), __shfl_xor_sync(0xffffffffu, ms.s, o)};
    ms = merge(ms, other);
    sum += __shfl_xor_sync(0xffffffffu, sum, o);
  }
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  __syncthreads();
  if (lane == 0) sm[warp] = ms.m, ss[warp] = ms.s, sx[warp] = sum;
  __syncthreads();
  ms = lane < warps ? MS{sm[lane], ss[lane]} : MS{-INFINITY, 0.0f};
  sum = lane < warps ? sx[lane] : 0.0f;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const MS other{__shfl_xor_sync(0xffffffffu, ms.m, o), __shfl_xor_sync(0xffffffffu, ms.s, o)};
    ms = merge(ms, other);
    sum += __shfl_xor_sync(0xffffffffu, sum, o);
  }
}

// count[0] = the mean's divisor D (non-ignored rows, or the sum of their targets' class weights);
// count[1] = W, the sum of the class weights (with class weights).  One block, a fixed order.
__global__ void count_valid(const __grid_constant__ CrossEntropyParams p, float* count) {
  __shared__ float scratch[32];
  float c = 0.0f;
  for (int64_t i = threadIdx.x; i < p.n; i += blockDim.x) {
    const int64_t t = target_at(p, i);
    if (t == p.ignore_index) continue;
    c += p.class_weight && t >= 0 && t < p.v ? p.class_weight[t] : 1.0f;  // a bad target's row is NaN anyway
  }
  c = block_sum(c, scratch);  // without class weights exact: integers far below 2^24 per thread
  float w = 0.0f;
  if (p.class_weight) {
    for (int64_t j = threadIdx.x; j < p.v; j += blockDim.x) w += p.class_weight[j];
    w = block_sum(w, scratch);
  }
  if (threadIdx.x == 0) count[0] = c, count[1] = w;
}

// Logits j .. j + VEC of a row in f32, the bias added.
template <typename T, int VEC> __device__ __forceinline__ void load_row(const T* x, const T* bias, int64_t j, float (&f)[VEC]) {
  load_f32(x + j, f);
  if (bias) {
    float b[VEC];
    load_f32(bias + j, b);
#pragma unroll
    for (int k = 0; k < VEC; ++k) f[k] += b[k];
  }
}

// tanh(y) = sign(y) (1 - 2 / (e^(2 |y|) + 1)) from one special-function exponential and an
// approximate division: absolute error a few 2^-24 (relative, where |y| is tiny, larger: the
// subtraction cancels), against tanhf's ~20 instructions.  For 16-bit logits only, whose capped
// values z = c tanh(x / c) then carry an absolute error of a few c 2^-24, far below their exponentials'
// f32 rounding's effect on a 16-bit gradient; f32 logits keep tanhf.
__device__ __forceinline__ float tanh_approx(float y) {
  const float e = exp2_approx(2.0f * kLog2e * fabsf(y));  // +inf for large |y|: the quotient is then 0
  return copysignf(1.0f - __fdividef(2.0f, e + 1.0f), y);
}

// Softcap (EXT only): z = c tanh(x / c), the division a multiply by 1 / c (`inv`, computed once: an
// IEEE division an element, twice with the derivative, was a large part of the options path).  Every
// use (the row's values and z_t) goes through here, so z_t is the z the row's lse saw.
template <bool EXT, typename T, int VEC> __device__ __forceinline__ void cap_row(float cap, float inv, float (&f)[VEC]) {
  if (EXT && cap > 0.0f) {
#pragma unroll
    for (int k = 0; k < VEC; ++k) f[k] = cap * (sizeof(T) < 4 ? tanh_approx(f[k] * inv) : tanhf(f[k] * inv));
  }
}

// VEC class weights from w (16-byte loads where `aligned`).
template <int VEC> __device__ __forceinline__ void load_weights(const float* w, bool aligned, float (&out)[VEC]) {
  if (VEC % 4 == 0 && aligned) {
#pragma unroll
    for (int k = 0; k < VEC; k += 4) {
      const float4 v = *reinterpret_cast<const float4*>(w + k);
      out[k] = v.x, out[k + 1] = v.y, out[k + 2] = v.z, out[k + 3] = v.w;
    }
  } else {
#pragma unroll
    for (int k = 0; k < VEC; ++k) out[k] = w[k];
  }
}

// dz / dx of the softcap at z: 1 - (z / c)^2.
__device__ __forceinline__ float cap_slope(float z, float inv) {
  const float u = z * inv;
  return fmaf(-u, u, 1.0f);
}

// The scalars of one row's gradient (cross_entropy.h): dz_j = s_row (p_j a - smooth w_j - hot [j = t]),
// p_j = exp(z_j - lse); a bad target makes the whole row NaN.
struct RowGrad {
  float lse, a, smooth, hot, s_row;
  int64_t t;
  bool bad;
};

__device__ __forceinline__ RowGrad row_grad(const CrossEntropyParams& p, float lse, int64_t t, bool bad, float wt, float tau,
                                            float scale, float wsum) {
  const float smooth = p.label_smoothing / static_cast<float>(p.v), hot = (1.0f - p.label_smoothing) * wt;
  return {lse, hot + smooth * wsum + 2.0f * p.lse_square_scale * lse, smooth, hot, tau * scale, t, bad};
}

// The gradient of logit j whose (biased, capped) value is z.
template <bool EXT>
__device__ __forceinline__ float grad_at(const RowGrad& r, float z, int64_t j, const float* cw, float cap, float inv_cap) {
  float d = expf(z - r.lse) * r.a - r.smooth * (cw ? cw[j] : 1.0f) - (j == r.t ? r.hot : 0.0f);
  if (EXT && cap > 0.0f) d *= cap_slope(z, inv_cap);
  return r.bad ? NAN : d * r.s_row;
}

// loss_i from the row's lse, z_t and sum_j w_j z_j.
__device__ __forceinline__ float row_loss_value(const CrossEntropyParams& p, float lse, float zt, float sum, float wt, float tau,
                                                float wsum) {
  const float eps = p.label_smoothing;
  // The smoothing term only with smoothing: sum is -inf when a logit is masked, and 0 x inf is NaN.
  const float ce = (1.0f - eps) * wt * (lse - zt) + (eps > 0.0f ? eps / static_cast<float>(p.v) * (wsum * lse - sum) : 0.0f);
  return tau * (ce + p.lse_square_scale * lse * lse);
}

// sum_k exp(f_k - m) for a vector whose max is m; 0 when every f_k is -inf (masked logits: exp of
// -inf - -inf would be NaN where PyTorch gives 0).
template <int VEC> __device__ __forceinline__ float sum_exp(const float (&f)[VEC], float m) {
  float s = 0.0f;
  if (m != -INFINITY) {
#pragma unroll
    for (int k = 0; k < VEC; ++k) s += expf(f[k] - m);
  }
  return s;
}

// The loss-side per-row bookkeeping every kernel shares: the row's loss (or NaN and a count for a
// bad target) and its lse.
__device__ __forceinline__ void write_row_loss(const CrossEntropyParams& p, int64_t i, float* out_loss, bool bad, float lse,
                                               float zt, float sum, float wt, float tau, float wsum) {
  if (bad) {
    *out_loss = NAN;
    if (p.bad_targets) atomicAdd(p.bad_targets, 1);
  } else {
    *out_loss = row_loss_value(p, lse, zt, sum, wt, tau, wsum);
  }
  if (p.lse) p.lse[i] = lse;
}

// EXT: the per-element options (softcap, class weights) are compiled in; the per-row ones (z-loss,
// token weights) cost nothing and are always there.
template <typename T, int VEC, bool EXT>
__global__ void __launch_bounds__(kThreads, 2048 / kThreads) rows_kernel(const __grid_constant__ CrossEntropyParams p, float* row_loss,
                                                         const float* count) {
  __shared__ float sm[32], ss[32], sx[32];
  const int64_t v = p.v, step = int64_t(blockDim.x) * VEC;
  const float cap = p.softcap, inv_cap = cap > 0.0f ? 1.0f / cap : 0.0f;
  const float* cw = EXT ? p.class_weight : nullptr;
  // The smoothing term's weights w_j, read only with smoothing (without, only w_t matters).
  const float* cws = p.label_smoothing > 0.0f ? cw : nullptr;
  const float wsum = cw ? count[1] : static_cast<float>(v);
  const float scale = p.reduction == CEReduction::Mean ? p.grad_scale / count[0] : p.grad_scale;
  const T* bias = static_cast<const T*>(p.bias);
  for (int64_t i = blockIdx.x; i < p.n; i += gridDim.x) {
    const int64_t t = target_at(p, i);
    const T* x = static_cast<const T*>(p.logits) + i * p.logits_stride;
    T* g = p.grad ? static_cast<T*>(p.grad) + i * p.grad_stride : nullptr;
    float* out_loss = p.reduction == CEReduction::None ? p.loss + i : row_loss + i;
    if (t == p.ignore_index) {
      if (g)
        for (int64_t j = threadIdx.x; j < v; j += blockDim.x) g[j] = from_f32<T>(0.0f);
      if (threadIdx.x == 0) {
        *out_loss = 0.0f;
        if (p.lse) p.lse[i] = 0.0f;
      }
      continue;
    }
    const bool bad = t < 0 || t >= v;
    const float tau = p.token_weight ? p.token_weight[i] : 1.0f;
    MS ms{-INFINITY, 0.0f};
    float sum = 0.0f;  // sum_j w_j z_j
    for (int64_t j = threadIdx.x * VEC; j < v; j += step) {
      float f[VEC];
      load_row(x, bias, j, f);
      cap_row<EXT, T>(cap, inv_cap, f);
      float vm = f[0];
#pragma unroll
      for (int k = 1; k < VEC; ++k) vm = fmaxf(vm, f[k]);
#pragma unroll
      for (int k = 0; k < VEC; ++k) sum += cws ? cws[j + k] * f[k] : f[k];
      ms = merge(ms, MS{vm, sum_exp(f, vm)});
    }
    block_reduce(ms, sum, sm, ss, sx);
    const float lse = ms.m + logf(ms.s);
    const float wt = bad ? 0.0f : cw ? cw[t] : 1.0f;
    if (threadIdx.x == 0) {
      float zt[1] = {bad ? 0.0f : to_f32(x[t]) + (bias ? to_f32(bias[t]) : 0.0f)};
      cap_row<EXT, T>(cap, inv_cap, zt);
      write_row_loss(p, i, out_loss, bad, lse, zt[0], sum, wt, tau, wsum);
    }
    if (!g) continue;
    __syncthreads();  // in place: every thread has read the row before anyone overwrites x[t]
    const RowGrad r = row_grad(p, lse, t, bad, wt, tau, scale, wsum);
    for (int64_t j = threadIdx.x * VEC; j < v; j += step) {
      float f[VEC];
      load_row(x, bias, j, f);
      cap_row<EXT, T>(cap, inv_cap, f);
#pragma unroll
      for (int k = 0; k < VEC; ++k) f[k] = grad_at<EXT>(r, f[k], j + k, cws, cap, inv_cap);
      store_f32(g + j, f);
    }
  }
}

// ---- The one-pass path (sm_90): a thread-block cluster holds each row on chip.
//
// A cluster of C blocks (C = 1, 2, 4 or 8; one or two blocks an SM) owns rows cid, cid + G, ... (G clusters);
// block r of the cluster owns columns [r chunk, (r + 1) chunk) of every row.  Its thread 0 brings the
// slice of the next `stages` rows into shared memory with the bulk copy engine (cp.async.bulk; a
// `full` mbarrier a stage counts the bytes), so the loads of later rows are in flight while a row is
// computed.  For each row every thread moves its part of the slice into registers (the stage goes
// back to the copy engine at once, at the barrier that also gives the block its max), takes the
// exponentials relative to that max (kept in registers where the gradient can reuse them), sums them
// and w z over the block (a second barrier), and thread 0 sends that partial to every block of the
// cluster by st.async, whose bytes complete a phase of the receiver's `exchanged` mbarrier: no
// cluster barrier a row, whose release would wait for this
// block's gradient stores in flight (it cost 30%).  Every warp merges the C partials itself and the
// gradient is written from the registers.  DRAM sees each logit read once and each gradient written
// once: 2 N V element moves, the count anchors.py uses (the loop path makes 3).  Ignored rows are
// never loaded nor exchanged (every block of a cluster skips them alike).  Two exchange slots
// suffice: a block sends exchange x + 2 into slot x only after exchange x + 1 completed, which needs
// every block's x + 1 partial, sent after a __syncthreads that follows all that block's reads of slot x.
constexpr int kMaxStages = 4;

// THREADS x VECS 16-byte vectors: the largest slice a block holds in registers (64 KiB at 512 x 8
// or 1024 x 4: one block per SM; 32 KiB at 256 x 8 or 512 x 4: two).
template <typename T, bool EXT, int THREADS, int VECS>
__global__ void __launch_bounds__(THREADS, 4096 / (THREADS * VECS))
    cluster_rows_kernel(const __grid_constant__ CrossEntropyParams p, float* row_loss, const float* count, int chunk, int stages) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  namespace cg = cooperative_groups;
  namespace ptx = cuda::ptx;
  constexpr int VEC = 16 / sizeof(T);
  // Base 2 for 16-bit logits: p_j = 2^(L z_j - L lse) with L = log2(e): one FFMA and the
  // special-function unit alone (relative error about 2^-22, far below a 16-bit gradient's rounding,
  // where expf costs several instructions more).  f32 logits keep expf.  Maxima travel as L m.
  constexpr bool kBase2 = sizeof(T) < 4;
  constexpr float L = kBase2 ? kLog2e : 1.0f;
  auto expL = [](float x) { return kBase2 ? exp2_approx(x) : expf(x); };
  // Without the per-element options the sum pass's exponentials 2^(L z - L m), m the block's max,
  // replace z in the registers and the gradient pass scales them by 2^(L m - L lse): one FFMA an
  // element instead of an FFMA, an exponential and a multiply.  The exponentials were half of the
  // special-function unit's work (16 a cycle an SM: at 512 x 8 about 2 us of a row's ~6).  The
  // softcap's derivative needs z itself: EXT recomputes.
  constexpr bool kKeepExp = !EXT;
  constexpr bool kPackedMax = sizeof(T) == 2 && !EXT;  // the max pass on packed pairs (HMNMX2)
  extern __shared__ __align__(128) unsigned char smem_raw[];  // stages x chunk elements of T
  __shared__ uint64_t full[kMaxStages], exchanged[2];
  __shared__ __align__(16) float parts[2][8][4];  // by exchange parity, every block's (L max, sum of exp, sum of w z, z_t)
  constexpr int kWarps = THREADS / 32;
  __shared__ __align__(16) float warp_max[kWarps];
  __shared__ __align__(16) float2 warp_sum[kWarps];  // (sum of exp, sum of w z)
  const cg::cluster_group cluster = cg::this_cluster();
  const int rank = static_cast<int>(cluster.block_rank()), csize = static_cast<int>(cluster.num_blocks());
  const int lane = threadIdx.x & 31;
  const int64_t cid = blockIdx.x / csize, nclusters = gridDim.x / csize;
  const int64_t lo = int64_t(rank) * chunk;
  const int len = static_cast<int>(max(int64_t(0), min(int64_t(chunk), p.v - lo)));
  const uint32_t bytes = static_cast<uint32_t>(len) * sizeof(T);
  T* const buf = reinterpret_cast<T*>(smem_raw);
  const T* bias = p.bias ? static_cast<const T*>(p.bias) + lo : nullptr;
  const float cap = p.softcap, inv_cap = cap > 0.0f ? 1.0f / cap : 0.0f, eps = p.label_smoothing;
  // The smoothing term's class weights w_j of this block's slice, read only with smoothing (without,
  // only w_t matters: reading the [V] weights again for every row cost 0.23 ms at [4096, 128256]).
  const float* cw = EXT && p.class_weight && eps > 0.0f ? p.class_weight + lo : nullptr;
  const bool cw16 = (reinterpret_cast<uintptr_t>(cw) & 15) == 0;  // then every vector's weights are (lo, e: multiples of VEC)
  const float wsum = EXT && p.class_weight ? count[1] : static_cast<float>(p.v);
  const float scale = p.reduction == CEReduction::Mean ? p.grad_scale / count[0] : p.grad_scale;

  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) ptx::mbarrier_init(&full[s], 1);
    ptx::mbarrier_init(&exchanged[0], 1);
    ptx::mbarrier_init(&exchanged[1], 1);
    ptx::fence_mbarrier_init(ptx::sem_release, ptx::scope_cluster);
  }
  cluster.sync();  // every block's barriers initialized before any st.async reaches them
  // Thread 0: row `it` of this cluster into stage it % stages (an ignored row: the phase completes empty).
  auto issue = [&](int64_t it) {
    const int64_t i = cid + it * nclusters;
    if (i >= p.n) return;
    uint64_t* bar = &full[it % stages];
    if (bytes == 0 || target_at(p, i) == p.ignore_index) {
      ptx::mbarrier_arrive(bar);
      return;
    }
    ptx::mbarrier_arrive_expect_tx(ptx::sem_release, ptx::scope_cta, ptx::space_shared, bar, bytes);
    ptx::cp_async_bulk(ptx::space_cluster, ptx::space_global, buf + (it % stages) * int64_t(chunk),
                       static_cast<const T*>(p.logits) + i * p.logits_stride + lo, bytes, bar);
  };
  auto wait = [](uint64_t* bar, uint32_t parity) {
    while (!ptx::mbarrier_try_wait_parity(bar, parity)) {
    }
  };
  if (threadIdx.x == 0)
    for (int it = 0; it < stages; ++it) issue(it);

  int exchanges = 0;
  for (int64_t it = 0;; ++it) {
    const int64_t i = cid + it * nclusters;
    if (i >= p.n) break;
    const T* src = buf + (it % stages) * int64_t(chunk);
    wait(&full[it % stages], static_cast<uint32_t>((it / stages) & 1));
    const int64_t t = target_at(p, i);
    T* g = p.grad ? static_cast<T*>(p.grad) + i * p.grad_stride + lo : nullptr;  // null: the loss alone
    float* out_loss = p.reduction == CEReduction::None ? p.loss + i : row_loss + i;
    if (t == p.ignore_index) {
      __syncthreads();  // every thread has seen this phase complete before the stage is re-armed
      if (threadIdx.x == 0) issue(it + stages);
      const float zero[VEC] = {};
      if (g)
        for (int e = threadIdx.x * VEC; e < len; e += THREADS * VEC) store_f32(g + e, zero);
      if (rank == 0 && threadIdx.x == 0) {
        *out_loss = 0.0f;
        if (p.lse) p.lse[i] = 0.0f;
      }
      continue;
    }
    const bool bad = t < 0 || t >= p.v;
    // The slice into registers (biased, capped); per-lane maxima and sums keep the dependency chains
    // VEC apart (one accumulator would serialize VECS x VEC dependent instructions).
    float z[VECS][VEC];
    float mq[VEC];
#pragma unroll
    for (int q = 0; q < VEC; ++q) mq[q] = -INFINITY;
    bool packed = false;  // the max of the 16-bit values themselves, two an instruction (exact; NaN as fmaxf)
    if constexpr (kPackedMax) packed = bias == nullptr;
    if constexpr (kPackedMax) if (packed) {
      using P2 = typename Pair<T>::type;
      P2 pm[VEC / 2];
#pragma unroll
      for (int q = 0; q < VEC / 2; ++q) pm[q] = Pair<T>::round(-INFINITY, -INFINITY);
#pragma unroll
      for (int k = 0; k < VECS; ++k) {
        const int e = (k * THREADS + threadIdx.x) * VEC;
        if (e < len) {
          const Vec<T, VEC> raw = *reinterpret_cast<const Vec<T, VEC>*>(src + e);
          widen(raw, z[k]);
          P2 two[VEC / 2];
          memcpy(two, &raw, sizeof(two));
#pragma unroll
          for (int q = 0; q < VEC / 2; ++q) pm[q] = __hmax2(pm[q], two[q]);
        }
      }
#pragma unroll
      for (int q = 0; q < VEC / 2; ++q) mq[2 * q] = __low2float(pm[q]), mq[2 * q + 1] = __high2float(pm[q]);
    }
    if (!packed) {
#pragma unroll
      for (int k = 0; k < VECS; ++k) {
        const int e = (k * THREADS + threadIdx.x) * VEC;
        if (e < len) {
          load_row(src, bias, e, z[k]);
          cap_row<EXT, T>(cap, inv_cap, z[k]);
#pragma unroll
          for (int q = 0; q < VEC; ++q) mq[q] = fmaxf(mq[q], z[k][q]);
        }
      }
    }
    float zt[1] = {0.0f};  // z_t, from the block that owns column t (0 elsewhere: the exchange sums it)
    if (threadIdx.x == 0 && t >= lo && t < lo + len) {
      zt[0] = to_f32(src[t - lo]) + (p.bias ? to_f32(static_cast<const T*>(p.bias)[t]) : 0.0f);
      cap_row<EXT, T>(cap, inv_cap, zt);
    }
    // The block's max first (its warps' maxima meet at the barrier that frees the stage), so that
    // the exponentials are relative to one max and their sums add plainly: merging (max, sum) pairs
    // in the reduction took two exponentials a level, about a third of the special-function unit's
    // work a row.
    float m = mq[0];
#pragma unroll
    for (int q = 1; q < VEC; ++q) m = fmaxf(m, mq[q]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    if (lane == 0) warp_max[threadIdx.x >> 5] = m;
    __syncthreads();  // the stage is read: hand it back to the copy engine; warp_max complete
    if (threadIdx.x == 0) {
      ptx::fence_proxy_async(ptx::space_shared);  // our generic reads before the async proxy's writes
      issue(it + stages);
    }
    m = warp_max[0];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) m = fmaxf(m, warp_max[w]);
    const float mL = m * L;
    float sq[VEC] = {}, wq[VEC] = {};  // sums of exp and of w z, per lane
    if (eps > 0.0f) {  // before the exponentials replace z (kKeepExp)
#pragma unroll
      for (int k = 0; k < VECS; ++k) {
        const int e = (k * THREADS + threadIdx.x) * VEC;
        if (e < len) {
          float w[VEC];
          if (cw) load_weights(cw + e, cw16, w);
#pragma unroll
          for (int q = 0; q < VEC; ++q) wq[q] += cw ? w[q] * z[k][q] : z[k][q];
        }
      }
    }
    // Every z -inf (masked) or none: m = -inf, and exp(z - m) would be NaN; exponents from 0 instead
    // give exp(-inf) = 0, the masked logits' share.
    const float mL0 = m == -INFINITY ? 0.0f : mL;
#pragma unroll
    for (int k = 0; k < VECS; ++k)
      if ((k * THREADS + threadIdx.x) * VEC < len) {
#pragma unroll
        for (int q = 0; q < VEC; ++q) {
          const float ez = expL(fmaf(z[k][q], L, -mL0));
          sq[q] += ez;
          if constexpr (kKeepExp) z[k][q] = ez;
        }
      }
    // The sums over the block, every thread adding the warps' sums in the same order.  One barrier:
    // the next write of warp_sum follows the next row's first barrier, after every read here.
    MS ms{mL, 0.0f};
    float sum = 0.0f;  // sum_j w_j z_j (only with smoothing)
#pragma unroll
    for (int q = 0; q < VEC; ++q) ms.s += sq[q], sum += wq[q];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      ms.s += __shfl_xor_sync(0xffffffffu, ms.s, o);
      sum += __shfl_xor_sync(0xffffffffu, sum, o);
    }
    if (lane == 0) warp_sum[threadIdx.x >> 5] = float2{ms.s, sum};
    __syncthreads();
    ms.s = 0.0f, sum = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float2 ws = warp_sum[w];
      ms.s += ws.x, sum += ws.y;
    }
    // The exchange.
    const int x = exchanges & 1;
    const uint32_t x_parity = (exchanges >> 1) & 1;
    ++exchanges;
    if (threadIdx.x == 0) {
      ptx::mbarrier_arrive_expect_tx(ptx::sem_release, ptx::scope_cta, ptx::space_shared, &exchanged[x],
                                     static_cast<uint32_t>(csize * sizeof(parts[0][0])));
      const float mine[4] = {ms.m, ms.s, sum, zt[0]};
      for (int peer = 0; peer < csize; ++peer)
        ptx::st_async(cluster.map_shared_rank(&parts[x][rank][0], peer), mine, cluster.map_shared_rank(&exchanged[x], peer));
    }
    wait(&exchanged[x], x_parity);
    MS row{-INFINITY, 0.0f};
    float row_sum = 0.0f, row_zt = 0.0f;
    if (lane < csize) row = MS{parts[x][lane][0], parts[x][lane][1]}, row_sum = parts[x][lane][2], row_zt = parts[x][lane][3];
#pragma unroll
    for (int o = 4; o > 0; o >>= 1) {  // csize <= 8: lanes 0..7 hold the parts
      row = merge<kBase2>(row, MS{__shfl_xor_sync(0xffffffffu, row.m, o), __shfl_xor_sync(0xffffffffu, row.s, o)});
      row_sum += __shfl_xor_sync(0xffffffffu, row_sum, o);
      row_zt += __shfl_xor_sync(0xffffffffu, row_zt, o);
    }
    const float lse2 = __shfl_sync(0xffffffffu, row.m + (kBase2 ? log2f(row.s) : logf(row.s)), 0);  // L lse
    const float lse = lse2 / L;
    row_sum = __shfl_sync(0xffffffffu, row_sum, 0);
    row_zt = __shfl_sync(0xffffffffu, row_zt, 0);
    const float wt = bad ? 0.0f : EXT && p.class_weight ? p.class_weight[t] : 1.0f;
    const float tau = p.token_weight ? p.token_weight[i] : 1.0f;
    if (rank == 0 && threadIdx.x == 0) write_row_loss(p, i, out_loss, bad, lse, row_zt, row_sum, wt, tau, wsum);
    if (!g) continue;  // the loss alone (evaluation): the next row
    // dz_j = A p_j - S w_j - H [j = t], the row's scale folded in; NaN throughout for a bad target.
    const RowGrad r = row_grad(p, lse, t, bad, wt, tau, scale, wsum);
    const float A = bad ? NAN : r.a * r.s_row, S = bad ? NAN : r.smooth * r.s_row, H = r.hot * r.s_row;
    // p_j = 2^(L z_j - L m) 2^(L m - M) / s, with m this block's max and (M, s) the row's merged (max,
    // sum): the first factor kept from the sum above (kKeepExp) or recomputed.  Not 2^(L z_j - L lse):
    // L lse in f32 (about 24 at V = 128k) carries up to 2^-20 of absolute error, 7e-7 of every p_j,
    // which put the f32 gradient past twice the eager error.  In a masked slice (m = -inf, kept values
    // 0) the second factor is 0 too; a row whose max is -inf or NaN makes it NaN.
    const float row_m = __shfl_sync(0xffffffffu, row.m, 0), row_s = __shfl_sync(0xffffffffu, row.s, 0);
    const float Ae = A * (expL(mL - row_m) / row_s);
    // The target's position relative to this thread's first element (none: out of every slice's reach).
    const int tl = t >= lo && t < lo + len ? static_cast<int>(t - lo) - static_cast<int>(threadIdx.x) * VEC : INT_MIN;
#pragma unroll
    for (int k = 0; k < VECS; ++k) {
      const int e = (k * THREADS + threadIdx.x) * VEC;
      if (e < len) {
        float d[VEC], w[VEC];
        if (cw) load_weights(cw + e, cw16, w);
#pragma unroll
        for (int q = 0; q < VEC; ++q) {
          if constexpr (kKeepExp) d[q] = fmaf(Ae, z[k][q], -S);
          else d[q] = Ae * expL(fmaf(z[k][q], L, -mL0)) - (cw ? S * w[q] : S);
        }
        const int kb = k * THREADS * VEC;
        if (tl >= kb && tl < kb + VEC) {  // this vector holds the target
#pragma unroll
          for (int q = 0; q < VEC; ++q)
            if (kb + q == tl) d[q] -= H;
        }
        if (EXT && cap > 0.0f) {
#pragma unroll
          for (int q = 0; q < VEC; ++q) d[q] *= cap_slope(z[k][q], inv_cap);
        }
        store_f32(g + e, d);
      }
    }
  }
  cluster.sync();  // no block leaves while a st.async may still be on its way to it
#else
  __trap();  // launched only on sm_90 and newer (see cross_entropy_rows_cuda)
#endif
}

__global__ void reduce_loss(const __grid_constant__ CrossEntropyParams p, const float* row_loss, const float* count) {
  __shared__ float scratch[32];
  float s = 0.0f;
  for (int64_t i = threadIdx.x; i < p.n; i += blockDim.x) s += row_loss[i];
  s = block_sum(s, scratch);
  if (threadIdx.x == 0) p.loss[0] = p.reduction == CEReduction::Mean ? s / count[0] : s;
}

__global__ void empty_loss(float* loss, float value) { *loss = value; }

// dlogits = grad * dloss: blocks stride over rows, threads over VEC-element vectors of a row.
template <typename T, int VEC> __global__ void __launch_bounds__(256) scale_rows(const __grid_constant__ CEScaleParams p) {
  for (int64_t i = blockIdx.x; i < p.n; i += gridDim.x) {
    const float s = p.dloss ? p.dloss[p.per_row ? i : 0] : p.scale;
    const T* g = static_cast<const T*>(p.grad) + i * p.grad_stride;
    T* d = static_cast<T*>(p.dlogits) + i * p.dlogits_stride;
    for (int64_t j = threadIdx.x; j < p.v / VEC; j += blockDim.x) {
      float x[VEC];
      load_f32(g + j * VEC, x);
#pragma unroll
      for (int k = 0; k < VEC; ++k) x[k] *= s;
      store_f32(d + j * VEC, x);
    }
  }
}

}  // namespace

const char* cross_entropy_scale_cuda(const CEScaleParams& p, cudaStream_t stream) {
  if (const char* e = cross_entropy_scale_check(p)) return e;
  if (p.n == 0) return nullptr;
  int device = 0;
  cudaGetDevice(&device);
  const int vec_full = 16 / kcpp::kernel::dtype_bytes(p.dtype);
  const bool vec_ok = p.v % vec_full == 0 && aligned16(p.grad) && aligned16(p.dlogits) &&
                      p.grad_stride % vec_full == 0 && p.dlogits_stride % vec_full == 0;
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>(p.n, int64_t(sm_count(device)) * 8));
  auto go = [&]<typename T>(T*) {
    if (vec_ok) scale_rows<T, 16 / sizeof(T)><<<grid, 256, 0, stream>>>(p);
    else scale_rows<T, 1><<<grid, 256, 0, stream>>>(p);
  };
  switch (p.dtype) {
    case kernel::DType::f32: go(static_cast<float*>(nullptr)); break;
    case kernel::DType::bf16: go(static_cast<__nv_bfloat16*>(nullptr)); break;
    case kernel::DType::f16: go(static_cast<__half*>(nullptr)); break;
  }
  return launch_error("cross_entropy backward");
}

size_t cross_entropy_workspace(const CrossEntropyParams& p) {
  return (static_cast<size_t>(p.n) + 4) * sizeof(float);  // [count, pad x3, row losses...]
}

const char* cross_entropy_count_cuda(const CrossEntropyParams& p, float* count, cudaStream_t stream) {
  count_valid<<<1, 1024, 0, stream>>>(p, count);
  return launch_error("cross_entropy count");
}

namespace {

// The cluster path's shape for p under c: blocks a cluster (0: the path does not apply) and the
// slice length of each block, in elements.
struct ClusterShape {
  int csize = 0, chunk = 0;
};

ClusterShape cluster_shape(const CrossEntropyParams& p, const CrossEntropyConfig& c, int device);

// The configuration to run: c, with threads 0 (the default) resolved.  Without the per-element
// options, 256 x 8 (two blocks an SM, clusters of up to 8) where the row fits 8 such blocks (up to
// 131072 16-bit logits): at [4096, 128256] bf16 on an H200 0.6267 ms against 0.6429 at 512 x 8
// (bench/RESULTS.md); else, and with the options (whose kernel holds more registers), 512 x 8.
CrossEntropyConfig resolved(const CrossEntropyParams& p, CrossEntropyConfig c, int device) {
  if (c.threads != 0) return c;
  c.threads = 256, c.vecs = 8;
  const bool ext = p.softcap > 0.0f || p.class_weight;
  if (!ext && cluster_shape(p, c, device).csize > 0) return c;
  c.threads = 512;
  return c;
}

ClusterShape cluster_shape(const CrossEntropyParams& p, const CrossEntropyConfig& c, int device) {
  const bool known = (c.threads == 512 && (c.vecs == 4 || c.vecs == 8)) || (c.threads == 1024 && c.vecs == 4) ||
                     (c.threads == 256 && c.vecs == 8);
  if (!c.cluster || !known || p.n == 0 || c.stages < 1 || c.stages > kMaxStages) return {};
  if (device_attribute(cudaDevAttrComputeCapabilityMajor, device) < 9) return {};
  const int64_t bytes = kcpp::kernel::dtype_bytes(p.dtype), vec = 16 / bytes;
  if (p.v % vec != 0 || !aligned16(p.logits) || p.logits_stride % vec != 0 ||
      (p.grad && (!aligned16(p.grad) || p.grad_stride % vec != 0)) || (p.bias && !aligned16(p.bias)))
    return {};
  const int64_t slice_max = int64_t(c.threads) * c.vecs * vec;
  for (int csize = 1; csize <= 8; csize *= 2) {
    const int64_t chunk = ((p.v + csize - 1) / csize + vec - 1) / vec * vec;
    if (chunk > slice_max) continue;
    if (chunk * bytes * c.stages + 4096 > device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin, device)) return {};
    return {csize, static_cast<int>(chunk)};
  }
  return {};
}

// Clusters that fit on the device at once for this kernel, block count and shared memory (cached:
// the occupancy query costs more than the launch).
template <typename Kernel> int resident_clusters(Kernel kernel, cudaLaunchConfig_t cfg, int device) {
  struct Entry {
    const void* fn;
    int device, csize;
    size_t smem;
    int clusters;
  };
  static std::mutex mu;
  static Entry cache[32];
  static int used = 0;
  const int csize = static_cast<int>(cfg.attrs[0].val.clusterDim.x);
  std::lock_guard<std::mutex> lock(mu);
  for (int k = 0; k < used; ++k)
    if (cache[k].fn == reinterpret_cast<const void*>(kernel) && cache[k].device == device && cache[k].csize == csize &&
        cache[k].smem == cfg.dynamicSmemBytes)
      return cache[k].clusters;
  int clusters = 0;
  if (cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg) != cudaSuccess) {
    cudaGetLastError();
    clusters = 0;
  }
  cache[used % 32] = {reinterpret_cast<const void*>(kernel), device, csize, cfg.dynamicSmemBytes, clusters};
  used = used < 32 ? used + 1 : 32;
  return clusters;
}

template <typename T, bool EXT, int THREADS, int VECS>
const char* launch_cluster_rows(const CrossEntropyParams& p, float* row_loss, const float* count, ClusterShape shape,
                                const CrossEntropyConfig& c, int device, cudaStream_t stream, bool& launched) {
  const int stages = c.stages;
  auto kernel = cluster_rows_kernel<T, EXT, THREADS, VECS>;
  const size_t smem = size_t(stages) * shape.chunk * sizeof(T);
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)) != cudaSuccess)
    return launch_error("cross_entropy (cluster shared memory)");
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = static_cast<unsigned>(shape.csize);
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(shape.csize * sm_count(device)), 1, 1);
  cfg.blockDim = dim3(THREADS, 1, 1);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  int clusters = resident_clusters(kernel, cfg, device);
  if (clusters <= 0) return nullptr;  // does not fit: the caller takes the loop path
  if (c.max_clusters > 0) clusters = std::min(clusters, c.max_clusters);
  cfg.gridDim = dim3(static_cast<unsigned>(std::min<int64_t>(p.n, clusters) * shape.csize), 1, 1);
  launched = true;
  if (cudaLaunchKernelEx(&cfg, kernel, p, row_loss, count, shape.chunk, stages) != cudaSuccess) return launch_error("cross_entropy");
  return launch_error("cross_entropy");
}

const char* rows_with(const CrossEntropyParams& p, float* row_loss, const float* count, cudaStream_t stream,
                      const CrossEntropyConfig& given) {
  if (p.n == 0) return nullptr;
  int device = 0;
  cudaGetDevice(&device);
  const CrossEntropyConfig c = resolved(p, given, device);
  const bool ext = p.softcap > 0.0f || p.class_weight;
  if (const ClusterShape shape = cluster_shape(p, c, device); shape.csize > 0) {
    bool launched = false;
    const char* e = nullptr;
    auto go = [&]<typename T>(T*) {
      auto launch = [&]<int THREADS, int VECS>() {
        e = ext ? launch_cluster_rows<T, true, THREADS, VECS>(p, row_loss, count, shape, c, device, stream, launched)
                : launch_cluster_rows<T, false, THREADS, VECS>(p, row_loss, count, shape, c, device, stream, launched);
      };
      if (c.threads == 1024) launch.template operator()<1024, 4>();
      else if (c.threads == 256) launch.template operator()<256, 8>();
      else if (c.vecs == 8) launch.template operator()<512, 8>();
      else launch.template operator()<512, 4>();
    };
    switch (p.dtype) {
      case kernel::DType::f32: go(static_cast<float*>(nullptr)); break;
      case kernel::DType::bf16: go(static_cast<__nv_bfloat16*>(nullptr)); break;
      case kernel::DType::f16: go(static_cast<__half*>(nullptr)); break;
    }
    if (e || launched) return e;
  }
  const int vec_full = 16 / kcpp::kernel::dtype_bytes(p.dtype);
  const bool vec_ok = p.v % vec_full == 0 && aligned16(p.logits) && p.logits_stride % vec_full == 0 &&
                      (!p.grad || (aligned16(p.grad) && p.grad_stride % vec_full == 0)) && (!p.bias || aligned16(p.bias));
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>(p.n, int64_t(sm_count(device)) * 4));
  auto go = [&]<typename T>(T*) {
    constexpr int kVec = 16 / sizeof(T);
    if (ext) {
      if (vec_ok) rows_kernel<T, kVec, true><<<grid, kThreads, 0, stream>>>(p, row_loss, count);
      else rows_kernel<T, 1, true><<<grid, kThreads, 0, stream>>>(p, row_loss, count);
    } else {
      if (vec_ok) rows_kernel<T, kVec, false><<<grid, kThreads, 0, stream>>>(p, row_loss, count);
      else rows_kernel<T, 1, false><<<grid, kThreads, 0, stream>>>(p, row_loss, count);
    }
  };
  switch (p.dtype) {
    case kernel::DType::f32: go(static_cast<float*>(nullptr)); break;
    case kernel::DType::bf16: go(static_cast<__nv_bfloat16*>(nullptr)); break;
    case kernel::DType::f16: go(static_cast<__half*>(nullptr)); break;
  }
  return launch_error("cross_entropy");
}

}  // namespace

int cross_entropy_cluster_size(const CrossEntropyParams& p, const CrossEntropyConfig& c) {
  int device = 0;
  cudaGetDevice(&device);
  return cluster_shape(p, resolved(p, c, device), device).csize;
}

const char* cross_entropy_rows_cuda(const CrossEntropyParams& p, float* row_loss, const float* count, cudaStream_t stream) {
  return rows_with(p, row_loss, count, stream, CrossEntropyConfig{});
}

const char* cross_entropy_reduce_cuda(const CrossEntropyParams& p, const float* row_loss, const float* count,
                                      cudaStream_t stream) {
  if (p.n == 0) empty_loss<<<1, 1, 0, stream>>>(p.loss, p.reduction == CEReduction::Mean ? NAN : 0.0f);
  else reduce_loss<<<1, 1024, 0, stream>>>(p, row_loss, count);
  return launch_error("cross_entropy reduce");
}

const char* cross_entropy_cuda_with(const CrossEntropyParams& p, cudaStream_t stream, const CrossEntropyConfig& c) {
  if (const char* e = cross_entropy_check(p)) return e;
  KCPP_KERNEL_REQUIRE(p.workspace != nullptr, "cross_entropy: argument 'workspace' is null (see cross_entropy_workspace)");
  float* count = static_cast<float*>(p.workspace);
  float* row_loss = count + 4;
  // The mean of no rows is NaN (as PyTorch), their sum 0: written by a kernel, so graph capture is safe.
  if ((p.reduction == CEReduction::Mean || p.class_weight) && p.n > 0)
    if (const char* e = cross_entropy_count_cuda(p, count, stream)) return e;
  if (const char* e = rows_with(p, row_loss, count, stream, c)) return e;
  if (p.reduction != CEReduction::None) return cross_entropy_reduce_cuda(p, row_loss, count, stream);
  return nullptr;
}

const char* cross_entropy_cuda(const CrossEntropyParams& p, cudaStream_t stream) {
  return cross_entropy_cuda_with(p, stream, CrossEntropyConfig{});
}

}  // namespace kcpp::liger
