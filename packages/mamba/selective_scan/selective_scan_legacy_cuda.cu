// The sequential selective scan on CUDA, kept beside the chunked kernels of selective_scan_cuda.cu for
// comparison: KCPP_SCAN_LEGACY=1 selects it (maths, saved states and layout in selective_scan.h).  Each
// thread walks a channel's whole sequence, position after position.
//
// A block per (batch, group, kKC channels of the group), TPC = 1, 2 or 4 threads a channel (N <= 4, 8
// or 16), each holding 4 states in registers; states past N hold zeros (A = B = C = 0 there), channels
// past the group's end zeros too, so every thread of a block runs the same loop (the shuffles need it).
// Positions go through shared memory in tiles of kTile: per (channel, position) u, dt (bias and
// softplus applied) and the gate's factors widened to f32; per position B and C, normalised there.
// The decay is exp2(dt * A log2 e) on the special-function unit.
//
// Forward: each thread steps its 4 states through the tile; the channel's TPC partial sums of y meet
// through shuffles; the channel's first thread writes out into a tile that is stored coalesced.
//
// Backward: chunk after chunk from the last (kStateChunk positions; the forward saved the state before
// each), in two passes over the chunk's tiles.  Pass 1 runs the recurrence forward from the saved
// state and keeps the state at every kSub-th position in shared memory.  Pass 2 walks the tiles
// backward and, in each, the sub-chunks of kSub positions from the last: the sub-chunk's decays a_l and
// a_l h_{l-1} are recomputed into registers from its checkpoint, then the reverse scan runs over them
// with g carried in registers from position to position, sub-chunk to sub-chunk, chunk to chunk.
// Sums over the states (y, sum g B, ddt) meet across the channel's TPC threads, kSub positions at a time
// (a transposing butterfly: each step halves the values a lane holds); sums over channels (dB, dC) across
// the warp the same way, then across the block's warps in shared memory.  The block writes its partial
// dB, dC rows and its per-(batch, channel) dA, dD, ddelta_bias to the workspace, in the layout of
// selective_scan_cuda.cu's BackwardWorkspace, whose two reduction kernels add them up.
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

constexpr int kKC = 32;          // channels a block
constexpr int kTile = 32;        // positions a tile
constexpr int kRow = kTile + 1;  // padded row of a per-channel tile
constexpr int kSub = 8;          // backward: positions held in registers
constexpr int kSubsPerChunk = static_cast<int>(kStateChunk) / kSub;
static_assert(kStateChunk % kTile == 0 && kTile % kSub == 0, "a chunk is whole tiles, a tile whole sub-chunks");

int threads_per_channel(int64_t n) { return n <= 4 ? 1 : n <= 8 ? 2 : 4; }
__host__ __device__ __forceinline__ int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

// Sums v over the channel's TPC lanes (lane bits 0 .. log2 TPC - 1), V values at once: step k pairs the
// lanes that differ in bit k; each keeps the half of the values its bit selects (the upper half for 1)
// and adds the partner's copy of that half.  Afterwards v[0 .. V / TPC) hold complete sums, of the
// original values reduced_index(sg, i).
template <int V, int TPC>
__device__ __forceinline__ void lane_reduce(float (&v)[V], int sg) {
#pragma unroll
  for (int k = 0; (1 << k) < TPC; ++k) {
    const int mask = 1 << k, half = V >> (k + 1);
    const bool upper = (sg & mask) != 0;
#pragma unroll
    for (int i = 0; i < half; ++i) {
      const float send = upper ? v[i] : v[i + half];
      const float keep = upper ? v[i + half] : v[i];
      v[i] = keep + __shfl_xor_sync(kFull, send, mask);
    }
  }
}
template <int V, int TPC>
__device__ __forceinline__ int reduced_index(int sg, int i) {
  int base = 0;
#pragma unroll
  for (int k = 0; (1 << k) < TPC; ++k)
    if (sg & (1 << k)) base += V >> (k + 1);
  return base + i;
}

