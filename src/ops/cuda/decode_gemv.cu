// The fused decode projections (ops/nn/decode_fused.h): a prologue that makes the M <= 4 input rows
// of a projection, then the few-row product of ops/cuda/gemv.cu (gemv.cuh) over them
// (add_rms_norm_linear_glu: the AddNorm prologue, and the gated activation of each gate / up pair of
// columns after their sums).
//
// Each block makes the rows itself, in shared memory [M, K] rounded to T (what the eager
// composition stores): add_rms_norm_linear adds the residual and normalizes (one block also writes
// the sum s; an f32 residual is summed in f32 and rounded to T for the norm), glu_linear applies
// the gated activation to the packed gate/up row.  mamba_norm_in_proj is add_rms_norm_linear with
// an epilogue: the output column's bias and, for the columns of x (the first D), the column's
// convolution at the new position and the advance of its state (ops/nn/mamba_decode.h).  The rows are a
// few K elements read from L2, against the weight's N x K; to make them once for many columns the
// grid is one wave (the blocks that fit on the device at once) and a block walks its columns
// blockIdx.x, blockIdx.x + gridDim.x, ...
//
// Programmatic dependent launch (ops/cuda/pdl.cuh): the block's first pass of weight loads, and its
// threads' first norm weights, are issued before pdl_wait(); the rows (the previous kernels' outputs)
// are read, and s written, after it.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <mutex>
#include <tuple>
#include <type_traits>

#include "ops/cuda/common.cuh"
#include "ops/cuda/gemv.cuh"
#include "ops/cuda/launch.h"
#include "ops/cuda/pdl.cuh"
#include "ops/math.h"

namespace kcpp::ops::cuda {

// The blocks of `kernel` that fit on the device at once with `smem` bytes of dynamic shared memory
// (raising the kernel's limit above the default 48 KiB where needed); 0 when it does not fit.
// Cached a (kernel, device, threads, smem): a decode step asks for the same few every layer.
int resident_blocks(const void* kernel, int threads, size_t smem) {
  static std::mutex mu;
  static std::map<std::tuple<const void*, int, int, size_t>, int> known;
  int dev = 0;
  KCPP_CUDA_CHECK(cudaGetDevice(&dev));
  const std::lock_guard<std::mutex> lock(mu);
  const auto [it, fresh] = known.try_emplace({kernel, dev, threads, smem}, 0);
  if (!fresh) return it->second;
  int sms = 0, optin = 0;
  KCPP_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  KCPP_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  cudaFuncAttributes attr{};
  KCPP_CUDA_CHECK(cudaFuncGetAttributes(&attr, kernel));
  const size_t most = static_cast<size_t>(optin) - attr.sharedSizeBytes;  // the static part is the kernel's own
  if (smem > most) return 0;
  if (smem > 48 * 1024)  // the kernel's limit, raised once to all there is (smaller calls stay valid)
    KCPP_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(most)));
  int per_sm = 0;
  KCPP_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem));
  return it->second = per_sm * sms;
}

