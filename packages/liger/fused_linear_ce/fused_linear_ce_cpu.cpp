// Fused linear cross-entropy on the CPU (maths and schedule in fused_linear_ce.h).  The GEMMs are
// OpenBLAS sgemm on f32: f32 inputs are used in place; 16-bit ones are widened a chunk of hidden rows
// and a block of 512 weight rows at a time (the weight is never widened whole).  Also the checks and
// the workspace size shared with the CUDA path.
#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#include "fused_linear_ce.h"
#include "kcpp/kernel/cpu.h"
#include "kcpp/kernel/error.h"

namespace kcpp::liger {
namespace {

using kernel::cpu::from_f32;
using kernel::cpu::to_f32;

constexpr int64_t kCudaChunkBytes = int64_t(256) << 20;  // logits chunk budget, input dtype
constexpr int64_t kCpuChunkBytes = int64_t(32) << 20;    // logits chunk budget, f32
constexpr int64_t kCpuWeightBlock = 512;                 // weight rows widened at a time
constexpr size_t kCublasWorkspace = size_t(32) << 20;    // cuBLAS's recommendation for Hopper
constexpr size_t kAlign = 256;

size_t align_up(size_t b) { return (b + kAlign - 1) / kAlign * kAlign; }

// The workspace sections, in order; a section of 0 bytes is absent.
struct Layout {
  // CUDA
  size_t count = 0, logits = 0, row_loss = 0, dbias = 0, dweight = 0, cublas = 0;
  // CPU (besides logits, row_loss, dbias, dweight)
  size_t hidden_f32 = 0, dhidden_f32 = 0, weight_f32 = 0, dweight_block = 0, bias_f32 = 0;

