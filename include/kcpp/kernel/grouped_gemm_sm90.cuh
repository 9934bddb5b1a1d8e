// A persistent grouped GEMM on Hopper (sm_90a): the rows of an A buffer [rows, K] in groups, group g
// the rows [offsets[g], offsets[g + 1]), each group multiplied by its own weight W_g of a stack
// [G, N, K], with warpgroup MMA (wgmma) on tiles that the tensor memory accelerator (TMA) brings into
// shared memory.  The moe package's experts run on it (group g = expert g, its rows the tokens routed
// there, by position: packages/moe/moe_gemm_sm90.cuh); a dense product is its one-group case, given
// without offsets (the library's ops::linear_glu and ops::linear_qk_norm_rope_cache).
//
//   Glu    [g | u] = A [Wg; Wu]^T of the group's rows, then gate_up (saved, optional) = r([g, u])
//          and h = r(act(r g) r u), or with round_act h = r(r(act(r g)) r u)  (r: round to T)
//   Store  C = r(A W^T)
//   QkNormRope  the attention's fused q / k / v projection (one group): C = r(A W^T) as heads of D
//          (64 or 128) columns, q heads then k heads then v heads; the q and k heads RMS-normed per
//          head and rotated (rotate-half RoPE), q written out, k and v into a KV cache at each row's
//          cache row and position (qk_norm_rope_epilogue below has the maths)
//
// A is contiguous along K; W_g [N, K] contiguous along K (Glu: Wg and Wu [inter, K], e.g. the two
// halves of one [2 inter, K] stack: Transformers' gate_up_proj [E, 2I, H], a dense MLP's fused
// gate_up [2I, H]).  No group size comes to the host: the tiles of every group are the prefix sum of
// ceil(rows / 128) (tile_offsets), read on the device, so the products need no stream
// synchronization and run under graph capture.
//
// The kernel is persistent (a block an SM, each looping over work items: one 128-row tile of one
// group's rows x one 256-column tile of N) with three warpgroups, as the package flash_attn's Hopper
// attention.  The items run in panels of kPanel = 16 m tiles, n tiles outer and the panel's m tiles
// inner (panel_item), so that the blocks working at a time read about 16 tiles of A rows and 132 / 16
// tiles of W: the fewest bytes from memory for 132 tiles of 128 x 256 when W's tile is twice A's
// (sqrt(132 * 2)).  With the columns fastest instead, a wave of blocks at Mixtral's I = 14,336 reads
// 132 different weight tiles and its gate_up ran 7.3 against 5.4 ms (bench/RESULTS.md).
// Warpgroup 0 is the producer, one thread issuing the bulk tensor copies of A's [128, 64] and W's
// [256, 64] tiles of each k-step into a ring of stages (4 for Glu, 3 for Store), each guarded by a
// "full" mbarrier (completed by the copy engine with its bytes) and an "empty" one (every consumer
// warp arrives once its products have read the stage), the ring running on across items so that the
// next item's loads overlap this one's epilogue; warpgroups 1 and 2 each own 64 of the tile's rows
// and issue m64n256k16 wgmma with both operands in shared memory (K-major, 128-byte swizzle), keeping
// one k-step's products in flight while they wait for the next stage.  A tile's rows that belong to
// the next group (or lie past the buffer, read as zeros) are computed and not written; K past its
// end reads zeros from both operands.  Glu's tile of W is the gate's 128 rows then the up's 128 rows
// of the same columns of inter, so a thread holds g and u of one element in accumulators 4 i + e and
// 4 (i + 16) + e and the activation needs no exchange between threads; the activation is a template
// parameter (a runtime switch over the four, unrolled 64 times a thread, cost gate_up about twice its
// products' time) in kernel/activation.h's Fast mode (the outputs are 16-bit).
// The epilogue: where all 64 rows of a warpgroup are its group's, the warpgroup writes its output
// (h, or C) into a staging tile of its own in the 128-byte swizzle (conflict-free: the 8 rows of a
// store instruction fall in 8 different 16-byte chunks) and one thread issues bulk tensor stores of
// 64 x 64 boxes, which run on while the warpgroup starts its next item; before it writes the staging
// tile again, that thread waits until the previous stores have read it.  The group's last tile
// (rows past its end are the next group's) is written from the registers, 16 bytes a thread after
// each quad of threads exchanges its column pairs, and so is Glu's saved gate_up.
#pragma once

#include <climits>
#include <cstdint>
#include <type_traits>

#include "kcpp/kernel/activation.h"
#include "kcpp/kernel/sm90.cuh"
#include "kcpp/kernel/tile_order.h"

