// The selective scan on CUDA, the state-lane kernels (maths, saved states and layout in
// selective_scan.h).  The forward is the default one; the backward runs under KCPP_SCAN_LANES=1: at
// Mamba's sizes it is slower than the chunked backward (bench/RESULTS.md says by how much and why).
//
// A thread holds four states of one channel and walks the positions in order, so the recurrence
// h_l = a_l h_{l-1} + b_l needs no scan across threads and runs once (the chunked kernels of
// selective_scan_cuda.cu run it twice around a warp scan).  Four threads (a quad) make a channel, eight
// channels a warp.  A (position, state) step is one exp2 on the special-function unit and four FP32
// instructions.  What a channel's threads share (dt and dt u of a position) is computed once by one of
// them into shared memory; B and C of a tile of positions sit in shared memory as [position][state], so a
// thread reads its four states as one float4.
//
// Forward: a block of 32 channels (128 threads, 64 registers: eight blocks an SM) per (batch, group,
// block of the group's channels).  Tile after tile of 16 positions: thread q of a quad computes dt and
// dt u of the tile's positions 4q .. 4q + 3 (u and delta loaded one tile ahead, z at the tile's start);
// B and C are staged (normalised under bc_norm); every thread walks the 16 positions over its four
// states, keeping each position's partial sum of C h; a two-round shuffle (quad_scatter) sums them over
// the quad so that thread q ends with the outputs of its own four positions, which it gates and stores.
// The state is saved at each chunk's end as the contract asks.
//
// Backward: a block of 96 channels (384 threads of up to 168 registers, one block an SM: its checkpoints
// and staged rows take 190 KiB of shared memory, which Hopper gives a block and an A100's 163 KiB does
// not: lanes_backward_fits() says which, and the entry points take the chunked backward elsewhere), chunk
// after chunk of kStateChunk positions from the last.  Per chunk:
//   1. B and C of the chunk staged; the state at the chunk's entry read from the forward's `states`;
//   2. the forward walked over the chunk, its state saved in shared memory at the start of each
//      sub-chunk of 16 positions (the checkpoints);
//   3. sub-chunk after sub-chunk from the last: dt, dt u, dy of its positions into shared memory (thread q
//      owns positions q, q + 4, q + 8, q + 12), the forward walked again from the checkpoint with the 16
//      positions' states kept in registers, then the adjoint walked back
//        g_l = dy_l C_l + a_{l+1} g_{l+1}      (the carry a g crossing sub-chunks and chunks in registers)
//      with the decays a_l recomputed (a step costs three exp2 in all: a thread has no room for the
//      decays of a chunk).  Sums over the states (sum g B, sum A g a h, y) go over the quad by a
//      reduce-scatter of four positions at a time (quad_scatter4), which leaves each thread the sums of
//      its own positions.  dB and dC of a position (sums over channels) go over the warp's eight channels
//      through a per-warp shared buffer, then over the block's warps in order once a sub-chunk, to the
//      workspace (the chunked kernels' rows, added in block order by the same reduction kernels); dA, dD
//      and ddelta_bias stay in the thread until the end.
// Every sum runs in a fixed order: the results are reproducible bit for bit.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "kcpp/kernel/cuda.cuh"
#include "kcpp/kernel/error.h"
#include "kcpp/kernel/fast_math.h"
#include "selective_scan/selective_scan.h"
#include "selective_scan/selective_scan_cuda.cuh"

