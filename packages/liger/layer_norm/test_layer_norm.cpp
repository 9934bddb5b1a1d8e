// LayerNorm kernels against the f64 oracle, held to docs/DESIGN.md's bound: at most twice the error of
// the eager reference (ops::layer_norm_*) run in the same precision, and within the dtype's table.
#include "core/cuda_runtime.h"
#include "kernel_params.h"
#include "layer_norm.h"
#include "oracle.h"
#include "ops/nn/layer_norm.h"
#include "test_util.h"

namespace kcpp {
namespace {

using liger::LayerNormParams;

LayerNormParams params(const Tensor& x, const Tensor& w, const Tensor& b, const Tensor& mean, const Tensor& rstd) {
  LayerNormParams p;
  p.dtype = test::kernel_dtype(x.dtype());
  p.rows = x.size(0);
  p.hidden = x.size(1);
  p.eps = 1e-5f;
  p.x = x.data(), p.x_stride = x.stride(0);
  p.w = w.data();
  if (b.defined()) p.b = b.data();
  p.mean = static_cast<float*>(mean.data());
  p.rstd = static_cast<float*>(rstd.data());
  return p;
}

// Runs forward, then backward with dx written to `dx_out` (dy itself for the in-place form).
struct Result {
  Tensor y, mean, rstd, dx, dw, db;
};
Result run(Device dev, const Tensor& x, const Tensor& w, const Tensor& b, const Tensor& dy, const Tensor& dx_out) {
  const int64_t rows = x.size(0), h = x.size(1);
  Result r{Tensor::empty({rows, h}, x.dtype(), dev), Tensor::empty({rows}, DType::f32, dev), Tensor::empty({rows}, DType::f32, dev),
        dx_out, Tensor::empty({h}, x.dtype(), dev), b.defined() ? Tensor::empty({h}, x.dtype(), dev) : Tensor()};
  LayerNormParams p = params(x, w, b, r.mean, r.rstd);
  p.y = r.y.data(), p.y_stride = r.y.stride(0);
  test::check(KCPP_CALL_KERNEL(dev, liger::layer_norm_forward, p));
  p.dy = dy.data(), p.dy_stride = dy.stride(0);
  p.dx = r.dx.data(), p.dx_stride = r.dx.stride(0);
  p.dw = r.dw.data();
  if (r.db.defined()) p.db = r.db.data();
  Tensor ws;
#if KCPP_WITH_CUDA
  if (dev.is_cuda()) {
    ws = Tensor::empty({std::max<int64_t>(1, static_cast<int64_t>(liger::layer_norm_backward_workspace(p, dev.index)))}, DType::u8, dev);
    p.workspace = ws.data();
  }
#endif
  test::check(KCPP_CALL_KERNEL(dev, liger::layer_norm_backward, p));
  return r;
}

class LigerLayerNorm : public ::testing::TestWithParam<Device> {};

TEST_P(LigerLayerNorm, WithinTwiceTheReferenceError) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test::test_generator();
  // 1, primes, 4096 (registers), 4097 (unaligned: loop), 40000 (vector loop beyond the registers).
  for (DType dt : {DType::f32, DType::bf16, DType::f16})
    for (int64_t h : {1, 7, 111, 4096, 4097, 40000})
      for (bool bias : {true, false}) {
        if (h == 40000 && !bias) continue;  // keep CI fast
        const int64_t rows = h >= 4096 ? 7 : 37;
        const std::string cfg = fmt::format("{} h={} bias={}", test::config_name(dev, dt), h, bias);
        // Rows of a wider buffer, an offset mean (the two-pass variance matters there).
        const Tensor x = Tensor::randn({rows, h + 8}, dt, dev, gen, 3.0, 1.5).narrow(1, 0, h);
        const Tensor w = Tensor::randn({h}, dt, dev, gen), b = bias ? Tensor::randn({h}, dt, dev, gen) : Tensor();
        const Tensor dy = Tensor::randn({rows, h}, dt, dev, gen);
        const auto xv = x.to_f64_vector(), wv = w.to_f64_vector();
        const auto fo = oracle::layer_norm(xv, wv, bias ? b.to_f64_vector() : oracle::V{}, rows, h, 1e-5);
        const auto bo = oracle::layer_norm_backward(dy.to_f64_vector(), xv, wv, rows, h, 1e-5);
        const auto ref = ops::layer_norm_forward(x, w, b, 1e-5);
        const auto rb = ops::layer_norm_backward(dy, x, w, ref.mean, ref.rstd, bias);
        const Result got = run(dev, x, w, b, dy, Tensor::empty({rows, h}, dt, dev));
        const double ey_ref = test::rel_l2_error(ref.y, fo.y), ey = test::rel_l2_error(got.y, fo.y);
        EXPECT_LE(ey, test::kernel_bound(ey_ref, dt)) << cfg << " y (reference error " << ey_ref << ")";
        EXPECT_LE(test::rel_l2_error(got.rstd, fo.rstd), test::kernel_bound(test::rel_l2_error(ref.rstd, fo.rstd), DType::f32))
            << cfg << " rstd";
        const double edx_ref = test::mag_error(rb.dx, bo.dx, bo.dx_mag), edx = test::mag_error(got.dx, bo.dx, bo.dx_mag);
        const double edw_ref = test::mag_error(rb.dw, bo.dw, bo.dw_mag), edw = test::mag_error(got.dw, bo.dw, bo.dw_mag);
        EXPECT_LE(edx, test::kernel_bound(edx_ref, dt)) << cfg << " dx (reference error " << edx_ref << ")";
        EXPECT_LE(edw, test::kernel_bound(edw_ref, dt)) << cfg << " dw (reference error " << edw_ref << ")";
        EXPECT_LE(std::max({ey, edx, edw}), test::composite_rel_l2(dt)) << cfg;
        if (bias) {
          const double edb_ref = test::rel_l2_error(rb.db, bo.db), edb = test::rel_l2_error(got.db, bo.db);
          EXPECT_LE(edb, test::kernel_bound(edb_ref, dt)) << cfg << " db (reference error " << edb_ref << ")";
        }
      }
}

// Rows whose mean is a hundred times their spread: the variance must come from deviations (two
// passes, or merged partial deviations), not from mean(x^2) - mean^2, whose cancellation would cost
// f32 four of its seven digits here.
TEST_P(LigerLayerNorm, LargeMeanRowsWithinTheBound) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test::test_generator();
  for (DType dt : {DType::f32, DType::bf16})
    for (int64_t h : {111, 1000, 2048, 4096, 4097}) {  // loop, registers (a partly empty block), registers (full)
      const int64_t rows = 37;
      const std::string cfg = fmt::format("{} h={}", test::config_name(dev, dt), h);
      const Tensor x = Tensor::randn({rows, h}, dt, dev, gen, 100.0, 1.0);
      const Tensor w = Tensor::randn({h}, dt, dev, gen), b = Tensor::randn({h}, dt, dev, gen);
      const auto fo = oracle::layer_norm(x.to_f64_vector(), w.to_f64_vector(), b.to_f64_vector(), rows, h, 1e-5);
      const auto ref = ops::layer_norm_forward(x, w, b, 1e-5);
      const Result got = run(dev, x, w, b, Tensor::zeros({rows, h}, dt, dev), Tensor::empty({rows, h}, dt, dev));
      const double erstd_ref = test::rel_l2_error(ref.rstd, fo.rstd), erstd = test::rel_l2_error(got.rstd, fo.rstd);
      EXPECT_LE(erstd, test::kernel_bound(erstd_ref, DType::f32)) << cfg << " rstd (reference error " << erstd_ref << ")";
      EXPECT_LE(test::rel_l2_error(got.y, fo.y), test::composite_rel_l2(dt)) << cfg << " y";
    }
}

