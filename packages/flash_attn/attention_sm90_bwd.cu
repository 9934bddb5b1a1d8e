// Attention backward on Hopper (sm_90a): warpgroup MMA (wgmma) on tiles that the tensor memory
// accelerator (TMA) brings into shared memory, with a producer warpgroup and two consumer warpgroups.
// The maths and the workspace are attention.h's (delta, the f32 dq accumulator and its last pass are
// attention_cuda.cu's); the building blocks are sm90_common.cuh's.
//
// The scheme is FlashAttention-3's backward (Shah et al. 2024), written here from the paper: a block
// per 128 keys of one kv head, K and V loaded once and kept in shared memory, dK and dV accumulated in
// registers over the group's query heads and the query tiles that see the keys; dQ accumulated in f32
// in the workspace by bulk reductions (order-dependent rounding: not bit-reproducible run to run).  Each consumer warpgroup owns 64 of the
// keys and works in the transposed frame (keys as the M dimension), per sub-tile of 64 queries (a query
// tile is one sub-tile at head dim 128, two at 64: see below):
//   S^T  = K Q^T, dP^T = V dO^T           wgmma, A and B from shared memory (K-major); at head dim
//                                          64, A (K, V) from registers, loaded once a block
//   P^T  = exp(scale S^T - lse)           dS^T = P^T o (dP^T - delta)      (in registers; with soft-
//                                          capping S^T is capped first and dS^T takes the factor 1 - tanh^2)
//   dV  += P^T dO, dK += dS^T Q            wgmma, A from registers, B MN-major (dO, Q as loaded)
//   dQ   = dS K over all 128 keys          wgmma, once a query tile, A = dS^T as written to shared
//                                          memory by both warpgroups (MN-major), B = K (MN-major),
//                                          into a shared f32 tile (128-byte swizzle) that bulk tensor
//                                          reductions (cp.reduce.async.bulk.tensor .add) add to the
//                                          accumulator: of a tile of 64 queries each warpgroup takes
//                                          half of the head dim's columns; of 128, every column of
//                                          its own 64 queries.
// Tiles of 128 queries at head dim 64 halve what a tile costs beyond its products (the dQ product's
// barrier and drain, its reductions, the ring's waits) against products half the size of head dim
// 128's; their sub-tiles keep the registers of 64-query tiles (S^T and dP^T of all 128 queries at once
// with dK and dV would exceed them: ptxas then serializes every wgmma).  What bounds head dim 64 is
// shared memory's bandwidth more than the tensor cores (by count: about 3,070 cycles of its traffic
// against 2,560 of products a tile, bench/RESULTS.md), hence K and V in registers there: S^T and dP^T
// then read only Q and dO.
// Warpgroup 0 is the producer: thread 0 issues the copies of K and V and of each query tile's Q and dO
// into a ring of slots ("full" mbarriers completed by the copy engine, "empty" ones by the consumer
// warps); warp 1 fills each slot's lse (scaled to base 2, +inf for rows that see no key or lie past
// the end) and delta beside it and arrives on the same "full" barrier.  dS^T is double-buffered, so one
// named barrier an iteration orders both warpgroups' writes before either's dQ product (and, with tiles
// of 64, its issuer having waited, the dQ tile's last reduction before the tile is rewritten).  The dQ
// tile's reductions: with tiles of 64, thread 128 issues them once a second named barrier, on which only
// its warp waits, has ordered both halves; with tiles of 128, the consumers' 8 warps arrive on an
// mbarrier (dq_full) for the producer warpgroup's thread 64, which issues them and hands the tile back
// (dq_empty) once the copy engine has read it, so no consumer warp waits for the copy engine
// (backward_dq_reducer; 7-9% less time a forward + backward at head dim 64 than each warpgroup's first
// thread issuing its own rows', bench/RESULTS.md; at head dim 128 the same scheme was 2-3% slower).
// A sliding window ends each block's query tiles where the last key leaves the window of the queries,
// and masks the tiles at its edge as the causal diagonal is masked.
// Varlen (cu_seqlens): a block per 128 keys of a kv head of one sequence, the grid over max_seqlen_k
// (the blocks past the sequence's keys leave at once); the tensor maps span the packed tokens (batch
// coordinate 0) with tiles from the sequence's first token.  Rows past the sequence's end are the next
// sequence's tokens: its keys are masked, its queries get lse +inf (probabilities 0, so dS 0 and their
// dQ rows exact zeros, which the reductions add harmlessly), and dK / dV are written for the sequence's
// keys only.
// Head dims 64 and 128 (each warpgroup's dK and dV of 64 keys x D in registers), bf16 / f16; head dim
// 256, whose dK and dV do not fit so, is attention_sm90_bwd256.cu's.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "sm90_common.cuh"

