// KernelConfig, layer slots and kernelize (src/nn/), with this build's liger package loaded through
// the hub from its local folder, as a user's `use_local_kernel` config would.
#include <nlohmann/json.hpp>

#include "hub/hub.h"
#include "nn/kernel_config.h"
#include "nn/layers.h"
#include "package_util.h"
#include "test_util.h"

namespace kcpp {
namespace {

using nn::KernelConfig;

// ---- KernelConfig --------------------------------------------------------------------------------

TEST(KernelConfig, SelectsByDeviceCapabilityAndMode) {
  const KernelConfig c = KernelConfig::parse(nlohmann::json::parse(R"({
    "RMSNorm": "acme/norm@^1.2:FastNorm",
    "SiLU": {"cuda": "acme/act:SiLU", "cpu": ""},
    "MLP": {"cuda": [{"ref": "acme/mlp-hopper", "capability": ">=9.0"}, {"ref": "acme/mlp"}]},
    "ForCausalLMLoss": {"cuda": {"training": "acme/loss:Fused", "inference": ""}},
    "Attention": {"training|graph": "acme/attn:Graphable", "training": "acme/attn:Eager"}
  })"));
  using hub::Backend;
  auto ref = [&](const char* layer, uint32_t mode, Backend dev, int major = 0, int minor = 0) -> std::string {
    const auto e = c.select(layer, mode, dev, major, minor);
    if (!e) return "<none>";
    return e->ref ? e->ref->text : "<disabled>";
  };
  EXPECT_EQ(ref("RMSNorm", nn::kTraining, Backend::CPU), "acme/norm@^1.2:FastNorm");
  EXPECT_EQ(ref("RMSNorm", nn::kInference | nn::kGraph, Backend::CUDA), "acme/norm@^1.2:FastNorm");
  EXPECT_EQ(ref("SiLU", nn::kInference, Backend::CUDA), "acme/act:SiLU");
  EXPECT_EQ(ref("SiLU", nn::kInference, Backend::CPU), "<disabled>");
  EXPECT_EQ(ref("SiLU", nn::kInference, Backend::ROCm), "<none>");
  EXPECT_EQ(ref("MLP", nn::kTraining, Backend::CUDA, 9, 0), "acme/mlp-hopper");
  EXPECT_EQ(ref("MLP", nn::kTraining, Backend::CUDA, 8, 0), "acme/mlp");
  EXPECT_EQ(ref("ForCausalLMLoss", nn::kTraining, Backend::CUDA), "acme/loss:Fused");
  EXPECT_EQ(ref("ForCausalLMLoss", nn::kInference, Backend::CUDA), "<disabled>");
  EXPECT_EQ(ref("ForCausalLMLoss", nn::kTraining, Backend::CPU), "<none>");
  // Mode fallback: exact, without graph, inference -> training, no mode.
  EXPECT_EQ(ref("Attention", nn::kTraining | nn::kGraph, Backend::CUDA), "acme/attn:Graphable");
  EXPECT_EQ(ref("Attention", nn::kTraining, Backend::CUDA), "acme/attn:Eager");
  EXPECT_EQ(ref("Attention", nn::kInference, Backend::CUDA), "acme/attn:Eager");
  EXPECT_EQ(ref("Attention", nn::kInference | nn::kGraph, Backend::CUDA), "acme/attn:Graphable");
  EXPECT_EQ(ref("LayerNorm", nn::kTraining, Backend::CUDA), "<none>");
  std::string why;
  c.select("ForCausalLMLoss", nn::kInference, Backend::CUDA, 0, 0, &why);
  EXPECT_EQ(why, "kernel_mapping.ForCausalLMLoss[inference] disables it");
}

TEST(KernelConfig, BadMappingsNameTheKey) {
  auto fails = [](const char* text, const std::string& needle, bool local = false) {
    try {
      KernelConfig::parse_text(text, local);
      return ::testing::AssertionFailure() << "accepted " << text;
    } catch (const Error& e) {
      if (std::string(e.what()).find(needle) == std::string::npos)
        return ::testing::AssertionFailure() << "message '" << e.what() << "' lacks '" << needle << "'";
      return ::testing::AssertionSuccess();
    }
  };
  EXPECT_TRUE(fails(R"({"RMSNrom": "acme/norm"})", "kernel_mapping.RMSNrom: unknown layer name 'RMSNrom' (known: RMSNorm"));
  EXPECT_TRUE(fails(R"({"RMSNorm": {"tpu": "acme/norm"}})", "kernel_mapping.RMSNorm"));
  EXPECT_TRUE(fails(R"({"RMSNorm": "acme/--norm"})", "kernel_mapping.RMSNorm"));
  EXPECT_TRUE(fails(R"({"RMSNorm": 3})", "kernel_mapping.RMSNorm: expected a kernel reference"));
  EXPECT_TRUE(fails(R"({"RMSNorm": {"cuda": "acme/a", "training": "acme/b"}})", "mixes mode keys and device keys"));
  EXPECT_TRUE(fails(R"({"RMSNorm": {"cuda": {"trainng": "acme/a"}}})", "kernel_mapping.RMSNorm.cuda: unknown key 'trainng'"));
  EXPECT_TRUE(fails(R"({"RMSNorm": {"training|inference": "acme/a"}})", "unknown device 'training|inference'"));
  EXPECT_TRUE(fails(R"({"RMSNorm": "/opt/kernels/liger:LigerRMSNorm"})", "set use_local_kernel"));
  EXPECT_TRUE(fails(R"({"RMSNorm": "acme/norm"})", "use_local_kernel is set", true));
  EXPECT_TRUE(fails("[1, 2]", "expected an object"));
  EXPECT_TRUE(fails("{not json", "not JSON"));
  EXPECT_THROW(nn::LigerSwitches::parse(nlohmann::json::parse(R"({"rope": true, "ropee": false})")), Error);
  EXPECT_THROW(nn::LigerSwitches::parse(nlohmann::json::parse(R"({"cross_entropy": true})")), Error);
}

TEST(KernelConfig, LigerSwitchesMapTheirLayers) {
  const nn::LigerSwitches s = nn::LigerSwitches::parse(nlohmann::json::parse(R"({"rope": false})"));
  const KernelConfig c = nn::liger_kernel_config(s, "kernels-community/liger@^0.1");
  EXPECT_EQ(c.layers(), (std::vector<std::string>{"ForCausalLMLoss", "MLP", "RMSNorm"}));
  EXPECT_EQ(c.select("RMSNorm", nn::kTraining, hub::Backend::CUDA)->ref->text, "kernels-community/liger@^0.1:LigerRMSNorm");
}

// ---- kernelize ------------------------------------------------------------------------------------

// A toy model: three RMSNorm slots.
struct Norms : nn::Module {
  std::vector<std::unique_ptr<nn::RMSNorm>> norms;
  void visit_slots(const std::function<void(nn::Slot&)>& fn) override {
    for (auto& n : norms) fn(*n);
  }
};

nn::KernelLoader local_loader() {
  hub::HubConfig c = hub::HubConfig::from_env();
  c.allow_all_kernels = true;  // this build's packages are unsigned
  c.enabled = true;
  c.lock_file.reset();
  c.cache_dir = std::filesystem::temp_directory_path() / "kcpp-test-kernelize-cache";
  return nn::hub_loader(std::make_shared<hub::Hub>(std::move(c)));
}

class Kernelize : public ::testing::TestWithParam<Device> {};

TEST_P(Kernelize, SlotsTakeTheKernelFallBackAndReport) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test::test_generator();
  Norms m;
  for (int i = 0; i < 3; ++i)
    m.norms.push_back(std::make_unique<nn::RMSNorm>(Tensor::randn({64}, DType::f32, dev, gen)));
  const std::string liger = test::built_package_dir("liger").string();
  const KernelConfig config = KernelConfig::parse(
      nlohmann::json{{"RMSNorm", liger + ":LigerRMSNorm"}, {"SiLU", liger}}, /*use_local_kernel=*/true);
  const nn::KernelizeReport r = m.kernelize(config, nn::kTraining, dev, local_loader());
  ASSERT_EQ(r.entries.size(), 1u);
  EXPECT_EQ(r.entries[0].slots, 3);
  EXPECT_NE(r.entries[0].kernel.find("liger 0.1.0: LigerRMSNorm (RMSNorm/1)"), std::string::npos) << r.str();
  EXPECT_EQ(r.unused, std::vector<std::string>{"SiLU"});

