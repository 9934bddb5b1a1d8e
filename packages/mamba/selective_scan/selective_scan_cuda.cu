// The selective scan on CUDA (maths, saved states and layout in selective_scan.h): the entry points,
// which pick the kernels (path(): by default the state-lane forward of selective_scan_lanes_cuda.cu and
// the chunked backward below), and the chunked kernels, in which the recurrence runs in parallel over
// the positions of a chunk of kStateChunk, as in Gu & Dao's selective_scan kernel (Mamba, 2023: each
// thread holds a run of consecutive positions, a block scan combines the runs) with the scan kept
// inside one warp.
//
// The scan.  Per channel and state n, h_l = a_l h_{l-1} + b_l with a_l = exp(dt_l A_n) and
// b_l = dt_l B_n,l u_l.  A chunk's R lanes each own K = kStateChunk / R consecutive positions (R K = 256)
// and run the recurrence over them from 0, which gives the lane's (P, H): h at its last position is
// H + P h_in, with P = prod a_l = exp2(log2(e) A_n sum dt_l) (one exp2 a lane, not K products).  An
// inclusive warp scan of the lanes' pairs with the associative operator
//   (P1, H1) then (P2, H2) = (P1 P2, P2 H1 + H2)
// (Kogge-Stone over R lanes, __shfl_up_sync) gives each lane its h_in from the chunk's entry state, and
// a second pass over the lane's positions the states themselves.  The backward's adjoint
//   g_l = dy_l C_n,l + a_{l+1} g_{l+1}
// is the same recurrence in reverse: with the carry c_l = a_{l+1} g_{l+1} into a position, a lane maps the
// carry into its last position to the one out of its first, a_{l0} g_{l0} = G + P c (the same P), and
// the pairs scan in reverse (__shfl_down_sync), (P1, G1) then (P2, G2) = (P1 P2, G1 + P1 G2).
// Decays are exp2(dt (A log2 e)) on the special-function unit (ex2.approx, relative error ~2^-22).
//
// Chunks.  B and C of a chunk (normalised under bc_norm) go to shared memory as f32 once for all the
// block's channels, in an order in which a lane's four consecutive positions are one float4 and the R
// lanes' float4s are adjacent (slot<K>).  u, delta, z, dout are read by each lane as 16-byte vectors
// where the views allow it (else element by element); the backward reads them a second time for its
// outputs (from L2, the rows just used) rather than keep them in registers through the states.
//
// Forward: a block per (batch, group, up to 32 channels), four warps of two channels each (R = 16, K =
// 16).  Chunk after chunk, the block stages B and C, then each half-warp scans its channels, carrying
// each channel's state from chunk to chunk in shared memory and writing it to `states` at each chunk's
// end (the state after position min(256 (c + 1), L) - 1).
//
// Backward: a block per (batch, group, up to 128 channels), eight warps of one channel each (R = 32,
// K = 8), chunk after chunk from the last.  Per chunk, channel and state: the forward recomputed from the
// saved state at the chunk's start (the decays a_l kept in registers for the reverse scan), then the
// reverse scan of g from the carry that the later chunk left in shared memory, then the gradients.  Sums
// over the states (y, sum g B, sum A g a h) stay in the lane's registers; dA sums over the warp once a
// state; dB and dC, sums over channels, go through shared memory: each warp writes its channel's row of
// the chunk, the block adds the eight rows and accumulates over its channels in a chunk-wide buffer,
// which it writes to the workspace once the chunk is done.  Two kernels then add the blocks' partial
// sums in block order, and dA, dD, ddelta_bias in batch order (in f64), and take dB, dC back through
// the norm: reproducible bit for bit.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdlib>

#include "kcpp/kernel/cuda.cuh"
#include "kcpp/kernel/error.h"
#include "kcpp/kernel/fast_math.h"
#include "selective_scan/selective_scan.h"
#include "selective_scan/selective_scan_cuda.cuh"

