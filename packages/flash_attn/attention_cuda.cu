// Attention on CUDA (maths and paths in attention.h).
//
// Tensor-core path.  Fragment layouts are those of mma.sync.m16n8k16 (PTX ISA, "Matrix Fragments for
// mma.m16n8k16"): with g = lane / 4 and t = lane % 4, an A fragment holds rows g and g + 8, columns
// 2t, 2t + 1 (and + 8); B holds k rows 2t, 2t + 1 (and + 8) of column g; the f32 accumulator holds
// rows g and g + 8, columns 2t, 2t + 1.  ldmatrix gives A and B fragments straight from shared
// memory (its .trans form for operands stored k-major the other way round).  Tiles are stored with
// rows of D elements in 16-byte chunks, chunk c of row r at position c ^ (r % 8), so the eight rows
// one ldmatrix reads fall in eight different bank groups.
//
// varlen (attention.h): every kernel's grid covers max_seqlen positions of each sequence; a block or
// warp reads its sequence's begin and lengths from the cu_seqlens on the device (sequence()) and does
// nothing past them, and works inside the sequence exactly as on one batch entry of the batched layout.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "attention.h"
#include "kcpp/kernel/cuda.cuh"
#include "kcpp/kernel/fast_math.h"
#include "kcpp/kernel/error.h"
#include "softcap.cuh"