  Layout(const FusedLinearCEParams& p, bool cuda) {
    const int64_t c = fused_linear_ce_chunk_rows(p, cuda);
    const bool grads = fused_linear_ce_grads(p), narrow = p.dtype != kernel::DType::f32;
    const size_t h = static_cast<size_t>(p.h), v = static_cast<size_t>(p.v), n = static_cast<size_t>(p.n);
    const size_t rows = static_cast<size_t>(c);
    const bool f32_dw = grads && p.dweight && p.accum_f32 && narrow;
    if (cuda) {
      count = align_up(4 * sizeof(float));
      logits = align_up(rows * v * kernel::dtype_bytes(p.dtype));
      row_loss = p.reduction == CEReduction::None ? 0 : align_up(n * sizeof(float));
      dbias = grads && p.dbias ? align_up(v * sizeof(float)) : 0;
      dweight = f32_dw ? align_up(v * h * sizeof(float)) : 0;
      cublas = kCublasWorkspace;
    } else {
      logits = align_up(rows * v * sizeof(float));
      row_loss = align_up(n * sizeof(double));
      dbias = grads && p.dbias ? align_up(v * sizeof(double)) : 0;
      dweight = f32_dw ? align_up(v * h * sizeof(float)) : 0;
      const size_t block = std::min<size_t>(v, kCpuWeightBlock);
      hidden_f32 = narrow ? align_up(rows * h * sizeof(float)) : 0;
      dhidden_f32 = narrow && grads ? align_up(rows * h * sizeof(float)) : 0;
      weight_f32 = narrow ? align_up(block * h * sizeof(float)) : 0;
      dweight_block = narrow && grads && p.dweight && !p.accum_f32 ? align_up(block * h * sizeof(float)) : 0;
      bias_f32 = p.bias ? align_up(v * sizeof(float)) : 0;
    }
  }
  size_t total() const {
    return count + logits + row_loss + dbias + dweight + cublas + hidden_f32 + dhidden_f32 + weight_f32 + dweight_block +
           bias_f32;
  }
};

// Carves the CPU sections out of the workspace.
struct CpuSpace {
  float *logits, *hidden, *dhidden, *weight, *dweight_block, *bias, *dweight;
  double *row_loss, *dbias;
  CpuSpace(const Layout& l, void* base) {
    auto* b = static_cast<unsigned char*>(base);
    auto take = [&](size_t bytes) {
      void* q = bytes ? b : nullptr;
      b += bytes;
      return q;
    };
    logits = static_cast<float*>(take(l.logits));
    row_loss = static_cast<double*>(take(l.row_loss));
    dbias = static_cast<double*>(take(l.dbias));
    dweight = static_cast<float*>(take(l.dweight));
    hidden = static_cast<float*>(take(l.hidden_f32));
    dhidden = static_cast<float*>(take(l.dhidden_f32));
    weight = static_cast<float*>(take(l.weight_f32));
    dweight_block = static_cast<float*>(take(l.dweight_block));
    bias = static_cast<float*>(take(l.bias_f32));
  }
};

// rows x cols of src (row stride ld) widened into dst (dense); by the OpenMP team when `parallel`.
// Between two GEMMs it must not be: the team's threads spin-wait after the loop (libgomp's default
// wait policy) on the cores OpenBLAS's own threads need, which doubled the 16-bit time (bench/RESULTS.md).
template <typename T> void widen(const T* src, int64_t ld, int64_t rows, int64_t cols, float* dst, bool parallel = true) {
#pragma omp parallel for schedule(static) if (parallel)
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) dst[i * cols + j] = to_f32(src[i * ld + j]);
}

template <typename T> const char* run(const FusedLinearCEParams& p, const Layout& layout) {
  constexpr bool kF32 = std::is_same_v<T, float>;
  const int64_t n = p.n, h = p.h, v = p.v;
  const bool grads = fused_linear_ce_grads(p);
  const int64_t chunk = fused_linear_ce_chunk_rows(p, false);
  CpuSpace ws(layout, p.workspace);

  CrossEntropyParams ce = fused_linear_ce_loss_params(p);
  ce.dtype = kernel::DType::f32;  // the chunk's logits are f32 here, the bias widened below
  ce.bias = nullptr;
  double count = 0;
  if (const char* e = cross_entropy_count_cpu(ce, &count)) return e;
  const float scale = p.grad_scale * (p.reduction == CEReduction::Mean ? static_cast<float>(1.0 / count) : 1.0f);

  const T* hidden = static_cast<const T*>(p.hidden);
  const T* weight = static_cast<const T*>(p.weight);
  T* dhidden = static_cast<T*>(p.dhidden);
  T* dweight = static_cast<T*>(p.dweight);
  const int64_t ldx_in = std::max(p.hidden_stride, h), ldw_in = std::max(p.weight_stride, h);
  const int64_t lddx_in = std::max(p.dhidden_stride, h);
  if (p.bias) widen(static_cast<const T*>(p.bias), v, 1, v, ws.bias);
  if (grads && p.dbias)
    for (int64_t j = 0; j < v; ++j) ws.dbias[j] = p.accumulate ? to_f32(static_cast<const T*>(p.dbias)[j]) : 0.0;
  if (ws.dweight) {  // f32 accumulator of a 16-bit dweight
    if (p.accumulate) widen(dweight, h, v, h, ws.dweight);
    else std::memset(ws.dweight, 0, static_cast<size_t>(v * h) * sizeof(float));
  }
  if (grads && dweight && !p.accumulate && !ws.dweight) std::memset(dweight, 0, static_cast<size_t>(v * h) * sizeof(T));

  // The weight rows [r, r + rows) as f32: in place for f32, else widened into the block buffer.
  auto weight_block = [&](int64_t r, int64_t rows, int64_t& ld) -> const float* {
    if constexpr (kF32) {
      ld = ldw_in;
      return weight + r * ldw_in;
    } else {
      widen(weight + r * ldw_in, ldw_in, rows, h, ws.weight, false);
      ld = h;
      return ws.weight;
    }
  };
  const int64_t block = kF32 ? v : std::min<int64_t>(v, kCpuWeightBlock);

  for (int64_t r0 = 0; r0 < n; r0 += chunk) {
    const int64_t c = std::min(chunk, n - r0);
    const float* x;
    int64_t ldx;
    if constexpr (kF32) {
      x = hidden + r0 * ldx_in;
      ldx = ldx_in;
    } else {
      widen(hidden + r0 * ldx_in, ldx_in, c, h, ws.hidden);
      x = ws.hidden;
      ldx = h;
    }
    // Logits of the chunk: L[:, b] = X_c W_b^T, block by block.
    for (int64_t b0 = 0; b0 < v; b0 += block) {
      const int64_t rows = std::min(block, v - b0);
      int64_t ldw = 0;
      const float* w = weight_block(b0, rows, ldw);
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(c), static_cast<int>(rows), static_cast<int>(h),
                  1.0f, x, static_cast<int>(ldx), w, static_cast<int>(ldw), 0.0f, ws.logits + b0, static_cast<int>(v));
    }
    // Loss per row, the gradient in place over the logits.
    ce.n = c;
    ce.logits = ws.logits;
    ce.logits_stride = v;
    ce.bias = ws.bias;
    ce.targets = p.targets_i32 ? static_cast<const void*>(static_cast<const int32_t*>(p.targets) + r0)
                               : static_cast<const void*>(static_cast<const int64_t*>(p.targets) + r0);
    ce.grad = grads ? ws.logits : nullptr;
    ce.grad_stride = v;
    ce.lse = p.lse ? p.lse + r0 : nullptr;
    ce.token_weight = p.token_weight ? p.token_weight + r0 : nullptr;
    cross_entropy_rows_cpu(ce, ws.row_loss + r0, scale);
    if (!grads) continue;
    if (p.dbias) {
#pragma omp parallel for schedule(static)
      for (int64_t j0 = 0; j0 < v; j0 += 256)
        for (int64_t i = 0; i < c; ++i)
          for (int64_t j = j0; j < std::min(v, j0 + 256); ++j) ws.dbias[j] += ws.logits[i * v + j];
    }
    // dX_c = G_c W (summed over the blocks), dW_b += G_c[:, b]^T X_c.
    float* dx = kF32 ? reinterpret_cast<float*>(dhidden + r0 * lddx_in) : ws.dhidden;
    const int64_t lddx = kF32 ? lddx_in : h;
    const bool first = r0 == 0 && !p.accumulate;
    for (int64_t b0 = 0; b0 < v; b0 += block) {
      const int64_t rows = std::min(block, v - b0);
      int64_t ldw = 0;
      const float* w = weight_block(b0, rows, ldw);
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(c), static_cast<int>(h), static_cast<int>(rows),
                  1.0f, ws.logits + b0, static_cast<int>(v), w, static_cast<int>(ldw), b0 == 0 ? 0.0f : 1.0f, dx,
                  static_cast<int>(lddx));
      if (!dweight) continue;
      float* dw = kF32 ? reinterpret_cast<float*>(dweight + b0 * h) : ws.dweight ? ws.dweight + b0 * h : ws.dweight_block;
      const bool direct = kF32 || ws.dweight;  // accumulate in the GEMM; else round into dweight below
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, static_cast<int>(rows), static_cast<int>(h), static_cast<int>(c),
                  1.0f, ws.logits + b0, static_cast<int>(v), x, static_cast<int>(ldx), direct ? 1.0f : 0.0f, dw,
                  static_cast<int>(h));
      if (!direct) {  // one thread: between GEMMs (see widen)
        T* out = dweight + b0 * h;
        for (int64_t k = 0; k < rows * h; ++k) out[k] = from_f32<T>(first ? dw[k] : to_f32(out[k]) + dw[k]);
      }
    }
    if constexpr (!kF32) {
#pragma omp parallel for schedule(static)
      for (int64_t i = 0; i < c; ++i)
        for (int64_t j = 0; j < h; ++j) dhidden[(r0 + i) * lddx_in + j] = from_f32<T>(dx[i * h + j]);
    }
  }

  if (p.reduction == CEReduction::None) {
    for (int64_t i = 0; i < n; ++i) p.loss[i] = static_cast<float>(ws.row_loss[i]);
  } else {
    double total = 0.0;
    for (int64_t i = 0; i < n; ++i) total += ws.row_loss[i];  // fixed order
    p.loss[0] = static_cast<float>(p.reduction == CEReduction::Mean ? total / count : total);
  }
  if (!grads) return nullptr;
  if (p.dbias)
    for (int64_t j = 0; j < v; ++j) static_cast<T*>(p.dbias)[j] = from_f32<T>(static_cast<float>(ws.dbias[j]));
  if (ws.dweight) {
#pragma omp parallel for schedule(static)
    for (int64_t k = 0; k < v * h; ++k) dweight[k] = from_f32<T>(ws.dweight[k]);
  }
  return nullptr;
}

}  // namespace