namespace kcpp::mamba {
namespace {

using namespace detail;
namespace kc = kernel::cuda;
using kernel::exp2_approx;

constexpr int kChunk = static_cast<int>(kStateChunk);

// Forward: lanes a channel, positions a lane, warps a block, channels a block at once, at most that
// many times over per chunk (the block's channels, kFwdChannels * iterations, share the staged B, C).
constexpr int kFwdR = 16, kFwdK = kChunk / kFwdR;
constexpr int kFwdWarps = 4, kFwdThreads = 32 * kFwdWarps, kFwdChannels = kFwdWarps * (32 / kFwdR);
constexpr int kFwdMaxIters = 4;
constexpr int64_t kFwdTargetBlocks = 1024;  // blocks below which a block takes fewer channels
// Backward: likewise, one channel a warp.
constexpr int kBwdR = 32, kBwdK = kChunk / kBwdR;
constexpr int kBwdWarps = 8, kBwdThreads = 32 * kBwdWarps, kBwdChannels = kBwdWarps;
constexpr int kBwdMaxIters = 16;
constexpr int64_t kBwdTargetBlocks = 256;
static_assert(kFwdK % 8 == 0 && kBwdK % 8 == 0, "stage_bc moves 8 positions of a lane's run at once");
static_assert(kChunk == 256 && kBwdThreads == kChunk, "the backward's reduction gives each thread one position");

__host__ __device__ __forceinline__ int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

// Asks L2 for the line holding `ptr` (a row that a later step reads).
__device__ __forceinline__ void prefetch_l2(const void* ptr) { asm volatile("prefetch.global.L2 [%0];" ::"l"(ptr)); }

// Where position p of a chunk sits in a shared chunk row read by lanes of K positions each (R = 256 / K
// lanes): lane r's positions 4j .. 4j + 3 are the float4 at 4 R j + 4 r, so the R lanes' float4s for
// one j are adjacent (a conflict-free 16-byte access).
template <int K>
__device__ __forceinline__ int slot(int p) {
  constexpr int R = kChunk / K;
  const int r = p / K, k = p % K;
  return (k / 4) * (4 * R) + 4 * r + (k % 4);
}

// K consecutive values of the lane (positions p0 .. p0 + K of a row whose first `valid` are real; zeros
// past them), widened to f32; 16-byte loads when `vec` (the row 16-byte aligned) and all K are real.
template <typename T, int K>
__device__ __forceinline__ void load_run(const T* row, int p0, int valid, bool vec, float (&v)[K]) {
  constexpr int V = 16 / sizeof(T);
  static_assert(K % V == 0, "a run is whole 16-byte vectors");
  if (vec && p0 + K <= valid) {
#pragma unroll
    for (int j = 0; j < K / V; ++j) {
      float part[V];
      kc::load_f32<T, V>(row + p0 + j * V, part);
#pragma unroll
      for (int i = 0; i < V; ++i) v[j * V + i] = part[i];
    }
  } else {
#pragma unroll
    for (int k = 0; k < K; ++k) v[k] = p0 + k < valid ? kc::to_f32(row[p0 + k]) : 0.0f;
  }
}

// Stores the real ones of the lane's K values (those before `valid`), as load_run reads them.
template <typename T, int K>
__device__ __forceinline__ void store_run(T* row, int p0, int valid, bool vec, const float (&v)[K]) {
  constexpr int V = 16 / sizeof(T);
  if (vec && p0 + K <= valid) {
#pragma unroll
    for (int j = 0; j < K / V; ++j) {
      float part[V];
#pragma unroll
      for (int i = 0; i < V; ++i) part[i] = v[j * V + i];
      kc::store_f32<T, V>(row + p0 + j * V, part);
    }
  } else {
#pragma unroll
    for (int k = 0; k < K; ++k)
      if (p0 + k < valid) row[p0 + k] = kc::from_f32<T>(v[k]);
  }
}

// Positions [l0, l0 + len) of B and C of (b, g) into s_B, s_C ([N][kChunk] f32 in slot<K> order, zeros
// past len), normalised under bc_norm; the rows of the chunk at `next` (or none when negative) asked of
// L2.  Starts after a barrier of the caller's, ends with one.
template <typename T, int K, int NT>
__device__ void stage_bc(const SelectiveScanParams& p, int64_t b, int64_t g, int64_t l0, int len, int64_t next, bool vec,
                         float* s_B, float* s_C) {
  const int N = static_cast<int>(p.dstate);
  constexpr int E = 8, groups = kChunk / E;  // positions a thread moves at once, groups of them a row
  for (int e = threadIdx.x; e < 2 * N * groups; e += NT) {
    const int row = e / groups, q = (e % groups) * E, kind = row / N, n = row % N;
    const T* src = (kind == 0 ? p.B : p.C).at<T>(b, g, n) + l0;
    float v[E];
    load_run<T, E>(src, q, len, vec, v);
    if (next >= 0 && next + q < p.seqlen) prefetch_l2(src - l0 + next + q);
    float* dst = (kind == 0 ? s_B : s_C) + n * kChunk;
    // q is a multiple of 8 and K of 8: q .. q + 7 lie in one lane's run, two float4 slots.
    *reinterpret_cast<float4*>(dst + slot<K>(q)) = make_float4(v[0], v[1], v[2], v[3]);
    *reinterpret_cast<float4*>(dst + slot<K>(q + 4)) = make_float4(v[4], v[5], v[6], v[7]);
  }
  __syncthreads();
  if (!p.bc_norm) return;
  for (int q = threadIdx.x; q < len; q += NT) {  // the zeros past len stay zeros
    const int s = slot<K>(q);
    float sb = 0.0f, sc = 0.0f;
    for (int n = 0; n < N; ++n) sb += s_B[n * kChunk + s] * s_B[n * kChunk + s], sc += s_C[n * kChunk + s] * s_C[n * kChunk + s];
    const float rb = 1.0f / sqrtf(sb / N + p.bc_eps), rc = 1.0f / sqrtf(sc / N + p.bc_eps);
    for (int n = 0; n < N; ++n) s_B[n * kChunk + s] *= rb, s_C[n * kChunk + s] *= rc;
  }
  __syncthreads();
}

// The lane's K values of state row `s_row` (a chunk row in slot<K> order); r is the lane's run.
template <int K>
__device__ __forceinline__ void load_row(const float* s_row, int r, float (&v)[K]) {
  constexpr int R = kChunk / K;
#pragma unroll
  for (int j = 0; j < K / 4; ++j) {
    const float4 f = *reinterpret_cast<const float4*>(s_row + j * 4 * R + 4 * r);
    v[4 * j] = f.x, v[4 * j + 1] = f.y, v[4 * j + 2] = f.z, v[4 * j + 3] = f.w;
  }
}

// Inclusive scan of the lanes' (P, H) over each segment of R lanes (r: the lane's index in it), in lane
// order: afterwards lane r holds the pair of lanes 0 .. r, (P1, H1) then (P2, H2) = (P1 P2, P2 H1 + H2).
template <int R>
__device__ __forceinline__ void scan_up(float& P, float& H, int r) {
#pragma unroll
  for (int o = 1; o < R; o <<= 1) {  // lanes with no partner combine with the identity (1, 0)
    const float Pp = __shfl_up_sync(kFull, P, o, R), Hp = __shfl_up_sync(kFull, H, o, R);
    const bool in = r >= o;
    H = fmaf(P, in ? Hp : 0.0f, H);
    P *= in ? Pp : 1.0f;
  }
}
// The same from the segment's last lane down: lane r holds the pair of lanes r .. R - 1 applied from the
// last, (P1, G1) then (P2, G2) = (P1 P2, G1 + P1 G2) with pair 1 the earlier lane.
template <int R>
__device__ __forceinline__ void scan_down(float& P, float& G, int r) {
#pragma unroll
  for (int o = 1; o < R; o <<= 1) {
    const float Pn = __shfl_down_sync(kFull, P, o, R), Gn = __shfl_down_sync(kFull, G, o, R);
    const bool in = r + o < R;
    G = fmaf(P, in ? Gn : 0.0f, G);
    P *= in ? Pn : 1.0f;
  }
}
// After scan_up: the state entering lane r's run, from h0 entering the segment.
template <int R>
__device__ __forceinline__ float enter_up(float P, float H, int r, float h0) {
  const float Pp = __shfl_up_sync(kFull, P, 1, R), Hp = __shfl_up_sync(kFull, H, 1, R);
  return r == 0 ? h0 : fmaf(Pp, h0, Hp);
}
// After scan_down: the carry into lane r's last position, from c0 into the segment's last.
template <int R>
__device__ __forceinline__ float enter_down(float P, float G, int r, float c0) {
  const float Pn = __shfl_down_sync(kFull, P, 1, R), Gn = __shfl_down_sync(kFull, G, 1, R);
  return r == R - 1 ? c0 : fmaf(Pn, c0, Gn);
}

// The forward.  Channel slots past the block's channels run on zeros (a = 1, b = 0) and store nothing,
// so that the shuffles see every lane.
template <typename T>
__global__ void __launch_bounds__(kFwdThreads) chunked_forward_kernel(const SelectiveScanParams p, int64_t bpg, int iters,
                                                                     bool vec, bool bc_vec) {
  constexpr int R = kFwdR, K = kFwdK;
  __shared__ __align__(16) float s_B[kMaxStates * kChunk];
  __shared__ __align__(16) float s_C[kMaxStates * kChunk];
  __shared__ float s_h[kFwdChannels * kFwdMaxIters][kMaxStates];  // each channel's state between chunks
  const Place w = place(p, bpg, kFwdChannels * iters);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, r = lane % R, p0 = r * K;
  const int N = static_cast<int>(p.dstate);
  const int64_t L = p.seqlen, chunks = state_chunks(L);
  const bool has_z = p.z.data != nullptr;
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t l0 = c * kChunk;
    const int len = static_cast<int>(min64(kChunk, L - l0));
    __syncthreads();  // the previous chunk's reads of s_B, s_C are done
    stage_bc<T, K, kFwdThreads>(p, w.b, w.g, l0, len, c + 1 < chunks ? l0 + kChunk : -1, bc_vec, s_B, s_C);
    for (int it = 0; it < iters; ++it) {
      const int ch = it * kFwdChannels + warp * (32 / R) + lane / R;
      const bool active = ch < w.kc;
      const int64_t d = w.d0 + (active ? ch : 0);
      const int valid = active ? len : 0;
      float dt[K], dtu[K], y[K], sdt = 0.0f;
      {
        float u[K], raw[K];
        load_run<T, K>(p.u.at<T>(w.b, d) + l0, p0, valid, vec, u);
        load_run<T, K>(p.delta.at<T>(w.b, d) + l0, p0, valid, vec, raw);
        if (ch + kFwdChannels < w.kc && p0 < len) {  // the rows of this lane's next channel
          const int64_t dn = d + kFwdChannels;
          prefetch_l2(p.u.at<T>(w.b, dn) + l0 + p0);
          prefetch_l2(p.delta.at<T>(w.b, dn) + l0 + p0);
          if (has_z) prefetch_l2(p.z.at<T>(w.b, dn) + l0 + p0);
        }
        const float bias = active && p.delta_bias ? p.delta_bias[d] : 0.0f, Dd = active && p.D ? p.D[d] : 0.0f;
#pragma unroll
        for (int k = 0; k < K; ++k) {
          dt[k] = p0 + k < valid ? step_fast(p, raw[k] + bias) : 0.0f;
          dtu[k] = dt[k] * u[k];
          y[k] = Dd * u[k];
          sdt += dt[k];
        }
      }
      // Lane r holds state r's entry to the chunk and A log2(e).
      const float h0v = active && c > 0 && r < N ? s_h[ch][r] : 0.0f;
      const float A2v = active && r < N ? p.A[d * N + r] * kLog2e : 0.0f;
      __syncwarp();  // read before the lane R - 1 writes the chunk's end state below
      for (int n = 0; n < N; ++n) {
        const float A2 = __shfl_sync(kFull, A2v, n, R);
        float a[K], bu[K], bc[K];
        load_row<K>(s_B + n * kChunk, r, bc);
        float H = 0.0f;
#pragma unroll
        for (int k = 0; k < K; ++k) {
          a[k] = exp2_approx(dt[k] * A2);
          bu[k] = dtu[k] * bc[k];
          H = fmaf(a[k], H, bu[k]);
        }
        float P = exp2_approx(A2 * sdt);
        scan_up<R>(P, H, r);
        float h = enter_up<R>(P, H, r, __shfl_sync(kFull, h0v, n, R));
        load_row<K>(s_C + n * kChunk, r, bc);
#pragma unroll
        for (int k = 0; k < K; ++k) {
          h = fmaf(a[k], h, bu[k]);
          y[k] = fmaf(bc[k], h, y[k]);
        }
        if (r == R - 1) s_h[ch][n] = h;  // the state after the chunk's last position
      }
      __syncwarp();
      if (active && r < N) {
        const int64_t i = w.b * p.dim + d;
        if (p.states) p.states[(i * chunks + c) * N + r] = s_h[ch][r];
        if (p.last_state && c == chunks - 1) p.last_state[i * N + r] = s_h[ch][r];
      }
      if (active) {
        if (has_z) {
          float z[K];
          load_run<T, K>(p.z.at<T>(w.b, d) + l0, p0, valid, vec, z);
#pragma unroll
          for (int k = 0; k < K; ++k) y[k] *= fast_silu(z[k]);
        }
        store_run<T, K>(p.out.mut<T>(w.b, d) + l0, p0, valid, vec, y);
      }
    }
  }
}

// The backward's shared memory, in floats after the f64 part: s_dA [cpb][N], s_dD [cpb], s_db [cpb]
// (f64, each channel's sums over the chunks); s_B, s_C [N][kChunk]; s_red [warps][2][kChunk] (each
// warp's dB, dC row of one state); s_acc [2][N][kChunk] (the block's dB, dC of the chunk); s_g [cpb][N]
// (each channel's carry a g into the chunk after the one in hand).
struct BackwardSmem {
  int cpb, n;
  __host__ __device__ size_t doubles() const { return size_t(cpb) * n + 2 * size_t(cpb); }
  __host__ __device__ size_t floats() const {
    return 2 * size_t(n) * kChunk + size_t(kBwdWarps) * 2 * kChunk + 2 * size_t(n) * kChunk + size_t(cpb) * n;
  }
  __host__ __device__ size_t bytes() const { return sizeof(double) * doubles() + sizeof(float) * floats(); }
};

template <typename T>
__global__ void __launch_bounds__(kBwdThreads, 2)
    chunked_backward_kernel(const SelectiveScanParams p, int64_t bpg, int iters, bool vec, bool bc_vec, float* ws_bc, float* ws_a,
                            float* ws_d, float* ws_bias) {
  constexpr int R = kBwdR, K = kBwdK;
  const int N = static_cast<int>(p.dstate), cpb = kBwdChannels * iters;
  const BackwardSmem layout{cpb, N};
  extern __shared__ __align__(16) double smem_d[];
  double* s_dA = smem_d;
  double* s_dD = s_dA + size_t(cpb) * N;
  double* s_db = s_dD + cpb;
  float* s_B = reinterpret_cast<float*>(smem_d + layout.doubles());  // 16-byte aligned: doubles() is even
  float* s_C = s_B + N * kChunk;
  float* s_red = s_C + N * kChunk;
  float* s_acc = s_red + kBwdWarps * 2 * kChunk;
  float* s_g = s_acc + 2 * N * kChunk;

  const Place w = place(p, bpg, cpb);
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, p0 = lane * K;
  const int64_t L = p.seqlen, D = p.dim, chunks = state_chunks(L);
  const bool has_z = p.z.data != nullptr;
  for (int i = tid; i < cpb * N; i += kBwdThreads) s_dA[i] = 0.0, s_g[i] = 0.0f;
  for (int i = tid; i < cpb; i += kBwdThreads) s_dD[i] = 0.0, s_db[i] = 0.0;

  for (int64_t c = chunks - 1; c >= 0; --c) {
    const int64_t l0 = c * kChunk;
    const int len = static_cast<int>(min64(kChunk, L - l0));
    __syncthreads();  // the previous chunk's reads of s_B, s_C, s_acc (and the zeroing above) are done
    for (int i = tid; i < 2 * N * kChunk; i += kBwdThreads) s_acc[i] = 0.0f;
    stage_bc<T, K, kBwdThreads>(p, w.b, w.g, l0, len, l0 - kChunk, bc_vec, s_B, s_C);
    for (int it = 0; it < iters; ++it) {
      const int ch = it * kBwdChannels + warp;
      const bool active = ch < w.kc;
      const int64_t d = w.d0 + (active ? ch : 0);
      const int valid = active ? len : 0;
      const float Dd = active && p.D ? p.D[d] : 0.0f;
      // Per position: dt, dt u, dy = dout silu(z) (dout without z); y, sum_n g B, sum_n A g a h.
      float dt[K], dtu[K], dy[K], y[K], sgb[K], sagx[K], sdt = 0.0f;
      {
        float u[K], raw[K], go[K];
        load_run<T, K>(p.u.at<T>(w.b, d) + l0, p0, valid, vec, u);
        load_run<T, K>(p.delta.at<T>(w.b, d) + l0, p0, valid, vec, raw);
        load_run<T, K>(p.dout.at<T>(w.b, d) + l0, p0, valid, vec, go);
        if (ch + kBwdChannels < w.kc && p0 < len) {  // the rows of this warp's next channel
          const int64_t dn = d + kBwdChannels;
          prefetch_l2(p.u.at<T>(w.b, dn) + l0 + p0);
          prefetch_l2(p.delta.at<T>(w.b, dn) + l0 + p0);
          prefetch_l2(p.dout.at<T>(w.b, dn) + l0 + p0);
          if (has_z) prefetch_l2(p.z.at<T>(w.b, dn) + l0 + p0);
        }
        const float bias = active && p.delta_bias ? p.delta_bias[d] : 0.0f;
#pragma unroll
        for (int k = 0; k < K; ++k) {
          dt[k] = p0 + k < valid ? step_fast(p, raw[k] + bias) : 0.0f;
          dtu[k] = dt[k] * u[k];
          dy[k] = go[k];
          y[k] = 0.0f, sgb[k] = 0.0f, sagx[k] = 0.0f;
          sdt += dt[k];
        }
        if (has_z) {
          float z[K];
          load_run<T, K>(p.z.at<T>(w.b, d) + l0, p0, valid, vec, z);
#pragma unroll
          for (int k = 0; k < K; ++k) dy[k] *= fast_silu(z[k]);
        }
      }
      // Lane n holds state n's entry to the chunk (saved by the forward), carry from the next chunk, A.
      const int64_t i_bd = w.b * D + d;
      const float h0v = active && c > 0 && lane < N ? p.states[(i_bd * chunks + c - 1) * N + lane] : 0.0f;
      const float gcv = lane < N ? s_g[ch * N + lane] : 0.0f;
      const float Av = active && lane < N ? p.A[d * N + lane] : 0.0f;
      __syncwarp();  // read before lane 0 writes the new carries below
      float dA_prev = 0.0f;  // the lane's share of the previous state's dA
      for (int n = 0; n < N; ++n) {
        const float A = __shfl_sync(kFull, Av, n), A2 = A * kLog2e;
        float a[K], bv[K], cv[K], h[K];
        load_row<K>(s_B + n * kChunk, lane, bv);
        load_row<K>(s_C + n * kChunk, lane, cv);
        float H = 0.0f, G = 0.0f;
#pragma unroll
        for (int k = 0; k < K; ++k) {
          a[k] = exp2_approx(dt[k] * A2);
          H = fmaf(a[k], H, dtu[k] * bv[k]);
        }
#pragma unroll
        for (int k = K - 1; k >= 0; --k) G = a[k] * fmaf(dy[k], cv[k], G);  // a_k g_k with no carry in
        float Pf = exp2_approx(A2 * sdt), Pr = Pf;
        scan_up<R>(Pf, H, lane);
        scan_down<R>(Pr, G, lane);
        const float hin = enter_up<R>(Pf, H, lane, __shfl_sync(kFull, h0v, n));
        const float cin = enter_down<R>(Pr, G, lane, __shfl_sync(kFull, gcv, n));
        // The two recurrences over the lane's positions, independent of each other: h forward, g back.
        float hp = hin, carry = cin, g[K];
#pragma unroll
        for (int k = 0; k < K; ++k) {
          h[k] = fmaf(dtu[k], bv[k], a[k] * hp);
          y[k] = fmaf(cv[k], h[k], y[k]);
          hp = h[k];
          const int j = K - 1 - k;
          g[j] = fmaf(dy[j], cv[j], carry);
          carry = a[j] * g[j];
        }
        if (lane == 0) s_g[ch * N + n] = carry;  // a g at the chunk's first position
        // The previous state's dA, summed over the warp here, off this state's path to the barrier.
        if (n > 0) {
          dA_prev = kc::warp_sum(dA_prev);
          if (active && lane == 0) s_dA[ch * N + n - 1] += dA_prev;
        }
        float dA = 0.0f, dB[K], dC[K];
#pragma unroll
        for (int k = 0; k < K; ++k) {
          const float gx = g[k] * (a[k] * (k > 0 ? h[k - 1] : hin));  // g a_l h_{l-1}
          sagx[k] = fmaf(A, gx, sagx[k]);
          dA = fmaf(gx, dt[k], dA);
          sgb[k] = fmaf(g[k], bv[k], sgb[k]);
          dB[k] = g[k] * dtu[k];
          dC[k] = dy[k] * h[k];
        }
        dA_prev = dA;
        float* red = s_red + warp * 2 * kChunk;
#pragma unroll
        for (int j = 0; j < K / 4; ++j) {
          *reinterpret_cast<float4*>(red + j * 4 * R + 4 * lane) = make_float4(dB[4 * j], dB[4 * j + 1], dB[4 * j + 2], dB[4 * j + 3]);
          *reinterpret_cast<float4*>(red + kChunk + j * 4 * R + 4 * lane) =
              make_float4(dC[4 * j], dC[4 * j + 1], dC[4 * j + 2], dC[4 * j + 3]);
        }
        __syncthreads();  // the warps' rows are in
        if (tid < 2 * kChunk / 4) {  // thread tid adds slots 4 tid .. 4 tid + 3 (dB's for tid < 64, dC's after)
          const int e = 4 * tid, kind = e / kChunk, s = e % kChunk;
          float4 sum = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
          for (int wp = 0; wp < kBwdWarps; ++wp) {
            const float4 v = *reinterpret_cast<const float4*>(s_red + (wp * 2 + kind) * kChunk + s);
            sum.x += v.x, sum.y += v.y, sum.z += v.z, sum.w += v.w;
          }
          float4* acc = reinterpret_cast<float4*>(s_acc + (kind * N + n) * kChunk + s);
          float4 t = *acc;
          t.x += sum.x, t.y += sum.y, t.z += sum.z, t.w += sum.w;
          *acc = t;
        }
        __syncthreads();  // s_red free again
      }
      dA_prev = kc::warp_sum(dA_prev);
      if (active && lane == 0) s_dA[ch * N + N - 1] += dA_prev;
      if (active) {
        // Reloaded rather than kept through the loop over the states (registers): u, delta, z.
        float u[K], raw[K], du[K], dd[K];
        load_run<T, K>(p.u.at<T>(w.b, d) + l0, p0, valid, vec, u);
        load_run<T, K>(p.delta.at<T>(w.b, d) + l0, p0, valid, vec, raw);
        const float bias = p.delta_bias ? p.delta_bias[d] : 0.0f;
        float sum_d = 0.0f, sum_bias = 0.0f;
#pragma unroll
        for (int k = 0; k < K; ++k) {
          du[k] = fmaf(Dd, dy[k], dt[k] * sgb[k]);
          const float ddt = fmaf(u[k], sgb[k], sagx[k]);
          dd[k] = p0 + k < valid ? (p.delta_softplus ? ddt * fast_dsoftplus(raw[k] + bias) : ddt) : 0.0f;
          sum_d = fmaf(dy[k], u[k], sum_d);
          sum_bias += dd[k];
        }
        store_run<T, K>(p.du.mut<T>(w.b, d) + l0, p0, valid, vec, du);
        store_run<T, K>(p.ddelta.mut<T>(w.b, d) + l0, p0, valid, vec, dd);
        if (has_z) {  // dz = dout silu'(z) (y + D u)
          float z[K], go[K];
          load_run<T, K>(p.z.at<T>(w.b, d) + l0, p0, valid, vec, z);
          load_run<T, K>(p.dout.at<T>(w.b, d) + l0, p0, valid, vec, go);
#pragma unroll
          for (int k = 0; k < K; ++k) go[k] *= fast_dsilu(z[k]) * fmaf(Dd, u[k], y[k]);
          store_run<T, K>(p.dz.mut<T>(w.b, d) + l0, p0, valid, vec, go);
        }
        sum_d = kc::warp_sum(sum_d);
        sum_bias = kc::warp_sum(sum_bias);
        if (lane == 0) s_dD[ch] += sum_d, s_db[ch] += sum_bias;
      }
    }
    __syncthreads();  // s_acc complete
    const int64_t row0 = (((w.cb * p.batch + w.b) * p.groups + w.g) * 2) * N;
    for (int e = tid; e < 2 * N * kChunk; e += kBwdThreads) {
      const int q = e % kChunk;
      if (q < len) ws_bc[(row0 + e / kChunk) * L + l0 + q] = s_acc[e - q + slot<K>(q)];
    }
  }
  __syncthreads();
  for (int e = tid; e < w.kc * N; e += kBwdThreads) ws_a[(w.b * D + w.d0) * N + e] = static_cast<float>(s_dA[e]);
  for (int e = tid; e < w.kc; e += kBwdThreads) {
    ws_d[w.b * D + w.d0 + e] = static_cast<float>(s_dD[e]);
    ws_bias[w.b * D + w.d0 + e] = static_cast<float>(s_db[e]);
  }
}

// dB, dC of each (batch, group, position): the blocks' partial sums added in block order (f64), back
// through the norm, rounded once.
template <typename T>
__global__ void reduce_bc_kernel(const SelectiveScanParams p, int64_t bpg, const float* ws_bc) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const int64_t L = p.seqlen, G = p.groups;
  const int N = static_cast<int>(p.dstate);
  if (i >= p.batch * G * L) return;
  const int64_t l = i % L, g = i / L % G, b = i / (L * G);
  for (int kind = 0; kind < 2; ++kind) {
    float gr[kMaxStates];
#pragma unroll
    for (int n = 0; n < kMaxStates; ++n) {
      double s = 0.0;
      if (n < N)
        for (int64_t cb = 0; cb < bpg; ++cb) s += ws_bc[((((cb * p.batch + b) * G + g) * 2 + kind) * N + n) * L + l];
      gr[n] = static_cast<float>(s);
    }
    const GroupSeq& src = kind == 0 ? p.B : p.C;
    const GroupSeq& dst = kind == 0 ? p.dB : p.dC;
    if (p.bc_norm) {
      float nr[kMaxStates], ss = 0.0f;
#pragma unroll
      for (int n = 0; n < kMaxStates; ++n) {
        nr[n] = n < N ? kc::to_f32(src.at<T>(b, g, n)[l]) : 0.0f;
        ss += nr[n] * nr[n];
      }
      const float r = 1.0f / sqrtf(ss / N + p.bc_eps);
      float m = 0.0f;
#pragma unroll
      for (int n = 0; n < kMaxStates; ++n) nr[n] *= r, m += gr[n] * nr[n];
      m /= N;
#pragma unroll
      for (int n = 0; n < kMaxStates; ++n) gr[n] = r * (gr[n] - nr[n] * m);
    }
#pragma unroll
    for (int n = 0; n < kMaxStates; ++n)
      if (n < N) dst.mut<T>(b, g, n)[l] = kc::from_f32<T>(gr[n]);
  }
}

