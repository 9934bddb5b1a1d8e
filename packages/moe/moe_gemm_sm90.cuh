// The experts' forward GEMMs on Hopper (sm_90a): the grouped products of moe_gemm.cuh's MGroup
// scheduling (group g = expert g, its rows the positions [offsets[g], offsets[g + 1]) of a buffer by
// position) with warpgroup MMA (wgmma) on tiles that the tensor memory accelerator (TMA) brings into
// shared memory.  Internal to moe_cuda.cu; the mma.sync kernel (moe_gemm.cuh) runs whatever this one
// does not take (sm_launchable below).
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
// expert's rows x one 256-column tile of N, columns fastest so that the blocks working at a time share
// the A rows and the expert's weight in L2) with three warpgroups, as the package flash_attn's Hopper
// attention: warpgroup 0 is the producer, one thread issuing the bulk tensor copies of A's [128, 64]
// and W's [256, 64] tiles of each k-step into a ring of four stages, each guarded by a "full" mbarrier
// (completed by the copy engine with its bytes) and an "empty" one (every consumer warp arrives once
// its products have read the stage), the ring running on across items so that the next item's loads
// overlap this one's epilogue; warpgroups 1 and 2 each own 64 of the tile's rows and issue
// m64n256k16 wgmma with both operands in shared memory (K-major, 128-byte swizzle), keeping one
// k-step's products in flight while they wait for the next stage.  A tile's rows that belong to the
// next expert (or lie past the buffer, read as zeros) are computed and not written; K past its end
// reads zeros from both operands.  Glu's tile of W is the gate's 128 rows then the up's 128 rows of
// the same columns of I, so a thread holds g and u of one element in accumulators 4 i + e and
// 4 (i + 16) + e and the activation needs no exchange between threads.  The epilogue writes pairs of
// columns from the registers.
#pragma once

#include <climits>
#include <cstdlib>
#include <string>
#include <type_traits>

#include "kcpp/kernel/sm90.cuh"
#include "moe_gemm.cuh"

namespace kcpp::moe::gemm::sm90 {

using namespace kernel::sm90;

constexpr int kBM = 128, kBN = 256, kBK = 64, kStages = 4, kThreads = 384;
static_assert(kBM == BM, "the tile offsets (scan_buckets) count tiles of moe_gemm.cuh's BM rows");
constexpr int kABytes = kBM * kBK * 2, kBBytes = kBN * kBK * 2, kStageBytes = kABytes + kBBytes;
constexpr int kSmem = 1024 /* alignment slack */ + kStages * kStageBytes + 8 * 2 * kStages;
static_assert(kSmem <= 227 * 1024, "moe sm90 GEMM: the stages do not fit in shared memory");

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
  Activation act = Activation::Silu;
  T* h = nullptr;       // [rows, inter]
  T* gu_out = nullptr;  // [rows, 2 inter], optional
};

#if KCPP_SM90_DEVICE || !defined(__CUDA_ARCH__)
__device__ __forceinline__ void store_pair(void* p, uint32_t v) { *static_cast<uint32_t*>(p) = v; }
#endif

template <typename T, Epi E>
__global__ void __launch_bounds__(kThreads, 1)
    grouped_gemm_sm90(const __grid_constant__ Sm90Args<T> p, const __grid_constant__ CUtensorMap ta,
                      const __grid_constant__ CUtensorMap tb0, const __grid_constant__ CUtensorMap tb1) {
#if KCPP_SM90_DEVICE
  extern __shared__ unsigned char smem_raw[];
  const uint32_t s0 = (smem_addr(smem_raw) + 1023u) & ~1023u;
  auto sa = [&](int st) { return s0 + st * kStageBytes; };
  auto sb = [&](int st) { return s0 + st * kStageBytes + kABytes; };
  const uint32_t bars = s0 + kStages * kStageBytes;
  auto full = [&](int st) { return bars + 8u * st; };
  auto empty = [&](int st) { return bars + 8u * (kStages + st); };

  const int tid = threadIdx.x;
  const int64_t items = static_cast<int64_t>(p.tile_offsets[p.groups]) * p.n_tiles;
  // Item w: m tile w / n_tiles (an expert's tile of rows, found in tile_offsets), n tile w % n_tiles.
  struct Item {
    int g, m0, m_end, nt;
  };
  auto item = [&](int64_t w) {
    Item x;
    const int mt = static_cast<int>(w / p.n_tiles);
    x.nt = static_cast<int>(w % p.n_tiles);
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
        wgmma_ss<T, kBN>(acc, desc(sa(st) + cw * 64 * 128 + kk * 32, 16, 1024), desc(sb(st) + kk * 32, 16, 1024), kb > 0 || kk > 0);
      wg_commit();
      wg_wait<1>();  // the previous stage's products are done: release it
      pin(acc);
      if (prev >= 0 && lane == 0) mbar_arrive(empty(prev));
      prev = st;
    }
    wg_wait<0>();
    pin(acc);
    if (prev >= 0 && lane == 0) mbar_arrive(empty(prev));

    // Epilogue: this thread's rows m0 + 64 cw + 16 warp + g4 (+ 8), columns 8 i + 2 t (+ 1).
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int64_t m = static_cast<int64_t>(x.m0) + cw * 64 + warp * 16 + g4 + 8 * r;
      if (m >= x.m_end) continue;
      if constexpr (E == Epi::Glu) {
        const int64_t I = p.n;
#pragma unroll
        for (int i = 0; i < kBN / 16; ++i) {
          const int64_t col = static_cast<int64_t>(x.nt) * (kBN / 2) + 8 * i + 2 * t;
          if (col >= I) continue;
          const uint32_t gv = pack2<T>(acc[4 * i + 2 * r], acc[4 * i + 2 * r + 1]);
          const uint32_t uv = pack2<T>(acc[4 * (i + kBN / 16) + 2 * r], acc[4 * (i + kBN / 16) + 2 * r + 1]);
          if (p.gu_out) {
            store_pair(p.gu_out + m * 2 * I + col, gv);
            store_pair(p.gu_out + m * 2 * I + I + col, uv);
          }
          const T* gp = reinterpret_cast<const T*>(&gv);
          const T* up = reinterpret_cast<const T*>(&uv);
          store_pair(p.h + m * I + col, pack2<T>(act_eval(p.act, to_f32(gp[0]), nullptr) * to_f32(up[0]),
                                                 act_eval(p.act, to_f32(gp[1]), nullptr) * to_f32(up[1])));
        }
      } else {
#pragma unroll
        for (int i = 0; i < kBN / 8; ++i) {
          const int64_t col = static_cast<int64_t>(x.nt) * kBN + 8 * i + 2 * t;
          if (col >= p.n) continue;
          store_pair(p.c + m * p.ldc + col, pack2<T>(acc[4 * i + 2 * r], acc[4 * i + 2 * r + 1]));
        }
      }
    }
  }
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

