// Attention forward on Hopper (sm_90a): warpgroup MMA (wgmma) on tiles that the tensor memory
// accelerator (TMA) brings into shared memory, producer / consumer warp specialization, and the
// softmax of one key tile overlapped with the matrix products of the next.  The maths, the layout
// and the log-sum-exp it saves are attention.h's; the backward is attention_cuda.cu's.
//
// The algorithm is FlashAttention-3's (Shah, Bikshandi, Zhang, Thakkar, Ramani, Dao, "FlashAttention-3:
// Fast and Accurate Attention with Asynchrony and Low-precision", 2024, section 3), written here from
// the paper: persistent blocks of three warpgroups, one block an SM, each looping over work items
// (128 queries of one head).  Warpgroup 0 is the producer: one thread issues the bulk tensor copies
// of each item's Q tile and of its K and V tiles into rings of slots that run on across items, each
// slot guarded by a "full" mbarrier (the copy engine completes it with the bytes it wrote) and an
// "empty" one (every consumer warp arrives once it no longer reads the slot), so the next item's
// loads overlap the last one's tail; the producer gives up registers (setmaxnreg) to the consumers.
// Warpgroups 1 and 2 each own 64 query rows and run, per key tile j:
//   S_j = Q K_j^T                   wgmma, A and B from shared memory (both K-major)
//   O  += P_{j-1} V_{j-1}           wgmma, A (the probabilities) from registers, B = V (MN-major)
//   softmax of S_j in registers while the O product runs (the two are issued together and waited
//   for one after the other), then O is rescaled by the change of the running maximum;
// and the two warpgroups take turns to issue (ping-pong), so that one's softmax overlaps the other's
// products.  Key tiles are visited from the last to the first, so the tiles that need a mask come
// first.  Items are ordered heads-fastest with the heaviest (last) query tiles first and dealt out
// in a snake, which balances the causal triangle and keeps the query heads of one kv head close in
// time (their K / V stay in L2).  The output goes through a staging tile and a bulk tensor store
// (head dims 64 and 128) or straight from registers (256, where the staging tile does not fit).
// Tiles: 128 queries x 128 keys (64 keys at head dim 256); rings of 4 K and 4 V slots at head dim 64,
// 3 and 2 at 128, 2 and 2 at 256.
//
// Shared memory: every tile is stored as D / 64 column blocks of [rows][64] elements (128 bytes a
// row) in the 128-byte swizzle that both TMA (CU_TENSOR_MAP_SWIZZLE_128B) and wgmma's descriptors
// (layout type 1) use: 16-byte chunk c of row r lands at chunk c ^ (r % 8), each 8-row group being
// 1024 bytes, so every tile starts on a 1024-byte boundary.  Descriptor strides (PTX ISA, "Matrix
// Descriptor Format" and its canonical layouts): K-major operands (Q, K) step 1024 bytes between
// 8-row groups (SBO), and a k-step of 16 elements inside a 128-byte row advances the start address
// by 32 bytes; V read MN-major steps 1024 bytes between 8-key groups (SBO) and Bc * 128 bytes between
// 64-column blocks (LBO).
// Fragments: the f32 accumulator of m64nNk16 gives warp w of the warpgroup rows 16 w + g and
// 16 w + g + 8 (g = lane / 4), columns 8 i + 2 t, 8 i + 2 t + 1 (t = lane % 4) in registers 4 i ..
// 4 i + 3; the A operand from registers has mma.sync's m16n8k16 layout, so two neighbouring 8-column
// accumulator groups of S become one k-step of P without any data movement between threads.
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "attention.h"
#include "kcpp/kernel/cuda.cuh"
#include "kcpp/kernel/error.h"

// The device code exists only in the sm_90a pass (wgmma and setmaxnreg are sm_90a instructions);
// other passes compile an empty kernel that the host never launches.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define KCPP_SM90_DEVICE 1
#else
#define KCPP_SM90_DEVICE 0
#endif

