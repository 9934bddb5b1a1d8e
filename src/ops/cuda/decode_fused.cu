// The fused decode-layer kernels (ops/nn/decode_fused.h).  Each rounds its intermediates to the
// dtype where the eager composition it replaces stores them (round_to), so that it gives what that
// composition gives up to the order of the f32 sums of squares.
//
// qk_norm_rope_cache: where D and the pointers allow 16-byte accesses, a group of lanes per (row,
// head), each lane holding 16 bytes of the head; in bf16 / f16, where each lane's elements rotate
// with one other lane's, in pairs of elements with the partners by shuffle (the pairs kernel), else
// with the partners from shared memory; elsewhere one warp per (row, head), 4 heads a block, the
// head's D <= 256 elements in registers (8 a lane), the partners from shared memory.
// add_rms_norm: one block per row; a thread keeps its sums in registers for the normalization where
// the row has at most a chunk a thread (else reads back what it wrote; never a second read of x and
// delta).  16-byte accesses where the row allows.
// glu_packed: elementwise over [N, I], gate and up read from the two halves of each row, 16 bytes a
// thread where the row allows.
// All three are launched with programmatic dependent launch (add_rms_norm loads its norm weights
// before the wait).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "ops/cuda/common.cuh"
#include "ops/cuda/launch.h"
#include "ops/cuda/pdl.cuh"
#include "ops/math.h"