namespace kcpp::mamba::detail {
namespace {

namespace kc = kernel::cuda;
using kernel::exp2_approx;

constexpr int kChunkL = static_cast<int>(kStateChunk);
constexpr int kLaneStates = 4;                        // states a thread
constexpr int kQuad = kMaxStates / kLaneStates;       // threads a channel
constexpr int kWarpChannels = 32 / kQuad;             // channels a warp
constexpr float kLn2 = 0.6931471805599453f;

constexpr int kFwdTile = 16;                          // positions staged at once
constexpr int kFwdThreads = 128, kFwdChannels = kFwdThreads / kQuad;
constexpr int kFwdBlocksPerSm = 8;                    // 64 registers a thread: B 8 x 4096 channels fill one wave

constexpr int kBwdSub = 16;                           // positions a sub-chunk
constexpr int kBwdSubs = kChunkL / kBwdSub;
constexpr int kBwdThreads = 384, kBwdWarps = kBwdThreads / 32, kBwdChannels = kBwdThreads / kQuad;
constexpr int kRedStride = 33;                        // floats a row of s_red (32 + 1: no bank conflicts)
static_assert(kFwdTile % (4 * kQuad) == 0, "a forward thread owns whole 4-element vectors of a tile");
static_assert(kBwdSub == 4 * kQuad, "a backward thread owns four positions of a sub-chunk, strided by the quad");

__host__ __device__ __forceinline__ int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

// Asks L2 for the 128-byte line holding `ptr` (a row that a later step reads).
__device__ __forceinline__ void prefetch_l2(const void* ptr) { asm volatile("prefetch.global.L2 [%0];" ::"l"(ptr)); }

// Four consecutive values (positions p0 .. p0 + 3 of a row whose first `valid` are real; zeros past
// them) widened to f32: one 4-element load when `vec` and all four are real.
template <typename T>
__device__ __forceinline__ void load4(const T* row, int p0, int valid, bool vec, float* v) {
  if (vec && p0 + 4 <= valid) {
    // Loaded into a register copy first: widen() given the global vector by reference reads it byte by byte.
    const kc::Vec<T, 4> x = *reinterpret_cast<const kc::Vec<T, 4>*>(row + p0);
    float w[4];
    kc::widen(x, w);
#pragma unroll
    for (int k = 0; k < 4; ++k) v[k] = w[k];
  } else {
#pragma unroll
    for (int k = 0; k < 4; ++k) v[k] = p0 + k < valid ? kc::to_f32(row[p0 + k]) : 0.0f;
  }
}
template <typename T>
__device__ __forceinline__ void store4(T* row, int p0, int valid, bool vec, const float* v) {
  if (vec && p0 + 4 <= valid) {
    kc::Vec<T, 4> x;
#pragma unroll
    for (int k = 0; k < 4; ++k) x.v[k] = kc::from_f32<T>(v[k]);
    *reinterpret_cast<kc::Vec<T, 4>*>(row + p0) = x;
  } else {
#pragma unroll
    for (int k = 0; k < 4; ++k)
      if (p0 + k < valid) row[p0 + k] = kc::from_f32<T>(v[k]);
  }
}

// A thread's four values of a row fetched ahead of their use: one 4-element load left in flight while
// the tile before is computed when the whole vector is real and the row aligned (`ready`), else read
// element by element at use.
template <typename T>
struct Ahead4 {
  kc::Vec<T, 4> v;
  bool ready = false;
  __device__ __forceinline__ void fetch(const T* row, int p0, int valid, bool vec) {
    ready = vec && p0 + 4 <= valid;
    if (ready) v = *reinterpret_cast<const kc::Vec<T, 4>*>(row + p0);
  }
  __device__ __forceinline__ void take(const T* row, int p0, int valid, float* out) const {
    if (ready) {
      float w[4];
      kc::widen(v, w);
#pragma unroll
      for (int k = 0; k < 4; ++k) out[k] = w[k];
    } else {
      load4<T>(row, p0, valid, false, out);
    }
  }
};

// The values at positions p0, p0 + 4, p0 + 8, p0 + 12 (those before `valid`; zeros after): a backward
// thread's positions of a sub-chunk.
template <typename T>
__device__ __forceinline__ void load_strided(const T* row, int p0, int valid, float (&v)[4]) {
#pragma unroll
  for (int k = 0; k < 4; ++k) v[k] = p0 + 4 * k < valid ? kc::to_f32(row[p0 + 4 * k]) : 0.0f;
}
template <typename T>
__device__ __forceinline__ void store_strided(T* row, int p0, int valid, const float (&v)[4]) {
#pragma unroll
  for (int k = 0; k < 4; ++k)
    if (p0 + 4 * k < valid) row[p0 + 4 * k] = kc::from_f32<T>(v[k]);
}

// Sums over the quad (the four threads of a channel, q = lane % 4) of M values a thread: thread q gets
// the sums of values q M / 4 .. (q + 1) M / 4 - 1 (round one halves by bit 1 of q, round two by bit 0).
template <int M>
__device__ __forceinline__ void quad_scatter(const float (&v)[M], float (&out)[M / 4], int q) {
  constexpr int H = M / 2, Q = M / 4;
  float half[H];
  const bool hi = q & 2, odd = q & 1;
#pragma unroll
  for (int i = 0; i < H; ++i) {
    const float keep = hi ? v[H + i] : v[i], send = hi ? v[i] : v[H + i];
    half[i] = keep + __shfl_xor_sync(kFull, send, 2);
  }
#pragma unroll
  for (int i = 0; i < Q; ++i) {
    const float keep = odd ? half[Q + i] : half[i], send = odd ? half[i] : half[Q + i];
    out[i] = keep + __shfl_xor_sync(kFull, send, 1);
  }
}
// The same for four values: thread q gets the sum of value q.
__device__ __forceinline__ float quad_scatter4(const float (&v)[4], int q) {
  const bool hi = q & 2, odd = q & 1;
  const float r0 = (hi ? v[2] : v[0]) + __shfl_xor_sync(kFull, hi ? v[0] : v[2], 2);
  const float r1 = (hi ? v[3] : v[1]) + __shfl_xor_sync(kFull, hi ? v[1] : v[3], 2);
  return (odd ? r1 : r0) + __shfl_xor_sync(kFull, odd ? r0 : r1, 1);
}

// B and C at positions [l0, l0 + len) of (b, g) into s_B, s_C ([tile][kMaxStates] f32; zeros past len
// and for states past N), normalised under bc_norm.  Starts after a barrier of the caller's, ends with one.
template <typename T, int Tile, int NT>
__device__ void stage_bc_rows(const SelectiveScanParams& p, int64_t b, int64_t g, int64_t l0, int len, bool vec,
                              float (*s_B)[kMaxStates], float (*s_C)[kMaxStates]) {
  const int N = static_cast<int>(p.dstate), tid = threadIdx.x;
  constexpr int per_row = Tile / 8;
  for (int e = tid; e < 2 * kMaxStates * per_row; e += NT) {
    const int row = e / per_row, p8 = (e % per_row) * 8, kind = row / kMaxStates, n = row % kMaxStates;
    float v[8] = {};
    if (n < N) {
      const T* src = (kind == 0 ? p.B : p.C).at<T>(b, g, n) + l0;
      load4<T>(src, p8, len, vec, v);
      load4<T>(src, p8 + 4, len, vec, v + 4);
    }
    float(*dst)[kMaxStates] = kind == 0 ? s_B : s_C;
#pragma unroll
    for (int k = 0; k < 8; ++k) dst[p8 + k][n] = v[k];
  }
  __syncthreads();
  if (!p.bc_norm) return;
  for (int e = tid; e < 2 * len; e += NT) {  // rows past len stay zeros
    float* r = (e < len ? s_B : s_C)[e % len];
    float ss = 0.0f;
    for (int n = 0; n < N; ++n) ss += r[n] * r[n];
    const float rs = 1.0f / sqrtf(ss / N + p.bc_eps);
    for (int n = 0; n < N; ++n) r[n] *= rs;
  }
  __syncthreads();
}

__device__ __forceinline__ void unpack(const float4 v, float (&out)[4]) {
  out[0] = v.x, out[1] = v.y, out[2] = v.z, out[3] = v.w;
}

// ---- forward

template <typename T>
__global__ void __launch_bounds__(kFwdThreads, kFwdBlocksPerSm)
    lanes_forward_kernel(const SelectiveScanParams p, int64_t bpg, bool vec, bool bc_vec) {
  __shared__ __align__(16) float s_B[kFwdTile][kMaxStates];
  __shared__ __align__(16) float s_C[kFwdTile][kMaxStates];
  // Per channel, (dt, dt u) of two positions a float4; a row padded by one float4 so that the eight
  // channels of a warp read from different banks.
  __shared__ float4 s_tt[kFwdChannels][kFwdTile / 2 + 1];
  const Place w = place(p, bpg, kFwdChannels);
  const int tid = threadIdx.x, q = tid % kQuad, ch = tid / kQuad;
  const int N = static_cast<int>(p.dstate);
  const bool active = ch < w.kc, has_z = p.z.data != nullptr;
  const int64_t d = w.d0 + (active ? ch : 0), L = p.seqlen, chunks = state_chunks(L);
  float A2[kLaneStates], h[kLaneStates];
#pragma unroll
  for (int s = 0; s < kLaneStates; ++s) {
    const int n = kLaneStates * q + s;
    A2[s] = active && n < N ? p.A[d * N + n] * kLog2e : 0.0f;
    h[s] = 0.0f;
  }
  const float bias = active && p.delta_bias ? p.delta_bias[d] : 0.0f, Dd = active && p.D ? p.D[d] : 0.0f;
  const T* u_row = p.u.at<T>(w.b, d);
  const T* d_row = p.delta.at<T>(w.b, d);
  constexpr int kOwn = kFwdTile / kQuad;  // positions of a tile a thread computes dt for and outputs
  static_assert(kOwn == 4, "a forward thread's positions of a tile are one 4-element vector");
  const int p0 = kOwn * q;
  const T* z_row = has_z ? p.z.at<T>(w.b, d) : nullptr;
  // u and delta of the next tile are loaded while this one is computed, z at the tile's start.
  Ahead4<T> nu, nd;
  nu.fetch(u_row, p0, active ? static_cast<int>(min64(kFwdTile, L)) : 0, vec);
  nd.fetch(d_row, p0, active ? static_cast<int>(min64(kFwdTile, L)) : 0, vec);
  for (int64_t l0 = 0; l0 < L; l0 += kFwdTile) {
    const int len = static_cast<int>(min64(kFwdTile, L - l0)), valid = active ? len : 0;
    const Ahead4<T> cu = nu, cd = nd;
    Ahead4<T> cz;
    if (has_z) cz.fetch(z_row + l0, p0, valid, vec);
    if (l0 + kFwdTile < L) {
      const int next = active ? static_cast<int>(min64(kFwdTile, L - l0 - kFwdTile)) : 0;
      nu.fetch(u_row + l0 + kFwdTile, p0, next, vec);
      nd.fetch(d_row + l0 + kFwdTile, p0, next, vec);
    }
    // The rows' line after the next (128 bytes hold 64 bf16 positions), asked of L2 once a line.
    constexpr int kLine = static_cast<int>(128 / sizeof(T));
    if (active && q == 0 && l0 % kLine == 0 && l0 + kLine < L) {
      prefetch_l2(u_row + l0 + kLine);
      prefetch_l2(d_row + l0 + kLine);
      if (has_z) prefetch_l2(z_row + l0 + kLine);
    }
    float uo[kOwn];
    {
      float raw[kOwn];
      cu.take(u_row + l0, p0, valid, uo);
      cd.take(d_row + l0, p0, valid, raw);
#pragma unroll
      for (int j = 0; j < kOwn / 2; ++j) {
        const int k = 2 * j;
        const float t0 = p0 + k < valid ? step_fast(p, raw[k] + bias) : 0.0f;
        const float t1 = p0 + k + 1 < valid ? step_fast(p, raw[k + 1] + bias) : 0.0f;
        s_tt[ch][kOwn / 2 * q + j] = make_float4(t0, t0 * uo[k], t1, t1 * uo[k + 1]);
      }
    }
    stage_bc_rows<T, kFwdTile, kFwdThreads>(p, w.b, w.g, l0, len, bc_vec, s_B, s_C);
    float yp[kFwdTile];
#pragma unroll
    for (int j = 0; j < kFwdTile / 2; ++j) {
      const float4 pr = s_tt[ch][j];
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int t = 2 * j + i;
        const float dt = i ? pr.z : pr.x, dtu = i ? pr.w : pr.y;
        float bb[4], cc[4];
        unpack(*reinterpret_cast<const float4*>(&s_B[t][kLaneStates * q]), bb);
        unpack(*reinterpret_cast<const float4*>(&s_C[t][kLaneStates * q]), cc);
        float y = 0.0f;
#pragma unroll
        for (int s = 0; s < kLaneStates; ++s) {
          h[s] = fmaf(exp2_approx(dt * A2[s]), h[s], dtu * bb[s]);
          y = fmaf(cc[s], h[s], y);
        }
        yp[t] = y;
      }
    }
    const int64_t l_end = l0 + kFwdTile;
    if (active && p.states && (l_end % kChunkL == 0 || l_end >= L)) {
      float* st = p.states + ((w.b * p.dim + d) * chunks + l0 / kChunkL) * N;
#pragma unroll
      for (int s = 0; s < kLaneStates; ++s)
        if (kLaneStates * q + s < N) st[kLaneStates * q + s] = h[s];
    }
    float yo[kOwn];
    quad_scatter<kFwdTile>(yp, yo, q);
    if (active) {
#pragma unroll
      for (int k = 0; k < kOwn; ++k) yo[k] = fmaf(Dd, uo[k], yo[k]);
      if (has_z) {
        float zo[kOwn];
        cz.take(z_row + l0, p0, valid, zo);
#pragma unroll
        for (int k = 0; k < kOwn; ++k) yo[k] *= fast_silu(zo[k]);
      }
      T* o_row = p.out.mut<T>(w.b, d) + l0;
#pragma unroll
      for (int k = 0; k < kOwn; k += 4) store4<T>(o_row, p0 + k, valid, vec, yo + k);
    }
    __syncthreads();  // s_B, s_C, s_tt read before the next tile's staging
  }
  if (active && p.last_state) {
#pragma unroll
    for (int s = 0; s < kLaneStates; ++s)
      if (kLaneStates * q + s < N) p.last_state[(w.b * p.dim + d) * N + kLaneStates * q + s] = h[s];
  }
}

// ---- backward

// Shared memory, in floats: s_B, s_C [kChunkL][kMaxStates]; s_ck [kBwdSubs][kBwdThreads] float4 (the
// checkpoints); s_v [kBwdChannels][kVStride] float4 (dt, dt u, dy of a sub-chunk's positions, written
// by the thread that owns each); s_x [kBwdWarps][32][8] (a warp's dB, dC of one position, 8 a thread); s_red
// [kBwdWarps][kBwdSub][kRedStride] (the warps' sums over their channels, a sub-chunk).
constexpr int kVStride = kBwdSub + 1;  // float4s a row of s_v (one more: a warp's channels on different banks)
constexpr size_t kBwdSmemFloats = 2 * size_t(kChunkL) * kMaxStates + 4 * size_t(kBwdSubs) * kBwdThreads +
                                  4 * size_t(kBwdChannels) * kVStride + size_t(kBwdWarps) * 32 * 8 +
                                  size_t(kBwdWarps) * kBwdSub * kRedStride;
constexpr size_t kBwdSmemBytes = sizeof(float) * kBwdSmemFloats;

template <typename T>
__global__ void __launch_bounds__(kBwdThreads, 1)
    lanes_backward_kernel(const SelectiveScanParams p, int64_t bpg, bool bc_vec, float* ws_bc, float* ws_a, float* ws_d,
                          float* ws_bias) {
  extern __shared__ float4 smem4[];
  float(*s_B)[kMaxStates] = reinterpret_cast<float(*)[kMaxStates]>(smem4);
  float(*s_C)[kMaxStates] = s_B + kChunkL;
  float4* s_ck = reinterpret_cast<float4*>(s_C + kChunkL);
  float4* s_v = s_ck + kBwdSubs * kBwdThreads;
  float* s_x = reinterpret_cast<float*>(s_v + kBwdChannels * kVStride);
  float* s_red = s_x + kBwdWarps * 32 * 8;

  const Place w = place(p, bpg, kBwdChannels);
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, q = lane % kQuad, ch = tid / kQuad;
  const int N = static_cast<int>(p.dstate);
  const bool active = ch < w.kc, has_z = p.z.data != nullptr;
  const int64_t D = p.dim, L = p.seqlen, chunks = state_chunks(L);
  const int64_t d = w.d0 + (active ? ch : 0);
  float A2[kLaneStates];
#pragma unroll
  for (int s = 0; s < kLaneStates; ++s) {
    const int n = kLaneStates * q + s;
    A2[s] = active && n < N ? p.A[d * N + n] * kLog2e : 0.0f;
  }
  const float bias = active && p.delta_bias ? p.delta_bias[d] : 0.0f, Dd = active && p.D ? p.D[d] : 0.0f;
  const T* u_row = p.u.at<T>(w.b, d);
  const T* d_row = p.delta.at<T>(w.b, d);
  const T* o_row = p.dout.at<T>(w.b, d);
  const T* z_row = has_z ? p.z.at<T>(w.b, d) : nullptr;
  float carry[kLaneStates] = {}, dA[kLaneStates] = {};
  float sum_dD = 0.0f, sum_bias = 0.0f;
  const int64_t row0 = (((w.cb * p.batch + w.b) * p.groups + w.g) * 2) * N;  // the block's dB rows in ws_bc
  int64_t l0 = 0;  // the chunk in hand's first position
  int valid = 0;   // its positions (0 for a channel slot past the block's channels)
  // dt, dt u and (with_dy) dy = dout silu(z) of the thread's positions sl0 + q + 4k of the sub-chunk at
  // sl0 into s_v, then the warp's barrier: each thread reads every position of its channel after.
  auto stage_steps = [&](int sl0, bool with_dy) {
    const int sv = valid - sl0;
    float u[4], dt[4], go[4] = {}, z[4] = {};
    load_strided<T>(u_row + l0 + sl0, q, sv, u);
    load_strided<T>(d_row + l0 + sl0, q, sv, dt);
    if (with_dy) load_strided<T>(o_row + l0 + sl0, q, sv, go);
    if (with_dy && has_z) load_strided<T>(z_row + l0 + sl0, q, sv, z);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const float v = q + 4 * k < sv ? step_fast(p, dt[k] + bias) : 0.0f;
      s_v[ch * kVStride + q + 4 * k] = make_float4(v, v * u[k], has_z ? go[k] * fast_silu(z[k]) : go[k], 0.0f);
    }
    __syncwarp();
  };
  // The recurrence over the sub-chunk at sl0 (s_v staged) from the state h, updated in place; keep(t, h)
  // sees the state after each position t.
  auto walk = [&](int sl0, float (&h)[kLaneStates], auto&& keep) {
#pragma unroll
    for (int t = 0; t < kBwdSub; ++t) {
      const float4 v = s_v[ch * kVStride + t];
      float bb[4];
      unpack(*reinterpret_cast<const float4*>(&s_B[sl0 + t][kLaneStates * q]), bb);
#pragma unroll
      for (int s = 0; s < kLaneStates; ++s) h[s] = fmaf(exp2_approx(v.x * A2[s]), h[s], v.y * bb[s]);
      keep(t, h);
    }
  };

