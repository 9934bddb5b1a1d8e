// The selective scan of Mamba (package mamba, contracts SelectiveScan/1 and SelectiveStateUpdate/1,
// docs/contracts/SelectiveScan.md), forward and backward, and its one-step decoding update; CPU and CUDA.
//
// Maths (Gu & Dao 2023, Algorithm 2), per batch b and channel d of group g = d / (D / G), from h_{-1} = 0:
//   dt_l   = delta_l + delta_bias_d, then softplus (log1p(e^x), x itself above 20) when delta_softplus
//   a_l,n  = exp(dt_l A_d,n)
//   h_l,n  = a_l,n h_{l-1},n + dt_l B_g,n,l u_l
//   y_l    = sum_n C_g,n,l h_l,n + D_d u_l
//   out_l  = y_l silu(z_l)                    (y_l without z)
// With bc_norm (Falcon-Mamba), B and C are first divided by their root mean square over n (+ eps), per
// (b, g, l).  Everything in f32 (inputs widened), each output rounded once to the dtype.
//
// Saved for backward: states[b, d, c, :] (f32) = h after position min(kStateChunk (c + 1), L) - 1.
// Backward, one chunk of kStateChunk positions at a time from the last: the chunk's states are
// recomputed from the previous chunk's entry (0 for the first), then the reverse scan
//   g_l,n  = dy_l C_n,l + a_{l+1},n g_{l+1},n          (dy_l = dout_l silu(z_l), g_L = 0)
//   ddt_l  = sum_n g_l,n (A_n a_l,n h_{l-1},n + B_n,l u_l)
//   du_l   = D dy_l + dt_l sum_n g_l,n B_n,l,          dz_l = dout_l y_l silu'(z_l)
//   dA_n  += g_l,n dt_l a_l,n h_{l-1},n,               dD += dy_l u_l
//   dB_n,l += g_l,n dt_l u_l,   dC_n,l += dy_l h_l,n   (summed over the group's channels)
//   ddelta = ddt * sigmoid(delta + delta_bias) under softplus (below the threshold), ddelta_bias += ddelta
// and with bc_norm the gradient of a normalised row goes back through the norm:
//   d raw = rstd (d norm - norm mean_n(d norm * norm)).
// Sums over channels and over (batch, position) run in a fixed order: results are reproducible bit
// for bit (no float atomics).
//
// Layout: u, delta, z, out, dout, du, ddelta, dz are [B, D, L] with L contiguous (a Seq: batch and
// channel strides); B, C, dB, dC are [B, G, N, L] with L contiguous (a GroupSeq); A [D, N], D,
// delta_bias [D], states [B, D, chunks, N], last_state [B, D, N] are contiguous f32.
// Paths:
//   CPU: forward a task per (batch, channel); backward a task per (batch, block of 128 channels of a
//        group), channel after channel, each chunk's states and decays recomputed into a buffer; dB / dC
//        summed per block, then over the blocks in order.
//   CUDA: N <= 16 (selective_scan_cuda_unsupported says so otherwise); the step dt's softplus is
//        softplus_fast below.  By default the state-lane forward and the chunked backward, the fastest
//        of each direction as measured (bench/RESULTS.md); the saved states are the same either way.
//        KCPP_SCAN_LANES=1, KCPP_SCAN_CHUNKED=1 or KCPP_SCAN_LEGACY=1 in the environment (read at every
//        call) runs one family both ways (the state-lane backward only where the device gives a block
//        its 190 KiB of shared memory: Hopper, not an A100; the chunked one elsewhere).
//     State lanes (selective_scan_lanes_cuda.cu): a thread holds four states of one channel and walks
//        the positions in order (no scan across threads); four threads a channel share dt (through
//        shared memory) and the output's sum over the states (by shuffles); B, C of a tile in shared
//        memory as [position][state].
//        The backward walks each chunk three times: the forward to checkpoints every 16 positions, then
//        per sub-chunk from the last the forward again (its states in registers) and the adjoint back.
//     Chunked (selective_scan_cuda.cu): the recurrence runs in parallel over the positions of a chunk
//        of kStateChunk, one chunk at a time:
//        each lane of a warp holds a run of consecutive positions (loaded as 16-byte vectors), runs the
//        recurrence over it, and a warp scan of the runs' (prod a, h) pairs under the associative
//        operator (a1, h1) then (a2, h2) = (a1 a2, a2 h1 + h2) gives each run its entry state (Gu & Dao's
//        scheme, with the scan inside one warp); B and C of the chunk are staged in shared memory once
//        for all the block's channels.  Forward: a block per (batch, group, up to 32 channels), two
//        channels a warp (16 lanes of 16 positions), the state carried from chunk to chunk and saved at
//        each chunk's end.  Backward: a block per (batch, group, up to 128 channels), a channel a warp
//        (32 lanes of 8 positions), chunks from the last: the forward recomputed from the chunk's saved
//        state, the adjoint g scanned in reverse from the carry that the later chunk left, dB / dC summed
//        over the block's channels in shared memory and written per block to the workspace, which two
//        kernels add in block and batch order (and send dB, dC back through the norm).
//     Legacy (selective_scan_legacy_cuda.cu): a thread walks its channel's whole sequence; kept for
//        comparison.
// Memory: states is B D ceil(L / 256) N floats.  The CUDA backward's workspace,
// selective_scan_backward_workspace(p) bytes: P B G 2 N L floats (the blocks' dB / dC rows, P blocks a
// group: ceil(D / G / c) for c channels a block: a multiple of 8 up to 128 as the grid allows for the
// chunked kernels, 96 for the state-lane ones, 32 for the sequential ones) + B D (N + 2) floats.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "kcpp/kernel/fast_math.h"
#include "kcpp/kernel/types.h"