namespace kcpp::ops::cuda {
namespace {

using kcpp::kernel::cuda::from_f32;
using kcpp::kernel::cuda::round_to;
using kcpp::kernel::cuda::to_f32;
using kcpp::kernel::cuda::warp_sum;

constexpr int kHeadsPerBlock = 4;
constexpr int kMaxPerLane = 8;  // D <= 256

// RoPE of element e (< rd) of a head whose normed values are in sh, each product rounded before the
// add, as the eager ops store them (no fused multiply-add in f32).
template <typename T>
__device__ __forceinline__ float rope_at(float x, const float* sh, int e, int half, bool interleaved, const T* c, const T* s) {
  const float rot = interleaved ? ((e & 1) ? sh[e - 1] : -sh[e + 1]) : (e < half ? -sh[e + half] : sh[e - half]);
  return round_to<T>(__fadd_rn(round_to<T>(__fmul_rn(x, to_f32(c[e]))), round_to<T>(__fmul_rn(rot, to_f32(s[e])))));
}

// Where head `head` of row b goes: its row of q, or its slot of the k or v cache; nullptr for a row or
// position out of range (decode_attention then reports that row as NaN).
template <typename T>
__device__ __forceinline__ T* qk_destination(T* q_out, T* k_cache, T* v_cache, const int* rows, const int* positions, int b,
                                             int head, int hq, int hkv, int d, int r_count, int capacity) {
  if (head < hq) return q_out + (static_cast<int64_t>(b) * hq + head) * d;
  const int row = rows[b], pos = positions[b];
  if (row < 0 || row >= r_count || pos < 0 || pos >= capacity) return nullptr;
  const bool is_v = head >= hq + hkv;
  const int h = is_v ? head - hq - hkv : head - hq;
  return (is_v ? v_cache : k_cache) + ((static_cast<int64_t>(row) * hkv + h) * capacity + pos) * d;
}

template <typename T>
__global__ void qk_norm_rope_cache_kernel(T* __restrict__ q_out, const T* __restrict__ qkv, const T* __restrict__ q_norm,
                                          const T* __restrict__ k_norm, const T* __restrict__ cos_, const T* __restrict__ sin_,
                                          T* __restrict__ k_cache, T* __restrict__ v_cache, const int* __restrict__ rows,
                                          const int* __restrict__ positions, int hq, int hkv, int d, int rd, int r_count,
                                          int capacity, float eps, float offset, bool gemma, bool interleaved) {
  __shared__ float buf[kHeadsPerBlock][kMaxPerLane * 32];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int head = blockIdx.x * kHeadsPerBlock + warp, b = blockIdx.y, heads = hq + 2 * hkv;
  pdl_wait();  // every input but the norm weights is an earlier kernel's output
  pdl_trigger();
  if (head >= heads) return;
  const T* x = qkv + (static_cast<int64_t>(b) * heads + head) * d;
  const bool is_q = head < hq, is_v = head >= hq + hkv;
  float v[kMaxPerLane];
#pragma unroll
  for (int i = 0; i < kMaxPerLane; ++i) {
    const int e = lane + 32 * i;
    v[i] = e < d ? to_f32(x[e]) : 0.f;
  }
  if (!is_v) {
    const T* w = is_q ? q_norm : k_norm;
    if (w != nullptr) {  // RMSNorm over the head: rstd in f32, as ops::rms_norm_forward computes it
      float ss = 0.f;
#pragma unroll
      for (int i = 0; i < kMaxPerLane; ++i) ss += v[i] * v[i];
      const float rstd = 1.f / sqrtf(warp_sum(ss) / static_cast<float>(d) + eps);
#pragma unroll
      for (int i = 0; i < kMaxPerLane; ++i) {
        const int e = lane + 32 * i;
        if (e >= d) continue;
        const float wt = norm_weight(w, e, offset, gemma);
        v[i] = gemma ? round_to<T>(v[i] * rstd * wt) : round_to<T>(wt * round_to<T>(v[i] * rstd));
      }
    }
    float* sh = buf[warp];
#pragma unroll
    for (int i = 0; i < kMaxPerLane; ++i)
      if (lane + 32 * i < d) sh[lane + 32 * i] = v[i];
    __syncwarp();
    const T* c = cos_ + static_cast<int64_t>(b) * rd;
    const T* s = sin_ + static_cast<int64_t>(b) * rd;
    const int half = rd / 2;
#pragma unroll
    for (int i = 0; i < kMaxPerLane; ++i) {
      const int e = lane + 32 * i;
      if (e < rd) v[i] = rope_at(v[i], sh, e, half, interleaved, c, s);
    }
  }
  T* dst = qk_destination(q_out, k_cache, v_cache, rows, positions, b, head, hq, hkv, d, r_count, capacity);
  if (dst == nullptr) return;
#pragma unroll
  for (int i = 0; i < kMaxPerLane; ++i) {
    const int e = lane + 32 * i;
    if (e < d) dst[e] = from_f32<T>(v[i]);
  }
}

// A thread's place in the 16-byte qk_norm_rope_cache kernels: its lane, its group of p lanes (one
// head of the block's rows), its place gl in the group, that head, and the block's first row (R rows
// a block).
struct QkLane {
  int lane, group, gl, head, b0;
  __device__ QkLane(int p, int rows_a_block)
      : lane(threadIdx.x % 32), group(lane / p), gl(lane % p),
        head((blockIdx.x * kHeadsPerBlock + static_cast<int>(threadIdx.x / 32)) * (32 / p) + group),
        b0(blockIdx.y * rows_a_block) {}
};

// kVec consecutive elements of T in 16 bytes: the unit of the vectorized loads and stores below.
template <typename T> struct alignas(16) Pack {
  static constexpr int kVec = 16 / sizeof(T);
  T v[kVec];
};

// qk_norm_rope_cache with 16-byte accesses: a head is a group of P lanes (D / V rounded up to a
// power of two), each holding V consecutive elements; 32 / P heads a warp, 4 warps a block, R rows a
// block (R > 1 for prefill's many rows: every row's load is issued before the first is used, so a
// thread has R loads in flight).  The norm's sum is a shuffle within the group; RoPE reads each
// element's partner from shared memory.  The lane's norm weights and its cos / sin are 16-byte loads
// where `wide` says the pointers and rd allow it (its V elements then all lie below rd or none do).
template <typename T, int V, int R>
__global__ void qk_norm_rope_cache_vec_kernel(T* __restrict__ q_out, const T* __restrict__ qkv, const T* __restrict__ q_norm,
                                              const T* __restrict__ k_norm, const T* __restrict__ cos_,
                                              const T* __restrict__ sin_, T* __restrict__ k_cache, T* __restrict__ v_cache,
                                              const int* __restrict__ rows, const int* __restrict__ positions, int hq, int hkv,
                                              int d, int rd, int n, int r_count, int capacity, float eps, float offset, bool gemma,
                                              bool interleaved, int p, bool wide) {
  struct alignas(16) Chunk { T v[V]; };
  __shared__ float buf[kHeadsPerBlock * 32 * V];
  const QkLane at(p, R);
  const int warp = threadIdx.x / 32, group = at.group, gl = at.gl, head = at.head, b0 = at.b0, heads = hq + 2 * hkv;
  pdl_wait();  // every input but the norm weights is an earlier kernel's output
  pdl_trigger();
  const bool in_head = head < heads, active = in_head && gl * V < d;
  const bool is_q = head < hq, is_v = head >= hq + hkv;
  const int e0 = gl * V;
  Chunk in[R];
#pragma unroll
  for (int r = 0; r < R; ++r)
    if (active && b0 + r < n) in[r] = reinterpret_cast<const Chunk*>(qkv + (static_cast<int64_t>(b0 + r) * heads + head) * d)[gl];
  const T* w = is_q ? q_norm : k_norm;
  const bool normed = active && !is_v && w != nullptr;
  float wt[V];
  if (normed) {
    if (wide) {
      const Chunk c = reinterpret_cast<const Chunk*>(w)[gl];
#pragma unroll
      for (int j = 0; j < V; ++j) wt[j] = norm_weight_value<T>(to_f32(c.v[j]), offset, gemma);
    } else {
#pragma unroll
      for (int j = 0; j < V; ++j) wt[j] = norm_weight(w, e0 + j, offset, gemma);
    }
  }
  float* sh = buf + (warp * 32 + group * p) * V;  // the head's D elements
  const int half = rd / 2;
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int b = b0 + r;
    const bool live = active && b < n;
    float v[V];
#pragma unroll
    for (int j = 0; j < V; ++j) v[j] = live ? to_f32(in[r].v[j]) : 0.f;
    float ss = 0.f;
#pragma unroll
    for (int j = 0; j < V; ++j) ss += v[j] * v[j];
    for (int o = p / 2; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);  // within the group
    if (normed) {  // RMSNorm over the head: rstd in f32, as ops::rms_norm_forward
      const float rstd = 1.f / sqrtf(ss / static_cast<float>(d) + eps);
#pragma unroll
      for (int j = 0; j < V; ++j) v[j] = gemma ? round_to<T>(v[j] * rstd * wt[j]) : round_to<T>(wt[j] * round_to<T>(v[j] * rstd));
    }
    if (r > 0) __syncwarp();  // the previous row's partners have been read
    if (active) {
#pragma unroll
      for (int j = 0; j < V; ++j) sh[e0 + j] = v[j];
    }
    __syncwarp();
    if (!live) continue;
    if (!is_v && e0 < rd) {
      const T* c = cos_ + static_cast<int64_t>(b) * rd;
      const T* s = sin_ + static_cast<int64_t>(b) * rd;
      if (wide) {  // all V elements below rd; the partners from shared memory
        const Chunk cc = reinterpret_cast<const Chunk*>(c)[gl], sc = reinterpret_cast<const Chunk*>(s)[gl];
#pragma unroll
        for (int j = 0; j < V; ++j) {
          const int e = e0 + j;
          const float rot = interleaved ? ((e & 1) ? sh[e - 1] : -sh[e + 1]) : (e < half ? -sh[e + half] : sh[e - half]);
          v[j] = round_to<T>(__fadd_rn(round_to<T>(__fmul_rn(v[j], to_f32(cc.v[j]))), round_to<T>(__fmul_rn(rot, to_f32(sc.v[j])))));
        }
      } else {
#pragma unroll
        for (int j = 0; j < V; ++j) {
          const int e = e0 + j;
          if (e < rd) v[j] = rope_at(v[j], sh, e, half, interleaved, c, s);
        }
      }
    }
    T* dst = qk_destination(q_out, k_cache, v_cache, rows, positions, b, head, hq, hkv, d, r_count, capacity);
    if (dst == nullptr) continue;
    Chunk out;
#pragma unroll
    for (int j = 0; j < V; ++j) out.v[j] = from_f32<T>(v[j]);
    reinterpret_cast<Chunk*>(dst)[gl] = out;
  }
}

// qk_norm_rope_cache_vec_kernel's work for bf16 / f16 where `wide` holds and a lane's 8 elements
// rotate with one other lane's (RotateHalf with rd a multiple of 16; Interleaved pairs within the
// lane): the same bits in about a third of the instructions.  The norm's f32 product by rstd is
// rounded in pairs; the weight's product (Llama casting: the weight is a value of T, as
// norm_weight_value rounds it), RoPE's products and its sum are paired operations; the partner
// element comes from the partner lane by shuffle.  G: Gemma casting (r(s rstd w) in f32).
template <typename T, int R, bool G>
__global__ void qk_norm_rope_cache_pairs_kernel(T* __restrict__ q_out, const T* __restrict__ qkv, const T* __restrict__ q_norm,
                                                const T* __restrict__ k_norm, const T* __restrict__ cos_,
                                                const T* __restrict__ sin_, T* __restrict__ k_cache, T* __restrict__ v_cache,
                                                const int* __restrict__ rows, const int* __restrict__ positions, int hq, int hkv,
                                                int d, int rd, int n, int r_count, int capacity, float eps, float offset,
                                                bool interleaved, int p) {
  constexpr int V = 8, W = V / 2;  // elements and pairs a lane
  using P = kcpp::kernel::cuda::Pair<T>;
  using T2 = typename P::type;
  struct alignas(16) Chunk { T2 v[W]; };
  const QkLane at(p, R);
  const int lane = at.lane, gl = at.gl, head = at.head, b0 = at.b0, heads = hq + 2 * hkv;
  pdl_wait();  // every input but the norm weights is an earlier kernel's output
  pdl_trigger();
  const bool in_head = head < heads, active = in_head && gl * V < d;
  const bool is_q = head < hq, is_v = head >= hq + hkv;
  const int e0 = gl * V, half = rd / 2;
  Chunk in[R] = {};  // (lanes past the head or the rows shuffle these)
#pragma unroll
  for (int r = 0; r < R; ++r)
    if (active && b0 + r < n) in[r] = reinterpret_cast<const Chunk*>(qkv + (static_cast<int64_t>(b0 + r) * heads + head) * d)[gl];
  const T* w = is_q ? q_norm : k_norm;
  const bool normed = active && !is_v && w != nullptr, rotated = active && !is_v && e0 < rd;
  // RotateHalf: the lane holding elements e0 + half (for e0 < half) or e0 - half.
  const int partner = interleaved || e0 >= rd ? lane : e0 < half ? lane + half / V : lane - half / V;
  T2 w2[G ? 1 : W];
  float wf[G ? V : 1];
  if (normed) {
    const Chunk c = reinterpret_cast<const Chunk*>(w)[gl];
#pragma unroll
    for (int k = 0; k < W; ++k) {
      const float2 f = P::split(c.v[k]);
      const float a = norm_weight_value<T>(f.x, offset, G), b = norm_weight_value<T>(f.y, offset, G);
      if constexpr (G) wf[2 * k] = a, wf[2 * k + 1] = b;
      else w2[k] = P::round(a, b);  // exact: a and b are values of T
    }
  }
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int b = b0 + r;
    const bool live = active && b < n;
    T2 x[W];
    float ss = 0.f;
#pragma unroll
    for (int k = 0; k < W; ++k) {
      x[k] = in[r].v[k];
      const float2 f = live ? P::split(x[k]) : make_float2(0.f, 0.f);
      ss += f.x * f.x;
      ss += f.y * f.y;
    }
    for (int o = p / 2; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);  // within the group
    if (normed) {  // RMSNorm over the head: rstd in f32, as ops::rms_norm_forward
      const float rstd = 1.f / sqrtf(ss / static_cast<float>(d) + eps);
#pragma unroll
      for (int k = 0; k < W; ++k) {
        const float2 f = P::split(x[k]);
        if constexpr (G) x[k] = P::round(f.x * rstd * wf[2 * k], f.y * rstd * wf[2 * k + 1]);
        else x[k] = __hmul2_rn(w2[k], P::round(f.x * rstd, f.y * rstd));
      }
    }
    T2 other[W];  // the partner lane's pairs (every lane takes part in the shuffles)
#pragma unroll
    for (int k = 0; k < W; ++k) {
      const unsigned u = __shfl_sync(0xffffffffu, *reinterpret_cast<const unsigned*>(&x[k]), partner);
      other[k] = *reinterpret_cast<const T2*>(&u);
    }
    if (!live) continue;
    if (rotated) {
      const Chunk cc = reinterpret_cast<const Chunk*>(cos_ + static_cast<int64_t>(b) * rd)[gl];
      const Chunk sc = reinterpret_cast<const Chunk*>(sin_ + static_cast<int64_t>(b) * rd)[gl];
#pragma unroll
      for (int k = 0; k < W; ++k) {
        const T2 xc = __hmul2_rn(x[k], cc.v[k]);
        if (interleaved) {  // (x0, x1) -> (x0 c0 - x1 s0, x1 c1 + x0 s1)
          T2 rs = __hmul2_rn(__lowhigh2highlow(x[k]), sc.v[k]);
          *reinterpret_cast<unsigned*>(&rs) ^= 0x8000u;  // negate the first element: exact
          x[k] = __hadd2_rn(xc, rs);
        } else {  // x c - x[e + half] s below half, x c + x[e - half] s above
          const T2 rs = __hmul2_rn(other[k], sc.v[k]);
          x[k] = e0 < half ? __hsub2_rn(xc, rs) : __hadd2_rn(xc, rs);
        }
      }
    }
    T* dst = qk_destination(q_out, k_cache, v_cache, rows, positions, b, head, hq, hkv, d, r_count, capacity);
    if (dst == nullptr) continue;
    Chunk out;
#pragma unroll
    for (int k = 0; k < W; ++k) out.v[k] = x[k];
    reinterpret_cast<Chunk*>(dst)[gl] = out;
  }
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// V: elements a thread reads at once (Pack<T>::kVec when the row and the pointers allow 16-byte
// accesses, else 1).  kOne: the row has at most blockDim.x chunks, so a thread keeps its chunk's sums
// in registers and loads its norm weights (as a chunk where `wvec`) before the block's reduction;
// else the threads walk the chunks and read their own sums back for the normalization.
template <typename T, int V, bool kOne>
__global__ void __launch_bounds__(1024) add_rms_norm_kernel(T* __restrict__ s_out, T* __restrict__ y, const T* __restrict__ x,
                                    const T* __restrict__ delta, const T* __restrict__ w, int h, float eps, float offset,
                                    bool gemma, bool wvec) {
  struct alignas(V * sizeof(T)) Chunk { T v[V]; };
  __shared__ float scratch[32];
  const int64_t base = static_cast<int64_t>(blockIdx.x) * h;
  const int chunks = h / V;
  const Chunk* xc = reinterpret_cast<const Chunk*>(x + base);
  const Chunk* dc = reinterpret_cast<const Chunk*>(delta + base);
  Chunk* sc = reinterpret_cast<Chunk*>(s_out + base);
  Chunk* yc = reinterpret_cast<Chunk*>(y + base);
  float ss = 0.f;
  if constexpr (kOne) {
    const int c = threadIdx.x;
    const bool live = c < chunks;
    float wt[V] = {};
    if (live) {
      if (wvec) {
        const Chunk wc = reinterpret_cast<const Chunk*>(w)[c];
#pragma unroll
        for (int j = 0; j < V; ++j) wt[j] = norm_weight_value<T>(to_f32(wc.v[j]), offset, gemma);
      } else {
#pragma unroll
        for (int j = 0; j < V; ++j) wt[j] = norm_weight(w, c * V + j, offset, gemma);
      }
    }
    pdl_wait();  // x and delta are earlier kernels' outputs; the weights are not
    pdl_trigger();
    Chunk a{}, b{};
    if (live) a = xc[c], b = dc[c];
    float sum[V];
    Chunk out;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      sum[j] = round_to<T>(to_f32(a.v[j]) + to_f32(b.v[j]));
      out.v[j] = from_f32<T>(sum[j]);
      ss += sum[j] * sum[j];
    }
    if (live) sc[c] = out;
    const float rstd = 1.f / sqrtf(block_reduce<BlockOp::Sum>(ss, scratch) / static_cast<float>(h) + eps);
    if (!live) return;
#pragma unroll
    for (int j = 0; j < V; ++j) out.v[j] = from_f32<T>(gemma ? sum[j] * rstd * wt[j] : wt[j] * round_to<T>(sum[j] * rstd));
    yc[c] = out;
  } else {
    pdl_wait();
    pdl_trigger();
    for (int c = threadIdx.x; c < chunks; c += blockDim.x) {
      const Chunk a = xc[c], b = dc[c];
      Chunk out;
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const float sum = round_to<T>(to_f32(a.v[j]) + to_f32(b.v[j]));
        out.v[j] = from_f32<T>(sum);
        ss += sum * sum;
      }
      sc[c] = out;
    }
    const float rstd = 1.f / sqrtf(block_reduce<BlockOp::Sum>(ss, scratch) / static_cast<float>(h) + eps);
    for (int c = threadIdx.x; c < chunks; c += blockDim.x) {
      const Chunk a = sc[c];  // this thread's own writes
      Chunk out;
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const int e = c * V + j;
        const float sum = to_f32(a.v[j]);
        const float wt = norm_weight(w, e, offset, gemma);
        out.v[j] = from_f32<T>(gemma ? sum * rstd * wt : wt * round_to<T>(sum * rstd));
      }
      yc[c] = out;
    }
  }
}

