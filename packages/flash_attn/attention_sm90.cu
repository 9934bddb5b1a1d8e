// Attention forward on Hopper (sm_90a): warpgroup MMA (wgmma) on tiles that the tensor memory
// accelerator (TMA) brings into shared memory, producer / consumer warp specialization, and the
// softmax of one key tile overlapped with the matrix products of the next.  The maths, the layout
// and the log-sum-exp it saves are attention.h's; the backward is attention_sm90_bwd.cu's (head dims 64 and 128)
// or attention_cuda.cu's; the building blocks shared with it are sm90_common.cuh's.
//
// The algorithm is FlashAttention-3's (Shah, Bikshandi, Zhang, Thakkar, Ramani, Dao, "FlashAttention-3:
// Fast and Accurate Attention with Asynchrony and Low-precision", 2024, section 3), written here from
// the paper: persistent blocks of three (or four) warpgroups, one block an SM, each looping over work
// items (128, or 192, queries of one head).  Warpgroup 0 is the producer: one thread issues the bulk tensor copies
// of each item's Q tile and of its K and V tiles into rings of slots that run on across items, each
// slot guarded by a "full" mbarrier (the copy engine completes it with the bytes it wrote) and an
// "empty" one (every consumer warp arrives once it no longer reads the slot), so the next item's
// loads overlap the last one's tail; the producer gives up registers (setmaxnreg) to the consumers.
// Warpgroups 1 and 2 (and 3: the head-dim-64 tiles of long sequences) each own 64 query rows and run, per key tile j:
//   S_j = Q K_j^T                   wgmma, A and B from shared memory (both K-major); with two
//                                   warpgroups at head dims 64 and 128, A (Q) from registers
//   O  += P_{j-1} V_{j-1}           wgmma, A (the probabilities) from registers, B = V (MN-major)
//   softmax of S_j in registers while the O product runs (the two are issued together and waited
//   for one after the other), then O is rescaled by the change of the running maximum;
// and the warpgroups take turns to issue (ping-pong, round the warpgroups), so that one's softmax
// overlaps the others' products.  Key tiles are visited from the last to the first, so the tiles that need a mask come
// first; a sliding window bounds the tiles from below as causal does from above, and the tiles at its
// edge are masked as the diagonal's are.  Soft-capping maps each tile's scores through tanh
// (softcap.cuh) at the start of its softmax.  Items are ordered heads-fastest with the heaviest (last) query tiles first and dealt out
// in a snake, which balances the causal triangle and keeps the query heads of one kv head close in
// time (their K / V stay in L2).  The output goes through a staging tile and a bulk tensor store
// (head dims 64 and 128) or straight from registers (256, where the staging tile does not fit).
// Tiles: 128 queries (192 with three warpgroups) x 128 keys (64 keys at head dim 256); rings of 4 K
// and 4 V slots at head dim 64, 3 and 2 at 128, 2 and 2 at 256.
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
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "sm90_common.cuh"

