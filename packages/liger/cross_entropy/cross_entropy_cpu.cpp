// Cross-entropy on the CPU (maths in cross_entropy.h): rows in parallel; per row one pass for the
// max, one for the exponentials (kept), one summing them (f64) with the logits, one writing the gradient.
// The stages (count, rows) are exported for the fused linear cross-entropy, which runs them per chunk.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "cross_entropy.h"
#include "kcpp/kernel/activation.h"
#include "kcpp/kernel/cpu.h"
#include "kcpp/kernel/error.h"

namespace kcpp::liger {
namespace {

using kernel::cpu::load_row;
using kernel::cpu::store_row;

int64_t target_of(const CrossEntropyParams& p, int64_t i) {
  return p.targets_i32 ? static_cast<const int32_t*>(p.targets)[i] : static_cast<const int64_t*>(p.targets)[i];
}

// Built for baseline x86-64 and for AVX2 (KCPP_CPU_MULTIVERSION), so the exp and sum loops run 8
// floats wide where the machine allows: 33 -> 23 ms at 256 x 32000 on the 2-core dev machine.
template <typename T>
KCPP_CPU_MULTIVERSION void rows(const CrossEntropyParams& p, double* row_loss, float scale) {
  const int64_t n = p.n, v = p.v;
  const float eps = p.label_smoothing, cap = p.softcap, beta = p.lse_square_scale;
  const float* cw = p.class_weight;
  double wsum_d = static_cast<double>(v);
  if (cw) {
    wsum_d = 0.0;
    for (int64_t j = 0; j < v; ++j) wsum_d += cw[j];
  }
  const T* bias = static_cast<const T*>(p.bias);
#pragma omp parallel
  {
    std::vector<float> x(static_cast<size_t>(v)), e(static_cast<size_t>(v)), b;
    if (bias) {
      b.resize(static_cast<size_t>(v));
      load_row(bias, v, b.data());
    }
#pragma omp for schedule(static)
    for (int64_t i = 0; i < n; ++i) {
      const int64_t t = target_of(p, i);
      T* g = p.grad ? static_cast<T*>(p.grad) + i * p.grad_stride : nullptr;
      if (t == p.ignore_index) {
        row_loss[i] = 0.0;
        if (p.lse) p.lse[i] = 0.0f;
        if (g) {
          std::fill(x.begin(), x.end(), 0.0f);
          store_row(x.data(), v, g);
        }
        continue;
      }
      load_row(static_cast<const T*>(p.logits) + i * p.logits_stride, v, x.data());
      if (bias)
#pragma omp simd
        for (int64_t j = 0; j < v; ++j) x[j] += b[j];
      if (cap > 0.0f)  // z = c tanh(x / c), kept in x
#pragma omp simd
        for (int64_t j = 0; j < v; ++j) x[j] = cap * kernel::tanh_f32(x[j] / cap);
      // The max may skip a NaN logit; its exponential below is NaN all the same, and so is the row.
      float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
      for (int64_t j = 0; j < v; ++j) m = std::max(m, x[j]);
      // e_j = exp(z_j - m) in (0, 1] (exp_f32: vectorized, within 1 ulp of expf), kept for the
      // gradient (p_j = e_j / s); the sums in f64 (10^5 terms keep their digits).
      for (int64_t j = 0; j < v; ++j) e[j] = kernel::exp_f32(x[j] - m);
      double s = 0.0, sx = 0.0;  // sx = sum_j w_j z_j (used with smoothing only)
      if (cw && eps > 0.0f) {
#pragma omp simd reduction(+ : s, sx)
        for (int64_t j = 0; j < v; ++j) {
          s += e[j];
          sx += static_cast<double>(cw[j]) * x[j];
        }
      } else {
#pragma omp simd reduction(+ : s, sx)
        for (int64_t j = 0; j < v; ++j) {
          s += e[j];
          sx += x[j];
        }
      }
      const double lse = m + std::log(s);
      const double wt = cw ? cw[t] : 1.0, tau = p.token_weight ? p.token_weight[i] : 1.0;
      if (p.lse) p.lse[i] = static_cast<float>(lse);
      // The smoothing term only with smoothing: sx is -inf when a logit is masked, and 0 x inf is NaN.
      const double ce = (1.0 - eps) * wt * (lse - x[t]) + (eps > 0.0f ? eps / static_cast<double>(v) * (wsum_d * lse - sx) : 0.0);
      row_loss[i] = tau * (ce + beta * lse * lse);
      if (g) {
        const float smooth = eps / static_cast<float>(v), hot = static_cast<float>((1.0 - eps) * wt);
        const float a = static_cast<float>((hot + smooth * wsum_d + 2.0 * beta * lse) / s);  // factor of e_j
        const float s_row = static_cast<float>(tau) * scale;
        if (cw && eps > 0.0f) {  // without smoothing the w_j term is 0
#pragma omp simd
          for (int64_t j = 0; j < v; ++j) e[j] = e[j] * a - smooth * cw[j];
        } else {
#pragma omp simd
          for (int64_t j = 0; j < v; ++j) e[j] = e[j] * a - smooth;
        }
        e[t] -= hot;
        if (cap > 0.0f) {
#pragma omp simd
          for (int64_t j = 0; j < v; ++j) e[j] *= 1.0f - (x[j] / cap) * (x[j] / cap);
        }
#pragma omp simd
        for (int64_t j = 0; j < v; ++j) e[j] *= s_row;
        store_row(e.data(), v, g);
      }
    }
  }
}

const char* run(const CrossEntropyParams& p) {
  double count = 0;
  if (const char* e = cross_entropy_count_cpu(p, &count)) return e;
  const float scale = p.grad_scale * (p.reduction == CEReduction::Mean ? static_cast<float>(1.0 / count) : 1.0f);
  std::vector<double> row_loss(static_cast<size_t>(p.n), 0.0);
  cross_entropy_rows_cpu(p, row_loss.data(), scale);
  if (p.reduction == CEReduction::None) {
    for (int64_t i = 0; i < p.n; ++i) p.loss[i] = static_cast<float>(row_loss[i]);
  } else {
    double total = 0.0;
    for (double l : row_loss) total += l;  // fixed order
    p.loss[0] = static_cast<float>(p.reduction == CEReduction::Mean ? total / static_cast<double>(count) : total);
  }
  return nullptr;
}

}  // namespace

const char* cross_entropy_check(const CrossEntropyParams& p) {
  KCPP_KERNEL_REQUIRE(p.dtype == kernel::DType::f32 || p.dtype == kernel::DType::bf16 || p.dtype == kernel::DType::f16,
                      "cross_entropy: unsupported dtype %d", static_cast<int>(p.dtype));
  KCPP_KERNEL_REQUIRE(p.n >= 0 && p.v > 0, "cross_entropy: need n >= 0 and v > 0, got n %lld v %lld",
                      static_cast<long long>(p.n), static_cast<long long>(p.v));
  KCPP_KERNEL_REQUIRE(static_cast<int32_t>(p.reduction) >= 0 && static_cast<int32_t>(p.reduction) <= 2,
                      "cross_entropy: unknown reduction %d", static_cast<int>(p.reduction));
  KCPP_KERNEL_REQUIRE(p.label_smoothing >= 0.0f && p.label_smoothing <= 1.0f,
                      "cross_entropy: label_smoothing %g outside [0, 1]", static_cast<double>(p.label_smoothing));
  KCPP_KERNEL_REQUIRE(p.softcap >= 0.0f && std::isfinite(p.softcap), "cross_entropy: softcap %g must be >= 0 and finite",
                      static_cast<double>(p.softcap));
  KCPP_KERNEL_REQUIRE(std::isfinite(p.lse_square_scale), "cross_entropy: lse_square_scale %g is not finite",
                      static_cast<double>(p.lse_square_scale));
  // An empty batch may come with null data (no bytes to point at); its loss is still written.
  KCPP_KERNEL_REQUIRE((p.n == 0 || (p.logits && p.targets)) && (p.loss || (p.n == 0 && p.reduction == CEReduction::None)),
                      "cross_entropy: 'logits', 'targets' and 'loss' must not be null");
  KCPP_KERNEL_REQUIRE(p.logits_stride >= p.v || p.n <= 1, "cross_entropy: logits row stride %lld < v %lld",
                      static_cast<long long>(p.logits_stride), static_cast<long long>(p.v));
  KCPP_KERNEL_REQUIRE(!p.grad || p.grad_stride >= p.v || p.n <= 1, "cross_entropy: grad row stride %lld < v %lld",
                      static_cast<long long>(p.grad_stride), static_cast<long long>(p.v));
  KCPP_KERNEL_REQUIRE(p.grad != p.logits || p.grad_stride == p.logits_stride,
                      "cross_entropy: in-place 'grad' must have the logits' row stride");
  return nullptr;
}

const char* cross_entropy_count_cpu(const CrossEntropyParams& p, double* divisor) {
  double c = 0;
  for (int64_t i = 0; i < p.n; ++i) {
    const int64_t t = target_of(p, i);
    if (t == p.ignore_index) continue;
    KCPP_KERNEL_REQUIRE(t >= 0 && t < p.v, "cross_entropy: argument 'targets'[%lld] = %lld is out of range [0, %lld)",
                        static_cast<long long>(i), static_cast<long long>(t), static_cast<long long>(p.v));
    c += p.class_weight ? p.class_weight[t] : 1.0;
  }
  *divisor = c;
  return nullptr;
}

void cross_entropy_rows_cpu(const CrossEntropyParams& p, double* row_loss, float scale) {
  switch (p.dtype) {
    case kernel::DType::f32: return rows<float>(p, row_loss, scale);
    case kernel::DType::bf16: return rows<kernel::cpu::bf16>(p, row_loss, scale);
    case kernel::DType::f16: return rows<kernel::cpu::f16>(p, row_loss, scale);
  }
}

const char* cross_entropy_cpu(const CrossEntropyParams& p) {
  if (const char* e = cross_entropy_check(p)) return e;
  return run(p);
}

const char* cross_entropy_scale_check(const CEScaleParams& p) {
  KCPP_KERNEL_REQUIRE(p.dtype == kernel::DType::f32 || p.dtype == kernel::DType::bf16 || p.dtype == kernel::DType::f16,
                      "cross_entropy backward: unsupported dtype %d", static_cast<int>(p.dtype));
  KCPP_KERNEL_REQUIRE(p.n >= 0 && p.v > 0, "cross_entropy backward: need n >= 0 and v > 0");
  if (p.n == 0) return nullptr;
  KCPP_KERNEL_REQUIRE(p.grad && p.dlogits, "cross_entropy backward: 'grad' and 'dlogits' must not be null");
  KCPP_KERNEL_REQUIRE((p.grad_stride >= p.v && p.dlogits_stride >= p.v) || p.n <= 1,
                      "cross_entropy backward: row stride below v");
  KCPP_KERNEL_REQUIRE(p.grad != p.dlogits || p.grad_stride == p.dlogits_stride,
                      "cross_entropy backward: in-place 'dlogits' must have the stride of 'grad'");
  return nullptr;
}

const char* cross_entropy_scale_cpu(const CEScaleParams& p) {
  if (const char* e = cross_entropy_scale_check(p)) return e;
  auto go = [&]<typename T>(T*) {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < p.n; ++i) {
      const float s = p.dloss ? p.dloss[p.per_row ? i : 0] : p.scale;
      const T* g = static_cast<const T*>(p.grad) + i * p.grad_stride;
      T* d = static_cast<T*>(p.dlogits) + i * p.dlogits_stride;
      for (int64_t j = 0; j < p.v; ++j) d[j] = kernel::cpu::from_f32<T>(kernel::cpu::to_f32(g[j]) * s);
    }
  };
  switch (p.dtype) {
    case kernel::DType::f32: go(static_cast<float*>(nullptr)); break;
    case kernel::DType::bf16: go(static_cast<kernel::cpu::bf16*>(nullptr)); break;
    case kernel::DType::f16: go(static_cast<kernel::cpu::f16*>(nullptr)); break;
  }
  return nullptr;
}

}  // namespace kcpp::liger