namespace kcpp::flash {
namespace {

namespace kc = kernel::cuda;
using kernel::DType;

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// ---- PTX wrappers ------------------------------------------------------------------------------

__device__ __forceinline__ uint32_t smem_addr(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

// 16 bytes global -> shared, bypassing L1; `valid` false writes zeros (and reads nothing).
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// c += a b, 16 x 8 x 16, f32 accumulation.
template <typename T> __device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);
template <> __device__ __forceinline__ void mma<__nv_bfloat16>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
               "{%0, %1, %2, %3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <> __device__ __forceinline__ void mma<__half>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
               "{%0, %1, %2, %3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

using kernel::cuda::pack2;

// The accumulators of two neighbouring n-tiles (16 x 16 of f32) as one A fragment of T.
template <typename T> __device__ __forceinline__ void to_a(uint32_t (&a)[4], const float (&c0)[4], const float (&c1)[4]) {
  a[0] = pack2<T>(c0[0], c0[1]);
  a[1] = pack2<T>(c0[2], c0[3]);
  a[2] = pack2<T>(c1[0], c1[1]);
  a[3] = pack2<T>(c1[2], c1[3]);
}

// Element offset of chunk `c` (8 elements) of row `r` in a tile of rows of `W` elements.
template <int W> __device__ __forceinline__ int swz(int r, int c) { return r * W + ((c ^ (r & 7)) << 3); }

// Rows [0, R) of a tile of width D from global rows `g + r * ss`; rows >= valid are zero-filled.
// Each thread copies one fixed 16-byte chunk column of rows r0, r0 + RSTEP, ...: RSTEP is a multiple
// of 8, so the swizzle (chunk ^ row % 8) and both addresses are the same offsets stepped by constants.
template <int R, int D, int NT, typename T>
__device__ __forceinline__ void load_tile(T* s, const T* g, int64_t ss, int valid, int tid) {
  constexpr int CH = D / 8, RSTEP = NT / CH;
  static_assert(NT % CH == 0 && RSTEP % 8 == 0 && R % RSTEP == 0, "load_tile: tile and thread count do not divide");
  const int c = tid % CH, r0 = tid / CH;
  const uint32_t dst = smem_addr(s + swz<D>(r0, c));
  const T* src = g + r0 * ss + c * 8;
#pragma unroll
  for (int k = 0; k < R / RSTEP; ++k) {
    const bool ok = r0 + k * RSTEP < valid;
    cp_async16(dst + k * RSTEP * D * static_cast<int>(sizeof(T)), ok ? src + k * RSTEP * ss : g, ok);
  }
}

// 2^x in one MUFU instruction (flush-to-zero; 2^-inf = 0).
using kernel::exp2_approx;

__device__ __forceinline__ bool visible(int64_t pos, int64_t j, int64_t skv, bool causal, int64_t window) {
  return j < skv && (!causal || j <= pos) && (window <= 0 || pos - j < window);
}

// acc (16 x N) += A B^T: A the warp's 16 rows [a0, a0 + 16) of an smem tile, B rows [0, N) of another,
// both of width D (the k dimension), swizzled as load_tile writes them.
template <typename T, int D, int N>
__device__ __forceinline__ void mma_rows_bt(float (&acc)[N / 8][4], const T* sA, int a0, const T* sB, int lane) {
  const int m8 = lane >> 3;
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    uint32_t a[4];
    ldsm_x4(a, smem_addr(sA + swz<D>(a0 + (lane & 15), 2 * kk + (lane >> 4))));
#pragma unroll
    for (int np = 0; np < N / 16; ++np) {
      uint32_t r[4];
      ldsm_x4(r, smem_addr(sB + swz<D>(np * 16 + (m8 >> 1) * 8 + (lane & 7), 2 * kk + (m8 & 1))));
      mma<T>(acc[2 * np], a, r[0], r[1]);
      mma<T>(acc[2 * np + 1], a, r[2], r[3]);
    }
  }
}

// acc (16 x D) += A B for the k-step `kq` of 16: A given as fragments, B rows [16 kq, 16 kq + 16) of
// an smem tile of width D (read transposed by ldmatrix.trans).
template <typename T, int D>
__device__ __forceinline__ void mma_frag_b(float (&acc)[D / 8][4], const uint32_t (&a)[4], const T* sB, int kq, int lane) {
  const int m8 = lane >> 3;
#pragma unroll
  for (int dp = 0; dp < D / 16; ++dp) {
    uint32_t r[4];
    ldsm_x4_t(r, smem_addr(sB + swz<D>(kq * 16 + (m8 & 1) * 8 + (lane & 7), 2 * dp + (m8 >> 1))));
    mma<T>(acc[2 * dp], a, r[0], r[1]);
    mma<T>(acc[2 * dp + 1], a, r[2], r[3]);
  }
}

// ---- forward (tensor cores) --------------------------------------------------------------------

constexpr int kWarps = 4, kThreads = 32 * kWarps, kBr = 16 * kWarps, kBc = 64;

template <typename T, int D> constexpr int fwd_smem() { return (kBr + 4 * kBc) * D * static_cast<int>(sizeof(T)); }

template <typename T, int D> __global__ void __launch_bounds__(kThreads) fwd_kernel(const AttentionParams p) {
  extern __shared__ __align__(128) unsigned char smem[];
  T* sQ = reinterpret_cast<T*>(smem);
  T* sK = sQ + kBr * D;       // two buffers
  T* sV = sK + 2 * kBc * D;   // two buffers
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  const int64_t b = blockIdx.y / p.heads_q, h = blockIdx.y % p.heads_q, hk = h / (p.heads_q / p.heads_kv);
  const Sequence seq = sequence(p, b);
  const int64_t q0 = static_cast<int64_t>(blockIdx.x) * kBr;
  if (q0 >= seq.seq_q) return;  // varlen: a tile past this sequence's queries (the whole block leaves)
  const int64_t sq = seq.seq_q, skv = seq.seq_kv, off = skv - sq;
  const int64_t pos_lo = q0 + off, pos_hi = min(q0 + kBr, sq) - 1 + off;
  const int64_t kv_lo = p.window > 0 ? max(int64_t{0}, pos_lo - p.window + 1) : 0;
  const int64_t kv_hi = p.causal ? pos_hi : skv - 1;
  const int64_t n_begin = kv_lo / kBc, n_end = kv_hi >= kv_lo ? kv_hi / kBc + 1 : n_begin;

  const T* qg = static_cast<const T*>(p.q.data) + b * p.q.sb + h * p.q.sh + (seq.q_begin + q0) * p.q.ss;
  const T* kg = static_cast<const T*>(p.k.data) + b * p.k.sb + hk * p.k.sh + seq.k_begin * p.k.ss;
  const T* vg = static_cast<const T*>(p.v.data) + b * p.v.sb + hk * p.v.sh + seq.k_begin * p.v.ss;
  auto load_kv = [&](int64_t n, int buf) {
    const int valid = static_cast<int>(min(int64_t{kBc}, skv - n * kBc));
    load_tile<kBc, D, kThreads>(sK + buf * kBc * D, kg + n * kBc * p.k.ss, p.k.ss, valid, tid);
    load_tile<kBc, D, kThreads>(sV + buf * kBc * D, vg + n * kBc * p.v.ss, p.v.ss, valid, tid);
  };
  load_tile<kBr, D, kThreads>(sQ, qg, p.q.ss, static_cast<int>(min(int64_t{kBr}, sq - q0)), tid);
  if (n_begin < n_end) load_kv(n_begin, 0);
  cp_async_commit();

  // Soft-capping: the scores become tanh(scale q.k / c) in [-1, 1], and c log2(e) takes the place of
  // scale log2(e) below (both positive: the maximum is taken before the factor).
  const bool cap = p.softcap > 0.0f;
  const float t_scale = cap ? p.scale / p.softcap : 0.0f, sl2 = (cap ? p.softcap : p.scale) * kLog2e;
  float o[D / 8][4] = {};
  float mx[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
  uint32_t qf[D / 16][4];
  for (int64_t n = n_begin; n < n_end; ++n) {
    const int buf = static_cast<int>(n - n_begin) & 1;
    if (n + 1 < n_end) load_kv(n + 1, buf ^ 1);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    if (n == n_begin) {
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) ldsm_x4(qf[kk], smem_addr(sQ + swz<D>(warp * 16 + (lane & 15), 2 * kk + (lane >> 4))));
    }
    const T* k_s = sK + buf * kBc * D;
    const T* v_s = sV + buf * kBc * D;
    // s = q k^T for this warp's 16 rows and the tile's 64 keys.
    float s[kBc / 8][4] = {};
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
#pragma unroll
      for (int np = 0; np < kBc / 16; ++np) {
        uint32_t r[4];
        const int m = lane >> 3;
        ldsm_x4(r, smem_addr(k_s + swz<D>(np * 16 + (m >> 1) * 8 + (lane & 7), 2 * kk + (m & 1))));
        mma<T>(s[2 * np], qf[kk], r[0], r[1]);
        mma<T>(s[2 * np + 1], qf[kk], r[2], r[3]);
      }
    if (cap) cap_scores(s, t_scale);
    const int64_t j0 = n * kBc;
    const bool masked = (p.causal && j0 + kBc - 1 > pos_lo) || (p.window > 0 && j0 <= pos_hi - p.window) ||
                        j0 + kBc > skv;
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      // The maximum of the scores before the factor sl2 (> 0 on this path), then p = 2^(s sl2 - max sl2):
      // one FFMA and one MUFU per score.  mx holds the scaled running maximum.
      float m_raw = -INFINITY;
      if (masked) {
        const int64_t pos = q0 + warp * 16 + g + 8 * hf + off;
#pragma unroll
        for (int nt = 0; nt < kBc / 8; ++nt)
#pragma unroll
          for (int e = 0; e < 2; ++e)
            if (!visible(pos, j0 + nt * 8 + 2 * t + e, skv, p.causal, p.window)) s[nt][2 * hf + e] = -INFINITY;
      }
#pragma unroll
      for (int nt = 0; nt < kBc / 8; ++nt) m_raw = fmaxf(m_raw, fmaxf(s[nt][2 * hf], s[nt][2 * hf + 1]));
      m_raw = fmaxf(m_raw, __shfl_xor_sync(0xffffffffu, m_raw, 1));
      m_raw = fmaxf(m_raw, __shfl_xor_sync(0xffffffffu, m_raw, 2));
      const float m_new = fmaxf(mx[hf], m_raw * sl2);
      const float m_use = m_new == -INFINITY ? 0.0f : m_new;
      const float corr = exp2_approx(mx[hf] - m_use);
      mx[hf] = m_new;
      float sum = 0.0f;
#pragma unroll
      for (int nt = 0; nt < kBc / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) sum += (s[nt][2 * hf + e] = exp2_approx(fmaf(s[nt][2 * hf + e], sl2, -m_use)));
      l[hf] = l[hf] * corr + sum;
#pragma unroll
      for (int dt = 0; dt < D / 8; ++dt) o[dt][2 * hf] *= corr, o[dt][2 * hf + 1] *= corr;
    }
    // o += p v
#pragma unroll
    for (int kk = 0; kk < kBc / 16; ++kk) {
      uint32_t a[4];
      to_a<T>(a, s[2 * kk], s[2 * kk + 1]);
      mma_frag_b<T, D>(o, a, v_s, kk, lane);
    }
    __syncthreads();
  }
  cp_async_wait<0>();

#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    float sum = l[hf];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    const int64_t row = q0 + warp * 16 + g + 8 * hf;
    if (row >= sq) continue;
    const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
    T* og = static_cast<T*>(const_cast<void*>(p.out.data)) + b * p.out.sb + h * p.out.sh + (seq.q_begin + row) * p.out.ss;
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt)
      *reinterpret_cast<uint32_t*>(og + dt * 8 + 2 * t) = pack2<T>(o[dt][2 * hf] * inv, o[dt][2 * hf + 1] * inv);
    if (p.lse && t == 0)
      p.lse[lse_row(p, b, h, seq.q_begin + row)] = sum > 0.0f ? (mx[hf] + log2f(sum)) * kLn2 : -INFINITY;
  }
}

// ---- backward (tensor cores) -------------------------------------------------------------------