namespace kcpp::kernel::sm90gemm {

using namespace kernel::sm90;
using cuda::round_to;

enum class GemmEpilogue : int { Store = 0, Glu = 1, QkNormRope = 2 };

constexpr int kBM = 128, kBN = 256, kBK = 64, kThreads = 384;
// Work items run in panels of kPanel m tiles, n tiles outer (see the head comment).
constexpr int kPanel = 16;
constexpr int kABytes = kBM * kBK * 2, kBBytes = kBN * kBK * 2, kStageBytes = kABytes + kBBytes;
// Per epilogue: the ring's stages, and each consumer warpgroup's staging tile of its 64 output rows
// (Glu: h's 128 columns; Store: 256 columns), in boxes of 64 x 64 (8 KiB, 128-byte swizzle).
// QkNormRope stores from registers and takes Store's sizes (its staging unused).
constexpr int stages(GemmEpilogue e) { return e == GemmEpilogue::Glu ? 4 : 3; }
constexpr int staging_bytes(GemmEpilogue e) { return 64 * (e == GemmEpilogue::Glu ? kBN / 2 : kBN) * 2; }
constexpr int smem_bytes(GemmEpilogue e) {
  return 1024 /* alignment slack */ + stages(e) * kStageBytes + 2 * staging_bytes(e) + 16 * stages(e);
}
static_assert(smem_bytes(GemmEpilogue::Glu) <= 227 * 1024 && smem_bytes(GemmEpilogue::Store) <= 227 * 1024 &&
                  smem_bytes(GemmEpilogue::QkNormRope) <= 227 * 1024,
              "sm90 grouped GEMM: shared memory");

// The kernel's parameters (the host's GroupedGemm below, with the tensor maps made).
template <typename T> struct GemmParams {
  int groups = 0;
  const int32_t* offsets = nullptr;       // [groups + 1]; null: one group of `rows` rows
  const int32_t* tile_offsets = nullptr;  // [groups + 1]
  int rows = 0;
  int64_t n = 0;                          // Store: N; Glu: inter
  int n_tiles = 0;                        // tiles of kBN columns (Glu: of kBN / 2 columns of inter)
  int k_tiles = 0;
  // Store
  T* c = nullptr;
  int64_t ldc = 0;
  // Glu
  T* h = nullptr;       // [rows, inter]
  T* gu_out = nullptr;  // [rows, 2 inter], optional
  bool round_act = false;
  // QkNormRope (N = (hq + 2 hkv) D columns: the heads q, then k, then v)
  T* q_out = nullptr;                     // [rows, hq, D]
  T* k_cache = nullptr;                   // [cache_rows, hkv, capacity, D]
  T* v_cache = nullptr;
  const int32_t* rows_of = nullptr;       // [rows]: each row's cache row
  const int32_t* positions = nullptr;     // [rows]: each row's position
  const T* q_norm = nullptr;              // [D] each, or both null
  const T* k_norm = nullptr;
  const T* cos = nullptr;                 // [rows, D] each (rotate-half RoPE over the whole head), or both null
  const T* sin = nullptr;
  int hq = 0, hkv = 0, cache_rows = 0, capacity = 0;
  float eps = 0.f, norm_offset = 0.f;
  bool gemma = false;
};

#if KCPP_SM90_DEVICE || !defined(__CUDA_ARCH__)
__device__ __forceinline__ void st_shared(uint32_t addr, uint32_t v) { asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory"); }
__device__ __forceinline__ uint32_t pick4(const uint32_t (&v)[4], int s) { return s == 0 ? v[0] : s == 1 ? v[1] : s == 2 ? v[2] : v[3]; }
// The four lanes t of a quad hold pairs v[j] of columns 8 (i0 + j) + 2 t; returns the 8 columns 8 (i0 + t) .. + 7.
__device__ __forceinline__ uint4 quad_transpose(const uint32_t (&v)[4], int t) {
  uint32_t g[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const uint32_t send = pick4(v, t ^ k);
    g[k] = k == 0 ? send : __shfl_xor_sync(0xffffffffu, send, k);
  }
  return make_uint4(pick4(g, t), pick4(g, t ^ 1), pick4(g, t ^ 2), pick4(g, t ^ 3));
}
// The QkNormRope epilogue on a consumer thread's accumulators: rows m = row0 + 16 warp + g4 + 8 r
// (r = 0, 1) of the tile, columns col0 + 8 i + 2 t + e (i < 32 pairs).  A tile's 256 columns are
// kBN / D whole heads; a head's D columns of one row lie in the four threads of a quad (D / 8 pairs
// each), so the head's sum of squares is the thread's sum and two shuffles, and RoPE's rotate-half
// partner of column c (c +- D / 2: pair i +- D / 16, same t and e) is in the same thread.  Each row of
// a head: v = r(acc); for q and k heads with norm weights, v = r(wt r(v rstd)) (Llama casting;
// Gemma: r(v rstd wt)), rstd = 1 / sqrt(sum v^2 / D + eps) in f32, wt = w + offset (rounded to T under
// Llama casting with an offset); then with cos / sin, y1 = r(r(x1 cos1) - r(x2 sin1)) and
// y2 = r(r(x2 cos2) + r(x1 sin2)) over the halves (x1, x2); q rows go to q_out, k and v rows to the
// caches at (rows_of[m], positions[m]) where those lie inside them (else nothing is written).
template <typename T, int D>
__device__ __forceinline__ void qk_norm_rope_epilogue(float (&acc)[kBN / 2], const GemmParams<T>& p, int64_t row0,
                                                      int64_t m_end, int64_t col0, int warp, int g4, int t) {
  constexpr int kHeads = kBN / D, kPairs = D / 8, kHalf = D / 16;
  static_assert(kBN % D == 0 && kPairs % 2 == 0, "QkNormRope: D of 64 or 128");
  using P = cuda::Pair<T>;
  using T2 = typename P::type;
  const int heads = p.hq + 2 * p.hkv, head0 = static_cast<int>(col0 / D);
  // A pair of T at the thread's columns 8 i + 2 t of a head: one 4-byte load through the read-only
  // path (the inputs are not written by this kernel, so the loads may be issued ahead of the stores).
  auto pair_at = [t](const T* base, int i) {
    const unsigned u = __ldg(reinterpret_cast<const unsigned*>(base + 8 * i + 2 * t));
    return *reinterpret_cast<const T2*>(&u);
  };
  // Both rows' cache places are loaded first; each row's cos / sin (every head of the tile) at the
  // row's start (both rows' at once would not fit the consumers' registers beside the accumulators).
  int64_t ms[2];
  bool lives[2];
  int crows[2], cposs[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    ms[r] = row0 + warp * 16 + g4 + 8 * r;
    lives[r] = ms[r] < m_end;
    crows[r] = lives[r] ? __ldg(p.rows_of + ms[r]) : -1, cposs[r] = lives[r] ? __ldg(p.positions + ms[r]) : -1;
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t m = ms[r];
    const bool live = lives[r], rotate = p.cos != nullptr && live;
    const int crow = crows[r], cpos = cposs[r];
    T2 cs[kPairs], sn[kPairs];
    if (rotate) {
#pragma unroll
      for (int i = 0; i < kPairs; ++i) cs[i] = pair_at(p.cos + m * D, i), sn[i] = pair_at(p.sin + m * D, i);
    }
#pragma unroll
    for (int hh = 0; hh < kHeads; ++hh) {
      const int head = head0 + hh;  // the same in every thread of the warpgroup
      if (head >= heads) break;
      const bool is_q = head < p.hq, is_v = head >= p.hq + p.hkv;
      T2 x[kPairs];
#pragma unroll
      for (int i = 0; i < kPairs; ++i) {
        const int k = 4 * (hh * kPairs + i) + 2 * r;
        x[i] = P::round(acc[k], acc[k + 1]);
      }
      if (!is_v) {
        const T* w = is_q ? p.q_norm : p.k_norm;
        if (w != nullptr) {
          T2 w2[kPairs];
#pragma unroll
          for (int i = 0; i < kPairs; ++i) w2[i] = pair_at(w, i);
          float ss = 0.f;
#pragma unroll
          for (int i = 0; i < kPairs; ++i) {
            const float2 f = P::split(x[i]);
            ss += f.x * f.x + f.y * f.y;
          }
          ss += __shfl_xor_sync(0xffffffffu, ss, 1);
          ss += __shfl_xor_sync(0xffffffffu, ss, 2);
          const float rstd = 1.f / sqrtf(ss / static_cast<float>(D) + p.eps);
#pragma unroll
          for (int i = 0; i < kPairs; ++i) {
            const float2 f = P::split(x[i]), wf = P::split(w2[i]);
            if (p.gemma) {
              x[i] = P::round(f.x * rstd * (wf.x + p.norm_offset), f.y * rstd * (wf.y + p.norm_offset));
            } else {
              const T2 wt = p.norm_offset == 0.f ? w2[i] : P::round(wf.x + p.norm_offset, wf.y + p.norm_offset);
              x[i] = __hmul2_rn(wt, P::round(f.x * rstd, f.y * rstd));
            }
          }
        }
        if (rotate) {  // a paired multiply or add of two values of T rounds once, as r(f32 op) does
#pragma unroll
          for (int i = 0; i < kHalf; ++i) {
            const T2 x1 = x[i], x2 = x[i + kHalf];
            x[i] = __hsub2_rn(__hmul2_rn(x1, cs[i]), __hmul2_rn(x2, sn[i]));
            x[i + kHalf] = __hadd2_rn(__hmul2_rn(x2, cs[i + kHalf]), __hmul2_rn(x1, sn[i + kHalf]));
          }
        }
      }
      // Each thread stores its own pairs (4 bytes at columns 8 i + 2 t): a quad's four stores of one i
      // cover 16 contiguous bytes of the row, and no shuffles are spent to make wider stores.
      T* dst = nullptr;
      if (live) {
        if (is_q) {
          dst = p.q_out + (m * p.hq + head) * D;
        } else if (crow >= 0 && crow < p.cache_rows && cpos >= 0 && cpos < p.capacity) {
          const int kv = head - p.hq - (is_v ? p.hkv : 0);
          dst = (is_v ? p.v_cache : p.k_cache) + ((static_cast<int64_t>(crow) * p.hkv + kv) * p.capacity + cpos) * D;
        }
      }
      if (dst != nullptr) {
#pragma unroll
        for (int i = 0; i < kPairs; ++i) *reinterpret_cast<T2*>(dst + 8 * i + 2 * t) = x[i];
      }
    }
  }
}
#endif

template <typename T, GemmEpilogue E, Activation A, int D = 0>
__global__ void __launch_bounds__(kThreads, 1)
    grouped_gemm_kernel(const __grid_constant__ GemmParams<T> p, const __grid_constant__ CUtensorMap ta,
                      const __grid_constant__ CUtensorMap tb0, const __grid_constant__ CUtensorMap tb1,
                      const __grid_constant__ CUtensorMap tout) {
#if KCPP_SM90_DEVICE
  constexpr int kStages = stages(E), kStaging = staging_bytes(E);
  extern __shared__ unsigned char smem_raw[];
  const uint32_t s0 = (smem_addr(smem_raw) + 1023u) & ~1023u;
  auto sa = [&](int st) { return s0 + st * kStageBytes; };
  auto sb = [&](int st) { return s0 + st * kStageBytes + kABytes; };
  const uint32_t staging = s0 + kStages * kStageBytes;  // [2 warpgroups][kStaging]
  const uint32_t bars = staging + 2 * kStaging;
  auto full = [&](int st) { return bars + 8u * st; };
  auto empty = [&](int st) { return bars + 8u * (kStages + st); };

  // Launched as a programmatic dependent (GroupedGemm::dependent), the block may start while the
  // previous kernel ends: nothing in memory (tile_offsets included) is read or written before that
  // kernel has completed.
  cuda::griddep_wait();
  const int tid = threadIdx.x;
  const int m_tiles = p.offsets ? p.tile_offsets[p.groups] : (p.rows + kBM - 1) / kBM;
  const int64_t items = static_cast<int64_t>(m_tiles) * p.n_tiles;
  // Item w: its m tile and n tile in panels of kPanel m tiles (panel_item); an m tile is a
  // group's tile of rows, found in tile_offsets.
  struct Item {
    int g, m0, m_end, nt;
  };
  auto item = [&](int64_t w) {
    Item x;
    int mt = 0;
    panel_item(w, m_tiles, p.n_tiles, kPanel, &mt, &x.nt);
    if (!p.offsets) {  // one group of p.rows rows
      x.g = 0, x.m0 = mt * kBM, x.m_end = p.rows;
      return x;
    }
    const int lo = group_of_tile(p.tile_offsets, p.groups, mt);
    x.g = lo;
    x.m0 = p.offsets[lo] + (mt - p.tile_offsets[lo]) * kBM;
    x.m_end = p.offsets[lo + 1];
    return x;
  };

  if (tid == 0) {
    for (int st = 0; st < kStages; ++st) mbar_init(full(st), 1), mbar_init(empty(st), 8);  // every consumer warp arrives
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  if (tid < 128) {
    // Producer: one thread issues every copy; the warpgroup keeps few registers.
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
    if (tid == 0) {
      asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&ta)) : "memory");
      asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&tb0)) : "memory");
      if constexpr (E == GemmEpilogue::Glu) asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&tb1)) : "memory");
      asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&tout)) : "memory");
      int cnt = 0;
      for (int64_t w = blockIdx.x; w < items; w += gridDim.x) {
        const Item x = item(w);
        for (int kb = 0; kb < p.k_tiles; ++kb, ++cnt) {
          const int st = cnt % kStages;
          mbar_wait(empty(st), ((cnt / kStages) & 1) ^ 1);
          mbar_expect_tx(full(st), kStageBytes);
          tma_load(sa(st), &ta, full(st), kb * kBK, x.m0, 0, 0);
          if constexpr (E == GemmEpilogue::Glu) {
            tma_load(sb(st), &tb0, full(st), kb * kBK, x.nt * (kBN / 2), x.g, 0);
            tma_load(sb(st) + kBBytes / 2, &tb1, full(st), kb * kBK, x.nt * (kBN / 2), x.g, 0);
          } else {
            tma_load(sb(st), &tb0, full(st), kb * kBK, x.nt * kBN, x.g, 0);
          }
        }
      }
    }
    return;
  }

  // Consumers: warpgroup cw owns the tile's rows 64 cw .. 64 cw + 63.
  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
  const int cw = tid / 128 - 1, lane = tid % 32, warp = (tid % 128) / 32, g4 = lane / 4, t = lane % 4;
  float acc[kBN / 2];
  // Stage 0's descriptors of this warpgroup's A rows and of B, stepped by desc_at.
  const uint64_t a_desc = desc(sa(0) + cw * 64 * 128, 16, 1024), b_desc = desc(sb(0), 16, 1024);
  int cnt = 0;
  for (int64_t w = blockIdx.x; w < items; w += gridDim.x) {
    const Item x = item(w);
    int prev = -1;
    for (int kb = 0; kb < p.k_tiles; ++kb, ++cnt) {
      const int st = cnt % kStages;
      mbar_wait(full(st), (cnt / kStages) & 1);
      wg_fence();
#pragma unroll
      for (int kk = 0; kk < kBK / 16; ++kk)
        wgmma_ss<T, kBN>(acc, desc_at(a_desc, st * kStageBytes + kk * 32), desc_at(b_desc, st * kStageBytes + kk * 32), kb > 0 || kk > 0);
      wg_commit();
      wg_wait<1>();  // the previous stage's products are done: release it
      pin(acc);
      if (prev >= 0 && lane == 0) mbar_arrive(empty(prev));
      prev = st;
    }
    wg_wait<0>();
    pin(acc);
    if (prev >= 0 && lane == 0) mbar_arrive(empty(prev));

    // The epilogue, on this thread's fragments: rows 16 warp + g4 + 8 r of the warpgroup's 64, pairs of
    // columns 8 i + 2 t of the output tile (Glu: h's kBN / 2 columns of I, from the gate's pair i and
    // the up's pair i + kBN / 16; Store: kBN columns).  The activation at 16-bit outputs with the
    // hardware exp and division (kernel/activation.h's Fast mode).
    constexpr int kPairs = E == GemmEpilogue::Glu ? kBN / 16 : kBN / 8;
    auto out_pair = [&](int r, int i) {
      if constexpr (E == GemmEpilogue::Glu) {
        const float g0 = round_to<T>(acc[4 * i + 2 * r]), g1 = round_to<T>(acc[4 * i + 2 * r + 1]);
        const float u0 = round_to<T>(acc[4 * (i + kPairs) + 2 * r]), u1 = round_to<T>(acc[4 * (i + kPairs) + 2 * r + 1]);
        float a0 = activate<A, MathMode::Fast>(g0, nullptr), a1 = activate<A, MathMode::Fast>(g1, nullptr);
        if (p.round_act) a0 = round_to<T>(a0), a1 = round_to<T>(a1);
        return pack2<T>(a0 * u0, a1 * u1);
      } else {
        return pack2<T>(acc[4 * i + 2 * r], acc[4 * i + 2 * r + 1]);
      }
    };
    const int64_t row0 = static_cast<int64_t>(x.m0) + cw * 64;  // the warpgroup's first row
    const int64_t n = p.n;
    const int64_t col0 = static_cast<int64_t>(x.nt) * (kBN / (E == GemmEpilogue::Glu ? 2 : 1));
    if constexpr (E == GemmEpilogue::QkNormRope) {
      qk_norm_rope_epilogue<T, D>(acc, p, row0, x.m_end, col0, warp, g4, t);
      continue;
    }
    if (row0 + 64 <= x.m_end) {
      // All 64 rows are the group's: through the staging tile and a bulk tensor store (columns past
      // n are dropped by the tensor map), which runs on while the warpgroup goes on to its next item.
      const uint32_t stg = staging + cw * kStaging;
      if (tid % 128 == 0) bulk_wait_read();  // the previous item's store has read the staging tile
      bar_sync(1 + cw, 128);
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = warp * 16 + g4 + 8 * r;
#pragma unroll
        for (int i = 0; i < kPairs; ++i)
          st_shared(stg + (i / 8) * 8192 + row * 128 + (((i % 8) ^ (row % 8)) << 4) + t * 4, out_pair(r, i));
      }
      fence_async_smem();
      bar_sync(1 + cw, 128);
      if (tid % 128 == 0) {
#pragma unroll
        for (int b = 0; b < kPairs / 8; ++b)
          if (col0 + 64 * b < n) tma_store(&tout, stg + b * 8192, static_cast<int>(col0 + 64 * b), static_cast<int>(row0), 0, 0);
        bulk_commit();
      }
    } else {
      // The group's last tile: rows past its end are the next group's, not written.  Each quad
      // exchanges its pairs (quad_transpose) so that a thread writes 16 bytes.
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int64_t m = row0 + warp * 16 + g4 + 8 * r;
#pragma unroll
        for (int i0 = 0; i0 < kPairs; i0 += 4) {
          uint32_t v[4];
#pragma unroll
          for (int j = 0; j < 4; ++j) v[j] = out_pair(r, i0 + j);
          const uint4 q = quad_transpose(v, t);
          const int64_t col = col0 + 8 * (i0 + t);
          if (m < x.m_end && col < n) {
            if constexpr (E == GemmEpilogue::Glu) *reinterpret_cast<uint4*>(p.h + m * n + col) = q;
            else *reinterpret_cast<uint4*>(p.c + m * p.ldc + col) = q;
          }
        }
      }
    }
    if constexpr (E == GemmEpilogue::Glu) {
      // The saved gate_up [g, u] (training), 16 bytes a thread.
      if (p.gu_out) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int64_t m = row0 + warp * 16 + g4 + 8 * r;
#pragma unroll
          for (int i0 = 0; i0 < kPairs; i0 += 4) {
            uint32_t gv[4], uv[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
              gv[j] = pack2<T>(acc[4 * (i0 + j) + 2 * r], acc[4 * (i0 + j) + 2 * r + 1]);
              uv[j] = pack2<T>(acc[4 * (i0 + j + kPairs) + 2 * r], acc[4 * (i0 + j + kPairs) + 2 * r + 1]);
            }
            const uint4 gq = quad_transpose(gv, t), uq = quad_transpose(uv, t);
            const int64_t col = col0 + 8 * (i0 + t);
            if (m < x.m_end && col < n) {
              *reinterpret_cast<uint4*>(p.gu_out + m * 2 * n + col) = gq;
              *reinterpret_cast<uint4*>(p.gu_out + m * 2 * n + n + col) = uq;
            }
          }
        }
      }
    }
  }
  if (tid % 128 == 0) bulk_wait();  // the warpgroup's last store has completed