namespace kcpp::flash {
namespace {

constexpr int kBk = 128;          // keys a block: two consumer warpgroups of 64
constexpr int kStages = 2;        // Q / dO ring depth
constexpr int kThreadsB = 3 * 128;
// The tiles of head dim D and query tiles of BQ: 64 at head dim 128, 128 at 64 (see the head comment).
template <int D, int BQ> struct Bwd {
  static_assert(BQ == 64 || (BQ == 128 && D == 64), "attention_sm90_bwd: query tiles of 64, or of 128 at head dim 64");
  static constexpr int kKVBytes = kBk * D * 2;   // K or V
  static constexpr int kQBytes = BQ * D * 2;     // one Q or dO tile
  static constexpr int kDSBytes = kBk * BQ * 2;  // dS^T, [query block of 64][keys][64 queries]
  static constexpr int kDQBytes = BQ * D * 4;    // a tile's dQ, f32 [D / 32][BQ rows][32 columns]
  // The split of a tile's dQ between the consumer warpgroups: of 64 queries, half of the head dim's
  // columns each; of 128, all columns of its own 64 queries (kSplitRows).
  static constexpr bool kSplitRows = BQ == 128;
  static constexpr int kDQCols = kSplitRows ? D : D / 2;
  // K, V, the ring of Q and dO, two dS^T buffers, the dQ tile, lse and delta per slot, the barriers (K /
  // V's, the ring's and, of 128, dq_full / dq_empty).
  static constexpr int kSmem = 1024 + 2 * kKVBytes + kStages * 2 * kQBytes + 2 * kDSBytes + kDQBytes + kStages * 2 * BQ * 4 +
                               8 * (1 + 2 * kStages + (kSplitRows ? 2 : 0));
  static_assert(kSmem <= 227 * 1024, "attention_sm90_bwd: the tiles do not fit in shared memory");
};

#if KCPP_SM90_DEVICE || !defined(__CUDA_ARCH__)
// d (64 x N, f32) = (scale_d ? d : 0) + A B, A (64 x 16) and B (16 x N) both MN-major in shared memory.
template <typename T, int N> __device__ __forceinline__ void wgmma_ss_mn(float (&d)[N / 2], uint64_t a, uint64_t b, int scale_d);
template <> __device__ __forceinline__ void wgmma_ss_mn<__nv_bfloat16, 64>(float (&d)[32], uint64_t a, uint64_t b, int scale_d) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 1, 1;\n}\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
               : "l"(a), "l"(b), "r"(scale_d));
}
template <> __device__ __forceinline__ void wgmma_ss_mn<__half, 64>(float (&d)[32], uint64_t a, uint64_t b, int scale_d) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 1, 1;\n}\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
               : "l"(a), "l"(b), "r"(scale_d));
}
#endif