  for (int64_t c = chunks - 1; c >= 0; --c) {
    l0 = c * kChunkL;
    const int len = static_cast<int>(min64(kChunkL, L - l0));
    valid = active ? len : 0;
    const int subs = (len + kBwdSub - 1) / kBwdSub;
    __syncthreads();  // the previous chunk's reads of s_B, s_C, s_ck are done
    stage_bc_rows<T, kChunkL, kBwdThreads>(p, w.b, w.g, l0, len, bc_vec, s_B, s_C);

    // 2. The checkpoints: the state entering each sub-chunk.
    {
      float h[kLaneStates];
#pragma unroll
      for (int s = 0; s < kLaneStates; ++s) {
        const int n = kLaneStates * q + s;
        h[s] = active && c > 0 && n < N ? p.states[((w.b * D + d) * chunks + c - 1) * N + n] : 0.0f;
      }
      // Asked of L2 while the checkpoints are made: this chunk's dout and z rows (first read by the
      // adjoint) and the previous chunk's u and delta (read by its checkpoints), a quarter of each a thread.
      if (active) {
        constexpr int kLine = static_cast<int>(128 / sizeof(T));
        for (int e = q * kLine; e < kChunkL; e += kQuad * kLine) {
          if (e < len) {
            prefetch_l2(o_row + l0 + e);
            if (has_z) prefetch_l2(z_row + l0 + e);
          }
          if (c > 0) {
            prefetch_l2(u_row + l0 - kChunkL + e);
            prefetch_l2(d_row + l0 - kChunkL + e);
          }
        }
      }
      for (int sc = 0; sc < subs; ++sc) {
        s_ck[sc * kBwdThreads + tid] = make_float4(h[0], h[1], h[2], h[3]);
        if (sc == subs - 1) break;
        stage_steps(sc * kBwdSub, false);
        walk(sc * kBwdSub, h, [](int, const float (&)[kLaneStates]) {});
        __syncwarp();  // s_v read before the next sub-chunk's values
      }
    }

    // 3. Sub-chunk after sub-chunk from the last.
    for (int sc = subs - 1; sc >= 0; --sc) {
      const int sl0 = sc * kBwdSub, sv = valid - sl0;  // the thread's positions sl0 + q + 4k are real below sv
      stage_steps(sl0, true);
      // The states of the sub-chunk's positions (hin: the checkpoint, read again where the adjoint needs it).
      float hs[kBwdSub][kLaneStates], hin[4], hp[4];
      unpack(s_ck[sc * kBwdThreads + tid], hin);
#pragma unroll
      for (int s = 0; s < kLaneStates; ++s) hp[s] = hin[s];
      walk(sl0, hp, [&](int t, const float (&h)[kLaneStates]) {
#pragma unroll
        for (int s = 0; s < kLaneStates; ++s) hs[t][s] = h[s];
      });
      // The adjoint, from the sub-chunk's last position; the thread's sums of its own positions.
      float sgb[4], sagx[4], yv[4];
      float* x = s_x + warp * 32 * 8;
#pragma unroll
      for (int j = 3; j >= 0; --j) {
        float pg[4], px[4], py[4];
#pragma unroll
        for (int i = 3; i >= 0; --i) {
          const int t = 4 * j + i;  // thread i's position k = j
          const float4 v = s_v[ch * kVStride + t];
          const float dtt = v.x, dtut = v.y, dyt = v.z;
          float bb[4], cc[4];
          unpack(*reinterpret_cast<const float4*>(&s_B[sl0 + t][kLaneStates * q]), bb);
          unpack(*reinterpret_cast<const float4*>(&s_C[sl0 + t][kLaneStates * q]), cc);
          float gb = 0.0f, gx = 0.0f, yy = 0.0f, vb[4], vc[4];
          if (t == 0) unpack(s_ck[sc * kBwdThreads + tid], hin);
#pragma unroll
          for (int s = 0; s < kLaneStates; ++s) {
            const float a = exp2_approx(dtt * A2[s]);
            const float g = fmaf(dyt, cc[s], carry[s]);
            const float ag = a * g;
            carry[s] = ag;
            const float xg = ag * (t > 0 ? hs[t - 1][s] : hin[s]);  // g a_l h_{l-1}
            dA[s] = fmaf(xg, dtt, dA[s]);
            gx = fmaf(A2[s], xg, gx);
            gb = fmaf(g, bb[s], gb);
            yy = fmaf(cc[s], hs[t][s], yy);
            vb[s] = g * dtut;
            vc[s] = dyt * hs[t][s];
          }
          pg[i] = gb, px[i] = gx, py[i] = yy;
          // dB, dC of position t over the warp's channels: thread j of the warp adds output j (dB of
          // state j for j < 16, dC of state j - 16 after) over the eight channels, in channel order.
          __syncwarp();  // the previous position's reads of x are done
          *reinterpret_cast<float4*>(x + lane * 8) = make_float4(vb[0], vb[1], vb[2], vb[3]);
          *reinterpret_cast<float4*>(x + lane * 8 + 4) = make_float4(vc[0], vc[1], vc[2], vc[3]);
          __syncwarp();
          {
            const int kind = lane >> 4, n = lane & 15, at = (n >> 2) * 8 + kind * 4 + (n & 3);
            float v[kWarpChannels];
#pragma unroll
            for (int cw = 0; cw < kWarpChannels; ++cw) v[cw] = x[cw * 32 + at];
#pragma unroll
            for (int o = 1; o < kWarpChannels; o <<= 1)  // pairs, then pairs of pairs: a fixed order
#pragma unroll
              for (int cw = 0; cw < kWarpChannels; cw += 2 * o) v[cw] += v[cw + o];
            s_red[(warp * kBwdSub + t) * kRedStride + lane] = v[0];
          }
        }
        sgb[j] = quad_scatter4(pg, q);
        sagx[j] = quad_scatter4(px, q);
        yv[j] = quad_scatter4(py, q);
      }
      // The thread's positions: du, ddelta, dz, and its shares of dD, ddelta_bias.
      if (active) {
        float raw[4], go[4], z[4] = {}, du[4], dd[4], dz[4], u[4], dt[4], dy[4];
        load_strided<T>(u_row + l0 + sl0, q, sv, u);
        load_strided<T>(d_row + l0 + sl0, q, sv, raw);
        load_strided<T>(o_row + l0 + sl0, q, sv, go);
        if (has_z) load_strided<T>(z_row + l0 + sl0, q, sv, z);
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const float4 v = s_v[ch * kVStride + q + 4 * k];
          dt[k] = v.x, dy[k] = v.z;
        }
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          du[k] = fmaf(Dd, dy[k], dt[k] * sgb[k]);
          const float ddt = fmaf(u[k], sgb[k], kLn2 * sagx[k]);
          dd[k] = q + 4 * k < sv ? (p.delta_softplus ? ddt * fast_dsoftplus(raw[k] + bias) : ddt) : 0.0f;
          dz[k] = go[k] * fast_dsilu(z[k]) * fmaf(Dd, u[k], yv[k]);
          sum_dD = fmaf(dy[k], u[k], sum_dD);
          sum_bias += dd[k];
        }
        store_strided<T>(p.du.mut<T>(w.b, d) + l0 + sl0, q, sv, du);
        store_strided<T>(p.ddelta.mut<T>(w.b, d) + l0 + sl0, q, sv, dd);
        if (has_z) store_strided<T>(p.dz.mut<T>(w.b, d) + l0 + sl0, q, sv, dz);
      }
      __syncthreads();  // every warp's sums of the sub-chunk are in s_red (and s_v read)
      for (int e = tid; e < kBwdSub * 2 * kMaxStates; e += kBwdThreads) {
        // Output j = e / 16 (dB of state j, then dC of state j - 16) of position t = e % 16, over the
        // warps in order.
        const int j = e / kBwdSub, t = e % kBwdSub, kind = j >> 4, n = j & 15;
        float sum = 0.0f;
#pragma unroll
        for (int wp = 0; wp < kBwdWarps; ++wp) sum += s_red[(wp * kBwdSub + t) * kRedStride + j];
        if (n < N && sl0 + t < len) ws_bc[(row0 + kind * N + n) * L + l0 + sl0 + t] = sum;
      }
      __syncthreads();  // s_red read before the next sub-chunk writes it
    }
  }
  if (active) {
#pragma unroll
    for (int s = 0; s < kLaneStates; ++s)
      if (kLaneStates * q + s < N) ws_a[(w.b * D + d) * N + kLaneStates * q + s] = dA[s];
  }
  // The channel's dD and ddelta_bias shares, over the quad in order.
  sum_dD += __shfl_xor_sync(kFull, sum_dD, 1);
  sum_dD += __shfl_xor_sync(kFull, sum_dD, 2);
  sum_bias += __shfl_xor_sync(kFull, sum_bias, 1);
  sum_bias += __shfl_xor_sync(kFull, sum_bias, 2);
  if (active && q == 0) ws_d[w.b * D + d] = sum_dD, ws_bias[w.b * D + d] = sum_bias;
}

