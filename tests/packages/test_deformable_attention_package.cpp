// Package "deformable_attention" through the ABI, as a host calls it: the built library loaded, its layer
// called with the named arguments of docs/contracts/MultiScaleDeformableAttention.md, results against the
// f64 oracle (tests/oracle_msda.h).  The numerics are covered in depth by
// packages/deformable_attention/test_msda.cpp; here every argument is exercised, so that a wrong mapping
// from the contract to the kernel shows up as an O(1) error, and bad input is refused by name.
#include <cmath>
#include <string>
#include <vector>

#include "oracle_msda.h"
#include "package_util.h"
#include "test_util.h"

namespace kcpp {
namespace {

using nn::KernelArgs;
using nn::KernelLayer;

KernelLayer layer() { return KernelLayer::find(test::built_package("deformable_attention"), "MultiScaleDeformableAttention"); }

// Within one rounding to the dtype plus f32 sums of the magnitudes, plus what the f32 rounding of the
// sampling positions moves the weights by (`moved`: oracle::Terms::PositionRounding, which dominates
// where a sample lies just inside a map's edge and its in-range weights are small).
void expect_close(const Tensor& got, const oracle::V& ref, const oracle::V& mag, const oracle::V& moved, DType dt,
                  const std::string& what) {
  double mag2 = 0, moved2 = 0;
  for (size_t i = 0; i < mag.size(); ++i) mag2 += mag[i] * mag[i], moved2 += moved[i] * moved[i];
  const double position = test::unit_roundoff(DType::f32) * (mag2 > 0 ? std::sqrt(moved2 / mag2) : std::sqrt(moved2));
  const double e = test::mag_error(got, ref, mag);
  EXPECT_LE(e, test::unit_roundoff(dt) + 32 * test::unit_roundoff(DType::f32) + position + test::underflow_allowance(dt, mag))
      << what << " (error / magnitude " << e << ")";
}

class DeformableAttentionPackage : public ::testing::TestWithParam<Device> {};

TEST_P(DeformableAttentionPackage, TableNamesTheLayerAndContract) {
  const auto pkg = test::built_package("deformable_attention");
  EXPECT_STREQ(pkg->table().name, "deformable_attention");
  const KernelLayer l = layer();
  EXPECT_STREQ(l.info().contract, "MultiScaleDeformableAttention/1");
  EXPECT_TRUE(l.has_backward());
  EXPECT_TRUE(l.runs_on(Device::cpu()));
}

TEST_P(DeformableAttentionPackage, ForwardAndBackward) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test::test_generator();
  const KernelLayer k = layer();
  const int64_t b = 2, q = 11, m = 3, c = 9, p = 2;
  const std::vector<int64_t> shapes = {5, 6, 3, 3, 1, 2}, starts = {0, 30, 39};
  const int64_t L = 3, s = 41;
  for (DType dt : {DType::f32, DType::bf16, DType::f16}) {
    const std::string cfg = test::config_name(dev, dt);
    const Tensor value = Tensor::randn({b, s, m, c}, dt, dev, gen);
    const Tensor ts = Tensor::from_i64(shapes, {L, 2}, DType::i64, dev), tst = Tensor::from_i64(starts, {L}, DType::i64, dev);
    const Tensor loc = Tensor::uniform({b, q, m, L, p, 2}, dt, dev, gen, -0.2, 1.2);
    const Tensor attn = Tensor::uniform({b, q, m, L, p}, dt, dev, gen, 0, 1);
    auto inputs = [&](KernelArgs& a) {
      a.tensor("value", value).tensor("value_spatial_shapes", ts).tensor("value_level_start_index", tst);
      a.tensor("sampling_locations", loc).tensor("attention_weights", attn).integer("im2col_step", 64);
    };
    const Tensor out = Tensor::full({b, q, m * c}, std::nan(""), dt, dev);
    KernelArgs f;
    inputs(f);
    f.tensor("out", out);
    ASSERT_TRUE(k.supports(f, dev, test::kTraining).ok()) << cfg << ": " << k.supports(f, dev, test::kTraining).message;
    k.forward(f, dev, test::kTraining);
    const Tensor dout = Tensor::randn({b, q, m * c}, dt, dev, gen);
    const Tensor dvalue = Tensor::full(value.shape(), std::nan(""), dt, dev),
                 dloc = Tensor::full(loc.shape(), std::nan(""), dt, dev),
                 dattn = Tensor::full(attn.shape(), std::nan(""), dt, dev);
    KernelArgs bw;
    inputs(bw);
    bw.tensor("dout", dout).tensor("dvalue", dvalue).tensor("dsampling_locations", dloc).tensor("dattention_weights", dattn);
    k.backward(bw, dev, test::kTraining);

    oracle::Msda o;
    o.batch = b, o.seq = s, o.heads = m, o.channels = c, o.queries = q, o.levels = L, o.points = p;
    o.shapes = shapes, o.starts = starts;
    o.value = value.to_f64_vector(), o.loc = loc.to_f64_vector(), o.attn = attn.to_f64_vector();
    using oracle::Terms;
    expect_close(out, oracle::msda_forward(o), oracle::msda_forward(o, Terms::Magnitude),
                 oracle::msda_forward(o, Terms::PositionRounding), dt, cfg + " out");
    const auto dv = dout.to_f64_vector();
    const oracle::MsdaGrad g = oracle::msda_backward(o, dv), mg = oracle::msda_backward(o, dv, Terms::Magnitude),
                           pg = oracle::msda_backward(o, dv, Terms::PositionRounding);
    expect_close(dvalue, g.dvalue, mg.dvalue, pg.dvalue, dt, cfg + " dvalue");
    expect_close(dloc, g.dloc, mg.dloc, pg.dloc, dt, cfg + " dsampling_locations");
    expect_close(dattn, g.dattn, mg.dattn, pg.dattn, dt, cfg + " dattention_weights");
  }
}

TEST_P(DeformableAttentionPackage, BadArgumentsAreRefusedByName) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  const KernelLayer k = layer();
  const Tensor value = Tensor::zeros({1, 10, 2, 4}, DType::f32, dev);
  const Tensor shapes = Tensor::from_i64(std::vector<int64_t>{3, 3, 1, 1}, {2, 2}, DType::i64, dev);
  const Tensor starts = Tensor::from_i64(std::vector<int64_t>{0, 9}, {2}, DType::i64, dev);
  const Tensor loc = Tensor::zeros({1, 3, 2, 2, 1, 2}, DType::f32, dev), attn = Tensor::zeros({1, 3, 2, 2, 1}, DType::f32, dev);
  const Tensor out = Tensor::empty({1, 3, 8}, DType::f32, dev);
  // Every argument but `skip` (which the block then gives its bad value).
  auto base = [&](KernelArgs& a, const std::string& skip = "") {
    const std::pair<const char*, const Tensor*> all[] = {{"value", &value},
                                                         {"value_spatial_shapes", &shapes},
                                                         {"value_level_start_index", &starts},
                                                         {"sampling_locations", &loc},
                                                         {"attention_weights", &attn},
                                                         {"out", &out}};
    for (const auto& [name, t] : all)
      if (skip != name) a.tensor(name, *t);
  };
  auto refused = [&](KernelArgs& a, kcpp_status s, const std::string& needle) {
    EXPECT_TRUE(test::refused(k.supports(a, dev, test::kInference), s, needle)) << needle;
  };
  {
    KernelArgs a;
    base(a);
    EXPECT_TRUE(k.supports(a, dev, test::kInference).ok());
  }
  {
    KernelArgs a;
    base(a, "attention_weights");
    a.tensor("attention_weights", Tensor::zeros({1, 3, 2, 2, 1}, DType::bf16, dev));
    refused(a, KCPP_ERROR_INVALID_ARGUMENT, "tensor 'attention_weights' is bf16 but 'value' is f32");
  }
  {  // an argument the call does not read (misspelt) is refused naming it, not ignored
    KernelArgs a;
    base(a);
    a.integer("im2col_steps", 64);
    refused(a, KCPP_ERROR_INVALID_ARGUMENT, "argument 'im2col_steps' is not one this call reads");
  }
  {
    KernelArgs a;
    base(a, "out");
    a.tensor("out", Tensor::empty({1, 3, 4}, DType::f32, dev));
    refused(a, KCPP_ERROR_INVALID_ARGUMENT, "tensor 'out' has shape [1, 3, 4]; expected [1, 3, 8]");
  }
  {
    KernelArgs a;
    base(a, "value_spatial_shapes");
    a.tensor("value_spatial_shapes", Tensor::from_i64(std::vector<int64_t>{3, 3, 1, 1}, {2, 2}, DType::i32, dev));
    refused(a, KCPP_ERROR_INVALID_ARGUMENT, "tensor 'value_spatial_shapes' must be int64");
  }
  {
    KernelArgs a;
    base(a, "value_level_start_index");
    a.tensor("value_level_start_index", Tensor::from_i64(std::vector<int64_t>{0}, {1}, DType::i64, dev));
    refused(a, KCPP_ERROR_INVALID_ARGUMENT, "tensor 'value_level_start_index' has shape [1]; expected [2]");
  }
  {
    KernelArgs a;
    base(a, "sampling_locations");
    a.tensor("sampling_locations", Tensor::zeros({1, 3, 2, 2, 1}, DType::f32, dev));
    refused(a, KCPP_ERROR_INVALID_ARGUMENT, "tensor 'sampling_locations' must have 6 dims");
  }
  if (dev.is_cpu()) {  // a level past the end of value: the CPU checks the index tensors' contents
    KernelArgs a;
    base(a, "value_level_start_index");
    a.tensor("value_level_start_index", Tensor::from_i64(std::vector<int64_t>{0, 10}, {2}, DType::i64, dev));
    try {
      k.forward(a, dev, test::kInference);
      ADD_FAILURE() << "a level past the end of 'value' was accepted";
    } catch (const Error& e) {
      EXPECT_NE(
          std::string(e.what()).find("level 1 (1 x 1 from row 10 of 'value_level_start_index') does not fit in the 10 rows"),
          std::string::npos)
          << e.what();
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Devices, DeformableAttentionPackage, ::testing::Values(Device::cpu(), Device::cuda(0)),
                         [](const auto& info) { return info.param.is_cpu() ? std::string("cpu") : std::string("cuda"); });

}  // namespace
}  // namespace kcpp