// delta_i = dout_i . out_i, one warp per row of lse_row's numbering (f32): the form for any head dim
// and layout (the tensor-core paths take vector_passes()'s below where they apply).
template <typename T> __global__ void delta_kernel(const AttentionParams p, float* delta) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (row >= lse_rows(p)) return;
  int64_t b, h, i;
  lse_row_index(p, row, b, h, i);
  const T* o = static_cast<const T*>(p.out.data) + b * p.out.sb + h * p.out.sh + i * p.out.ss;
  const T* d = static_cast<const T*>(p.dout.data) + b * p.dout.sb + h * p.dout.sh + i * p.dout.ss;
  float s = 0.0f;
  for (int64_t c = threadIdx.x % 32; c < p.head_dim; c += 32) s += kc::to_f32(o[c]) * kc::to_f32(d[c]);
  s = kc::warp_sum(s);
  if (threadIdx.x % 32 == 0) delta[row] = s;
}

// dq = scale * the f32 accumulator, rounded to T; 0 without one (acc null: varlen with no keys at all,
// max_seqlen_k 0, where no other backward kernel runs, their grids over the keys being empty).  An
// element a thread: the form for any head dim and layout.
template <typename T> __global__ void dq_finish_kernel(const AttentionParams p, const float* acc) {
  const int64_t n = lse_rows(p) * p.head_dim;
  for (int64_t x = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; x < n;
       x += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t c = x % p.head_dim, row = x / p.head_dim;
    int64_t b, h, i;
    lse_row_index(p, row, b, h, i);
    static_cast<T*>(const_cast<void*>(p.dq.data))[b * p.dq.sb + h * p.dq.sh + i * p.dq.ss + c] =
        kc::from_f32<T>(acc ? acc[x] * p.scale : 0.0f);
  }
}

// The same two passes 16 bytes a thread, L = head_dim / 8 threads a row (head dims 64, 128 and 256),
// where out, dout, dq and the workspace allow 16-byte access and the rows are numbered in 32 bits
// (vector_passes()).
// The first also zeroes the row's f32 dq accumulator, which the tensor-core kernels add into, so the
// accumulator costs no pass of its own.  Per element they do the arithmetic of the forms above, in
// another order of delta's sum (eight products a thread, then across the row's threads).
bool vector_passes(const AttentionParams& p) {
  if (p.head_dim != 64 && p.head_dim != 128 && p.head_dim != 256) return false;
  if (!kc::aligned16(p.workspace)) return false;  // the accumulator's float4s (the workspace's 256-byte rule is not checked)
  if (lse_rows(p) > int64_t{0xffffffff}) return false;
  for (const Operand* o : {&p.out, &p.dout, &p.dq})
    if (!kc::aligned16(o->data) || o->sb % 8 != 0 || o->sh % 8 != 0 || o->ss % 8 != 0) return false;
  return true;
}

// Row `row` of lse_row's numbering (rows < 2^32) to the element offset of its (b, h, s) in `o`.
__device__ __forceinline__ int64_t row_offset(const AttentionParams& p, const Operand& o, uint32_t row) {
  uint32_t b, h, s;
  lse_row_index(p, row, b, h, s);
  return b * o.sb + h * o.sh + s * o.ss;
}

template <typename T, int L>
__global__ void __launch_bounds__(256) delta_zero_kernel(const AttentionParams p, float* __restrict__ delta,
                                                        float* __restrict__ dq_acc, uint32_t rows) {
  const uint32_t row = blockIdx.x * (256 / L) + threadIdx.x / L;
  const int c = static_cast<int>(threadIdx.x % L) * 8;
  float s = 0.0f;
  if (row < rows) {
    float o[8], d[8];
    kc::load_f32<T, 8>(static_cast<const T*>(p.out.data) + row_offset(p, p.out, row) + c, o);
    kc::load_f32<T, 8>(static_cast<const T*>(p.dout.data) + row_offset(p, p.dout, row) + c, d);
#pragma unroll
    for (int i = 0; i < 8; ++i) s = fmaf(o[i], d[i], s);
    auto* z = reinterpret_cast<float4*>(dq_acc + static_cast<int64_t>(row) * (8 * L) + c);
    z[0] = z[1] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  }
#pragma unroll
  for (int m = L / 2; m > 0; m >>= 1) s += __shfl_xor_sync(0xffffffffu, s, m);  // L divides 32: no row spans warps
  if (row < rows && threadIdx.x % L == 0) delta[row] = s;
}

template <typename T, int L>
__global__ void __launch_bounds__(256) dq_finish_vec_kernel(const AttentionParams p, const float* __restrict__ acc, uint32_t rows) {
  const uint32_t row = blockIdx.x * (256 / L) + threadIdx.x / L;
  if (row >= rows) return;
  const int c = static_cast<int>(threadIdx.x % L) * 8;
  const auto* a = reinterpret_cast<const float4*>(acc + static_cast<int64_t>(row) * (8 * L) + c);
  const float4 lo = a[0], hi = a[1];
  const float v[8] = {lo.x * p.scale, lo.y * p.scale, lo.z * p.scale, lo.w * p.scale,
                      hi.x * p.scale, hi.y * p.scale, hi.z * p.scale, hi.w * p.scale};
  kc::store_f32<T, 8>(static_cast<T*>(const_cast<void*>(p.dq.data)) + row_offset(p, p.dq, row) + c, v);
}

template <typename T, int D> constexpr int bwd_smem() {
  return (2 * kBc + 2 * kBr) * D * static_cast<int>(sizeof(T)) + kBc * kBr * static_cast<int>(sizeof(T)) +
         2 * kBr * static_cast<int>(sizeof(float));
}