// Whether every row of these views starts on a boundary of four elements (4-element vector accesses).
bool aligned4(const void* data, size_t elem) { return reinterpret_cast<uintptr_t>(data) % (4 * elem) == 0; }
bool rows_aligned4(size_t elem, std::initializer_list<Seq> seqs) {
  for (const Seq& s : seqs)
    if (s.data && (!aligned4(s.data, elem) || s.sb % 4 != 0 || s.sr % 4 != 0)) return false;
  return true;
}
bool rows_aligned4(size_t elem, std::initializer_list<GroupSeq> seqs) {
  for (const GroupSeq& s : seqs)
    if (s.data && (!aligned4(s.data, elem) || s.sb % 4 != 0 || s.sg % 4 != 0 || s.sn % 4 != 0)) return false;
  return true;
}

}  // namespace

bool lanes_backward_fits() {
  int dev = 0, optin = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess)
    return false;
  return static_cast<size_t>(optin) >= kBwdSmemBytes;
}

int64_t lanes_blocks_per_group(const SelectiveScanParams& p) {
  return (p.dim / p.groups + kBwdChannels - 1) / kBwdChannels;
}

const char* lanes_forward(const SelectiveScanParams& p, cudaStream_t stream) {
  const int64_t bpg = (p.dim / p.groups + kFwdChannels - 1) / kFwdChannels;
  const unsigned grid = static_cast<unsigned>(p.batch * p.groups * bpg);
  return kc::with_float_dtype(p.dtype, "selective_scan", [&]<typename T>(T*) -> const char* {
    const bool vec = rows_aligned4(sizeof(T), {p.u, p.delta, p.z, p.out});
    const bool bc_vec = rows_aligned4(sizeof(T), {p.B, p.C});
    lanes_forward_kernel<T><<<grid, kFwdThreads, 0, stream>>>(p, bpg, vec, bc_vec);
    return kc::launch_error("selective_scan forward");
  });
}

const char* lanes_backward_blocks(const SelectiveScanParams& p, int64_t bpg, float* ws_bc, float* ws_a, float* ws_d,
                                  float* ws_bias, cudaStream_t stream) {
  const unsigned grid = static_cast<unsigned>(p.batch * p.groups * bpg);
  return kc::with_float_dtype(p.dtype, "selective_scan", [&]<typename T>(T*) -> const char* {
    const cudaError_t attr = cudaFuncSetAttribute(lanes_backward_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                  static_cast<int>(kBwdSmemBytes));
    if (attr != cudaSuccess)
      return kernel::errorf("selective_scan backward: cannot reserve %zu bytes of shared memory: %s", kBwdSmemBytes,
                            cudaGetErrorString(attr));
    const bool bc_vec = rows_aligned4(sizeof(T), {p.B, p.C});
    lanes_backward_kernel<T><<<grid, kBwdThreads, kBwdSmemBytes, stream>>>(p, bpg, bc_vec, ws_bc, ws_a, ws_d, ws_bias);
    return kc::launch_error("selective_scan backward");
  });
}

}  // namespace kcpp::mamba::detail
