// Package "activation" through the ABI against the f64 oracle, held to docs/DESIGN.md's bound: at most
// twice the error of the eager reference in the same precision (ops/: the unary op, or its
// composition where eager composes), and within the dtype's table.
#include <cmath>
#include <limits>

#include "oracle.h"
#include "ops/nn/glu.h"
#include "ops/ops.h"
#include "package_util.h"
#include "test_util.h"

namespace kcpp {
namespace {

using nn::KernelArgs;
using nn::KernelLayer;

struct Layer {
  const char* name;
  oracle::Act act;
  bool gated;
};

const Layer kLayers[] = {{"SiLU", oracle::Act::Silu, false},          {"GeLU", oracle::Act::Gelu, false},
                         {"GeluTanh", oracle::Act::GeluTanh, false},  {"FastGELU", oracle::Act::GeluTanh, false},
                         {"NewGELU", oracle::Act::GeluTanh, false},   {"QuickGELU", oracle::Act::QuickGelu, false},
                         {"SiluAndMul", oracle::Act::Silu, true},     {"GeluAndMul", oracle::Act::Gelu, true},
                         {"GeluTanhAndMul", oracle::Act::GeluTanh, true}};

KernelLayer layer(const char* name) { return KernelLayer::find(test::built_package("activation"), name); }

// The eager reference of a plain activation: one op (rounding once), or QuickGELU's composition
// x * sigmoid(1.702 x) as Transformers writes it (three roundings).
Tensor reference_forward(oracle::Act a, const Tensor& x) {
  switch (a) {
    case oracle::Act::Silu: return ops::silu(x);
    case oracle::Act::Gelu: return ops::gelu(x);
    case oracle::Act::GeluTanh: return ops::gelu(x, true);
    case oracle::Act::QuickGelu: return ops::mul(x, ops::sigmoid(ops::scale(x, 1.702)));
  }
  return {};
}
// Its backward, as autograd runs it (QuickGELU: the chain rule through the three ops).
Tensor reference_backward(oracle::Act a, const Tensor& dy, const Tensor& x) {
  switch (a) {
    case oracle::Act::Silu: return ops::silu_backward(dy, x);
    case oracle::Act::Gelu: return ops::gelu_backward(dy, x);
    case oracle::Act::GeluTanh: return ops::gelu_backward(dy, x, true);
    case oracle::Act::QuickGelu: {
      const Tensor s = ops::sigmoid(ops::scale(x, 1.702));
      const Tensor ds = ops::mul(ops::mul(dy, x), ops::mul(s, ops::sub(Tensor::full(s.shape(), 1.0, s.dtype(), s.device()), s)));
      return ops::add(ops::mul(dy, s), ops::scale(ds, 1.702));
    }
  }
  return {};
}
ops::GluActivation glu_act(oracle::Act a) {
  return a == oracle::Act::Silu ? ops::GluActivation::Silu : a == oracle::Act::Gelu ? ops::GluActivation::Gelu
                                                                                     : ops::GluActivation::GeluTanh;
}

class ActivationPackage : public ::testing::TestWithParam<Device> {};

TEST_P(ActivationPackage, TableHasEveryLayer) {
  const auto pkg = test::built_package("activation");
  EXPECT_EQ(pkg->table().num_layers, static_cast<int32_t>(std::size(kLayers)));
  for (const Layer& l : kLayers) EXPECT_EQ(std::string(layer(l.name).info().contract), std::string(l.name) + "/1");
}

TEST_P(ActivationPackage, WithinTwiceTheReferenceError) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test::test_generator();
  for (const Layer& l : kLayers) {
    const KernelLayer k = layer(l.name);
    for (DType dt : {DType::f32, DType::bf16, DType::f16})
      for (int64_t d : {1, 7, 111, 4097})
        for (bool strided : {false, true}) {
          const int64_t rows = d > 1000 ? 3 : 37, xw = l.gated ? 2 * d : d;
          const std::string cfg = fmt::format("{} {} d={} strided={}", l.name, test::config_name(dev, dt), d, strided);
          // x [2, rows/2.., xw] viewed from a wider buffer when strided; y and dy contiguous [.., d].
          const Tensor xb = Tensor::randn({rows, xw + (strided ? 9 : 0)}, dt, dev, gen, 0, 2.5);
          const Tensor x = xb.narrow(1, 0, xw);
          const Tensor y = Tensor::empty({rows, d}, dt, dev), dy = Tensor::randn({rows, d}, dt, dev, gen);
          const Tensor dx = Tensor::empty({rows, xw}, dt, dev);
          KernelArgs f;
          f.tensor("x", x).tensor("y", y);
          ASSERT_TRUE(k.supports(f, dev, test::kTraining).ok()) << cfg;
          k.forward(f, dev, test::kTraining);
          KernelArgs b;
          b.tensor("dy", dy).tensor("x", x).tensor("dx", dx);
          k.backward(b, dev, test::kTraining);

          // Oracle: the gated form is glu(gate, up); the plain one is glu with up = 1.
          const Tensor gate = l.gated ? x.narrow(1, 0, d) : x;
          const Tensor up = l.gated ? x.narrow(1, d, d) : Tensor::full({rows, d}, 1.0, dt, dev);
          const auto gv = gate.to_f64_vector(), uv = up.to_f64_vector(), dv = dy.to_f64_vector();
          const auto mag = oracle::glu_magnitude(dv, gv, uv, l.act);
          oracle::V dg, du;
          oracle::glu_backward(dv, gv, uv, l.act, dg, du);
          const auto fo = oracle::glu(gv, uv, l.act);
          Tensor ref_y, ref_dgate, ref_dup;
          if (l.gated) {
            ref_y = ops::glu_forward(gate, up, glu_act(l.act));
            const auto rb = ops::glu_backward(dy, gate, up, glu_act(l.act));
            ref_dgate = rb.dgate, ref_dup = rb.dup;
          } else {
            ref_y = reference_forward(l.act, x);
            ref_dgate = reference_backward(l.act, dy, x);
          }
          const double ey_ref = test::mag_error(ref_y, fo, mag.out), ey = test::mag_error(y, fo, mag.out);
          EXPECT_LE(ey, test::kernel_bound(ey_ref, dt)) << cfg << " y (reference error " << ey_ref << ")";
          EXPECT_LE(ey, test::composite_rel_l2(dt)) << cfg << " y";
          const Tensor dgate = l.gated ? dx.narrow(1, 0, d) : dx;
          const double eg_ref = test::mag_error(ref_dgate, dg, mag.dgate), eg = test::mag_error(dgate, dg, mag.dgate);
          EXPECT_LE(eg, test::kernel_bound(eg_ref, dt)) << cfg << " dx (reference error " << eg_ref << ")";
          EXPECT_LE(eg, test::composite_rel_l2(dt)) << cfg << " dx";
          if (l.gated) {
            const double eu_ref = test::mag_error(ref_dup, du, mag.dup), eu = test::mag_error(dx.narrow(1, d, d), du, mag.dup);
            EXPECT_LE(eu, test::kernel_bound(eu_ref, dt)) << cfg << " dx (up half; reference error " << eu_ref << ")";
          }
        }
  }
}

TEST_P(ActivationPackage, InPlaceMatchesOutOfPlace) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test::test_generator();
  for (const Layer& l : kLayers) {
    const KernelLayer k = layer(l.name);
    const int64_t d = 4104, xw = l.gated ? 2 * d : d;
    const Tensor x = Tensor::randn({2, 3, xw}, DType::bf16, dev, gen), dy = Tensor::randn({2, 3, d}, DType::bf16, dev, gen);
    const Tensor y = Tensor::empty({2, 3, d}, DType::bf16, dev), dx = Tensor::empty({2, 3, xw}, DType::bf16, dev);
    KernelArgs f, b;
    f.tensor("x", x).tensor("y", y);
    k.forward(f, dev, test::kTraining);
    b.tensor("dy", dy).tensor("x", x).tensor("dx", dx);
    k.backward(b, dev, test::kTraining);
    // Plain: y over x, dx over dy.  Gated: dx over x (y cannot alias x: it is half as wide).
    const Tensor x2 = x.clone(), dy2 = dy.clone();
    if (!l.gated) {
      KernelArgs f2;
      f2.tensor("x", x2).tensor("y", x2);
      k.forward(f2, dev, test::kTraining);
      EXPECT_EQ(x2.to_f64_vector(), y.to_f64_vector()) << l.name << " y over x";
      KernelArgs b2;
      b2.tensor("dy", dy2).tensor("x", x).tensor("dx", dy2);
      k.backward(b2, dev, test::kTraining);
      EXPECT_EQ(dy2.to_f64_vector(), dx.to_f64_vector()) << l.name << " dx over dy";
    } else {
      KernelArgs b2;
      b2.tensor("dy", dy).tensor("x", x2).tensor("dx", x2);
      k.backward(b2, dev, test::kTraining);
      EXPECT_EQ(x2.to_f64_vector(), dx.to_f64_vector()) << l.name << " dx over x";
      KernelArgs bad;
      bad.tensor("x", x).tensor("y", x.narrow(2, 0, d));
      EXPECT_TRUE(test::refused(k.supports(bad, dev, test::kInference), KCPP_ERROR_INVALID_ARGUMENT, "plain activation"))
          << l.name;
    }
  }
}

