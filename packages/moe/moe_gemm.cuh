// The grouped GEMM of the moe package's CUDA path: C = A B over groups of a variable number of rows
// (the tokens routed to each expert) or of a variable reduction length (the weight gradients), on
// tensor cores (mma.sync m16n8k16, bf16 / f16 in, f32 accumulate), with the group sizes read on the
// device (no host synchronization).  Internal to moe_cuda.cu.
//
// Tiles of BM x BN x BK = 128 x 128 x 32, eight warps of 64 x 32, three cp.async stages.  Shared
// memory keeps each operand in its global order (rows of the contiguous dim, padded by 8 elements so
// that the eight rows one ldmatrix reads fall in different bank groups): A [BM][BK] when A is
// contiguous along k, else [BK][BM] read with ldmatrix.trans; B [BN][BK] when contiguous along k,
// else [BK][BN].  So one kernel reads every layout the block needs (Transformers' [E, 2I, H] and
// Llama 4's [E, H, 2I] weights, activations by position, gathered token rows) without copies.
//
// Operands.  A(m, k): a + row * lda + k (contiguous along k; row = m) or a + row * lda + m (row = k),
// where a grouped dim's index is a position (the group's offset added) and a gathered row is
// gather[position] / gather_div (the token of a slot).  B(k, n) of group g: half + g * gstride +
// row * ldb + col likewise.  B may be two halves (gate and up): split along n, interleaved by 8
// columns (Dual: logical columns 16c .. 16c+7 are the gate's 8c .., 16c+8 .. 16c+15 the up's, so one
// thread holds the gate and up value of one column), or along k at `b_split`.
//
// Scheduling.  Single: one group of M rows.  MGroup: group g has rows [offsets[g], offsets[g+1]); the
// grid's y covers an upper bound of the m tiles (sum over groups of ceil(rows / BM) <= S / BM + G)
// and a block finds its group in tile_offsets (a prefix sum of the groups' tile counts, made on the
// device), exiting when beyond the last.  KGroup: grid z = group, the reduction runs over the
// group's positions; a group without rows writes zeros.
//
// Epilogues (in registers, at the accumulators' positions):
//   Store:  C rounded to T (or f32, optionally added to) at c + row * ldc + n
//   Glu:    Dual B: gate_up (saved) and h = round(act(round g) * round u)
//   BwdGlu: q = the accumulator; with g, u read from gate_up and the row's coefficient c:
//           dgu = round([dh * u * act'(g), dh * act(g)]), dh = round(c q); ch = round(c h); and the
//           row's partial sum of q * h over this block's columns (partial[row * partial_ld + n tile])
//   Wgrad:  the group's weight gradient, rounded, through its strides, rows split at w_split into two
//           matrices (gate and up)
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kcpp/kernel/activation.h"
#include "kcpp/kernel/cuda.cuh"
#include "kcpp/kernel/tile_order.h"