// Sums 8 values over the warp's channels (lane bits log2 TPC .. 4): three halving steps as lane_reduce,
// then plain ones.  Returns the sum of the original value 4 b0 + 2 b1 + b2 (b_k: bit k of the lane's
// channel within the warp); lanes whose channel is 8 or more return copies.
template <int TPC>
__device__ __forceinline__ float channel_reduce8(float (&v)[8], int lane) {
#pragma unroll
  for (int k = 0; k < 3; ++k) {
    const int mask = TPC << k, half = 4 >> k;
    const bool upper = (lane & mask) != 0;
#pragma unroll
    for (int i = 0; i < half; ++i) {
      const float send = upper ? v[i] : v[i + half];
      const float keep = upper ? v[i + half] : v[i];
      v[i] = keep + __shfl_xor_sync(kFull, send, mask);
    }
  }
#pragma unroll
  for (int mask = TPC << 3; mask < 32; mask <<= 1) v[0] += __shfl_xor_sync(kFull, v[0], mask);
  return v[0];
}

// B and C of the tile [l0, l0 + tl) as [kTile][NP] f32 (zeros past N and tl), normalised under bc_norm.
// Ends with the tile ready (a barrier).
template <typename T, int NT, int NP>
__device__ void load_bc(const SelectiveScanParams& p, const Place& w, int64_t l0, int tl, float (*s_B)[NP], float (*s_C)[NP]) {
  const int n_states = static_cast<int>(p.dstate);
  for (int e = threadIdx.x; e < NP * kTile; e += NT) {
    const int n = e / kTile, t = e % kTile;
    float bv = 0.0f, cv = 0.0f;
    if (n < n_states && t < tl) {
      bv = kc::to_f32(p.B.at<T>(w.b, w.g, n)[l0 + t]);
      cv = kc::to_f32(p.C.at<T>(w.b, w.g, n)[l0 + t]);
    }
    s_B[t][n] = bv;
    s_C[t][n] = cv;
  }
  __syncthreads();
  if (!p.bc_norm) return;
  for (int t = threadIdx.x; t < tl; t += NT) {  // the padding past tl stays 0
    float sb = 0.0f, sc = 0.0f;
    for (int n = 0; n < n_states; ++n) sb += s_B[t][n] * s_B[t][n], sc += s_C[t][n] * s_C[t][n];
    const float rb = 1.0f / sqrtf(sb / n_states + p.bc_eps), rc = 1.0f / sqrtf(sc / n_states + p.bc_eps);
    for (int n = 0; n < n_states; ++n) s_B[t][n] *= rb, s_C[t][n] *= rc;
  }
  __syncthreads();
}

// The forward's per-(channel, position) tile: u, dt and the gate silu(z) (1 without z); zeros past the
// block's channels and the tile's positions.
template <typename T, int NT>
__device__ void load_forward_rows(const SelectiveScanParams& p, const Place& w, int64_t l0, int tl, float (*s_u)[kRow],
                                  float (*s_dt)[kRow], float (*s_gate)[kRow]) {
  for (int e = threadIdx.x; e < kKC * kTile; e += NT) {
    const int r = e / kTile, t = e % kTile;
    float u = 0.0f, dt = 0.0f, gate = 1.0f;
    if (r < w.kc && t < tl) {
      const int64_t d = w.d0 + r, l = l0 + t;
      u = kc::to_f32(p.u.at<T>(w.b, d)[l]);
      dt = step_of(p, kc::to_f32(p.delta.at<T>(w.b, d)[l]) + (p.delta_bias ? p.delta_bias[d] : 0.0f));
      if (p.z.data) gate = silu(kc::to_f32(p.z.at<T>(w.b, d)[l]));
    }
    s_u[r][t] = u, s_dt[r][t] = dt, s_gate[r][t] = gate;
  }
}