namespace kcpp::flash {
namespace {

using kernel::DType;

constexpr int kBr = 128;           // queries a block: two consumer warpgroups of 64
constexpr int kThreads = 3 * 128;  // producer warpgroup + two consumer warpgroups

// Tile sizes and ring depths by head dim: a K or V tile is kBc keys x D.
template <int D> struct Tile {
  static constexpr int kBc = D == 256 ? 64 : 128;
  // Ring depths: K is needed a step before V, so it gets the deeper ring where shared memory allows.
  static constexpr int kStagesK = D == 64 ? 4 : D == 128 ? 3 : 2, kStagesV = D == 64 ? 4 : 2;
  // Head dim 256 writes out straight from registers: a staging tile would not fit beside the rings.
  static constexpr bool kStaged = D != 256;
  static constexpr int kQBytes = kBr * D * 2;
  static constexpr int kKVBytes = kBc * D * 2;          // one K or one V tile
  static constexpr int kBarBytes = 8 * (2 + 2 * (kStagesK + kStagesV));
  // Q, the K and V rings, the output staging tile (as large as Q), the barriers.
  static constexpr int kSmem =
      1024 /* alignment slack */ + (kStaged ? 2 : 1) * kQBytes + (kStagesK + kStagesV) * kKVBytes + kBarBytes;
  static_assert(kSmem <= 227 * 1024, "attention_sm90: the tiles do not fit in shared memory");
};

#if KCPP_SM90_DEVICE || !defined(__CUDA_ARCH__)

__device__ __forceinline__ uint32_t smem_addr(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

// ---- mbarriers and the bulk tensor copy -----------------------------------------------------------

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Waits until the phase of parity `parity` has completed (a fresh barrier counts parity 1 as done).
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  uint32_t done;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
}
// Box {64, rows, 1, 1} of a 4-d tensor map at coordinates (c0, c1, c2, c3) into shared `dst`,
// completing `bar` with its byte count.
__device__ __forceinline__ void tma_load(uint32_t dst, const CUtensorMap* map, uint32_t bar, int c0, int c1, int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6}], [%2];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}

// Box {64, 64, 1, 1} from shared `src` into a 4-d tensor map at (c0, c1, c2, c3); rows past the
// tensor's end are not written.  Completes as a bulk async-group of the issuing thread.
__device__ __forceinline__ void tma_store(const CUtensorMap* map, uint32_t src, int c0, int c1, int c2, int c3) {
  asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(src), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
               : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// Waits until the thread's bulk stores have read their shared memory.
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory"); }
__device__ __forceinline__ void bulk_wait() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }
// Orders this thread's ordinary shared-memory stores before the copy engine's reads of them.
__device__ __forceinline__ void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// ---- warpgroup MMA --------------------------------------------------------------------------------

__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void wg_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }

// Pins registers that an in-flight wgmma reads or writes: the compiler may not move their uses across.
template <int N> __device__ __forceinline__ void pin(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
template <int N> __device__ __forceinline__ void pin(uint32_t (&r)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(r[i][e])::"memory");
}

// Shared-memory matrix descriptor, 128-byte swizzle.
__device__ __forceinline__ uint64_t desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | static_cast<uint64_t>((lbo & 0x3FFFF) >> 4) << 16 |
         static_cast<uint64_t>((sbo & 0x3FFFF) >> 4) << 32 | uint64_t{1} << 62;
}

// d (64 x N, f32) = (scale_d ? d : 0) + A B^T, A and B K-major in shared memory (descriptors).
template <typename T, int N> __device__ __forceinline__ void wgmma_ss(float (&d)[N / 2], uint64_t a, uint64_t b, int scale_d);
// d (64 x N, f32) += A B, A (64 x 16) in registers, B (16 x N) MN-major in shared memory.
template <typename T, int N> __device__ __forceinline__ void wgmma_rs(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t b);

