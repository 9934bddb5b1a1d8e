// Building blocks of the Hopper (sm_90a) attention kernels, forward (attention_sm90.cu) and backward
// (attention_sm90_bwd.cu, attention_sm90_bwd256.cu): the generic ones (mbarriers, TMA, wgmma, device
// queries) are kcpp/kernel/sm90.cuh's; this adds the tensor maps over attention's operands and the
// backward's block order, producer and dq reductions.  See attention_sm90.cu's
// head comment for the swizzle, the descriptor strides and the fragment layouts.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "attention.h"
#include "kcpp/kernel/cuda.cuh"
#include "kcpp/kernel/error.h"
#include "kcpp/kernel/fast_math.h"
#include "softcap.cuh"
#include "kcpp/kernel/sm90.cuh"

namespace kcpp::flash {
namespace {

using kernel::DType;
using namespace kernel::sm90;

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

// ---- the backward's shared pieces (attention_sm90_bwd.cu at head dims 64 / 128, attention_sm90_bwd256.cu at 256)

// The f32 dq accumulator, [B Hq, Sq, D] (varlen [Hq, total_q, D]: lse_row's numbering), as a 3-d tensor
// map of boxes of 32 columns x 64 rows, 128-byte swizzle, for bulk tensor reductions.  False when the
// driver refuses it.
inline bool make_dq_map(CUtensorMap* map, const AttentionParams& p, float* dq_acc) {
  const auto fn = encode_fn();
  if (!fn) return false;
  const bool varlen = p.varlen();
  const int64_t nq = varlen ? p.total_q : p.seq_q, planes = varlen ? p.heads_q : p.batch * p.heads_q, d = p.head_dim;
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(d), static_cast<cuuint64_t>(nq), static_cast<cuuint64_t>(planes)};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(d) * 4, static_cast<cuuint64_t>(nq * d) * 4};
  const cuuint32_t box[3] = {32, 64, 1}, estr[3] = {1, 1, 1};
  return fn(map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 3, dq_acc, dims, strides, box, estr, CU_TENSOR_MAP_INTERLEAVE_NONE,
            CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// The backward's tensor maps: Q and dO in boxes of bq rows, K and V of bk rows (varlen: over the packed
// tokens, one "batch"), and the dq accumulator's (make_dq_map).  Null, or why the driver refused one.
inline const char* backward_maps(const AttentionParams& p, float* dq_acc, int bk, int bq, CUtensorMap* tq, CUtensorMap* tdo,
                                 CUtensorMap* tk, CUtensorMap* tv, CUtensorMap* tdq) {
  const bool varlen = p.varlen();
  const int64_t nq = varlen ? p.total_q : p.seq_q, nk = varlen ? p.total_kv : p.seq_kv, nb = varlen ? 1 : p.batch, d = p.head_dim;
  if (!make_map(tq, p.q, p.dtype, d, nq, p.heads_q, nb, bq) || !make_map(tdo, p.dout, p.dtype, d, nq, p.heads_q, nb, bq) ||
      !make_map(tk, p.k, p.dtype, d, nk, p.heads_kv, nb, bk) || !make_map(tv, p.v, p.dtype, d, nk, p.heads_kv, nb, bk))
    return "attention_backward (hopper): the driver refused a tensor map of these strides "
           "(KCPP_FLASH_ATTN_BACKWARD=ampere takes the mma.sync kernel at head dims 64 and 128, =generic the generic one)";
  if (!make_dq_map(tdq, p, dq_acc)) return "attention_backward (hopper): the driver refused the tensor map of the dq accumulator";
  return nullptr;
}

// The order of the backward's blocks: the group of kv heads whose blocks run first key block first (0:
// each head's blocks together, the last key block first), for blocks of `block_keys` keys.  Each head's
// blocks together lets the blocks that run at once share their Q / dO tiles in L2; every head's first
// key blocks first (a group of all heads) starts the longest causal blocks first and ends the grid on
// short ones, but spreads the blocks that run at once over every head.  Groups of about a wave of blocks
// (the default) keep most of both, of a size that divides the heads where one lies within a factor of
// two below a wave: a short last group starts its longest blocks near the end of the grid.  On an H200
// at B2 S8192 (16 heads, head dim 128) groups of 5 heads (5, 5, 5, 1) ran fwd+bwd at 460.7 TFLOP/s, of 2
// or 4 at 496.7 / 493.2, all in one group at 476.9 (bench/RESULTS.md, 2026-11-27, twelfth session).
// Where no such divisor exists, the groups are as even as groups of one size get (13 heads in fours:
// 4, 4, 4, 1).  KCPP_FLASH_ATTN_SM90_BWD_ORDER = keys | heads | grouped pins one, a number N groups of
// N heads (for measuring).
inline int backward_head_group(const AttentionParams& p, int block_keys) {
  const int64_t key_blocks = std::max<int64_t>((p.seq_kv + block_keys - 1) / block_keys, 1), heads = p.batch * p.heads_kv;
  const int64_t per_wave = std::clamp<int64_t>((sm_count() + key_blocks / 2) / key_blocks, 1, heads);
  int64_t size = 0;
  for (int64_t c = per_wave; c >= std::max<int64_t>(1, per_wave / 2) && size == 0; --c)
    if (heads % c == 0) size = c;
  if (size == 0) {
    const int64_t groups = (heads + per_wave - 1) / per_wave;
    size = (heads + groups - 1) / groups;
  }
  const auto grouped = static_cast<int>(size);
  const char* order = std::getenv("KCPP_FLASH_ATTN_SM90_BWD_ORDER");
  if (order && std::strcmp(order, "heads") == 0) return static_cast<int>(heads);
  if (order && std::strcmp(order, "keys") == 0 && heads <= 65535) return 0;  // its grid (key blocks, B Hkv)
  if (order && order[0] >= '1' && order[0] <= '9') return static_cast<int>(std::clamp<int64_t>(std::atoll(order), 1, heads));
  return grouped;
}

// The grid of backward_head_group's order: (key blocks, B Hkv) for group 0, else one dimension.
inline dim3 backward_grid(const AttentionParams& p, int block_keys, int head_group) {
  const auto key_blocks = static_cast<unsigned>((p.seq_kv + block_keys - 1) / block_keys), bh = static_cast<unsigned>(p.batch * p.heads_kv);
  return head_group == 0 ? dim3(key_blocks, bh) : dim3(key_blocks * bh);
}

// One block of the backward: BK keys from k0 of kv head hk of sequence b, and the items it loops over,
// the (query head, query tile of BQ) pairs whose queries see a key of the block: query heads of the kv
// head's group, each over the tiles m_begin .. m_begin + tiles - 1.
struct BwdBlock {
  int64_t b, hk, k0, sq, skv, off, group, m_begin, tiles;
  int mb, kb, qb;  // the tensor maps' batch coordinate (0 under varlen) and the sequence's first key / query
  int n_items;
  __device__ __forceinline__ int64_t item_h(int it) const { return hk * group + it / tiles; }
  __device__ __forceinline__ int64_t item_q0(int it, int bq) const { return (m_begin + it % tiles) * bq; }
};

// The block that this CTA takes in backward_head_group's order; false when it lies past its sequence's
// keys (varlen), which the caller returns on before any barrier.  The queries that see a key of the
// block run from the first whose position reaches k0 (causal) to the last whose window still holds the
// block's last key.
template <int BK, int BQ>
__device__ __forceinline__ bool backward_block(const AttentionParams& p, int head_group, BwdBlock& k) {
  int64_t bh, kblk;
  if (head_group == 0) {
    bh = blockIdx.y, kblk = gridDim.x - 1 - blockIdx.x;
  } else {  // groups of head_group heads, each group's blocks first key block first, heads fastest within it
    const int64_t heads = p.batch * p.heads_kv, blocks = (p.seq_kv + BK - 1) / BK, per = head_group * blocks;
    const int64_t gi = blockIdx.x / per, r = blockIdx.x - gi * per;
    const int64_t in_group = min(static_cast<int64_t>(head_group), heads - gi * head_group);
    kblk = r / in_group, bh = gi * head_group + r % in_group;
  }
  k.group = p.heads_q / p.heads_kv, k.b = bh / p.heads_kv, k.hk = bh % p.heads_kv;
  const Sequence seq = sequence(p, k.b);
  k.sq = seq.seq_q, k.skv = seq.seq_kv, k.off = k.skv - k.sq, k.k0 = kblk * BK;
  if (k.k0 >= k.skv) return false;
  k.mb = p.varlen() ? 0 : static_cast<int>(k.b);
  k.kb = static_cast<int>(seq.k_begin), k.qb = static_cast<int>(seq.q_begin);
  const int64_t i_lo = p.causal ? max(int64_t{0}, k.k0 - k.off) : 0;
  const int64_t i_end = p.window > 0 ? min(k.sq, min(k.k0 + BK, k.skv) - 1 + p.window - k.off) : k.sq;
  k.m_begin = i_lo / BQ;
  const int64_t m_end = i_lo < i_end ? (i_end + BQ - 1) / BQ : k.m_begin;
  k.tiles = m_end - k.m_begin;
  k.n_items = static_cast<int>(k.group * k.tiles);
  return true;
}

// A consumer warpgroup's dK (times the scale) and dV at the end of a block: N columns from col0 of the
// thread's keys key0 and key0 + 8 (the m64nN accumulator layout, t the thread's index in its quad),
// keys past the sequence's end skipped.
template <typename T, int N>
__device__ __forceinline__ void store_dkdv(const AttentionParams& p, const BwdBlock& k, int64_t key0, int col0, int t,
                                           const float (&dk)[N / 2], const float (&dv)[N / 2]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t key = key0 + 8 * r;
    if (key >= k.skv) continue;
    T* kg = static_cast<T*>(const_cast<void*>(p.dk.data)) + k.b * p.dk.sb + k.hk * p.dk.sh + (k.kb + key) * p.dk.ss + col0;
    T* vg = static_cast<T*>(const_cast<void*>(p.dv.data)) + k.b * p.dv.sb + k.hk * p.dv.sh + (k.kb + key) * p.dv.ss + col0;
#pragma unroll
    for (int c = 0; c < N / 8; ++c) {
      *reinterpret_cast<uint32_t*>(kg + 8 * c + 2 * t) = pack2<T>(dk[4 * c + 2 * r] * p.scale, dk[4 * c + 2 * r + 1] * p.scale);
      *reinterpret_cast<uint32_t*>(vg + 8 * c + 2 * t) = pack2<T>(dv[4 * c + 2 * r], dv[4 * c + 2 * r + 1]);
    }
  }
}

#if KCPP_SM90_DEVICE || !defined(__CUDA_ARCH__)
// Adds box {32, 64, 1} of f32 from shared `src` into a 3-d tensor map at (c0, c1, c2); rows past the
// tensor's end are left alone.  A bulk async-group of the issuing thread.
__device__ __forceinline__ void tma_reduce_add(const CUtensorMap* map, uint32_t src, int c0, int c1, int c2) {
  asm volatile("cp.reduce.async.bulk.tensor.3d.global.shared::cta.add.tile.bulk_group [%0, {%2, %3, %4}], [%1];\n" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(src), "r"(c0), "r"(c1), "r"(c2)
               : "memory");
}

// Thread 64 of the producer warpgroup, where the consumers hand it their dQ tiles (attention_sm90_bwd.cu
// at head dim 64): each item's tile (BQ rows x D f32 in shared memory at sDQ, D / 32 column blocks of
// [BQ rows][32 columns], 128-byte swizzle) added into the accumulator once the consumers' 8 warps arrive
// on dq_full, and dq_empty arrived once the copy engine has read it.
template <int D, int BQ>
__device__ __forceinline__ void backward_dq_reducer(const AttentionParams& p, const BwdBlock& k, const CUtensorMap* tdq, uint32_t sDQ,
                                                    uint32_t dq_full, uint32_t dq_empty) {
  const bool varlen = p.varlen();
  // The items' (plane, tile) by steps (item_h / item_q0 without their divisions): the group's heads in
  // turn, each over tiles m_begin .. m_begin + tiles - 1.
  int plane = static_cast<int>((varlen ? 0 : k.b * p.heads_q) + k.hk * k.group), m = static_cast<int>(k.m_begin);
  const int m_last = static_cast<int>(k.m_begin + k.tiles - 1), qb = varlen ? k.qb : 0;
  for (int it = 0; it < k.n_items; ++it) {
    mbar_wait(dq_full, it & 1);
#pragma unroll
    for (int r = 0; r < BQ / 64; ++r)
#pragma unroll
      for (int j = 0; j < D / 32; ++j) tma_reduce_add(tdq, sDQ + j * (BQ * 128) + r * (64 * 128), 32 * j, qb + m * BQ + 64 * r, plane);
    bulk_commit();
    bulk_wait_read();
    mbar_arrive(dq_empty);
    if (m == m_last) m = static_cast<int>(k.m_begin), ++plane;
    else ++m;
  }
  bulk_wait();
}

// The backward's dS^T = P^T o (dP^T - delta), in place over dp, on NI groups of 8 columns of m64nN
// accumulator fragments (element 4 i + 2 r + e: key row g + 8 r, query column 8 i + 2 t + e);
// delta(i, e) is that column's delta.
template <int NI, typename Delta>
__device__ __forceinline__ void backward_ds(const float (&s)[4 * NI], float (&dp)[4 * NI], Delta delta) {
#pragma unroll
  for (int i = 0; i < NI; ++i)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const float dl = delta(i, e);
#pragma unroll
      for (int r = 0; r < 2; ++r) dp[4 * i + 2 * r + e] = s[4 * i + 2 * r + e] * (dp[4 * i + 2 * r + e] - dl);
    }
}

