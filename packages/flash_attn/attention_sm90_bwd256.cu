// Attention backward on Hopper (sm_90a) at head dim 256: warpgroup MMA (wgmma) on tiles that the tensor
// memory accelerator (TMA) brings into shared memory, a producer warpgroup and two consumer warpgroups.
// The maths and the workspace are attention.h's (delta, the f32 dq accumulator and its last pass are
// attention_cuda.cu's); the block order, the producer and the tensor maps are sm90_common.cuh's, shared
// with attention_sm90_bwd.cu (head dims 64 and 128), whose scheme this follows (FlashAttention-3's
// backward, Shah et al. 2024, written here from the paper) with the work split differently.
//
// Why another split: the 64 / 128 kernel gives each consumer warpgroup 64 keys and keeps its dK and dV
// (64 keys x D, f32) in registers, 256 registers a thread at D = 256, past the 255 a thread may have.
// Here a block takes 64 keys of one kv head and each consumer warpgroup w (0, 1) owns half of the head
// dim, columns 128 w .. 128 w + 127, of dK and dV (64 + 64 registers).  The score products need the
// whole head dim, so they are split by queries instead: per query tile of 64, warpgroup w takes queries
// 32 w .. 32 w + 31 and, in the transposed frame (keys as the M dimension),
//   S^T  = K Q^T,  dP^T = V dO^T           wgmma m64n32, A and B from shared memory (K-major)
//   P^T  = exp(scale S^T - lse)            dS^T = P^T o (dP^T - delta)         (in registers; with soft-
//                                          capping S^T is capped first and dS^T takes 1 - tanh^2)
// and writes its 32 columns of P^T and dS^T (rounded to T) into shared tiles [64 keys][64 queries]
// (128-byte swizzle).  A named barrier of both warpgroups later, each takes the whole tiles as A:
//   dV[:, w half] += P^T dO[:, w half]     wgmma m64n128, A K-major, B MN-major (dO as loaded)
//   dK[:, w half] += dS^T Q[:, w half]     likewise
//   dQ[:, w half]  = dS K[:, w half]       A = dS^T read MN-major, B = K MN-major
// P^T and dS^T are double-buffered, so that one barrier a tile suffices: a warpgroup that has passed
// tile i's barrier knows that the other has finished tile i - 1's products, the last readers of the
// buffer that tile i + 1 writes.
// dQ (64 queries x 128 columns a warpgroup, f32) leaves through the ring slot its tile came in: once a
// warpgroup's three products are done, nothing reads its half of the slot's Q (the dK product's B) and
// dO (the dV product's B) any more: both warpgroups' score products, the only other readers, finished
// before the tile's barrier.  Those two halves, 16 KB each, hold its four boxes of [64 rows][32 columns]
// f32 (128-byte swizzle), which one thread adds into the accumulator by bulk tensor reductions
// (cp.reduce.async.bulk.tensor .add; order-dependent rounding: not bit-reproducible run to run).  The
// slot goes back to the producer (its "empty" barrier, one arrival a warpgroup) once the reductions
// have read it, which the issuing thread waits for at the next tile, after that tile's score products
// are issued.  Masks, windows, varlen and the lse / delta staging are the 64 / 128 kernel's.
//
// Shared memory (227 KB at most): K and V 32 KB each, a ring of two slots of Q and dO (64 KB a slot),
// two P^T and two dS^T tiles (8 KB each), each slot's lse and delta, the barriers: 226 KB.
#include <cmath>
#include <cstdint>

#include "sm90_common.cuh"