// The wgmma instructions, one per shape and type (operand lists written out: inline PTX has no loops).
template <> __device__ __forceinline__ void wgmma_ss<__nv_bfloat16, 64>(float (&d)[32], uint64_t a, uint64_t b, int scale_d) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
               : "l"(a), "l"(b), "r"(scale_d));
}
template <> __device__ __forceinline__ void wgmma_rs<__nv_bfloat16, 64>(float (&d)[32], const uint32_t (&a)[4], uint64_t b) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));
}
template <> __device__ __forceinline__ void wgmma_ss<__nv_bfloat16, 128>(float (&d)[64], uint64_t a, uint64_t b, int scale_d) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
               : "l"(a), "l"(b), "r"(scale_d));
}
template <> __device__ __forceinline__ void wgmma_rs<__nv_bfloat16, 128>(float (&d)[64], const uint32_t (&a)[4], uint64_t b) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));
}
template <> __device__ __forceinline__ void wgmma_rs<__nv_bfloat16, 256>(float (&d)[128], const uint32_t (&a)[4], uint64_t b) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, {%128, %129, %130, %131}, %132, p, 1, 1, 1;\n}\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));
}
template <> __device__ __forceinline__ void wgmma_ss<__half, 64>(float (&d)[32], uint64_t a, uint64_t b, int scale_d) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
               : "l"(a), "l"(b), "r"(scale_d));
}
template <> __device__ __forceinline__ void wgmma_rs<__half, 64>(float (&d)[32], const uint32_t (&a)[4], uint64_t b) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));
}
template <> __device__ __forceinline__ void wgmma_ss<__half, 128>(float (&d)[64], uint64_t a, uint64_t b, int scale_d) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
               : "l"(a), "l"(b), "r"(scale_d));
}
template <> __device__ __forceinline__ void wgmma_rs<__half, 128>(float (&d)[64], const uint32_t (&a)[4], uint64_t b) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));
}
template <> __device__ __forceinline__ void wgmma_rs<__half, 256>(float (&d)[128], const uint32_t (&a)[4], uint64_t b) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, {%128, %129, %130, %131}, %132, p, 1, 1, 1;\n}\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));
}

template <typename T> __device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <> __device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}
template <> __device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

