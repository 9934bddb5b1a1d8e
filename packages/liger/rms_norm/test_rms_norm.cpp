// RMSNorm kernels against the f64 oracle, held to docs/DESIGN.md's bound: at most twice the error of
// the eager reference (ops::rms_norm_*) run in the same precision, and within the dtype's table.
#include <cmath>
#include <cstring>

#include "core/cuda_runtime.h"
#include "kernel_params.h"
#include "oracle.h"
#include "ops/nn/rms_norm.h"
#include "ops/ops.h"
#include "rms_norm.h"
#include "rms_norm_tuning.h"
#include "test_util.h"

namespace kcpp {
namespace {

using liger::RMSNormCasting;
using liger::RMSNormParams;

std::vector<DType> kernel_dtypes() { return {DType::f32, DType::bf16, DType::f16}; }

// The host side of a call, as the ABI layer will do it: tensors in, params out, errors thrown.
struct Kernel {
  Device dev;

  RMSNormParams params(const Tensor& x, const Tensor& w, const ops::RMSNormOptions& o) const {
    return test::rms_norm_params({x, w, {}, {}, {}, {}, {}}, o);
  }

  static void check(const char* err) { test::check(err); }
  const char* forward_raw(const RMSNormParams& p) const { return KCPP_CALL_KERNEL(dev, liger::rms_norm_forward, p); }
  const char* backward_raw(const RMSNormParams& p) const { return KCPP_CALL_KERNEL(dev, liger::rms_norm_backward, p); }

  ops::RMSNormForward forward(const Tensor& x, const Tensor& w, const ops::RMSNormOptions& o) const {
    Tensor y = Tensor::empty(x.shape(), x.dtype(), dev), rstd = Tensor::empty({x.size(0)}, DType::f32, dev);
    check(forward_raw(test::rms_norm_params({x, w, y, rstd, {}, {}, {}}, o)));
    return {y, rstd};
  }

