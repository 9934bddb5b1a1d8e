// RMSNorm on CUDA (maths in rms_norm.h).
//
// One block per row; blocks stride over rows, so the weight is read into registers once per block.
// Two code paths, chosen per call:
//  - registers: the row is held in registers as ITEMS 16-byte vectors per thread (ITEMS = 1, 2, 4,
//    so H up to 4096 vectors: 32768 bf16 or 16384 f32), read from memory exactly once;
//  - loop: any H and alignment; the row is read twice (the second read mostly hits L2).
// Backward accumulates dw in registers (registers path) or in the block's own workspace row (loop
// path); a second kernel adds the blocks' rows in a fixed order (deterministic, no atomics).
#include "kcpp/kernel/cuda.cuh"
#include "rms_norm.h"

namespace kcpp::liger {
namespace {

using namespace kcpp::kernel::cuda;
using kcpp::kernel::DType;

constexpr int kMaxThreads = 1024;         // loop path
constexpr int kMaxRegisterThreads = 512;  // registers path: leaves 128 registers a thread

// The normalised value n as the forward rounds it (see the casting modes in rms_norm.h).
template <typename T> __device__ __forceinline__ float normed(float x, float rstd, RMSNormCasting c) {
  switch (c) {
    case RMSNormCasting::Llama: return round_to<T>(x * rstd);
    case RMSNormCasting::Gemma: return x * rstd;
    case RMSNormCasting::None: return round_to<T>(x * round_to<T>(rstd));
  }
  return x * rstd;
}

// ---- forward -------------------------------------------------------------------------------------

// The registers path holds rows as raw 16-byte vectors (4 registers per 8 bf16) and widens to f32
// at the point of use, so that x, dy and w of a thread fit without spilling.
template <typename T, int VEC> __device__ __forceinline__ void widen(const Vec<T, VEC>& v, float (&out)[VEC]) {
#pragma unroll
  for (int k = 0; k < VEC; ++k) out[k] = to_f32(v.v[k]);
}

template <typename T, int VEC, int ITEMS>
__global__ void __launch_bounds__(kMaxRegisterThreads) forward_registers(const __grid_constant__ RMSNormParams p) {
  __shared__ float scratch[32];
  using V = Vec<T, VEC>;
  const int64_t h = p.hidden;
  V w[ITEMS];
  bool live[ITEMS];
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    const int64_t c = (int64_t(i) * blockDim.x + threadIdx.x) * VEC;
    live[i] = c < h;
    if (live[i]) w[i] = *reinterpret_cast<const V*>(static_cast<const T*>(p.w) + c);
  }
  // Software pipelining: the next row's loads are issued before this row's reduction and stores,
  // so that every block keeps bytes in flight.
  V next[ITEMS];
  auto load_row = [&](int64_t row, V (&dst)[ITEMS]) {
    const T* x = static_cast<const T*>(p.x) + row * p.x_stride;  // [h]
#pragma unroll
    for (int i = 0; i < ITEMS; ++i)
      if (live[i]) dst[i] = *reinterpret_cast<const V*>(x + (int64_t(i) * blockDim.x + threadIdx.x) * VEC);
  };
  if (blockIdx.x < p.rows) load_row(blockIdx.x, next);
  for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    T* y = static_cast<T*>(p.y) + row * p.y_stride;
    V v[ITEMS];
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) v[i] = next[i];
    if (row + gridDim.x < p.rows) load_row(row + gridDim.x, next);
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
    const float rstd = 1.0f / sqrtf(ss / static_cast<float>(h) + p.eps);
    if (threadIdx.x == 0) p.rstd[row] = rstd;
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      if (!live[i]) continue;
      float f[VEC], wf[VEC], o[VEC];
      widen(v[i], f);
      widen(w[i], wf);
#pragma unroll
      for (int k = 0; k < VEC; ++k) o[k] = normed<T>(f[k], rstd, p.casting) * (wf[k] + p.offset);
      store_f32(y + (int64_t(i) * blockDim.x + threadIdx.x) * VEC, o);
    }
  }
}