__device__ __forceinline__ void bar_sync(int id, int count) { asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory"); }
__device__ __forceinline__ void bar_arrive(int id, int count) { asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory"); }

__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

#endif  // KCPP_SM90_DEVICE || !defined(__CUDA_ARCH__)

// ---- the kernel -----------------------------------------------------------------------------------

// PP: ping-pong between the consumer warpgroups (FlashAttention-3, section 3.1): each issues its
// matrix products only after the other has issued its own, so one's softmax runs while the other's
// products occupy the tensor cores.  Named barriers 1 and 2 pass the turn.
template <typename T, int D, bool PP>
__global__ void __launch_bounds__(kThreads, 1)
    fwd_sm90_kernel(const __grid_constant__ AttentionParams p, const __grid_constant__ CUtensorMap tq,
                    const __grid_constant__ CUtensorMap tk, const __grid_constant__ CUtensorMap tv,
                    const __grid_constant__ CUtensorMap to) {
#if KCPP_SM90_DEVICE
  using C = Tile<D>;
  constexpr float kLog2e = 1.4426950408889634f, kLn2 = 0.6931471805599453f;
  constexpr int kCols = D / 64;  // 64-column (128-byte) blocks of a row
  constexpr int kBc = C::kBc, kSK = C::kStagesK, kSV = C::kStagesV, kNS = kBc / 2, kNO = D / 2;
  extern __shared__ unsigned char smem_raw[];
  const uint32_t sQ = (smem_addr(smem_raw) + 1023u) & ~1023u;
  const uint32_t sK = sQ + C::kQBytes, sV = sK + kSK * C::kKVBytes, sO = sV + kSV * C::kKVBytes;
  const uint32_t bars = sO + (C::kStaged ? C::kQBytes : 0);
  const uint32_t qfull = bars, qempty = bars + 8;
  auto kfull = [&](int s) { return bars + 8u * (2 + s); };
  auto vfull = [&](int s) { return bars + 8u * (2 + kSK + s); };
  auto kempty = [&](int s) { return bars + 8u * (2 + kSK + kSV + s); };
  auto vempty = [&](int s) { return bars + 8u * (2 + 2 * kSK + kSV + s); };

  // Work items: (query tile, batch x head), the heaviest query tiles first (causal), heads fastest.
  // Block k takes item k of each round of gridDim.x items, the rounds alternately forwards and
  // backwards (a snake), so that the causal items' falling costs even out between blocks.
  const int tid = threadIdx.x;
  const int64_t bh_count = p.batch * p.heads_q, n_qt = (p.seq_q + kBr - 1) / kBr, n_items = n_qt * bh_count;
  const int64_t off = p.seq_kv - p.seq_q;
  struct Item {
    int64_t b, h, hk, q0;
    int n_tiles;
  };
  auto item = [&](int64_t w) {
    Item x;
    const int64_t bh = w % bh_count;
    x.b = bh / p.heads_q, x.h = bh % p.heads_q, x.hk = x.h / (p.heads_q / p.heads_kv);
    x.q0 = (n_qt - 1 - w / bh_count) * kBr;
    const int64_t pos_hi = min(x.q0 + kBr, p.seq_q) - 1 + off;
    x.n_tiles = static_cast<int>(p.causal ? pos_hi / kBc + 1 : (p.seq_kv + kBc - 1) / kBc);
    return x;
  };

  const int64_t G = gridDim.x;
  auto item_of_round = [&](int64_t r) { return r * G + ((r & 1) ? G - 1 - blockIdx.x : blockIdx.x); };

  if (tid == 0) {
    mbar_init(qfull, 1), mbar_init(qempty, 8);
    for (int s = 0; s < kSK; ++s) mbar_init(kfull(s), 1), mbar_init(kempty(s), 8);  // every consumer warp arrives
    for (int s = 0; s < kSV; ++s) mbar_init(vfull(s), 1), mbar_init(vempty(s), 8);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  if (tid < 128) {
    // Producer: one thread issues every copy; the warpgroup keeps few registers.
    asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n" ::: "memory");
    if (tid == 0) {
      asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&tq)) : "memory");
      asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&tk)) : "memory");
      asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&tv)) : "memory");
      int kc = 0, vc = 0, i = 0;  // K and V tiles loaded, items begun (ring and Q phases)
      for (int64_t r = 0, w = item_of_round(0); w < n_items; w = item_of_round(++r), ++i) {
        const Item x = item(w);
        const int hk = static_cast<int>(x.hk), b = static_cast<int>(x.b);
        mbar_wait(qempty, (i & 1) ^ 1);
        mbar_expect_tx(qfull, C::kQBytes);
#pragma unroll
        for (int c = 0; c < kCols; ++c)
          tma_load(sQ + c * kBr * 128, &tq, qfull, c * 64, static_cast<int>(x.q0), static_cast<int>(x.h), b);
        // K of tile it, then V of tile it - 1 (the consumers need them in that order): a K load never
        // waits behind the release of a V slot.
        auto load = [&](const CUtensorMap* map, uint32_t ring, int stages, uint32_t full, uint32_t empty, int n, int count) {
          const int st = count % stages;
          mbar_wait(empty, ((count / stages) & 1) ^ 1);
          mbar_expect_tx(full, C::kKVBytes);
#pragma unroll
          for (int c = 0; c < kCols; ++c) tma_load(ring + st * C::kKVBytes + c * kBc * 128, map, full, c * 64, n * kBc, hk, b);
        };
        for (int it = 0; it <= x.n_tiles; ++it) {
          if (it < x.n_tiles) load(&tk, sK, kSK, kfull(kc % kSK), kempty(kc % kSK), x.n_tiles - 1 - it, kc), ++kc;
          if (it > 0) load(&tv, sV, kSV, vfull(vc % kSV), vempty(vc % kSV), x.n_tiles - it, vc), ++vc;
        }
      }
    }
    return;
  }

  // Consumers.
  asm volatile("setmaxnreg.inc.sync.aligned.u32 240;\n" ::: "memory");
  const int cw = tid / 128 - 1, tw = tid % 128, lane = tid % 32, warp = tw / 32, g = lane / 4, t = lane % 4;
  const float sl2 = p.scale * kLog2e;
  const uint32_t q_base = sQ + cw * 64 * 128;
  const uint32_t o_base = sO + cw * (C::kQBytes / 2);  // this warpgroup's [D / 64][64][64] staging tile

  float o[kNO], s[kNS];
  uint32_t pf[kBc / 16][4];  // P as the A operand of k-steps of 16 keys
  float mx[2], l[2];         // running maximum (scaled, base 2), the thread's part of the row sum

  auto qk = [&](int st) {  // s = Q K^T for ring slot st (issued, not waited for)
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
      wgmma_ss<T, kBc>(s, desc(q_base + (kk / 4) * kBr * 128 + (kk % 4) * 32, 16, 1024),
                       desc(sK + st * C::kKVBytes + (kk / 4) * kBc * 128 + (kk % 4) * 32, 16, 1024), kk > 0);
  };
  auto pv = [&](int st) {  // o += P V for ring slot st
#pragma unroll
    for (int kk = 0; kk < kBc / 16; ++kk) wgmma_rs<T, D>(o, pf[kk], desc(sV + st * C::kKVBytes + kk * 16 * 128, kBc * 128, 1024));
  };
  // The online softmax of the tile of keys from j0: s becomes the probabilities (f32, relative to the
  // new maximum), corr the factor that rescales what was accumulated before.
  auto softmax = [&](int64_t j0, int64_t pos0, bool masked, float (&corr)[2]) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      if (masked) {
        // Column c = 8 i + e of the tile (key j0 + c + 2 t) is visible when c < limit.
        const int64_t lim = min(p.seq_kv, p.causal ? pos0 + 8 * r + 1 : p.seq_kv) - j0 - 2 * t;
        const int limit = static_cast<int>(max(int64_t{-1}, min(int64_t{kBc}, lim)));
#pragma unroll
        for (int i = 0; i < kBc / 8; ++i)
#pragma unroll
          for (int e = 0; e < 2; ++e)
            if (8 * i + e >= limit) s[4 * i + 2 * r + e] = -INFINITY;
      }
      // The maximum of the raw scores (scale > 0 on this path), then p = 2^(s sl2 - max sl2); both
      // reductions as trees of four chains (a chain of kBc / 4 dependent operations would be latency).
      float m4[4] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY};