namespace {

using namespace gemv;
using kcpp::kernel::cuda::from_f32;
using kcpp::kernel::cuda::load_f32;
using kcpp::kernel::cuda::round_to;
using kcpp::kernel::cuda::store_f32;
using kcpp::kernel::cuda::to_f32;
using kcpp::kernel::cuda::warp_sum;

// AddNorm and Glu make the rows; MambaNorm makes them as AddNorm and ends each column with the Mamba
// epilogue (a template case of its own, so that the other kernels keep no epilogue registers).
enum class Prologue { AddNorm, Glu, MambaNorm };

template <typename T> struct FusedGemvParams {
  T* out;              // [M, N]; add_rms_norm_linear_glu: [M, N / 2]
  T* s;                // AddNorm: [M, K], x + delta, written by block 0; null without delta
  const T* x;          // AddNorm: x [M, K]; Glu: gu [M, 2K]
  const T* delta;      // AddNorm: [M, K] or null
  const T* norm_w;     // AddNorm: [K]
  const T* w;          // [N, K]
  int n, k;
  float eps, offset;   // AddNorm: the norm's options
  bool gemma;
  Unary act;           // Glu and add_rms_norm_linear_glu: Silu, Gelu or GeluTanh
  const float* xw;     // AddNorm with an f32 residual: x [M, K] (x above unused) and its sum sw [M, K]
  float* sw;
  // The Mamba epilogue (mamba_norm_in_proj): out's bias [N] or null; the convolution of columns
  // col < conv_d over conv_state [M, conv_d, conv_k] (the last conv_k inputs, oldest first; advanced
  // in place) with conv_w [conv_d, width] and conv_b [conv_d] or null, written to xc [M, conv_d].
  const T* bias;
  T* conv_state;
  const T* conv_w;
  const T* conv_b;
  T* xc;
  int conv_d, conv_k, width;
};

constexpr int kMaxConv = 4;  // the most convolution taps and state entries the epilogue takes

// The norm's weights a thread applies in make_rows (AddNorm, MambaNorm): its first kNormPre chunks of 8,
// loaded before pdl_wait() (weights are no kernel's output), so that the normalization after the
// rows' sums does not wait for memory (a norm's 2-8 KiB are long out of the L2 by the next step).
constexpr int kNormPre = 2;
struct NormPre {
  uint4 v[kNormPre];
};

template <typename T, Prologue P> __device__ __forceinline__ NormPre preload_norm(const FusedGemvParams<T>& p) {
  NormPre pre{};
  if constexpr (P != Prologue::Glu) {
#pragma unroll
    for (int j = 0; j < kNormPre; ++j) {
      const int e = static_cast<int>(threadIdx.x) * 8 + j * kThreads * 8;
      if (e < p.k) pre.v[j] = *reinterpret_cast<const uint4*>(p.norm_w + e);
    }
  }
  return pre;
}

// rows [M, K] in shared memory: the projection's input rows as the composition stores them (`pre`:
// preload_norm's weights).
template <typename T, int M, Prologue P>
__device__ __forceinline__ void make_rows(const FusedGemvParams<T>& p, T* rows, const NormPre& pre) {
  const int k = p.k;
  if constexpr (P == Prologue::Glu) {
    // The activation a constant in each loop (one branch a block, not unary()'s whole switch an element).
    auto glu = [&]<Unary A>() {
      for (int m = 0; m < M; ++m)
        for (int e = threadIdx.x * 8; e < k; e += kThreads * 8) {
          const T* r = p.x + static_cast<int64_t>(m) * 2 * k;  // [2K]: gate, then up
          float g[8], u[8], h[8];
          load_f32<T, 8>(r + e, g);
          load_f32<T, 8>(r + k + e, u);
#pragma unroll
          for (int i = 0; i < 8; ++i) h[i] = round_to<T>(math::unary<float>(A, g[i], 0.f)) * u[i];
          store_f32<T, 8>(rows + m * k + e, h);
        }
    };
    switch (p.act) {
      case Unary::Gelu: glu.template operator()<Unary::Gelu>(); break;
      case Unary::GeluTanh: glu.template operator()<Unary::GeluTanh>(); break;
      default: glu.template operator()<Unary::Silu>(); break;  // Silu (glu_linear sets no other op)
    }
  } else {
    __shared__ float red[kWarps][M];
    float ss[M] = {};
    for (int m = 0; m < M; ++m)
      for (int e = threadIdx.x * 8; e < k; e += kThreads * 8) {
        const int64_t at = static_cast<int64_t>(m) * k + e;
        float v[8];
        if (p.xw != nullptr) {  // an f32 residual: summed in f32, the norm reads the sum rounded to T
          const float4* xr = reinterpret_cast<const float4*>(p.xw + at);
          const float4 lo = xr[0], hi = xr[1];
          v[0] = lo.x, v[1] = lo.y, v[2] = lo.z, v[3] = lo.w, v[4] = hi.x, v[5] = hi.y, v[6] = hi.z, v[7] = hi.w;
          if (p.delta != nullptr) {
            float d[8];
            load_f32<T, 8>(p.delta + at, d);
#pragma unroll
            for (int i = 0; i < 8; ++i) v[i] += d[i];
            if (p.sw != nullptr && blockIdx.x == 0) {
              float4* sr = reinterpret_cast<float4*>(p.sw + at);
              sr[0] = make_float4(v[0], v[1], v[2], v[3]), sr[1] = make_float4(v[4], v[5], v[6], v[7]);
            }
          }
#pragma unroll
          for (int i = 0; i < 8; ++i) v[i] = kcpp::kernel::cuda::round_to<T>(v[i]);
        } else {
          load_f32<T, 8>(p.x + at, v);
        }
        if (p.xw == nullptr && p.delta != nullptr) {
          float d[8];
          load_f32<T, 8>(p.delta + at, d);
#pragma unroll
          for (int i = 0; i < 8; ++i) v[i] = round_to<T>(v[i] + d[i]);
          if (p.s != nullptr && blockIdx.x == 0) store_f32<T, 8>(p.s + at, v);
        }
        store_f32<T, 8>(rows + at, v);
#pragma unroll
        for (int i = 0; i < 8; ++i) ss[m] += v[i] * v[i];
      }
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
    for (int m = 0; m < M; ++m) {
      const float t = warp_sum(ss[m]);
      if (lane == 0) red[warp][m] = t;
    }
    __syncthreads();
    float rstd[M];
#pragma unroll
    for (int m = 0; m < M; ++m) {
      float t = 0.f;
#pragma unroll
      for (int j = 0; j < kWarps; ++j) t += red[j][m];
      rstd[m] = 1.f / sqrtf(t / static_cast<float>(k) + p.eps);
    }
    // Each thread normalizes the elements it stored above.
    int chunk = 0;
    for (int e = threadIdx.x * 8; e < k; e += kThreads * 8, ++chunk) {
      float wt[8];
      static_assert(kNormPre == 2);  // each preloaded chunk by its own branch (no indexed register array)
      if (chunk == 0) widen8<T>(pre.v[0], wt);
      else if (chunk == 1) widen8<T>(pre.v[1], wt);
      else load_f32<T, 8>(p.norm_w + e, wt);
#pragma unroll
      for (int i = 0; i < 8; ++i) wt[i] = norm_weight_value<T>(wt[i], p.offset, p.gemma);
#pragma unroll
      for (int m = 0; m < M; ++m) {
        float v[8];
        load_f32<T, 8>(rows + m * k + e, v);
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = norm_apply<T>(v[i], rstd[m], wt[i], p.gemma);
        store_f32<T, 8>(rows + m * k + e, v);
      }
    }
  }
  __syncthreads();
}

// A fused kernel's start: the first pass of the warp's first weight row and the thread's norm weights
// loaded (the weights are no kernel's output), the wait for the kernel before, then the input rows
// made in shared memory.
template <typename T, int M, int KS, Prologue P>
__device__ __forceinline__ void begin_block(const FusedGemvParams<T>& p, int64_t first_row, int slice, int lane, T* rows,
                                      uint4 (&wv)[kUnroll]) {
  load_pass<T, KS>(p.w + first_row * p.k, slice * kStep, p.k, lane, wv);
  const NormPre pre = preload_norm<T, P>(p);
  pdl_wait();
  pdl_trigger();
  make_rows<T, M, P>(p, rows, pre);
}

// Columns (kWarps / KS a group) blockIdx.x, blockIdx.x + gridDim.x, ... of out.
template <typename T, int M, int KS, Prologue P>
__global__ void __launch_bounds__(kThreads) fused_gemv_kernel(const __grid_constant__ FusedGemvParams<T> p) {
  extern __shared__ __align__(16) unsigned char smem[];
  T* rows = reinterpret_cast<T*>(smem);  // [M, K]
  __shared__ float part[kWarps][M];
  constexpr int cols = kWarps / KS;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, slice = warp % KS, n = p.n, k = p.k;
  const int groups = (n + cols - 1) / cols;
  uint4 wv[kUnroll];
  int col = blockIdx.x * cols + warp / KS;
  begin_block<T, M, KS, P>(p, min(col, n - 1), slice, lane, rows, wv);
  constexpr bool mamba = P == Prologue::MambaNorm;
  for (int g = blockIdx.x; g < groups; g += gridDim.x) {
    col = g * cols + warp / KS;
    const T* row = p.w + static_cast<int64_t>(min(col, n - 1)) * k;  // [K]
    // The Mamba epilogue's operands, loaded while the product runs: lane m < M of the column's
    // first warp takes row m's convolution.
    const bool conv = mamba && col < p.conv_d && warp % KS == 0 && lane < M;
    T* st = conv && p.conv_k > 0 ? p.conv_state + (static_cast<int64_t>(lane) * p.conv_d + col) * p.conv_k : nullptr;
    float taps[kMaxConv] = {}, state[kMaxConv] = {}, cbias = 0.f, obias = 0.f;
    if (mamba && warp % KS == 0 && lane < M && col < n && p.bias != nullptr) obias = to_f32(p.bias[col]);
    if (conv) {
#pragma unroll
      for (int j = 0; j < kMaxConv; ++j) {
        if (j < p.width) taps[j] = to_f32(p.conv_w[static_cast<int64_t>(col) * p.width + j]);
        if (j < p.conv_k) state[j] = to_f32(st[j]);
      }
      if (p.conv_b != nullptr) cbias = to_f32(p.conv_b[col]);
    }
    float acc[M] = {};
    for (int base = slice * kStep; base < k; base += kStep * KS * kUnroll) {
      if (g != static_cast<int>(blockIdx.x) || base != slice * kStep) load_pass<T, KS>(row, base, k, lane, wv);
      dot_pass<T, M, KS>(rows, k, base, k, lane, wv, acc);
    }
    if constexpr (!mamba) {
      finish_column<T, M, KS>(p.out, n, col, warp, lane, acc, part);
    } else {
      sum_column<M, KS>(warp, lane, acc, part);
      if (warp % KS == 0 && col < n && lane < M) {
        // out as linear() stores it: the product rounded, then the bias added and rounded.
        float v = round_to<T>(lane_sum<M>(acc, lane));
        if (p.bias != nullptr) v = round_to<T>(v + obias);
        p.out[static_cast<int64_t>(lane) * n + col] = from_f32<T>(v);
        if (conv) {
          // CausalConv1dUpdate/1 at the new position: the state's last width - 1 entries, then v.
          float c = cbias;
#pragma unroll
          for (int j = 0; j < kMaxConv; ++j)
            if (j < p.width - 1) {
              const int at = p.conv_k - (p.width - 1) + j;
              float sv = state[0];
#pragma unroll
              for (int i = 1; i < kMaxConv; ++i)
                if (at == i) sv = state[i];
              c += taps[j] * sv;
            }
#pragma unroll
          for (int j = 0; j < kMaxConv; ++j)
            if (j == p.width - 1) c += taps[j] * v;
          p.xc[static_cast<int64_t>(lane) * p.conv_d + col] = from_f32<T>(math::unary<float>(Unary::Silu, c, 0.f));
          // The state: its oldest entry out, v in (values as stored).
#pragma unroll
          for (int j = 0; j + 1 < kMaxConv; ++j)
            if (j + 1 < p.conv_k) st[j] = from_f32<T>(state[j + 1]);
          if (p.conv_k > 0) st[p.conv_k - 1] = from_f32<T>(v);
        }
      }
    }
    if constexpr (KS > 1) __syncthreads();  // part is read before the next group writes it
  }
}

// add_rms_norm_linear_glu: the AddNorm prologue, then output column c < I = n / 2 from weight rows c
// (gate) and I + c (up) of W [2I, K]: KS warps take the gate row's passes, then the up row's, and lane
// m < M of the column's first warp writes h[m, c] = r(r(act(r(gate))) * r(up)), the roundings of
// add_rms_norm_linear's gu followed by glu_packed.  The passes and sums are the AddNorm kernel's, row
// for row, so h has the bits of that composition.
template <typename T, int M, int KS>
__global__ void __launch_bounds__(kThreads) fused_gemv_glu_kernel(const __grid_constant__ FusedGemvParams<T> p) {
  extern __shared__ __align__(16) unsigned char smem[];
  T* rows = reinterpret_cast<T*>(smem);  // [M, K]
  __shared__ float part[kWarps][2 * M];
  constexpr int cols = kWarps / KS;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, slice = warp % KS, inter = p.n / 2, k = p.k;
  const int groups = (inter + cols - 1) / cols;
  uint4 wv[kUnroll];
  int col = blockIdx.x * cols + warp / KS;
  begin_block<T, M, KS, Prologue::AddNorm>(p, min(col, inter - 1), slice, lane, rows, wv);
  for (int g = blockIdx.x; g < groups; g += gridDim.x) {
    col = g * cols + warp / KS;
    const int c = min(col, inter - 1);
    float gate[M] = {}, up[M] = {};
    auto row_sums = [&](const T* row, float(&acc)[M], bool first) {
      for (int base = slice * kStep; base < k; base += kStep * KS * kUnroll) {
        if (!first || base != slice * kStep) load_pass<T, KS>(row, base, k, lane, wv);
        dot_pass<T, M, KS>(rows, k, base, k, lane, wv, acc);
      }
    };
    row_sums(p.w + static_cast<int64_t>(c) * k, gate, g == static_cast<int>(blockIdx.x));
    row_sums(p.w + (static_cast<int64_t>(inter) + c) * k, up, false);
    float acc[2 * M];
#pragma unroll
    for (int m = 0; m < M; ++m) acc[m] = gate[m], acc[M + m] = up[m];
    sum_column<2 * M, KS>(warp, lane, acc, part);
    if (warp % KS == 0 && col < inter && lane < M) {
#pragma unroll
      for (int m = 0; m < M; ++m) gate[m] = acc[m], up[m] = acc[M + m];
      const float gv = lane_sum<M>(gate, lane), uv = lane_sum<M>(up, lane);
      const float h = round_to<T>(math::gated<float>(p.act, round_to<T>(gv))) * round_to<T>(uv);
      p.out[static_cast<int64_t>(lane) * inter + col] = from_f32<T>(h);
    }
    if constexpr (KS > 1) __syncthreads();  // part is read before the next group writes it
  }
}

// False (nothing launched) when the rows do not fit in a block's shared memory.  GluOut: the
// add_rms_norm_linear_glu kernel (P AddNorm), out's N / 2 columns from the weight's N rows.
template <typename T, int M, int KS, Prologue P, bool GluOut>
bool launch(const char* op, const FusedGemvParams<T>& p) {
  const auto kernel = GluOut ? fused_gemv_glu_kernel<T, M, KS> : fused_gemv_kernel<T, M, KS, P>;
  const size_t smem = sizeof(T) * M * static_cast<size_t>(p.k);
  const int fit = resident_blocks(reinterpret_cast<const void*>(kernel), kThreads, smem);
  if (fit == 0) return false;
  const int columns = GluOut ? p.n / 2 : p.n;
  const int groups = (columns + kWarps / KS - 1) / (kWarps / KS);
  launch_pdl(op, kernel, dim3(std::min(groups, fit)), dim3(kThreads), smem, p);
  return true;
}

// KCPP_FUSED_ONE_PASS=0: every fused projection takes slices_for's slices (a measuring switch).
bool one_pass_off() {
  static const bool off = [] {
    const char* e = std::getenv("KCPP_FUSED_ONE_PASS");
    return e != nullptr && e[0] == '0';
  }();
  return off;
}

// KS from the weight's N rows (for GluOut too, so that its sums are add_rms_norm_linear's): where
// every row's warps fit at once (four blocks an SM: the kernels keep to 64 registers at one row) with
// a single pass of loads each, the fewest slices that do, so that each warp has loaded its whole
// slice before pdl_wait() (bench/RESULTS.md, 2026-11-28: Qwen3-0.6B's qkv); else slices_for's.
int fused_slices(int n, int k) {
  const int ks = one_pass_off() ? 0 : one_pass_slices(n, k, 4 * kWarps);
  return ks > 0 ? ks : slices_for(n, k);
}

template <typename T, Prologue P, bool GluOut = false> bool dispatch(const char* op, int64_t m, const FusedGemvParams<T>& p) {
  auto with_rows = [&]<int M>() {
    switch (fused_slices(p.n, p.k)) {
      case 1: return launch<T, M, 1, P, GluOut>(op, p);
      case 2: return launch<T, M, 2, P, GluOut>(op, p);
      case 4: return launch<T, M, 4, P, GluOut>(op, p);
      default: return launch<T, M, 8, P, GluOut>(op, p);
    }
  };
  static_assert(kFusedLinearMaxRows == 4);
  switch (m) {
    case 1: return with_rows.template operator()<1>();
    case 2: return with_rows.template operator()<2>();
    case 3: return with_rows.template operator()<3>();
    default: return with_rows.template operator()<4>();
  }
}

}  // namespace