// dA [D, N], dD and ddelta_bias [D]: the per-batch sums added in batch order.
__global__ void reduce_params_kernel(const SelectiveScanParams p, const float* ws_a, const float* ws_d, const float* ws_bias) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x, D = p.dim, N = p.dstate;
  if (i < D * N) {
    double s = 0.0;
    for (int64_t b = 0; b < p.batch; ++b) s += ws_a[b * D * N + i];
    p.dA[i] = static_cast<float>(s);
  } else if (i < D * N + D) {
    const int64_t d = i - D * N;
    double sd = 0.0, sb = 0.0;
    for (int64_t b = 0; b < p.batch; ++b) sd += ws_d[b * D + d], sb += ws_bias[b * D + d];
    if (p.dD) p.dD[d] = static_cast<float>(sd);
    if (p.ddelta_bias) p.ddelta_bias[d] = static_cast<float>(sb);
  }
}

template <typename T>
__global__ void state_update_kernel(const StateUpdateParams p) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= p.batch * p.dim) return;
  const int64_t b = i / p.dim, d = i % p.dim, g = d / (p.dim / p.groups), N = p.dstate;
  const T* Bp = static_cast<const T*>(p.B) + b * p.B_sb + g * p.B_sg;
  const T* Cp = static_cast<const T*>(p.C) + b * p.C_sb + g * p.C_sg;
  float rb = 1.0f, rc = 1.0f;
  if (p.bc_norm) {
    float sb = 0.0f, sc = 0.0f;
    for (int64_t n = 0; n < N; ++n) {
      const float bv = kc::to_f32(Bp[n]), cv = kc::to_f32(Cp[n]);
      sb += bv * bv, sc += cv * cv;
    }
    rb = 1.0f / sqrtf(sb / N + p.bc_eps), rc = 1.0f / sqrtf(sc / N + p.bc_eps);
  }
  const float raw = kc::to_f32(static_cast<const T*>(p.dt)[b * p.dt_sb + d * p.dt_sd]) + (p.dt_bias ? p.dt_bias[d] : 0.0f);
  const float dt = p.dt_softplus ? softplus(raw) : raw;
  const float x = kc::to_f32(static_cast<const T*>(p.x)[b * p.x_sb + d * p.x_sd]), dtu = dt * x;
  float* h = p.state + b * p.state_sb + d * p.state_sd;
  const float* A = p.A + d * N;
  float y = 0.0f;
  for (int64_t n = 0; n < N; ++n) {
    const float hn = expf(dt * A[n]) * h[n] + dtu * (kc::to_f32(Bp[n]) * rb);
    h[n] = hn;
    y += kc::to_f32(Cp[n]) * rc * hn;
  }
  y += (p.D ? p.D[d] : 0.0f) * x;
  if (p.z) y *= silu(kc::to_f32(static_cast<const T*>(p.z)[b * p.z_sb + d * p.z_sd]));
  static_cast<T*>(p.out)[b * p.out_sb + d * p.out_sd] = kc::from_f32<T>(y);
}

