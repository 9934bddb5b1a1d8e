// Placeholder until the CUDA kernels land.
#include "selective_scan/selective_scan.h"
namespace kcpp::mamba {
const char* selective_scan_cuda_unsupported(const SelectiveScanParams&) { return "selective_scan: no CUDA kernel yet"; }
size_t selective_scan_backward_workspace(const SelectiveScanParams&) { return 0; }
const char* selective_scan_forward_cuda(const SelectiveScanParams&, cudaStream_t) { return "selective_scan: no CUDA kernel yet"; }
const char* selective_scan_backward_cuda(const SelectiveScanParams&, cudaStream_t) { return "selective_scan: no CUDA kernel yet"; }
const char* selective_state_update_cuda(const StateUpdateParams&, cudaStream_t) { return "selective_state_update: no CUDA kernel yet"; }
}  // namespace kcpp::mamba