#endif
}

// ---- host ------------------------------------------------------------------------------------------

using cuda::aligned16;

// One product.  Every pointer is to device memory; offsets / tile_offsets hold groups + 1 values each
// (tile_offsets[g] = sum over the groups before g of ceil(rows / kBM)), or both are null for a dense
// product (one group: the a_rows rows of A); a_rows is the A buffer's row count (rows past it read as
// zeros).
template <typename T> struct GroupedGemm {
  GemmEpilogue epilogue = GemmEpilogue::Store;
  Activation act = Activation::Silu;  // Glu
  bool round_act = false;             // Glu: round act(g) to T before the product with u
  int groups = 1;
  const int32_t* offsets = nullptr;
  const int32_t* tile_offsets = nullptr;
  const T* a = nullptr;
  int64_t a_rows = 0, lda = 0, k = 0;
  const T* b0 = nullptr;  // Store: W [G][N, K]; Glu: Wg [G][inter, K]
  const T* b1 = nullptr;  // Glu: Wu [G][inter, K]
  int64_t ldb = 0, b_gstride = 0;
  int64_t n = 0;  // Store: N; Glu: inter
  T* c = nullptr;  // Store: [a_rows, N], row stride ldc
  int64_t ldc = 0;
  T* h = nullptr;       // Glu: [a_rows, inter], contiguous
  T* gu_out = nullptr;  // Glu: [a_rows, 2 inter], contiguous, optional
  // QkNormRope (one group; n = (hq + 2 hkv) head_dim): GemmParams' fields of that name, every tensor
  // contiguous, head_dim 64 or 128.
  int head_dim = 0;
  T* q_out = nullptr;
  T *k_cache = nullptr, *v_cache = nullptr;
  const int32_t *rows_of = nullptr, *positions = nullptr;
  const T *q_norm = nullptr, *k_norm = nullptr, *cos = nullptr, *sin = nullptr;
  int hq = 0, hkv = 0, cache_rows = 0, capacity = 0;
  float eps = 0.f, norm_offset = 0.f;
  bool gemma = false;
  bool dependent = false;  // launched as a programmatic dependent of the stream's previous kernel
};