// Which kernels run (read at every call): KCPP_SCAN_LEGACY=1 the sequential ones, KCPP_SCAN_CHUNKED=1
// the chunked ones, KCPP_SCAN_LANES=1 the state-lane ones, each both ways (the state-lane backward where
// the device gives a block its shared memory, else the chunked one); else the fastest of each direction
// as measured (bench/RESULTS.md): the state-lane forward, the chunked backward.  The saved states are
// the contract's whichever forward wrote them.
enum class Path { lanes, chunked, legacy };
bool env_is_1(const char* name) {
  const char* e = std::getenv(name);
  return e && e[0] == '1' && e[1] == '\0';
}
Path path(bool backward) {
  if (env_is_1("KCPP_SCAN_LEGACY")) return Path::legacy;
  if (env_is_1("KCPP_SCAN_CHUNKED")) return Path::chunked;
  if (env_is_1("KCPP_SCAN_LANES") && (!backward || lanes_backward_fits())) return Path::lanes;
  return backward ? Path::chunked : Path::lanes;
}

// Whether every row of these views starts on a 16-byte boundary (16-byte loads of a lane's run).
bool rows_aligned(size_t elem, std::initializer_list<Seq> seqs) {
  const int64_t v = static_cast<int64_t>(16 / elem);
  for (const Seq& s : seqs)
    if (s.data && (!kc::aligned16(s.data) || s.sb % v != 0 || s.sr % v != 0)) return false;
  return true;
}
bool rows_aligned(size_t elem, std::initializer_list<GroupSeq> seqs) {
  const int64_t v = static_cast<int64_t>(16 / elem);
  for (const GroupSeq& s : seqs)
    if (s.data && (!kc::aligned16(s.data) || s.sb % v != 0 || s.sg % v != 0 || s.sn % v != 0)) return false;
  return true;
}