// Over [N, I] by V-element chunks of a row: blockIdx.x and the thread pick the chunk, blockIdx.y the
// row (walking on by gridDim.y rows), gate and up read from the two halves of the row.  A thread a
// chunk of a row: at prefill's 2,048 x 3,072 that is 60% of the copy rate in a kernel timed alone,
// where four rows a thread (their eight loads in flight, 92 registers) was 48% (bench/RESULTS.md).
// The activation is a template parameter: the unrolled body holds only its code (a runtime switch
// over every unary op, sin and cos with their slow paths among them, made the kernel's code too big).
template <typename T, int V, Unary A>
__global__ void glu_packed_kernel(T* __restrict__ out, const T* __restrict__ gu, int64_t n, int64_t inter) {
  struct alignas(V * sizeof(T)) Chunk { T v[V]; };
  const int64_t chunks = inter / V;
  const int64_t c = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  pdl_wait();  // gu is the projection's output
  pdl_trigger();
  if (c >= chunks) return;
  for (int64_t row = blockIdx.y; row < n; row += gridDim.y) {
    const Chunk* src = reinterpret_cast<const Chunk*>(gu + row * 2 * inter);
    const Chunk g = src[c], u = src[chunks + c];
    Chunk o;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const float a = round_to<T>(math::unary<float>(A, to_f32(g.v[j]), 0.f));
      o.v[j] = from_f32<T>(a * to_f32(u.v[j]));
    }
    reinterpret_cast<Chunk*>(out + row * inter)[c] = o;
  }
}

}  // namespace

