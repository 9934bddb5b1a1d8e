// Plain types shared by kernel packages and hosts: a dtype tag and the error convention.
// Packages include only include/kcpp/ headers (docs/DESIGN.md); nothing here depends on src/.
//
// Error convention of every kernel entry point: it returns nullptr on success, or a message naming
// the op, the argument and what was wrong (a static string or thread-local buffer valid until the
// next call on that thread).  A kernel never throws across its entry point and never aborts.
#pragma once

#include <cstdint>

namespace kcpp::kernel {

enum class DType : int32_t { f32 = 0, bf16 = 1, f16 = 2 };

inline const char* dtype_name(DType t) {
  switch (t) {
    case DType::f32: return "f32";
    case DType::bf16: return "bf16";
    case DType::f16: return "f16";
  }
  return "?";
}

inline int dtype_bytes(DType t) { return t == DType::f32 ? 4 : 2; }

}  // namespace kcpp::kernel