  // Forward and backward through the kernel match the reference.
  const Tensor x = Tensor::randn({5, 64}, DType::f32, dev, gen), dy = Tensor::randn({5, 64}, DType::f32, dev, gen);
  nn::RMSNorm& n = *m.norms[0];
  nn::RMSNorm::Saved saved;
  const Tensor y = n.forward(x, &saved);
  const nn::RMSNorm::Grads g = n.backward(dy, saved);
  const auto rf = ops::rms_norm_forward(x, n.weight);
  const auto rb = ops::rms_norm_backward(dy, x, n.weight, rf.rstd);
  EXPECT_TRUE(test::close_l2(y, rf.y.to_f64_vector(), 1e-6));
  EXPECT_TRUE(test::close_l2(g.dx, rb.dx.to_f64_vector(), 1e-5));
  EXPECT_TRUE(test::close_l2(g.dweight, rb.dw.to_f64_vector(), 1e-5));
  EXPECT_EQ(n.stats().kernel_calls, 2);
  EXPECT_EQ(n.stats().fallbacks, 0);

  // A layout the kernel does not take (the last dim strided): supports() refuses, the reference runs,
  // the fallback is counted with the kernel's reason.
  const Tensor xt = Tensor::randn({64, 5}, DType::f32, dev, gen).transpose(0, 1);
  nn::RMSNorm& n1 = *m.norms[1];
  const Tensor yt = n1.forward(xt);
  EXPECT_TRUE(test::close_l2(yt, ops::rms_norm_forward(xt, n1.weight).y.to_f64_vector(), 1e-6));
  EXPECT_EQ(n1.stats().fallbacks, 1);
  EXPECT_NE(n1.stats().last_refusal.find("contiguous"), std::string::npos) << n1.stats().last_refusal;
  const std::string report = m.kernel_report();
  EXPECT_NE(report.find("fallbacks 1"), std::string::npos) << report;