namespace {

// add_rms_norm_linear's parameters (an f32 x with 16-bit weights: the f32 residual's fields).
template <typename T>
FusedGemvParams<T> norm_params(const Tensor& out, const Tensor& s, const Tensor& x, const Tensor& delta, const Tensor& norm_weight,
                               const RMSNormOptions& opt, const Tensor& weight) {
  FusedGemvParams<T> p{};
  p.out = static_cast<T*>(out.data());
  if (x.dtype() == DType::f32) {
    p.xw = static_cast<const float*>(x.data());
    p.sw = s.defined() ? static_cast<float*>(s.data()) : nullptr;
  } else {
    p.x = static_cast<const T*>(x.data());
    p.s = s.defined() ? static_cast<T*>(s.data()) : nullptr;
  }
  p.delta = delta.defined() ? static_cast<const T*>(delta.data()) : nullptr;
  p.norm_w = static_cast<const T*>(norm_weight.data());
  p.w = static_cast<const T*>(weight.data());
  p.n = static_cast<int>(weight.size(0)), p.k = static_cast<int>(x.size(1));
  p.eps = static_cast<float>(opt.eps), p.offset = static_cast<float>(opt.offset);
  p.gemma = opt.casting == RMSNormCasting::Gemma;
  return p;
}

}  // namespace

