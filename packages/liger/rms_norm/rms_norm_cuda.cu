// RMSNorm on CUDA (maths in rms_norm.h).
//
// One block per row at a time.  Three code paths, chosen per call by make_plan():
//  - registers: the row is held in registers as raw 16-byte vectors, ITEMS per thread, and widened
//    to f32 at the point of use; x (and dy) are read from memory exactly once;
//  - bulk (backward, sm_90): as registers, but the rows of x and dy come through a ring of `stages`
//    shared-memory slots that the copy engine fills (kcpp/kernel/bulk.cuh), so the next rows' loads
//    are in flight while a row is computed;
//  - loop: any H and alignment; the row is read twice (the second read mostly hits L2).
// Which is faster was measured, not assumed (default_config).  Tried and dropped after measuring on
// an H200 (bench/RESULTS.md): prefetching the next row, dw in shared memory on the registers path,
// one warp per row, holding the weight in registers across rows in the forward (59 registers
// against 40 when re-read from L1/L2, and occupancy is what this kernel is short of), loading the
// weight together with the row, the bulk path for the forward (no faster than registers), and
// streaming (evict-first) cache hints on the forward's loads and stores (within 1-3%).
// The grid is either one block per row or persistent (as many blocks as fit, striding over rows).
// The backward always runs persistent: each block sums dw for its rows into its own f32 workspace
// row (on the bulk path, clusters of blocks add theirs first, through distributed shared memory),
// and column_sums (kcpp/kernel/column_sums.cuh) adds those rows in a fixed order (deterministic, no
// atomics).
#include <cooperative_groups.h>

#include <algorithm>

#include "kcpp/kernel/bulk.cuh"
#include "kcpp/kernel/column_sums.cuh"
#include "kcpp/kernel/cuda.cuh"
#include "rms_norm.h"
#include "rms_norm_tuning.h"