  // dx_out: where dx goes (a fresh tensor, or dy itself for the in-place variant).
  ops::RMSNormBackward backward(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& rstd,
                                const ops::RMSNormOptions& o, bool in_place = false) const {
    Tensor dx = in_place ? dy : Tensor::empty(x.shape(), x.dtype(), dev), dw = Tensor::empty({x.size(1)}, x.dtype(), dev);
    RMSNormParams p = test::rms_norm_params({x, w, {}, rstd, dy, dx, dw}, o);
    Tensor ws;
#if KCPP_WITH_CUDA
    if (dev.is_cuda()) {
      ws = Tensor::empty({static_cast<int64_t>(liger::rms_norm_backward_workspace(p, dev.index))}, DType::u8, dev);
      p.workspace = ws.data();
    }
#endif
    check(backward_raw(p));
    return {dx, dw};
  }
};

class LigerRMSNorm : public ::testing::TestWithParam<Device> {};

TEST_P(LigerRMSNorm, WithinTwiceTheReferenceError) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test::test_generator();
  const Kernel k{dev};
  // 1, primes, 4097 (scalar loop), 4096 and 8192 (registers), 40000 (vector loop: beyond registers).
  for (DType dt : kernel_dtypes())
    for (int64_t h : {1, 7, 111, 4096, 4097, 8192, 40000})
      for (RMSNormCasting casting : {RMSNormCasting::Llama, RMSNormCasting::Gemma, RMSNormCasting::None})
        for (double offset : {0.0, 1.0}) {
          if (h == 40000 && (casting != RMSNormCasting::Llama || offset != 0.0)) continue;  // keep CI fast
          const int64_t rows = h >= 4096 ? 7 : 37;
          const ops::RMSNormOptions opt{1e-6, offset, static_cast<ops::RMSNormCasting>(static_cast<int>(casting))};
          // Rows of a wider buffer: a row stride that is not the width.
          const Tensor x = Tensor::randn({rows, h + 8}, dt, dev, gen, 0.1, 1.5).narrow(1, 0, h);
          const Tensor w = Tensor::randn({h}, dt, dev, gen, 0.0, 1.0);
          const Tensor dy = Tensor::randn({rows, h}, dt, dev, gen);
          const auto xv = x.to_f64_vector(), wv = w.to_f64_vector();
          const auto fo = oracle::rms_norm(xv, wv, rows, h, opt.eps, offset);
          const auto bo = oracle::rms_norm_backward(dy.to_f64_vector(), xv, wv, rows, h, opt.eps, offset);
          const std::string cfg = fmt::format("{} h={} casting={} offset={}", test::config_name(dev, dt), h,
                                              static_cast<int>(casting), offset);

          const auto ref = ops::rms_norm_forward(x, w, opt);
          const auto got = k.forward(x, w, opt);
          const double e_ref = test::rel_l2_error(ref.y, fo.y), e_got = test::rel_l2_error(got.y, fo.y);
          EXPECT_LE(e_got, test::kernel_bound(e_ref, dt)) << cfg << " y (reference error " << e_ref << ")";
          EXPECT_LE(e_got, test::composite_rel_l2(dt)) << cfg << " y";
          const double er_ref = test::rel_l2_error(ref.rstd, fo.rstd), er = test::rel_l2_error(got.rstd, fo.rstd);
          EXPECT_LE(er, test::kernel_bound(er_ref, DType::f32)) << cfg << " rstd (reference error " << er_ref << ")";

          const auto rb = ops::rms_norm_backward(dy, x, w, ref.rstd, opt);
          const auto gb = k.backward(dy, x, w, got.rstd, opt);
          const double edx_ref = test::mag_error(rb.dx, bo.dx, bo.dx_mag), edx = test::mag_error(gb.dx, bo.dx, bo.dx_mag);
          const double edw_ref = test::mag_error(rb.dw, bo.dw, bo.dw_mag), edw = test::mag_error(gb.dw, bo.dw, bo.dw_mag);
          EXPECT_LE(edx, test::kernel_bound(edx_ref, dt)) << cfg << " dx (reference error " << edx_ref << ")";
          EXPECT_LE(edw, test::kernel_bound(edw_ref, dt)) << cfg << " dw (reference error " << edw_ref << ")";
          EXPECT_LE(edx, test::composite_rel_l2(dt)) << cfg << " dx";
          EXPECT_LE(edw, test::composite_rel_l2(dt)) << cfg << " dw";
        }
}

TEST_P(LigerRMSNorm, InPlaceBackwardAndDeterminism) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test::test_generator();
  const Kernel k{dev};
  const ops::RMSNormOptions opt;
  for (int64_t h : {4096, 4097}) {
    const Tensor x = Tensor::randn({301, h}, DType::bf16, dev, gen), w = Tensor::randn({h}, DType::bf16, dev, gen);
    const Tensor dy = Tensor::randn({301, h}, DType::bf16, dev, gen);
    const auto f = k.forward(x, w, opt);
    const auto a = k.backward(dy, x, w, f.rstd, opt), b = k.backward(dy, x, w, f.rstd, opt);
    EXPECT_EQ(a.dw.to_f64_vector(), b.dw.to_f64_vector()) << "dw differs between two runs, h=" << h;
    EXPECT_EQ(a.dx.to_f64_vector(), b.dx.to_f64_vector()) << "h=" << h;
    const Tensor dy2 = dy.clone();
    const auto c = k.backward(dy2, x, w, f.rstd, opt, /*in_place=*/true);
    EXPECT_TRUE(c.dx.shares_storage(dy2));
    EXPECT_EQ(c.dx.to_f64_vector(), a.dx.to_f64_vector()) << "in-place dx differs, h=" << h;
    EXPECT_EQ(c.dw.to_f64_vector(), a.dw.to_f64_vector()) << "in-place dw differs, h=" << h;
  }
}