namespace kcpp::flash {
namespace {

using kernel::DType;

// NW consumer warpgroups of 64 queries each: kBr = 64 NW queries an item, 128 (NW + 1) threads a
// block with the producer warpgroup.  Two, or at head dim 64 three (FlashAttention-3's tiles there:
// 192 queries x 128 keys), where a tile's products are short beside its softmax and each warpgroup's
// softmax then has two others' products to run under.  Three warpgroups leave a consumer thread 160
// registers by setmaxnreg, but ptxas allocates for the launch's average, 128 a thread: the kernel fits
// them (positions held in 32 bits, below) with no spill; keep it so (ptxas -v).

// Tile sizes and ring depths by head dim: a K or V tile is kBc keys x D.
template <int D, int NW> struct Tile {
  static constexpr int kBr = 64 * NW;
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


// ---- the kernel -----------------------------------------------------------------------------------

// PP: ping-pong between the consumer warpgroups (FlashAttention-3, section 3.1): each issues its
// matrix products only after the one before it (round the NW warpgroups) has issued its own, so one's
// softmax runs while the others' products occupy the tensor cores.  Named barriers 1 to NW pass the turn.  V: varlen (cu_seqlens), a
// kernel of its own so that the batched one keeps its lengths in the parameters, not in registers.
template <typename T, int D, bool PP, bool V, int NW>
__global__ void __launch_bounds__(128 * (NW + 1), 1)
    fwd_sm90_kernel(const __grid_constant__ AttentionParams p, const __grid_constant__ CUtensorMap tq,
                    const __grid_constant__ CUtensorMap tk, const __grid_constant__ CUtensorMap tv,
                    const __grid_constant__ CUtensorMap to) {
#if KCPP_SM90_DEVICE
  using C = Tile<D, NW>;
  constexpr int kBr = C::kBr;
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
  // Varlen: the query tiles run over max_seqlen_q of each sequence; an item past its sequence's
  // queries has no rows (n_tiles < 0) and one whose rows see no key (more queries than keys under
  // causal, or no keys) has no tiles (n_tiles 0): producer and consumers skip both alike, the
  // consumers writing the latter's zero rows.  The tensor maps then span the packed tokens (batch
  // coordinate 0), a tile starting at the sequence's first token; rows past the sequence's end are
  // the next sequence's tokens, masked (keys) or not written (queries).
  const int tid = threadIdx.x;
  const int64_t bh_count = p.batch * p.heads_q, n_qt = (p.seq_q + kBr - 1) / kBr, n_items = n_qt * bh_count;
  // 32-bit fields (every count fits: attention_sm90_unsupported), so that an item costs few registers.
  struct Item {
    int b, h, hk, q0;
    int qb, kb, sq, skv, off;  // the sequence's first query / key token, its lengths, skv - sq
    int mb;                    // the tensor maps' batch coordinate
    int t_hi, n_tiles;         // key tiles t_hi - n_tiles .. t_hi - 1 are visited, the last first
  };
  auto item = [&](int64_t w) {
    Item x;
    const int64_t bh = w % bh_count;
    x.b = static_cast<int>(bh / p.heads_q), x.h = static_cast<int>(bh % p.heads_q);
    x.hk = x.h / static_cast<int>(p.heads_q / p.heads_kv);
    x.q0 = static_cast<int>((n_qt - 1 - w / bh_count) * kBr);
    if constexpr (V) {
      const Sequence seq = sequence(p, x.b);
      x.qb = static_cast<int>(seq.q_begin), x.kb = static_cast<int>(seq.k_begin);
      x.sq = static_cast<int>(seq.seq_q), x.skv = static_cast<int>(seq.seq_kv), x.mb = 0;
    } else {
      x.qb = x.kb = 0, x.sq = static_cast<int>(p.seq_q), x.skv = static_cast<int>(p.seq_kv), x.mb = x.b;
    }
    x.off = x.skv - x.sq;
    if (x.q0 >= x.sq) {
      x.n_tiles = -1;
      return x;
    }
    const int pos_hi = min(x.q0 + kBr, x.sq) - 1 + x.off;
    x.t_hi = p.causal ? (pos_hi < 0 ? 0 : pos_hi / kBc + 1) : (x.skv + kBc - 1) / kBc;
    // A sliding window: no row sees a key below the first row's position - window + 1.
    const int t_lo = p.window > 0 ? static_cast<int>(max(int64_t{0}, x.q0 + x.off - p.window + 1) / kBc) : 0;
    x.n_tiles = max(0, x.t_hi - t_lo);
    return x;
  };

  const int64_t G = gridDim.x;
  auto item_of_round = [&](int64_t r) { return r * G + ((r & 1) ? G - 1 - blockIdx.x : blockIdx.x); };

  if (tid == 0) {
    mbar_init(qfull, 1), mbar_init(qempty, 4 * NW);
    for (int s = 0; s < kSK; ++s) mbar_init(kfull(s), 1), mbar_init(kempty(s), 4 * NW);  // every consumer warp arrives
    for (int s = 0; s < kSV; ++s) mbar_init(vfull(s), 1), mbar_init(vempty(s), 4 * NW);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  // Launched with programmatic dependent launch: the set-up above may overlap the kernel before;
  // every read of q, k, v and every write comes after that kernel has finished.
  kernel::cuda::griddep_wait();

  if (tid < 128) {
    // Producer: one thread issues every copy; the warpgroup keeps few registers.
    asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n" ::: "memory");
    if (tid == 0) {
      asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&tq)) : "memory");
      asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&tk)) : "memory");
      asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&tv)) : "memory");
      int kc = 0, vc = 0, i = 0;  // K and V tiles loaded, items loaded (ring and Q phases)
      for (int64_t r = 0, w = item_of_round(0); w < n_items; w = item_of_round(++r)) {
        const Item x = item(w);
        if (V && x.n_tiles <= 0) continue;
        const int hk = x.hk, b = x.mb;
        mbar_wait(qempty, (i & 1) ^ 1);
        mbar_expect_tx(qfull, C::kQBytes);
#pragma unroll
        for (int c = 0; c < kCols; ++c)
          tma_load(sQ + c * kBr * 128, &tq, qfull, c * 64, x.qb + x.q0, x.h, b);
        // K of tile it, then V of tile it - 1 (the consumers need them in that order): a K load never
        // waits behind the release of a V slot.
        auto load = [&](const CUtensorMap* map, uint32_t ring, int stages, uint32_t full, uint32_t empty, int n, int count) {
          const int st = count % stages;
          mbar_wait(empty, ((count / stages) & 1) ^ 1);
          mbar_expect_tx(full, C::kKVBytes);
#pragma unroll
          for (int c = 0; c < kCols; ++c)
            tma_load(ring + st * C::kKVBytes + c * kBc * 128, map, full, c * 64, x.kb + n * kBc, hk, b);
        };
        for (int it = 0; it <= x.n_tiles; ++it) {
          if (it < x.n_tiles) load(&tk, sK, kSK, kfull(kc % kSK), kempty(kc % kSK), x.t_hi - 1 - it, kc), ++kc;
          if (it > 0) load(&tv, sV, kSV, vfull(vc % kSV), vempty(vc % kSV), x.t_hi - it, vc), ++vc;
        }
        ++i;
      }
    }
    return;
  }

  // Consumers.
  // The registers the producer gave up: 128 (24 + NW R) <= 65536.
  if constexpr (NW == 2)
    asm volatile("setmaxnreg.inc.sync.aligned.u32 240;\n" ::: "memory");
  else
    asm volatile("setmaxnreg.inc.sync.aligned.u32 160;\n" ::: "memory");
  const int cw = tid / 128 - 1, tw = tid % 128, lane = tid % 32, warp = tw / 32, g = lane / 4, t = lane % 4;
  // Soft-capping: the scores become tanh(scale q.k / c) in [-1, 1], and c log2(e) takes the place of
  // scale log2(e) in the exponent (both positive: the softmax takes the maximum before the factor).
  const bool cap = p.softcap > 0.0f;
  const float t_scale = cap ? p.scale / p.softcap : 0.0f, sl2 = (cap ? p.softcap : p.scale) * kLog2e;
  const uint32_t q_base = sQ + cw * 64 * 128;
  const uint32_t o_base = sO + cw * (C::kQBytes / NW);  // this warpgroup's [D / 64][64][64] staging tile

  float o[kNO], s[kNS];
  uint32_t pf[kBc / 16][4];  // P as the A operand of k-steps of 16 keys
  float mx[2], l[2];         // running maximum (scaled, base 2), the thread's part of the row sum

  // The operands' descriptors, stepped by desc_at: this warpgroup's Q rows, ring slot 0's K (K-major) and V (MN-major).
  const uint64_t q_desc = desc(q_base, 16, 1024), k_desc = desc(sK, 16, 1024), v_desc = desc(sV, kBc * 128, 1024);
  // With two consumer warpgroups at head dims 64 and 128 (kQRegs), the warpgroup's Q rows are held in
  // registers as A fragments for the item (16 or 32 registers), so that Q K^T reads only K from shared
  // memory: there, a tile's products and its copies move about 112 bytes of shared memory a cycle
  // against the 128 it serves (bench/RESULTS.md), Q's reads a third of the score product's.  Three
  // warpgroups have no registers to spare, nor has the varlen kernel at head dim 128 (ptxas spills).
  constexpr bool kQRegs = NW == 2 && (D == 64 || (D == 128 && !V));
  uint32_t qf[kQRegs ? D / 16 : 1][4];
  auto qk = [&](int st) {  // s = Q K^T for ring slot st (issued, not waited for)
    const uint64_t k_st = desc_at(k_desc, st * C::kKVBytes);
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      if constexpr (kQRegs)
        wgmma_rs_kb<T, kBc>(s, qf[kk], desc_at(k_st, (kk / 4) * kBc * 128 + (kk % 4) * 32), kk > 0);
      else
        wgmma_ss<T, kBc>(s, desc_at(q_desc, (kk / 4) * kBr * 128 + (kk % 4) * 32), desc_at(k_st, (kk / 4) * kBc * 128 + (kk % 4) * 32),
                         kk > 0);
    }
  };
  auto pv = [&](int st) {  // o += P V for ring slot st
    const uint64_t v_st = desc_at(v_desc, st * C::kKVBytes);
#pragma unroll
    for (int kk = 0; kk < kBc / 16; ++kk) wgmma_rs<T, D>(o, pf[kk], desc_at(v_st, kk * 16 * 128));
  };
  // The online softmax of the tile of keys from j0: s becomes the probabilities (f32, relative to the
  // new maximum), corr the factor that rescales what was accumulated before.
  // Positions and key indices are 32-bit: 64-bit ones held through the loop took registers that three
  // warpgroups do not have.  attention_sm90_unsupported bounds every count below 2^31 - 256; a query's
  // position pos0 (its row + skv - sq) may be negative, but under causal every visited key tile starts
  // at most a tile of queries after it, so min(skv, pos0 + 9) - j0 stays small; the window's first
  // visible key, pos0 + 1 - window, is taken once an item in 64 bits and floored at -16 (below -8 it
  // hides no key of either row r), first_key below.
  auto softmax = [&](int j0, int pos0, int first_key, int skv, bool masked, float (&corr)[2]) {
    if (cap) cap_scores(s, t_scale);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      if (masked) {
        // Column c = 8 i + e of the tile (key j0 + c + 2 t) is visible when first <= c < limit.
        const int lim = min(skv, p.causal ? pos0 + 8 * r + 1 : skv) - j0 - 2 * t;
        const int limit = max(-1, min(kBc, lim));
        const int fst = p.window > 0 ? first_key + 8 * r - j0 - 2 * t : 0;
        const int first = max(0, min(kBc, fst));
#pragma unroll
        for (int i = 0; i < kBc / 8; ++i)
#pragma unroll
          for (int e = 0; e < 2; ++e)
            if (8 * i + e >= limit || 8 * i + e < first) s[4 * i + 2 * r + e] = -INFINITY;
      }
      // The maximum of the scores before the factor sl2 (> 0 on this path), then p = 2^(s sl2 - max sl2); both
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
  // The turn to issue matrix products (PP): warpgroup 0 first, then each after the one before, round
  // the NW warpgroups (named barrier 1 + w is warpgroup w's turn; 1 + NW + w its staging tile's).
  auto my_turn = [&] {
    if constexpr (PP) bar_sync(1 + cw, 256);
  };
  auto your_turn = [&](bool last) {
    if constexpr (PP)
      if (!(last && cw == NW - 1)) bar_arrive(1 + (cw + 1) % NW, 256);  // the last warpgroup's very last would be one arrival too many
  };
  // out = o / l straight from the accumulators (pairs of columns) for the rows of x's sequence, lse =
  // (max + log2 l) ln 2 (0 and -inf where l is 0: no visible key).
  auto write_direct = [&](const Item& x, int64_t row0) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float sum = l[r];
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      const int64_t row = row0 + 8 * r;
      if (row >= x.sq) continue;
      const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
      T* og = static_cast<T*>(const_cast<void*>(p.out.data)) + x.b * p.out.sb + x.h * p.out.sh + (x.qb + row) * p.out.ss;
#pragma unroll
      for (int c = 0; c < D / 8; ++c)
        *reinterpret_cast<uint32_t*>(og + 8 * c + 2 * t) = pack2<T>(o[4 * c + 2 * r] * inv, o[4 * c + 2 * r + 1] * inv);
      if (p.lse && t == 0) p.lse[lse_row(p, x.b, x.h, x.qb + row)] = sum > 0.0f ? (mx[r] + log2f(sum)) * kLn2 : -INFINITY;
    }
  };
  // Whether a round after r holds an item with tiles (the ping-pong's last hand-over is the one before
  // none is left).  Each call scans the items without tiles up to the next one with, so the scans of a
  // block cover its rounds about once.
  auto tiles_after = [&](int64_t r) {
    if constexpr (!V) {
      return item_of_round(r + 1) < n_items;  // every batched item has tiles
    } else {
      for (int64_t w = item_of_round(++r); w < n_items; w = item_of_round(++r))
        if (item(w).n_tiles > 0) return true;
      return false;
    }
  };
  if constexpr (PP)
    if (cw == NW - 1 && tiles_after(-1)) bar_arrive(1, 256);

  int kc = 0, vc = 0, i = 0;  // K and V tiles consumed, items with tiles begun
  for (int64_t r = 0, w = item_of_round(0); w < n_items; w = item_of_round(++r)) {
    const Item x = item(w);
    if (V && x.n_tiles < 0) continue;                     // no rows of this sequence
    const int64_t row0 = x.q0 + cw * 64 + warp * 16 + g;  // this thread's rows: row0 and row0 + 8
#pragma unroll
    for (int e = 0; e < kNO; ++e) o[e] = 0.0f;
    mx[0] = mx[1] = -INFINITY, l[0] = l[1] = 0.0f;
    if (V && x.n_tiles == 0) {  // rows that see no key: 0 and -inf
      write_direct(x, row0);
      continue;
    }
    const bool last_item = !tiles_after(r);
    const int pos0 = static_cast<int>(row0) + x.off, pos_wg = x.q0 + cw * 64 + x.off;
    const int first_key = static_cast<int>(max(int64_t{pos0} + 1 - p.window, int64_t{-16}));
    // The warpgroup's last row's first visible key: tiles that start below it need the window's mask.
    const int edge = static_cast<int>(max(int64_t{pos_wg} + 64 - p.window, int64_t{-1}));
    auto tile_j0 = [&](int it) { return (x.t_hi - 1 - it) * kBc; };
    // A tile needs the mask where it holds a key after the warpgroup's first row (causal), past the
    // end, or before its last row's window.
    auto tile_masked = [&](int j0) {
      return (p.causal && j0 + kBc - 1 > pos_wg) || j0 + kBc > x.skv || (p.window > 0 && j0 < edge);
    };

    mbar_wait(qfull, i & 1);
    if constexpr (kQRegs)
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) load_a_fragment(qf[kk], sQ, kBr * 128, cw * 64 + warp * 16 + g, kk, t);
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
      softmax(tile_j0(0), pos0, first_key, x.skv, tile_masked(tile_j0(0)), corr);
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
        if (it == x.n_tiles - 1) mbar_arrive(qempty);  // the item's last read of Q (or, kQRegs, after it)
      }
      float corr[2];
      const int j0 = tile_j0(it);
      softmax(j0, pos0, first_key, x.skv, tile_masked(j0), corr);
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
    ++i;

    // Straight from registers at head dim 256 (no staging tile) and for a varlen tile that ends past
    // its sequence (a bulk store would write the next sequence's rows).
    if (!C::kStaged || (V && x.q0 + cw * 64 + 64 > x.sq)) {
      write_direct(x, row0);
      continue;
    }
    // out = o / l through the staging tile (same swizzle as the loads: a conflict-free scatter) and
    // one bulk tensor store a 64-column block; lse = (max + log2 l) ln 2.
    if (tw == 0) bulk_wait_read();  // the previous item's store has read the staging tile
    bar_sync(1 + NW + cw, 128);
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
      if (p.lse && t == 0 && row < x.sq)
        p.lse[lse_row(p, x.b, x.h, x.qb + row)] = sum > 0.0f ? (mx[r] + log2f(sum)) * kLn2 : -INFINITY;
    }
    fence_async_smem();
    bar_sync(1 + NW + cw, 128);
    if (tw == 0) {
#pragma unroll
      for (int c = 0; c < kCols; ++c)
        tma_store(&to, o_base + c * 64 * 128, c * 64, x.qb + x.q0 + cw * 64, x.h, x.mb);
      bulk_commit();
    }
  }
  if (C::kStaged && tw == 0) bulk_wait();