namespace kcpp::liger {
namespace {

using namespace kcpp::kernel::cuda;
using kcpp::kernel::DType;

constexpr int kMaxThreads = 1024;         // loop path
constexpr int kMaxRegisterThreads = 512;  // registers path: leaves 128 registers a thread
constexpr int kMaxStages = 8;            // backward bulk path: rows (x and dy) in flight a block

// The normalised value n as the forward rounds it (see the casting modes in rms_norm.h), set up once
// a row so that the per-element work is one multiply and at most one rounding, with no branch on the
// mode in the unrolled loops: Llama round(x rstd), Gemma x rstd, None round(x round(rstd)).
template <typename T> struct Normed {
  float scale;
  bool round;
  __device__ __forceinline__ Normed(float rstd, RMSNormCasting c)
      : scale(c == RMSNormCasting::None ? round_to<T>(rstd) : rstd), round(c != RMSNormCasting::Gemma) {}
  __device__ __forceinline__ float operator()(float x) const {
    const float n = x * scale;
    return round ? round_to<T>(n) : n;
  }
};

// Column of vector i of this thread.
template <int VEC> __device__ __forceinline__ int64_t column(int i) {
  return (int64_t(i) * blockDim.x + threadIdx.x) * VEC;
}

// ---- forward -------------------------------------------------------------------------------------

// ADD: AddRMSNorm (x + residual normalised, the sum written to residual_out); a template parameter so
// that the plain kernel keeps its registers (occupancy is what it is short of).  PACKED (16-bit T,
// Llama or None casting, offset 0): y = round(n w) with n already rounded to T is the correctly
// rounded product of two T values, which the packed multiply (__hmul2) gives two at a time, with no
// widening of w: the forward issues about as many instructions as it moves bytes, so this counts.
template <typename T, int VEC, int ITEMS, bool ADD, bool PACKED>
__global__ void __launch_bounds__(kMaxRegisterThreads) forward_registers(const __grid_constant__ RMSNormParams p, int /*stages*/) {
  __shared__ float scratch[32];
  using V = Vec<T, VEC>;
  const int64_t h = p.hidden;
  const float inv_h = 1.0f / static_cast<float>(h);
  bool live[ITEMS];
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) live[i] = column<VEC>(i) < h;
  for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const T* x = static_cast<const T*>(p.x) + row * p.x_stride;  // [h]
    V v[ITEMS], rv[ADD ? ITEMS : 1];
    const T* res = ADD ? static_cast<const T*>(p.residual) + row * p.residual_stride : nullptr;
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {  // every load of the row issued before any use
      if (!live[i]) continue;
      v[i] = *reinterpret_cast<const V*>(x + column<VEC>(i));
      if constexpr (ADD) rv[i] = *reinterpret_cast<const V*>(res + column<VEC>(i));
    }
    if constexpr (ADD) {  // v = round(x + residual), also written to residual_out
      T* rout = static_cast<T*>(p.residual_out) + row * p.residual_out_stride;
#pragma unroll
      for (int i = 0; i < ITEMS; ++i) {
        if (!live[i]) continue;
#pragma unroll
        for (int k = 0; k < VEC; ++k) v[i].v[k] = from_f32<T>(to_f32(v[i].v[k]) + to_f32(rv[i].v[k]));
        *reinterpret_cast<V*>(rout + column<VEC>(i)) = v[i];
      }
    }
    float ss = 0.0f;
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      if (!live[i]) continue;
      float f[VEC];
      widen(v[i], f);
#pragma unroll
      for (int k = 0; k < VEC; ++k) ss += f[k] * f[k];
    }
    ss = block_sum(ss, scratch);
    const float rstd = rsqrtf(ss * inv_h + p.eps);
    if (threadIdx.x == 0) p.rstd[row] = rstd;
    T* y = static_cast<T*>(p.y) + row * p.y_stride;
    if constexpr (PACKED) {
      using P = Pair<T>;
      const float scale = p.casting == RMSNormCasting::None ? round_to<T>(rstd) : rstd;
#pragma unroll
      for (int i = 0; i < ITEMS; ++i) {
        if (!live[i]) continue;
        float f[VEC];
        widen(v[i], f);
        typename P::type w2[VEC / 2], o2[VEC / 2];
        const V wv = *reinterpret_cast<const V*>(static_cast<const T*>(p.w) + column<VEC>(i));
        memcpy(w2, &wv, sizeof(w2));
#pragma unroll
        for (int k = 0; k < VEC / 2; ++k) o2[k] = __hmul2(P::round(f[2 * k] * scale, f[2 * k + 1] * scale), w2[k]);
        uint4 u;
        memcpy(&u, o2, sizeof(u));
        *reinterpret_cast<uint4*>(y + column<VEC>(i)) = u;
      }
    } else {
      const Normed<T> nrm(rstd, p.casting);
#pragma unroll
      for (int i = 0; i < ITEMS; ++i) {
        if (!live[i]) continue;
        // The weight is re-read per row (it stays in L1/L2): loading it with the row, to overlap its
        // latency, measured slower (registers: occupancy).
        float f[VEC], wf[VEC], o[VEC];
        widen(v[i], f);
        load_f32(static_cast<const T*>(p.w) + column<VEC>(i), wf);
#pragma unroll
        for (int k = 0; k < VEC; ++k) o[k] = nrm(f[k]) * (wf[k] + p.offset);
        store_f32(y + column<VEC>(i), o);
      }
    }
  }
}

template <typename T, int VEC, bool ADD>
__global__ void __launch_bounds__(kMaxThreads) forward_loop(const __grid_constant__ RMSNormParams p, int /*stages*/) {
  __shared__ float scratch[32];
  const int64_t h = p.hidden, step = int64_t(blockDim.x) * VEC;
  const float inv_h = 1.0f / static_cast<float>(h);
  const T* wp = static_cast<const T*>(p.w);
  for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const T* x = static_cast<const T*>(p.x) + row * p.x_stride;
    T* y = static_cast<T*>(p.y) + row * p.y_stride;
    float ss = 0.0f;
    for (int64_t c = threadIdx.x * VEC; c < h; c += step) {
      float v[VEC];
      load_f32(x + c, v);
      if constexpr (ADD) {  // r = round(x + residual) to residual_out, read back below
        float rv[VEC];
        load_f32(static_cast<const T*>(p.residual) + row * p.residual_stride + c, rv);
#pragma unroll
        for (int k = 0; k < VEC; ++k) v[k] = round_to<T>(v[k] + rv[k]);
        store_f32(static_cast<T*>(p.residual_out) + row * p.residual_out_stride + c, v);
      }
#pragma unroll
      for (int k = 0; k < VEC; ++k) ss += v[k] * v[k];
    }
    // The second pass reads the row normalised: r (this thread wrote those columns) or x.
    if constexpr (ADD) x = static_cast<const T*>(p.residual_out) + row * p.residual_out_stride;
    ss = block_sum(ss, scratch);
    const float rstd = rsqrtf(ss * inv_h + p.eps);
    const Normed<T> nrm(rstd, p.casting);
    if (threadIdx.x == 0) p.rstd[row] = rstd;
    for (int64_t c = threadIdx.x * VEC; c < h; c += step) {
      float v[VEC], w[VEC], o[VEC];
      load_f32(x + c, v);
      load_f32(wp + c, w);
#pragma unroll
      for (int k = 0; k < VEC; ++k) o[k] = nrm(v[k]) * (w[k] + p.offset);
      store_f32(y + c, o);
    }
  }
}