// Cap: soft-capping (p.softcap > 0).  ds then needs tanh itself (its slope 1 - tanh^2), so dP^T is
// computed before P^T and both come out of one pass over the scores (without the cap, dP^T is computed
// after dV's product, which keeps fewer accumulators live at once).
template <typename T, int D, bool Cap>
__global__ void __launch_bounds__(kThreads) bwd_kernel(const AttentionParams p, const float* delta, float* dq_acc) {
  extern __shared__ __align__(128) unsigned char smem[];
  T* sK = reinterpret_cast<T*>(smem);
  T* sV = sK + kBc * D;
  T* sQ = sV + kBc * D;
  T* sO = sQ + kBr * D;      // dout
  T* sS = sO + kBr * D;      // ds^T [key][query]
  float* sL = reinterpret_cast<float*>(sS + kBc * kBr);  // lse * log2(e), +inf for a row that sees nothing
  float* sD = sL + kBr;                                   // delta
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4, m8 = lane >> 3;
  const int64_t group = p.heads_q / p.heads_kv;
  const int64_t b = blockIdx.y / p.heads_kv, hk = blockIdx.y % p.heads_kv;
  const Sequence seq = sequence(p, b);
  const int64_t k0 = static_cast<int64_t>(gridDim.x - 1 - blockIdx.x) * kBc;  // the longest tiles first
  if (k0 >= seq.seq_kv) return;  // varlen: a tile past this sequence's keys (the whole block leaves)
  const int64_t sq = seq.seq_q, skv = seq.seq_kv, qb = seq.q_begin, kb = seq.k_begin;
  const int64_t off = skv - sq, k_last = min(k0 + kBc, skv) - 1;
  const int64_t i_lo = p.causal ? max(int64_t{0}, k0 - off) : 0;
  const int64_t i_hi = p.window > 0 ? min(sq - 1, k_last + p.window - 1 - off) : sq - 1;
  const int64_t m_begin = i_lo / kBr, m_end = i_hi >= i_lo ? i_hi / kBr + 1 : m_begin;

  const int64_t tiles = m_end - m_begin, iters = group * tiles;  // (query head, query tile) pairs
  const int kvalid = static_cast<int>(k_last - k0 + 1);
  load_tile<kBc, D, kThreads>(sK, static_cast<const T*>(p.k.data) + b * p.k.sb + hk * p.k.sh + (kb + k0) * p.k.ss, p.k.ss,
                              kvalid, tid);
  load_tile<kBc, D, kThreads>(sV, static_cast<const T*>(p.v.data) + b * p.v.sb + hk * p.v.sh + (kb + k0) * p.v.ss, p.v.ss,
                              kvalid, tid);
  // Iteration `it`'s q and dout tiles (cp.async) and its lse and delta (plain loads).  Issued for the
  // next iteration once this one no longer reads sQ / sO / sL / sD (before its dq stage), so the
  // copy overlaps the dq GEMM and its atomics.
  auto load_q = [&](int64_t it) {
    const int64_t h = hk * group + it / tiles, i0 = (m_begin + it % tiles) * kBr;
    const int qvalid = static_cast<int>(min(int64_t{kBr}, sq - i0));
    load_tile<kBr, D, kThreads>(sQ, static_cast<const T*>(p.q.data) + b * p.q.sb + h * p.q.sh + (qb + i0) * p.q.ss, p.q.ss,
                                qvalid, tid);
    load_tile<kBr, D, kThreads>(sO, static_cast<const T*>(p.dout.data) + b * p.dout.sb + h * p.dout.sh + (qb + i0) * p.dout.ss,
                                p.dout.ss, qvalid, tid);
    if (tid < kBr) {
      const int64_t row = lse_row(p, b, h, qb + i0 + tid);  // read only for tid < qvalid
      const float lse = tid < qvalid ? p.lse[row] : -INFINITY;
      sL[tid] = lse == -INFINITY ? INFINITY : lse * kLog2e;
      sD[tid] = tid < qvalid ? delta[row] : 0.0f;
    }
    cp_async_commit();
  };
  if (iters > 0) load_q(0);
  else cp_async_commit();

  const float t_scale = Cap ? p.scale / p.softcap : 0.0f, sl2 = (Cap ? p.softcap : p.scale) * kLog2e;
  float dk[D / 8][4] = {}, dv[D / 8][4] = {};
  for (int64_t it = 0; it < iters; ++it) {
    {
      const int64_t h = hk * group + it / tiles, i0 = (m_begin + it % tiles) * kBr;
      const int qvalid = static_cast<int>(min(int64_t{kBr}, sq - i0));
      const int64_t row0 = lse_row(p, b, h, qb + i0);  // the tile's rows are row0, row0 + 1, ...
      cp_async_wait<0>();
      __syncthreads();

      // s^T = k q^T: this warp's 16 keys x the tile's 64 queries; then p^T.
      float st[kBr / 8][4] = {}, dpt[kBr / 8][4] = {};
      mma_rows_bt<T, D, kBr>(st, sK, warp * 16, sQ, lane);
      if constexpr (Cap) {
        mma_rows_bt<T, D, kBr>(dpt, sV, warp * 16, sO, lane);  // dp^T = v dout^T
        cap_scores(st, t_scale);
      }
      const bool masked = (p.causal && k0 + kBc - 1 > i0 + off) || (p.window > 0 && i0 + kBr - 1 + off - k0 >= p.window) ||
                          k0 + kBc > skv;
#pragma unroll
      for (int nt = 0; nt < kBr / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int qi = nt * 8 + 2 * t + (e & 1);
          const float u = st[nt][e];  // with the cap, tanh(scale q.k / c)
          float x = exp2_approx(fmaf(u, sl2, -sL[qi]));
          if (masked && !visible(i0 + qi + off, k0 + warp * 16 + g + 8 * (e >> 1), skv, p.causal, p.window)) x = 0.0f;
          st[nt][e] = x;
          if constexpr (Cap) dpt[nt][e] = x * (dpt[nt][e] - sD[qi]) * fmaf(-u, u, 1.0f);  // ds^T
        }
      // dv += p^T dout
#pragma unroll
      for (int kq = 0; kq < kBr / 16; ++kq) {
        uint32_t a[4];
        to_a<T>(a, st[2 * kq], st[2 * kq + 1]);
        mma_frag_b<T, D>(dv, a, sO, kq, lane);
      }
      // Without the cap: dp^T = v dout^T, then ds^T = p^T (dp^T - delta), in st.
      if constexpr (!Cap) {
        mma_rows_bt<T, D, kBr>(dpt, sV, warp * 16, sO, lane);
#pragma unroll
        for (int nt = 0; nt < kBr / 8; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) st[nt][e] *= dpt[nt][e] - sD[nt * 8 + 2 * t + (e & 1)];
      }
      float (&ds)[kBr / 8][4] = Cap ? dpt : st;
      // dk += ds^T q; ds^T to shared memory for dq.
#pragma unroll
      for (int kq = 0; kq < kBr / 16; ++kq) {
        uint32_t a[4];
        to_a<T>(a, ds[2 * kq], ds[2 * kq + 1]);
        const int r0 = warp * 16 + g;
        *reinterpret_cast<uint32_t*>(sS + swz<kBr>(r0, 2 * kq) + 2 * t) = a[0];
        *reinterpret_cast<uint32_t*>(sS + swz<kBr>(r0 + 8, 2 * kq) + 2 * t) = a[1];
        *reinterpret_cast<uint32_t*>(sS + swz<kBr>(r0, 2 * kq + 1) + 2 * t) = a[2];
        *reinterpret_cast<uint32_t*>(sS + swz<kBr>(r0 + 8, 2 * kq + 1) + 2 * t) = a[3];
        mma_frag_b<T, D>(dk, a, sQ, kq, lane);
      }
      __syncthreads();
      if (it + 1 < iters) load_q(it + 1);  // sQ, sO, sL, sD are free: the next tile loads during dq
      // dq (this warp's 16 queries) += ds k, half of D at a time, added into the f32 accumulator.
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        float acc[D / 16][4] = {};
#pragma unroll
        for (int kk = 0; kk < kBc / 16; ++kk) {
          uint32_t a[4];
          ldsm_x4_t(a, smem_addr(sS + swz<kBr>(kk * 16 + (m8 >> 1) * 8 + (lane & 7), warp * 2 + (m8 & 1))));
#pragma unroll
          for (int dp = 0; dp < D / 32; ++dp) {
            uint32_t r[4];
            ldsm_x4_t(r, smem_addr(sK + swz<D>(kk * 16 + (m8 & 1) * 8 + (lane & 7), half * (D / 16) + 2 * dp + (m8 >> 1))));
            mma<T>(acc[2 * dp], a, r[0], r[1]);
            mma<T>(acc[2 * dp + 1], a, r[2], r[3]);
          }
        }
#if __CUDA_ARCH__ >= 900
        // red.global.add.v2.f32: both of a thread's columns in one instruction (the atomics are what
        // bounds this stage: 10.0 -> 7.1 ms for the backward at S 4096 against two scalar ones; a
        // shuffle to 16-byte red.v4 measured slower, 7.5 ms).
#pragma unroll
        for (int e2 = 0; e2 < 2; ++e2) {
          const int qi = warp * 16 + g + 8 * e2;
          if (qi >= qvalid) continue;
          float* dst = dq_acc + (row0 + qi) * D + half * (D / 2) + 2 * t;
#pragma unroll
          for (int dt = 0; dt < D / 16; ++dt)
            atomicAdd(reinterpret_cast<float2*>(dst + dt * 8), make_float2(acc[dt][2 * e2], acc[dt][2 * e2 + 1]));
        }
#else
#pragma unroll
        for (int e2 = 0; e2 < 2; ++e2) {
          const int qi = warp * 16 + g + 8 * e2;
          if (qi >= qvalid) continue;
          float* dst = dq_acc + (row0 + qi) * D + half * (D / 2) + 2 * t;
#pragma unroll
          for (int dt = 0; dt < D / 16; ++dt) {
            atomicAdd(dst + dt * 8, acc[dt][2 * e2]);
            atomicAdd(dst + dt * 8 + 1, acc[dt][2 * e2 + 1]);
          }
        }
#endif
      }
      // No barrier here: the next iteration's (after its cp.async wait) keeps sS from being
      // overwritten while a slower warp still reads it.
    }
  }
  cp_async_wait<0>();