// Null when the device can run the kernel, else why not.  built_for_sm90a: whether the caller's
// translation unit was compiled with sm_90a code (a build system fact its CMake passes on); the
// device of compute capability 9.0; the driver's tensor-map encoder.
inline const char* device_unavailable(bool built_for_sm90a) {
  if (!built_for_sm90a) return "the build has no sm_90a code";
  if (device_cc() != 90) return "the device is not of compute capability 9.0";
  if (!encode_fn()) return "the driver has no cuTensorMapEncodeTiled";
  return nullptr;
}

// Null when the kernel takes the product's shapes and addresses, else why not: 1 to 2^31 - 1 rows,
// bases and strides multiples of 16 bytes (TMA), N (Glu: inter) a multiple of 8.
template <typename T> const char* unsupported(const GroupedGemm<T>& g) {
  static_assert(std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>, "sm90 grouped GEMM: bf16 or f16");
  if (g.a_rows <= 0 || g.a_rows > INT32_MAX - kBM || g.groups < 1 || g.k <= 0)
    return "not 1 to 2^31 - 129 rows in one or more groups, or no K";
  if ((g.offsets == nullptr) != (g.tile_offsets == nullptr) || (!g.offsets && g.groups != 1))
    return "offsets and tile offsets go together (neither: one group)";
  if (g.k % 8 || g.lda % 8 || g.ldb % 8 || g.b_gstride % 8 || !aligned16(g.a) || !aligned16(g.b0))
    return "an operand's base or stride is not a multiple of 16 bytes";
  if (g.epilogue == GemmEpilogue::Glu) {
    if (!g.b1 || !g.h) return "not a gate / up product into h";
    if (!aligned16(g.b1) || g.n % 8 || !aligned16(g.h) || (g.gu_out && !aligned16(g.gu_out)))
      return "the up weight, h or gate_up is not 16-byte aligned, or the intermediate size not a multiple of 8";
    return nullptr;
  }
  if (g.epilogue == GemmEpilogue::QkNormRope) {
    if (g.head_dim != 64 && g.head_dim != 128) return "a head dim other than 64 or 128";
    if (g.offsets || g.n != static_cast<int64_t>(g.hq + 2 * g.hkv) * g.head_dim || g.hq < 1 || g.hkv < 1)
      return "not one group of q, k and v heads";
    if (!g.q_out || !g.k_cache || !g.v_cache || !g.rows_of || !g.positions || (g.q_norm == nullptr) != (g.k_norm == nullptr) ||
        (g.cos == nullptr) != (g.sin == nullptr))
      return "an output or index is missing";
    if (!aligned16(g.q_out) || !aligned16(g.k_cache) || !aligned16(g.v_cache)) return "an output is not 16-byte aligned";
    for (const void* in : {static_cast<const void*>(g.q_norm), static_cast<const void*>(g.k_norm), static_cast<const void*>(g.cos),
                           static_cast<const void*>(g.sin)})
      if (reinterpret_cast<uintptr_t>(in) % 4 != 0) return "a norm weight, cos or sin is not 4-byte aligned (read in pairs)";
    return nullptr;
  }
  if (!g.c || !aligned16(g.c) || g.n % 8 || g.ldc % 8) return "the output's base or stride is not a multiple of 16 bytes";
  return nullptr;
}