// The backward's: u, dt, softplus' at the raw step (1 without softplus), dy = dout silu(z) and
// gz = dout silu'(z) (dout and 0 without z).  With `all` false, u and dt only.
template <typename T, int NT>
__device__ void load_backward_rows(const SelectiveScanParams& p, const Place& w, int64_t l0, int tl, bool all, float (*s_u)[kRow],
                                   float (*s_dt)[kRow], float (*s_dsp)[kRow], float (*s_dy)[kRow], float (*s_gz)[kRow]) {
  for (int e = threadIdx.x; e < kKC * kTile; e += NT) {
    const int r = e / kTile, t = e % kTile;
    float u = 0.0f, dt = 0.0f, dsp = 0.0f, dy = 0.0f, gz = 0.0f;
    if (r < w.kc && t < tl) {
      const int64_t d = w.d0 + r, l = l0 + t;
      u = kc::to_f32(p.u.at<T>(w.b, d)[l]);
      const float raw = kc::to_f32(p.delta.at<T>(w.b, d)[l]) + (p.delta_bias ? p.delta_bias[d] : 0.0f);
      dt = step_of(p, raw);
      if (all) {
        dsp = p.delta_softplus ? dsoftplus(raw) : 1.0f;
        const float go = kc::to_f32(p.dout.at<T>(w.b, d)[l]);
        if (p.z.data) {
          const float z = kc::to_f32(p.z.at<T>(w.b, d)[l]);
          dy = go * silu(z), gz = go * dsilu(z);
        } else {
          dy = go;
        }
      }
    }
    s_u[r][t] = u, s_dt[r][t] = dt;
    if (all) s_dsp[r][t] = dsp, s_dy[r][t] = dy, s_gz[r][t] = gz;
  }
}

__device__ __forceinline__ void unpack(const float4 v, float (&out)[4]) {
  out[0] = v.x, out[1] = v.y, out[2] = v.z, out[3] = v.w;
}

template <typename T, int TPC>
__global__ void __launch_bounds__(32 * TPC, 8) scan_forward_kernel(const SelectiveScanParams p, int64_t bpg) {
  constexpr int NT = 32 * TPC, NP = 4 * TPC;
  __shared__ float s_u[kKC][kRow], s_dt[kKC][kRow], s_gate[kKC][kRow], s_out[kKC][kRow];
  __shared__ __align__(16) float s_B[kTile][NP];
  __shared__ __align__(16) float s_C[kTile][NP];
  const Place w = place(p, bpg, kKC);
  const int c = threadIdx.x / TPC, sg = threadIdx.x % TPC;
  const int64_t N = p.dstate, L = p.seqlen, d = w.d0 + c, chunks = state_chunks(L);
  const bool active = c < w.kc;
  float A2[4], h[4];
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    const int n = 4 * sg + s;
    A2[s] = active && n < N ? p.A[d * N + n] * kLog2e : 0.0f;
    h[s] = 0.0f;
  }
  const float Dd = active && p.D ? p.D[d] : 0.0f;
  for (int64_t l0 = 0; l0 < L; l0 += kTile) {
    const int tl = static_cast<int>(min64(kTile, L - l0));
    __syncthreads();  // the previous tile's reads are done
    load_forward_rows<T, NT>(p, w, l0, tl, s_u, s_dt, s_gate);
    load_bc<T, NT, NP>(p, w, l0, tl, s_B, s_C);
    for (int t = 0; t < tl; ++t) {
      const float dt = s_dt[c][t], u = s_u[c][t], dtu = dt * u;
      float bb[4], cc[4];
      unpack(*reinterpret_cast<const float4*>(&s_B[t][4 * sg]), bb);
      unpack(*reinterpret_cast<const float4*>(&s_C[t][4 * sg]), cc);
      float y = 0.0f;
#pragma unroll
      for (int s = 0; s < 4; ++s) {
        h[s] = exp2_approx(dt * A2[s]) * h[s] + dtu * bb[s];
        y += cc[s] * h[s];
      }
#pragma unroll
      for (int o = TPC / 2; o > 0; o /= 2) y += __shfl_xor_sync(kFull, y, o);
      if (sg == 0) s_out[c][t] = (y + Dd * u) * s_gate[c][t];
    }
    if (p.states && active && ((l0 + tl) % kStateChunk == 0 || l0 + tl == L)) {
      float* st = p.states + ((w.b * p.dim + d) * chunks + (l0 + tl - 1) / kStateChunk) * N;
#pragma unroll
      for (int s = 0; s < 4; ++s)
        if (4 * sg + s < N) st[4 * sg + s] = h[s];
    }
    __syncthreads();
    for (int e = threadIdx.x; e < kKC * kTile; e += NT) {
      const int r = e / kTile, t = e % kTile;
      if (r < w.kc && t < tl) p.out.mut<T>(w.b, w.d0 + r)[l0 + t] = kc::from_f32<T>(s_out[r][t]);
    }
  }
  if (p.last_state && active) {
#pragma unroll
    for (int s = 0; s < 4; ++s)
      if (4 * sg + s < N) p.last_state[(w.b * p.dim + d) * N + 4 * sg + s] = h[s];
  }
}