namespace kcpp::flash {
namespace {

constexpr int kD = 256;
constexpr int kBk = 64;        // keys a block
constexpr int kBq = 64;        // queries a tile, 32 a consumer warpgroup in the score products
constexpr int kStages = 2;     // Q / dO ring depth
constexpr int kThreads = 3 * 128;
constexpr int kKVBytes = kBk * kD * 2;  // K or V: four boxes of [64 keys][64 columns]
constexpr int kQBytes = kBq * kD * 2;   // one Q or dO tile: four boxes of [64 queries][64 columns]
constexpr int kBox = 64 * 128;          // one such box, and one [64 rows][32 columns] f32 box of dQ
constexpr int kPBytes = kBk * kBq * 2;  // P^T or dS^T, [keys][queries]
constexpr int kSmem = 1024 + 2 * kKVBytes + kStages * 2 * kQBytes + 4 * kPBytes + kStages * 2 * kBq * 4 + 8 * (1 + 2 * kStages);
static_assert(kSmem <= 227 * 1024, "attention_sm90_bwd256: the tiles do not fit in shared memory");
static_assert(kBox * 4 == kKVBytes && kBox * 4 == kQBytes, "attention_sm90_bwd256: a tile is four boxes");

#if KCPP_SM90_DEVICE || !defined(__CUDA_ARCH__)
// d (64 x N, f32) = (scale_d ? d : 0) + A B from shared-memory descriptors; TA / TB: A / B MN-major (1)
// or K-major (0).
template <typename T, int N, int TA, int TB> struct Wgmma;
// One specialization per shape, its operand list written out (inline PTX has no loops), for bf16 and f16.
#define KCPP_BWD256_WGMMA_N32(T, TY)                                                                       \
  template <int TA, int TB> struct Wgmma<T, 32, TA, TB> {                                                \
    static __device__ __forceinline__ void run(float (&d)[16], uint64_t a, uint64_t b, int scale_d) {       \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"                                          \
                   "wgmma.mma_async.sync.aligned.m64n32k16.f32." TY "." TY " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, 1, %19, %20;\n}\n" \
                   : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]) \
                   : "l"(a), "l"(b), "r"(scale_d), "n"(TA), "n"(TB));                                    \
    }                                                                                                    \
  };
#define KCPP_BWD256_WGMMA_N128(T, TY)                                                                       \
  template <int TA, int TB> struct Wgmma<T, 128, TA, TB> {                                                \
    static __device__ __forceinline__ void run(float (&d)[64], uint64_t a, uint64_t b, int scale_d) {       \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"                                          \
                   "wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, %67, %68;\n}\n" \
                   : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]) \
                   : "l"(a), "l"(b), "r"(scale_d), "n"(TA), "n"(TB));                                    \
    }                                                                                                    \
  };
KCPP_BWD256_WGMMA_N32(__nv_bfloat16, "bf16")
KCPP_BWD256_WGMMA_N32(__half, "f16")
KCPP_BWD256_WGMMA_N128(__nv_bfloat16, "bf16")
KCPP_BWD256_WGMMA_N128(__half, "f16")
#undef KCPP_BWD256_WGMMA_N32
#undef KCPP_BWD256_WGMMA_N128
#endif

template <typename T, bool Cap>
__global__ void __launch_bounds__(kThreads, 1)
    bwd256_kernel(const __grid_constant__ AttentionParams p, int head_group, const float* __restrict__ delta,
                  const __grid_constant__ CUtensorMap tq, const __grid_constant__ CUtensorMap tdo,
                  const __grid_constant__ CUtensorMap tk, const __grid_constant__ CUtensorMap tv,
                  const __grid_constant__ CUtensorMap tdq) {
#if KCPP_SM90_DEVICE
  constexpr float kLog2e = 1.4426950408889634f;
  extern __shared__ unsigned char smem_raw[];
  const uint32_t sK = (smem_addr(smem_raw) + 1023u) & ~1023u;
  const uint32_t sV = sK + kKVBytes, sQ = sV + kKVBytes;  // slot s: Q at sQ + 2 s kQBytes, dO after it
  const uint32_t sP = sQ + kStages * 2 * kQBytes;          // two P^T tiles, then two dS^T tiles
  const uint32_t sDS = sP + 2 * kPBytes;
  float* s_stats = reinterpret_cast<float*>(smem_raw + (sDS + 2 * kPBytes - smem_addr(smem_raw)));  // [slot][lse | delta][64]
  const uint32_t bars = smem_addr(s_stats + kStages * 2 * kBq);
  const uint32_t kvfull = bars;
  auto full = [&](int s) { return bars + 8u * (1 + s); };
  auto empty = [&](int s) { return bars + 8u * (1 + kStages + s); };

  const int tid = threadIdx.x;
  BwdBlock blk;
  if (!backward_block<kBk, kBq>(p, head_group, blk)) return;  // varlen: past this sequence's keys
  if (tid == 0) {
    mbar_init(kvfull, 1);
    for (int s = 0; s < kStages; ++s) mbar_init(full(s), 2), mbar_init(empty(s), 2);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  if (tid < 128) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n" ::: "memory");
    backward_producer<kD, kBk, kBq, kStages>(p, blk, delta, tid, &tq, &tdo, &tk, &tv, sK, sV, sQ, s_stats, kvfull, full(0), empty(0));
    return;
  }

  // Consumers.
  asm volatile("setmaxnreg.inc.sync.aligned.u32 240;\n" ::: "memory");
  // The warpgroup's index broadcast from lane 0, so that the compiler keeps the descriptors in uniform
  // registers (attention_sm90_bwd.cu).
  const int cw = __shfl_sync(0xffffffffu, tid / 128, 0) - 1;
  const int tw = tid % 128, lane = tid % 32, warp = tw / 32, g = lane / 4, t = lane % 4;
  const bool varlen = p.varlen();
  const int64_t skv = blk.skv, k0 = blk.k0, off = blk.off;
  const float t_scale = Cap ? p.scale / p.softcap : 0.0f, sl2 = (Cap ? p.softcap : p.scale) * kLog2e;
  const int qc = 32 * cw;                       // this warpgroup's queries of a tile in the score products
  const int64_t key0 = k0 + warp * 16 + g;      // this thread's keys: key0 and key0 + 8 (rows of S^T)

  // Descriptors (desc_at steps them): K and V as S^T's and dP^T's A (K-major); slot 0's Q rows qc.. as
  // S^T's B (K-major, dO a tile after it); the warpgroup's columns of Q (boxes 2 cw, 2 cw + 1) as dK's B,
  // MN-major (dO's as dV's); P^T / dS^T buffer 0 as dV's / dK's A (K-major) and dS^T as dQ's A (MN-major);
  // the warpgroup's columns of K as dQ's B (MN-major).
  const uint64_t k_desc = desc(sK, 16, 1024), v_desc = desc(sV, 16, 1024);
  const uint64_t q_desc0 = desc(sQ + qc * 128, 16, 1024), q_mn0 = desc(sQ + 2 * cw * kBox, kBox, 1024);
  const uint64_t p_desc0 = desc(sP, 16, 1024), ds_desc0 = desc(sDS, 16, 1024), ds_mn0 = desc(sDS, kBox, 1024);
  const uint64_t kq_desc = desc(sK + 2 * cw * kBox, kBox, 1024);
  float dk[64], dv[64];
#pragma unroll
  for (int e = 0; e < 64; ++e) dk[e] = dv[e] = 0.0f;

  mbar_wait(kvfull, 0);
  for (int it = 0; it < blk.n_items; ++it) {
    const int st = it % kStages;
    const int64_t h = blk.item_h(it), q0 = blk.item_q0(it, kBq);
    const uint32_t slot = st * 2 * kQBytes, buf = (it & 1) * kPBytes;
    const uint64_t q_desc = desc_at(q_desc0, slot), do_desc = desc_at(q_desc0, slot + kQBytes);
    const float* lse_s = s_stats + st * 2 * kBq;
    const float* dl_s = lse_s + kBq;
    auto delta_at = [&](int i, int e) { return dl_s[qc + 8 * i + 2 * t + e]; };  // query column qc + 8 i + 2 t + e's delta
    float s[16], dp[16];
    mbar_wait(full(st), (it / kStages) & 1);
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < kD / 16; ++kk)
      Wgmma<T, 32, 0, 0>::run(s, desc_at(k_desc, (kk / 4) * kBox + (kk % 4) * 32), desc_at(q_desc, (kk / 4) * kBox + (kk % 4) * 32), kk > 0);
    wg_commit();
#pragma unroll
    for (int kk = 0; kk < kD / 16; ++kk)
      Wgmma<T, 32, 0, 0>::run(dp, desc_at(v_desc, (kk / 4) * kBox + (kk % 4) * 32), desc_at(do_desc, (kk / 4) * kBox + (kk % 4) * 32), kk > 0);
    wg_commit();
    // The last tile's dQ reductions have read their slot by now (most likely): give it back.
    if (it > 0 && tw == 0) {
      bulk_wait_read();
      mbar_arrive(empty((it - 1) % kStages));
    }
    float l2[4][2];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int e = 0; e < 2; ++e) l2[i][e] = lse_s[qc + 8 * i + 2 * t + e];
    wg_wait<1>();  // S^T
    pin(s);
    // P^T: row r of the thread is key key0 + 8 r, column 8 i + 2 t + e is query q0 + qc + that.
    const bool masked = (p.causal && k0 + kBk - 1 > q0 + off) || k0 + kBk > skv || (p.window > 0 && q0 + kBq - 1 + off - k0 >= p.window);
    // Key key0 + 8 r lies past the end when 8 r >= kv_left, after query q0 + c when 8 r + ahead > c;
    // query q0 + c lies outside its window when c - 8 r >= win (win clamped into [-64, 2^20]: c - 8 r
    // lies in [-8, 63]).
    const int kv_left = static_cast<int>(min(skv - key0, int64_t{64})), ahead = static_cast<int>(key0 - q0 - off);
    const int win = p.window > 0 ? static_cast<int>(max(int64_t{-64}, min(p.window + ahead, int64_t{1} << 20))) : 1 << 20;
    auto hidden = [&](int i, int e, int r) {
      const int c = qc + 8 * i + 2 * t + e;
      return 8 * r >= kv_left || (p.causal && 8 * r + ahead > c) || c - 8 * r >= win;
    };
    if constexpr (!Cap) {
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int e = 0; e < 2; ++e)
#pragma unroll
          for (int r = 0; r < 2; ++r) s[4 * i + 2 * r + e] = ex2(fmaf(s[4 * i + 2 * r + e], sl2, -l2[i][e]));
      if (masked)
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
          for (int e = 0; e < 2; ++e)
#pragma unroll
            for (int r = 0; r < 2; ++r)
              if (hidden(i, e, r)) s[4 * i + 2 * r + e] = 0.0f;
      wg_wait<0>();  // dP^T
      pin(dp);
      backward_ds<4>(s, dp, delta_at);
    } else {
      wg_wait<0>();
      pin(dp);
      cap_scores(s, t_scale);
      backward_capped_p_ds<4>(s, dp, sl2, masked, [&](int i, int e) { return l2[i][e]; }, delta_at, hidden);
    }
    // This warpgroup's 32 columns of P^T and dS^T into the shared tiles (row = key, 16-byte chunk
    // 4 cw + i of the row, swizzled).
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int rl = warp * 16 + g + 8 * r;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const uint32_t at = buf + rl * 128 + (((4 * cw + i) ^ (rl % 8)) << 4) + 4 * t;
        asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(sP + at), "r"(pack2<T>(s[4 * i + 2 * r], s[4 * i + 2 * r + 1])) : "memory");
        asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(sDS + at), "r"(pack2<T>(dp[4 * i + 2 * r], dp[4 * i + 2 * r + 1])) : "memory");
      }
    }
    fence_async_smem();
    bar_sync(1, 256);  // both halves of P^T and dS^T written
    // dV += P^T dO, dK += dS^T Q, dQ = dS K over this warpgroup's columns (k-steps of 16 queries, then
    // of 16 keys).
    const uint64_t p_desc = desc_at(p_desc0, buf), ds_desc = desc_at(ds_desc0, buf), ds_mn = desc_at(ds_mn0, buf);
    const uint64_t q_mn = desc_at(q_mn0, slot), do_mn = desc_at(q_mn0, slot + kQBytes);
    float dq[64];
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < kBq / 16; ++kk) Wgmma<T, 128, 0, 1>::run(dv, desc_at(p_desc, kk * 32), desc_at(do_mn, kk * 16 * 128), 1);
#pragma unroll
    for (int kk = 0; kk < kBq / 16; ++kk) Wgmma<T, 128, 0, 1>::run(dk, desc_at(ds_desc, kk * 32), desc_at(q_mn, kk * 16 * 128), 1);