// ---- backward ------------------------------------------------------------------------------------

// A thread's part of the backward on the registers and bulk paths: w and the block's dw sums for its
// columns stay in registers across rows; row() does one row from wherever its x, dy (and
// dresidual_out) are (global memory, or a shared-memory slot of the bulk path's ring).
template <typename T, int VEC, int ITEMS, bool DRES> struct BackwardRows {
  using V = Vec<T, VEC>;
  float w[ITEMS][VEC];  // w + offset, widened once (the register budget has room at one vector a thread)
  float dw[ITEMS][VEC];
  bool live[ITEMS];
  float inv_h;
  uint32_t phase = 0;  // of block_sum_alternating: rows alternate halves of the scratch

  __device__ explicit BackwardRows(const RMSNormParams& p) : inv_h(1.0f / static_cast<float>(p.hidden)) {
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      live[i] = column<VEC>(i) < p.hidden;
      V wv{};
      if (live[i]) wv = *reinterpret_cast<const V*>(static_cast<const T*>(p.w) + column<VEC>(i));
      widen(wv, w[i]);
#pragma unroll
      for (int k = 0; k < VEC; ++k) w[i][k] += p.offset, dw[i][k] = 0.0f;
    }
  }

  // Reads the row's sources into registers (every load issued before any use), reduces over the
  // block (one barrier), calls reduced() once that barrier shows that every thread has read them
  // (the bulk path refills the slot there), then writes dx.  `scratch`: 64 floats.  With
  // g = dy (w + offset) and n = x rstd unrounded (d round / dn = 1): dx = rstd g - x rstd^3
  // mean_j(g x), one multiply and one fma.
  template <typename F>
  __device__ __forceinline__ void row(const RMSNormParams& p, int64_t row, float rstd, const T* x, const T* dy,
                                      const T* dres, float* scratch, F&& reduced) {
    V xv[ITEMS], dv[ITEMS], rv[DRES ? ITEMS : 1];
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      if (!live[i]) continue;
      xv[i] = *reinterpret_cast<const V*>(x + column<VEC>(i));
      dv[i] = *reinterpret_cast<const V*>(dy + column<VEC>(i));
      if constexpr (DRES) rv[i] = *reinterpret_cast<const V*>(dres + column<VEC>(i));
    }
    const Normed<T> nrm(rstd, p.casting);
    // Widened once and kept in f32 across the reduction (two blocks an SM leave the registers).
    float xf[ITEMS][VEC], df[ITEMS][VEC];
    float gx = 0.0f;
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      if (!live[i]) continue;
      widen(xv[i], xf[i]);
      widen(dv[i], df[i]);
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        gx += df[i][k] * w[i][k] * xf[i][k];
        dw[i][k] += df[i][k] * nrm(xf[i][k]);
      }
    }
    const float c = block_sum_alternating(gx, scratch, phase) * (rstd * rstd * rstd * inv_h);
    phase ^= 1u;
    reduced();
    T* dx = static_cast<T*>(p.dx) + row * p.dx_stride;
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      if (!live[i]) continue;
      float o[VEC];
#pragma unroll
      for (int k = 0; k < VEC; ++k) o[k] = fmaf(-c, xf[i][k], rstd * (df[i][k] * w[i][k]));
      if constexpr (DRES) {  // AddRMSNorm: the gradient arriving at residual_out passes through
        float rf[VEC];
        widen(rv[i], rf);
#pragma unroll
        for (int k = 0; k < VEC; ++k) o[k] += rf[k];
      }
      store_f32(dx + column<VEC>(i), o);
    }
  }

  // The cluster's dw sums to its workspace row (kcpp/kernel/column_sums.cuh), staged in `stage` (h
  // floats of the block's shared memory, free once the rows are done).
  template <typename Cluster>
  __device__ __forceinline__ void write_cluster_partial(const RMSNormParams& p, float* stage, const Cluster& cluster) const {
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      if (!live[i]) continue;
#pragma unroll
      for (int k = 0; k < VEC; ++k) stage[column<VEC>(i) + k] = dw[i][k];
    }
    cluster_column_sums(stage, p.hidden, static_cast<float*>(p.workspace) + int64_t(blockIdx.x / cluster.num_blocks()) * p.hidden,
                        cluster);
  }

  // The block's dw sums to its own workspace row (column_sums adds the rows).
  __device__ __forceinline__ void write_partial(const RMSNormParams& p) const {
    float* part = static_cast<float*>(p.workspace) + int64_t(blockIdx.x) * p.hidden;
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      if (!live[i]) continue;
#pragma unroll
      for (int k = 0; k < VEC; ++k) part[column<VEC>(i) + k] = dw[i][k];
    }
  }
};