#pragma unroll
  for (int e2 = 0; e2 < 2; ++e2) {
    const int64_t j = k0 + warp * 16 + g + 8 * e2;
    if (j >= skv) continue;
    T* dkg = static_cast<T*>(const_cast<void*>(p.dk.data)) + b * p.dk.sb + hk * p.dk.sh + (kb + j) * p.dk.ss;
    T* dvg = static_cast<T*>(const_cast<void*>(p.dv.data)) + b * p.dv.sb + hk * p.dv.sh + (kb + j) * p.dv.ss;
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt) {
      *reinterpret_cast<uint32_t*>(dkg + dt * 8 + 2 * t) = pack2<T>(dk[dt][2 * e2] * p.scale, dk[dt][2 * e2 + 1] * p.scale);
      *reinterpret_cast<uint32_t*>(dvg + dt * 8 + 2 * t) = pack2<T>(dv[dt][2 * e2], dv[dt][2 * e2 + 1]);
    }
  }
}

// ---- generic path (any dtype, head_dim <= 256) ------------------------------------------------
// Correct rather than fast: f32 inputs, head dims without a tensor-core kernel.  It accumulates in
// f64 (dots, the online softmax, the gradients), so its error is one rounding to the dtype, well
// inside twice the eager reference's (f32's bound is a few units of roundoff).

constexpr int kMaxPerLane = 8;  // head_dim <= 32 * 8

// The score of t = scale q.k in f64 (attention.h): c tanh(t / c) with softcap c, else t; and its slope
// d score / d t at score s.
__device__ __forceinline__ double capped64(double t, double c) { return c > 0.0 ? c * tanh(t / c) : t; }
__device__ __forceinline__ double cap_slope64(double s, double c) { return c > 0.0 ? 1.0 - (s / c) * (s / c) : 1.0; }

