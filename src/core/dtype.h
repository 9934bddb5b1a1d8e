// Element types.  The numbering is ours; DLPack codes are mapped in core/tensor.cpp.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "core/half.h"

namespace kcpp {

enum class DType : uint8_t { f64, f32, bf16, f16, i64, i32, u8, boolean };

inline constexpr DType kAllDTypes[] = {DType::f64, DType::f32, DType::bf16, DType::f16,
                                       DType::i64, DType::i32, DType::u8,   DType::boolean};

constexpr size_t dtype_size(DType t) {
  switch (t) {
    case DType::f64: case DType::i64: return 8;
    case DType::f32: case DType::i32: return 4;
    case DType::bf16: case DType::f16: return 2;
    case DType::u8: case DType::boolean: return 1;
  }
  return 0;
}

constexpr std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::f64: return "f64";
    case DType::f32: return "f32";
    case DType::bf16: return "bf16";
    case DType::f16: return "f16";
    case DType::i64: return "i64";
    case DType::i32: return "i32";
    case DType::u8: return "u8";
    case DType::boolean: return "bool";
  }
  return "?";
}

constexpr bool is_floating(DType t) {
  return t == DType::f64 || t == DType::f32 || t == DType::bf16 || t == DType::f16;
}
constexpr bool is_integral(DType t) { return !is_floating(t); }

// Parses "f32", "float32", "bf16", "bfloat16", ... ; throws kcpp::Error on an unknown name.
DType parse_dtype(std::string_view name);

// The C++ type stored for each DType, and back.
template <DType T> struct dtype_traits;
template <> struct dtype_traits<DType::f64> { using type = double; };
template <> struct dtype_traits<DType::f32> { using type = float; };
template <> struct dtype_traits<DType::bf16> { using type = bf16; };
template <> struct dtype_traits<DType::f16> { using type = f16; };
template <> struct dtype_traits<DType::i64> { using type = int64_t; };
template <> struct dtype_traits<DType::i32> { using type = int32_t; };
template <> struct dtype_traits<DType::u8> { using type = uint8_t; };
template <> struct dtype_traits<DType::boolean> { using type = bool; };

template <typename T> constexpr DType dtype_of();
template <> constexpr DType dtype_of<double>() { return DType::f64; }
template <> constexpr DType dtype_of<float>() { return DType::f32; }
template <> constexpr DType dtype_of<bf16>() { return DType::bf16; }
template <> constexpr DType dtype_of<f16>() { return DType::f16; }
template <> constexpr DType dtype_of<int64_t>() { return DType::i64; }
template <> constexpr DType dtype_of<int32_t>() { return DType::i32; }
template <> constexpr DType dtype_of<uint8_t>() { return DType::u8; }
template <> constexpr DType dtype_of<bool>() { return DType::boolean; }

// Conversions between any stored type and double/float, for host loops.
template <typename T> inline double to_f64(T v) { return static_cast<double>(v); }
template <> inline double to_f64(bf16 v) { return bf16_to_f32(v); }
template <> inline double to_f64(f16 v) { return f16_to_f32(v); }
template <typename T> inline float to_f32(T v) { return static_cast<float>(v); }
template <> inline float to_f32(bf16 v) { return bf16_to_f32(v); }
template <> inline float to_f32(f16 v) { return f16_to_f32(v); }
template <typename T> inline T from_f64(double v) { return static_cast<T>(v); }
template <> inline bf16 from_f64(double v) { return f32_to_bf16(static_cast<float>(v)); }
template <> inline f16 from_f64(double v) { return f32_to_f16(static_cast<float>(v)); }
template <typename T> inline T from_f32(float v) { return static_cast<T>(v); }
template <> inline bf16 from_f32(float v) { return f32_to_bf16(v); }
template <> inline f16 from_f32(float v) { return f32_to_f16(v); }

// Calls f(std::type_identity<T>{}) with T the stored type of `t` (one switch per axis).
template <typename F> decltype(auto) visit_dtype(DType t, F&& f) {
  switch (t) {
    case DType::f64: return f(std::type_identity<double>{});
    case DType::f32: return f(std::type_identity<float>{});
    case DType::bf16: return f(std::type_identity<bf16>{});
    case DType::f16: return f(std::type_identity<f16>{});
    case DType::i64: return f(std::type_identity<int64_t>{});
    case DType::i32: return f(std::type_identity<int32_t>{});
    case DType::u8: return f(std::type_identity<uint8_t>{});
    case DType::boolean: return f(std::type_identity<bool>{});
  }
  return f(std::type_identity<float>{});  // unreachable
}

// As visit_dtype, over the floating types only; other dtypes throw, naming `what`.
template <typename F> decltype(auto) visit_floating(DType t, std::string_view what, F&& f);

}  // namespace kcpp

#include "core/error.h"

namespace kcpp {
template <typename F> decltype(auto) visit_floating(DType t, std::string_view what, F&& f) {
  switch (t) {
    case DType::f64: return f(std::type_identity<double>{});
    case DType::f32: return f(std::type_identity<float>{});
    case DType::bf16: return f(std::type_identity<bf16>{});
    case DType::f16: return f(std::type_identity<f16>{});
    default: KCPP_FAIL("{}: expected a floating dtype (f64, f32, bf16, f16), got {}", what, dtype_name(t));
  }
}
}  // namespace kcpp
