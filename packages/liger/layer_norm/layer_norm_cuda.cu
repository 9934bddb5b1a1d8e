// LayerNorm on CUDA (maths in layer_norm.h).
//
// Forward: one block per row (blocks striding over rows).  Rows up to 256 threads x ITEMS (1, 2 or 4)
// 16-byte vectors are held in registers, so x is read once; where the row fills the block, each
// thread's mean and squared deviations of x - x[row, 0] (two passes over its registers) are merged
// over the block in one reduction (Chan's pairwise update, kcpp/kernel/moments.cuh), else the mean
// and then the deviations from it take two.  Wider or unaligned rows take the loop path: the mean,
// then the deviations from it, re-reading the row (from L1 / L2) for those and for the output.
// Backward: a persistent grid; per row, one pass for the two sums (g and g * xhat, reduced together
// with one barrier), one writing dx and adding dy * xhat and dy into the block's own dw / db sums
// (each column has one owner thread: no atomics); on the bulk path clusters of blocks add their sums
// through distributed shared memory; column_sums (kcpp/kernel/column_sums.cuh) then adds the
// blocks' (clusters') sums in a fixed order, in f64, dw and db in one launch.  Rows of up to 512
// 16-byte vectors (4096 bf16 / 2048 f32) hold x, dy and the sums in registers (one vector a thread in
// up to 512 threads, or two in up to 256); on sm_90 those rows come through a shared-memory ring
// filled by the copy engine (the bulk path).  The next row's mean and rstd are loaded while a row
// is computed.
#include <algorithm>

#include <cooperative_groups.h>

#include "kcpp/kernel/bulk.cuh"
#include "kcpp/kernel/column_sums.cuh"
#include "kcpp/kernel/cuda.cuh"
#include "kcpp/kernel/moments.cuh"
#include "layer_norm.h"