#if KCPP_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace kcpp::mamba {

// Positions between two saved states (SelectiveScan/1 fixes it).
constexpr int64_t kStateChunk = 256;
KCPP_KERNEL_INLINE int64_t state_chunks(int64_t seqlen) { return (seqlen + kStateChunk - 1) / kStateChunk; }

// A [batch, rows, L] tensor with L contiguous: element (b, r, l) at data + b * sb + r * sr + l.  An
// empty tensor (L = 0) may come with no data at all: its rows are then null, never an offset from null.
struct Seq {
  const void* data = nullptr;
  int64_t sb = 0, sr = 0;
  template <typename T>
  KCPP_KERNEL_INLINE const T* at(int64_t b, int64_t r) const {
    return data ? static_cast<const T*>(data) + b * sb + r * sr : nullptr;
  }
  template <typename T>
  KCPP_KERNEL_INLINE T* mut(int64_t b, int64_t r) const {
    return const_cast<T*>(at<T>(b, r));
  }
};

// A [batch, groups, N, L] tensor with L contiguous ([batch, N, L] is one group, sg unused); null rows
// for an empty one without data, as Seq's.
struct GroupSeq {
  const void* data = nullptr;
  int64_t sb = 0, sg = 0, sn = 0;
  template <typename T>
  KCPP_KERNEL_INLINE const T* at(int64_t b, int64_t g, int64_t n) const {
    return data ? static_cast<const T*>(data) + b * sb + g * sg + n * sn : nullptr;
  }
  template <typename T>
  KCPP_KERNEL_INLINE T* mut(int64_t b, int64_t g, int64_t n) const {
    return const_cast<T*>(at<T>(b, g, n));
  }
};

struct SelectiveScanParams {
  kernel::DType dtype = kernel::DType::bf16;  // of u, delta, B, C, z, out and their gradients
  int64_t batch = 0, dim = 0, seqlen = 0, dstate = 0, groups = 1;
  Seq u, delta, z;  // z.data null: no gate
  GroupSeq B, C;
  const float* A = nullptr;           // [D, N]
  const float* D = nullptr;           // [D] or null
  const float* delta_bias = nullptr;  // [D] or null
  bool delta_softplus = false;
  bool bc_norm = false;  // Falcon-Mamba: B and C RMS-normalised over N
  float bc_eps = 1e-6f;
  // forward
  Seq out;
  float* last_state = nullptr;  // [B, D, N] or null
  float* states = nullptr;      // [B, D, chunks, N]: written by forward (when non-null), read by backward
  // backward
  Seq dout, du, ddelta, dz;  // dz required iff z
  GroupSeq dB, dC;
  float* dA = nullptr;           // [D, N]
  float* dD = nullptr;           // [D], required iff D
  float* ddelta_bias = nullptr;  // [D], required iff delta_bias
  void* workspace = nullptr;     // CUDA backward: selective_scan_backward_workspace(p) bytes
  size_t workspace_bytes = 0;    // its size; the backward refuses a smaller one than it needs (e.g. when
                                 // a KCPP_SCAN_* variable changed between the query and the call)
};

