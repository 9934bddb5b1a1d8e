// Device-side element access: loads any stored dtype as float/double/int64 and stores back, with
// the same rounding as the host conversions in core/half.h (round to nearest even).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kcpp/kernel/cuda.cuh"

#include <cstdint>

#include "core/dtype.h"

namespace kcpp::cuda {

// The CUDA type that stores each host type.
template <typename T> struct device_type { using type = T; };
template <> struct device_type<bf16> { using type = __nv_bfloat16; };
template <> struct device_type<f16> { using type = __half; };
template <typename T> using device_t = typename device_type<T>::type;

// Conversions to and from f32: kcpp::kernel::cuda::to_f32 / from_f32 (include/kcpp/kernel/cuda.cuh),
// the same ones the kernel packages use.

// Runtime-dtype element access through a byte pointer (the dtype switch is uniform across a warp).
__device__ __forceinline__ double load_as_f64(const void* p, DType t, int64_t i) {
  switch (t) {
    case DType::f64: return static_cast<const double*>(p)[i];
    case DType::f32: return static_cast<const float*>(p)[i];
    case DType::bf16: return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
    case DType::f16: return __half2float(static_cast<const __half*>(p)[i]);
    case DType::i64: return static_cast<double>(static_cast<const int64_t*>(p)[i]);
    case DType::i32: return static_cast<const int32_t*>(p)[i];
    case DType::u8: return static_cast<const uint8_t*>(p)[i];
    case DType::boolean: return static_cast<const bool*>(p)[i] ? 1.0 : 0.0;
  }
  return 0;
}
__device__ __forceinline__ int64_t load_as_i64(const void* p, DType t, int64_t i) {
  switch (t) {
    case DType::i64: return static_cast<const int64_t*>(p)[i];
    case DType::i32: return static_cast<const int32_t*>(p)[i];
    case DType::u8: return static_cast<const uint8_t*>(p)[i];
    case DType::boolean: return static_cast<const bool*>(p)[i];
    default: return static_cast<int64_t>(load_as_f64(p, t, i));
  }
}
__device__ __forceinline__ void store_f64(void* p, DType t, int64_t i, double v) {
  switch (t) {
    case DType::f64: static_cast<double*>(p)[i] = v; break;
    case DType::f32: static_cast<float*>(p)[i] = static_cast<float>(v); break;
    // through f32 first, as the host does (core/half.h)
    case DType::bf16: static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(static_cast<float>(v)); break;
    case DType::f16: static_cast<__half*>(p)[i] = __float2half_rn(static_cast<float>(v)); break;
    case DType::i64: static_cast<int64_t*>(p)[i] = static_cast<int64_t>(v); break;
    case DType::i32: static_cast<int32_t*>(p)[i] = static_cast<int32_t>(v); break;
    case DType::u8: static_cast<uint8_t*>(p)[i] = static_cast<uint8_t>(v); break;
    case DType::boolean: static_cast<bool*>(p)[i] = v != 0.0; break;
  }
}
__device__ __forceinline__ void store_i64(void* p, DType t, int64_t i, int64_t v) {
  switch (t) {
    case DType::i64: static_cast<int64_t*>(p)[i] = v; break;
    case DType::i32: static_cast<int32_t*>(p)[i] = static_cast<int32_t>(v); break;
    case DType::u8: static_cast<uint8_t*>(p)[i] = static_cast<uint8_t>(v); break;
    case DType::boolean: static_cast<bool*>(p)[i] = v != 0; break;
    default: store_f64(p, t, i, static_cast<double>(v));
  }
}

// Grid size for a grid-stride loop over n elements with `block` threads.
inline unsigned grid_for(int64_t n, int block, int max_blocks = 65535 * 8) {
  const int64_t g = (n + block - 1) / block;
  return static_cast<unsigned>(g < 1 ? 1 : (g > max_blocks ? max_blocks : g));
}

}  // namespace kcpp::cuda