namespace kcpp::liger {
namespace {

using namespace kcpp::kernel::cuda;
using kcpp::kernel::DType;

constexpr int kThreads = 256;      // forward, and the backward's loop path
// The backward's registers and bulk paths: one vector a thread in up to 512 threads, or two in up
// to 256 (rows up to 4096 bf16 / 2048 f32), at least 2 blocks an SM.  At [8192, 4096] bf16 on an
// H200 (bench/RESULTS.md) two vectors in 256 threads, with the ~120 registers that leaves, and one
// in 512 (64 registers) are level, 0.0778 / 0.0770 ms; two vectors held to 79 registers (3 blocks
// an SM) took 0.0849-0.0884.
constexpr int kRowThreads = 512;
template <int ITEMS> constexpr int row_threads() { return ITEMS == 1 ? kRowThreads : kRowThreads / 2; }
constexpr int kRowMinBlocks = 2;
constexpr int kMaxStages = 4;  // backward bulk path: rows (x and dy) in flight a block
constexpr int kBulkStages = 2;  // the ring depth used

template <typename T, int VEC>
__device__ __forceinline__ void write_out(const LayerNormParams& p, T* y, int64_t c, const float (&x)[VEC], float mean,
                                          float rstd) {
  float w[VEC], b[VEC], o[VEC];
  load_f32(static_cast<const T*>(p.w) + c, w);
  if (p.b) load_f32(static_cast<const T*>(p.b) + c, b);
#pragma unroll
  for (int k = 0; k < VEC; ++k) o[k] = (x[k] - mean) * rstd * w[k] + (p.b ? b[k] : 0.0f);
  store_f32(y + c, o);
}

// BIAS: a template parameter so that the kernel without one keeps its registers.  MERGE: the row
// fills the block (every thread ITEMS vectors, at least 8 values), the block has a power-of-two
// number of warps: the statistics in one reduction (block_moments); else in two (mean, deviations).
// The merged partial means are of x - K, K the row's first value (every thread loads it): the
// rounding of a partial mean reaches the variance at first order through the merge, and relative to
// K that rounding is of the row's spread, not of its mean (measured without the shift: rows of mean
// 100 and spread 1 at 8 and 16 values a thread, f32, missed the rstd bound by 3-12%).  With fewer
// than 8 values a thread the two reductions are kept.
template <typename T, int VEC, int ITEMS, bool BIAS, bool MERGE>
__global__ void __launch_bounds__(kThreads) forward_registers(const __grid_constant__ LayerNormParams p) {
  __shared__ float scratch[96];
  using V = Vec<T, VEC>;
  const int64_t h = p.hidden;
  for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const T* x = static_cast<const T*>(p.x) + row * p.x_stride;
    V v[ITEMS];
    bool live[ITEMS];
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      const int64_t c = (int64_t(i) * blockDim.x + threadIdx.x) * VEC;
      live[i] = c < h;
      if (live[i]) v[i] = *reinterpret_cast<const V*>(x + c);
    }
    const float k0 = MERGE ? to_f32(x[0]) : 0.0f;  // the shift (one L1 line for the whole block)
    // sum of g(value) over this thread's values (all of them live on the MERGE path)
    auto thread_sum = [&](auto g) {
      float acc = 0.0f;
#pragma unroll
      for (int i = 0; i < ITEMS; ++i) {
        if (!live[i]) continue;
        float f[VEC];
        widen(v[i], f);
#pragma unroll
        for (int k = 0; k < VEC; ++k) acc += g(f[k]);
      }
      return acc;
    };
    float mean, m2;
    if constexpr (MERGE) {
      // The thread's summary of x - k0 (its mean, then the squared deviations from it: two passes
      // over its registers), merged over the block in one reduction (kcpp/kernel/moments.cuh).  The
      // deviations are taken from k0 + the thread's mean, rounded: an offset d there changes m2 by
      // n d^2 only.
      Moments m;
      m.n = ITEMS * VEC;
      m.mean = thread_sum([&](float f) { return f - k0; }) * (1.0f / (ITEMS * VEC));
      const float center = k0 + m.mean;
      m.m2 = thread_sum([&](float f) { return (f - center) * (f - center); });
      m = block_moments(m, scratch);
      mean = k0 + m.mean, m2 = m.m2;
    } else {  // the mean, then the deviations from it: two block reductions
      const float s = thread_sum([](float f) { return f; });
      mean = block_sum(s, scratch) / static_cast<float>(h);
      m2 = block_sum(thread_sum([&](float f) { return (f - mean) * (f - mean); }), scratch);
    }
    // Rounded as the reference rounds it (a division and a square root: rsqrtf's 2 ulp would take
    // most of the f32 error budget).
    const float rstd = 1.0f / sqrtf(m2 / static_cast<float>(h) + p.eps);
    if (threadIdx.x == 0) p.mean[row] = mean, p.rstd[row] = rstd;
    T* y = static_cast<T*>(p.y) + row * p.y_stride;
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      if (!live[i]) continue;
      const int64_t c = (int64_t(i) * blockDim.x + threadIdx.x) * VEC;
      float f[VEC], w[VEC], b[VEC], o[VEC];
      widen(v[i], f);
      load_f32(static_cast<const T*>(p.w) + c, w);
      if constexpr (BIAS) load_f32(static_cast<const T*>(p.b) + c, b);
#pragma unroll
      for (int k = 0; k < VEC; ++k) o[k] = (f[k] - mean) * rstd * w[k] + (BIAS ? b[k] : 0.0f);
      store_f32(y + c, o);
    }
  }
}

// Two passes over the row for the statistics (the mean, then the deviations from it) and one for the
// output, the second and third mostly from L1 / L2.  Not Chan's merge: with a thread's summary of
// only a few values (short rows, 256 threads), the merged f32 partial means carry the mean's rounding
// into the variance at first order; the two-pass form does not.
template <typename T, int VEC>
__global__ void __launch_bounds__(kThreads) forward_loop(const __grid_constant__ LayerNormParams p) {
  __shared__ float scratch[32];
  const int64_t h = p.hidden, step = int64_t(blockDim.x) * VEC;
  for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const T* x = static_cast<const T*>(p.x) + row * p.x_stride;
    float s = 0.0f;
    for (int64_t c = threadIdx.x * VEC; c < h; c += step) {
      float f[VEC];
      load_f32(x + c, f);
#pragma unroll
      for (int k = 0; k < VEC; ++k) s += f[k];
    }
    const float mean = block_sum(s, scratch) / static_cast<float>(h);
    float q = 0.0f;
    for (int64_t c = threadIdx.x * VEC; c < h; c += step) {
      float f[VEC];
      load_f32(x + c, f);
#pragma unroll
      for (int k = 0; k < VEC; ++k) q += (f[k] - mean) * (f[k] - mean);
    }
    const float rstd = 1.0f / sqrtf(block_sum(q, scratch) / static_cast<float>(h) + p.eps);
    if (threadIdx.x == 0) p.mean[row] = mean, p.rstd[row] = rstd;
    T* y = static_cast<T*>(p.y) + row * p.y_stride;
    for (int64_t c = threadIdx.x * VEC; c < h; c += step) {
      float f[VEC];
      load_f32(x + c, f);
      write_out<T, VEC>(p, y, c, f, mean, rstd);
    }
  }
}