// A NaN makes its row's statistics NaN, so every y of the row (as PyTorch); an infinity makes rstd 0,
// so its own y is inf x 0 = NaN and the rest of the row 0.  Other rows are untouched.  h = 16 and
// 4096 take the loop and the register paths.
TEST_P(LigerRMSNorm, NaNAndInfStayInTheirRows) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  for (DType dt : {DType::f32, DType::bf16})
    for (int64_t h : {int64_t{16}, int64_t{4096}}) {
      std::vector<double> xv(static_cast<size_t>(4 * h), 0.5);
      xv[static_cast<size_t>(h + 3)] = std::nan("");
      xv[static_cast<size_t>(3 * h + 5)] = std::numeric_limits<double>::infinity();
      const Tensor x = Tensor::from_f64(xv, {4, h}, dt, dev), w = Tensor::full({h}, 1.0, dt, dev);
      const auto y = Kernel{dev}.forward(x, w, {}).y.to_f64_vector();
      for (int64_t j = 0; j < h; ++j) {
        const auto at = [&](int64_t row) { return y[static_cast<size_t>(row * h + j)]; };
        EXPECT_TRUE(std::isnan(at(1))) << dtype_name(dt) << " h=" << h << " col " << j;
        EXPECT_TRUE(std::isfinite(at(0)) && std::isfinite(at(2))) << dtype_name(dt) << " h=" << h << " col " << j;
        if (j == 5) EXPECT_TRUE(std::isnan(at(3))) << dtype_name(dt) << " h=" << h;
        else EXPECT_EQ(at(3), 0.0) << dtype_name(dt) << " h=" << h << " col " << j;
      }
    }
}

TEST_P(LigerRMSNorm, BadInputIsAnErrorNotACrash) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  const Kernel k{dev};
  const Tensor x = Tensor::zeros({4, 8}, DType::bf16, dev), w = Tensor::zeros({8}, DType::bf16, dev);
  const Tensor y = Tensor::empty({4, 8}, DType::bf16, dev), r = Tensor::empty({4}, DType::f32, dev);
  RMSNormParams p = test::rms_norm_params({x, w, y, r, {}, {}, {}});
  auto expect_error = [&](const RMSNormParams& q, const char* needle, bool backward = false) {
    EXPECT_TRUE(test::kernel_error_contains(backward ? k.backward_raw(q) : k.forward_raw(q), needle));
  };
  RMSNormParams q = p;
  q.x = nullptr;
  expect_error(q, "must not be null");
  q = p;
  q.hidden = 0;
  expect_error(q, "hidden > 0");
  q = p;
  q.casting = static_cast<RMSNormCasting>(7);
  expect_error(q, "unknown casting mode 7");
  q = p;
  q.x_stride = 4;
  expect_error(q, "row stride 4 < hidden 8");
  q = p;
  q.eps = std::nanf("");
  expect_error(q, "eps");
  q = p;
  q.dtype = static_cast<kernel::DType>(9);
  expect_error(q, "unsupported dtype 9");
  q = p;  // backward without dy
  expect_error(q, "'dy', 'dx' and 'dw' must not be null", true);
  ASSERT_EQ(k.forward_raw(p), nullptr);  // the good call still works afterwards
}