// The backward's shared memory: checkpoints [kSubsPerChunk][NT] float4, eight per-channel tiles, the B
// and C tiles, the warps' dB / dC sums of a sub-chunk, the block's dB / dC sums of a tile.
template <int TPC>
constexpr size_t backward_smem() {
  constexpr int NT = 32 * TPC, NP = 4 * TPC;
  return sizeof(float) *
         (size_t(kSubsPerChunk) * NT * 4 + 8 * kKC * kRow + 2 * kTile * NP + TPC * kSub * 2 * NP + 2 * NP * kTile);
}

template <typename T, int TPC>
__global__ void __launch_bounds__(32 * TPC)
    scan_backward_kernel(const SelectiveScanParams p, int64_t bpg, float* ws_bc, float* ws_a, float* ws_d, float* ws_bias) {
  constexpr int NT = 32 * TPC, NP = 4 * TPC;
  extern __shared__ __align__(16) float smem[];
  float4* ckpt = reinterpret_cast<float4*>(smem);
  float* at = smem + size_t(kSubsPerChunk) * NT * 4;
  auto rows = [&at]() {
    float(*r)[kRow] = reinterpret_cast<float(*)[kRow]>(at);
    at += kKC * kRow;
    return r;
  };
  float(*s_u)[kRow] = rows();
  float(*s_dt)[kRow] = rows();
  float(*s_dsp)[kRow] = rows();
  float(*s_dy)[kRow] = rows();
  float(*s_gz)[kRow] = rows();
  float(*s_du)[kRow] = rows();
  float(*s_dd)[kRow] = rows();
  float(*s_dz)[kRow] = rows();
  float(*s_B)[NP] = reinterpret_cast<float(*)[NP]>(at);  // 16-byte aligned: every part above is whole float4s
  at += kTile * NP;
  float(*s_C)[NP] = reinterpret_cast<float(*)[NP]>(at);
  at += kTile * NP;
  float* s_wbc = at;  // [TPC warps][kSub][2 NP]
  at += TPC * kSub * 2 * NP;
  float* s_pbc = at;  // [2 NP][kTile]

  const Place w = place(p, bpg, kKC);
  const int tid = threadIdx.x, c = tid / TPC, sg = tid % TPC, lane = tid % 32, warp = tid / 32, cw = lane / TPC;
  const int64_t N = p.dstate, L = p.seqlen, D = p.dim, d = w.d0 + c, chunks = state_chunks(L);
  const bool active = c < w.kc, has_z = p.z.data != nullptr;
  float A2[4], Ar[4], carry[4];
  double dA_acc[4];
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    const int n = 4 * sg + s;
    Ar[s] = active && n < N ? p.A[d * N + n] : 0.0f;
    A2[s] = Ar[s] * kLog2e;
    carry[s] = 0.0f;  // a_{l+1} g_{l+1}
    dA_acc[s] = 0.0;
  }
  const float Dd = active && p.D ? p.D[d] : 0.0f;
  double dD_acc = 0.0, dbias_acc = 0.0;

  for (int64_t ci = chunks - 1; ci >= 0; --ci) {
    const int64_t cl0 = ci * kStateChunk;
    const int clen = static_cast<int>(min64(kStateChunk, L - cl0));
    // Pass 1: the chunk forward from the saved state, a checkpoint every kSub positions.
    float h[4];
#pragma unroll
    for (int s = 0; s < 4; ++s)
      h[s] = ci > 0 && active && 4 * sg + s < N ? p.states[((w.b * D + d) * chunks + ci - 1) * N + 4 * sg + s] : 0.0f;
    for (int t0 = 0; t0 < clen; t0 += kTile) {
      const int tl = min(kTile, clen - t0);
      __syncthreads();
      load_backward_rows<T, NT>(p, w, cl0 + t0, tl, false, s_u, s_dt, s_dsp, s_dy, s_gz);
      load_bc<T, NT, NP>(p, w, cl0 + t0, tl, s_B, s_C);
      for (int j = 0; j < tl; ++j) {
        if (j % kSub == 0) ckpt[((t0 + j) / kSub) * NT + tid] = make_float4(h[0], h[1], h[2], h[3]);
        const float dt = s_dt[c][j], dtu = dt * s_u[c][j];
        float bb[4];
        unpack(*reinterpret_cast<const float4*>(&s_B[j][4 * sg]), bb);
#pragma unroll
        for (int s = 0; s < 4; ++s) h[s] = exp2_approx(dt * A2[s]) * h[s] + dtu * bb[s];
      }
    }
    // Pass 2: the tiles backward, each tile's sub-chunks backward.
    for (int t0 = ((clen - 1) / kTile) * kTile; t0 >= 0; t0 -= kTile) {
      const int tl = min(kTile, clen - t0);
      const int64_t l0 = cl0 + t0;
      __syncthreads();
      load_backward_rows<T, NT>(p, w, l0, tl, true, s_u, s_dt, s_dsp, s_dy, s_gz);
      load_bc<T, NT, NP>(p, w, l0, tl, s_B, s_C);
      for (int sub = (tl - 1) / kSub; sub >= 0; --sub) {
        const int j0 = sub * kSub, sl = min(kSub, tl - j0);
        const float4 hc = ckpt[((t0 + j0) / kSub) * NT + tid];
        float hh[4] = {hc.x, hc.y, hc.z, hc.w};
        float x[kSub][4], a[kSub][4], yp[kSub];
#pragma unroll
        for (int j = 0; j < kSub; ++j) {
          yp[j] = 0.0f;
          if (j < sl) {
            const float dt = s_dt[c][j0 + j], dtu = dt * s_u[c][j0 + j];
            float bb[4], cc[4];
            unpack(*reinterpret_cast<const float4*>(&s_B[j0 + j][4 * sg]), bb);
            unpack(*reinterpret_cast<const float4*>(&s_C[j0 + j][4 * sg]), cc);
#pragma unroll
            for (int s = 0; s < 4; ++s) {
              a[j][s] = exp2_approx(dt * A2[s]);
              x[j][s] = a[j][s] * hh[s];  // a_l h_{l-1}
              hh[s] = x[j][s] + dtu * bb[s];
              yp[j] += cc[s] * hh[s];
            }
          } else {
#pragma unroll
            for (int s = 0; s < 4; ++s) a[j][s] = 0.0f, x[j][s] = 0.0f;
          }
        }
        if (has_z) {  // dz = dout silu'(z) y
          lane_reduce<kSub, TPC>(yp, sg);
#pragma unroll
          for (int i = 0; i < kSub / TPC; ++i) {
            const int j = reduced_index<kSub, TPC>(sg, i);
            if (j < sl) s_dz[c][j0 + j] = s_gz[c][j0 + j] * (yp[i] + Dd * s_u[c][j0 + j]);
          }
        }
        float red[2 * kSub];  // sum_n g B (du) and ddt of each position
        float dA_sub[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int j = kSub - 1; j >= 0; --j) {
          red[j] = 0.0f, red[kSub + j] = 0.0f;
          if (j < sl) {
            const int t = j0 + j;
            const float dt = s_dt[c][t], u = s_u[c][t], dy = s_dy[c][t], dtu = dt * u;
            float bb[4], cc[4], v[8];
            unpack(*reinterpret_cast<const float4*>(&s_B[t][4 * sg]), bb);
            unpack(*reinterpret_cast<const float4*>(&s_C[t][4 * sg]), cc);
#pragma unroll
            for (int s = 0; s < 4; ++s) {
              const float g = dy * cc[s] + carry[s];
              red[kSub + j] += g * (Ar[s] * x[j][s] + bb[s] * u);
              red[j] += g * bb[s];
              dA_sub[s] += g * dt * x[j][s];
              v[s] = g * dtu;                           // dB
              v[4 + s] = dy * (x[j][s] + dtu * bb[s]);  // dC: dy h_l
              carry[s] = a[j][s] * g;
            }
            const float r = channel_reduce8<TPC>(v, lane);
            if (cw < 8) {
              const int idx = 4 * (cw & 1) + 2 * ((cw >> 1) & 1) + ((cw >> 2) & 1);
              s_wbc[(warp * kSub + j) * 2 * NP + (idx >> 2) * NP + 4 * sg + (idx & 3)] = r;
            }
          }
        }
#pragma unroll
        for (int s = 0; s < 4; ++s) dA_acc[s] += dA_sub[s];
        lane_reduce<2 * kSub, TPC>(red, sg);
        float dD_sub = 0.0f, dbias_sub = 0.0f;
#pragma unroll
        for (int i = 0; i < 2 * kSub / TPC; ++i) {
          const int idx = reduced_index<2 * kSub, TPC>(sg, i), j = idx % kSub, t = j0 + j;
          if (j < sl) {
            if (idx < kSub) {
              s_du[c][t] = Dd * s_dy[c][t] + s_dt[c][t] * red[i];
              dD_sub += s_dy[c][t] * s_u[c][t];
            } else {
              const float dd = red[i] * s_dsp[c][t];
              s_dd[c][t] = dd;
              dbias_sub += dd;
            }
          }
        }
        dD_acc += dD_sub, dbias_acc += dbias_sub;
        __syncthreads();  // the warps' dB / dC sums are in
        for (int e = tid; e < kSub * 2 * NP; e += NT) {
          const int j = e / (2 * NP), k = e % (2 * NP);
          if (j < sl) {
            float s = 0.0f;
#pragma unroll
            for (int wp = 0; wp < TPC; ++wp) s += s_wbc[(wp * kSub + j) * 2 * NP + k];
            s_pbc[k * kTile + j0 + j] = s;
          }
        }
        __syncthreads();  // s_wbc free again
      }
      // The tile's du, ddelta, dz, and the block's dB / dC sums.
      for (int e = tid; e < kKC * kTile; e += NT) {
        const int r = e / kTile, t = e % kTile;
        if (r < w.kc && t < tl) {
          const int64_t dr = w.d0 + r;
          p.du.mut<T>(w.b, dr)[l0 + t] = kc::from_f32<T>(s_du[r][t]);
          p.ddelta.mut<T>(w.b, dr)[l0 + t] = kc::from_f32<T>(s_dd[r][t]);
          if (has_z) p.dz.mut<T>(w.b, dr)[l0 + t] = kc::from_f32<T>(s_dz[r][t]);
        }
      }
      for (int e = tid; e < 2 * NP * kTile; e += NT) {
        const int k = e / kTile, t = e % kTile, kind = k / NP, n = k % NP;
        if (n < N && t < tl)
          ws_bc[((((w.cb * p.batch + w.b) * p.groups + w.g) * 2 + kind) * N + n) * L + l0 + t] = s_pbc[k * kTile + t];
      }
    }
  }
  if (active) {
#pragma unroll
    for (int s = 0; s < 4; ++s)
      if (4 * sg + s < N) ws_a[(w.b * D + d) * N + 4 * sg + s] = static_cast<float>(dA_acc[s]);
  }
