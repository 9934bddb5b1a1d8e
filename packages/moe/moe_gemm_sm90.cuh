// The experts' forward GEMMs on Hopper (sm_90a): the grouped products of moe_gemm.cuh's MGroup
// scheduling (group g = expert g, its rows the positions [offsets[g], offsets[g + 1]) of a buffer by
// position) with warpgroup MMA (wgmma) on tiles that the tensor memory accelerator (TMA) brings into
// shared memory.  Internal to moe_cuda.cu; the mma.sync kernel (moe_gemm.cuh) runs whatever this one
// does not take (unsupported below).
//
//   Glu    [g | u] = A [Wg; Wu]^T of the group's rows, then gate_up (saved, optional) = round([g, u])
//          and h = round(act(round g) round u), both by position
//   Store  C = round(A W^T) by position
//
// A is a buffer by position [rows, K] (contiguous along K: the gathered token rows, or h); W is a
// weight stack [E, N, K], contiguous along K (Transformers' gate_up_proj [E, 2I, H] and down_proj [E,
// H, I], as the forward applies them).  No group size comes to the host: the tiles of every group
// are the prefix sum of ceil(rows / 128) that the permutation already wrote (tile_offsets), read on
// the device, so the products need no stream synchronization and run under graph capture.
//
// The kernel is persistent (a block an SM, each looping over work items: one 128-row tile of one
// expert's rows x one 256-column tile of N) with three warpgroups, as the package flash_attn's Hopper
// attention.  The items run in panels of kPanel = 16 m tiles, n tiles outer and the panel's m tiles
// inner, so that the blocks working at a time read about 16 tiles of A rows and 132 / 16 tiles of W:
// the fewest bytes from memory for 132 tiles of 128 x 256 when W's tile is twice A's (sqrt(132 * 2)).
// With the columns fastest instead, a wave of blocks at Mixtral's I = 14,336 reads 132 different
// weight tiles and its gate_up ran 7.3 against 5.4 ms (bench/RESULTS.md).
// Warpgroup 0 is the producer, one thread issuing the bulk tensor copies of A's [128, 64] and W's
// [256, 64] tiles of each k-step into a ring of stages (4 for Glu, 3 for Store), each guarded by a
// "full" mbarrier (completed by the copy engine with its bytes) and an "empty" one (every consumer
// warp arrives once its products have read the stage), the ring running on across items so that the
// next item's loads overlap this one's epilogue; warpgroups 1 and 2 each own 64 of the tile's rows
// and issue m64n256k16 wgmma with both operands in shared memory (K-major, 128-byte swizzle), keeping
// one k-step's products in flight while they wait for the next stage.  A tile's rows that belong to
// the next expert (or lie past the buffer, read as zeros) are computed and not written; K past its
// end reads zeros from both operands.  Glu's tile of W is the gate's 128 rows then the up's 128 rows
// of the same columns of I, so a thread holds g and u of one element in accumulators 4 i + e and
// 4 (i + 16) + e and the activation needs no exchange between threads; the activation is a template
// parameter (a runtime switch over the four, unrolled 64 times a thread, cost gate_up about twice its
// products' time) in kernel/activation.h's Fast mode (the outputs are 16-bit).
// The epilogue: where all 64 rows of a warpgroup are its expert's, the warpgroup writes its output
// (h, or C) into a staging tile of its own in the 128-byte swizzle (conflict-free: the 8 rows of a
// store instruction fall in 8 different 16-byte chunks) and one thread issues bulk tensor stores of
// 64 x 64 boxes, which run on while the warpgroup starts its next item; before it writes the staging
// tile again, that thread waits until the previous stores have read it.  The expert's last tile
// (rows past its end are the next expert's) is written from the registers, 16 bytes a thread after
// each quad of threads exchanges its column pairs, and so is Glu's saved gate_up.
#pragma once

#include <climits>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "kcpp/kernel/sm90.cuh"
#include "moe.h"
#include "moe_gemm.cuh"