// The block's dw / db sums live in shared memory when 2 x h floats fit (SMEM), else directly in its
// [2, h] rows of the workspace (a read-modify-write per element and row: slow, only for h > 6144);
// either way they end in the workspace rows, which column_sums adds.
template <typename T, int VEC, bool SMEM>
__global__ void __launch_bounds__(kThreads) backward_loop(const __grid_constant__ LayerNormParams p, int /*stages*/) {
  __shared__ float scratch[64];
  extern __shared__ float sums_smem[];
  const int64_t h = p.hidden, step = int64_t(blockDim.x) * VEC;
  const float inv_h = 1.0f / static_cast<float>(h);
  float* out_rows = static_cast<float*>(p.workspace) + int64_t(blockIdx.x) * 2 * h;
  float* dw = SMEM ? sums_smem : out_rows;
  float* db = dw + h;
  for (int64_t c = threadIdx.x * VEC; c < h; c += step)
#pragma unroll
    for (int k = 0; k < VEC; ++k) dw[c + k] = db[c + k] = 0.0f;  // each column: one owner thread
  const T* wp = static_cast<const T*>(p.w);
  for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const T* x = static_cast<const T*>(p.x) + row * p.x_stride;
    const T* dy = static_cast<const T*>(p.dy) + row * p.dy_stride;
    const float mean = p.mean[row], rstd = p.rstd[row];
    float sg = 0.0f, sgx = 0.0f;
    for (int64_t c = threadIdx.x * VEC; c < h; c += step) {
      float xv[VEC], dv[VEC], w[VEC];
      load_f32(x + c, xv);
      load_f32(dy + c, dv);
      load_f32(wp + c, w);
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        const float g = dv[k] * w[k];
        sg += g;
        sgx += g * (xv[k] - mean) * rstd;
      }
    }
    const float2 sums = block_sum2(sg, sgx, scratch);
    const float mg = sums.x * inv_h, mgx = sums.y * inv_h;
    T* dx = static_cast<T*>(p.dx) + row * p.dx_stride;
    for (int64_t c = threadIdx.x * VEC; c < h; c += step) {
      float xv[VEC], dv[VEC], w[VEC], o[VEC];
      load_f32(x + c, xv);
      load_f32(dy + c, dv);
      load_f32(wp + c, w);
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        const float xh = (xv[k] - mean) * rstd;
        o[k] = rstd * (dv[k] * w[k] - mg - xh * mgx);
        dw[c + k] += dv[k] * xh;
        db[c + k] += dv[k];
      }
      store_f32(dx + c, o);
    }
  }
  if constexpr (SMEM)
    for (int64_t c = threadIdx.x * VEC; c < h; c += step)
#pragma unroll
      for (int k = 0; k < VEC; ++k) out_rows[c + k] = dw[c + k], out_rows[h + c + k] = db[c + k];
}