template <typename T, int VEC>
__global__ void __launch_bounds__(kMaxThreads) forward_loop(const __grid_constant__ RMSNormParams p) {
  __shared__ float scratch[32];
  const int64_t h = p.hidden, step = int64_t(blockDim.x) * VEC;
  const T* wp = static_cast<const T*>(p.w);
  for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const T* x = static_cast<const T*>(p.x) + row * p.x_stride;
    T* y = static_cast<T*>(p.y) + row * p.y_stride;
    float ss = 0.0f;
    for (int64_t c = threadIdx.x * VEC; c < h; c += step) {
      float v[VEC];
      load_f32(x + c, v);
#pragma unroll
      for (int k = 0; k < VEC; ++k) ss += v[k] * v[k];
    }
    ss = block_sum(ss, scratch);
    const float rstd = 1.0f / sqrtf(ss / static_cast<float>(h) + p.eps);
    if (threadIdx.x == 0) p.rstd[row] = rstd;
    for (int64_t c = threadIdx.x * VEC; c < h; c += step) {
      float v[VEC], w[VEC], o[VEC];
      load_f32(x + c, v);
      load_f32(wp + c, w);
#pragma unroll
      for (int k = 0; k < VEC; ++k) o[k] = normed<T>(v[k], rstd, p.casting) * (w[k] + p.offset);
      store_f32(y + c, o);
    }
  }
}

// ---- backward ------------------------------------------------------------------------------------

// dw is summed in shared memory ([h] f32, dynamic): each column has one owner thread, so no atomics,
// and the registers go to keeping two rows of x and dy in flight.
template <typename T, int VEC, int ITEMS>
__global__ void __launch_bounds__(kMaxRegisterThreads) backward_registers(const __grid_constant__ RMSNormParams p) {
  __shared__ float scratch[32];
  extern __shared__ float dw_smem[];  // [h]
  using V = Vec<T, VEC>;
  const int64_t h = p.hidden;
  const float inv_h = 1.0f / static_cast<float>(h);
  V w[ITEMS];
  bool live[ITEMS];
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    const int64_t c = (int64_t(i) * blockDim.x + threadIdx.x) * VEC;
    live[i] = c < h;
    if (live[i]) w[i] = *reinterpret_cast<const V*>(static_cast<const T*>(p.w) + c);
#pragma unroll
    for (int k = 0; k < VEC; ++k)
      if (live[i]) dw_smem[c + k] = 0.0f;
  }
  V nx[ITEMS], nd[ITEMS];  // the next row, in flight
  auto load_row = [&](int64_t row) {
    const T* x = static_cast<const T*>(p.x) + row * p.x_stride;
    const T* dy = static_cast<const T*>(p.dy) + row * p.dy_stride;
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      if (!live[i]) continue;
      const int64_t c = (int64_t(i) * blockDim.x + threadIdx.x) * VEC;
      nx[i] = *reinterpret_cast<const V*>(x + c);
      nd[i] = *reinterpret_cast<const V*>(dy + c);
    }
  };
  if (blockIdx.x < p.rows) load_row(blockIdx.x);
  for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    T* dx = static_cast<T*>(p.dx) + row * p.dx_stride;
    V xv[ITEMS], dv[ITEMS];
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) xv[i] = nx[i], dv[i] = nd[i];
    const float rstd = p.rstd[row];
    if (row + gridDim.x < p.rows) load_row(row + gridDim.x);
    float dot = 0.0f;
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      if (!live[i]) continue;
      const int64_t c = (int64_t(i) * blockDim.x + threadIdx.x) * VEC;
      float xf[VEC], df[VEC], wf[VEC];
      widen(xv[i], xf);
      widen(dv[i], df);
      widen(w[i], wf);
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        dot += df[k] * (wf[k] + p.offset) * (xf[k] * rstd);  // g * n, n unrounded (d round / dn = 1)
        dw_smem[c + k] += df[k] * normed<T>(xf[k], rstd, p.casting);
      }
    }
    dot = block_sum(dot, scratch) * inv_h;
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      if (!live[i]) continue;
      float xf[VEC], df[VEC], wf[VEC], o[VEC];
      widen(xv[i], xf);
      widen(dv[i], df);
      widen(w[i], wf);