namespace kcpp::moe::gemm::sm90 {

using namespace kernel::sm90;
using kernel::cuda::round_to;

constexpr int kBM = 128, kBN = 256, kBK = 64, kThreads = 384;
// Work items run in panels of kPanel m tiles, n tiles outer (see the head comment).
constexpr int kPanel = 16;
static_assert(kBM == BM, "the tile offsets (scan_buckets) count tiles of moe_gemm.cuh's BM rows");
constexpr int kABytes = kBM * kBK * 2, kBBytes = kBN * kBK * 2, kStageBytes = kABytes + kBBytes;
// Per epilogue: the ring's stages, and each consumer warpgroup's staging tile of its 64 output rows
// (Glu: h's 128 columns; Store: 256 columns), in boxes of 64 x 64 (8 KiB, 128-byte swizzle).
constexpr int stages(Epi e) { return e == Epi::Glu ? 4 : 3; }
constexpr int staging_bytes(Epi e) { return 64 * (e == Epi::Glu ? kBN / 2 : kBN) * 2; }
constexpr int smem_bytes(Epi e) { return 1024 /* alignment slack */ + stages(e) * kStageBytes + 2 * staging_bytes(e) + 16 * stages(e); }
static_assert(smem_bytes(Epi::Glu) <= 227 * 1024 && smem_bytes(Epi::Store) <= 227 * 1024, "moe sm90 GEMM: shared memory");

template <typename T> struct Sm90Args {
  int groups = 0;
  const int32_t* offsets = nullptr;       // [groups + 1]
  const int32_t* tile_offsets = nullptr;  // [groups + 1]
  int64_t n = 0;                          // Store: N; Glu: inter
  int n_tiles = 0;                        // tiles of kBN columns (Glu: of kBN / 2 columns of I)
  int k_tiles = 0;
  // Store
  T* c = nullptr;
  int64_t ldc = 0;
  // Glu
  T* h = nullptr;       // [rows, inter]
  T* gu_out = nullptr;  // [rows, 2 inter], optional
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
#endif

template <typename T, Epi E, Activation A>
__global__ void __launch_bounds__(kThreads, 1)
    grouped_gemm_sm90(const __grid_constant__ Sm90Args<T> p, const __grid_constant__ CUtensorMap ta,
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

  const int tid = threadIdx.x;
  const int m_tiles = p.tile_offsets[p.groups];
  const int64_t items = static_cast<int64_t>(m_tiles) * p.n_tiles;
  // Item w: its m tile and n tile in panels of kPanel m tiles (moe.h: panel_item); an m tile is an
  // expert's tile of rows, found in tile_offsets.
  struct Item {
    int g, m0, m_end, nt;
  };
  auto item = [&](int64_t w) {
    Item x;
    int mt = 0;
    panel_item(w, m_tiles, p.n_tiles, kPanel, &mt, &x.nt);
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
      if constexpr (E == Epi::Glu) asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&tb1)) : "memory");
      asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&tout)) : "memory");
      int cnt = 0;
      for (int64_t w = blockIdx.x; w < items; w += gridDim.x) {
        const Item x = item(w);
        for (int kb = 0; kb < p.k_tiles; ++kb, ++cnt) {
          const int st = cnt % kStages;
          mbar_wait(empty(st), ((cnt / kStages) & 1) ^ 1);
          mbar_expect_tx(full(st), kStageBytes);
          tma_load(sa(st), &ta, full(st), kb * kBK, x.m0, 0, 0);
          if constexpr (E == Epi::Glu) {
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
    constexpr int kPairs = E == Epi::Glu ? kBN / 16 : kBN / 8;
    auto out_pair = [&](int r, int i) {
      if constexpr (E == Epi::Glu) {
        const float g0 = round_to<T>(acc[4 * i + 2 * r]), g1 = round_to<T>(acc[4 * i + 2 * r + 1]);
        const float u0 = round_to<T>(acc[4 * (i + kPairs) + 2 * r]), u1 = round_to<T>(acc[4 * (i + kPairs) + 2 * r + 1]);
        return pack2<T>(kernel::activate<A, kernel::MathMode::Fast>(g0, nullptr) * u0,
                        kernel::activate<A, kernel::MathMode::Fast>(g1, nullptr) * u1);
      } else {
        return pack2<T>(acc[4 * i + 2 * r], acc[4 * i + 2 * r + 1]);
      }
    };
    const int64_t row0 = static_cast<int64_t>(x.m0) + cw * 64;  // the warpgroup's first row
    const int64_t n = p.n;
    const int64_t col0 = static_cast<int64_t>(x.nt) * (kBN / (E == Epi::Glu ? 2 : 1));
    if (row0 + 64 <= x.m_end) {
      // All 64 rows are the expert's: through the staging tile and a bulk tensor store (columns past
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
      // The expert's last tile: rows past its end are the next expert's, not written.  Each quad
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
            if constexpr (E == Epi::Glu) *reinterpret_cast<uint4*>(p.h + m * n + col) = q;
            else *reinterpret_cast<uint4*>(p.c + m * p.ldc + col) = q;
          }
        }
      }
    }
    if constexpr (E == Epi::Glu) {
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

using kernel::cuda::aligned16;

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

// KCPP_MOE_SM90: 0 leaves every product to the mma.sync kernel (for comparing the two); 1 requires
// this kernel for every product of the package's forward path that it is built for (the call fails,
// saying why, where it cannot take one: so a test or benchmark knows what it ran); unset or anything
// else, this kernel wherever it can run.
enum class Mode { Off, Auto, Required };
inline Mode mode() {
  const char* env = std::getenv("KCPP_MOE_SM90");
  if (env && std::strcmp(env, "0") == 0) return Mode::Off;
  if (env && std::strcmp(env, "1") == 0) return Mode::Required;
  return Mode::Auto;
}

// Null when the kernel can run on this device, else why not: a build with sm_90a code, a device of
// compute capability 9.0, the driver's tensor-map encoder.
inline const char* device_unavailable() {
#if defined(KCPP_MOE_HAS_SM90)
  if (device_cc() != 90) return "the device is not of compute capability 9.0";
  if (!encode_fn()) return "the driver has no cuTensorMapEncodeTiled";
  return nullptr;
#else
  return "the package was built without sm_90a code";
#endif
}
// The same, and KCPP_MOE_SM90 not 0.
inline const char* unavailable() { return mode() == Mode::Off ? "KCPP_MOE_SM90=0" : device_unavailable(); }
inline bool enabled() { return unavailable() == nullptr; }

// Null when this kernel takes the product `a` (moe_gemm.cuh's arguments) with its A buffer of a_rows
// rows, else why not: the kernel available here, bf16 / f16, MGroup, Glu (gate and up two matrices, or
// halves of one stack: Split::Dual) or Store (no split, in the dtype, not added to), A and W
// contiguous along K and not gathered, with 16-byte aligned bases and strides (TMA) and outputs.
template <typename T> const char* unsupported(const Args<T>& a, Epi e, int64_t a_rows) {
  if (const char* why = unavailable()) return why;
  if (a.grouping != Grouping::MGroup || a_rows <= 0 || a_rows > INT32_MAX) return "not a grouping of 1 to 2^31 - 1 rows by expert";
  if (!a.a_kcontig || !a.b_kcontig || a.a_gather || a.b_gather) return "an operand is gathered or not contiguous along K";
  if (a.K % 8 || a.lda % 8 || a.ldb % 8 || a.b_gstride % 8 || !aligned16(a.a) || !aligned16(a.b0))
    return "an operand's base or stride is not a multiple of 16 bytes";
  if (e == Epi::Glu) {
    if (a.split != Split::Dual || !a.b1 || !a.h) return "not a gate / up product into h";
    if (!aligned16(a.b1) || a.inter % 8 || !aligned16(a.h) || (a.gu_out && !aligned16(a.gu_out)))
      return "the up weight, h or gate_up is not 16-byte aligned, or the intermediate size not a multiple of 8";
    return nullptr;
  }
  if (e == Epi::Store) {
    if (a.split != Split::None || a.c_f32 || a.c_add || !a.c) return "not a product stored in the dtype";
    if (!aligned16(a.c) || a.N % 8 || a.ldc % 8) return "the output's base or stride is not a multiple of 16 bytes";
    return nullptr;
  }
  return "an epilogue this kernel does not have";
}

// Launches the product (unsupported must have said null).  False when the driver refused a tensor map
// or the kernel's shared-memory size (the caller then runs the mma.sync kernel, or under
// KCPP_MOE_SM90=1 fails the call); an error of the launch itself is the forward's launch error.
template <typename T> bool launch(const Args<T>& a, Epi e, int64_t a_rows, cudaStream_t st) {
  const bool bf16 = std::is_same_v<T, __nv_bfloat16>;
  const int64_t groups = a.groups;
  CUtensorMap ta{}, tb0{}, tb1{}, tout{};
  if (!make_map(&ta, a.a, bf16, a.K, a_rows, 1, a.lda, 0, kBM)) return false;
  Sm90Args<T> p;
  p.groups = a.groups, p.offsets = a.offsets, p.tile_offsets = a.tile_offsets;
  p.k_tiles = static_cast<int>((a.K + kBK - 1) / kBK);
  if (e == Epi::Glu) {
    if (!make_map(&tb0, a.b0, bf16, a.K, a.inter, groups, a.ldb, a.b_gstride, kBN / 2) ||
        !make_map(&tb1, a.b1, bf16, a.K, a.inter, groups, a.ldb, a.b_gstride, kBN / 2) ||
        !make_map(&tout, a.h, bf16, a.inter, a_rows, 1, a.inter, 0, 64))
      return false;
    p.n = a.inter, p.n_tiles = static_cast<int>((a.inter + kBN / 2 - 1) / (kBN / 2));
    p.h = a.h, p.gu_out = a.gu_out;
  } else {
    if (!make_map(&tb0, a.b0, bf16, a.K, a.N, groups, a.ldb, a.b_gstride, kBN) ||
        !make_map(&tout, a.c, bf16, a.N, a_rows, 1, a.ldc, 0, 64))
      return false;
    tb1 = tb0;
    p.n = a.N, p.n_tiles = static_cast<int>((a.N + kBN - 1) / kBN);
    p.c = static_cast<T*>(a.c), p.ldc = a.ldc;
  }
  auto kern = grouped_gemm_sm90<T, Epi::Store, Activation::Silu>;
  if (e == Epi::Glu) switch (a.act) {
      case Activation::Gelu: kern = grouped_gemm_sm90<T, Epi::Glu, Activation::Gelu>; break;
      case Activation::GeluTanh: kern = grouped_gemm_sm90<T, Epi::Glu, Activation::GeluTanh>; break;
      case Activation::QuickGelu: kern = grouped_gemm_sm90<T, Epi::Glu, Activation::QuickGelu>; break;
      default: kern = grouped_gemm_sm90<T, Epi::Glu, Activation::Silu>;
    }
  const int smem = smem_bytes(e);
  if (cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  // Every block reads the item count on the device; blocks beyond it exit at once.
  kern<<<static_cast<unsigned>(sm_count()), kThreads, smem, st>>>(p, ta, tb0, tb1, tout);
  return true;
}

}  // namespace kcpp::moe::gemm::sm90
