// ops/nn/decode_fused.h's linear_glu on Hopper: the packed gate/up projection as the one group of
// kernel/grouped_gemm_sm90.cuh's grouped GEMM, the gated activation in its epilogue, the activation
// rounded to the dtype before the product with up (glu_packed's rounding).
#include "kcpp/kernel/grouped_gemm_sm90.cuh"
#include "ops/cuda/common.cuh"
#include "ops/cuda/launch.h"

namespace kcpp::ops::cuda {

namespace g90 = kcpp::kernel::sm90gemm;

const char* linear_glu_unavailable(Device device) {
  kcpp::cuda::DeviceGuard guard(device.index);
#if defined(KCPP_OPS_HAS_SM90)
  return g90::device_unavailable(true);
#else
  return g90::device_unavailable(false);
#endif
}

int multiprocessors(Device device) { return kcpp::kernel::cuda::sm_count(device.index); }

const char* linear_glu(const Tensor& h, const Tensor& x, const Tensor& weight, GluActivation act) {
  if (const char* why = linear_glu_unavailable(x.device())) return why;
  kcpp::cuda::DeviceGuard guard(x.device().index);
  if (x.stride(1) != 1 || !weight.is_contiguous() || !h.is_contiguous()) return "an operand is not contiguous along K";
  const int64_t n = x.size(0), k = x.size(1), inter = weight.size(0) / 2;
  const char* why = nullptr;
  auto run = [&]<typename T>(std::type_identity<T>) {
    g90::GroupedGemm<T> p;
    p.epilogue = g90::GemmEpilogue::Glu;
    p.act = act == GluActivation::Silu   ? kcpp::kernel::Activation::Silu
            : act == GluActivation::Gelu ? kcpp::kernel::Activation::Gelu
                                         : kcpp::kernel::Activation::GeluTanh;
    p.round_act = true;
    p.a = static_cast<const T*>(x.data()), p.a_rows = n, p.lda = x.stride(0), p.k = k;
    p.b0 = static_cast<const T*>(weight.data()), p.b1 = p.b0 + inter * k, p.ldb = k, p.b_gstride = 2 * inter * k;
    p.n = inter, p.h = static_cast<T*>(h.data());
    p.dependent = true;  // after add_rms_norm in a prefill; the kernel waits before it touches memory
    if ((why = g90::unsupported(p)) != nullptr) return;
    cudaError_t err = cudaSuccess;
    if (!g90::launch(p, kcpp::cuda::current_stream(), &err)) {
      why = "the driver refused a tensor map or the kernel's shared memory";
      return;
    }
    if (err != cudaSuccess)
      KCPP_FAIL("op linear_glu: kernel launch failed: {}: {}", cudaGetErrorName(err), cudaGetErrorString(err));
  };
  if (x.dtype() == DType::bf16) run(std::type_identity<__nv_bfloat16>{});
  else if (x.dtype() == DType::f16) run(std::type_identity<__half>{});
  else why = "the dtype is not bf16 or f16";
  return why;
}

}  // namespace kcpp::ops::cuda