#pragma unroll
      for (int i = 0; i < kBc / 8; ++i) m4[i % 4] = fmaxf(m4[i % 4], fmaxf(s[4 * i + 2 * r], s[4 * i + 2 * r + 1]));
      float m = fmaxf(fmaxf(m4[0], m4[1]), fmaxf(m4[2], m4[3]));
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
      const float m_new = fmaxf(mx[r], m * sl2);
      const float m_use = m_new == -INFINITY ? 0.0f : m_new;
      corr[r] = ex2(mx[r] - m_use);
      mx[r] = m_new;
      float sum4[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
      for (int i = 0; i < kBc / 8; ++i)
#pragma unroll
        for (int e = 0; e < 2; ++e) sum4[i % 4] += (s[4 * i + 2 * r + e] = ex2(fmaf(s[4 * i + 2 * r + e], sl2, -m_use)));
      l[r] = l[r] * corr[r] + ((sum4[0] + sum4[1]) + (sum4[2] + sum4[3]));
    }
  };
  auto to_p = [&] {
#pragma unroll
    for (int kk = 0; kk < kBc / 16; ++kk) {
      pf[kk][0] = pack2<T>(s[8 * kk + 0], s[8 * kk + 1]);
      pf[kk][1] = pack2<T>(s[8 * kk + 2], s[8 * kk + 3]);
      pf[kk][2] = pack2<T>(s[8 * kk + 4], s[8 * kk + 5]);
      pf[kk][3] = pack2<T>(s[8 * kk + 6], s[8 * kk + 7]);
    }
  };
  auto rescale = [&](const float (&corr)[2]) {
#pragma unroll
    for (int i = 0; i < D / 8; ++i) o[4 * i] *= corr[0], o[4 * i + 1] *= corr[0], o[4 * i + 2] *= corr[1], o[4 * i + 3] *= corr[1];
  };
  // The turn to issue matrix products (PP): warpgroup 0 first, then strictly alternating.
  auto my_turn = [&] {
    if constexpr (PP) bar_sync(1 + cw, 256);
  };
  auto your_turn = [&](bool last) {
    if constexpr (PP)
      if (!(last && cw == 1)) bar_arrive(2 - cw, 256);  // warpgroup 1's very last would be one arrival too many
  };
  if constexpr (PP)
    if (cw == 1) bar_arrive(1, 256);

  int kc = 0, vc = 0, i = 0;  // K and V tiles consumed, items begun
  for (int64_t r = 0, w = item_of_round(0); w < n_items; w = item_of_round(++r), ++i) {
    const Item x = item(w);
    const bool last_item = item_of_round(r + 1) >= n_items;
    const int64_t row0 = x.q0 + cw * 64 + warp * 16 + g;  // this thread's rows: row0 and row0 + 8
    const int64_t pos0 = row0 + off, pos_wg = x.q0 + cw * 64 + off;
    auto tile_j0 = [&](int it) { return static_cast<int64_t>(x.n_tiles - 1 - it) * kBc; };
    auto tile_masked = [&](int64_t j0) { return (p.causal && j0 + kBc - 1 > pos_wg) || j0 + kBc > p.seq_kv; };
#pragma unroll
    for (int e = 0; e < kNO; ++e) o[e] = 0.0f;
    mx[0] = mx[1] = -INFINITY, l[0] = l[1] = 0.0f;

    mbar_wait(qfull, i & 1);
    // Tile 0: its scores alone.
    {
      const int st = kc % kSK;
      mbar_wait(kfull(st), (kc / kSK) & 1);
      my_turn();
      wg_fence();
      qk(st);
      wg_commit();
      your_turn(false);
      wg_wait<0>();
      pin(s);
      if (lane == 0) {
        mbar_arrive(kempty(st));
        if (x.n_tiles == 1) mbar_arrive(qempty);
      }
      ++kc;
      float corr[2];
      softmax(tile_j0(0), pos0, tile_masked(tile_j0(0)), corr);
      to_p();
    }
    // Tile it's scores with tile it - 1's P V in flight.
    for (int it = 1; it < x.n_tiles; ++it, ++kc, ++vc) {
      const int st = kc % kSK, ps = vc % kSV;
      mbar_wait(kfull(st), (kc / kSK) & 1);
      mbar_wait(vfull(ps), (vc / kSV) & 1);
      my_turn();
      wg_fence();
      qk(st);
      wg_commit();
      pv(ps);
      wg_commit();
      your_turn(false);
      wg_wait<1>();
      pin(s);
      if (lane == 0) {
        mbar_arrive(kempty(st));
        if (it == x.n_tiles - 1) mbar_arrive(qempty);  // the item's last read of Q
      }
      float corr[2];
      const int64_t j0 = tile_j0(it);
      softmax(j0, pos0, tile_masked(j0), corr);
      wg_wait<0>();
      pin(o);
      pin(pf);
      if (lane == 0) mbar_arrive(vempty(ps));
      // Once the running maxima settle, corr is 1: skip the rescale when it is for the whole warp.
      if (__any_sync(0xffffffffu, corr[0] != 1.0f || corr[1] != 1.0f)) rescale(corr);
      to_p();
    }
    {
      const int ps = vc % kSV;
      mbar_wait(vfull(ps), (vc / kSV) & 1);
      my_turn();
      wg_fence();
      pv(ps);
      wg_commit();
      your_turn(last_item);
      wg_wait<0>();
      pin(o);
      pin(pf);
      if (lane == 0) mbar_arrive(vempty(ps));
      ++vc;
    }

    if constexpr (!C::kStaged) {
      // out = o / l straight from the accumulators (pairs of columns), lse = (max + log2 l) ln 2.
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float sum = l[r];
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        const int64_t row = row0 + 8 * r;
        if (row >= p.seq_q) continue;
        const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
        T* og = static_cast<T*>(const_cast<void*>(p.out.data)) + x.b * p.out.sb + x.h * p.out.sh + row * p.out.ss;
#pragma unroll
        for (int c = 0; c < D / 8; ++c)
          *reinterpret_cast<uint32_t*>(og + 8 * c + 2 * t) = pack2<T>(o[4 * c + 2 * r] * inv, o[4 * c + 2 * r + 1] * inv);
        if (p.lse && t == 0) p.lse[(x.b * p.heads_q + x.h) * p.seq_q + row] = sum > 0.0f ? (mx[r] + log2f(sum)) * kLn2 : -INFINITY;
      }
      continue;
    }
    // out = o / l through the staging tile (same swizzle as the loads: a conflict-free scatter) and
    // one bulk tensor store a 64-column block; lse = (max + log2 l) ln 2.
    if (tw == 0) bulk_wait_read();  // the previous item's store has read the staging tile
    bar_sync(3 + cw, 128);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float sum = l[r];
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
      const int rl = warp * 16 + g + 8 * r;  // row within the warpgroup's 64
