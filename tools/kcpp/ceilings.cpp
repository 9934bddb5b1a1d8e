#include "ceilings.h"

#include "core/allocator.h"
#include "core/cuda_runtime.h"
#include "core/random.h"
#include "core/tensor.h"
#include "core/timing.h"
#include "ops/ops.h"

namespace kcpp::tools {
namespace {

Ceiling copy_ceiling(Device device, size_t bytes) {
  const CopyCeiling c = measure_copy(device, bytes, device.is_cpu() ? 7 : 20);
  return {fmt::format("copy {}", format_bytes(bytes)), c.timing.median_ms, c.gbps, 0};
}

Ceiling gemm_ceiling(Device device, DType dtype, int64_t n) {
  Generator gen(1234);  // random data: zeros would run faster than real inputs
  const Tensor a = Tensor::randn({n, n}, dtype, device, gen);
  const Tensor b = Tensor::randn({n, n}, dtype, device, gen);
  Tensor c;
  const Timing t = time_op(device, [&] { c = ops::matmul(a, b); }, 2, device.is_cpu() ? 3 : 10);
  Ceiling r{fmt::format("gemm {} {}^3", dtype_name(dtype), n), t.median_ms, 0, 0};
  r.tflops = 2.0 * static_cast<double>(n) * n * n / (t.median_ms * 1e-3) / 1e12;
  return r;
}

}  // namespace

std::vector<Ceiling> measure_ceilings(Device device, bool quick) {
  std::vector<Ceiling> out;
  if (device.is_cuda()) {
    out.push_back(copy_ceiling(device, quick ? (size_t{256} << 20) : (size_t{2} << 30)));
    out.push_back(gemm_ceiling(device, DType::bf16, quick ? 2048 : 8192));
    out.push_back(gemm_ceiling(device, DType::f32, quick ? 2048 : 8192));
  } else {
    out.push_back(copy_ceiling(device, quick ? (size_t{64} << 20) : (size_t{512} << 20)));
    out.push_back(gemm_ceiling(device, DType::f32, quick ? 512 : 2048));
    out.push_back(gemm_ceiling(device, DType::bf16, quick ? 512 : 2048));
  }
  return out;
}

}  // namespace kcpp::tools