template <typename T, int VEC, int ITEMS, bool DRES>
__global__ void __launch_bounds__(kMaxRegisterThreads) backward_registers(const __grid_constant__ RMSNormParams p, int /*stages*/) {
  __shared__ float scratch[64];
  BackwardRows<T, VEC, ITEMS, DRES> t(p);
  float rstd = blockIdx.x < p.rows ? p.rstd[blockIdx.x] : 0.0f;
  for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const float rstd_next = row + gridDim.x < p.rows ? p.rstd[row + gridDim.x] : 0.0f;  // in flight during this row
    const T* dres = DRES ? static_cast<const T*>(p.dresidual_out) + row * p.dres_stride : nullptr;
    t.row(p, row, rstd, static_cast<const T*>(p.x) + row * p.x_stride,
          static_cast<const T*>(p.dy) + row * p.dy_stride, dres, scratch, [] {});
    rstd = rstd_next;
  }
  griddep_launch_dependents();  // column_sums may start launching (it waits for these writes)
  t.write_partial(p);
}

// The bulk path of the backward (sm_90): a persistent block keeps a ring of `stages` slots in shared
// memory, each holding one row of x, dy (and dresidual_out), filled by the copy engine; w and the
// block's dw sums stay in registers; the next row's rstd is loaded while a row is computed (read at
// the row's start, its latency was exposed once a row: ncu found it the kernel's main stall).  A
// slot is refilled as soon as the block reduction's barrier shows every thread has read it.
template <typename T, int VEC, int ITEMS, bool DRES>
__global__ void __launch_bounds__(kMaxRegisterThreads) backward_bulk(const __grid_constant__ RMSNormParams p, int stages) {
  extern __shared__ __align__(128) unsigned char smem_raw[];  // stages x (x, dy, dresidual_out) rows
  __shared__ uint64_t full[kMaxStages];
  __shared__ float scratch[64];
  constexpr int kRows = DRES ? 3 : 2;
  const int64_t h = p.hidden;
  const uint32_t row_bytes = static_cast<uint32_t>(h * sizeof(T));
  T* const ring = reinterpret_cast<T*>(smem_raw);
  BackwardRows<T, VEC, ITEMS, DRES> t(p);
  if (threadIdx.x == 0) bulk_init(full, stages);
  __syncthreads();
  // Thread 0: `row` (if any) into ring slot `slot`.
  auto issue = [&](int64_t row, int slot) {
    if (row >= p.rows) return;
    uint64_t* bar = &full[slot];
    T* dst = ring + slot * kRows * h;
    bulk_expect(bar, kRows * row_bytes);
    bulk_load(dst, static_cast<const T*>(p.x) + row * p.x_stride, row_bytes, bar);
    bulk_load(dst + h, static_cast<const T*>(p.dy) + row * p.dy_stride, row_bytes, bar);
    if constexpr (DRES)
      bulk_load(dst + 2 * h, static_cast<const T*>(p.dresidual_out) + row * p.dres_stride, row_bytes, bar);
  };
  const int64_t ahead = int64_t(stages) * gridDim.x;  // a slot's next row
  if (threadIdx.x == 0)
    for (int s = 0; s < stages; ++s) issue(blockIdx.x + int64_t(s) * gridDim.x, s);
  RingCursor ring_at;
  float rstd = blockIdx.x < p.rows ? p.rstd[blockIdx.x] : 0.0f;
  for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x, ring_at.advance(stages)) {
    const float rstd_next = row + gridDim.x < p.rows ? p.rstd[row + gridDim.x] : 0.0f;
    const T* slot = ring + ring_at.slot * kRows * h;
    bulk_wait(&full[ring_at.slot], ring_at.parity);
    t.row(p, row, rstd, slot, slot + h, slot + 2 * h, scratch, [&] {
      if (threadIdx.x == 0) issue(row + ahead, ring_at.slot);
    });
    rstd = rstd_next;
  }
  griddep_launch_dependents();  // column_sums may start launching (it waits for these writes)
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const cooperative_groups::cluster_group cluster = cooperative_groups::this_cluster();
  if (cluster.num_blocks() > 1) {  // the ring is idle now: every row issued has been read
    t.write_cluster_partial(p, reinterpret_cast<float*>(smem_raw), cluster);
    return;
  }
