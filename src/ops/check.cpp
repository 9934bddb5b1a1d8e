#include "ops/check.h"

namespace kcpp::ops {

void check_defined(const Tensor& t, std::string_view op, std::string_view arg) {
  KCPP_CHECK(t.defined(), "op {}: argument '{}' is an undefined tensor", op, arg);
}

void check_float(const Tensor& t, std::string_view op, std::string_view arg) {
  check_defined(t, op, arg);
  KCPP_CHECK(is_floating(t.dtype()), "op {}: argument '{}': expected a floating dtype, got {}", op, arg,
             dtype_name(t.dtype()));
  KCPP_CHECK(!(t.dtype() == DType::f64 && t.device().is_cuda()),
             "op {}: argument '{}': f64 is supported on the CPU only, got f64 on {}", op, arg, t.device().str());
  check_cuda_available(t, op);
}

void check_index(const Tensor& t, std::string_view op, std::string_view arg) {
  check_defined(t, op, arg);
  KCPP_CHECK(t.dtype() == DType::i64 || t.dtype() == DType::i32, "op {}: argument '{}': expected i64 or i32, got {}",
             op, arg, dtype_name(t.dtype()));
  check_cuda_available(t, op);
}

void check_range(const std::vector<int64_t>& v, int64_t limit, int64_t ignore, bool allow_ignore, std::string_view op,
                 std::string_view arg) {
  for (size_t i = 0; i < v.size(); ++i) {
    if (allow_ignore && v[i] == ignore) continue;
    KCPP_CHECK(v[i] >= 0 && v[i] < limit, "op {}: argument '{}'[{}] = {} is out of range [0, {})", op, arg, i, v[i], limit);
  }
}

void check_dims(const Tensor& t, int64_t ndim, std::string_view op, std::string_view arg) {
  KCPP_CHECK(t.dim() == ndim, "op {}: argument '{}': expected {} dims, got shape {}", op, arg, ndim,
             shape_str(t.shape()));
}

void check_same(const Tensor& t, const Tensor& ref, std::string_view op, std::string_view arg,
                std::string_view ref_arg) {
  check_device(t, ref, op, arg, ref_arg);
  KCPP_CHECK(t.dtype() == ref.dtype(), "op {}: argument '{}' is {} but '{}' is {}", op, arg, dtype_name(t.dtype()),
             ref_arg, dtype_name(ref.dtype()));
}

void check_device(const Tensor& t, const Tensor& ref, std::string_view op, std::string_view arg,
                  std::string_view ref_arg) {
  check_defined(t, op, arg);
  KCPP_CHECK(t.device() == ref.device(), "op {}: argument '{}' is on {} but '{}' is on {}", op, arg,
             t.device().str(), ref_arg, ref.device().str());
}

void check_shape(const Tensor& t, const Shape& expected, std::string_view op, std::string_view arg) {
  KCPP_CHECK(t.shape() == expected, "op {}: argument '{}': expected shape {}, got {}", op, arg, shape_str(expected),
             shape_str(t.shape()));
}

void check_cuda_available(const Tensor& t, std::string_view op) {
  KCPP_CHECK(!t.device().is_cuda() || cuda_compiled(), "op {}: tensor on {} but this build has no CUDA support", op,
             t.device().str());
}

}  // namespace kcpp::ops