namespace kcpp::moe::gemm {

using kernel::Activation;
using kernel::cuda::from_f32;
using kernel::cuda::to_f32;

constexpr int BM = 128, BN = 128, BK = 32, STAGES = 3, THREADS = 256, PAD = 8;
constexpr int A_STAGE = (BM * (BK + PAD) > BK * (BM + PAD)) ? BM * (BK + PAD) : BK * (BM + PAD);
constexpr int B_STAGE = (BN * (BK + PAD) > BK * (BN + PAD)) ? BN * (BK + PAD) : BK * (BN + PAD);
constexpr int SMEM_BYTES = STAGES * (A_STAGE + B_STAGE) * 2;

enum class Grouping : int { Single = 0, MGroup = 1, KGroup = 2 };
enum class Split : int { None = 0, Dual = 1, K = 2 };
enum class Epi : int { Store = 0, Glu = 1, BwdGlu = 2, Wgrad = 3 };

template <typename T> struct Args {
  Grouping grouping = Grouping::Single;
  int64_t M = 0, N = 0, K = 0;  // the grouped dim comes from offsets; N is logical (Dual: 2 x inter)
  int groups = 1;
  const int32_t* offsets = nullptr;       // [groups + 1]
  const int32_t* tile_offsets = nullptr;  // [groups + 1] (MGroup)
  // A
  const T* a = nullptr;
  int64_t lda = 0;
  bool a_kcontig = true;
  const int32_t* a_gather = nullptr;
  int a_div = 1;
  // B
  const T* b0 = nullptr;
  const T* b1 = nullptr;
  int64_t ldb = 0, b_gstride = 0, b_split = 0;
  bool b_kcontig = true;
  Split split = Split::None;
  const int32_t* b_gather = nullptr;
  int b_div = 1;
  bool vec = false;  // 16-byte loads (every contiguous extent, stride and base a multiple of 8 elements)
  // Store
  void* c = nullptr;
  int64_t ldc = 0;
  bool c_f32 = false, c_add = false;
  // Glu / BwdGlu
  int64_t inter = 0;
  Activation act = Activation::Silu;
  T* h = nullptr;        // Glu: [rows, inter]
  T* gu_out = nullptr;   // Glu: [rows, 2 inter], optional
  const T* gu_in = nullptr;  // BwdGlu: [rows, 2 inter]
  const float* coef = nullptr;          // BwdGlu: the row's c (null: 1), indexed by coef_index[row] when given
  const int32_t* coef_index = nullptr;
  T* dgu = nullptr;     // BwdGlu: [rows, 2 inter]
  T* ch = nullptr;      // BwdGlu: [rows, inter]
  float* partial = nullptr;  // BwdGlu: [rows, partial_ld], optional
  int64_t partial_ld = 0;
  // Wgrad
  T* w0 = nullptr;
  T* w1 = nullptr;
  int64_t w_gstride = 0, w_rs = 0, w_cs = 0, w_split = 0;
};

__device__ __forceinline__ uint32_t smem_u32(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }
__device__ __forceinline__ void cp16(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }
__device__ __forceinline__ void ldsm4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldsm4t(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
template <typename T> __device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);
template <> __device__ __forceinline__ void mma16816<__nv_bfloat16>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                                                   uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
               "{%0, %1, %2, %3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <> __device__ __forceinline__ void mma16816<__half>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
               "{%0, %1, %2, %3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// act(x), and act'(x) into *d when d is not null: for 16-bit T with the hardware exp and division
// (kernel/activation.h's Fast mode; its error is far below one rounding to T), for f32 the accurate ones.
template <typename T> __device__ __forceinline__ float act_eval(Activation a, float x, float* d) {
  constexpr kernel::MathMode M = sizeof(T) == 2 ? kernel::MathMode::Fast : kernel::MathMode::Accurate;
  switch (a) {
    case Activation::Gelu: return kernel::activate<Activation::Gelu, M>(x, d);
    case Activation::GeluTanh: return kernel::activate<Activation::GeluTanh, M>(x, d);
    case Activation::QuickGelu: return kernel::activate<Activation::QuickGelu, M>(x, d);
    default: return kernel::activate<Activation::Silu, M>(x, d);
  }
}

using kernel::group_of_tile;  // MGroup: the group of m tile mt

// Where this block works: its group, the rows (positions) of the grouped dim, and the k range.
struct Place {
  int g;
  int64_t m0;        // first m of the tile (Single / KGroup: a plain row; MGroup: a position)
  int64_t m_end;     // rows valid below this (a position for MGroup)
  int64_t k_begin;   // first k (KGroup: a position)
  int64_t k_end;
};

// AK: A contiguous along k; BKc: B contiguous along k (the layouts decide the shared-memory order and the
// ldmatrix form); everything else is read from the arguments.
template <typename T, bool AK, bool BKc, Epi E>
__global__ void __launch_bounds__(THREADS) grouped_gemm(const Args<T> p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* const sa = reinterpret_cast<T*>(smem_raw);
  T* const sb = sa + STAGES * A_STAGE;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wm = warp >> 2, wn = warp & 3;

  const Grouping G = p.grouping;
  const Split SP = p.split;
  const bool VEC = p.vec;
  Place pl;
  if (G == Grouping::MGroup) {
    const int mt = blockIdx.y;
    if (mt >= p.tile_offsets[p.groups]) return;
    const int lo = group_of_tile(p.tile_offsets, p.groups, mt);
    pl.g = lo;
    pl.m0 = p.offsets[lo] + static_cast<int64_t>(mt - p.tile_offsets[lo]) * BM;
    pl.m_end = p.offsets[lo + 1];
    pl.k_begin = 0, pl.k_end = p.K;
  } else if (G == Grouping::KGroup) {
    pl.g = blockIdx.z;
    pl.m0 = static_cast<int64_t>(blockIdx.y) * BM, pl.m_end = p.M;
    pl.k_begin = p.offsets[pl.g], pl.k_end = p.offsets[pl.g + 1];
  } else {
    pl.g = 0;
    pl.m0 = static_cast<int64_t>(blockIdx.y) * BM, pl.m_end = p.M;
    pl.k_begin = 0, pl.k_end = p.K;
  }
  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * BN;
  const int64_t klen = pl.k_end - pl.k_begin;
  const int ktiles = static_cast<int>((klen + BK - 1) / BK);

  // Storage row of a (possibly gathered) index.
  auto arow = [&](int64_t r) -> int64_t { return p.a_gather ? p.a_gather[r] / p.a_div : r; };
  auto brow = [&](int64_t r) -> int64_t { return p.b_gather ? p.b_gather[r] / p.b_div : r; };
  const T* bgroup0 = p.b0 + static_cast<int64_t>(pl.g) * p.b_gstride;
  const T* bgroup1 = (p.b1 ? p.b1 : p.b0) + static_cast<int64_t>(pl.g) * p.b_gstride;
  // B's logical n -> (half, physical n); valid when inside its half.
  auto bcol = [&](int64_t n, const T*& half, int64_t& pn) -> bool {
    if (SP == Split::Dual) {
      const int64_t c8 = n >> 3;
      half = (c8 & 1) ? bgroup1 : bgroup0;
      pn = (c8 >> 1) * 8 + (n & 7);
      return pn < p.inter;
    } else {
      half = bgroup0;
      pn = n;
      return n < p.N;
    }
  };
  // B's k (a position for KGroup) -> (half, physical k) for the K split.
  auto bk = [&](int64_t k, const T*& half, int64_t& pk) {
    if (SP == Split::K) {
      if (k >= p.b_split) {
        half = bgroup1;
        pk = k - p.b_split;
        return;
      }
    }
    pk = k;
  };

  auto load_stage = [&](int stage, int kt) {
    T* as = sa + stage * A_STAGE;
    T* bs = sb + stage * B_STAGE;
    const int64_t kb = pl.k_begin + static_cast<int64_t>(kt) * BK;  // first k of the tile (a position for KGroup)
    // ---- A ----
    if constexpr (AK) {  // [BM][BK + PAD]
      if (VEC) {
        for (int c = tid; c < BM * (BK / 8); c += THREADS) {
          const int r = c / (BK / 8), kc = (c % (BK / 8)) * 8;
          const int64_t m = pl.m0 + r, k = kb + kc;
          const bool ok = m < pl.m_end && k < pl.k_end;
          const T* src = ok ? p.a + arow(m) * p.lda + k : p.a;
          cp16(smem_u32(as + r * (BK + PAD) + kc), src, ok);
        }
      } else {
        for (int c = tid; c < BM * BK; c += THREADS) {
          const int r = c / BK, kc = c % BK;
          const int64_t m = pl.m0 + r, k = kb + kc;
          as[r * (BK + PAD) + kc] = (m < pl.m_end && k < pl.k_end) ? p.a[arow(m) * p.lda + k] : from_f32<T>(0.0f);
        }
      }
    } else {  // [BK][BM + PAD]; rows are k
      if (VEC) {
        for (int c = tid; c < BK * (BM / 8); c += THREADS) {
          const int r = c / (BM / 8), mc = (c % (BM / 8)) * 8;
          const int64_t k = kb + r, m = pl.m0 + mc;
          const bool ok = k < pl.k_end && m < pl.m_end;
          const T* src = ok ? p.a + arow(k) * p.lda + m : p.a;
          cp16(smem_u32(as + r * (BM + PAD) + mc), src, ok);
        }
      } else {
        for (int c = tid; c < BK * BM; c += THREADS) {
          const int r = c / BM, mc = c % BM;
          const int64_t k = kb + r, m = pl.m0 + mc;
          as[r * (BM + PAD) + mc] = (k < pl.k_end && m < pl.m_end) ? p.a[arow(k) * p.lda + m] : from_f32<T>(0.0f);
        }
      }
    }
    // ---- B ----
    if constexpr (BKc) {  // [BN][BK + PAD]; rows are n (B is never grouped along k here)
      if (VEC) {
        for (int c = tid; c < BN * (BK / 8); c += THREADS) {
          const int r = c / (BK / 8), kc = (c % (BK / 8)) * 8;
          const T* half;
          int64_t pn, pk;
          const bool okn = bcol(n0 + r, half, pn);
          const int64_t k = kb + kc;
          bk(k, half, pk);
          const bool ok = okn && k < pl.k_end;
          cp16(smem_u32(bs + r * (BK + PAD) + kc), ok ? half + pn * p.ldb + pk : p.b0, ok);
        }
      } else {
        for (int c = tid; c < BN * BK; c += THREADS) {
          const int r = c / BK, kc = c % BK;
          const T* half;
          int64_t pn, pk;
          const bool okn = bcol(n0 + r, half, pn);
          const int64_t k = kb + kc;
          bk(k, half, pk);
          bs[r * (BK + PAD) + kc] = (okn && k < pl.k_end) ? half[pn * p.ldb + pk] : from_f32<T>(0.0f);
        }
      }
    } else {  // [BK][BN + PAD]; rows are k
      if (VEC) {
        for (int c = tid; c < BK * (BN / 8); c += THREADS) {
          const int r = c / (BN / 8), nc = (c % (BN / 8)) * 8;
          const T* half;
          int64_t pn, pk;
          const bool okn = bcol(n0 + nc, half, pn);
          const int64_t k = kb + r;
          bk(k, half, pk);
          const bool ok = okn && k < pl.k_end;
          cp16(smem_u32(bs + r * (BN + PAD) + nc), ok ? half + brow(pk) * p.ldb + pn : p.b0, ok);
        }
      } else {
        for (int c = tid; c < BK * BN; c += THREADS) {
          const int r = c / BN, nc = c % BN;
          const T* half;
          int64_t pn, pk;
          const bool okn = bcol(n0 + nc, half, pn);
          const int64_t k = kb + r;
          bk(k, half, pk);
          bs[r * (BN + PAD) + nc] = (okn && k < pl.k_end) ? half[brow(pk) * p.ldb + pn] : from_f32<T>(0.0f);
        }
      }
    }
  };

  float acc[4][4][4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[i][j][r] = 0.0f;

#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < ktiles) load_stage(s, s);
    cp_commit();
  }
  for (int kt = 0; kt < ktiles; ++kt) {
    cp_wait<STAGES - 2>();
    __syncthreads();
    const int next = kt + STAGES - 1;
    if (next < ktiles) load_stage(next % STAGES, next);
    cp_commit();
    const T* as = sa + (kt % STAGES) * A_STAGE;
    const T* bs = sb + (kt % STAGES) * B_STAGE;
#pragma unroll
    for (int kk = 0; kk < BK; kk += 16) {
      uint32_t af[4][4], bf[4][2];
#pragma unroll
      for (int mi = 0; mi < 4; ++mi) {
        const int mrow = wm * 64 + mi * 16;
        if constexpr (AK) {
          ldsm4(af[mi], smem_u32(as + (mrow + (lane & 15)) * (BK + PAD) + kk + (lane >> 4) * 8));
        } else {
          const int mat = lane >> 3, r = lane & 7;
          ldsm4t(af[mi], smem_u32(as + (kk + r + (mat >> 1) * 8) * (BM + PAD) + mrow + (mat & 1) * 8));
        }
      }
#pragma unroll
      for (int nj = 0; nj < 2; ++nj) {
        const int ncol = wn * 32 + nj * 16, mat = lane >> 3, r = lane & 7;
        uint32_t q[4];
        if constexpr (BKc) ldsm4(q, smem_u32(bs + (ncol + r + (mat >> 1) * 8) * (BK + PAD) + kk + (mat & 1) * 8));
        else ldsm4t(q, smem_u32(bs + (kk + r + (mat & 1) * 8) * (BN + PAD) + ncol + (mat >> 1) * 8));
        bf[2 * nj][0] = q[0], bf[2 * nj][1] = q[1], bf[2 * nj + 1][0] = q[2], bf[2 * nj + 1][1] = q[3];
      }
#pragma unroll
      for (int mi = 0; mi < 4; ++mi)
#pragma unroll
        for (int ni = 0; ni < 4; ++ni) mma16816<T>(acc[mi][ni], af[mi], bf[ni][0], bf[ni][1]);
    }
  }
  cp_wait<0>();
  __syncthreads();

  // ---- epilogue ----
  const int g4 = lane >> 2, t4 = lane & 3;
  auto row_of = [&](int mi, int r) { return wm * 64 + mi * 16 + g4 + ((r & 2) ? 8 : 0); };
  if constexpr (E == Epi::Store) {
#pragma unroll
    for (int mi = 0; mi < 4; ++mi)
#pragma unroll
      for (int ni = 0; ni < 4; ++ni)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const int64_t m = pl.m0 + row_of(mi, r), n = n0 + wn * 32 + ni * 8 + 2 * t4 + (r & 1);
          if (m >= pl.m_end || n >= p.N) continue;
          if (p.c_f32) {
            float* c = static_cast<float*>(p.c) + m * p.ldc + n;
            *c = p.c_add ? *c + acc[mi][ni][r] : acc[mi][ni][r];
          } else {
            static_cast<T*>(p.c)[m * p.ldc + n] = from_f32<T>(acc[mi][ni][r]);
          }
        }
  } else if constexpr (E == Epi::Glu) {
    const int64_t I = p.inter;
#pragma unroll
    for (int mi = 0; mi < 4; ++mi)
#pragma unroll
      for (int ni = 0; ni < 4; ni += 2)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const int64_t m = pl.m0 + row_of(mi, r);
          const int64_t pc = static_cast<int64_t>(blockIdx.x) * (BN / 2) + (wn * 2 + ni / 2) * 8 + 2 * t4 + (r & 1);
          if (m >= pl.m_end || pc >= I) continue;
          const T g = from_f32<T>(acc[mi][ni][r]), u = from_f32<T>(acc[mi][ni + 1][r]);
          if (p.gu_out) {
            p.gu_out[m * 2 * I + pc] = g;
            p.gu_out[m * 2 * I + I + pc] = u;
          }
          if (p.h) p.h[m * I + pc] = from_f32<T>(act_eval<T>(p.act, to_f32(g), nullptr) * to_f32(u));
        }
  } else if constexpr (E == Epi::BwdGlu) {
    const int64_t I = p.inter;
    float rowsum[4][2];
#pragma unroll
    for (int mi = 0; mi < 4; ++mi) {
      rowsum[mi][0] = rowsum[mi][1] = 0.0f;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int64_t m = pl.m0 + wm * 64 + mi * 16 + g4 + half * 8;
        if (m >= pl.m_end) continue;
        float c = 1.0f;
        if (p.coef) c = p.coef[p.coef_index ? p.coef_index[m] : m];
#pragma unroll
        for (int ni = 0; ni < 4; ++ni)
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            const int64_t i = n0 + wn * 32 + ni * 8 + 2 * t4 + j;
            if (i >= I) continue;
            const float q = acc[mi][ni][half * 2 + j];
            const float g = to_f32(p.gu_in[m * 2 * I + i]), u = to_f32(p.gu_in[m * 2 * I + I + i]);
            float da = 0.0f;
            const float a = act_eval<T>(p.act, g, &da);
            const float hv = to_f32(from_f32<T>(a * u));
            rowsum[mi][half] += q * hv;
            const float dh = to_f32(from_f32<T>(c * q));
            p.dgu[m * 2 * I + i] = from_f32<T>(dh * u * da);
            p.dgu[m * 2 * I + I + i] = from_f32<T>(dh * a);
            p.ch[m * I + i] = from_f32<T>(c * hv);
          }
      }
    }
    if (p.partial) {
      // The four lanes of a row, then the four warps along n, in a fixed order.
      float* red = reinterpret_cast<float*>(smem_raw);  // [4][BM]
#pragma unroll
      for (int mi = 0; mi < 4; ++mi)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          float v = rowsum[mi][half];
          v += __shfl_xor_sync(0xffffffffu, v, 1);
          v += __shfl_xor_sync(0xffffffffu, v, 2);
          if (t4 == 0) red[wn * BM + wm * 64 + mi * 16 + g4 + half * 8] = v;
        }
      __syncthreads();
      if (tid < BM) {
        const int64_t m = pl.m0 + tid;
        if (m < pl.m_end)
          p.partial[m * p.partial_ld + blockIdx.x] = ((red[tid] + red[BM + tid]) + red[2 * BM + tid]) + red[3 * BM + tid];
      }
    }
  } else {  // Wgrad
#pragma unroll
    for (int mi = 0; mi < 4; ++mi)
#pragma unroll
      for (int ni = 0; ni < 4; ++ni)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const int64_t m = pl.m0 + row_of(mi, r), n = n0 + wn * 32 + ni * 8 + 2 * t4 + (r & 1);
          if (m >= p.M || n >= p.N) continue;
          T* w = m < p.w_split ? p.w0 : p.w1;
          const int64_t mm = m < p.w_split ? m : m - p.w_split;
          w[static_cast<int64_t>(pl.g) * p.w_gstride + mm * p.w_rs + n * p.w_cs] = from_f32<T>(acc[mi][ni][r]);
        }
  }
}

}  // namespace kcpp::moe::gemm