#pragma unroll
    for (int kk = 0; kk < kBk / 16; ++kk)
      Wgmma<T, 128, 1, 1>::run(dq, desc_at(ds_mn, kk * 16 * 128), desc_at(kq_desc, kk * 16 * 128), kk > 0);
    wg_commit();
    wg_wait<0>();
    pin(dv);
    pin(dk);
    pin(dq);
    // dQ into this warpgroup's halves of the slot: box j (columns 128 cw + 32 j) in Q's box 2 cw + j
    // for j < 2, in dO's box 2 cw + j - 2 after; row warp * 16 + g + 8 r, columns 8 i + 2 t of the
    // warpgroup's 128: box i / 4, 16-byte chunk 2 (i % 4) + t / 2 of the row, swizzled.
    auto dq_box = [&](int j) { return sQ + slot + (j / 2) * kQBytes + (2 * cw + j % 2) * kBox; };
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = warp * 16 + g + 8 * r;
#pragma unroll
      for (int i = 0; i < 16; ++i)
        asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(dq_box(i / 4) + row * 128 + (((2 * (i % 4) + t / 2) ^ (row % 8)) << 4) + 8 * (t % 2)),
                     "f"(dq[4 * i + 2 * r]), "f"(dq[4 * i + 2 * r + 1])
                     : "memory");
    }
    fence_async_smem();
    bar_sync(2 + cw, 128);
    if (tw == 0) {
#pragma unroll
      for (int j = 0; j < 4; ++j)
        tma_reduce_add(&tdq, dq_box(j), 128 * cw + 32 * j, static_cast<int>(varlen ? blk.qb + q0 : q0),
                       static_cast<int>(varlen ? h : blk.b * p.heads_q + h));
      bulk_commit();
    }
  }
  if (tw == 0) bulk_wait();

  // dK (times the scale) and dV over this warpgroup's columns, straight from the accumulators.
  store_dkdv<T, 128>(p, blk, key0, 128 * cw, t, dk, dv);