// How many channel slots a block's channels fill (`iters` times kChannels) and blocks a group: a block
// takes up to max_iters slots' worth while the grid keeps `target` blocks.
struct Plan {
  int iters;
  int64_t bpg;
};
Plan plan(const SelectiveScanParams& p, int channels, int max_iters, int64_t target) {
  const int64_t per_group = p.dim / p.groups, slots = (per_group + channels - 1) / channels;
  const int64_t iters = std::clamp<int64_t>(p.batch * p.groups * slots / target, 1, std::min<int64_t>(max_iters, slots));
  const int64_t cpb = channels * iters;
  return {static_cast<int>(iters), (per_group + cpb - 1) / cpb};
}
Plan backward_plan(const SelectiveScanParams& p, Path path) {
  switch (path) {
    case Path::legacy: return Plan{1, legacy_blocks_per_group(p)};
    case Path::lanes: return Plan{1, lanes_blocks_per_group(p)};
    case Path::chunked: break;
  }
  return plan(p, kBwdChannels, kBwdMaxIters, kBwdTargetBlocks);
}

// The backward's workspace, in floats: the blocks' dB / dC rows [bpg][B][G][2][N][L], then dA [B][D][N],
// dD and ddelta_bias [B][D] per batch.
struct BackwardWorkspace {
  size_t bc, a, d;
};
BackwardWorkspace workspace_parts(const SelectiveScanParams& p, int64_t bpg) {
  const size_t bc = size_t(bpg) * p.batch * p.groups * 2 * p.dstate * p.seqlen;
  return {bc, size_t(p.batch) * p.dim * p.dstate, size_t(p.batch) * p.dim};
}