TEST_P(LigerLayerNorm, InPlaceBackwardDeterminismAndBadInput) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test::test_generator();
  const Tensor x = Tensor::randn({301, 4096}, DType::bf16, dev, gen), w = Tensor::randn({4096}, DType::bf16, dev, gen);
  const Tensor b = Tensor::randn({4096}, DType::bf16, dev, gen), dy = Tensor::randn({301, 4096}, DType::bf16, dev, gen);
  const Result a = run(dev, x, w, b, dy, Tensor::empty({301, 4096}, DType::bf16, dev));
  const Result a2 = run(dev, x, w, b, dy, Tensor::empty({301, 4096}, DType::bf16, dev));
  EXPECT_EQ(a.dw.to_f64_vector(), a2.dw.to_f64_vector()) << "dw differs between two runs";
  EXPECT_EQ(a.db.to_f64_vector(), a2.db.to_f64_vector()) << "db differs between two runs";
  const Tensor dy2 = dy.clone();
  const Result c = run(dev, x, w, b, dy2, dy2);
  EXPECT_EQ(dy2.to_f64_vector(), a.dx.to_f64_vector()) << "in-place dx differs";
  LayerNormParams p = params(x, w, b, a.mean, a.rstd);
  p.y = a.y.data(), p.y_stride = 4096;
  LayerNormParams q = p;
  q.eps = -1.0f;
  EXPECT_TRUE(test::kernel_error_contains(KCPP_CALL_KERNEL(dev, liger::layer_norm_forward, q), "eps must be finite"));
  q = p;
  q.y = nullptr;
  EXPECT_TRUE(test::kernel_error_contains(KCPP_CALL_KERNEL(dev, liger::layer_norm_forward, q), "'y' is null"));
  q = p;
  q.x_stride = 5;
  EXPECT_TRUE(test::kernel_error_contains(KCPP_CALL_KERNEL(dev, liger::layer_norm_forward, q), "row stride"));
}