// A thread's part of the backward on the registers and bulk paths (rows of up to 512 16-byte
// vectors, ITEMS a thread): w and the block's dw / db sums for its columns stay in registers across
// rows (each thread owns its columns); row() does one row from wherever its x and dy are (global
// memory, or a shared-memory slot of the bulk path's ring), reading each once.
template <typename T, int VEC, int ITEMS> struct BackwardRows {
  using V = Vec<T, VEC>;
  float w[ITEMS][VEC];  // widened once
  float dw[ITEMS][VEC], db[ITEMS][VEC];
  bool live[ITEMS];
  float inv_h;
  uint32_t phase = 0;  // of block_sum2_alternating: rows alternate halves of the scratch

  __device__ static int64_t column(int i) { return (int64_t(i) * blockDim.x + threadIdx.x) * VEC; }

  __device__ explicit BackwardRows(const LayerNormParams& p) : inv_h(1.0f / static_cast<float>(p.hidden)) {
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      live[i] = column(i) < p.hidden;
      V wv{};
      if (live[i]) wv = *reinterpret_cast<const V*>(static_cast<const T*>(p.w) + column(i));
      widen(wv, w[i]);
#pragma unroll
      for (int k = 0; k < VEC; ++k) dw[i][k] = db[i][k] = 0.0f;
    }
  }

  // Reads the row into registers (every load issued before any use) and widens it once, keeping
  // d = x - mean and dy in f32 across the reduction; reduces the two sums over the block (one
  // barrier), calls reduced() once that barrier shows that every thread has read the row (the bulk
  // path refills the slot there), then writes dx and adds to the dw / db sums.  With g = dy w and
  // xhat = d rstd, dx = rstd (g - mean(g) - xhat mean(g xhat)) = rstd g + (B d + C), B = -rstd^2
  // mean(g xhat), C = -rstd mean(g): two fma an element (x, dy and w were widened twice a row:
  // 519 instructions a row and thread at two vectors, now 459).  `scratch`: 128 floats.
  template <typename F>
  __device__ __forceinline__ void row(const LayerNormParams& p, int64_t row, float mean, float rstd, const T* x,
                                      const T* dy, float* scratch, F&& reduced) {
    V xv[ITEMS], dv[ITEMS];
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      if (!live[i]) continue;
      xv[i] = *reinterpret_cast<const V*>(x + column(i));
      dv[i] = *reinterpret_cast<const V*>(dy + column(i));
    }
    float d[ITEMS][VEC], df[ITEMS][VEC];
    float sg = 0.0f, sgx = 0.0f;
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      if (!live[i]) continue;
      widen(xv[i], d[i]);
      widen(dv[i], df[i]);
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        d[i][k] -= mean;
        const float g = df[i][k] * w[i][k];
        sg += g;
        sgx = fmaf(g, d[i][k], sgx);  // times rstd once, below
      }
    }
    const float2 sums = block_sum2_alternating(sg, sgx, scratch, phase);
    phase ^= 1u;
    reduced();
    const float mg = sums.x * inv_h, mgx = sums.y * (rstd * inv_h);  // mean(g), mean(g xhat)
    const float b = -rstd * rstd * mgx, c = -rstd * mg;
    T* dx = static_cast<T*>(p.dx) + row * p.dx_stride;
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      if (!live[i]) continue;
      float o[VEC];
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        o[k] = fmaf(rstd, df[i][k] * w[i][k], fmaf(b, d[i][k], c));
        dw[i][k] = fmaf(df[i][k], d[i][k] * rstd, dw[i][k]);
        db[i][k] += df[i][k];
      }
      store_f32(dx + column(i), o);
    }
  }

  // The cluster's dw / db sums to its pair of workspace rows (kcpp/kernel/column_sums.cuh), staged
  // in `stage` (2 h floats of the block's shared memory, free once the rows are done).
  template <typename Cluster>
  __device__ __forceinline__ void write_cluster_partial(const LayerNormParams& p, float* stage, const Cluster& cluster) const {
    const int64_t h = p.hidden;
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      if (!live[i]) continue;
#pragma unroll
      for (int k = 0; k < VEC; ++k) stage[column(i) + k] = dw[i][k], stage[h + column(i) + k] = db[i][k];
    }
    cluster_column_sums(stage, 2 * h, static_cast<float*>(p.workspace) + int64_t(blockIdx.x / cluster.num_blocks()) * 2 * h, cluster);
  }

  // The block's dw / db sums to its own pair of workspace rows (column_sums adds them).
  __device__ __forceinline__ void write_partial(const LayerNormParams& p) const {
    const int64_t h = p.hidden;
    float* out = static_cast<float*>(p.workspace) + int64_t(blockIdx.x) * 2 * h;
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      if (!live[i]) continue;
#pragma unroll
      for (int k = 0; k < VEC; ++k) out[column(i) + k] = dw[i][k], out[h + column(i) + k] = db[i][k];
    }
  }
};

// A row's saved statistics, loaded a row ahead: read at the row's start, their latency was exposed
// once a row (ncu: the RMSNorm backward's main stall).
struct RowStats {
  float mean = 0.0f, rstd = 0.0f;
  __device__ static RowStats load(const LayerNormParams& p, int64_t row) {
    return row < p.rows ? RowStats{p.mean[row], p.rstd[row]} : RowStats{};
  }
};