void qk_norm_rope_cache(const Tensor& q, const Tensor& qkv, const QkNormRopeCache& opt, const Tensor& cos, const Tensor& sin,
                        const Tensor& k_cache, const Tensor& v_cache, const Tensor& rows, const Tensor& positions) {
  kcpp::cuda::DeviceGuard guard(qkv.device().index);
  const int64_t n = qkv.size(0);
  const int d = static_cast<int>(qkv.size(2)), rd = static_cast<int>(cos.size(2));
  const int heads = static_cast<int>(opt.q_heads + 2 * opt.kv_heads);
  const bool gemma = opt.norm.casting == RMSNormCasting::Gemma;
  visit_cuda_float(qkv.dtype(), "qk_norm_rope_cache", [&]<typename T>(std::type_identity<T>) {
    constexpr int kV = Pack<T>::kVec;
    int p = 1;
    while (p * kV < d) p <<= 1;
    const bool vec = d % kV == 0 && p <= 32 && aligned16(q.data()) && aligned16(qkv.data()) && aligned16(k_cache.data()) &&
                     aligned16(v_cache.data());
    const T* qn = opt.q_norm.defined() ? static_cast<const T*>(opt.q_norm.data()) : nullptr;
    const T* kn = opt.k_norm.defined() ? static_cast<const T*>(opt.k_norm.data()) : nullptr;
    // Prefill's many rows: R = 4 rows a block (fewer, fuller blocks); decode's few: a row a block.
    const int rows_per_block = vec && n >= 1024 ? 4 : 1;
    const bool wide = vec && rd % kV == 0 && aligned16(cos.data()) && aligned16(sin.data()) && (qn == nullptr || aligned16(qn)) &&
                      (kn == nullptr || aligned16(kn));
    const int64_t per_launch = 65535LL * rows_per_block;  // the grid's y dimension holds 65535 blocks
    for (int64_t r0 = 0; r0 < n; r0 += per_launch) {
      const int64_t n_now = std::min<int64_t>(n - r0, per_launch);
      const unsigned rows_now = static_cast<unsigned>((n_now + rows_per_block - 1) / rows_per_block);
      T* q_out = static_cast<T*>(q.data()) + r0 * opt.q_heads * d;
      const T* in = static_cast<const T*>(qkv.data()) + r0 * heads * d;
      const T* c = static_cast<const T*>(cos.data()) + r0 * rd;
      const T* s = static_cast<const T*>(sin.data()) + r0 * rd;
      const int* rw = static_cast<const int*>(rows.data()) + r0;
      const int* ps = static_cast<const int*>(positions.data()) + r0;
      const bool interleaved = opt.layout == RopeLayout::Interleaved;
      if constexpr (sizeof(T) == 2) {
        if (vec && wide && (interleaved || rd % (2 * kV) == 0)) {
          const int per_block = kHeadsPerBlock * (32 / p);
          auto kernel = rows_per_block == 4 ? (gemma ? qk_norm_rope_cache_pairs_kernel<T, 4, true> : qk_norm_rope_cache_pairs_kernel<T, 4, false>)
                                            : (gemma ? qk_norm_rope_cache_pairs_kernel<T, 1, true> : qk_norm_rope_cache_pairs_kernel<T, 1, false>);
          launch_pdl("qk_norm_rope_cache", kernel, dim3((heads + per_block - 1) / per_block, rows_now), dim3(kHeadsPerBlock * 32), 0,
                     q_out, in, qn, kn, c, s, static_cast<T*>(k_cache.data()), static_cast<T*>(v_cache.data()), rw, ps,
                     static_cast<int>(opt.q_heads), static_cast<int>(opt.kv_heads), d, rd, static_cast<int>(n_now),
                     static_cast<int>(k_cache.size(0)), static_cast<int>(k_cache.size(2)), static_cast<float>(opt.norm.eps),
                     static_cast<float>(opt.norm.offset), interleaved, p);
          continue;
        }
      }
      if (vec) {
        const int per_block = kHeadsPerBlock * (32 / p);
        auto kernel = rows_per_block == 4 ? qk_norm_rope_cache_vec_kernel<T, kV, 4> : qk_norm_rope_cache_vec_kernel<T, kV, 1>;
        launch_pdl("qk_norm_rope_cache", kernel, dim3((heads + per_block - 1) / per_block, rows_now),
                   dim3(kHeadsPerBlock * 32), 0, q_out, in, qn, kn, c, s, static_cast<T*>(k_cache.data()),
                   static_cast<T*>(v_cache.data()), rw, ps, static_cast<int>(opt.q_heads), static_cast<int>(opt.kv_heads), d, rd,
                   static_cast<int>(n_now), static_cast<int>(k_cache.size(0)), static_cast<int>(k_cache.size(2)),
                   static_cast<float>(opt.norm.eps), static_cast<float>(opt.norm.offset), gemma,
                   opt.layout == RopeLayout::Interleaved, p, wide);
      } else {
        launch_pdl("qk_norm_rope_cache", qk_norm_rope_cache_kernel<T>, dim3((heads + kHeadsPerBlock - 1) / kHeadsPerBlock, rows_now),
                   dim3(kHeadsPerBlock * 32), 0, q_out, in, qn, kn, c, s, static_cast<T*>(k_cache.data()),
                   static_cast<T*>(v_cache.data()), rw, ps, static_cast<int>(opt.q_heads), static_cast<int>(opt.kv_heads), d, rd,
                   static_cast<int>(k_cache.size(0)), static_cast<int>(k_cache.size(2)), static_cast<float>(opt.norm.eps),
                   static_cast<float>(opt.norm.offset), gemma, opt.layout == RopeLayout::Interleaved);
      }
    }
  });
}