// A NaN or an infinity poisons its row as in PyTorch (the row's mean or variance is NaN, so is every
// y and dx of it) and dw (a column sum over the rows' normalised values), never db (the sum of dy)
// nor the other rows.  h = 4096 and 4095 take the kernels' vector and element paths.
TEST_P(LigerLayerNorm, NaNAndInfStayInTheirRows) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test::test_generator();
  for (DType dt : {DType::f32, DType::bf16})
    for (int64_t h : {int64_t{4096}, int64_t{4095}, int64_t{13}}) {
      const int64_t rows = 5;
      std::vector<double> xv = Tensor::randn({rows, h}, DType::f64, Device::cpu(), gen).to_f64_vector();
      xv[static_cast<size_t>(1 * h + h / 2)] = std::nan("");
      xv[static_cast<size_t>(3 * h + h - 1)] = std::numeric_limits<double>::infinity();
      const Tensor x = Tensor::from_f64(xv, {rows, h}, dt, dev), w = Tensor::randn({h}, dt, dev, gen);
      const Tensor b = Tensor::randn({h}, dt, dev, gen), dy = Tensor::randn({rows, h}, dt, dev, gen);
      const Result r = run(dev, x, w, b, dy, Tensor::empty({rows, h}, dt, dev));
      const auto y = r.y.to_f64_vector(), dx = r.dx.to_f64_vector(), dw = r.dw.to_f64_vector(), db = r.db.to_f64_vector();
      const std::string cfg = fmt::format("{} h={}", test::config_name(dev, dt), h);
      for (int64_t i = 0; i < rows; ++i) {
        const bool poisoned = i == 1 || i == 3;
        for (int64_t j = 0; j < h; ++j) {
          const size_t e = static_cast<size_t>(i * h + j);
          ASSERT_EQ(std::isnan(y[e]), poisoned) << cfg << " y[" << i << ", " << j << "] = " << y[e];
          ASSERT_EQ(std::isnan(dx[e]), poisoned) << cfg << " dx[" << i << ", " << j << "] = " << dx[e];
          if (!poisoned) ASSERT_TRUE(std::isfinite(y[e]) && std::isfinite(dx[e])) << cfg << " row " << i << " col " << j;
        }
      }
      for (int64_t j = 0; j < h; ++j) {
        ASSERT_TRUE(std::isnan(dw[static_cast<size_t>(j)])) << cfg << " dw[" << j << "] = " << dw[static_cast<size_t>(j)];
        ASSERT_TRUE(std::isfinite(db[static_cast<size_t>(j)])) << cfg << " db[" << j << "] = " << db[static_cast<size_t>(j)];
      }
    }
}