#if KCPP_WITH_CUDA
// Every launch configuration the tuning sweep can choose computes the same function, RMSNorm and
// AddRMSNorm: the loop and registers paths, one block a row or persistent, and the backward's bulk
// path (sm_90) at every ring depth.  A capped grid (one block an SM) makes each block cycle through its ring
// several times; rows of a wider buffer give strides that are not the width.
TEST(LigerRMSNormCuda, EveryConfigurationWithinTheBound) {
  const Device dev = Device::cuda(0);
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test::test_generator();
  const ops::RMSNormOptions opt;
  std::vector<liger::RMSNormConfig> configs;
  for (int items : {0, 1, 2, 4, 8})
    for (bool persistent : {false, true}) configs.push_back({items, persistent, 0, 0});
  for (int items : {1, 2, 4})
    for (int stages : {1, 3, 8})
      for (int blocks_per_sm : {0, 1})
        for (int cluster : {0, 1, 8}) configs.push_back({items, true, stages, blocks_per_sm, cluster});
  for (DType dt : {DType::f32, DType::bf16})
    for (int64_t h : {1000, 4096, 4100}) {  // 4100 f32: 8 ranks of a cluster share 4100 columns unevenly
      const int64_t rows = h == 1000 ? 989 : 301;
      const Tensor x = Tensor::randn({rows, h + 8}, dt, dev, gen).narrow(1, 0, h), w = Tensor::randn({h}, dt, dev, gen);
      const Tensor res = Tensor::randn({rows, h}, dt, dev, gen, 0.2, 2.0);
      const Tensor dy = Tensor::randn({rows, h}, dt, dev, gen), dres = Tensor::randn({rows, h}, dt, dev, gen);
      const Tensor r_ref = ops::add(x, res);  // AddRMSNorm's residual stream, rounded once
      for (bool add : {false, true}) {
        const Tensor& in = add ? r_ref : x;
        const auto xv = in.to_f64_vector(), wv = w.to_f64_vector();
        const auto fo = oracle::rms_norm(xv, wv, rows, h, opt.eps, 0.0);
        auto bo = oracle::rms_norm_backward(dy.to_f64_vector(), xv, wv, rows, h, opt.eps, 0.0);
        if (add) {  // dx = the RMSNorm gradient at r + dresidual_out
          const auto dv = dres.to_f64_vector();
          for (size_t e = 0; e < bo.dx.size(); ++e) bo.dx[e] += dv[e], bo.dx_mag[e] += std::fabs(dv[e]);
        }
        const auto ref = ops::rms_norm_forward(in, w, opt);
        const auto rb = ops::rms_norm_backward(dy, in, w, ref.rstd, opt);
        const double ey = test::kernel_bound(test::rel_l2_error(ref.y, fo.y), dt);
        const double edx = test::kernel_bound(test::mag_error(add ? ops::add(rb.dx, dres) : rb.dx, bo.dx, bo.dx_mag), dt);
        const double edw = test::kernel_bound(test::mag_error(rb.dw, bo.dw, bo.dw_mag), dt);
        for (const liger::RMSNormConfig& c : configs) {
          const std::string cfg = fmt::format("{} h={} add={} items={} persistent={} stages={} blocks_per_sm={} cluster={}",
                                              test::config_name(dev, dt), h, add, c.items, c.persistent, c.stages,
                                              c.blocks_per_sm, c.cluster);
          const test::RMSNormTensors t = test::rms_norm_tensors(x, w, dy);
          RMSNormParams p = test::rms_norm_params(t, opt);
          const Tensor rout = Tensor::empty({rows, h}, dt, dev);
          if (add) {
            p.residual = res.data(), p.residual_stride = res.stride(0);
            p.residual_out = rout.data(), p.residual_out_stride = rout.stride(0);
          }
          ASSERT_EQ(liger::rms_norm_forward_cuda_with(p, cuda::current_stream(), c), nullptr) << cfg;
          if (add) {
            EXPECT_EQ(rout.to_f64_vector(), xv) << cfg << " residual_out must be round(x + residual)";
            p.x = rout.data(), p.x_stride = rout.stride(0);  // the backward normalises r
            p.dresidual_out = dres.data(), p.dres_stride = dres.stride(0);
          }
          Tensor ws = Tensor::empty({static_cast<int64_t>(liger::rms_norm_backward_workspace_with(p, 0, c))}, DType::u8, dev);
          p.workspace = ws.data();
          ASSERT_EQ(liger::rms_norm_backward_cuda_with(p, cuda::current_stream(), c), nullptr) << cfg;
          EXPECT_LE(test::rel_l2_error(t.y, fo.y), ey) << cfg << " y";
          EXPECT_LE(test::mag_error(t.dx, bo.dx, bo.dx_mag), edx) << cfg << " dx";
          EXPECT_LE(test::mag_error(t.dw, bo.dw, bo.dw_mag), edw) << cfg << " dw";
        }
      }
    }
}
#endif

INSTANTIATE_TEST_SUITE_P(Devices, LigerRMSNorm, ::testing::Values(Device::cpu(), Device::cuda(0)),
                         [](const auto& info) { return info.param.is_cpu() ? std::string("cpu") : std::string("cuda"); });

}  // namespace
}  // namespace kcpp
