// RMSNorm on the CPU (maths in rms_norm.h): one pass over each row in f32 with loops the compiler
// vectorizes, rows in parallel under OpenMP; dw summed per thread, then across threads in order.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "kcpp/kernel/cpu.h"
#include "kcpp/kernel/error.h"
#include "rms_norm.h"

namespace kcpp::liger {
namespace {

using kernel::cpu::load_row;
using kernel::cpu::store_row;

template <typename T> float round_to(float v) { return kernel::cpu::round_to<T>(v); }

// The casting mode is a template parameter: a switch inside the element loops kept GCC from
// vectorizing them for 16-bit types ("control flow in loop").
template <typename T, RMSNormCasting C> float normed(float x, float rstd) {
  if constexpr (C == RMSNormCasting::Llama) return round_to<T>(x * rstd);
  else if constexpr (C == RMSNormCasting::Gemma) return x * rstd;
  else return round_to<T>(x * round_to<T>(rstd));
}

template <typename T, RMSNormCasting C> KCPP_CPU_MULTIVERSION void forward(const RMSNormParams& p) {
  const int64_t h = p.hidden;
  std::vector<float> w(h);
  load_row(static_cast<const T*>(p.w), h, w.data());
  for (float& v : w) v += p.offset;
#pragma omp parallel
  {
    std::vector<float> x(h), y(h);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < p.rows; ++r) {
      load_row(static_cast<const T*>(p.x) + r * p.x_stride, h, x.data());
      if (p.residual) {  // AddRMSNorm: normalise r = round(x + residual), written to residual_out
        load_row(static_cast<const T*>(p.residual) + r * p.residual_stride, h, y.data());
        for (int64_t j = 0; j < h; ++j) x[j] = round_to<T>(x[j] + y[j]);
        store_row(x.data(), h, static_cast<T*>(p.residual_out) + r * p.residual_out_stride);
      }
      double ss = 0.0;  // f64 accumulation: exact enough for any width, free in a memory-bound loop
#pragma omp simd reduction(+ : ss)
      for (int64_t j = 0; j < h; ++j) ss += static_cast<double>(x[j]) * x[j];
      const float rstd = 1.0f / std::sqrt(static_cast<float>(ss / static_cast<double>(h)) + p.eps);
      p.rstd[r] = rstd;
      for (int64_t j = 0; j < h; ++j) y[j] = normed<T, C>(x[j], rstd) * w[j];
      store_row(y.data(), h, static_cast<T*>(p.y) + r * p.y_stride);
    }
  }
}

template <typename T, RMSNormCasting C> KCPP_CPU_MULTIVERSION void backward(const RMSNormParams& p) {
  const int64_t h = p.hidden;
  const float inv_h = 1.0f / static_cast<float>(h);
  std::vector<float> w(h);
  load_row(static_cast<const T*>(p.w), h, w.data());
  for (float& v : w) v += p.offset;
  const int threads = omp_get_max_threads();
  std::vector<float> dw_parts(static_cast<size_t>(threads) * h, 0.0f);
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> x(h), dy(h), g(h), out(h), dres(p.dresidual_out ? h : 0);
    float* dw = dw_parts.data() + static_cast<size_t>(omp_get_thread_num()) * h;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < p.rows; ++r) {
      load_row(static_cast<const T*>(p.x) + r * p.x_stride, h, x.data());
      load_row(static_cast<const T*>(p.dy) + r * p.dy_stride, h, dy.data());
      const float rstd = p.rstd[r];
      double acc = 0.0;
#pragma omp simd reduction(+ : acc)
      for (int64_t j = 0; j < h; ++j) {
        g[j] = dy[j] * w[j];
        acc += static_cast<double>(g[j]) * x[j];
      }
      const float dot = static_cast<float>(acc * rstd) * inv_h;
      for (int64_t j = 0; j < h; ++j) {
        out[j] = rstd * (g[j] - x[j] * rstd * dot);
        dw[j] += dy[j] * normed<T, C>(x[j], rstd);
      }
      if (p.dresidual_out) {
        load_row(static_cast<const T*>(p.dresidual_out) + r * p.dres_stride, h, dres.data());
        for (int64_t j = 0; j < h; ++j) out[j] += dres[j];
      }
      store_row(out.data(), h, static_cast<T*>(p.dx) + r * p.dx_stride);
    }
  }
  std::vector<float> dw(h, 0.0f);
  for (int t = 0; t < threads; ++t)
    for (int64_t j = 0; j < h; ++j) dw[j] += dw_parts[static_cast<size_t>(t) * h + j];
  store_row(dw.data(), h, static_cast<T*>(p.dw));
}

template <typename F> void visit(kernel::DType t, F&& f) {
  switch (t) {
    case kernel::DType::f32: f(static_cast<float*>(nullptr)); break;
    case kernel::DType::bf16: f(static_cast<kernel::cpu::bf16*>(nullptr)); break;
    case kernel::DType::f16: f(static_cast<kernel::cpu::f16*>(nullptr)); break;
  }
}

