// Reductions and the softmax family over the last dimension.
#include <cmath>
#include <limits>

#include "ops/check.h"
#include "ops/cuda/launch.h"
#include "ops/ops.h"

namespace kcpp::ops {
namespace {

template <typename T> using acc_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

// The loops over rows run as an OpenMP team only from this many elements on, as host_for_each does
// (core/strided.h): below it, starting and joining the team costs more than the loop, and far more
// when the cores are busy with other work.  Rows are independent, so the result is the same either way.
constexpr int64_t kParallelMin = 1 << 15;

// Sum of get(begin .. end-1): pairwise (cascade) summation, as PyTorch's CPU reductions do.  The
// error grows with log(n) rather than n, which matters when many equal small terms meet one large
// one (a running f32 sum of a constant addend rounds the same way every time).  Leaves of 64 terms
// are summed in 8 independent lanes, which vectorizes.
template <typename A, typename F> A pairwise_sum(int64_t begin, int64_t end, F&& get) {
  const int64_t n = end - begin;
  if (n > 64) {
    const int64_t mid = begin + (n / 2 + 7) / 8 * 8;
    return pairwise_sum<A>(begin, mid, get) + pairwise_sum<A>(mid, end, get);
  }
  A lanes[8] = {};
  int64_t i = begin;
  for (; i + 8 <= end; i += 8)
    for (int l = 0; l < 8; ++l) lanes[l] += get(i + l);
  for (; i < end; ++i) lanes[(i - begin) % 8] += get(i);
  return ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
}
template <typename A, typename F> A lane_sum(int64_t n, F&& get) { return pairwise_sum<A>(0, n, get); }

// Row view [rows, n] of a tensor reduced over its last dim.  rows is the product of the leading dims,
// also when n is 0: a sum over an empty last dim still has one result per row (0, and NaN for a mean).
struct Rows {
  Tensor t;  // contiguous
  int64_t rows, n;
};
Rows as_rows(const Tensor& x) {
  Tensor c = x.contiguous();
  if (x.dim() == 0) return {c, 1, 1};
  return {c, shape_numel(Shape(x.shape().begin(), x.shape().end() - 1)), x.size(-1)};
}

const char* softmax_name(Softmax k) { return k == Softmax::Softmax ? "softmax" : "log_softmax"; }

Tensor softmax_impl(Softmax kind, const Tensor& x) {
  const char* name = softmax_name(kind);
  check_float(x, name, "x");
  KCPP_CHECK(x.dim() >= 1, "op {}: argument 'x' must have at least 1 dim", name);
  Rows r = as_rows(x);
  Tensor out = Tensor::empty(x.shape(), x.dtype(), x.device());
  if (x.device().is_cuda()) {
#if KCPP_WITH_CUDA
    cuda::softmax(kind, out, r.t);
#endif
    return out;
  }
  visit_floating(x.dtype(), name, [&]<typename T>(std::type_identity<T>) {
    using A = acc_t<T>;
    const T* in = static_cast<const T*>(r.t.data());
    T* o = out.data_ptr<T>();
#pragma omp parallel for schedule(static) if (r.rows * r.n >= kParallelMin)
    for (int64_t row = 0; row < r.rows; ++row) {
      const T* xr = in + row * r.n;
      T* yr = o + row * r.n;
      A mx = -std::numeric_limits<A>::infinity();
      for (int64_t i = 0; i < r.n; ++i) mx = std::max<A>(mx, static_cast<A>(to_f64(xr[i])));
      if (std::isinf(mx) && mx < 0) mx = 0;  // an all -inf row: exp gives zeros, sum 0, result nan as in PyTorch
      const A s = lane_sum<A>(r.n, [&](int64_t i) { return std::exp(static_cast<A>(to_f64(xr[i])) - mx); });
      if (kind == Softmax::Softmax) {
        for (int64_t i = 0; i < r.n; ++i) yr[i] = from_f64<T>(std::exp(static_cast<A>(to_f64(xr[i])) - mx) / s);
      } else {
        const A lse = mx + std::log(s);
        for (int64_t i = 0; i < r.n; ++i) yr[i] = from_f64<T>(static_cast<A>(to_f64(xr[i])) - lse);
      }
    }
  });
  return out;
}

Tensor softmax_backward_impl(Softmax kind, const Tensor& dy, const Tensor& y) {
  const char* name = kind == Softmax::Softmax ? "softmax_backward" : "log_softmax_backward";
  check_float(y, name, "y");
  check_same(dy, y, name, "dy", "y");
  check_shape(dy, y.shape(), name, "dy");
  Rows ry = as_rows(y), rd = as_rows(dy);
  Tensor dx = Tensor::empty(y.shape(), y.dtype(), y.device());
  if (y.device().is_cuda()) {
#if KCPP_WITH_CUDA
    cuda::softmax_backward(kind, dx, rd.t, ry.t);
#endif
    return dx;
  }
  visit_floating(y.dtype(), name, [&]<typename T>(std::type_identity<T>) {
    using A = acc_t<T>;
    const T* py = static_cast<const T*>(ry.t.data());
    const T* pd = static_cast<const T*>(rd.t.data());
    T* o = dx.data_ptr<T>();
#pragma omp parallel for schedule(static) if (ry.rows * ry.n >= kParallelMin)
    for (int64_t row = 0; row < ry.rows; ++row) {
      const T* yr = py + row * ry.n;
      const T* dr = pd + row * ry.n;
      T* xr = o + row * ry.n;
      auto f = [](T v) { return static_cast<A>(to_f64(v)); };
      if (kind == Softmax::Softmax) {
        const A s = lane_sum<A>(ry.n, [&](int64_t i) { return f(dr[i]) * f(yr[i]); });
        for (int64_t i = 0; i < ry.n; ++i) xr[i] = from_f64<T>(f(yr[i]) * (f(dr[i]) - s));
      } else {
        const A s = lane_sum<A>(ry.n, [&](int64_t i) { return f(dr[i]); });
        for (int64_t i = 0; i < ry.n; ++i) xr[i] = from_f64<T>(f(dr[i]) - std::exp(f(yr[i])) * s);
      }
    }
  });
  return dx;
}

}  // namespace

Tensor argmax_checked(const Tensor& x) {
  check_float(x, "argmax_checked", "x");
  KCPP_CHECK(x.dim() == 2 && x.size(1) > 0, "op argmax_checked: argument 'x' must be [rows, n] with n > 0, got [{}]",
             fmt::join(x.shape(), ", "));
  const Rows r = as_rows(x);
  Tensor out = Tensor::empty({r.rows, 2}, DType::i64, x.device());
  if (r.rows == 0) return out;
  if (x.device().is_cuda()) {
#if KCPP_WITH_CUDA
    cuda::argmax_checked(out, r.t);
#endif
    return out;
  }
  int64_t* o = out.data_ptr<int64_t>();
  visit_floating(x.dtype(), "argmax_checked", [&]<typename T>(std::type_identity<T>) {
    const T* in = static_cast<const T*>(r.t.data());
#pragma omp parallel for schedule(static) if (r.rows * r.n >= kParallelMin)
    for (int64_t row = 0; row < r.rows; ++row) {
      const T* xr = in + row * r.n;
      int64_t best = -1, bad = -1;
      double best_v = 0;
      for (int64_t i = 0; i < r.n; ++i) {
        const double v = to_f64(xr[i]);
        if (!std::isfinite(v)) {
          if (bad < 0) bad = i;
        } else if (best < 0 || v > best_v) {
          best = i, best_v = v;
        }
      }
      o[2 * row] = best < 0 ? 0 : best;
      o[2 * row + 1] = bad;
    }
  });
  return out;
}

Tensor reduce_last(Reduce op, const Tensor& x, bool keepdim) {
  static const char* names[] = {"sum", "mean", "max"};
  const char* name = names[static_cast<int>(op)];
  check_float(x, name, "x");
  KCPP_CHECK(x.dim() >= 1, "op {}: argument 'x' must have at least 1 dim", name);
  KCPP_CHECK(!(op == Reduce::Max && x.size(-1) == 0), "op max: argument 'x' has an empty last dim");
  Shape shape = x.shape();
  if (keepdim) shape.back() = 1;
  else shape.pop_back();
  Rows r = as_rows(x);
  Tensor out = Tensor::empty(shape, x.dtype(), x.device());
  if (x.device().is_cuda()) {
#if KCPP_WITH_CUDA
    cuda::reduce_last(op, out, r.t);
#endif
    return out;
  }
  visit_floating(x.dtype(), name, [&]<typename T>(std::type_identity<T>) {
    using A = acc_t<T>;
    const T* in = static_cast<const T*>(r.t.data());
    T* o = out.data_ptr<T>();
#pragma omp parallel for schedule(static) if (r.rows * r.n >= kParallelMin)
    for (int64_t row = 0; row < r.rows; ++row) {
      const T* xr = in + row * r.n;
      A v;
      if (op == Reduce::Max) {
        v = static_cast<A>(to_f64(xr[0]));
        for (int64_t i = 1; i < r.n; ++i) {
          const A e = static_cast<A>(to_f64(xr[i]));
          v = (e > v || std::isnan(e)) ? e : v;  // NaN propagates, as in PyTorch
        }
      } else {
        v = lane_sum<A>(r.n, [&](int64_t i) { return static_cast<A>(to_f64(xr[i])); });
        if (op == Reduce::Mean) v /= static_cast<A>(r.n);
      }
      o[row] = from_f64<T>(v);
    }
  });
  return out;
}

Tensor sum_dim(const Tensor& x, int64_t dim, bool keepdim) {
  check_float(x, "sum_dim", "x");
  KCPP_CHECK(dim >= -x.dim() && dim < x.dim(), "op sum_dim: dim {} out of range for shape {}", dim, shape_str(x.shape()));
  if (dim < 0) dim += x.dim();
  std::vector<int64_t> perm;
  for (int64_t d = 0; d < x.dim(); ++d)
    if (d != dim) perm.push_back(d);
  perm.push_back(dim);
  Tensor out = reduce_last(Reduce::Sum, x.permute(perm), false);
  return keepdim ? out.unsqueeze(dim) : out;
}

Tensor sum_leading(const Tensor& x) {
  check_float(x, "sum_leading", "x");
  KCPP_CHECK(x.dim() >= 1, "op sum_leading: argument 'x' must have at least 1 dim");
  // rows is given, not -1: with h = 0 there would be no element count to infer it from.
  const int64_t h = x.size(-1), rows = shape_numel(Shape(x.shape().begin(), x.shape().end() - 1));
  return reduce_last(Reduce::Sum, x.reshape({rows, h}).transpose(0, 1), false);
}

Tensor softmax(const Tensor& x) { return softmax_impl(Softmax::Softmax, x); }
Tensor log_softmax(const Tensor& x) { return softmax_impl(Softmax::LogSoftmax, x); }
Tensor softmax_backward(const Tensor& dy, const Tensor& y) { return softmax_backward_impl(Softmax::Softmax, dy, y); }
Tensor log_softmax_backward(const Tensor& dy, const Tensor& y) {
  return softmax_backward_impl(Softmax::LogSoftmax, dy, y);
}

}  // namespace kcpp::ops
