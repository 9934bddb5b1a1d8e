// The library's products with a fused epilogue on Hopper (ops/nn/decode_fused.h), each the one group of
// kernel/grouped_gemm_sm90.cuh's grouped GEMM: linear_glu (the packed gate/up product and its gated
// activation, the activation rounded to the dtype before the product with up, as glu_packed rounds
// it) and linear_qk_norm_rope_cache (the q / k / v product with the heads' norms, RoPE and the cache
// write).  Launched as programmatic dependents (in a prefill linear_glu follows add_rms_norm); the
// kernel waits before it touches memory.
#include <climits>

#include "kcpp/kernel/grouped_gemm_sm90.cuh"
#include "ops/cuda/common.cuh"
#include "ops/cuda/launch.h"

namespace kcpp::ops::cuda {

namespace g90 = kcpp::kernel::sm90gemm;

namespace {

// Launches p on the current stream: null, or why not (unsupported, or the driver refused a tensor map
// or the shared memory; nothing launched).  A failed launch throws, naming `op`.
template <typename T> const char* run(const g90::GroupedGemm<T>& p, const char* op) {
  if (const char* why = g90::unsupported(p)) return why;
  cudaError_t err = cudaSuccess;
  if (!g90::launch(p, kcpp::cuda::current_stream(), &err)) return "the driver refused a tensor map or the kernel's shared memory";
  if (err != cudaSuccess) KCPP_FAIL("op {}: kernel launch failed: {}: {}", op, cudaGetErrorName(err), cudaGetErrorString(err));
  return nullptr;
}

// f(type_identity<T>) for bf16 / f16; else "the dtype is not bf16 or f16".
template <typename F> const char* visit_16bit(DType t, F&& f) {
  if (t == DType::bf16) return f(std::type_identity<__nv_bfloat16>{});
  if (t == DType::f16) return f(std::type_identity<__half>{});
  return "the dtype is not bf16 or f16";
}

}  // namespace

const char* fused_gemm_unavailable(Device device) {
  kcpp::cuda::DeviceGuard guard(device.index);
#if defined(KCPP_OPS_HAS_SM90)
  return g90::device_unavailable(true);
#else
  return g90::device_unavailable(false);
#endif
}

int multiprocessors(Device device) { return kcpp::kernel::cuda::sm_count(device.index); }

const char* linear_glu(const Tensor& h, const Tensor& x, const Tensor& weight, GluActivation act) {
  if (const char* why = fused_gemm_unavailable(x.device())) return why;
  kcpp::cuda::DeviceGuard guard(x.device().index);
  if (x.stride(1) != 1 || !weight.is_contiguous() || !h.is_contiguous()) return "an operand is not contiguous along K";
  const int64_t n = x.size(0), k = x.size(1), inter = weight.size(0) / 2;
  return visit_16bit(x.dtype(), [&]<typename T>(std::type_identity<T>) {
    g90::GroupedGemm<T> p;
    p.epilogue = g90::GemmEpilogue::Glu;
    p.act = act == GluActivation::Silu   ? kcpp::kernel::Activation::Silu
            : act == GluActivation::Gelu ? kcpp::kernel::Activation::Gelu
                                         : kcpp::kernel::Activation::GeluTanh;
    p.round_act = true;
    p.a = static_cast<const T*>(x.data()), p.a_rows = n, p.lda = x.stride(0), p.k = k;
    p.b0 = static_cast<const T*>(weight.data()), p.b1 = p.b0 + inter * k, p.ldb = k, p.b_gstride = 2 * inter * k;
    p.n = inter, p.h = static_cast<T*>(h.data());
    p.dependent = true;
    return run(p, "linear_glu");
  });
}

const char* linear_qk_norm_rope_cache(const Tensor& q, const Tensor& x, const Tensor& weight, const QkNormRopeCache& opt,
                                      const Tensor& cos, const Tensor& sin, const Tensor& k_cache, const Tensor& v_cache,
                                      const Tensor& rows, const Tensor& positions) {
  if (const char* why = fused_gemm_unavailable(x.device())) return why;
  kcpp::cuda::DeviceGuard guard(x.device().index);
  for (const Tensor* t : {&weight, &q, &cos, &sin, &k_cache, &v_cache, &rows, &positions, &opt.q_norm, &opt.k_norm})
    if (t->defined() && !t->is_contiguous()) return "an operand is not contiguous";
  if (x.stride(1) != 1) return "x is not contiguous along K";
  const int64_t n = x.size(0), k = x.size(1), heads = opt.q_heads + 2 * opt.kv_heads, d = weight.size(0) / heads;
  if (k_cache.size(0) > INT32_MAX || k_cache.size(2) > INT32_MAX || heads > INT32_MAX)
    return "a cache of more than 2^31 - 1 rows or positions";
  return visit_16bit(x.dtype(), [&]<typename T>(std::type_identity<T>) {
    g90::GroupedGemm<T> p;
    p.epilogue = g90::GemmEpilogue::QkNormRope;
    p.a = static_cast<const T*>(x.data()), p.a_rows = n, p.lda = x.stride(0), p.k = k;
    p.b0 = static_cast<const T*>(weight.data()), p.ldb = k, p.b_gstride = heads * d * k;
    p.n = heads * d, p.head_dim = static_cast<int>(d);
    p.q_out = static_cast<T*>(q.data());
    p.k_cache = static_cast<T*>(k_cache.data()), p.v_cache = static_cast<T*>(v_cache.data());
    p.rows_of = static_cast<const int32_t*>(rows.data()), p.positions = static_cast<const int32_t*>(positions.data());
    if (opt.q_norm.defined()) {
      p.q_norm = static_cast<const T*>(opt.q_norm.data()), p.k_norm = static_cast<const T*>(opt.k_norm.data());
      p.eps = static_cast<float>(opt.norm.eps), p.norm_offset = static_cast<float>(opt.norm.offset);
      p.gemma = opt.norm.casting == RMSNormCasting::Gemma;
    }
    p.cos = static_cast<const T*>(cos.data()), p.sin = static_cast<const T*>(sin.data());
    p.hq = static_cast<int>(opt.q_heads), p.hkv = static_cast<int>(opt.kv_heads);
    p.cache_rows = static_cast<int>(k_cache.size(0)), p.capacity = static_cast<int>(k_cache.size(2));
    p.dependent = true;
    return run(p, "linear_qk_norm_rope_cache");
  });
}

}  // namespace kcpp::ops::cuda