template <typename T>
const char* launch_chunked_backward(const SelectiveScanParams& p, const Plan& pl, float* ws_bc, float* ws_a, float* ws_d,
                                    float* ws_bias, cudaStream_t stream) {
  const size_t smem = BackwardSmem{kBwdChannels * pl.iters, static_cast<int>(p.dstate)}.bytes();
  const cudaError_t attr =
      cudaFuncSetAttribute(chunked_backward_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (attr != cudaSuccess)
    return kernel::errorf("selective_scan backward: cannot reserve %zu bytes of shared memory: %s", smem,
                          cudaGetErrorString(attr));
  const size_t elem = sizeof(T);
  const bool vec = rows_aligned(elem, {p.u, p.delta, p.z, p.dout, p.du, p.ddelta, p.dz});
  const bool bc_vec = rows_aligned(elem, {p.B, p.C});
  chunked_backward_kernel<T><<<static_cast<unsigned>(p.batch * p.groups * pl.bpg), kBwdThreads, smem, stream>>>(
      p, pl.bpg, pl.iters, vec, bc_vec, ws_bc, ws_a, ws_d, ws_bias);
  return kc::launch_error("selective_scan backward");
}

}  // namespace

const char* selective_scan_cuda_unsupported(const SelectiveScanParams& p) {
  if (p.dstate > kMaxStates)
    return kernel::errorf("selective_scan: the CUDA kernels take N <= %d states a channel (A has %lld)", kMaxStates,
                          static_cast<long long>(p.dstate));
  return nullptr;
}

