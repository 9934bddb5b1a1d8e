// Placeholder until the CUDA kernels land.
#include "causal_conv1d/causal_conv1d.h"
namespace kcpp::mamba {
const char* causal_conv1d_forward_cuda(const CausalConv1dParams&, cudaStream_t) { return "causal_conv1d: no CUDA kernel yet"; }
const char* causal_conv1d_backward_cuda(const CausalConv1dParams&, cudaStream_t) { return "causal_conv1d: no CUDA kernel yet"; }
const char* causal_conv1d_update_cuda(const ConvUpdateParams&, cudaStream_t) { return "causal_conv1d: no CUDA kernel yet"; }
}  // namespace kcpp::mamba