#pragma unroll
  for (int o = 1; o < TPC; o <<= 1) {
    dD_acc += __shfl_xor_sync(kFull, dD_acc, o);
    dbias_acc += __shfl_xor_sync(kFull, dbias_acc, o);
  }
  if (active && sg == 0) {
    ws_d[w.b * D + d] = static_cast<float>(dD_acc);
    ws_bias[w.b * D + d] = static_cast<float>(dbias_acc);
  }
}

int64_t blocks_per_group(const SelectiveScanParams& p) { return (p.dim / p.groups + kKC - 1) / kKC; }

template <typename T, int TPC>
const char* launch_backward(const SelectiveScanParams& p, int64_t bpg, float* ws_bc, float* ws_a, float* ws_d, float* ws_bias,
                            cudaStream_t stream) {
  constexpr size_t smem = backward_smem<TPC>();
  const cudaError_t attr =
      cudaFuncSetAttribute(scan_backward_kernel<T, TPC>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (attr != cudaSuccess)
    return kernel::errorf("selective_scan backward: cannot reserve %zu bytes of shared memory: %s", smem,
                          cudaGetErrorString(attr));
  scan_backward_kernel<T, TPC>
      <<<static_cast<unsigned>(p.batch * p.groups * bpg), 32 * TPC, smem, stream>>>(p, bpg, ws_bc, ws_a, ws_d, ws_bias);
  return kc::launch_error("selective_scan backward");
}

}  // namespace