size_t selective_scan_backward_workspace(const SelectiveScanParams& p) {
  if (selective_scan_cuda_unsupported(p) || p.batch * p.dim * p.seqlen == 0 || p.groups < 1 || p.dim % p.groups != 0) return 0;
  const BackwardWorkspace parts = workspace_parts(p, backward_plan(p, path(true)).bpg);
  return sizeof(float) * (parts.bc + parts.a + 2 * parts.d);
}

const char* selective_scan_forward_cuda(const SelectiveScanParams& p, cudaStream_t stream) {
  if (const char* e = selective_scan_check(p, false)) return e;
  if (const char* e = selective_scan_cuda_unsupported(p)) return e;
  if (p.batch * p.dim == 0) return nullptr;
  if (p.seqlen == 0) {
    if (p.last_state) cudaMemsetAsync(p.last_state, 0, sizeof(float) * p.batch * p.dim * p.dstate, stream);
    return kc::launch_error("selective_scan forward");
  }
  const Path which = path(false);
  if (which == Path::legacy) return legacy_forward(p, stream);
  if (which == Path::lanes) return lanes_forward(p, stream);
  const Plan pl = plan(p, kFwdChannels, kFwdMaxIters, kFwdTargetBlocks);
  const unsigned grid = static_cast<unsigned>(p.batch * p.groups * pl.bpg);
  return kc::with_float_dtype(p.dtype, "selective_scan", [&]<typename T>(T*) -> const char* {
    const bool vec = rows_aligned(sizeof(T), {p.u, p.delta, p.z, p.out});
    const bool bc_vec = rows_aligned(sizeof(T), {p.B, p.C});
    chunked_forward_kernel<T><<<grid, kFwdThreads, 0, stream>>>(p, pl.bpg, pl.iters, vec, bc_vec);
    return kc::launch_error("selective_scan forward");
  });
}