// A 4-d map {k, rows, groups, 1} over a [groups][rows][k] stack (row stride ld, group stride gs, in
// elements), boxes of 64 x box_rows, 128-byte swizzle; what lies past an extent reads as zeros.
inline bool make_map(CUtensorMap* map, const void* base, bool bf16, int64_t k, int64_t rows, int64_t groups, int64_t ld, int64_t gs,
                     int box_rows) {
  const auto fn = encode_fn();
  if (!fn) return false;
  const cuuint64_t dims[4] = {static_cast<cuuint64_t>(k), static_cast<cuuint64_t>(rows), static_cast<cuuint64_t>(groups), 1};
  const cuuint64_t row_bytes = static_cast<cuuint64_t>(ld) * 2;
  const cuuint64_t group_bytes = groups > 1 ? static_cast<cuuint64_t>(gs) * 2 : row_bytes * static_cast<cuuint64_t>(rows);
  const cuuint64_t strides[3] = {row_bytes, group_bytes, group_bytes * static_cast<cuuint64_t>(groups)};
  const cuuint32_t box[4] = {static_cast<cuuint32_t>(kBK), static_cast<cuuint32_t>(box_rows), 1, 1};
  const cuuint32_t estr[4] = {1, 1, 1, 1};
  return fn(map, bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 4, const_cast<void*>(base), dims,
            strides, box, estr, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// Launches the product (unsupported() must have said null).  False when the driver refused a tensor
// map or the kernel's shared-memory size (nothing was launched); the launch's own error goes to
// *launch_error (cudaSuccess when it launched).
template <typename T> bool launch(const GroupedGemm<T>& g, cudaStream_t st, cudaError_t* launch_error) {
  const bool bf16 = std::is_same_v<T, __nv_bfloat16>;
  const bool glu = g.epilogue == GemmEpilogue::Glu;
  CUtensorMap ta{}, tb0{}, tb1{}, tout{};
  *launch_error = cudaSuccess;
  if (!make_map(&ta, g.a, bf16, g.k, g.a_rows, 1, g.lda, 0, kBM)) return false;
  GemmParams<T> p;
  p.groups = g.groups, p.offsets = g.offsets, p.tile_offsets = g.tile_offsets, p.rows = static_cast<int>(g.a_rows);
  p.k_tiles = static_cast<int>((g.k + kBK - 1) / kBK);
  p.n = g.n;
  if (glu) {
    if (!make_map(&tb0, g.b0, bf16, g.k, g.n, g.groups, g.ldb, g.b_gstride, kBN / 2) ||
        !make_map(&tb1, g.b1, bf16, g.k, g.n, g.groups, g.ldb, g.b_gstride, kBN / 2) ||
        !make_map(&tout, g.h, bf16, g.n, g.a_rows, 1, g.n, 0, 64))
      return false;
    p.n_tiles = static_cast<int>((g.n + kBN / 2 - 1) / (kBN / 2));
    p.h = g.h, p.gu_out = g.gu_out, p.round_act = g.round_act;
  } else if (g.epilogue == GemmEpilogue::QkNormRope) {
    if (!make_map(&tb0, g.b0, bf16, g.k, g.n, g.groups, g.ldb, g.b_gstride, kBN)) return false;
    tb1 = tout = tb0;  // the epilogue stores from registers
    p.n_tiles = static_cast<int>((g.n + kBN - 1) / kBN);
    p.q_out = g.q_out, p.k_cache = g.k_cache, p.v_cache = g.v_cache, p.rows_of = g.rows_of, p.positions = g.positions;
    p.q_norm = g.q_norm, p.k_norm = g.k_norm, p.cos = g.cos, p.sin = g.sin;
    p.hq = g.hq, p.hkv = g.hkv, p.cache_rows = g.cache_rows, p.capacity = g.capacity;
    p.eps = g.eps, p.norm_offset = g.norm_offset, p.gemma = g.gemma;
  } else {
    if (!make_map(&tb0, g.b0, bf16, g.k, g.n, g.groups, g.ldb, g.b_gstride, kBN) ||
        !make_map(&tout, g.c, bf16, g.n, g.a_rows, 1, g.ldc, 0, 64))
      return false;
    tb1 = tb0;
    p.n_tiles = static_cast<int>((g.n + kBN - 1) / kBN);
    p.c = g.c, p.ldc = g.ldc;
  }
  auto kern = grouped_gemm_kernel<T, GemmEpilogue::Store, Activation::Silu>;
  if (glu) switch (g.act) {
      case Activation::Gelu: kern = grouped_gemm_kernel<T, GemmEpilogue::Glu, Activation::Gelu>; break;
      case Activation::GeluTanh: kern = grouped_gemm_kernel<T, GemmEpilogue::Glu, Activation::GeluTanh>; break;
      case Activation::QuickGelu: kern = grouped_gemm_kernel<T, GemmEpilogue::Glu, Activation::QuickGelu>; break;
      default: kern = grouped_gemm_kernel<T, GemmEpilogue::Glu, Activation::Silu>;
    }
  if (g.epilogue == GemmEpilogue::QkNormRope)
    kern = g.head_dim == 64 ? grouped_gemm_kernel<T, GemmEpilogue::QkNormRope, Activation::Silu, 64>
                            : grouped_gemm_kernel<T, GemmEpilogue::QkNormRope, Activation::Silu, 128>;
  const int smem = smem_bytes(g.epilogue);
  if (cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  // Every block reads the item count on the device; blocks beyond it exit at once.
  const cudaLaunchAttribute pdl = cuda::dependent_launch();
  *launch_error = cuda::launch_ex(&pdl, g.dependent && cuda::dependent_launch_enabled() ? 1 : 0, kern, dim3(static_cast<unsigned>(sm_count())),
                  dim3(kThreads), static_cast<size_t>(smem), st, p, ta, tb0, tb1, tout);
  return true;
}

}  // namespace kcpp::kernel::sm90gemm