// Cap: soft-capping (p.softcap > 0), a kernel of its own so that the uncapped one keeps its code (with
// both in one kernel behind a run-time branch the uncapped backward ran markedly slower: bench/RESULTS.md).
// Red (head dim 128, KCPP_FLASH_ATTN_SM90_BWD_DQ=red, for measuring; not the default): each consumer
// thread adds its dQ rows into the accumulator from its registers (red.global.add.v4.f32) in place of
// the shared dQ tile and its bulk reductions, which take 64 KB of the 368 KB of shared-memory traffic a
// tile has against its 2,560 cycles of products (bench/RESULTS.md, the thirtieth session): a test of
// whether shared memory or the L2's reductions bound the backward there.  Not yet run on a GPU.
template <typename T, int D, int BQ, bool Cap, bool Red>
__global__ void __launch_bounds__(kThreadsB, 1)
    bwd_sm90_kernel(const __grid_constant__ AttentionParams p, int head_group, const float* __restrict__ delta, float* __restrict__ dq_acc,
                    const __grid_constant__ CUtensorMap tq, const __grid_constant__ CUtensorMap tdo,
                    const __grid_constant__ CUtensorMap tk, const __grid_constant__ CUtensorMap tv,
                    const __grid_constant__ CUtensorMap tdq) {
#if KCPP_SM90_DEVICE
  using C = Bwd<D, BQ>;
  constexpr int kBq = BQ, kKVBytes = C::kKVBytes, kQBytes = C::kQBytes, kDSBytes = C::kDSBytes, kDQBytes = C::kDQBytes;
  constexpr int kDQCols = C::kDQCols;
  constexpr bool kSplitRows = C::kSplitRows;
  constexpr int kSub = kBq / 64;  // a tile's sub-tiles of 64 queries
  constexpr float kLog2e = 1.4426950408889634f;
  extern __shared__ unsigned char smem_raw[];
  const uint32_t sK = (smem_addr(smem_raw) + 1023u) & ~1023u;
  const uint32_t sV = sK + kKVBytes, sQ = sV + kKVBytes;  // slot s: Q at sQ + 2 s kQBytes, dO after it
  const uint32_t sDS = sQ + kStages * 2 * kQBytes;         // two dS^T buffers
  // The dQ tile: D / 32 column blocks of [kBq rows][32 columns] f32, 128-byte swizzle (the reductions
  // take boxes of 64 of those rows).
  const uint32_t sDQ = sDS + 2 * kDSBytes;
  float* s_stats = reinterpret_cast<float*>(smem_raw + (sDQ + kDQBytes - smem_addr(smem_raw)));  // [slot][lse | delta][kBq]
  const uint32_t bars = smem_addr(s_stats + kStages * 2 * kBq);
  const uint32_t kvfull = bars;
  auto full = [&](int s) { return bars + 8u * (1 + s); };
  auto empty = [&](int s) { return bars + 8u * (1 + kStages + s); };
  // Tiles of 128: the dQ tile handed to the producer warpgroup's thread 64 and back.
  const uint32_t dq_full = bars + 8u * (1 + 2 * kStages), dq_empty = dq_full + 8;

  const int tid = threadIdx.x;
  BwdBlock blk;
  if (!backward_block<kBk, kBq>(p, head_group, blk)) return;  // varlen: past this sequence's keys
  const bool varlen = p.varlen();
  const int64_t b = blk.b, k0 = blk.k0, skv = blk.skv, off = blk.off;
  const int n_items = blk.n_items, qb = blk.qb;
  auto item_h = [&](int it) { return blk.item_h(it); };
  auto item_q0 = [&](int it) { return blk.item_q0(it, kBq); };

  if (tid == 0) {
    mbar_init(kvfull, 1);
    for (int s = 0; s < kStages; ++s) mbar_init(full(s), 2), mbar_init(empty(s), 8);
    if constexpr (kSplitRows) mbar_init(dq_full, 8), mbar_init(dq_empty, 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  if (tid < 128) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n" ::: "memory");
    backward_producer<D, kBk, kBq, kStages>(p, blk, delta, tid, &tq, &tdo, &tk, &tv, sK, sV, sQ, s_stats, kvfull, full(0), empty(0));
    if constexpr (kSplitRows && !Red)
      if (tid == 64) backward_dq_reducer<D, kBq>(p, blk, &tdq, sDQ, dq_full, dq_empty);
    return;
  }

  // Consumers.
  asm volatile("setmaxnreg.inc.sync.aligned.u32 240;\n" ::: "memory");
  // The warpgroup's index broadcast from lane 0: the compiler then knows it is the same across the warp
  // and may keep the descriptors below in uniform registers, where wgmma takes them, instead of moving
  // them there before every wgmma.
  const int cw = __shfl_sync(0xffffffffu, tid / 128, 0) - 1;
  const int tw = tid % 128, lane = tid % 32, warp = tw / 32, g = lane / 4, t = lane % 4;
  const float t_scale = Cap ? p.scale / p.softcap : 0.0f, sl2 = (Cap ? p.softcap : p.scale) * kLog2e;
  const uint32_t k_wg = sK + cw * 64 * 128, v_wg = sV + cw * 64 * 128;  // this warpgroup's 64 keys (row offset)
  const int64_t key0 = k0 + cw * 64 + warp * 16 + g;                     // this thread's keys: key0 and key0 + 8

  // The operands' descriptors (desc_at steps them): K and V as S^T's and dP^T's A (K-major), slot 0's Q
  // as S^T's B (K-major, dO a tile after it) and as dK's B (MN-major, likewise for dV), dS^T buffer 0 as
  // dQ's A, and K as dQ's B.  With query tiles of 64, dQ's A is all of dS^T and its B the keys of this
  // warpgroup's kDQCols columns (kDQCols cw on: K's 64-column block kDQCols cw / 64, from byte
  // 2 (kDQCols cw % 64) of its rows); of 128 (kSplitRows), its A is this warpgroup's block of 64
  // queries of dS^T and its B all of K's columns.
  const uint64_t k_desc = desc(k_wg, 16, 1024), v_desc = desc(v_wg, 16, 1024);
  const uint64_t q_desc0 = desc(sQ, 16, 1024), q_mn0 = desc(sQ, kBq * 128, 1024);
  const uint32_t kq_at = kSplitRows ? sK : sK + (kDQCols * cw / 64) * kBk * 128 + (kDQCols * cw % 64) * 2;
  const uint64_t ds_desc0 = desc(sDS + (kSplitRows ? cw * kBk * 128 : 0), 64 * 128, 1024), kq_desc = desc(kq_at, kBk * 128, 1024);
  // X (64 keys x 64 queries, f32 in the accumulator layout) rounded into A fragments, k-steps of 16 queries.
  auto pack = [&](uint32_t(&frag)[4][4], const float(&x)[32]) {
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
#pragma unroll
      for (int e = 0; e < 4; ++e) frag[kk][e] = pack2<T>(x[8 * kk + 2 * e], x[8 * kk + 2 * e + 1]);
  };
  // acc += X B in one commit group, X from the fragments `frag` (which neither the wgmma's issuer nor
  // anyone else may touch until a wait covers the group), B from `b` (MN-major).
  auto rs_product = [&](float(&acc)[D / 2], const uint32_t(&frag)[4][4], uint64_t b) {
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) wgmma_rs<T, D>(acc, frag[kk], desc_at(b, kk * 16 * 128));
    wg_commit();
  };
  float dk[D / 2], dv[D / 2];
#pragma unroll
  for (int e = 0; e < D / 2; ++e) dk[e] = dv[e] = 0.0f;

  mbar_wait(kvfull, 0);
  // At head dim 64, this warpgroup's K and V as A fragments in registers (kKVRegs: 32 registers, four
  // k-steps of 16 columns each), so that S^T and dP^T read only Q and dO from shared memory.
  constexpr bool kKVRegs = D == 64;
  uint32_t kf[kKVRegs ? 4 : 1][4], vf[kKVRegs ? 4 : 1][4];
  if constexpr (kKVRegs) {
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      load_a_fragment(kf[kk], sK, kBk * 128, cw * 64 + warp * 16 + g, kk, t);
      load_a_fragment(vf[kk], sV, kBk * 128, cw * 64 + warp * 16 + g, kk, t);
    }
  }
  for (int it = 0; it < n_items; ++it) {
    const int st = it % kStages;
    const int64_t h = item_h(it), q0 = item_q0(it);
    const uint32_t slot = st * 2 * kQBytes, ds_s = sDS + (it & 1) * kDSBytes;
    const uint64_t ds_desc = desc_at(ds_desc0, (it & 1) * kDSBytes);
    uint32_t pf[4][4], df[4][4];
    mbar_wait(full(st), (it / kStages) & 1);
    // The tile's sub-tiles of 64 queries (one, or two with tiles of 128), each in four commit groups
    // (S^T, dP^T, dV, dK), then the tile's dQ in a fifth; each group is waited for only when its result
    // is needed: P's exponentials run while dP^T is on the tensor cores, dS^T's arithmetic while dV is,
    // and its shared-memory stores while dK is.
#pragma unroll
    for (int sub = 0; sub < kSub; ++sub) {
      const int64_t qs = q0 + 64 * sub;  // the sub-tile's first query
      const uint32_t rows = sub * 64 * 128;  // its first row's offset in the Q and dO tiles
      const uint64_t q_desc = desc_at(q_desc0, slot + rows), do_desc = desc_at(q_desc0, slot + kQBytes + rows);
      const uint64_t q_mn = desc_at(q_mn0, slot + rows), do_mn = desc_at(q_mn0, slot + kQBytes + rows);
      const float* lse_s = s_stats + st * 2 * kBq + 64 * sub;
      const float* dl_s = lse_s + kBq;
      auto delta_at = [&](int i, int e) { return dl_s[8 * i + 2 * t + e]; };  // query column 8 i + 2 t + e's delta
      float s[32], dp[32];
      wg_fence();
      if constexpr (kKVRegs) {
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) wgmma_rs_kb<T, 64>(s, kf[kk], desc_at(q_desc, kk * 32), kk > 0);
        wg_commit();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) wgmma_rs_kb<T, 64>(dp, vf[kk], desc_at(do_desc, kk * 32), kk > 0);
        wg_commit();
      } else {
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk)
          wgmma_ss<T, 64>(s, desc_at(k_desc, (kk / 4) * kBk * 128 + (kk % 4) * 32), desc_at(q_desc, (kk / 4) * kBq * 128 + (kk % 4) * 32),
                          kk > 0);
        wg_commit();
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk)
          wgmma_ss<T, 64>(dp, desc_at(v_desc, (kk / 4) * kBk * 128 + (kk % 4) * 32), desc_at(do_desc, (kk / 4) * kBq * 128 + (kk % 4) * 32),
                          kk > 0);
        wg_commit();
      }
      // The sub-tile's lse while the products run (the exponentials wait for neither).
      float l2[8][2];