#if KCPP_WITH_CUDA
// Many more rows than resident blocks: every block of the persistent backward (on sm_90 the bulk
// path, whose ring of rows then wraps several times) cycles through many rows; by default and in
// every configuration of layer_norm_backward_cuda_with.
TEST(LigerLayerNormCuda, ManyRowsPerBlockWithinTheBound) {
  const Device dev = Device::cuda(0);
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test::test_generator();
  for (DType dt : {DType::f32, DType::bf16})
    for (int64_t h : {1000, 2048, 4096}) {
      const int64_t rows = h == 1000 ? 8191 : 3001;
      const std::string cfg = fmt::format("{} h={} rows={}", test::config_name(dev, dt), h, rows);
      const Tensor x = Tensor::randn({rows, h + 8}, dt, dev, gen, 3.0, 1.5).narrow(1, 0, h);
      const Tensor w = Tensor::randn({h}, dt, dev, gen), b = Tensor::randn({h}, dt, dev, gen);
      const Tensor dy = Tensor::randn({rows, h}, dt, dev, gen);
      const auto xv = x.to_f64_vector(), wv = w.to_f64_vector();
      const auto bo = oracle::layer_norm_backward(dy.to_f64_vector(), xv, wv, rows, h, 1e-5);
      const auto ref = ops::layer_norm_forward(x, w, b, 1e-5);
      const auto rb = ops::layer_norm_backward(dy, x, w, ref.mean, ref.rstd, true);
      const Result got = run(dev, x, w, b, dy, Tensor::empty({rows, h}, dt, dev));
      const double edx_ref = test::mag_error(rb.dx, bo.dx, bo.dx_mag), edx = test::mag_error(got.dx, bo.dx, bo.dx_mag);
      const double edw_ref = test::mag_error(rb.dw, bo.dw, bo.dw_mag), edw = test::mag_error(got.dw, bo.dw, bo.dw_mag);
      const double edb_ref = test::rel_l2_error(rb.db, bo.db), edb = test::rel_l2_error(got.db, bo.db);
      EXPECT_LE(edx, test::kernel_bound(edx_ref, dt)) << cfg << " dx (reference error " << edx_ref << ")";
      EXPECT_LE(edw, test::kernel_bound(edw_ref, dt)) << cfg << " dw (reference error " << edw_ref << ")";
      EXPECT_LE(edb, test::kernel_bound(edb_ref, dt)) << cfg << " db (reference error " << edb_ref << ")";
      // Every row-path configuration the sweep can choose: 1 or 2 vectors a thread, as many blocks
      // as fit or one an SM (each block's ring then wraps twice as often), the bulk path's partial
      // sums added in clusters of the default size, of 2 or 8, or not at all.
      for (int items : {1, 2})
        for (int blocks_per_sm : {0, 1})
          for (int cluster : {0, 1, 2, 8}) {
          const std::string c = fmt::format("{} items={} blocks_per_sm={} cluster={}", cfg, items, blocks_per_sm, cluster);
          LayerNormParams p = params(x, w, b, got.mean, got.rstd);
          const Tensor dx = Tensor::empty({rows, h}, dt, dev), dw = Tensor::empty({h}, dt, dev), db = Tensor::empty({h}, dt, dev);
          p.dy = dy.data(), p.dy_stride = dy.stride(0), p.dx = dx.data(), p.dx_stride = dx.stride(0);
          p.dw = dw.data(), p.db = db.data();
          const size_t bytes = liger::layer_norm_backward_workspace_with(p, dev.index, items, blocks_per_sm, cluster);
          const Tensor ws = Tensor::empty({std::max<int64_t>(1, static_cast<int64_t>(bytes))}, DType::u8, dev);
          p.workspace = ws.data();
          ASSERT_EQ(liger::layer_norm_backward_cuda_with(p, cuda::current_stream(), items, blocks_per_sm, cluster), nullptr) << c;
          EXPECT_LE(test::mag_error(dx, bo.dx, bo.dx_mag), test::kernel_bound(edx_ref, dt)) << c << " dx";
          EXPECT_LE(test::mag_error(dw, bo.dw, bo.dw_mag), test::kernel_bound(edw_ref, dt)) << c << " dw";
          EXPECT_LE(test::rel_l2_error(db, bo.db), test::kernel_bound(edb_ref, dt)) << c << " db";
        }
    }
}

