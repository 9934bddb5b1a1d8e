// Embedding, gather / scatter along the last dim, and the ignore-index mask.  Every index is
#include <cstring>
// checked; an out-of-range one throws naming the op, the position and the value.
#include "core/profile.h"
#include "ops/check.h"
#include "ops/cuda/launch.h"
#include "ops/ops.h"

namespace kcpp::ops {
namespace {

// The host loops run as an OpenMP team only from this many elements on (see reduce.cpp): below it the
// team costs more than the copy.
constexpr int64_t kParallelMin = 1 << 15;

// Host copy of the ids as i64, row-major.
std::vector<int64_t> host_ids(const Tensor& ids) { return ids.to_i64_vector(); }

}  // namespace

Tensor embedding(const Tensor& weight, const Tensor& ids, [[maybe_unused]] bool check_ids) {  // (the CUDA path's)
  check_float(weight, "embedding", "weight");
  check_index(ids, "embedding", "ids");
  check_device(ids, weight, "embedding", "ids", "weight");
  check_dims(weight, 2, "embedding", "weight");
  const int64_t v = weight.size(0), h = weight.size(1);
  const profile::Region region("embedding", weight.device(), 0,
                               profile::enabled() ? 2.0 * ids.numel() * h * dtype_size(weight.dtype()) : 0.0);
  Shape shape = ids.shape();
  shape.push_back(h);
  Tensor out = Tensor::empty(shape, weight.dtype(), weight.device());
  if (out.numel() == 0 && ids.numel() == 0) return out;
  if (weight.device().is_cuda()) {
#if KCPP_WITH_CUDA
    cuda::embedding(out, weight.contiguous(), ids.contiguous(), check_ids);
#endif
    return out;
  }
  const auto idv = host_ids(ids);
  check_range(idv, v, 0, false, "embedding", "ids");
  const Tensor w = weight.contiguous();
  const int64_t es = static_cast<int64_t>(w.element_size());
  const char* src = static_cast<const char*>(w.data());
  char* dst = static_cast<char*>(out.data());
#pragma omp parallel for schedule(static) if (out.numel() >= kParallelMin)
  for (int64_t i = 0; i < static_cast<int64_t>(idv.size()); ++i)
    std::memcpy(dst + i * h * es, src + idv[i] * h * es, static_cast<size_t>(h * es));
  return out;
}

Tensor embedding_backward(const Tensor& grad, const Tensor& ids, int64_t num_embeddings,
                          [[maybe_unused]] bool check_ids) {  // (the CUDA path's)
  // Floor: read the gradient, write the [V, H] result once.
  const profile::Region region("embedding_backward", grad.device(), 0,
                               profile::enabled() && grad.dim() > 0
                                   ? static_cast<double>(grad.numel() + num_embeddings * grad.size(-1)) * dtype_size(grad.dtype())
                                   : 0.0);
  check_float(grad, "embedding_backward", "grad");
  check_index(ids, "embedding_backward", "ids");
  check_device(ids, grad, "embedding_backward", "ids", "grad");
  KCPP_CHECK(grad.dim() == ids.dim() + 1 && Shape(grad.shape().begin(), grad.shape().end() - 1) == ids.shape(),
             "op embedding_backward: argument 'grad' {} does not match ids {} + [hidden]", shape_str(grad.shape()),
             shape_str(ids.shape()));
  KCPP_CHECK(num_embeddings >= 0, "op embedding_backward: num_embeddings {} < 0", num_embeddings);
  const int64_t h = grad.size(-1);
  if (grad.device().is_cuda()) {
#if KCPP_WITH_CUDA
    // In grad's dtype: each row is summed in f32 and rounded once (cuda/index.cu).
    Tensor out = Tensor::zeros({num_embeddings, h}, grad.dtype(), grad.device());
    cuda::embedding_backward(out, grad.contiguous(), ids.contiguous(), check_ids);
    return out;
#endif
  }
  const DType acc_type = grad.dtype() == DType::f64 ? DType::f64 : DType::f32;
  Tensor acc = Tensor::zeros({num_embeddings, h}, acc_type, grad.device());
  const Tensor g = grad.contiguous().to(acc_type);
  const auto idv = host_ids(ids);
  check_range(idv, num_embeddings, 0, false, "embedding_backward", "ids");
  visit_floating(acc_type, "embedding_backward", [&]<typename A>(std::type_identity<A>) {
    if constexpr (std::is_floating_point_v<A>) {  // the accumulator is f32 or f64
    A* pa = acc.data_ptr<A>();
    const A* pg = static_cast<const A*>(g.data());
    // Parallel over the hidden dim keeps the accumulation order fixed (deterministic).
#pragma omp parallel for schedule(static) if (grad.numel() >= kParallelMin)
    for (int64_t c = 0; c < h; ++c)
      for (size_t i = 0; i < idv.size(); ++i) pa[idv[i] * h + c] += pg[static_cast<int64_t>(i) * h + c];
    }
  });
  return acc.to(grad.dtype());
}

Tensor gather_last(const Tensor& x, const Tensor& idx, int64_t ignore_index) {
  check_float(x, "gather_last", "x");
  check_index(idx, "gather_last", "idx");
  check_device(idx, x, "gather_last", "idx", "x");
  check_dims(x, 2, "gather_last", "x");
  check_shape(idx, {x.size(0)}, "gather_last", "idx");
  Tensor out = Tensor::empty({x.size(0)}, x.dtype(), x.device());
  if (x.device().is_cuda()) {
#if KCPP_WITH_CUDA
    cuda::gather_last(out, x.contiguous(), idx.contiguous(), ignore_index);
#endif
    return out;
  }
  const auto iv = host_ids(idx);
  check_range(iv, x.size(1), ignore_index, true, "gather_last", "idx");
  const Tensor xc = x.contiguous();
  const int64_t v = x.size(1);
  visit_floating(x.dtype(), "gather_last", [&]<typename T>(std::type_identity<T>) {
    const T* px = static_cast<const T*>(xc.data());
    T* po = out.data_ptr<T>();
    for (size_t i = 0; i < iv.size(); ++i)
      po[i] = iv[i] == ignore_index ? from_f64<T>(0.0) : px[static_cast<int64_t>(i) * v + iv[i]];
  });
  return out;
}

Tensor scatter_last(const Tensor& values, const Tensor& idx, int64_t num_classes, int64_t ignore_index) {
  check_float(values, "scatter_last", "values");
  check_index(idx, "scatter_last", "idx");
  check_device(idx, values, "scatter_last", "idx", "values");
  check_dims(values, 1, "scatter_last", "values");
  check_shape(idx, values.shape(), "scatter_last", "idx");
  KCPP_CHECK(num_classes >= 0, "op scatter_last: num_classes {} < 0", num_classes);
  Tensor out = Tensor::zeros({values.size(0), num_classes}, values.dtype(), values.device());
  if (values.device().is_cuda()) {
#if KCPP_WITH_CUDA
    cuda::scatter_last(out, values.contiguous(), idx.contiguous(), ignore_index);
#endif
    return out;
  }
  const auto iv = host_ids(idx);
  check_range(iv, num_classes, ignore_index, true, "scatter_last", "idx");
  const Tensor vc = values.contiguous();
  visit_floating(values.dtype(), "scatter_last", [&]<typename T>(std::type_identity<T>) {
    const T* pv = static_cast<const T*>(vc.data());
    T* po = out.data_ptr<T>();
    for (size_t i = 0; i < iv.size(); ++i)
      if (iv[i] != ignore_index) po[static_cast<int64_t>(i) * num_classes + iv[i]] = pv[i];
  });
  return out;
}

Tensor valid_mask(const Tensor& idx, int64_t ignore_index, DType dtype) {
  check_index(idx, "valid_mask", "idx");
  Tensor out = Tensor::empty(idx.shape(), dtype, idx.device());
  if (idx.device().is_cuda()) {
#if KCPP_WITH_CUDA
    cuda::valid_mask(out, idx.contiguous(), ignore_index);
#endif
    return out;
  }
  const auto iv = host_ids(idx);
  std::vector<double> m(iv.size());
  for (size_t i = 0; i < iv.size(); ++i) m[i] = iv[i] != ignore_index ? 1.0 : 0.0;
  out.copy_(Tensor::from_f64(m, idx.shape(), dtype));
  return out;
}

}  // namespace kcpp::ops