void add_rms_norm(const Tensor& s, const Tensor& y, const Tensor& x, const Tensor& delta, const Tensor& w,
                  const RMSNormOptions& opt) {
  kcpp::cuda::DeviceGuard guard(x.device().index);
  const int64_t n = x.size(0), h = x.size(1);
  KCPP_CHECK(n <= 2147483647 && h <= 2147483647, "op add_rms_norm: too large for one launch: [{}, {}]", n, h);
  const int threads = h >= 4096 ? 1024 : h >= 1024 ? 512 : 256;
  visit_cuda_float(x.dtype(), "add_rms_norm", [&]<typename T>(std::type_identity<T>) {
    constexpr int kV = Pack<T>::kVec;
    const bool vec = h % kV == 0 && aligned16(s.data()) && aligned16(y.data()) && aligned16(x.data()) && aligned16(delta.data());
    const int64_t chunks = vec ? h / kV : h;
    // A row of at most 1024 chunks: a thread a chunk (kOne), the block rounded up to whole warps.
    const bool one = chunks <= 1024;
    auto kernel = vec ? (one ? add_rms_norm_kernel<T, kV, true> : add_rms_norm_kernel<T, kV, false>)
                      : (one ? add_rms_norm_kernel<T, 1, true> : add_rms_norm_kernel<T, 1, false>);
    const int t = one ? static_cast<int>(std::max<int64_t>(32, (chunks + 31) / 32 * 32)) : threads;
    launch_pdl("add_rms_norm", kernel, dim3(static_cast<unsigned>(n)), dim3(t), 0, static_cast<T*>(s.data()),
               static_cast<T*>(y.data()), static_cast<const T*>(x.data()), static_cast<const T*>(delta.data()),
               static_cast<const T*>(w.data()), static_cast<int>(h), static_cast<float>(opt.eps),
               static_cast<float>(opt.offset), opt.casting == RMSNormCasting::Gemma, !vec || aligned16(w.data()));
  });
}

