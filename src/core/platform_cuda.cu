// Which of this build's kernel images a GPU runs: the runtime picks the best compiled SASS (or
// JIT-compiles embedded PTX); cudaFuncGetAttributes on a trivial kernel reports its architecture.
#include <string>

#include "core/cuda_runtime.h"

namespace kcpp::detail {
namespace {
__global__ void probe_kernel() {}
}  // namespace

int probe_kernel_image(int device, std::string& note) {
  int prev = 0;
  cudaGetDevice(&prev);
  cudaSetDevice(device);
  cudaFuncAttributes attr{};
  const cudaError_t e = cudaFuncGetAttributes(&attr, probe_kernel);
  cudaSetDevice(prev);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    note = KCPP_FORMAT("no kernel image in this build runs here ({}); rebuild with this GPU's architecture in "
                       "CMAKE_CUDA_ARCHITECTURES",
                       cudaGetErrorString(e));
    return 0;
  }
  note = KCPP_FORMAT("runs this build's sm_{} code (PTX {})", attr.binaryVersion, attr.ptxVersion);
  return attr.binaryVersion;
}

}  // namespace kcpp::detail
