#include "core/copy.h"

#include <cstring>

#include "core/strided.h"

namespace kcpp::detail {
namespace {

template <typename D, typename S> inline D convert(S v) {
  if constexpr (std::is_same_v<D, S>) {
    return v;
  } else if constexpr (std::is_same_v<D, bool>) {
    return to_f64(v) != 0.0;
  } else if constexpr (std::is_integral_v<D> && std::is_integral_v<S>) {
    return static_cast<D>(v);
  } else if constexpr (std::is_same_v<D, double> || std::is_same_v<S, double> || std::is_same_v<S, int64_t>) {
    return from_f64<D>(to_f64(v));
  } else {
    return from_f32<D>(to_f32(v));
  }
}

void copy_cpu(const Tensor& dst, const Tensor& src) {
  if (dst.dtype() == src.dtype() && dst.is_contiguous() && src.is_contiguous()) {
    std::memcpy(dst.data(), src.data(), dst.nbytes());
    return;
  }
  const auto L = make_layout<2>(dst.shape(), {&dst.strides(), &src.strides()});
  visit_dtype(dst.dtype(), [&]<typename D>(std::type_identity<D>) {
    visit_dtype(src.dtype(), [&]<typename S>(std::type_identity<S>) {
      D* d = static_cast<D*>(dst.data());
      const S* s = static_cast<const S*>(src.data());
      host_for_each(L, dst.numel(), [&](const int64_t* off) { d[off[0]] = convert<D>(s[off[1]]); });
    });
  });
}

}  // namespace

void copy_same_device(const Tensor& dst, const Tensor& src) {
  KCPP_CHECK(dst.shape() == src.shape(), "copy: shapes differ: {} vs {}", shape_str(dst.shape()),
             shape_str(src.shape()));
  KCPP_CHECK(dst.device() == src.device(), "copy: devices differ: {} vs {}", dst.device().str(), src.device().str());
  if (dst.numel() == 0) return;
  if (dst.device().is_cpu()) return copy_cpu(dst, src);
#if KCPP_WITH_CUDA
  copy_cuda(dst, src);
#endif
}

void fill_same_device(const Tensor& dst, double value) {
  if (dst.numel() == 0) return;
  if (dst.device().is_cuda()) {
#if KCPP_WITH_CUDA
    fill_cuda(dst, value);
#endif
    return;
  }
  const auto L = make_layout<1>(dst.shape(), {&dst.strides()});
  visit_dtype(dst.dtype(), [&]<typename D>(std::type_identity<D>) {
    const D v = convert<D>(value);
    D* d = static_cast<D*>(dst.data());
    host_for_each(L, dst.numel(), [&](const int64_t* off) { d[off[0]] = v; });
  });
}

}  // namespace kcpp::detail