namespace {

// f(std::type_identity<T>{}) for a 16-bit dtype T of the weights, on `device`; f32 has no fused kernel
// (the callers compose it).  Returns what f returns: whether a kernel was launched.
template <typename F> bool with_16bit(const char* op, DType dtype, const Device& device, F&& f) {
  kcpp::cuda::DeviceGuard guard(device.index);
  bool done = false;
  visit_cuda_float(dtype, op, [&]<typename T>(std::type_identity<T> t) {
    if constexpr (std::is_same_v<T, float>) {
      KCPP_FAIL("op {}: f32 has no fused CUDA kernel (the caller composes it)", op);
    } else {
      done = f(t);
    }
  });
  return done;
}

Unary glu_op(GluActivation act) {
  return act == GluActivation::Silu ? Unary::Silu : act == GluActivation::Gelu ? Unary::Gelu : Unary::GeluTanh;
}

}  // namespace

bool add_rms_norm_linear(const Tensor& out, const Tensor& s, const Tensor& x, const Tensor& delta, const Tensor& norm_weight,
                         const RMSNormOptions& opt, const Tensor& weight) {
  constexpr const char* op = "add_rms_norm_linear";
  return with_16bit(op, weight.dtype(), x.device(), [&]<typename T>(std::type_identity<T>) {
    return dispatch<T, Prologue::AddNorm>(op, x.size(0), norm_params<T>(out, s, x, delta, norm_weight, opt, weight));
  });
}