int64_t legacy_blocks_per_group(const SelectiveScanParams& p) { return blocks_per_group(p); }

const char* legacy_forward(const SelectiveScanParams& p, cudaStream_t stream) {
  const int64_t bpg = blocks_per_group(p);
  const unsigned grid = static_cast<unsigned>(p.batch * p.groups * bpg);
  const int tpc = threads_per_channel(p.dstate);
  return kc::with_float_dtype(p.dtype, "selective_scan", [&]<typename T>(T*) -> const char* {
    if (tpc == 1)
      scan_forward_kernel<T, 1><<<grid, 32, 0, stream>>>(p, bpg);
    else if (tpc == 2)
      scan_forward_kernel<T, 2><<<grid, 64, 0, stream>>>(p, bpg);
    else
      scan_forward_kernel<T, 4><<<grid, 128, 0, stream>>>(p, bpg);
    return kc::launch_error("selective_scan forward");
  });
}

const char* legacy_backward_blocks(const SelectiveScanParams& p, int64_t bpg, float* ws_bc, float* ws_a, float* ws_d,
                                   float* ws_bias, cudaStream_t stream) {
  const int tpc = threads_per_channel(p.dstate);
  return kc::with_float_dtype(p.dtype, "selective_scan", [&]<typename T>(T*) -> const char* {
    return tpc == 1   ? launch_backward<T, 1>(p, bpg, ws_bc, ws_a, ws_d, ws_bias, stream)
           : tpc == 2 ? launch_backward<T, 2>(p, bpg, ws_bc, ws_a, ws_d, ws_bias, stream)
                      : launch_backward<T, 4>(p, bpg, ws_bc, ws_a, ws_d, ws_bias, stream);
  });
}

}  // namespace kcpp::mamba::detail