#endif
}

// ---- host ------------------------------------------------------------------------------------------


template <typename T, int D, bool PP, bool V, int NW = 2>
const char* launch(const AttentionParams& p, cudaStream_t stream) {
  using C = Tile<D, NW>;
  constexpr int kBr = C::kBr;
  // Varlen: the maps span the packed tokens, one "batch".  Varlen without keys (no key tokens, or
  // max_seqlen_k 0) gives every item no tiles: no K / V map exists to be made, none is read.
  const int64_t nq = p.varlen() ? p.total_q : p.seq_q, nk = p.varlen() ? p.total_kv : p.seq_kv, nb = p.varlen() ? 1 : p.batch;
  const bool no_keys = nk == 0 || p.seq_kv == 0;
  CUtensorMap tq, tk, tv, to;
  if (!make_map(&tq, p.q, p.dtype, D, nq, p.heads_q, nb, kBr) || !make_map(&to, p.out, p.dtype, D, nq, p.heads_q, nb, 64) ||
      (!no_keys && (!make_map(&tk, p.k, p.dtype, D, nk, p.heads_kv, nb, C::kBc) ||
                    !make_map(&tv, p.v, p.dtype, D, nk, p.heads_kv, nb, C::kBc))))
    return "attention_forward (hopper): the driver refused a tensor map of these strides "
           "(KCPP_FLASH_ATTN_FORWARD=ampere takes the mma.sync kernel instead)";
  if (no_keys) tk = tv = tq;  // never read
  const cudaError_t attr = cudaFuncSetAttribute(fwd_sm90_kernel<T, D, PP, V, NW>, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmem);
  if (attr != cudaSuccess)
    return kernel::errorf("attention_forward (hopper): cannot reserve %d bytes of shared memory: %s", C::kSmem,
                          cudaGetErrorString(attr));
  // Persistent: a block an SM, each looping over the work items.
  const int64_t items = (p.seq_q + kBr - 1) / kBr * p.batch * p.heads_q;
  const auto grid = static_cast<unsigned>(std::min<int64_t>(items, sm_count()));
  // A programmatic dependent of the kernel before (the kernel's barrier set-up overlaps its end);
  // KCPP_PDL=0, the library's switch for every such launch, makes it an ordinary one.
  const cudaLaunchAttribute pdl = kernel::cuda::dependent_launch();
  const cudaError_t e = kernel::cuda::launch_ex(&pdl, kernel::cuda::dependent_launch_enabled() ? 1 : 0, fwd_sm90_kernel<T, D, PP, V, NW>,
                                                dim3(grid), dim3(128 * (NW + 1)),
                                                C::kSmem, stream, p, tq, tk, tv, to);
  return e == cudaSuccess ? nullptr : kernel::errorf("attention_forward (hopper): kernel launch failed: %s", cudaGetErrorString(e));
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
  if (!(p.scale > 0.0f)) return "scale is not positive";
  for (const Operand* o : {&p.q, &p.k, &p.v, &p.out})  // the tensor maps' 16-byte rule
    if ((reinterpret_cast<uintptr_t>(o->data) & 15u) != 0 || o->sb % 8 != 0 || o->sh % 8 != 0 || o->ss % 8 != 0)
      return "a pointer or a stride is not a multiple of 16 bytes";
  constexpr int64_t kMaxRows = (int64_t{1} << 31) - 256;  // the tensor maps' 32-bit row coordinates
  if (p.seq_q > kMaxRows || p.seq_kv > kMaxRows || p.total_q > kMaxRows || p.total_kv > kMaxRows ||
      p.batch * p.heads_q > 0x7fffffff)
    return "a dimension is beyond the tensor map's 32-bit coordinates";
  if (!encode_fn()) return "the driver has no cuTensorMapEncodeTiled";
  return nullptr;
#endif
}