#endif
  t.write_partial(p);
}

// SMEM: the block's dw row is summed in shared memory (when it fits) and written out once; else it
// is summed in place in the block's workspace row (a read-modify-write per element and row: slow,
// only for rows beyond 12288 f32).
template <typename T, int VEC, bool SMEM>
__global__ void __launch_bounds__(kMaxThreads) backward_loop(const __grid_constant__ RMSNormParams p, int /*stages*/) {
  __shared__ float scratch[32];
  extern __shared__ float dw_smem[];
  const int64_t h = p.hidden, step = int64_t(blockDim.x) * VEC;
  const float inv_h = 1.0f / static_cast<float>(h);
  const T* wp = static_cast<const T*>(p.w);
  float* out_row = static_cast<float*>(p.workspace) + int64_t(blockIdx.x) * h;  // owned by this block
  float* part = SMEM ? dw_smem : out_row;
  for (int64_t c = threadIdx.x * VEC; c < h; c += step)
#pragma unroll
    for (int k = 0; k < VEC; ++k) part[c + k] = 0.0f;  // each column is touched by one thread only
  for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const T* x = static_cast<const T*>(p.x) + row * p.x_stride;
    const T* dy = static_cast<const T*>(p.dy) + row * p.dy_stride;
    T* dx = static_cast<T*>(p.dx) + row * p.dx_stride;
    const float rstd = p.rstd[row];
    const Normed<T> nrm(rstd, p.casting);
    float dot = 0.0f;
    for (int64_t c = threadIdx.x * VEC; c < h; c += step) {
      float xv[VEC], dv[VEC], w[VEC];
      load_f32(x + c, xv);
      load_f32(dy + c, dv);
      load_f32(wp + c, w);
#pragma unroll
      for (int k = 0; k < VEC; ++k) dot += dv[k] * (w[k] + p.offset) * xv[k] * rstd;
    }
    dot = block_sum(dot, scratch) * inv_h;
    for (int64_t c = threadIdx.x * VEC; c < h; c += step) {
      float xv[VEC], dv[VEC], w[VEC], o[VEC];
      load_f32(x + c, xv);
      load_f32(dy + c, dv);
      load_f32(wp + c, w);
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        o[k] = rstd * (dv[k] * (w[k] + p.offset) - xv[k] * rstd * dot);
        part[c + k] += dv[k] * nrm(xv[k]);  // each column has one owner thread
      }
      if (p.dresidual_out) {
        float rf[VEC];
        load_f32(static_cast<const T*>(p.dresidual_out) + row * p.dres_stride + c, rf);
#pragma unroll
        for (int k = 0; k < VEC; ++k) o[k] += rf[k];
      }
      store_f32(dx + c, o);
    }
  }
  if constexpr (SMEM)
    for (int64_t c = threadIdx.x * VEC; c < h; c += step)
#pragma unroll
      for (int k = 0; k < VEC; ++k) out_row[c + k] = part[c + k];
}

// ---- launch plan ---------------------------------------------------------------------------------

struct Plan {
  int vec = 1;  // elements per access
  RMSNormConfig config;  // stages > 0 only where the bulk path applies
  int threads = 32;
};

int round32(int64_t t, int max_threads) {
  return static_cast<int>(std::min<int64_t>(max_threads, std::max<int64_t>(32, (t + 31) / 32 * 32)));
}

bool vector_ok(const RMSNormParams& p, bool backward, int vec) {
  bool ok = p.hidden % vec == 0 && aligned16(p.x) && aligned16(p.w) && p.x_stride % vec == 0;
  if (!backward) {
    if (p.residual)
      ok = ok && aligned16(p.residual) && aligned16(p.residual_out) && p.residual_stride % vec == 0 &&
           p.residual_out_stride % vec == 0;
    return ok && aligned16(p.y) && p.y_stride % vec == 0;
  }
  if (p.dresidual_out) ok = ok && aligned16(p.dresidual_out) && p.dres_stride % vec == 0;
  return ok && aligned16(p.dy) && aligned16(p.dx) && p.dy_stride % vec == 0 && p.dx_stride % vec == 0;
}