#pragma unroll
      for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int e = 0; e < 2; ++e) l2[i][e] = lse_s[8 * i + 2 * t + e];
      wg_wait<1>();  // S^T (and the previous sub-tile's dV and dK)
      pin(s);
      if (sub > 0) {  // their fragments are free now
        pin(pf);
        pin(df);
      }
      // P^T: row r of the thread is key key0 + 8 r, column 8 i + 2 t + e is query qs + that.
      const bool masked = (p.causal && k0 + kBk - 1 > qs + off) || k0 + kBk > skv || (p.window > 0 && qs + 63 + off - k0 >= p.window);
      // Key key0 + 8 r lies past the end when 8 r >= kv_left, after query qs + c when 8 r + ahead > c.
      const int kv_left = static_cast<int>(min(skv - key0, int64_t{64})), ahead = static_cast<int>(key0 - qs - off);
      // Query qs + c lies outside key key0 + 8 r's window when c - 8 r >= window + ahead (clamped into
      // [-64, 2^20]: c - 8 r lies in [-8, 63]).
      const int win = p.window > 0 ? static_cast<int>(max(int64_t{-64}, min(p.window + ahead, int64_t{1} << 20))) : 1 << 20;
      auto hidden = [&](int i, int e, int r) {
        return 8 * r >= kv_left || (p.causal && 8 * r + ahead > 8 * i + 2 * t + e) || 8 * i + 2 * t + e - 8 * r >= win;
      };
      if constexpr (!Cap) {
#pragma unroll
        for (int i = 0; i < 8; ++i)
#pragma unroll
          for (int e = 0; e < 2; ++e)
#pragma unroll
            for (int r = 0; r < 2; ++r) s[4 * i + 2 * r + e] = ex2(fmaf(s[4 * i + 2 * r + e], sl2, -l2[i][e]));
        if (masked)  // the tiles on the causal diagonal or past the last key only (a branch of the warpgroup)
#pragma unroll
          for (int i = 0; i < 8; ++i)
#pragma unroll
            for (int e = 0; e < 2; ++e)
#pragma unroll
              for (int r = 0; r < 2; ++r)
                if (hidden(i, e, r)) s[4 * i + 2 * r + e] = 0.0f;
      } else {
        // Soft-capping: dS^T needs tanh itself (its slope 1 - tanh^2), so dP^T is waited for here and
        // P^T and dS^T = P^T o (dP^T - delta) o (1 - tanh^2) come out of one pass over the scores.
        wg_wait<0>();
        pin(dp);
        cap_scores(s, t_scale);
        backward_capped_p_ds<8>(s, dp, sl2, masked, [&](int i, int e) { return l2[i][e]; }, delta_at, hidden);
      }
      // dV += P^T dO (dO MN-major as loaded).
      pack(pf, s);
      rs_product(dv, pf, do_mn);
      if constexpr (!Cap) {
        wg_wait<1>();  // dP^T (dV may still run)
        pin(dp);
        backward_ds<8>(s, dp, delta_at);
      }
      // dK += dS^T Q (Q MN-major as loaded).
      pack(df, dp);
      rs_product(dk, df, q_mn);
      // dS^T into shared memory while dK runs, [keys][queries] in the 128-byte swizzle (the A operand
      // of dQ, MN-major; a sub-tile's block of 64 queries after the other's): rounded again from dp,
      // since df may not be read before a wait covers dK.
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int rl = cw * 64 + warp * 16 + g + 8 * r;
#pragma unroll
        for (int i = 0; i < 8; ++i)
          asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(ds_s + sub * (kBk * 128) + rl * 128 + ((i ^ (rl % 8)) << 4) + 4 * t),
                       "r"(pack2<T>(dp[4 * i + 2 * r], dp[4 * i + 2 * r + 1]))
                       : "memory");
      }
    }
    fence_async_smem();
    // Both warpgroups' dS^T written; with tiles of 64, the dQ tile's last bulk reductions have read it
    // (their issuer waited; with tiles of 128, dq_empty below says so).
    if (!Red && !kSplitRows && tid == 128) bulk_wait_read();
    bar_sync(1, 256);
    wg_fence();
    // dQ = dS K over the 128 keys (k-steps of 16 keys): with tiles of 64 queries, columns kDQCols cw on
    // of all of them; of 128, all columns of queries 64 cw on.
    float dq[kDQCols / 2];