#pragma unroll
      for (int k = 0; k < VEC; ++k) o[k] = rstd * (df[k] * (wf[k] + p.offset) - xf[k] * rstd * dot);
      store_f32(dx + (int64_t(i) * blockDim.x + threadIdx.x) * VEC, o);
    }
  }
  float* part = static_cast<float*>(p.workspace) + int64_t(blockIdx.x) * h;  // this block's dw row
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    if (!live[i]) continue;
    const int64_t c = (int64_t(i) * blockDim.x + threadIdx.x) * VEC;
#pragma unroll
    for (int k = 0; k < VEC; ++k) part[c + k] = dw_smem[c + k];
  }
}

template <typename T, int VEC>
__global__ void __launch_bounds__(kMaxThreads) backward_loop(const __grid_constant__ RMSNormParams p) {
  __shared__ float scratch[32];
  const int64_t h = p.hidden, step = int64_t(blockDim.x) * VEC;
  const float inv_h = 1.0f / static_cast<float>(h);
  const T* wp = static_cast<const T*>(p.w);
  float* part = static_cast<float*>(p.workspace) + int64_t(blockIdx.x) * h;  // owned by this block
  for (int64_t c = threadIdx.x; c < h; c += blockDim.x) part[c] = 0.0f;
  for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const T* x = static_cast<const T*>(p.x) + row * p.x_stride;
    const T* dy = static_cast<const T*>(p.dy) + row * p.dy_stride;
    T* dx = static_cast<T*>(p.dx) + row * p.dx_stride;
    const float rstd = p.rstd[row];
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
        part[c + k] += dv[k] * normed<T>(xv[k], rstd, p.casting);  // each column has one owner thread
      }
      store_f32(dx + c, o);
    }
  }
}

// dw[c] = sum over blocks of the workspace rows, in block order.
template <typename T> __global__ void reduce_dw(const float* part, int blocks, int64_t h, T* dw) {
  for (int64_t c = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; c < h; c += int64_t(gridDim.x) * blockDim.x) {
    float s = 0.0f;
    for (int b = 0; b < blocks; ++b) s += part[int64_t(b) * h + c];
    dw[c] = from_f32<T>(s);
  }
}

// ---- launch plan ---------------------------------------------------------------------------------

struct Plan {
  int vec = 1;      // elements per access
  int items = 0;    // vectors per thread held in registers; 0: loop path
  int threads = 32;
};

bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15u) == 0; }

int round32(int64_t t, int max_threads) {
  return static_cast<int>(std::min<int64_t>(max_threads, std::max<int64_t>(32, (t + 31) / 32 * 32)));
}

