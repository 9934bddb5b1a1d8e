// RoPE on CUDA (maths in rope.h).  Two kernels:
//  - the column-group kernel (the default where it applies, see rope_groups_kernel): a thread keeps
//    one 16-byte group of the token's cos and sin in registers and rotates that group in up to 4
//    (token, head) rows, all its loads issued before the first use;
//  - the token kernel (element access, a tail past rotary_dim to copy out of place, and the
//    configurations of rope_tuning.h that ask for it): one block per token at a time, blocks
//    striding over tokens; the token's cos and sin rows are staged in shared memory, then the block's
//    threads share out the token's items: for every head of q and k, groups of VEC pairs
//    (RotateHalf: elements j.. and j+rd/2..; Interleaved: VEC consecutive elements = VEC/2 pairs).
// Each item is read completely before it is written, so out == in is safe.
#include "kcpp/kernel/cuda.cuh"
#include "rope.h"
#include "rope_tuning.h"

namespace kcpp::liger {
namespace {

using namespace kcpp::kernel::cuda;

template <typename T, int N, bool VECTOR> __device__ __forceinline__ void load(const T* p, float (&out)[N]) {
  if constexpr (VECTOR) {
    load_f32(p, out);
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = to_f32(p[i]);
  }
}
template <typename T, int N, bool VECTOR> __device__ __forceinline__ void store(T* p, const float (&v)[N]) {
  if constexpr (VECTOR) {
    store_f32(p, v);
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) p[i] = from_f32<T>(v[i]);
  }
}

// One pair: (a, b) at positions (p, q) with their cos / sin.
template <bool BWD>
__device__ __forceinline__ void rotate(float a, float b, float cp, float cq, float sp, float sq, float& ya, float& yb) {
  if constexpr (BWD) {
    ya = a * cp + b * sq;
    yb = b * cq - a * sp;
  } else {
    ya = a * cp - b * sp;
    yb = b * cq + a * sq;
  }
}

// VEC: elements per access (RotateHalf: pairs per item; Interleaved: elements per item, even).
template <typename T, int VEC, bool VECTOR, bool IL, bool BWD>
__global__ void __launch_bounds__(256) rope_kernel(const __grid_constant__ RopeParams p) {
  // Item indices are 32-bit (heads x head_dim per token is small; rope_check bounds it).
  const int rd = static_cast<int>(p.rotary_dim), half = rd / 2, d = static_cast<int>(p.head_dim);
  const int per_head = IL ? rd / VEC : half / VEC;
  const int heads = static_cast<int>(p.q.heads + p.k.heads);
  const int items = heads * per_head, tail = d - rd;
  const int64_t tokens = p.batch * p.seq;
  // The token's cos and sin rows, shared by all its heads: staged in shared memory once per token.
  extern __shared__ __align__(16) unsigned char smem[];
  T* cs = reinterpret_cast<T*>(smem);
  T* sn = cs + rd;
  for (int64_t t = blockIdx.x; t < tokens; t += gridDim.x) {
    const int64_t b = t / p.seq, s = t % p.seq;
    const T* gc = static_cast<const T*>(p.cos) + b * p.cs_stride_b + s * p.cs_stride_s;  // [rd]
    const T* gs = static_cast<const T*>(p.sin) + b * p.cs_stride_b + s * p.cs_stride_s;
    __syncthreads();  // the previous token's rows are no longer read
    for (int e = threadIdx.x; e < rd; e += blockDim.x) {
      cs[e] = gc[e];
      sn[e] = gs[e];
    }
    __syncthreads();
    for (int it = threadIdx.x; it < items; it += blockDim.x) {
      const int h = it / per_head, i = it % per_head;
      const RopeOperand& op = h < p.q.heads ? p.q : p.k;
      const int64_t hh = h < p.q.heads ? h : h - p.q.heads;
      const T* in = static_cast<const T*>(op.in) + b * op.in_stride_b + s * op.in_stride_s + hh * op.in_stride_h;
      T* out = static_cast<T*>(op.out) + b * op.out_stride_b + s * op.out_stride_s + hh * op.out_stride_h;
      if constexpr (IL) {
        const int64_t e = i * VEC;
        float x[VEC], c[VEC], sv[VEC], y[VEC];
        load<T, VEC, VECTOR>(in + e, x);
        load<T, VEC, VECTOR>(cs + e, c);
        load<T, VEC, VECTOR>(sn + e, sv);
#pragma unroll
        for (int k = 0; k < VEC; k += 2) rotate<BWD>(x[k], x[k + 1], c[k], c[k + 1], sv[k], sv[k + 1], y[k], y[k + 1]);
        store<T, VEC, VECTOR>(out + e, y);
      } else {
        const int64_t j = i * VEC;
        float a[VEC], bq[VEC], cp[VEC], cq[VEC], sp[VEC], sq[VEC], ya[VEC], yb[VEC];
        load<T, VEC, VECTOR>(in + j, a);
        load<T, VEC, VECTOR>(in + j + half, bq);
        load<T, VEC, VECTOR>(cs + j, cp);
        load<T, VEC, VECTOR>(cs + j + half, cq);
        load<T, VEC, VECTOR>(sn + j, sp);
        load<T, VEC, VECTOR>(sn + j + half, sq);
#pragma unroll
        for (int k = 0; k < VEC; ++k) rotate<BWD>(a[k], bq[k], cp[k], cq[k], sp[k], sq[k], ya[k], yb[k]);
        store<T, VEC, VECTOR>(out + j, ya);
        store<T, VEC, VECTOR>(out + j + half, yb);
      }
    }
    // Out of place with rd < head_dim: the rest of each head is copied.
    if (tail > 0) {
      for (int it = threadIdx.x; it < heads * tail; it += blockDim.x) {
        const int h = it / tail;
        const int64_t e = rd + it % tail;
        const RopeOperand& op = h < p.q.heads ? p.q : p.k;
        if (op.out == op.in) continue;
        const int64_t hh = h < p.q.heads ? h : h - p.q.heads;
        static_cast<T*>(op.out)[b * op.out_stride_b + s * op.out_stride_s + hh * op.out_stride_h + e] =
            static_cast<const T*>(op.in)[b * op.in_stride_b + s * op.in_stride_s + hh * op.in_stride_h + e];
      }
    }
  }
}

// The column-group kernel.  Thread (r, j) of a block takes column group j of the rotary dimension
// (VEC pairs: elements j VEC.. and j VEC + rd/2.., or VEC interleaved elements) in HEADS (token,
// head) rows; its cos and sin vectors are loaded once, from global memory (L1 / L2), and every load
// of the thread (cos, sin and all its rows) is issued before the first use: one memory latency a
// block, no shared memory, no barrier.  With R = threads / groups a head has, a block covers
//  - HEADS_ADJACENT: one token, heads (c HEADS + i) R + r, so a warp reads neighbouring heads (the
//    contiguous run of a token in [B, S, H, D]);
//  - else: tokens c R + r, heads c' HEADS + i, so a warp reads neighbouring tokens of one head (the
//    contiguous run of a head in HF's [B, H, S, D]); cos and sin are then per thread, reused for
//    HEADS heads.
// Blocks take (token chunk, head chunk) pairs, head chunks fastest.  Needs vector access, threads a
// multiple of the groups a head has, and nothing to copy past rotary_dim (in place or rd = d).
template <typename T, int VEC, bool IL, bool BWD, int HEADS, bool HEADS_ADJACENT>
__global__ void __launch_bounds__(256) rope_groups_kernel(const __grid_constant__ RopeParams p, int head_chunks) {
  using V = Vec<T, VEC>;
  const int rd = static_cast<int>(p.rotary_dim), half = rd / 2;
  const int per_head = IL ? rd / VEC : half / VEC;
  const int rows = static_cast<int>(blockDim.x) / per_head;
  const int j = static_cast<int>(threadIdx.x) % per_head, r = static_cast<int>(threadIdx.x) / per_head;
  const int64_t tc = blockIdx.x / head_chunks;
  const int hc = static_cast<int>(blockIdx.x % head_chunks);
  const int64_t t = HEADS_ADJACENT ? tc : tc * rows + r;
  const int qh = static_cast<int>(p.q.heads), heads = qh + static_cast<int>(p.k.heads);
  if (t >= p.batch * p.seq) return;  // the last token chunk's spare rows (no barrier follows)
  const int64_t b = t / p.seq, s = t % p.seq;
  const int e = j * VEC;  // the group's first element (RotateHalf: of the first half)
  const T* gc = static_cast<const T*>(p.cos) + b * p.cs_stride_b + s * p.cs_stride_s;
  const T* gs = static_cast<const T*>(p.sin) + b * p.cs_stride_b + s * p.cs_stride_s;
  const V c0 = *reinterpret_cast<const V*>(gc + e), s0 = *reinterpret_cast<const V*>(gs + e);
  V c1 = c0, s1 = s0;
  if constexpr (!IL) c1 = *reinterpret_cast<const V*>(gc + e + half), s1 = *reinterpret_cast<const V*>(gs + e + half);
  V x0[HEADS], x1[HEADS];
  T* out[HEADS];
#pragma unroll
  for (int i = 0; i < HEADS; ++i) {
    const int h = HEADS_ADJACENT ? (hc * HEADS + i) * rows + r : hc * HEADS + i;
    out[i] = nullptr;
    if (h >= heads) continue;
    const RopeOperand& op = h < qh ? p.q : p.k;
    const int64_t hh = h < qh ? h : h - qh;
    const T* in = static_cast<const T*>(op.in) + b * op.in_stride_b + s * op.in_stride_s + hh * op.in_stride_h + e;
    out[i] = static_cast<T*>(op.out) + b * op.out_stride_b + s * op.out_stride_s + hh * op.out_stride_h + e;
    x0[i] = *reinterpret_cast<const V*>(in);
    if constexpr (!IL) x1[i] = *reinterpret_cast<const V*>(in + half);
  }
#pragma unroll
  for (int i = 0; i < HEADS; ++i) {
    if (!out[i]) continue;
    float a[VEC], cp[VEC], sp[VEC], ya[VEC];
    widen(x0[i], a);
    widen(c0, cp);
    widen(s0, sp);
    if constexpr (IL) {
#pragma unroll
      for (int k = 0; k < VEC; k += 2) rotate<BWD>(a[k], a[k + 1], cp[k], cp[k + 1], sp[k], sp[k + 1], ya[k], ya[k + 1]);
      store_f32(out[i], ya);
    } else {
      float bq[VEC], cq[VEC], sq[VEC], yb[VEC];
      widen(x1[i], bq);
      widen(c1, cq);
      widen(s1, sq);
#pragma unroll
      for (int k = 0; k < VEC; ++k) rotate<BWD>(a[k], bq[k], cp[k], cq[k], sp[k], sq[k], ya[k], yb[k]);
      store_f32(out[i], ya);
      store_f32(out[i] + half, yb);
    }
  }
}

bool operand_vec_ok(const RopeOperand& o, int vec) {
  if (o.heads == 0) return true;
  return aligned16(o.in) && aligned16(o.out) && o.in_stride_b % vec == 0 && o.in_stride_s % vec == 0 &&
         o.in_stride_h % vec == 0 && o.out_stride_b % vec == 0 && o.out_stride_s % vec == 0 && o.out_stride_h % vec == 0;
}

template <bool BWD> const char* run(const RopeParams& p, cudaStream_t stream, const RopeConfig& c) {
  if (const char* e = rope_check(p)) return e;
  KCPP_KERNEL_REQUIRE(c.threads == 64 || c.threads == 128 || c.threads == 256 || (c.threads == 160 && c.heads_per_thread > 0),
                      "rope: threads %d not in {64, 128, 256} (160 with heads_per_thread)", c.threads);
  KCPP_KERNEL_REQUIRE(c.heads_per_thread >= 0 && c.heads_per_thread <= 4, "rope: heads_per_thread %d not in 0..4",
                      c.heads_per_thread);
  KCPP_KERNEL_REQUIRE(c.order >= 0 && c.order <= 2, "rope: order %d not in 0..2", c.order);
  KCPP_KERNEL_REQUIRE(c.blocks_per_sm >= 0, "rope: blocks_per_sm %d < 0", c.blocks_per_sm);
  const int64_t tokens = p.batch * p.seq;
  if (tokens == 0) return nullptr;
  int device = 0;
  cudaGetDevice(&device);
  const int vec = 16 / kcpp::kernel::dtype_bytes(p.dtype);
  const bool il = p.layout == RopeLayout::Interleaved;
  const int64_t span = il ? p.rotary_dim : p.rotary_dim / 2;  // what VEC must divide
  const bool vec_ok = span % vec == 0 && aligned16(p.cos) && aligned16(p.sin) && p.cs_stride_b % vec == 0 &&
                      p.cs_stride_s % vec == 0 && operand_vec_ok(p.q, vec) && operand_vec_ok(p.k, vec);
  const int threads = c.threads;
  // The column-group kernel where it applies (see there), else the token kernel.
  const int64_t per_head = span / vec, heads = p.q.heads + p.k.heads;
  const bool in_place = p.q.out == p.q.in && (p.k.heads == 0 || p.k.out == p.k.in);
  const bool groups = c.heads_per_thread >= 1 && vec_ok && threads % per_head == 0 && (in_place || p.rotary_dim == p.head_dim);
  // Column groups: neighbouring heads or neighbouring tokens a warp, whichever q has closer together.
  const bool heads_adjacent = c.order == 1 || (c.order == 0 && p.q.in_stride_h <= p.q.in_stride_s);
  const int64_t rows = groups ? threads / per_head : 1;  // per_head may be 0 where the token kernel runs
  const int64_t per_block_heads = heads_adjacent ? rows * c.heads_per_thread : c.heads_per_thread;
  const int64_t head_chunks = groups ? (heads + per_block_heads - 1) / per_block_heads : 1;
  const int64_t token_chunks = heads_adjacent ? tokens : (tokens + rows - 1) / rows;
  KCPP_KERNEL_REQUIRE(!groups || token_chunks * head_chunks < (int64_t(1) << 31),
                      "rope: %lld tokens x %lld heads exceed the grid", static_cast<long long>(tokens), static_cast<long long>(heads));
  // The token kernel: its grid (capped by blocks_per_sm) and the cos / sin rows it stages.
  const int64_t cap = c.blocks_per_sm > 0 ? int64_t(sm_count(device)) * c.blocks_per_sm : int64_t(1) << 31;
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>(tokens, cap));
  const size_t smem = 2 * static_cast<size_t>(p.rotary_dim) * static_cast<size_t>(kcpp::kernel::dtype_bytes(p.dtype));
  KCPP_KERNEL_REQUIRE(groups || smem <= 48 * 1024, "rope: rotary_dim %lld needs %zu bytes of shared memory (at most 48 KiB)",
                      static_cast<long long>(p.rotary_dim), smem);
  auto group_kernel = [&]<typename T, int HEADS>() {
    constexpr int V = 16 / sizeof(T);
    const unsigned blocks = static_cast<unsigned>(token_chunks * head_chunks);
    const int hcs = static_cast<int>(head_chunks);
    if (heads_adjacent) {
      if (il) rope_groups_kernel<T, V, true, BWD, HEADS, true><<<blocks, threads, 0, stream>>>(p, hcs);
      else rope_groups_kernel<T, V, false, BWD, HEADS, true><<<blocks, threads, 0, stream>>>(p, hcs);
    } else {
      if (il) rope_groups_kernel<T, V, true, BWD, HEADS, false><<<blocks, threads, 0, stream>>>(p, hcs);
      else rope_groups_kernel<T, V, false, BWD, HEADS, false><<<blocks, threads, 0, stream>>>(p, hcs);
    }
  };
  auto go = [&]<typename T>(T*) {
    constexpr int V = 16 / sizeof(T);
    if (groups) {
      switch (c.heads_per_thread) {
        case 1: group_kernel.template operator()<T, 1>(); break;
        case 2: group_kernel.template operator()<T, 2>(); break;
        case 3: group_kernel.template operator()<T, 3>(); break;
        default: group_kernel.template operator()<T, 4>(); break;
      }
    } else if (il) {
      if (vec_ok) rope_kernel<T, V, true, true, BWD><<<grid, threads, smem, stream>>>(p);
      else rope_kernel<T, 2, false, true, BWD><<<grid, threads, smem, stream>>>(p);
    } else {
      if (vec_ok) rope_kernel<T, V, true, false, BWD><<<grid, threads, smem, stream>>>(p);
      else rope_kernel<T, 1, false, false, BWD><<<grid, threads, smem, stream>>>(p);
    }
  };
  switch (p.dtype) {
    case kernel::DType::f32: go(static_cast<float*>(nullptr)); break;
    case kernel::DType::bf16: go(static_cast<__nv_bfloat16*>(nullptr)); break;
    case kernel::DType::f16: go(static_cast<__half*>(nullptr)); break;
  }
  return launch_error(BWD ? "rope backward" : "rope forward");
}

}  // namespace

const char* rope_forward_cuda(const RopeParams& p, cudaStream_t stream) { return run<false>(p, stream, RopeConfig{}); }
const char* rope_backward_cuda(const RopeParams& p, cudaStream_t stream) { return run<true>(p, stream, RopeConfig{}); }
const char* rope_forward_cuda_with(const RopeParams& p, cudaStream_t stream, const RopeConfig& c) {
  return run<false>(p, stream, c);
}
const char* rope_backward_cuda_with(const RopeParams& p, cudaStream_t stream, const RopeConfig& c) {
  return run<true>(p, stream, c);
}

}  // namespace kcpp::liger