// Register budget a thread: 32 row elements forward, 16 backward (x, dy and the dw sums); beyond it
// ptxas spills (seen with -Xptxas -v) and the loop path is faster.
int max_items(bool backward, int vec) { return (backward ? 16 : 32) / vec; }

// The configuration used when none is given, from the sweep of bench/bench_kernels.cpp on an H200
// at [8192, 4096] bf16 (bench/RESULTS.md): the forward is fastest holding the row in registers, about
// 256 threads a row (2 vectors a thread, 32 registers, full occupancy: 0.0376-0.0379 ms in four runs
// over two calls against 0.0379-0.0381 at 4 vectors x 128 threads; the loop path 0.0411), one block
// per row;
// the backward with one register vector a thread on a persistent grid.
RMSNormConfig default_config(const RMSNormParams& p, bool backward, int vec) {
  RMSNormConfig c;
  const int64_t nvec = p.hidden / vec;
  c.persistent = backward;
  c.items = 0;  // loop path unless a register variant fits
  // AddRMSNorm forward: the loop path, one block per row, was fastest in the sweep (commit a6bd60b:
  // 72.3 us, 87% of copy, against 74.5 us with one register vector a thread and 98.4 us with four).
  if (p.residual && !backward) return c;
  const int64_t threads_target = backward ? kMaxRegisterThreads : 256;
  for (int items = 1; items <= max_items(backward, vec); items *= 2) {
    if (nvec <= threads_target * items || (items == max_items(backward, vec) && nvec <= int64_t(kMaxRegisterThreads) * items)) {
      c.items = items;
      break;
    }
  }
  // The backward's bulk path (sm_90; make_plan drops it elsewhere), two rows in flight a block:
  // 0.0760 ms against 0.0878 ms on the registers path (sweep, H200, [8192, 4096] bf16); two blocks
  // an SM rather than the three that fit: 0.0652 ms against 0.0698 (sweep at commit 4cfff56,
  // bench/RESULTS.md; one block 0.0739).
  if (backward) c.stages = 2, c.blocks_per_sm = 2;
  return c;
}

// The backward's bulk-path ring: a slot holds the rows of x, dy (and dresidual_out); at the end it
// stages the block's h f32 dw sums for the cluster's addition.
size_t bulk_smem(const RMSNormParams& p, int stages) {
  return std::max(size_t(stages) * (p.dresidual_out ? 3 : 2) * size_t(p.hidden) * kcpp::kernel::dtype_bytes(p.dtype),
                  size_t(p.hidden) * sizeof(float));
}

