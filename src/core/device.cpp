#include "core/device.h"

#include <string>

#include "core/cuda_runtime.h"
#include "core/dtype.h"
#include "core/error.h"

namespace kcpp {

Device parse_device(std::string_view s) {
  if (s == "cpu") return Device::cpu();
  if (s == "cuda") return Device::cuda(0);
  if (s.starts_with("cuda:")) {
    const std::string idx(s.substr(5));
    KCPP_CHECK(!idx.empty() && idx.find_first_not_of("0123456789") == std::string::npos && idx.size() < 6,
               "device '{}': expected cuda:N", s);
    return Device::cuda(std::stoi(idx));
  }
  KCPP_FAIL("unknown device '{}' (expected cpu, cuda or cuda:N)", s);
}

DType parse_dtype(std::string_view n) {
  if (n == "f64" || n == "float64" || n == "double") return DType::f64;
  if (n == "f32" || n == "float32" || n == "float") return DType::f32;
  if (n == "bf16" || n == "bfloat16") return DType::bf16;
  if (n == "f16" || n == "float16" || n == "half") return DType::f16;
  if (n == "i64" || n == "int64") return DType::i64;
  if (n == "i32" || n == "int32") return DType::i32;
  if (n == "u8" || n == "uint8") return DType::u8;
  if (n == "bool") return DType::boolean;
  KCPP_FAIL("unknown dtype '{}' (expected f64, f32, bf16, f16, i64, i32, u8 or bool)", n);
}

bool cuda_compiled() { return KCPP_WITH_CUDA != 0; }

void use_device(Device d) {
  if (!d.is_cuda()) return;
  const int n = cuda_device_count();
  KCPP_CHECK(d.index >= 0 && d.index < n, "device {} does not exist ({} CUDA device(s) visible)", d.str(), n);
#if KCPP_WITH_CUDA
  KCPP_CUDA_CHECK(cudaSetDevice(d.index));
#endif
}

int cuda_device_count() {
#if KCPP_WITH_CUDA
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();  // no driver / no device: not an error for us, just zero devices
    return 0;
  }
  return n;
#else
  return 0;
#endif
}

#if KCPP_WITH_CUDA
namespace cuda {
namespace {
thread_local cudaStream_t g_stream = nullptr;
}
cudaStream_t current_stream() { return g_stream; }
void set_current_stream(cudaStream_t s) { g_stream = s; }

DeviceGuard::DeviceGuard(int device) {
  KCPP_CUDA_CHECK(cudaGetDevice(&prev_));
  if (prev_ != device) KCPP_CUDA_CHECK(cudaSetDevice(device));
}
DeviceGuard::~DeviceGuard() {
  int cur = -1;
  if (cudaGetDevice(&cur) == cudaSuccess && cur != prev_ && prev_ >= 0) (void)cudaSetDevice(prev_);
}
}  // namespace cuda
#endif

}  // namespace kcpp