template <typename T, int VEC, int ITEMS>
__global__ void __launch_bounds__(row_threads<ITEMS>(), kRowMinBlocks) backward_registers(const __grid_constant__ LayerNormParams p, int /*stages*/) {
  __shared__ float scratch[128];
  BackwardRows<T, VEC, ITEMS> t(p);
  RowStats st = RowStats::load(p, blockIdx.x);
  for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const RowStats next = RowStats::load(p, row + gridDim.x);
    t.row(p, row, st.mean, st.rstd, static_cast<const T*>(p.x) + row * p.x_stride,
          static_cast<const T*>(p.dy) + row * p.dy_stride, scratch, [] {});
    st = next;
  }
  griddep_launch_dependents();  // column_sums may start launching (it waits for these writes)
  t.write_partial(p);
}

// The bulk path (sm_90): as backward_registers, but the x and dy rows come through a ring of
// `stages` shared-memory slots filled by the copy engine (kcpp/kernel/bulk.cuh), so the next rows'
// loads are in flight while a row is computed.  Each slot is refilled as soon as the pair
// reduction's barrier shows every thread has read it.
template <typename T, int VEC, int ITEMS>
__global__ void __launch_bounds__(row_threads<ITEMS>(), kRowMinBlocks) backward_bulk(const __grid_constant__ LayerNormParams p, int stages) {
  extern __shared__ __align__(128) unsigned char smem_raw[];  // stages x (x, dy) rows of T
  __shared__ uint64_t full[kMaxStages];
  __shared__ float scratch[128];
  const int64_t h = p.hidden;
  const uint32_t row_bytes = static_cast<uint32_t>(h * sizeof(T));
  T* const ring = reinterpret_cast<T*>(smem_raw);
  BackwardRows<T, VEC, ITEMS> t(p);
  if (threadIdx.x == 0) bulk_init(full, stages);
  __syncthreads();
  // Thread 0: `row` (if any) into ring slot `slot`.
  auto issue = [&](int64_t row, int slot) {
    if (row >= p.rows) return;
    uint64_t* bar = &full[slot];
    T* dst = ring + slot * 2 * h;
    bulk_expect(bar, 2 * row_bytes);
    bulk_load(dst, static_cast<const T*>(p.x) + row * p.x_stride, row_bytes, bar);
    bulk_load(dst + h, static_cast<const T*>(p.dy) + row * p.dy_stride, row_bytes, bar);
  };
  const int64_t ahead = int64_t(stages) * gridDim.x;  // a slot's next row
  if (threadIdx.x == 0)
    for (int s = 0; s < stages; ++s) issue(blockIdx.x + int64_t(s) * gridDim.x, s);
  RingCursor ring_at;
  RowStats st = RowStats::load(p, blockIdx.x);
  for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x, ring_at.advance(stages)) {
    const RowStats next = RowStats::load(p, row + gridDim.x);
    const T* slot = ring + ring_at.slot * 2 * h;
    bulk_wait(&full[ring_at.slot], ring_at.parity);
    t.row(p, row, st.mean, st.rstd, slot, slot + h, scratch, [&] {
      if (threadIdx.x == 0) issue(row + ahead, ring_at.slot);
    });
    st = next;
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

int vec_for(const LayerNormParams& p, bool backward) {
  const int vec = 16 / kcpp::kernel::dtype_bytes(p.dtype);
  bool ok = p.hidden % vec == 0 && aligned16(p.x) && aligned16(p.w) && (!p.b || aligned16(p.b)) && p.x_stride % vec == 0;
  if (backward) ok = ok && aligned16(p.dy) && aligned16(p.dx) && p.dy_stride % vec == 0 && p.dx_stride % vec == 0;
  else ok = ok && aligned16(p.y) && p.y_stride % vec == 0;
  return ok ? vec : 1;
}

using KernelFn = void (*)(LayerNormParams, int);  // the int: ring depth of the bulk path (others ignore it)

struct BackwardPlan {
  KernelFn fn = nullptr;
  int threads = kThreads;
  size_t smem = 0;  // dynamic shared memory
  bool bulk = false;
};

// The backward kernel for these params: on sm_90 the bulk path while the row fits 256 threads x 2
// vectors (4096 bf16 / 2048 f32) and its ring fits shared memory; elsewhere the registers path for
// those rows; else the loop path (sums in shared memory while 2 x h floats fit).  Row paths: ITEMS
// vectors a thread (`items` 1 or 2 asks for one where the row fits; 0: the default, measured in
// bench/RESULTS.md).
BackwardPlan backward_plan(const LayerNormParams& p, int device, int items_given) {
  BackwardPlan plan;
  const int vec = vec_for(p, true);
  const bool in_smem = 2 * p.hidden * int64_t(sizeof(float)) <= 48 * 1024;
  // The ring, which also stages the block's 2 h float sums for the cluster's addition at the end.
  const size_t ring = std::max(size_t(kBulkStages) * 2 * size_t(p.hidden) * kcpp::kernel::dtype_bytes(p.dtype),
                               2 * size_t(p.hidden) * sizeof(float));
  const bool bulk = device_attribute(cudaDevAttrComputeCapabilityMajor, device) >= 9 &&
                    ring + 1024 <= size_t(device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  auto pick = [&]<typename T>(T*) {
    constexpr int V = 16 / sizeof(T);
    const int64_t nvec = p.hidden / vec;
    if (vec > 1 && nvec <= 2 * row_threads<2>()) {
      int items = nvec <= row_threads<2>() ? 1 : 2;
      if (items_given == 1 || items_given == 2) items = items_given;  // both fit: nvec <= 512
      plan.threads = static_cast<int>(std::max<int64_t>(32, ((nvec + items - 1) / items + 31) / 32 * 32));
      plan.bulk = bulk;
      if (bulk) plan.smem = ring;
      if (items == 1) plan.fn = bulk ? backward_bulk<T, V, 1> : backward_registers<T, V, 1>;
      else plan.fn = bulk ? backward_bulk<T, V, 2> : backward_registers<T, V, 2>;
    } else if (in_smem) {
      plan.smem = 2 * static_cast<size_t>(p.hidden) * sizeof(float);
      plan.fn = vec == 1 ? backward_loop<T, 1, true> : backward_loop<T, V, true>;
    } else {
      plan.fn = vec == 1 ? backward_loop<T, 1, false> : backward_loop<T, V, false>;
    }
  };
  switch (p.dtype) {
    case DType::f32: pick(static_cast<float*>(nullptr)); break;
    case DType::bf16: pick(static_cast<__nv_bfloat16*>(nullptr)); break;
    case DType::f16: pick(static_cast<__half*>(nullptr)); break;
  }
  // Beyond the default 48 KiB (with the static shared memory) the kernel must ask, before the
  // occupancy query too.
  if (plan.smem + 1024 > 48 * 1024)
    if (cudaFuncSetAttribute(plan.fn, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(plan.smem)) != cudaSuccess)
      (void)cudaGetLastError();  // the launch then reports it
  return plan;
}

// Persistent (kcpp/kernel/column_sums.cuh), in clusters on the bulk path (`cluster_given` 1, 2, 4 or
// 8; 1: none; else kPartialSumCluster).
PersistentGrid backward_grid(const LayerNormParams& p, const BackwardPlan& plan, int device, int blocks_per_sm, int cluster_given) {
  const bool given = cluster_given == 1 || cluster_given == 2 || cluster_given == 4 || cluster_given == 8;
  const int cluster = !plan.bulk ? 1 : given ? cluster_given : kPartialSumCluster;
  return persistent_grid(plan.fn, plan.threads, plan.smem, device, p.rows, blocks_per_sm, cluster);
}

template <typename F> const char* visit_type(DType t, F&& f) {
  switch (t) {
    case DType::f32: return f(static_cast<float*>(nullptr));
    case DType::bf16: return f(static_cast<__nv_bfloat16*>(nullptr));
    case DType::f16: return f(static_cast<__half*>(nullptr));
  }
  return "layer_norm: unknown dtype";
}

}  // namespace

size_t layer_norm_backward_workspace(const LayerNormParams& p, int device) {
  return layer_norm_backward_workspace_with(p, device, 0, 0, 0);
}

size_t layer_norm_backward_workspace_with(const LayerNormParams& p, int device, int items, int blocks_per_sm, int cluster) {
  if (layer_norm_check(p, true) || p.rows == 0) return 0;
  const BackwardPlan plan = backward_plan(p, device, items);
  return static_cast<size_t>(backward_grid(p, plan, device, blocks_per_sm, cluster).partial_rows()) * 2 *
         static_cast<size_t>(p.hidden) * sizeof(float);
}

const char* layer_norm_forward_cuda(const LayerNormParams& p, cudaStream_t stream) {
  return layer_norm_forward_cuda_with(p, stream, 0);
}

const char* layer_norm_forward_cuda_with(const LayerNormParams& p, cudaStream_t stream, int items_given) {
  if (const char* e = layer_norm_check(p, false)) return e;
  if (p.rows == 0) return nullptr;
  const int vec = vec_for(p, false);
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>(p.rows, int64_t(1) << 30));
  const int64_t nvec = p.hidden / vec;
  return visit_type(p.dtype, [&]<typename T>(T*) -> const char* {
    constexpr int V = 16 / sizeof(T);
    // Registers while the row fits 256 threads x 4 vectors, about 128 threads a row (the sweep of
    // bench_kernels.cpp, H200, [8192, 4096] bf16: 4 vectors x 128 threads 0.0400 ms, 2 x 256 0.0421).
    int items = nvec <= kThreads / 2 ? 1 : nvec <= kThreads ? 2 : 4;
    if ((items_given == 1 || items_given == 2 || items_given == 4) && nvec <= int64_t(items_given) * kThreads)
      items = items_given;
    const int64_t per_item = (nvec + items - 1) / items;
    const int threads = static_cast<int>(std::min<int64_t>(kThreads, std::max<int64_t>(32, (per_item + 31) / 32 * 32)));
    if (vec == 1 || nvec > 4 * kThreads) {
      if (vec == 1) forward_loop<T, 1><<<grid, kThreads, 0, stream>>>(p);
      else forward_loop<T, V><<<grid, kThreads, 0, stream>>>(p);
    } else {
      const int warps = threads / 32;
      const bool uniform = nvec == int64_t(threads) * items && (warps & (warps - 1)) == 0 && items * V >= 8;
      auto launch = [&]<int ITEMS>() {
        using K = void (*)(LayerNormParams);
        const K k = p.b ? (uniform ? forward_registers<T, V, ITEMS, true, true> : forward_registers<T, V, ITEMS, true, false>)
                        : (uniform ? forward_registers<T, V, ITEMS, false, true> : forward_registers<T, V, ITEMS, false, false>);
        k<<<grid, threads, 0, stream>>>(p);
      };
      if (items == 1) launch.template operator()<1>();
      else if (items == 2) launch.template operator()<2>();
      else launch.template operator()<4>();
    }
    return launch_error("layer_norm forward");
  });
}

