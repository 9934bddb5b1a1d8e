// Matrix products through OpenBLAS (host) and cuBLAS (CUDA).  16-bit operands are widened to f32
// on the host, multiplied in f32 and rounded back, as PyTorch's CPU path does.
#include <cblas.h>

#include "core/profile.h"
#include "ops/check.h"
#include "ops/cuda/launch.h"
#include "ops/ops.h"

namespace kcpp::ops {

Tensor matmul(const Tensor& a, const Tensor& b, bool trans_a, bool trans_b) {
  check_float(a, "matmul", "a");
  check_float(b, "matmul", "b");
  check_same(b, a, "matmul", "b", "a");
  KCPP_CHECK(a.dim() >= 2 && b.dim() >= 2, "op matmul: arguments need at least 2 dims, got a {} and b {}",
             shape_str(a.shape()), shape_str(b.shape()));
  const int64_t m = trans_a ? a.size(-1) : a.size(-2), k = trans_a ? a.size(-2) : a.size(-1);
  const int64_t kb = trans_b ? b.size(-1) : b.size(-2), n = trans_b ? b.size(-2) : b.size(-1);
  KCPP_CHECK(k == kb, "op matmul: inner dimensions differ: a {}{} and b {}{}", shape_str(a.shape()),
             trans_a ? " (transposed)" : "", shape_str(b.shape()), trans_b ? " (transposed)" : "");
  const Shape batch_shape(a.shape().begin(), a.shape().end() - 2);
  const bool broadcast_b = b.dim() == 2 && a.dim() > 2;
  if (!broadcast_b)
    KCPP_CHECK(Shape(b.shape().begin(), b.shape().end() - 2) == batch_shape,
               "op matmul: batch dims differ: a {} and b {} (b may also be 2-D)", shape_str(a.shape()),
               shape_str(b.shape()));
  const int64_t batch = shape_numel(batch_shape);
  Shape out_shape = batch_shape;
  out_shape.push_back(m);
  out_shape.push_back(n);
  Tensor out = Tensor::empty(out_shape, a.dtype(), a.device());
  if (out.numel() == 0) return out;
  if (k == 0) {
    out.fill_(0);
    return out;
  }
  // Profiled by its shape ("GEMM 8192x14336x4096" is M x N x K), the operands' copies included.
  const profile::Region region("GEMM", a.device(), profile::enabled() ? 2.0 * batch * m * n * k : 0.0, 0,
                               profile::enabled() ? fmt::format("{}{}x{}x{}", batch > 1 ? fmt::format("{}x", batch) : "", m, n, k)
                                                  : std::string());
  const Tensor ac = a.contiguous(), bc = b.contiguous();
  if (a.device().is_cuda()) {
#if KCPP_WITH_CUDA
    cuda::matmul(out, ac, bc, trans_a, trans_b, batch, m, n, k, broadcast_b);
#endif
    return out;
  }
  const auto ta = trans_a ? CblasTrans : CblasNoTrans, tb = trans_b ? CblasTrans : CblasNoTrans;
  const int64_t lda = trans_a ? m : k, ldb = trans_b ? k : n;
  const int64_t sa = m * k, sb = broadcast_b ? 0 : k * n, so = m * n;
  if (a.dtype() == DType::f64) {
    const double *pa = static_cast<const double*>(ac.data()), *pb = static_cast<const double*>(bc.data());
    double* po = out.data_ptr<double>();
    for (int64_t i = 0; i < batch; ++i)
      cblas_dgemm(CblasRowMajor, ta, tb, m, n, k, 1.0, pa + i * sa, lda, pb + i * sb, ldb, 0.0, po + i * so, n);
    return out;
  }
  const Tensor af = ac.to(DType::f32), bf = bc.to(DType::f32);
  const Tensor of = a.dtype() == DType::f32 ? out : Tensor::empty(out_shape, DType::f32);
  const float *pa = static_cast<const float*>(af.data()), *pb = static_cast<const float*>(bf.data());
  float* po = of.data_ptr<float>();
  for (int64_t i = 0; i < batch; ++i)
    cblas_sgemm(CblasRowMajor, ta, tb, m, n, k, 1.0f, pa + i * sa, lda, pb + i * sb, ldb, 0.0f, po + i * so, n);
  if (!of.shares_storage(out)) out.copy_(of);
  return out;
}

}  // namespace kcpp::ops