// The same with soft-capping, P^T with it: s holds u = tanh(scale q.k / c) (cap_scores) and becomes
// P^T = 2^(u sl2 - lse2(i, e)), 0 where masked and hidden(i, e, r); dp becomes dS^T = P^T o (dP^T -
// delta) o (1 - u^2), the cap's slope.
template <int NI, typename Lse, typename Delta, typename Hidden>
__device__ __forceinline__ void backward_capped_p_ds(float (&s)[4 * NI], float (&dp)[4 * NI], float sl2, bool masked, Lse lse2,
                                                     Delta delta, Hidden hidden) {
#pragma unroll
  for (int i = 0; i < NI; ++i)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const float dl = delta(i, e);
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int x = 4 * i + 2 * r + e;
        const float u = s[x];
        float pr = ex2(fmaf(u, sl2, -lse2(i, e)));
        if (masked && hidden(i, e, r)) pr = 0.0f;
        s[x] = pr;
        dp[x] = pr * (dp[x] - dl) * fmaf(-u, u, 1.0f);
      }
    }
}

// The backward's producer warpgroup (thread index tid < 128).  Thread 0 issues the copies of the block's
// K and V (boxes of 64 columns, completing kvfull) and of each item's Q and dO tiles into a ring of
// Stages slots (slot s: Q at sQ + 2 s Q bytes, dO after it; "full" barrier full0 + 8 s, "empty" empty0
// + 8 s).  Warp 1 writes each slot's lse (base 2; +inf where the row sees no key or lies past the end,
// so that its probabilities are 0) and delta into s_stats, [slot][lse | delta][BQ], and arrives on the
// same "full" barrier.
template <int D, int BK, int BQ, int Stages>
__device__ __forceinline__ void backward_producer(const AttentionParams& p, const BwdBlock& k, const float* __restrict__ delta, int tid,
                                                  const CUtensorMap* tq, const CUtensorMap* tdo, const CUtensorMap* tk,
                                                  const CUtensorMap* tv, uint32_t sK, uint32_t sV, uint32_t sQ, float* s_stats,
                                                  uint32_t kvfull, uint32_t full0, uint32_t empty0) {
  constexpr int kKVBytes = BK * D * 2, kQBytes = BQ * D * 2;
  constexpr float kLog2e = 1.4426950408889634f;
  if (tid == 0) {
    mbar_expect_tx(kvfull, 2 * kKVBytes);
#pragma unroll
    for (int c = 0; c < D / 64; ++c) {
      tma_load(sK + c * BK * 128, tk, kvfull, c * 64, k.kb + static_cast<int>(k.k0), static_cast<int>(k.hk), k.mb);
      tma_load(sV + c * BK * 128, tv, kvfull, c * 64, k.kb + static_cast<int>(k.k0), static_cast<int>(k.hk), k.mb);
    }
    for (int it = 0; it < k.n_items; ++it) {
      const int st = it % Stages;
      mbar_wait(empty0 + 8 * st, ((it / Stages) & 1) ^ 1);
      mbar_expect_tx(full0 + 8 * st, 2 * kQBytes);
      const int h = static_cast<int>(k.item_h(it)), q0 = static_cast<int>(k.item_q0(it, BQ));
      const uint32_t q_dst = sQ + st * 2 * kQBytes;
#pragma unroll
      for (int c = 0; c < D / 64; ++c) {
        tma_load(q_dst + c * BQ * 128, tq, full0 + 8 * st, c * 64, k.qb + q0, h, k.mb);
        tma_load(q_dst + kQBytes + c * BQ * 128, tdo, full0 + 8 * st, c * 64, k.qb + q0, h, k.mb);
      }
    }
  } else if (tid >= 32 && tid < 64) {
    const int lane = tid - 32;
    for (int it = 0; it < k.n_items; ++it) {
      const int st = it % Stages;
      mbar_wait(empty0 + 8 * st, ((it / Stages) & 1) ^ 1);
      const int64_t row0 = lse_row(p, k.b, k.item_h(it), k.qb), q0 = k.item_q0(it, BQ);
      float* dst = s_stats + st * 2 * BQ;
#pragma unroll
      for (int u = 0; u < BQ / 32; ++u) {
        const int64_t i = q0 + lane + 32 * u;
        const float l = i < k.sq ? p.lse[row0 + i] : -INFINITY;
        dst[lane + 32 * u] = l == -INFINITY ? INFINITY : l * kLog2e;
        dst[BQ + lane + 32 * u] = i < k.sq ? delta[row0 + i] : 0.0f;
      }
      __syncwarp();
      if (lane == 0) mbar_arrive(full0 + 8 * st);
    }
  }
}
#endif

}  // namespace
}  // namespace kcpp::flash