const char* selective_scan_backward_cuda(const SelectiveScanParams& p, cudaStream_t stream) {
  if (const char* e = selective_scan_check(p, true)) return e;
  if (const char* e = selective_scan_cuda_unsupported(p)) return e;
  if (p.dim == 0) return nullptr;
  if (p.batch * p.seqlen == 0) {  // no position: the parameters' gradients are 0
    cudaMemsetAsync(p.dA, 0, sizeof(float) * p.dim * p.dstate, stream);
    if (p.dD) cudaMemsetAsync(p.dD, 0, sizeof(float) * p.dim, stream);
    if (p.ddelta_bias) cudaMemsetAsync(p.ddelta_bias, 0, sizeof(float) * p.dim, stream);
    return kc::launch_error("selective_scan backward");
  }
  if (!p.workspace) return "selective_scan backward: no workspace (selective_scan_backward_workspace(p) bytes)";
  const Path which = path(true);
  const Plan pl = backward_plan(p, which);
  const BackwardWorkspace parts = workspace_parts(p, pl.bpg);
  const size_t need = sizeof(float) * (parts.bc + parts.a + 2 * parts.d);
  if (p.workspace_bytes < need)
    return kernel::errorf("selective_scan backward: the workspace holds %zu bytes, this call needs %zu "
                          "(selective_scan_backward_workspace(p), queried with the same KCPP_SCAN_* variables)",
                          p.workspace_bytes, need);
  float* ws = static_cast<float*>(p.workspace);
  float *ws_bc = ws, *ws_a = ws + parts.bc, *ws_d = ws_a + parts.a, *ws_bias = ws_d + parts.d;
  return kc::with_float_dtype(p.dtype, "selective_scan", [&]<typename T>(T*) -> const char* {
    const char* e = which == Path::legacy  ? legacy_backward_blocks(p, pl.bpg, ws_bc, ws_a, ws_d, ws_bias, stream)
                    : which == Path::lanes ? lanes_backward_blocks(p, pl.bpg, ws_bc, ws_a, ws_d, ws_bias, stream)
                                           : launch_chunked_backward<T>(p, pl, ws_bc, ws_a, ws_d, ws_bias, stream);
    if (e) return e;
    const int64_t rows = p.batch * p.groups * p.seqlen;
    reduce_bc_kernel<T><<<static_cast<unsigned>((rows + 255) / 256), 256, 0, stream>>>(p, pl.bpg, ws_bc);
    const int64_t params = p.dim * p.dstate + p.dim;
    reduce_params_kernel<<<static_cast<unsigned>((params + 255) / 256), 256, 0, stream>>>(p, ws_a, ws_d, ws_bias);
    return kc::launch_error("selective_scan backward");
  });
}

const char* selective_state_update_cuda(const StateUpdateParams& p, cudaStream_t stream) {
  if (const char* e = state_update_check(p)) return e;
  const int64_t n = p.batch * p.dim;
  if (n == 0) return nullptr;
  return kc::with_float_dtype(p.dtype, "selective_scan", [&]<typename T>(T*) -> const char* {
    state_update_kernel<T><<<static_cast<unsigned>((n + 127) / 128), 128, 0, stream>>>(p);
    return kc::launch_error("selective_state_update");
  });
}

}  // namespace kcpp::mamba