bool add_rms_norm_linear_glu(const Tensor& out, const Tensor& s, const Tensor& x, const Tensor& delta,
                             const Tensor& norm_weight, const RMSNormOptions& opt, const Tensor& weight, GluActivation act) {
  constexpr const char* op = "add_rms_norm_linear_glu";
  return with_16bit(op, weight.dtype(), x.device(), [&]<typename T>(std::type_identity<T>) {
    FusedGemvParams<T> p = norm_params<T>(out, s, x, delta, norm_weight, opt, weight);
    p.act = glu_op(act);
    return dispatch<T, Prologue::AddNorm, true>(op, x.size(0), p);
  });
}

bool mamba_norm_in_proj(const Tensor& out, const Tensor& s, const Tensor& xc, const Tensor& x, const Tensor& delta,
                        const Tensor& norm_weight, const RMSNormOptions& opt, const Tensor& weight, const Tensor& bias,
                        const Tensor& conv_state, const Tensor& conv_w, const Tensor& conv_b) {
  constexpr const char* op = "mamba_norm_in_proj";
  return with_16bit(op, weight.dtype(), x.device(), [&]<typename T>(std::type_identity<T>) {
    FusedGemvParams<T> p = norm_params<T>(out, s, x, delta, norm_weight, opt, weight);
    p.bias = bias.defined() ? static_cast<const T*>(bias.data()) : nullptr;
    p.conv_state = static_cast<T*>(conv_state.data());
    p.conv_w = static_cast<const T*>(conv_w.data());
    p.conv_b = conv_b.defined() ? static_cast<const T*>(conv_b.data()) : nullptr;
    p.xc = static_cast<T*>(xc.data());
    p.conv_d = static_cast<int>(conv_state.size(1)), p.conv_k = static_cast<int>(conv_state.size(2));
    p.width = static_cast<int>(conv_w.size(1));
    return dispatch<T, Prologue::MambaNorm>(op, x.size(0), p);
  });
}

bool glu_linear(const Tensor& out, const Tensor& gu, GluActivation act, const Tensor& weight) {
  constexpr const char* op = "glu_linear";
  return with_16bit(op, gu.dtype(), gu.device(), [&]<typename T>(std::type_identity<T>) {
    FusedGemvParams<T> p{};
    p.out = static_cast<T*>(out.data());
    p.x = static_cast<const T*>(gu.data());
    p.w = static_cast<const T*>(weight.data());
    p.n = static_cast<int>(weight.size(0)), p.k = static_cast<int>(gu.size(1) / 2);
    p.act = glu_op(act);
    return dispatch<T, Prologue::Glu>(op, gu.size(0), p);
  });
}

}  // namespace kcpp::ops::cuda