#pragma unroll
      for (int c = 0; c < D / 8; ++c) {
        const uint32_t v = pack2<T>(o[4 * c + 2 * r] * inv, o[4 * c + 2 * r + 1] * inv);
        asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(o_base + (c / 8) * 64 * 128 + rl * 128 + (((c % 8) ^ (rl % 8)) << 4) + 4 * t),
                     "r"(v)
                     : "memory");
      }
      const int64_t row = row0 + 8 * r;
      if (p.lse && t == 0 && row < p.seq_q)
        p.lse[(x.b * p.heads_q + x.h) * p.seq_q + row] = sum > 0.0f ? (mx[r] + log2f(sum)) * kLn2 : -INFINITY;
    }
    fence_async_smem();
    bar_sync(3 + cw, 128);
    if (tw == 0) {
#pragma unroll
      for (int c = 0; c < kCols; ++c)
        tma_store(&to, o_base + c * 64 * 128, c * 64, static_cast<int>(x.q0 + cw * 64), static_cast<int>(x.h), static_cast<int>(x.b));
      bulk_commit();
    }
  }
  if (C::kStaged && tw == 0) bulk_wait();
#endif
}

// ---- host ------------------------------------------------------------------------------------------

// cuTensorMapEncodeTiled through the runtime's driver entry point (nothing links libcuda).
PFN_cuTensorMapEncodeTiled_v12000 encode_fn() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess)
      f = nullptr;
    cudaGetLastError();
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }();
  return fn;
}