Plan plan_for(const RMSNormParams& p, bool backward) {
  const int vec = 16 / kcpp::kernel::dtype_bytes(p.dtype);
  bool ok = p.hidden % vec == 0 && aligned16(p.x) && aligned16(p.w) && p.x_stride % vec == 0;
  if (!backward) ok = ok && aligned16(p.y) && p.y_stride % vec == 0;
  else ok = ok && aligned16(p.dy) && aligned16(p.dx) && p.dy_stride % vec == 0 && p.dx_stride % vec == 0;
  Plan plan;
  if (!ok) {
    plan.threads = round32(std::min<int64_t>(p.hidden, 256), kMaxThreads);
    return plan;
  }
  plan.vec = vec;
  const int64_t nvec = p.hidden / vec;
  // Up to 512 threads a row, more vectors a thread for longer rows, up to a register budget of 32 row
  // elements a thread (forward) or 16 (backward: x, dy and the dw sums); beyond it ptxas spills
  // (seen with -Xptxas -v), and the loop path is faster.
  const int max_items = (backward ? 16 : 32) / vec;
  // The backward's dw row lives in shared memory: at most the 48 KiB a block gets by default.
  const bool fits = !backward || p.hidden * static_cast<int64_t>(sizeof(float)) <= 48 * 1024;
  for (int items = 1; fits && items <= max_items; items *= 2) {
    if (nvec <= int64_t(kMaxRegisterThreads) * items) {  // fewest vectors a thread: fewest registers
      plan.items = items;
      plan.threads = round32((nvec + items - 1) / items, kMaxRegisterThreads);
      return plan;
    }
  }
  plan.threads = 256;  // too long for registers: loop path with vectors
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

using KernelFn = void (*)(RMSNormParams);

// Only the variants plan_for can pick are instantiated: register variants for aligned rows within
// the register budget (items * VEC <= 32 forward, <= 16 backward), the loop path otherwise.
template <typename T, int VEC> KernelFn kernel_for(const Plan& plan, bool backward) {
  if constexpr (VEC == 1) {
    return backward ? backward_loop<T, 1> : forward_loop<T, 1>;
  } else if (backward) {
    if (plan.items == 1) return backward_registers<T, VEC, 1>;
    if constexpr (2 * VEC <= 16) if (plan.items == 2) return backward_registers<T, VEC, 2>;
    if constexpr (4 * VEC <= 16) if (plan.items == 4) return backward_registers<T, VEC, 4>;
    return backward_loop<T, VEC>;
  } else {
    if (plan.items == 1) return forward_registers<T, VEC, 1>;
    if constexpr (2 * VEC <= 32) if (plan.items == 2) return forward_registers<T, VEC, 2>;
    if constexpr (4 * VEC <= 32) if (plan.items == 4) return forward_registers<T, VEC, 4>;
    if constexpr (8 * VEC <= 32) if (plan.items == 8) return forward_registers<T, VEC, 8>;
    return forward_loop<T, VEC>;
  }
}

KernelFn kernel_for(const RMSNormParams& p, const Plan& plan, bool backward) {
  KernelFn fn = nullptr;
  visit_type(p.dtype, [&]<typename T>(T*) -> const char* {
    fn = plan.vec == 1 ? kernel_for<T, 1>(plan, backward) : kernel_for<T, 16 / sizeof(T)>(plan, backward);
    return nullptr;
  });
  return fn;
}

// A persistent grid: as many blocks as can be resident at once (asked of the occupancy API), each
// striding over rows, so that per-block work (the weight load, the dw row) is paid once per block.
// Dynamic shared memory of a launch: the dw row of the backward registers path.
size_t smem_for(const RMSNormParams& p, const Plan& plan, bool backward) {
  return backward && plan.items > 0 ? static_cast<size_t>(p.hidden) * sizeof(float) : 0;
}

int grid_for(const RMSNormParams& p, const Plan& plan, KernelFn fn, int device, size_t smem) {
  int per_sm = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, fn, plan.threads, smem) != cudaSuccess || per_sm < 1) {
    (void)cudaGetLastError();
    per_sm = 1;
  }
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(p.rows, int64_t(sm_count(device)) * per_sm)));
}

}  // namespace

size_t rms_norm_backward_workspace(const RMSNormParams& p, int device) {
  if (rms_norm_check(p, true) || p.rows == 0) return 0;
  const Plan plan = plan_for(p, true);
  return static_cast<size_t>(grid_for(p, plan, kernel_for(p, plan, true), device, smem_for(p, plan, true))) *
         static_cast<size_t>(p.hidden) * sizeof(float);
}

const char* rms_norm_forward_cuda(const RMSNormParams& p, cudaStream_t stream) {
  if (const char* e = rms_norm_check(p, false)) return e;
  if (p.rows == 0) return nullptr;
  int device = 0;
  cudaGetDevice(&device);
  const Plan plan = plan_for(p, false);
  const KernelFn fn = kernel_for(p, plan, false);
  fn<<<grid_for(p, plan, fn, device, 0), plan.threads, 0, stream>>>(p);
  return launch_error("rms_norm forward");
}

const char* rms_norm_backward_cuda(const RMSNormParams& p, cudaStream_t stream) {
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
  const Plan plan = plan_for(p, true);
  const KernelFn fn = kernel_for(p, plan, true);
  const size_t smem = smem_for(p, plan, true);
  const int blocks = grid_for(p, plan, fn, device, smem);
  fn<<<blocks, plan.threads, smem, stream>>>(p);
  const unsigned rgrid = static_cast<unsigned>(std::min<int64_t>((p.hidden + 255) / 256, 65535));
  return visit_type(p.dtype, [&]<typename T>(T*) -> const char* {
    reduce_dw<T><<<rgrid, 256, 0, stream>>>(static_cast<const float*>(p.workspace), blocks, p.hidden,
                                           static_cast<T*>(p.dw));
    return launch_error("rms_norm backward");
  });
}

}  // namespace kcpp::liger