#pragma unroll
    for (int kk = 0; kk < kBk / 16; ++kk)
      wgmma_ss_mn<T, kDQCols>(dq, desc_at(ds_desc, kk * 16 * 128), desc_at(kq_desc, kk * 16 * 128), kk > 0);
    wg_commit();
    wg_wait<0>();
    pin(dv);
    pin(dk);
    pin(pf);
    pin(df);
    pin(dq);
    if (lane == 0) mbar_arrive(empty(st));
    if constexpr (Red) {
      // Each thread's dQ straight into the accumulator, four columns of one row a vector add: lanes t
      // and t ^ 1 swap a pair, so that an even t holds row g's columns 8 i + 2 t .. + 3 and an odd t row
      // g + 8's from 8 i + 2 (t - 1) (fragment element 4 i + 2 r + e: row g + 8 r, column 8 i + 2 t + e);
      // rows past the sequence's queries are left out.
      const bool odd = t & 1;
      const int64_t plane = varlen ? h : b * p.heads_q + h, nq = varlen ? p.total_q : p.seq_q;
      const int64_t qi = q0 + (kSplitRows ? 64 * cw : 0) + warp * 16 + g + (odd ? 8 : 0);
      float* dst = dq_acc + (plane * nq + (varlen ? qb : 0) + qi) * D + (kSplitRows ? 0 : kDQCols * cw) + 2 * (t & ~1);
      const bool live = qi < blk.sq;
#pragma unroll
      for (int i = 0; i < kDQCols / 8; ++i) {
        const float x0 = __shfl_xor_sync(0xffffffffu, odd ? dq[4 * i] : dq[4 * i + 2], 1);
        const float x1 = __shfl_xor_sync(0xffffffffu, odd ? dq[4 * i + 1] : dq[4 * i + 3], 1);
        const float a0 = odd ? x0 : dq[4 * i], a1 = odd ? x1 : dq[4 * i + 1];
        const float a2 = odd ? dq[4 * i + 2] : x0, a3 = odd ? dq[4 * i + 3] : x1;
        if (live)
          asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(dst + 8 * i), "f"(a0), "f"(a1), "f"(a2), "f"(a3)
                       : "memory");
      }
    } else {
      // dQ into the tile (tiles of 64 queries: row warp * 16 + g + 8 r, columns kDQCols cw + 8 i + 2 t,
      // kDQCols a multiple of 32: box kDQCols cw / 32 + i / 4, 16-byte chunk 2 (i % 4) + t / 2 of the row,
      // swizzled; of 128: row 64 cw + that, box i / 4), then the bulk tensor reductions of its D / 32
      // boxes into the accumulator: of the whole tile by thread 128 once both halves are written, or
      // (kSplitRows) by thread 64 once the 8 warps have arrived on dq_full.
      const uint32_t dq_wg = sDQ + (kSplitRows ? cw * 64 * 128 : (kDQCols / 32) * cw * (kBq * 128));
      if constexpr (kSplitRows) mbar_wait(dq_empty, (it & 1) ^ 1);  // thread 64 has handed the last tile on
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = warp * 16 + g + 8 * r;
#pragma unroll
        for (int i = 0; i < kDQCols / 8; ++i)
          asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(dq_wg + (i / 4) * (kBq * 128) + row * 128 +
                                                                   (((2 * (i % 4) + t / 2) ^ (row % 8)) << 4) + 8 * (t % 2)),
                       "f"(dq[4 * i + 2 * r]), "f"(dq[4 * i + 2 * r + 1])
                       : "memory");
      }
      fence_async_smem();
      if constexpr (kSplitRows) {
        __syncwarp();
        if (lane == 0) mbar_arrive(dq_full);
      } else if (warp == 0 && cw == 0) {
        bar_sync(2, 256);
        if (tid == 128) {
#pragma unroll
          for (int j = 0; j < D / 32; ++j)
            tma_reduce_add(&tdq, sDQ + j * (kBq * 128), 32 * j, static_cast<int>(varlen ? qb + q0 : q0),
                           static_cast<int>(varlen ? h : b * p.heads_q + h));
          bulk_commit();
        }
      } else {
        bar_arrive(2, 256);
      }
    }
  }
  if (!Red && !kSplitRows && tid == 128) bulk_wait();

  // dK (times the scale) and dV, straight from the accumulators.
  store_dkdv<T, D>(p, blk, key0, 0, t, dk, dv);