// Whether the kernel can run here: a build with sm_90a code, a device of compute capability 9.0, the
// driver's tensor-map encoder, and KCPP_MOE_SM90 not 0 (KCPP_MOE_SM90=0 leaves every product to the
// mma.sync kernel, for comparing the two).
inline bool enabled() {
#if defined(KCPP_MOE_HAS_SM90)
  const char* env = std::getenv("KCPP_MOE_SM90");
  if (env && std::string(env) == "0") return false;
  return device_cc() == 90 && encode_fn() != nullptr;
#else
  return false;
#endif
}

// Whether this kernel takes the product `a` (moe_gemm.cuh's arguments) with its A buffer of a_rows
// rows: enabled(), bf16 / f16, MGroup, Glu (gate and up two matrices, or halves of one stack:
// Split::Dual) or Store (no split, in the dtype, not added to), A and W contiguous along K and not
// gathered, 16-byte aligned bases and strides (TMA) and outputs.
template <typename T> bool sm_launchable(const Args<T>& a, Epi e, int64_t a_rows) {
  if (!enabled() || a.grouping != Grouping::MGroup || a_rows <= 0 || a_rows > INT32_MAX) return false;
  if (!a.a_kcontig || !a.b_kcontig || a.a_gather || a.b_gather) return false;
  if (a.K % 8 || a.lda % 8 || a.ldb % 8 || a.b_gstride % 8 || !aligned16(a.a) || !aligned16(a.b0)) return false;
  if (e == Epi::Glu)
    return a.split == Split::Dual && a.b1 && aligned16(a.b1) && a.inter % 8 == 0 && a.h && aligned16(a.h) &&
           (!a.gu_out || aligned16(a.gu_out));
  if (e == Epi::Store) return a.split == Split::None && !a.c_f32 && !a.c_add && a.c && aligned16(a.c) && a.N % 8 == 0 && a.ldc % 8 == 0;
  return false;
}

// Launches the product (sm_launchable must have said yes).  False when the driver refused a tensor map
// or the kernel's shared-memory size (the caller then runs the mma.sync kernel); an error of the launch
// itself is the forward's launch error.
template <typename T> bool launch(const Args<T>& a, Epi e, int64_t a_rows, cudaStream_t st) {
  const bool bf16 = std::is_same_v<T, __nv_bfloat16>;
  const int64_t groups = a.groups;
  CUtensorMap ta{}, tb0{}, tb1{};
  if (!make_map(&ta, a.a, bf16, a.K, a_rows, 1, a.lda, 0, kBM)) return false;
  Sm90Args<T> p;
  p.groups = a.groups, p.offsets = a.offsets, p.tile_offsets = a.tile_offsets;
  p.k_tiles = static_cast<int>((a.K + kBK - 1) / kBK);
  if (e == Epi::Glu) {
    if (!make_map(&tb0, a.b0, bf16, a.K, a.inter, groups, a.ldb, a.b_gstride, kBN / 2) ||
        !make_map(&tb1, a.b1, bf16, a.K, a.inter, groups, a.ldb, a.b_gstride, kBN / 2))
      return false;
    p.n = a.inter, p.n_tiles = static_cast<int>((a.inter + kBN / 2 - 1) / (kBN / 2));
    p.act = a.act, p.h = a.h, p.gu_out = a.gu_out;
  } else {
    if (!make_map(&tb0, a.b0, bf16, a.K, a.N, groups, a.ldb, a.b_gstride, kBN)) return false;
    tb1 = tb0;
    p.n = a.N, p.n_tiles = static_cast<int>((a.N + kBN - 1) / kBN);
    p.c = static_cast<T*>(a.c), p.ldc = a.ldc;
  }
  auto kern = e == Epi::Glu ? grouped_gemm_sm90<T, Epi::Glu> : grouped_gemm_sm90<T, Epi::Store>;
  if (cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  // Every block reads the item count on the device; blocks beyond it exit at once.
  kern<<<static_cast<unsigned>(sm_count()), kThreads, kSmem, st>>>(p, ta, tb0, tb1);
  return true;
}

}  // namespace kcpp::moe::gemm::sm90
