// Element copies with dtype conversion between two tensors of one shape on one device: the engine
// under Tensor::contiguous(), to(dtype), clone() and copy_().  Floating conversions round to
// nearest even (f64 -> bf16/f16 goes through f32, as PyTorch does); integer conversions wrap as
// C++ casts do; to bool is `!= 0`.
#pragma once

#include "core/tensor.h"

namespace kcpp::detail {

// dst and src have the same shape (src may carry stride-0 broadcast dims) and the same device.
void copy_same_device(const Tensor& dst, const Tensor& src);
void fill_same_device(const Tensor& dst, double value);

#if KCPP_WITH_CUDA
void copy_cuda(const Tensor& dst, const Tensor& src);
void fill_cuda(const Tensor& dst, double value);
#endif

}  // namespace kcpp::detail