#endif
}

template <typename T, int D, int BQ, bool Cap, bool Red>
const char* launch_bwd_as(const AttentionParams& p, const float* delta, float* dq_acc, cudaStream_t stream) {
  CUtensorMap tq, tdo, tk, tv, tdq;
  if (const char* e = backward_maps(p, dq_acc, kBk, BQ, &tq, &tdo, &tk, &tv, &tdq)) return e;
  constexpr int kSmemB = Bwd<D, BQ>::kSmem;
  const cudaError_t attr = cudaFuncSetAttribute(bwd_sm90_kernel<T, D, BQ, Cap, Red>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemB);
  if (attr != cudaSuccess)
    return kernel::errorf("attention_backward (hopper): cannot reserve %d bytes of shared memory: %s", kSmemB,
                          cudaGetErrorString(attr));
  const int head_group = backward_head_group(p, kBk);
  const dim3 grid = backward_grid(p, kBk, head_group);
  bwd_sm90_kernel<T, D, BQ, Cap, Red><<<grid, kThreadsB, kSmemB, stream>>>(p, head_group, delta, dq_acc, tq, tdo, tk, tv, tdq);
  return kernel::cuda::launch_error("attention_backward (hopper)");
}

// KCPP_FLASH_ATTN_SM90_BWD_DQ=red takes the kernels that add dQ from registers (Red), for measuring, at
// head dim 128 (at 64 they would spill in the consumers' loop).
template <typename T, int D, int BQ, bool Cap>
const char* launch_bwd(const AttentionParams& p, const float* delta, float* dq_acc, cudaStream_t stream) {
  if constexpr (D == 128) {
    const char* how = std::getenv("KCPP_FLASH_ATTN_SM90_BWD_DQ");
    if (how && std::strcmp(how, "red") == 0) return launch_bwd_as<T, D, BQ, Cap, true>(p, delta, dq_acc, stream);
  }
  return launch_bwd_as<T, D, BQ, Cap, false>(p, delta, dq_acc, stream);
}

}  // namespace