  // eval() re-kernelizes in inference mode; unkernelize() goes back to the reference.
  m.eval();
  EXPECT_FALSE(m.training());
  EXPECT_TRUE(n.kernel().has_value());
  EXPECT_EQ(n.mode(), nn::kInference);
  m.unkernelize();
  EXPECT_FALSE(n.kernel().has_value());
  n.forward(x);
  EXPECT_EQ(n.stats().reference_calls, 1);
}

TEST_P(Kernelize, ConfigMistakesAreErrorsNamingTheLayer) {
  const Device dev = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  Generator gen = test::test_generator();
  Norms m;
  m.norms.push_back(std::make_unique<nn::RMSNorm>(Tensor::randn({8}, DType::f32, dev, gen)));
  const std::string liger = test::built_package_dir("liger").string();
  auto error_of = [&](const nlohmann::json& mapping) -> std::string {
    try {
      m.kernelize(KernelConfig::parse(mapping, true), nn::kTraining, dev, local_loader());
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  };
  // A kernel of another contract.
  EXPECT_NE(error_of({{"RMSNorm", liger + ":LigerGLU"}}).find("implements GLU/1, but the RMSNorm slot needs RMSNorm/1"),
            std::string::npos);
  // No such layer in the package.
  EXPECT_NE(error_of({{"RMSNorm", liger + ":NoSuchNorm"}}).find("NoSuchNorm"), std::string::npos);
  // No folder.
  EXPECT_NE(error_of({{"RMSNorm", "/nonexistent/kcpp-package:LigerRMSNorm"}}).find("kernel_mapping.RMSNorm: cannot load"),
            std::string::npos);
  // Without :Layer the package's one RMSNorm/1 layer is used.
  EXPECT_EQ(error_of({{"RMSNorm", liger}}), "");
  EXPECT_EQ(m.norms[0]->kernel()->info().name, std::string("LigerRMSNorm"));
  // Disabled explicitly: the reference, with the reason.
  const auto r = m.kernelize(KernelConfig::parse({{"RMSNorm", ""}}, true), nn::kTraining, dev, local_loader());
  EXPECT_FALSE(m.norms[0]->kernel().has_value());
  EXPECT_EQ(r.entries[0].reason, "kernel_mapping.RMSNorm disables it");
}

INSTANTIATE_TEST_SUITE_P(Devices, Kernelize, ::testing::Values(Device::cpu(), Device::cuda(0)),
                         [](const auto& info) { return info.param.is_cpu() ? std::string("cpu") : std::string("cuda"); });

}  // namespace
}  // namespace kcpp
