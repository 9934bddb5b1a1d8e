// LayerNorm on the CPU (maths in layer_norm.h): rows in parallel under OpenMP, each row widened to
// f32 once; sums as SIMD reductions in f64; dw / db summed per thread in f64, then across threads in order.
#include <omp.h>

#include <cmath>
#include <vector>

#include "kcpp/kernel/cpu.h"
#include "kcpp/kernel/error.h"
#include "layer_norm.h"

namespace kcpp::liger {
namespace {

using kernel::cpu::load_row;
using kernel::cpu::store_row;

template <typename T> KCPP_CPU_MULTIVERSION void forward(const LayerNormParams& p) {
  const int64_t h = p.hidden;
  std::vector<float> w(h), b(h, 0.0f);
  load_row(static_cast<const T*>(p.w), h, w.data());
  if (p.b) load_row(static_cast<const T*>(p.b), h, b.data());
#pragma omp parallel
  {
    std::vector<float> x(h);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < p.rows; ++r) {
      load_row(static_cast<const T*>(p.x) + r * p.x_stride, h, x.data());
      double s = 0.0;
#pragma omp simd reduction(+ : s)
      for (int64_t j = 0; j < h; ++j) s += x[j];
      const float mean = static_cast<float>(s / static_cast<double>(h));
      double v = 0.0;
#pragma omp simd reduction(+ : v)
      for (int64_t j = 0; j < h; ++j) v += static_cast<double>(x[j] - mean) * (x[j] - mean);
      const float rstd = 1.0f / std::sqrt(static_cast<float>(v / static_cast<double>(h)) + p.eps);
      p.mean[r] = mean;
      p.rstd[r] = rstd;
      for (int64_t j = 0; j < h; ++j) x[j] = (x[j] - mean) * rstd * w[j] + b[j];
      store_row(x.data(), h, static_cast<T*>(p.y) + r * p.y_stride);
    }
  }
}

template <typename T> KCPP_CPU_MULTIVERSION void backward(const LayerNormParams& p) {
  const int64_t h = p.hidden;
  const float inv_h = 1.0f / static_cast<float>(h);
  std::vector<float> w(h);
  load_row(static_cast<const T*>(p.w), h, w.data());
  const int threads = omp_get_max_threads();
  // Per thread: a dw row and a db row, in f64 (summing many rows in f32 loses digits the reference
  // keeps; the rows are not in the vector loop's critical path).
  std::vector<double> parts(static_cast<size_t>(threads) * 2 * h, 0.0);
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> x(h), dy(h), g(h);
    double* dw = parts.data() + static_cast<size_t>(omp_get_thread_num()) * 2 * h;
    double* db = dw + h;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < p.rows; ++r) {
      load_row(static_cast<const T*>(p.x) + r * p.x_stride, h, x.data());
      load_row(static_cast<const T*>(p.dy) + r * p.dy_stride, h, dy.data());
      const float mean = p.mean[r], rstd = p.rstd[r];
      double sg = 0.0, sgx = 0.0;
#pragma omp simd reduction(+ : sg, sgx)
      for (int64_t j = 0; j < h; ++j) {
        x[j] = (x[j] - mean) * rstd;  // xhat
        g[j] = dy[j] * w[j];
        sg += g[j];
        sgx += static_cast<double>(g[j]) * x[j];
      }
      const float mg = static_cast<float>(sg) * inv_h, mgx = static_cast<float>(sgx) * inv_h;
      for (int64_t j = 0; j < h; ++j) {
        dw[j] += static_cast<double>(dy[j]) * x[j];
        db[j] += dy[j];
        g[j] = rstd * (g[j] - mg - x[j] * mgx);
      }
      store_row(g.data(), h, static_cast<T*>(p.dx) + r * p.dx_stride);
    }
  }
  std::vector<float> dw(h), db(h);
  for (int64_t j = 0; j < h; ++j) {
    double sw = 0.0, sb = 0.0;
    for (int t = 0; t < threads; ++t) {
      sw += parts[static_cast<size_t>(t) * 2 * h + j];
      sb += parts[static_cast<size_t>(t) * 2 * h + h + j];
    }
    dw[j] = static_cast<float>(sw), db[j] = static_cast<float>(sb);
  }
  store_row(dw.data(), h, static_cast<T*>(p.dw));
  if (p.db) store_row(db.data(), h, static_cast<T*>(p.db));
}

template <typename F> void visit(kernel::DType t, F&& f) {
  switch (t) {
    case kernel::DType::f32: f(static_cast<float*>(nullptr)); break;
    case kernel::DType::bf16: f(static_cast<kernel::cpu::bf16*>(nullptr)); break;
    case kernel::DType::f16: f(static_cast<kernel::cpu::f16*>(nullptr)); break;
  }
}

}  // namespace

const char* layer_norm_check(const LayerNormParams& p, bool backward) {
  const char* op = backward ? "layer_norm backward" : "layer_norm forward";
  KCPP_KERNEL_REQUIRE(p.dtype == kernel::DType::f32 || p.dtype == kernel::DType::bf16 || p.dtype == kernel::DType::f16,
                      "%s: unsupported dtype %d", op, static_cast<int>(p.dtype));
  KCPP_KERNEL_REQUIRE(p.rows >= 0 && p.hidden > 0, "%s: need rows >= 0 and hidden > 0", op);
  KCPP_KERNEL_REQUIRE(std::isfinite(p.eps) && p.eps >= 0, "%s: eps must be finite and >= 0", op);
  KCPP_KERNEL_REQUIRE(p.x && p.w && p.mean && p.rstd, "%s: 'x', 'weight', 'mean' and 'rstd' must not be null", op);
  KCPP_KERNEL_REQUIRE(p.x_stride >= p.hidden || p.rows <= 1, "%s: 'x' row stride below hidden", op);
  if (!backward) {
    KCPP_KERNEL_REQUIRE(p.y != nullptr, "%s: argument 'y' is null", op);
    KCPP_KERNEL_REQUIRE(p.y_stride >= p.hidden || p.rows <= 1, "%s: 'y' row stride below hidden", op);
  } else {
    KCPP_KERNEL_REQUIRE(p.dy && p.dx && p.dw, "%s: 'dy', 'dx' and 'dweight' must not be null", op);
    KCPP_KERNEL_REQUIRE((p.dy_stride >= p.hidden && p.dx_stride >= p.hidden) || p.rows <= 1,
                        "%s: row strides of 'dy' and 'dx' must be >= hidden", op);
    KCPP_KERNEL_REQUIRE(p.dx != p.dy || p.dx_stride == p.dy_stride, "%s: in-place 'dx' must have the stride of 'dy'", op);
  }
  return nullptr;
}

const char* layer_norm_forward_cpu(const LayerNormParams& p) {
  if (const char* e = layer_norm_check(p, false)) return e;
  visit(p.dtype, [&]<typename T>(T*) { forward<T>(p); });
  return nullptr;
}

const char* layer_norm_backward_cpu(const LayerNormParams& p) {
  if (const char* e = layer_norm_check(p, true)) return e;
  visit(p.dtype, [&]<typename T>(T*) { backward<T>(p); });
  return nullptr;
}

}  // namespace kcpp::liger