TEST_P(ActivationPackage, NaNPropagatesAndBadInputIsRefused) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  const double nan = std::numeric_limits<double>::quiet_NaN();
  for (const Layer& l : kLayers) {
    const KernelLayer k = layer(l.name);
    const int64_t d = 16, xw = l.gated ? 2 * d : d;
    std::vector<double> xs(static_cast<size_t>(xw), 0.5);
    xs[3] = nan;
    const Tensor x = Tensor::from_f64(xs, {1, xw}, DType::bf16, dev), y = Tensor::empty({1, d}, DType::bf16, dev);
    KernelArgs f;
    f.tensor("x", x).tensor("y", y);
    k.forward(f, dev, test::kInference);
    const auto yv = y.to_f64_vector();
    for (int64_t j = 0; j < d; ++j) EXPECT_EQ(std::isnan(yv[j]), j == 3) << l.name << " y[" << j << "] = " << yv[j];

    auto refused = [&](KernelArgs& a, kcpp_status s, const std::string& needle) {
      EXPECT_TRUE(test::refused(k.supports(a, dev, test::kInference), s, needle)) << l.name;
    };
    KernelArgs shape;
    shape.tensor("x", x).tensor("y", Tensor::empty({1, d + 1}, DType::bf16, dev));
    refused(shape, KCPP_ERROR_INVALID_ARGUMENT, "tensor 'y' has shape [1, 17]");
    KernelArgs dtype;
    dtype.tensor("x", x).tensor("y", Tensor::empty({1, d}, DType::f16, dev));
    refused(dtype, KCPP_ERROR_INVALID_ARGUMENT, "'y' is f16");
    KernelArgs ints;
    ints.tensor("x", Tensor::zeros({1, xw}, DType::i32, dev)).tensor("y", y);
    refused(ints, KCPP_ERROR_UNSUPPORTED, "dtype i32");
    KernelArgs strided;
    strided.tensor("x", Tensor::zeros({xw, 2}, DType::bf16, dev).transpose(0, 1)).tensor("y", Tensor::empty({2, d}, DType::bf16, dev));
    refused(strided, KCPP_ERROR_UNSUPPORTED, "last dim must be contiguous");
    KernelArgs missing;
    missing.tensor("x", x);
    refused(missing, KCPP_ERROR_INVALID_ARGUMENT, "missing tensor argument 'y'");
    KernelArgs unread;  // a backward argument in a forward call is refused naming it, not ignored
    unread.tensor("x", x).tensor("y", y).tensor("dx", Tensor::empty({1, xw}, DType::bf16, dev));
    refused(unread, KCPP_ERROR_INVALID_ARGUMENT, "argument 'dx' is not one this call reads");
    if (l.gated) {
      KernelArgs odd;
      odd.tensor("x", Tensor::zeros({1, 7}, DType::bf16, dev)).tensor("y", Tensor::empty({1, 3}, DType::bf16, dev));
      refused(odd, KCPP_ERROR_INVALID_ARGUMENT, "odd last dim 7");
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Devices, ActivationPackage, ::testing::Values(Device::cpu(), Device::cuda(0)),
                         [](const auto& info) { return info.param.is_cpu() ? std::string("cpu") : std::string("cuda"); });

}  // namespace
}  // namespace kcpp