const char* fused_linear_ce_check(const FusedLinearCEParams& p) {
  KCPP_KERNEL_REQUIRE(p.dtype == kernel::DType::f32 || p.dtype == kernel::DType::bf16 || p.dtype == kernel::DType::f16,
                      "fused_linear_ce: unsupported dtype %d", static_cast<int>(p.dtype));
  KCPP_KERNEL_REQUIRE(p.n >= 0 && p.h > 0 && p.v > 0, "fused_linear_ce: need n >= 0, h > 0 and v > 0, got n %lld h %lld v %lld",
                      static_cast<long long>(p.n), static_cast<long long>(p.h), static_cast<long long>(p.v));
  constexpr int64_t kIntMax = std::numeric_limits<int32_t>::max();
  KCPP_KERNEL_REQUIRE(p.h <= kIntMax && p.v <= kIntMax && p.hidden_stride <= kIntMax && p.weight_stride <= kIntMax &&
                          p.dhidden_stride <= kIntMax,
                      "fused_linear_ce: h, v and the row strides must fit the BLAS's 32-bit sizes");
  KCPP_KERNEL_REQUIRE(static_cast<int32_t>(p.reduction) >= 0 && static_cast<int32_t>(p.reduction) <= 2,
                      "fused_linear_ce: unknown reduction %d", static_cast<int>(p.reduction));
  KCPP_KERNEL_REQUIRE(p.label_smoothing >= 0.0f && p.label_smoothing <= 1.0f,
                      "fused_linear_ce: label_smoothing %g outside [0, 1]", static_cast<double>(p.label_smoothing));
  KCPP_KERNEL_REQUIRE(p.weight && p.loss && (p.n == 0 || (p.hidden && p.targets)),
                      "fused_linear_ce: 'hidden', 'weight', 'targets' and 'loss' must not be null");
  KCPP_KERNEL_REQUIRE(p.hidden_stride >= p.h || p.n <= 1, "fused_linear_ce: hidden row stride %lld < h %lld",
                      static_cast<long long>(p.hidden_stride), static_cast<long long>(p.h));
  KCPP_KERNEL_REQUIRE(p.weight_stride >= p.h || p.v <= 1, "fused_linear_ce: weight row stride %lld < h %lld",
                      static_cast<long long>(p.weight_stride), static_cast<long long>(p.h));
  const bool grads = fused_linear_ce_grads(p);
  KCPP_KERNEL_REQUIRE(!grads || p.dhidden || p.n == 0,
                      "fused_linear_ce: 'dweight' and 'dbias' need 'dhidden' (gradients are all or nothing)");
  KCPP_KERNEL_REQUIRE(!grads || p.reduction != CEReduction::None,
                      "fused_linear_ce: reduction 'none' gives no gradients (the gradient would need each row's upstream gradient)");
  KCPP_KERNEL_REQUIRE(!p.dhidden || p.dhidden_stride >= p.h || p.n <= 1, "fused_linear_ce: dhidden row stride %lld < h %lld",
                      static_cast<long long>(p.dhidden_stride), static_cast<long long>(p.h));
  KCPP_KERNEL_REQUIRE(!p.dbias || p.bias, "fused_linear_ce: 'dbias' without 'bias'");
  KCPP_KERNEL_REQUIRE(p.softcap >= 0.0f && std::isfinite(p.softcap), "fused_linear_ce: softcap %g must be >= 0 and finite",
                      static_cast<double>(p.softcap));
  KCPP_KERNEL_REQUIRE(std::isfinite(p.lse_square_scale), "fused_linear_ce: lse_square_scale %g is not finite",
                      static_cast<double>(p.lse_square_scale));
  KCPP_KERNEL_REQUIRE(p.chunk_rows >= 0, "fused_linear_ce: chunk_rows %lld < 0", static_cast<long long>(p.chunk_rows));
  KCPP_KERNEL_REQUIRE(p.dhidden != p.hidden || !p.dhidden, "fused_linear_ce: 'dhidden' may not be 'hidden'");
  return nullptr;
}