// A 4-d map (D, S, H, B) over operand `o`, boxes of 64 columns x `rows` rows, 128-byte swizzle; rows
// past S read as zeros.  False when the driver refuses it (the caller then takes another path).
bool make_map(CUtensorMap* map, const Operand& o, DType dt, int64_t d, int64_t s, int64_t heads, int64_t batch, int rows) {
  const auto fn = encode_fn();
  if (!fn) return false;
  const cuuint64_t dims[4] = {static_cast<cuuint64_t>(d), static_cast<cuuint64_t>(s), static_cast<cuuint64_t>(heads),
                              static_cast<cuuint64_t>(batch)};
  // A dimension of extent 1 is never stepped: give it any legal stride (its own may be 0 or odd).
  auto stride = [](int64_t elems, int64_t extent, cuuint64_t fallback) {
    return extent > 1 ? static_cast<cuuint64_t>(elems) * 2 : fallback;
  };
  const cuuint64_t ss = stride(o.ss, s, 16 * ((d * 2 + 15) / 16));
  const cuuint64_t sh = stride(o.sh, heads, ss * static_cast<cuuint64_t>(s));
  const cuuint64_t sb = stride(o.sb, batch, sh * static_cast<cuuint64_t>(heads));
  const cuuint64_t strides[3] = {ss, sh, sb};
  const cuuint32_t box[4] = {64, static_cast<cuuint32_t>(rows), 1, 1};
  const cuuint32_t estr[4] = {1, 1, 1, 1};
  return fn(map, dt == DType::bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 4,
            const_cast<void*>(o.data), dims, strides, box, estr, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// Compute capability of the current device, cached per device.
int device_cc() {
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return cudaGetLastError(), 0;
  static std::mutex mu;
  static int cc[64] = {};
  std::lock_guard lock(mu);
  if (dev < 0 || dev >= 64) return 0;
  if (cc[dev] == 0) {
    int major = 0, minor = 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess)
      return cudaGetLastError(), 0;
    cc[dev] = 10 * major + minor;
  }
  return cc[dev];
}

// Multiprocessors of the current device, cached per device.
int sm_count() {
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return cudaGetLastError(), 1;
  static std::mutex mu;
  static int n[64] = {};
  std::lock_guard lock(mu);
  if (dev < 0 || dev >= 64) return 1;
  if (n[dev] == 0 && cudaDeviceGetAttribute(&n[dev], cudaDevAttrMultiProcessorCount, dev) != cudaSuccess)
    return cudaGetLastError(), n[dev] = 0, 1;
  return n[dev];
}

template <typename T, int D, bool PP> const char* launch(const AttentionParams& p, cudaStream_t stream) {
  using C = Tile<D>;
  CUtensorMap tq, tk, tv, to;
  if (!make_map(&tq, p.q, p.dtype, D, p.seq_q, p.heads_q, p.batch, kBr) ||
      !make_map(&tk, p.k, p.dtype, D, p.seq_kv, p.heads_kv, p.batch, C::kBc) ||
      !make_map(&tv, p.v, p.dtype, D, p.seq_kv, p.heads_kv, p.batch, C::kBc) ||
      !make_map(&to, p.out, p.dtype, D, p.seq_q, p.heads_q, p.batch, 64))
    return "attention_forward (hopper): the driver refused a tensor map of these strides "
           "(KCPP_FLASH_ATTN_FORWARD=ampere takes the mma.sync kernel instead)";
  const cudaError_t attr = cudaFuncSetAttribute(fwd_sm90_kernel<T, D, PP>, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmem);
  if (attr != cudaSuccess)
    return kernel::errorf("attention_forward (hopper): cannot reserve %d bytes of shared memory: %s", C::kSmem,
                          cudaGetErrorString(attr));
  // Persistent: a block an SM, each looping over the work items.
  const int64_t items = (p.seq_q + kBr - 1) / kBr * p.batch * p.heads_q;
  const auto grid = static_cast<unsigned>(std::min<int64_t>(items, sm_count()));
  fwd_sm90_kernel<T, D, PP><<<grid, kThreads, C::kSmem, stream>>>(p, tq, tk, tv, to);
  return kernel::cuda::launch_error("attention_forward (hopper)");
}

}  // namespace

