// Argument checks shared by the ops: each failure names the op, the argument and what was expected.
#pragma once

#include <string_view>
#include <vector>

#include "core/tensor.h"

namespace kcpp::ops {

void check_defined(const Tensor& t, std::string_view op, std::string_view arg);
// Floating dtype that the device supports (f64 only on the CPU).
void check_float(const Tensor& t, std::string_view op, std::string_view arg);
void check_index(const Tensor& t, std::string_view op, std::string_view arg);  // i32 or i64
// Every index of v (an index tensor's values, on the host) in [0, limit), or equal to `ignore` where
// allow_ignore: the first that is not is named with its position and value.
void check_range(const std::vector<int64_t>& v, int64_t limit, int64_t ignore, bool allow_ignore, std::string_view op,
                 std::string_view arg);
void check_dims(const Tensor& t, int64_t ndim, std::string_view op, std::string_view arg);
void check_same(const Tensor& t, const Tensor& ref, std::string_view op, std::string_view arg,
                std::string_view ref_arg);  // dtype and device
void check_device(const Tensor& t, const Tensor& ref, std::string_view op, std::string_view arg,
                  std::string_view ref_arg);
void check_shape(const Tensor& t, const Shape& expected, std::string_view op, std::string_view arg);
// The CUDA build of a device op; throws for CUDA tensors in a CPU-only build.
void check_cuda_available(const Tensor& t, std::string_view op);

}  // namespace kcpp::ops