// The bulk path (backward only) needs sm_90, rows the copy engine can move (16-byte aligned starts
// and lengths: what vector_ok checks, strides included) and the ring within the block's shared memory.
bool bulk_fits(const RMSNormParams& p, bool backward, int stages, int device) {
  if (!backward || stages < 1 || stages > kMaxStages) return false;
  if (device_attribute(cudaDevAttrComputeCapabilityMajor, device) < 9) return false;
  return bulk_smem(p, stages) + 1024 <= size_t(device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
}

Plan make_plan(const RMSNormParams& p, bool backward, const RMSNormConfig* given, int device) {
  Plan plan;
  const int vec = 16 / kcpp::kernel::dtype_bytes(p.dtype);
  if (!vector_ok(p, backward, vec)) {
    plan.config.items = 0;
    plan.config.stages = 0;
    plan.threads = round32(std::min<int64_t>(p.hidden, 256), kMaxThreads);
    return plan;
  }
  plan.vec = vec;
  plan.config = given ? *given : default_config(p, backward, vec);
  if (backward) plan.config.persistent = true;  // the dw workspace assumes it
  const int64_t nvec = p.hidden / vec;
  // A register variant covers the row only if its threads (at most kMaxRegisterThreads) do.
  if (plan.config.items <= 0 || plan.config.items > max_items(backward, vec) ||
      nvec > int64_t(kMaxRegisterThreads) * plan.config.items)
    plan.config.items = 0;
  if (plan.config.items == 0 || !bulk_fits(p, backward, plan.config.stages, device)) plan.config.stages = 0;
  if (plan.config.stages > 0) plan.config.persistent = true;
  if (plan.config.items > 0)
    plan.threads = round32((nvec + plan.config.items - 1) / plan.config.items, kMaxRegisterThreads);
  else
    plan.threads = 256;
  return plan;
}

template <typename F> const char* visit_type(DType t, F&& f) {
  switch (t) {
    case DType::f32: return f(static_cast<float*>(nullptr));
    case DType::bf16: return f(static_cast<__nv_bfloat16*>(nullptr));
    case DType::f16: return f(static_cast<__half*>(nullptr));
  }
  return "rms_norm: unknown dtype";
}

using KernelFn = void (*)(RMSNormParams, int);  // the int: stages of the bulk path (others ignore it)

// nullptr when ITEMS is beyond the direction's register budget (the caller then takes the loop path).
template <typename T, int VEC, int ITEMS> KernelFn registers_kernel(const RMSNormParams& p, bool backward) {
  if (!backward) {
    if constexpr (sizeof(T) == 2) {
      if (p.offset == 0.0f && p.casting != RMSNormCasting::Gemma)
        return p.residual ? forward_registers<T, VEC, ITEMS, true, true> : forward_registers<T, VEC, ITEMS, false, true>;
    }
    return p.residual ? forward_registers<T, VEC, ITEMS, true, false> : forward_registers<T, VEC, ITEMS, false, false>;
  }
  if constexpr (ITEMS * VEC <= 16)
    return p.dresidual_out ? backward_registers<T, VEC, ITEMS, true> : backward_registers<T, VEC, ITEMS, false>;
  return nullptr;
}

// dw of the backward loop path in shared memory: while a row of f32 fits the default 48 KiB.
bool loop_dw_in_smem(const RMSNormParams& p) { return p.hidden * int64_t(sizeof(float)) <= 48 * 1024; }

template <typename T, int VEC, int ITEMS> KernelFn bulk_kernel(const RMSNormParams& p) {
  if constexpr (ITEMS * VEC <= 16) return p.dresidual_out ? backward_bulk<T, VEC, ITEMS, true> : backward_bulk<T, VEC, ITEMS, false>;
  return nullptr;
}

template <typename T, int VEC> KernelFn kernel_for(const RMSNormParams& p, const Plan& plan, bool backward) {
  const int items = plan.config.items;
  const bool bulk = plan.config.stages > 0;
  KernelFn fn = nullptr;
  if constexpr (VEC > 1) {
    auto pick = [&]<int ITEMS>() {
      fn = bulk ? bulk_kernel<T, VEC, ITEMS>(p) : registers_kernel<T, VEC, ITEMS>(p, backward);
    };
    if (items == 1) pick.template operator()<1>();
    if constexpr (2 * VEC <= 32) if (items == 2) pick.template operator()<2>();
    if constexpr (4 * VEC <= 32) if (items == 4) pick.template operator()<4>();
    if constexpr (8 * VEC <= 32) if (items == 8) pick.template operator()<8>();
  }
  if (fn) return fn;
  if (!backward) return p.residual ? forward_loop<T, VEC, true> : forward_loop<T, VEC, false>;
  return loop_dw_in_smem(p) ? backward_loop<T, VEC, true> : backward_loop<T, VEC, false>;
}

KernelFn kernel_for(const RMSNormParams& p, const Plan& plan, bool backward) {
  KernelFn fn = nullptr;
  visit_type(p.dtype, [&]<typename T>(T*) -> const char* {
    fn = plan.vec == 1 ? kernel_for<T, 1>(p, plan, backward) : kernel_for<T, 16 / sizeof(T)>(p, plan, backward);
    return nullptr;
  });
  return fn;
}

// Dynamic shared memory of a launch: the bulk path's ring, or the dw row of the backward loop path.
size_t smem_for(const RMSNormParams& p, const Plan& plan, KernelFn fn, bool backward) {
  if (plan.config.stages > 0) return bulk_smem(p, plan.config.stages);
  if (!backward || !loop_dw_in_smem(p)) return 0;
  bool loop = false;
  visit_type(p.dtype, [&]<typename T>(T*) -> const char* {
    loop = fn == backward_loop<T, 1, true> || fn == backward_loop<T, 16 / sizeof(T), true>;
    return nullptr;
  });
  return loop ? static_cast<size_t>(p.hidden) * sizeof(float) : 0;
}

// Persistent (kcpp/kernel/column_sums.cuh): as many blocks as can be resident at once; the bulk
// backward's in clusters (kPartialSumCluster unless the configuration says).  Otherwise one block a row.
PersistentGrid grid_for(const RMSNormParams& p, const Plan& plan, KernelFn fn, int device, size_t smem) {
  if (!plan.config.persistent) return PersistentGrid{static_cast<int>(std::min<int64_t>(p.rows, int64_t(1) << 30)), 1};
  const int c = plan.config.cluster;
  const int cluster = plan.config.stages == 0 ? 1 : c == 1 || c == 2 || c == 4 || c == 8 ? c : kPartialSumCluster;
  return persistent_grid(fn, plan.threads, smem, device, p.rows, plan.config.blocks_per_sm, cluster);
}

// Shared memory beyond the default 48 KiB (dynamic and static together) must be asked for, kernel by
// kernel, before the occupancy query.
const char* allow_smem(KernelFn fn, size_t smem) {
  if (smem + 1024 <= 48 * 1024) return nullptr;  // 1 KiB: above the kernels' static shared memory
  if (cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)) != cudaSuccess)
    return launch_error("rms_norm (shared memory of the bulk path)");
  return nullptr;
}