// f<T, C>(p) for p's dtype and casting mode (both checked).
template <template <typename, RMSNormCasting> class K> void dispatch(const RMSNormParams& p) {
  visit(p.dtype, [&]<typename T>(T*) {
    switch (p.casting) {
      case RMSNormCasting::Llama: K<T, RMSNormCasting::Llama>::run(p); break;
      case RMSNormCasting::Gemma: K<T, RMSNormCasting::Gemma>::run(p); break;
      case RMSNormCasting::None: K<T, RMSNormCasting::None>::run(p); break;
    }
  });
}
template <typename T, RMSNormCasting C> struct Forward {
  static void run(const RMSNormParams& p) { forward<T, C>(p); }
};
template <typename T, RMSNormCasting C> struct Backward {
  static void run(const RMSNormParams& p) { backward<T, C>(p); }
};

}  // namespace

const char* rms_norm_check(const RMSNormParams& p, bool backward) {
  const char* op = backward ? "rms_norm backward" : "rms_norm forward";
  KCPP_KERNEL_REQUIRE(p.dtype == kernel::DType::f32 || p.dtype == kernel::DType::bf16 || p.dtype == kernel::DType::f16,
                      "%s: unsupported dtype %d", op, static_cast<int>(p.dtype));
  KCPP_KERNEL_REQUIRE(p.rows >= 0 && p.hidden > 0, "%s: need rows >= 0 and hidden > 0, got rows %lld hidden %lld", op,
                      static_cast<long long>(p.rows), static_cast<long long>(p.hidden));
  KCPP_KERNEL_REQUIRE(std::isfinite(p.eps) && p.eps >= 0, "%s: eps must be finite and >= 0", op);
  KCPP_KERNEL_REQUIRE(static_cast<int32_t>(p.casting) >= 0 && static_cast<int32_t>(p.casting) <= 2,
                      "%s: unknown casting mode %d", op, static_cast<int>(p.casting));
  KCPP_KERNEL_REQUIRE(p.x && p.w && p.rstd, "%s: arguments 'x', 'weight' and 'rstd' must not be null", op);
  KCPP_KERNEL_REQUIRE(p.x_stride >= p.hidden || p.rows <= 1, "%s: argument 'x': row stride %lld < hidden %lld", op,
                      static_cast<long long>(p.x_stride), static_cast<long long>(p.hidden));
  if (!backward) {
    KCPP_KERNEL_REQUIRE(p.y != nullptr, "%s: argument 'y' is null", op);
    KCPP_KERNEL_REQUIRE(p.y_stride >= p.hidden || p.rows <= 1, "%s: argument 'y': row stride %lld < hidden %lld", op,
                        static_cast<long long>(p.y_stride), static_cast<long long>(p.hidden));
    if (p.residual) {
      KCPP_KERNEL_REQUIRE(p.residual_out != nullptr, "%s: 'residual' needs 'residual_out'", op);
      KCPP_KERNEL_REQUIRE((p.residual_stride >= p.hidden && p.residual_out_stride >= p.hidden) || p.rows <= 1,
                          "%s: row strides of 'residual' and 'residual_out' must be >= hidden", op);
      KCPP_KERNEL_REQUIRE(p.residual_out != p.x || p.residual_out_stride == p.x_stride,
                          "%s: 'residual_out' over 'x' must have the stride of 'x'", op);
      KCPP_KERNEL_REQUIRE(p.residual_out != p.residual || p.residual_out_stride == p.residual_stride,
                          "%s: 'residual_out' over 'residual' must have the stride of 'residual'", op);
      KCPP_KERNEL_REQUIRE(p.y != p.x && p.y != p.residual && p.y != p.residual_out,
                          "%s: with a residual, 'y' must not alias 'x', 'residual' or 'residual_out'", op);
    }
  } else {
    KCPP_KERNEL_REQUIRE(!p.dresidual_out || p.dres_stride >= p.hidden || p.rows <= 1,
                        "%s: row stride of 'dresidual_out' must be >= hidden", op);
    KCPP_KERNEL_REQUIRE(p.dy && p.dx && p.dw, "%s: arguments 'dy', 'dx' and 'dw' must not be null", op);
    KCPP_KERNEL_REQUIRE((p.dy_stride >= p.hidden && p.dx_stride >= p.hidden) || p.rows <= 1,
                        "%s: row strides of 'dy' (%lld) and 'dx' (%lld) must be >= hidden %lld", op,
                        static_cast<long long>(p.dy_stride), static_cast<long long>(p.dx_stride),
                        static_cast<long long>(p.hidden));
    KCPP_KERNEL_REQUIRE(p.dx != p.dy || p.dx_stride == p.dy_stride, "%s: in-place 'dx' must have the stride of 'dy'", op);
  }
  return nullptr;
}

const char* rms_norm_forward_cpu(const RMSNormParams& p) {
  if (const char* e = rms_norm_check(p, false)) return e;
  dispatch<Forward>(p);
  return nullptr;
}

const char* rms_norm_backward_cpu(const RMSNormParams& p) {
  if (const char* e = rms_norm_check(p, true)) return e;
  dispatch<Backward>(p);
  return nullptr;
}

}  // namespace kcpp::liger