// Every forward configuration the sweep can choose (1, 2 or 4 vectors a thread; with 4 at h = 512 f32
// a single warp of 16 values a thread), on rows of ordinary and of large mean (100 times the spread:
// the merged statistics' partial means must not carry the mean's rounding into the variance).
TEST(LigerLayerNormCuda, EveryForwardConfigurationWithinTheBound) {
  const Device dev = Device::cuda(0);
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test::test_generator();
  for (DType dt : {DType::f32, DType::bf16, DType::f16})
    for (int64_t h : {512, 1000, 2048, 4096})
      for (double mean : {3.0, 100.0}) {
        const int64_t rows = 61;
        const std::string cfg = fmt::format("{} h={} mean={}", test::config_name(dev, dt), h, mean);
        const Tensor x = Tensor::randn({rows, h}, dt, dev, gen, mean, 1.0);
        const Tensor w = Tensor::randn({h}, dt, dev, gen), b = Tensor::randn({h}, dt, dev, gen);
        const auto fo = oracle::layer_norm(x.to_f64_vector(), w.to_f64_vector(), b.to_f64_vector(), rows, h, 1e-5);
        const auto ref = ops::layer_norm_forward(x, w, b, 1e-5);
        const double ey_ref = test::rel_l2_error(ref.y, fo.y), erstd_ref = test::rel_l2_error(ref.rstd, fo.rstd);
        for (int items : {0, 1, 2, 4}) {
          const std::string c = fmt::format("{} items={}", cfg, items);
          const Tensor y = Tensor::full({rows, h}, std::nan(""), dt, dev);
          const Tensor m = Tensor::empty({rows}, DType::f32, dev), r = Tensor::empty({rows}, DType::f32, dev);
          LayerNormParams p = params(x, w, b, m, r);
          p.y = y.data(), p.y_stride = h;
          ASSERT_EQ(test::finish_cuda(liger::layer_norm_forward_cuda_with(p, cuda::current_stream(), items)), nullptr) << c;
          EXPECT_LE(test::rel_l2_error(y, fo.y), test::kernel_bound(ey_ref, dt)) << c << " y (reference error " << ey_ref << ")";
          EXPECT_LE(test::rel_l2_error(r, fo.rstd), test::kernel_bound(erstd_ref, DType::f32))
              << c << " rstd (reference error " << erstd_ref << ")";
        }
      }
}
#endif

INSTANTIATE_TEST_SUITE_P(Devices, LigerLayerNorm, ::testing::Values(Device::cpu(), Device::cuda(0)),
                         [](const auto& info) { return info.param.is_cpu() ? std::string("cpu") : std::string("cuda"); });

}  // namespace
}  // namespace kcpp