const char* forward(const RMSNormParams& p, cudaStream_t stream, const RMSNormConfig* config) {
  if (const char* e = rms_norm_check(p, false)) return e;
  if (p.rows == 0) return nullptr;
  int device = 0;
  cudaGetDevice(&device);
  const Plan plan = make_plan(p, false, config, device);
  const KernelFn fn = kernel_for(p, plan, false);
  const size_t smem = smem_for(p, plan, fn, false);
  if (const char* e = allow_smem(fn, smem)) return e;
  fn<<<grid_for(p, plan, fn, device, smem).blocks, plan.threads, smem, stream>>>(p, plan.config.stages);
  return launch_error("rms_norm forward");
}

size_t workspace(const RMSNormParams& p, int device, const RMSNormConfig* config) {
  if (rms_norm_check(p, true) || p.rows == 0) return 0;
  const Plan plan = make_plan(p, true, config, device);
  const KernelFn fn = kernel_for(p, plan, true);
  const size_t smem = smem_for(p, plan, fn, true);
  if (allow_smem(fn, smem)) return 0;
  return static_cast<size_t>(grid_for(p, plan, fn, device, smem).partial_rows()) * static_cast<size_t>(p.hidden) * sizeof(float);
}

const char* backward(const RMSNormParams& p, cudaStream_t stream, const RMSNormConfig* config) {
  if (const char* e = rms_norm_check(p, true)) return e;
  if (p.rows == 0) {  // dw of no rows is zero
    return cudaMemsetAsync(p.dw, 0, p.hidden * kcpp::kernel::dtype_bytes(p.dtype), stream) == cudaSuccess
               ? nullptr
               : "rms_norm backward: cudaMemsetAsync failed";
  }
  KCPP_KERNEL_REQUIRE(p.workspace != nullptr,
                      "rms_norm backward: argument 'workspace' is null (size it with rms_norm_backward_workspace)");
  int device = 0;
  cudaGetDevice(&device);
  const Plan plan = make_plan(p, true, config, device);
  const KernelFn fn = kernel_for(p, plan, true);
  const size_t smem = smem_for(p, plan, fn, true);
  if (const char* e = allow_smem(fn, smem)) return e;
  const PersistentGrid grid = grid_for(p, plan, fn, device, smem);
  launch_persistent(fn, grid, plan.threads, smem, stream, p, plan.config.stages);  // an error is reported below
  return visit_type(p.dtype, [&]<typename T>(T*) -> const char* {
    column_sums<T>(static_cast<const float*>(p.workspace), grid.partial_rows(), p.hidden, p.hidden, static_cast<T*>(p.dw), stream);
    return launch_error("rms_norm backward");
  });
}

}  // namespace

size_t rms_norm_backward_workspace(const RMSNormParams& p, int device) { return workspace(p, device, nullptr); }
const char* rms_norm_forward_cuda(const RMSNormParams& p, cudaStream_t stream) { return forward(p, stream, nullptr); }
const char* rms_norm_backward_cuda(const RMSNormParams& p, cudaStream_t stream) { return backward(p, stream, nullptr); }

size_t rms_norm_backward_workspace_with(const RMSNormParams& p, int device, const RMSNormConfig& c) {
  return workspace(p, device, &c);
}
const char* rms_norm_forward_cuda_with(const RMSNormParams& p, cudaStream_t stream, const RMSNormConfig& c) {
  return forward(p, stream, &c);
}
const char* rms_norm_backward_cuda_with(const RMSNormParams& p, cudaStream_t stream, const RMSNormConfig& c) {
  return backward(p, stream, &c);
}

}  // namespace kcpp::liger