__device__ __forceinline__ double warp_sum_f64(double v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

template <typename T> __device__ __forceinline__ void load_lane(double (&x)[kMaxPerLane], const T* row, int64_t d, int lane) {
#pragma unroll
  for (int u = 0; u < kMaxPerLane; ++u) {
    const int64_t c = lane + 32 * u;
    x[u] = c < d ? kc::to_f32(row[c]) : 0.0;
  }
}
template <typename T> __device__ __forceinline__ double dot_lane(const double (&x)[kMaxPerLane], const T* row, int64_t d, int lane) {
  double s = 0.0;
#pragma unroll
  for (int u = 0; u < kMaxPerLane; ++u) {
    const int64_t c = lane + 32 * u;
    if (c < d) s += x[u] * kc::to_f32(row[c]);
  }
  return warp_sum_f64(s);
}
template <typename T> __device__ __forceinline__ void store_lane(T* row, const double (&x)[kMaxPerLane], double scale, int64_t d, int lane) {
#pragma unroll
  for (int u = 0; u < kMaxPerLane; ++u) {
    const int64_t c = lane + 32 * u;
    if (c < d) row[c] = kc::from_f32<T>(static_cast<float>(x[u] * scale));
  }
}

// Query `x` of the grid [B, Hq, Sq] (Sq = max_seqlen_q with varlen): its batch and head, its token i
// (the sequence's begin included), kv head, first key token kb, the keys [lo, hi] of its sequence it sees
// (empty: lo > hi), its row in lse (lse_row) and whether it exists (varlen: x past its sequence's end).
struct QueryRow {
  int64_t b, h, i, hk, kb, lo, hi, row;
  bool valid;
};
__device__ __forceinline__ QueryRow query_row(const AttentionParams& p, int64_t x) {
  QueryRow r;
  r.b = x / (p.heads_q * p.seq_q), r.h = x / p.seq_q % p.heads_q;
  r.hk = r.h / (p.heads_q / p.heads_kv);
  const Sequence seq = sequence(p, r.b);
  const int64_t i = x % p.seq_q, pos = i + seq.seq_kv - seq.seq_q;
  r.valid = i < seq.seq_q;
  r.i = seq.q_begin + i, r.kb = seq.k_begin, r.row = lse_row(p, r.b, r.h, r.i);
  r.lo = p.window > 0 ? max(int64_t{0}, pos - p.window + 1) : 0;
  r.hi = p.causal ? pos : seq.seq_kv - 1;
  return r;
}

// One warp per query row: the online softmax one key at a time.
template <typename T> __global__ void fwd_generic_kernel(const AttentionParams p) {
  const int64_t x = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (x >= p.batch * p.heads_q * p.seq_q) return;
  const int lane = threadIdx.x % 32;
  const QueryRow r = query_row(p, x);
  if (!r.valid) return;  // the whole warp: one query per warp
  const int64_t b = r.b, h = r.h, i = r.i, hk = r.hk, lo = r.lo, hi = r.hi, d = p.head_dim, row = r.row;
  double q[kMaxPerLane], o[kMaxPerLane] = {};
  load_lane(q, static_cast<const T*>(p.q.data) + b * p.q.sb + h * p.q.sh + i * p.q.ss, d, lane);
  const T* kb = static_cast<const T*>(p.k.data) + b * p.k.sb + hk * p.k.sh + r.kb * p.k.ss;
  const T* vb = static_cast<const T*>(p.v.data) + b * p.v.sb + hk * p.v.sh + r.kb * p.v.ss;
  double mx = -INFINITY, l = 0.0;
  for (int64_t j = lo; j <= hi; ++j) {
    const double s = capped64(dot_lane(q, kb + j * p.k.ss, d, lane) * p.scale, p.softcap);
    const double m_new = fmax(mx, s), corr = exp(mx - m_new), e = exp(s - m_new);
    mx = m_new;
    l = l * corr + e;
    const T* vr = vb + j * p.v.ss;
#pragma unroll
    for (int u = 0; u < kMaxPerLane; ++u) {
      const int64_t c = lane + 32 * u;
      o[u] = o[u] * corr + (c < d ? e * kc::to_f32(vr[c]) : 0.0);
    }
  }
  store_lane(static_cast<T*>(const_cast<void*>(p.out.data)) + b * p.out.sb + h * p.out.sh + i * p.out.ss, o,
             l > 0.0 ? 1.0 / l : 0.0, d, lane);
  if (p.lse && lane == 0) p.lse[row] = l > 0.0 ? static_cast<float>(mx + log(l)) : -INFINITY;
}

// One warp per query row: the log-sum-exp again and delta, in f64 (the saved f32 lse is off by
// u |lse| and an f32 delta by u |delta|; ds = p (dp - delta) cancels, and f32's bound is a few units
// of roundoff).  lse64[rows + row] is delta.
template <typename T> __global__ void lse64_generic_kernel(const AttentionParams p, double* lse64) {
  const int64_t x = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (x >= p.batch * p.heads_q * p.seq_q) return;
  const int lane = threadIdx.x % 32;
  const QueryRow r = query_row(p, x);
  if (!r.valid) return;
  const int64_t b = r.b, h = r.h, i = r.i, hk = r.hk, lo = r.lo, hi = r.hi, d = p.head_dim, row = r.row;
  double q[kMaxPerLane];
  load_lane(q, static_cast<const T*>(p.q.data) + b * p.q.sb + h * p.q.sh + i * p.q.ss, d, lane);
  const T* kb = static_cast<const T*>(p.k.data) + b * p.k.sb + hk * p.k.sh + r.kb * p.k.ss;
  double mx = -INFINITY, l = 0.0;
  for (int64_t j = lo; j <= hi; ++j) {
    const double s = capped64(dot_lane(q, kb + j * p.k.ss, d, lane) * p.scale, p.softcap);
    if (s > mx) l = l * exp(mx - s) + 1.0, mx = s;
    else l += exp(s - mx);
  }
  double o[kMaxPerLane];
  load_lane(o, static_cast<const T*>(p.out.data) + b * p.out.sb + h * p.out.sh + i * p.out.ss, d, lane);
  const double delta = dot_lane(o, static_cast<const T*>(p.dout.data) + b * p.dout.sb + h * p.dout.sh + i * p.dout.ss, d, lane);
  if (lane == 0) lse64[row] = l > 0.0 ? mx + log(l) : -INFINITY, lse64[lse_rows(p) + row] = delta;
}

// One warp per query row: dq.
template <typename T> __global__ void dq_generic_kernel(const AttentionParams p, const double* lse64) {
  const int64_t x = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (x >= p.batch * p.heads_q * p.seq_q) return;
  const int lane = threadIdx.x % 32;
  const QueryRow r = query_row(p, x);
  if (!r.valid) return;
  const int64_t b = r.b, h = r.h, i = r.i, hk = r.hk, lo = r.lo, hi = r.hi, d = p.head_dim;
  const double lse = lse64[r.row];
  const double dl = lse64[lse_rows(p) + r.row];
  double q[kMaxPerLane], dout[kMaxPerLane], dq[kMaxPerLane] = {};
  load_lane(q, static_cast<const T*>(p.q.data) + b * p.q.sb + h * p.q.sh + i * p.q.ss, d, lane);
  load_lane(dout, static_cast<const T*>(p.dout.data) + b * p.dout.sb + h * p.dout.sh + i * p.dout.ss, d, lane);
  const T* kb = static_cast<const T*>(p.k.data) + b * p.k.sb + hk * p.k.sh + r.kb * p.k.ss;
  const T* vb = static_cast<const T*>(p.v.data) + b * p.v.sb + hk * p.v.sh + r.kb * p.v.ss;
  if (lse != -INFINITY)
    for (int64_t j = lo; j <= hi; ++j) {
      const T* kr = kb + j * p.k.ss;
      const double sc = capped64(dot_lane(q, kr, d, lane) * p.scale, p.softcap), pr = exp(sc - lse);
      const double ds = pr * (dot_lane(dout, vb + j * p.v.ss, d, lane) - dl) * cap_slope64(sc, p.softcap);
#pragma unroll
      for (int u = 0; u < kMaxPerLane; ++u) {
        const int64_t c = lane + 32 * u;
        if (c < d) dq[u] += ds * kc::to_f32(kr[c]);
      }
    }
  store_lane(static_cast<T*>(const_cast<void*>(p.dq.data)) + b * p.dq.sb + h * p.dq.sh + i * p.dq.ss, dq, p.scale, d, lane);
}

// One warp per key of the grid [B, Hkv, Skv] (Skv = max_seqlen_k with varlen): dk and dv over the
// group's query heads.
template <typename T> __global__ void dkdv_generic_kernel(const AttentionParams p, const double* lse64) {
  const int64_t x = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (x >= p.batch * p.heads_kv * p.seq_kv) return;
  const int lane = threadIdx.x % 32;
  const int64_t b = x / (p.heads_kv * p.seq_kv), hk = x / p.seq_kv % p.heads_kv, jj = x % p.seq_kv;
  const Sequence seq = sequence(p, b);
  if (jj >= seq.seq_kv) return;  // varlen: past this sequence's keys
  const int64_t j = seq.k_begin + jj, qb = seq.q_begin;  // j: the key's token
  const int64_t group = p.heads_q / p.heads_kv, d = p.head_dim, off = seq.seq_kv - seq.seq_q;
  const int64_t i_lo = p.causal ? max(int64_t{0}, jj - off) : 0;
  const int64_t i_hi = p.window > 0 ? min(seq.seq_q - 1, jj + p.window - 1 - off) : seq.seq_q - 1;
  double k[kMaxPerLane], v[kMaxPerLane], dk[kMaxPerLane] = {}, dv[kMaxPerLane] = {};
  load_lane(k, static_cast<const T*>(p.k.data) + b * p.k.sb + hk * p.k.sh + j * p.k.ss, d, lane);
  load_lane(v, static_cast<const T*>(p.v.data) + b * p.v.sb + hk * p.v.sh + j * p.v.ss, d, lane);
  for (int64_t h = hk * group; h < (hk + 1) * group; ++h)
    for (int64_t ii = i_lo; ii <= i_hi; ++ii) {
      const int64_t i = qb + ii, r = lse_row(p, b, h, i);
      const double lse = lse64[r];
      if (lse == -INFINITY) continue;
      const T* qr = static_cast<const T*>(p.q.data) + b * p.q.sb + h * p.q.sh + i * p.q.ss;
      const T* dr = static_cast<const T*>(p.dout.data) + b * p.dout.sb + h * p.dout.sh + i * p.dout.ss;
      const double sc = capped64(dot_lane(k, qr, d, lane) * p.scale, p.softcap), pr = exp(sc - lse);
      const double ds = pr * (dot_lane(v, dr, d, lane) - lse64[lse_rows(p) + r]) * cap_slope64(sc, p.softcap);
#pragma unroll
      for (int u = 0; u < kMaxPerLane; ++u) {
        const int64_t c = lane + 32 * u;
        if (c < d) dk[u] += ds * kc::to_f32(qr[c]), dv[u] += pr * kc::to_f32(dr[c]);
      }
    }
  store_lane(static_cast<T*>(const_cast<void*>(p.dk.data)) + b * p.dk.sb + hk * p.dk.sh + j * p.dk.ss, dk, p.scale, d, lane);
  store_lane(static_cast<T*>(const_cast<void*>(p.dv.data)) + b * p.dv.sb + hk * p.dv.sh + j * p.dv.ss, dv, 1.0, d, lane);
}

// ---- launch ------------------------------------------------------------------------------------

unsigned blocks_for(int64_t warps_needed, int warps_per_block) {
  return static_cast<unsigned>((warps_needed + warps_per_block - 1) / warps_per_block);
}

template <typename T, int D> const char* launch_fwd(const AttentionParams& p, cudaStream_t stream) {
  constexpr int smem = fwd_smem<T, D>();
  const cudaError_t attr = cudaFuncSetAttribute(fwd_kernel<T, D>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (attr != cudaSuccess) return kernel::errorf("attention_forward: cannot reserve %d bytes of shared memory: %s", smem,
                                                 cudaGetErrorString(attr));
  const dim3 grid(static_cast<unsigned>((p.seq_q + kBr - 1) / kBr), static_cast<unsigned>(p.batch * p.heads_q));
  fwd_kernel<T, D><<<grid, kThreads, smem, stream>>>(p);
  return kc::launch_error("attention_forward");
}

template <typename T, int D, bool Cap>
const char* launch_bwd_as(const AttentionParams& p, const float* delta, float* dq_acc, cudaStream_t stream) {
  constexpr int smem = bwd_smem<T, D>();
  const cudaError_t attr = cudaFuncSetAttribute(bwd_kernel<T, D, Cap>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (attr != cudaSuccess) return kernel::errorf("attention_backward: cannot reserve %d bytes of shared memory: %s", smem,
                                                 cudaGetErrorString(attr));
  const dim3 grid(static_cast<unsigned>((p.seq_kv + kBc - 1) / kBc), static_cast<unsigned>(p.batch * p.heads_kv));
  bwd_kernel<T, D, Cap><<<grid, kThreads, smem, stream>>>(p, delta, dq_acc);
  return kc::launch_error("attention_backward");
}
template <typename T, int D>
const char* launch_bwd(const AttentionParams& p, const float* delta, float* dq_acc, cudaStream_t stream) {
  return p.softcap > 0.0f ? launch_bwd_as<T, D, true>(p, delta, dq_acc, stream) : launch_bwd_as<T, D, false>(p, delta, dq_acc, stream);
}

template <typename T> const char* forward_t(const AttentionParams& p, const char* path, cudaStream_t stream) {
  if constexpr (!std::is_same_v<T, float>) {  // the tensor cores take 16-bit inputs
    if (std::strcmp(path, "hopper") == 0) return attention_forward_sm90(p, stream);
    if (std::strcmp(path, "ampere") == 0) return p.head_dim == 64 ? launch_fwd<T, 64>(p, stream) : launch_fwd<T, 128>(p, stream);
  }
  fwd_generic_kernel<T><<<blocks_for(p.batch * p.heads_q * p.seq_q, 4), 128, 0, stream>>>(p);
  return kc::launch_error("attention_forward");
}

// f(L, blocks) with L = head_dim / 8 threads a row (std::integral_constant 8, 16 or 32: head dims 64,
// 128 and 256) and the count of 256-thread blocks that covers `rows` rows so: the vector passes' launch.
template <typename F> void by_row_lanes(const AttentionParams& p, int64_t rows, F&& f) {
  const int lanes = static_cast<int>(p.head_dim / 8);
  const auto blocks = static_cast<unsigned>((rows + 256 / lanes - 1) / (256 / lanes));
  if (lanes == 8) f(std::integral_constant<int, 8>{}, blocks);
  else if (lanes == 16) f(std::integral_constant<int, 16>{}, blocks);
  else f(std::integral_constant<int, 32>{}, blocks);
}

// delta (and the zeroed accumulator, dq_acc non-null) by the vector pass, else by the forms for any
// layout (and a memset).
template <typename T>
const char* launch_delta(const AttentionParams& p, bool vec, float* delta, float* dq_acc, cudaStream_t stream) {
  const int64_t rows = lse_rows(p);
  if (rows == 0) return nullptr;
  if (vec) {
    by_row_lanes(p, rows, [&](auto lanes, unsigned blocks) {
      delta_zero_kernel<T, decltype(lanes)::value><<<blocks, 256, 0, stream>>>(p, delta, dq_acc, static_cast<uint32_t>(rows));
    });
    return kc::launch_error("attention_backward (delta)");
  }
  delta_kernel<T><<<blocks_for(rows, 8), 256, 0, stream>>>(p, delta);
  if (const char* e = kc::launch_error("attention_backward (delta)")) return e;
  if (cudaMemsetAsync(dq_acc, 0, static_cast<size_t>(rows) * static_cast<size_t>(p.head_dim) * sizeof(float), stream) != cudaSuccess)
    return "attention_backward: cudaMemsetAsync of the dq accumulator failed";
  return nullptr;
}

template <typename T> const char* launch_dq_finish(const AttentionParams& p, bool vec, const float* dq_acc, cudaStream_t stream) {
  const int64_t rows = lse_rows(p);
  if (rows == 0) return nullptr;
  if (vec) {
    by_row_lanes(p, rows, [&](auto lanes, unsigned blocks) {
      dq_finish_vec_kernel<T, decltype(lanes)::value><<<blocks, 256, 0, stream>>>(p, dq_acc, static_cast<uint32_t>(rows));
    });
  } else {
    const int64_t n = rows * p.head_dim;
    dq_finish_kernel<T><<<static_cast<unsigned>(std::min<int64_t>((n + 255) / 256, 65536)), 256, 0, stream>>>(p, dq_acc);
  }
  return kc::launch_error("attention_backward (dq)");
}

template <typename T> const char* backward_t(const AttentionParams& p, const char* path, cudaStream_t stream) {
  // rows: of lse, delta and the dq accumulator (lse_row); grid: the generic kernels' queries (query_row).
  const auto rows = static_cast<size_t>(lse_rows(p));
  // No queries: dk = dv = 0 on any path, and the generic one needs no tensor map.
  const bool generic = rows == 0 || std::strcmp(path, "generic") == 0;
  const int64_t grid = p.batch * p.heads_q * p.seq_q;
  float* delta = static_cast<float*>(p.workspace);
  auto aligned = [](size_t n) { return (n + 255) / 256 * 256; };  // attention_backward_workspace's layout
  auto* lse64 = reinterpret_cast<double*>(static_cast<unsigned char*>(p.workspace) + aligned(rows * sizeof(float)));
  auto* dq_acc = reinterpret_cast<float*>(reinterpret_cast<unsigned char*>(lse64) + aligned(2 * rows * sizeof(double)));
  if constexpr (!std::is_same_v<T, float>)
    if (!generic) {
      const bool vec = vector_passes(p);
      if (const char* e = launch_delta<T>(p, vec, delta, dq_acc, stream)) return e;
      const char* e = std::strcmp(path, "hopper") == 0 ? attention_backward_sm90(p, delta, dq_acc, stream)
                      : p.head_dim == 64                ? launch_bwd<T, 64>(p, delta, dq_acc, stream)
                                                        : launch_bwd<T, 128>(p, delta, dq_acc, stream);
      if (e) return e;
      return launch_dq_finish<T>(p, vec, dq_acc, stream);
    }
  if (rows > 0 && grid > 0) {
    lse64_generic_kernel<T><<<blocks_for(grid, 4), 128, 0, stream>>>(p, lse64);
    dq_generic_kernel<T><<<blocks_for(grid, 4), 128, 0, stream>>>(p, lse64);
  }
  dkdv_generic_kernel<T><<<blocks_for(p.batch * p.heads_kv * p.seq_kv, 4), 128, 0, stream>>>(p, lse64);
  return kc::launch_error("attention_backward");
}

const char* cuda_check(const AttentionParams& p, bool backward) {
  if (const char* e = attention_check(p, backward)) return e;
  KCPP_KERNEL_REQUIRE(p.head_dim <= 32 * kMaxPerLane, "attention: head_dim %lld > %d on CUDA",
                      static_cast<long long>(p.head_dim), 32 * kMaxPerLane);
  if (backward && p.batch > 0 && p.seq_kv > 0)
    KCPP_KERNEL_REQUIRE(p.workspace != nullptr, "attention_backward: the workspace is null (attention_backward_workspace bytes)");
  return nullptr;
}

}  // namespace

namespace {

// The path a pass takes: `env` (KCPP_FLASH_ATTN_FORWARD / _BACKWARD) pins one, else the fastest that
// takes the call.  A pinned path that cannot run sets *error saying why.
const char* pick_path(const char* pass, const char* env, const char* no_hopper, bool ampere, const char** error) {
  *error = nullptr;
  const char* want = std::getenv(env);
  if (!want || !*want || std::strcmp(want, "auto") == 0) return !no_hopper ? "hopper" : ampere ? "ampere" : "generic";
  if (std::strcmp(want, "hopper") == 0) {
    if (no_hopper) *error = kernel::errorf("attention_%s: %s=hopper, but %s", pass, env, no_hopper);
    return "hopper";
  }
  if (std::strcmp(want, "ampere") == 0) {
    if (!ampere)
      *error = kernel::errorf("attention_%s: %s=ampere, but the mma.sync kernel takes only bf16 / f16, head_dim 64 / 128, "
                              "scale > 0 and 16-byte aligned rows", pass, env);
    return "ampere";
  }
  if (std::strcmp(want, "generic") == 0) return "generic";
  *error = kernel::errorf("%s is '%.64s'; expected auto, hopper, ampere or generic", env, want);
  return "generic";
}

}  // namespace

const char* attention_forward_path(const AttentionParams& p, const char** error) {
  return pick_path("forward", "KCPP_FLASH_ATTN_FORWARD", attention_sm90_unsupported(p),
                   p.dtype != DType::f32 && attention_fast_path(p), error);
}

const char* attention_backward_path(const AttentionParams& p, const char** error) {
  return pick_path("backward", "KCPP_FLASH_ATTN_BACKWARD", attention_sm90_backward_unsupported(p),
                   p.dtype != DType::f32 && attention_fast_path(p), error);
}

namespace {
// A window of at least the longest key sequence hides nothing (a query's position minus a key's is
// below seq_kv, or max_seqlen_k for varlen): dropped, so that no path masks for it.
AttentionParams without_idle_window(const AttentionParams& p) {
  AttentionParams r = p;
  if (r.window >= r.seq_kv) r.window = 0;
  return r;
}
}  // namespace

const char* attention_forward_cuda(const AttentionParams& params, cudaStream_t stream) {
  if (const char* e = cuda_check(params, false)) return e;
  const AttentionParams p = without_idle_window(params);
  if (p.batch == 0 || p.seq_q == 0) return nullptr;
  const char* error = nullptr;
  const char* path = attention_forward_path(p, &error);
  if (error) return error;
  switch (p.dtype) {
    case DType::f32: return forward_t<float>(p, path, stream);
    case DType::bf16: return forward_t<__nv_bfloat16>(p, path, stream);
    case DType::f16: return forward_t<__half>(p, path, stream);
  }
  return "attention_forward: unknown dtype";
}

const char* attention_backward_cuda(const AttentionParams& params, cudaStream_t stream) {
  if (const char* e = cuda_check(params, true)) return e;
  const AttentionParams p = without_idle_window(params);
  if (p.batch == 0) return nullptr;
  if (p.seq_kv == 0) {  // no keys: batched, no queries either; varlen, queries whose dq is 0 (dk, dv are empty)
    if (!p.varlen() || p.seq_q == 0) return nullptr;
    const int64_t n = lse_rows(p) * p.head_dim;
    const auto blocks = static_cast<unsigned>(std::min<int64_t>((n + 255) / 256, 65536));
    switch (p.dtype) {
      case DType::f32: dq_finish_kernel<float><<<blocks, 256, 0, stream>>>(p, nullptr); break;
      case DType::bf16: dq_finish_kernel<__nv_bfloat16><<<blocks, 256, 0, stream>>>(p, nullptr); break;
      case DType::f16: dq_finish_kernel<__half><<<blocks, 256, 0, stream>>>(p, nullptr); break;
    }
    return kc::launch_error("attention_backward (dq of queries without keys)");
  }
  const char* error = nullptr;
  const char* path = attention_backward_path(p, &error);
  if (error) return error;
  switch (p.dtype) {
    case DType::f32: return backward_t<float>(p, path, stream);
    case DType::bf16: return backward_t<__nv_bfloat16>(p, path, stream);
    case DType::f16: return backward_t<__half>(p, path, stream);
  }
  return "attention_backward: unknown dtype";
}

}  // namespace kcpp::flash