// One decoding step (SelectiveStateUpdate/1).  x, dt, z, out are [B, D] with any strides (a Seq whose
// "L" is one element); B, C [B, G, N] with N contiguous; state [B, D, N] with N contiguous.
struct StateUpdateParams {
  kernel::DType dtype = kernel::DType::bf16;
  int64_t batch = 0, dim = 0, dstate = 0, groups = 1;
  float* state = nullptr;
  int64_t state_sb = 0, state_sd = 0;
  const void* x = nullptr;
  int64_t x_sb = 0, x_sd = 0;
  const void* dt = nullptr;
  int64_t dt_sb = 0, dt_sd = 0;
  const void* z = nullptr;  // or null
  int64_t z_sb = 0, z_sd = 0;
  const void* B = nullptr;
  int64_t B_sb = 0, B_sg = 0;
  const void* C = nullptr;
  int64_t C_sb = 0, C_sg = 0;
  const float* A = nullptr;
  const float* D = nullptr;
  const float* dt_bias = nullptr;
  bool dt_softplus = false;
  bool bc_norm = false;
  float bc_eps = 1e-6f;
  void* out = nullptr;
  int64_t out_sb = 0, out_sd = 0;
};

// ---- the scalar maths, shared by the CPU and CUDA code (and named by the tests)

// PyTorch's softplus (beta 1, threshold 20) and its derivative.
KCPP_KERNEL_INLINE float softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }
KCPP_KERNEL_INLINE float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }
KCPP_KERNEL_INLINE float dsoftplus(float x) { return x > 20.0f ? 1.0f : sigmoid(x); }
KCPP_KERNEL_INLINE float silu(float x) { return x * sigmoid(x); }

// softplus as the CUDA kernels compute it, in about 20 instructions where log1pf takes some 80 (a
// tenth of the forward's instructions): max(x, 0) + log1p(u) with u = e^-|x| from exp2_approx, the
// rounding of -|x| log2(e) added back to first order (u (1 + lo ln 2)), and log1p(u), u in (0, 1], as
// 2 atanh(s) = 2 (s + s^3 / 3 + ... + s^15 / 15) with s = u / (2 + u) <= 1/3 (the series' tail is below
// 2e-8 relative).  With correctly rounded operations (the host) it is within 4e-7 relative of the exact
// value (MambaMath.FastSoftplusIsWithinItsBound); the device's ex2.approx and rcp.approx add about 3e-7.
// PyTorch's threshold as softplus(): x itself above 20; 0 below -88; NaN stays NaN.
KCPP_KERNEL_INLINE float softplus_fast(float x) {
  if (x > 20.0f) return x;
  if (x < -88.0f) return 0.0f;  // e^x below f32's normal range (and -inf, whose exponent arithmetic gives NaN)
  constexpr float kL2e = 1.44269502162933349609375f;     // log2(e) rounded to f32
  constexpr float kL2eLo = 1.925963033500011e-8f;        // log2(e) - kL2e
  constexpr float kLn2 = 0.6931471805599453f;
  const float a = -std::fabs(x), hi = a * kL2e;
  const float lo = std::fma(a, kL2e, -hi) + a * kL2eLo;  // a log2(e) - hi
  float u = kernel::exp2_approx(hi);
  u = std::fma(u, lo * kLn2, u);
  const float s = u * kernel::rcp_approx(2.0f + u), s2 = s * s;
  float poly = 1.0f / 15;
  poly = std::fma(poly, s2, 1.0f / 13);
  poly = std::fma(poly, s2, 1.0f / 11);
  poly = std::fma(poly, s2, 1.0f / 9);
  poly = std::fma(poly, s2, 1.0f / 7);
  poly = std::fma(poly, s2, 1.0f / 5);
  poly = std::fma(poly, s2, 1.0f / 3);
  poly = std::fma(poly, s2, 1.0f);
  return std::fmax(x, 0.0f) + 2.0f * s * poly;
}
KCPP_KERNEL_INLINE float dsilu(float x) {
  const float s = sigmoid(x);
  return s * (1.0f + x * (1.0f - s));
}

// nullptr, or why these params break the contract (names the argument).
const char* selective_scan_check(const SelectiveScanParams& p, bool backward);
const char* state_update_check(const StateUpdateParams& p);

const char* selective_scan_forward_cpu(const SelectiveScanParams& p);
const char* selective_scan_backward_cpu(const SelectiveScanParams& p);
const char* selective_state_update_cpu(const StateUpdateParams& p);
#if KCPP_WITH_CUDA
// Null when the CUDA kernels take these params, else why not (N > 16).
const char* selective_scan_cuda_unsupported(const SelectiveScanParams& p);
size_t selective_scan_backward_workspace(const SelectiveScanParams& p);
const char* selective_scan_forward_cuda(const SelectiveScanParams& p, cudaStream_t stream);
const char* selective_scan_backward_cuda(const SelectiveScanParams& p, cudaStream_t stream);
const char* selective_state_update_cuda(const StateUpdateParams& p, cudaStream_t stream);
#endif

}  // namespace kcpp::mamba