const char* layer_norm_backward_cuda(const LayerNormParams& p, cudaStream_t stream) {
  return layer_norm_backward_cuda_with(p, stream, 0, 0, 0);
}

const char* layer_norm_backward_cuda_with(const LayerNormParams& p, cudaStream_t stream, int items, int blocks_per_sm, int cluster) {
  if (const char* e = layer_norm_check(p, true)) return e;
  const size_t wbytes = static_cast<size_t>(p.hidden) * kcpp::kernel::dtype_bytes(p.dtype);
  if (p.rows == 0) {  // the gradients of no rows are zero
    if (cudaMemsetAsync(p.dw, 0, wbytes, stream) != cudaSuccess || (p.db && cudaMemsetAsync(p.db, 0, wbytes, stream) != cudaSuccess))
      return "layer_norm backward: cudaMemsetAsync failed";
    return nullptr;
  }
  KCPP_KERNEL_REQUIRE(p.workspace != nullptr,
                      "layer_norm backward: argument 'workspace' is null (size it with layer_norm_backward_workspace)");
  int device = 0;
  cudaGetDevice(&device);
  const BackwardPlan plan = backward_plan(p, device, items);
  const PersistentGrid grid = backward_grid(p, plan, device, blocks_per_sm, cluster);
  launch_persistent(plan.fn, grid, plan.threads, plan.smem, stream, p, kBulkStages);  // an error is reported below
  return visit_type(p.dtype, [&]<typename T>(T*) -> const char* {
    // Each block's (or cluster's) pair of rows (dw, db), both in one launch; f64 sums keep the
    // order's rounding out of the result.
    column_sums<T, double>(static_cast<const float*>(p.workspace), grid.partial_rows(), 2 * p.hidden, p.hidden,
                           static_cast<T*>(p.dw), stream, static_cast<T*>(p.db));
    return launch_error("layer_norm backward");
  });
}

}  // namespace kcpp::liger