int64_t fused_linear_ce_chunk_rows(const FusedLinearCEParams& p, bool cuda) {
  const int64_t n = std::max<int64_t>(p.n, 1);
  if (p.chunk_rows > 0) return std::min(p.chunk_rows, n);
  const int64_t bytes_per_row = std::max<int64_t>(p.v, 1) * (cuda ? kernel::dtype_bytes(p.dtype) : 4);
  int64_t rows = std::max<int64_t>((cuda ? kCudaChunkBytes : kCpuChunkBytes) / bytes_per_row, 1);
  if (rows >= 128) rows = rows / 128 * 128;  // whole GEMM tiles
  return std::min(rows, n);
}

size_t fused_linear_ce_workspace(const FusedLinearCEParams& p, bool cuda) { return Layout(p, cuda).total(); }

const char* fused_linear_ce_cpu(const FusedLinearCEParams& p) {
  if (const char* e = fused_linear_ce_check(p)) return e;
  const Layout layout(p, false);
  KCPP_KERNEL_REQUIRE(p.workspace != nullptr, "fused_linear_ce: argument 'workspace' is null (see fused_linear_ce_workspace)");
  switch (p.dtype) {
    case kernel::DType::f32: return run<float>(p, layout);
    case kernel::DType::bf16: return run<kernel::cpu::bf16>(p, layout);
    case kernel::DType::f16: return run<kernel::cpu::f16>(p, layout);
  }
  return nullptr;
}