#endif
}

template <typename T, bool Cap>
const char* launch_bwd256(const AttentionParams& p, const float* delta, float* dq_acc, cudaStream_t stream) {
  CUtensorMap tq, tdo, tk, tv, tdq;
  if (const char* e = backward_maps(p, dq_acc, kBk, kBq, &tq, &tdo, &tk, &tv, &tdq)) return e;
  const cudaError_t attr = cudaFuncSetAttribute(bwd256_kernel<T, Cap>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  if (attr != cudaSuccess)
    return kernel::errorf("attention_backward (hopper): cannot reserve %d bytes of shared memory: %s", kSmem, cudaGetErrorString(attr));
  const int head_group = backward_head_group(p, kBk);
  bwd256_kernel<T, Cap><<<backward_grid(p, kBk, head_group), kThreads, kSmem, stream>>>(p, head_group, delta, tq, tdo, tk, tv, tdq);
  return kernel::cuda::launch_error("attention_backward (hopper, head dim 256)");
}

}  // namespace

const char* attention_backward_sm90_d256(const AttentionParams& p, const float* delta, float* dq_acc, cudaStream_t stream) {
  const bool bf = p.dtype == DType::bf16;
  if (p.softcap > 0.0f) return bf ? launch_bwd256<__nv_bfloat16, true>(p, delta, dq_acc, stream) : launch_bwd256<__half, true>(p, delta, dq_acc, stream);
  return bf ? launch_bwd256<__nv_bfloat16, false>(p, delta, dq_acc, stream) : launch_bwd256<__half, false>(p, delta, dq_acc, stream);
}

}  // namespace kcpp::flash