const char* attention_sm90_unsupported(const AttentionParams& p) {
#if !KCPP_FLASH_ATTN_SM90
  (void)p;
  return "this build has no sm_90a code (CMAKE_CUDA_ARCHITECTURES without 90a)";
#else
  if (device_cc() != 90) return "the device is not compute capability 9.0";
  if (p.dtype != DType::bf16 && p.dtype != DType::f16) return "the dtype is not bf16 or f16";
  if (p.head_dim != 64 && p.head_dim != 128 && p.head_dim != 256) return "head_dim is not 64, 128 or 256";
  if (p.window > 0) return "sliding windows are not on this path";
  if (!(p.scale > 0.0f)) return "scale is not positive";
  for (const Operand* o : {&p.q, &p.k, &p.v, &p.out})  // the tensor maps' 16-byte rule
    if ((reinterpret_cast<uintptr_t>(o->data) & 15u) != 0 || o->sb % 8 != 0 || o->sh % 8 != 0 || o->ss % 8 != 0)
      return "a pointer or a stride is not a multiple of 16 bytes";
  if (p.seq_q > (int64_t{1} << 31) - 256 || p.seq_kv > (int64_t{1} << 31) - 256 || p.batch * p.heads_q > 0x7fffffff)
    return "a dimension is beyond the tensor map's 32-bit coordinates";
  if (!encode_fn()) return "the driver has no cuTensorMapEncodeTiled";
  return nullptr;
#endif
}

const char* attention_forward_sm90(const AttentionParams& p, cudaStream_t stream) {
  if (p.batch == 0 || p.seq_q == 0) return nullptr;
  const bool bf = p.dtype == DType::bf16;
  // KCPP_FLASH_ATTN_SM90_PINGPONG=0 turns the ping-pong off (for measuring what it gives).
  const char* pp_env = std::getenv("KCPP_FLASH_ATTN_SM90_PINGPONG");
  const bool pp = !(pp_env && std::strcmp(pp_env, "0") == 0);
  if (p.head_dim == 64) {
    if (pp) return bf ? launch<__nv_bfloat16, 64, true>(p, stream) : launch<__half, 64, true>(p, stream);
    return bf ? launch<__nv_bfloat16, 64, false>(p, stream) : launch<__half, 64, false>(p, stream);
  }
  if (p.head_dim == 256) {
    if (pp) return bf ? launch<__nv_bfloat16, 256, true>(p, stream) : launch<__half, 256, true>(p, stream);
    return bf ? launch<__nv_bfloat16, 256, false>(p, stream) : launch<__half, 256, false>(p, stream);
  }
  if (pp) return bf ? launch<__nv_bfloat16, 128, true>(p, stream) : launch<__half, 128, true>(p, stream);
  return bf ? launch<__nv_bfloat16, 128, false>(p, stream) : launch<__half, 128, false>(p, stream);
}

}  // namespace kcpp::flash