// The backward scales the three gradients: cross_entropy's scale kernel, once per gradient.
namespace {
template <typename Fn> const char* scale_all(const FusedLinearCEScaleParams& p, Fn&& scale) {
  KCPP_KERNEL_REQUIRE(p.dtype == kernel::DType::f32 || p.dtype == kernel::DType::bf16 || p.dtype == kernel::DType::f16,
                      "fused_linear_ce backward: unsupported dtype %d", static_cast<int>(p.dtype));
  KCPP_KERNEL_REQUIRE(p.n >= 0 && p.h > 0 && p.v > 0, "fused_linear_ce backward: need n >= 0, h > 0 and v > 0");
  KCPP_KERNEL_REQUIRE(p.dhidden || p.n == 0, "fused_linear_ce backward: 'dhidden' must not be null");
  CEScaleParams s;
  s.dtype = p.dtype;
  s.scale = p.scale;
  s.dloss = p.dloss;
  auto one = [&](void* g, int64_t rows, int64_t cols, int64_t stride) -> const char* {
    if (!g || rows == 0) return nullptr;
    s.n = rows;
    s.v = cols;
    s.grad = g;
    s.dlogits = g;
    s.grad_stride = s.dlogits_stride = stride;
    return scale(s);
  };
  if (const char* e = one(p.dhidden, p.n, p.h, std::max(p.dhidden_stride, p.h))) return e;
  if (const char* e = one(p.dweight, p.v, p.h, p.h)) return e;
  return one(p.dbias, 1, p.v, p.v);
}
}  // namespace

const char* fused_linear_ce_scale_cpu(const FusedLinearCEScaleParams& p) {
  return scale_all(p, [](const CEScaleParams& s) { return cross_entropy_scale_cpu(s); });
}

#if KCPP_WITH_CUDA
const char* fused_linear_ce_scale_cuda(const FusedLinearCEScaleParams& p, cudaStream_t stream) {
  return scale_all(p, [stream](const CEScaleParams& s) { return cross_entropy_scale_cuda(s, stream); });
}
#endif

}  // namespace kcpp::liger