void glu_packed(const Tensor& h, const Tensor& gu, GluActivation act) {
  kcpp::cuda::DeviceGuard guard(gu.device().index);
  const int64_t n = gu.size(0), inter = gu.size(1) / 2;
  const Unary op = act == GluActivation::Silu ? Unary::Silu : act == GluActivation::Gelu ? Unary::Gelu : Unary::GeluTanh;
  visit_cuda_float(gu.dtype(), "glu_packed", [&]<typename T>(std::type_identity<T>) {
    constexpr int kV = Pack<T>::kVec;
    // The blocks of a row split its chunks evenly (a multiple of 32 threads each, at most 256), so
    // few threads idle at the row's end.
    const bool vec = inter % kV == 0 && aligned16(h.data()) && aligned16(gu.data());
    const int64_t chunks = inter / (vec ? kV : 1);
    if (n == 0 || chunks == 0) return;
    const int64_t blocks_x = (chunks + 255) / 256;
    const int threads = static_cast<int>(((chunks + blocks_x - 1) / blocks_x + 31) / 32 * 32);
    const dim3 grid(static_cast<unsigned>(blocks_x), static_cast<unsigned>(std::min<int64_t>(n, 65535)));
    auto launch = [&]<int V>() {
      auto kernel = op == Unary::Silu ? glu_packed_kernel<T, V, Unary::Silu>
                    : op == Unary::Gelu ? glu_packed_kernel<T, V, Unary::Gelu>
                                        : glu_packed_kernel<T, V, Unary::GeluTanh>;
      launch_pdl("glu_packed", kernel, grid, dim3(threads), 0, static_cast<T*>(h.data()), static_cast<const T*>(gu.data()), n,
                 inter);
    };
    vec ? launch.template operator()<kV>() : launch.template operator()<1>();
  });
}

}  // namespace kcpp::ops::cuda