const char* attention_sm90_backward_unsupported(const AttentionParams& p) {
#if !KCPP_FLASH_ATTN_SM90
  (void)p;
  return "this build has no sm_90a code (CMAKE_CUDA_ARCHITECTURES without 90a)";
#else
  if (device_cc() != 90) return "the device is not compute capability 9.0";
  if (p.dtype != DType::bf16 && p.dtype != DType::f16) return "the dtype is not bf16 or f16";
  if (p.head_dim != 64 && p.head_dim != 128 && p.head_dim != 256) return "head_dim is not 64, 128 or 256";
  if (!(p.scale > 0.0f)) return "scale is not positive";
  for (const Operand* o : {&p.q, &p.k, &p.v, &p.dout})  // the tensor maps' 16-byte rule
    if ((reinterpret_cast<uintptr_t>(o->data) & 15u) != 0 || o->sb % 8 != 0 || o->sh % 8 != 0 || o->ss % 8 != 0)
      return "a pointer or a stride is not a multiple of 16 bytes";
  for (const Operand* o : {&p.dk, &p.dv})  // 4-byte stores of pairs
    if ((reinterpret_cast<uintptr_t>(o->data) & 3u) != 0 || o->sb % 2 != 0 || o->sh % 2 != 0 || o->ss % 2 != 0)
      return "dk or dv is not 4-byte aligned";
  constexpr int64_t kMaxRows = (int64_t{1} << 31) - 256;  // the tensor maps' 32-bit row coordinates
  const int64_t block_keys = p.head_dim == 256 ? 64 : kBk;  // attention_sm90_bwd256.cu's blocks are of 64 keys
  const int64_t key_blocks = (p.seq_kv + block_keys - 1) / block_keys, bh = p.batch * p.heads_kv;
  const bool grid_fits = bh * key_blocks <= 0x7fffffff;  // the grouped orders' grid (backward_head_group)
  if (p.seq_q > kMaxRows || p.seq_kv > kMaxRows || p.total_q > kMaxRows || p.total_kv > kMaxRows ||
      p.batch * p.heads_q > 0x7fffffff || !grid_fits)
    return "a dimension is beyond the tensor map's 32-bit coordinates or the grid";
  if (!encode_fn()) return "the driver has no cuTensorMapEncodeTiled";
  return nullptr;
#endif
}