const char* attention_forward_sm90(const AttentionParams& p, cudaStream_t stream) {
  if (p.batch == 0 || p.seq_q == 0) return nullptr;
  const bool bf = p.dtype == DType::bf16;
  // KCPP_FLASH_ATTN_SM90_PINGPONG=0 turns the ping-pong off (for measuring what it gives; batched only).
  const char* pp_env = std::getenv("KCPP_FLASH_ATTN_SM90_PINGPONG");
  const bool pp = !(pp_env && std::strcmp(pp_env, "0") == 0);
  if (p.varlen()) {  // always in ping-pong
    if (p.head_dim == 64) return bf ? launch<__nv_bfloat16, 64, true, true>(p, stream) : launch<__half, 64, true, true>(p, stream);
    if (p.head_dim == 256) return bf ? launch<__nv_bfloat16, 256, true, true>(p, stream) : launch<__half, 256, true, true>(p, stream);
    return bf ? launch<__nv_bfloat16, 128, true, true>(p, stream) : launch<__half, 128, true, true>(p, stream);
  }
  if (p.head_dim == 64) {
    // Three consumer warpgroups (192-query items) from 2,048 queries on: measured faster at 4,096 and
    // 8,192, slower at 1,024, where a 192-query tiling wastes more of its last tile and leaves fewer
    // items to balance (2,048 itself unmeasured).  KCPP_FLASH_ATTN_SM90_FWD_WGS = 2 | 3 pins it (with
    // the ping-pong; without it, KCPP_FLASH_ATTN_SM90_PINGPONG=0, two warpgroups run).
    const char* wgs = std::getenv("KCPP_FLASH_ATTN_SM90_FWD_WGS");
    const bool three = wgs && *wgs ? std::strcmp(wgs, "3") == 0 : p.seq_q >= 2048;
    if (pp && three)
      return bf ? launch<__nv_bfloat16, 64, true, false, 3>(p, stream) : launch<__half, 64, true, false, 3>(p, stream);
    if (pp) return bf ? launch<__nv_bfloat16, 64, true, false>(p, stream) : launch<__half, 64, true, false>(p, stream);
    return bf ? launch<__nv_bfloat16, 64, false, false>(p, stream) : launch<__half, 64, false, false>(p, stream);
  }
  if (p.head_dim == 256) {
    if (pp) return bf ? launch<__nv_bfloat16, 256, true, false>(p, stream) : launch<__half, 256, true, false>(p, stream);
    return bf ? launch<__nv_bfloat16, 256, false, false>(p, stream) : launch<__half, 256, false, false>(p, stream);
  }
  if (pp) return bf ? launch<__nv_bfloat16, 128, true, false>(p, stream) : launch<__half, 128, true, false>(p, stream);
  return bf ? launch<__nv_bfloat16, 128, false, false>(p, stream) : launch<__half, 128, false, false>(p, stream);
}

}  // namespace kcpp::flash