const char* attention_backward_sm90(const AttentionParams& p, const float* delta, float* dq_acc, cudaStream_t stream) {
  if (p.batch == 0 || p.seq_kv == 0) return nullptr;
  const bool bf = p.dtype == DType::bf16, cap = p.softcap > 0.0f;
  if (p.head_dim == 256) return attention_backward_sm90_d256(p, delta, dq_acc, stream);
  if (p.head_dim == 64) {
    if (cap) return bf ? launch_bwd<__nv_bfloat16, 64, 128, true>(p, delta, dq_acc, stream) : launch_bwd<__half, 64, 128, true>(p, delta, dq_acc, stream);
    return bf ? launch_bwd<__nv_bfloat16, 64, 128, false>(p, delta, dq_acc, stream) : launch_bwd<__half, 64, 128, false>(p, delta, dq_acc, stream);
  }
  if (cap) return bf ? launch_bwd<__nv_bfloat16, 128, 64, true>(p, delta, dq_acc, stream) : launch_bwd<__half, 128, 64, true>(p, delta, dq_acc, stream);
  return bf ? launch_bwd<__nv_bfloat16, 128, 64, false>(p, delta, dq_acc, stream) : launch_bwd<__half, 128, 64, false>(p, delta, dq_acc, stream);
}

}  // namespace kcpp::flash
