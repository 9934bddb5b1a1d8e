// Mamba and Falcon-Mamba (models/mamba.h) kernelized with this build's `mamba` package, loaded
// through the hub from its local folder: every scan and convolution slot runs the kernel (no
// fallback), and the logits, loss, gradients and greedy generation (its steps eager, then as a CUDA
// graph) still match Transformers' fixtures (tests/fixtures/mamba, falcon_mamba) within 1e-5 relative
// in f32.
#include <nlohmann/json.hpp>

#include "hub/hub.h"
#include "models/mamba.h"
#include "models/safetensors.h"
#include "nn/kernel_config.h"
#include "package_util.h"
#include "test_util.h"

namespace kcpp {
namespace {

namespace fs = std::filesystem;

nn::KernelLoader local_loader() {
  hub::HubConfig c = hub::HubConfig::from_env();
  c.allow_all_kernels = true;  // this build's packages are unsigned
  c.enabled = true;
  c.lock_file.reset();
  c.cache_dir = fs::temp_directory_path() / "kcpp-test-kernelize-cache";
  return nn::hub_loader(std::make_shared<hub::Hub>(std::move(c)));
}

struct Case {
  const char* family;
  Device device;
};

class MambaKernelized : public ::testing::TestWithParam<Case> {};

TEST_P(MambaKernelized, MatchesTransformersWithTheKernels) {
  const auto [family, dev] = GetParam();
  KCPP_REQUIRE_DEVICE(dev);
  const fs::path dir = fs::path(test::fixtures_dir()) / family;
  const auto model = models::MambaLM::from_folder(dir, DType::f32, dev);
  const std::string pkg = test::built_package_dir("mamba").string();
  nlohmann::json mapping;
  for (const char* layer : {"SelectiveScan", "SelectiveStateUpdate", "CausalConv1d", "CausalConv1dUpdate"})
    mapping[layer] = pkg + ":" + layer;
  const nn::KernelizeReport report = model->kernelize(nn::KernelConfig::parse(mapping, true), nn::kTraining, dev, local_loader());
  const models::SafetensorsFile e = models::SafetensorsFile::open(dir / "expected.safetensors");
  const Tensor ids = e.view("input_ids").to(dev), labels = e.view("labels").to(dev);

  EXPECT_TRUE(test::close_l2(model->forward(ids), e.view("logits").to_f64_vector(), 1e-5));
  const auto r = model->loss_and_gradients(ids, labels);
  EXPECT_TRUE(test::close_l2(r.loss, e.view("loss").to_f64_vector(), 1e-5));
  size_t expected = 0;
  for (const auto& [name, entry] : e.entries()) {
    if (name.rfind("grad.", 0) != 0) continue;
    ++expected;
    const auto it = r.grads.find(name.substr(5));
    ASSERT_NE(it, r.grads.end()) << name;
    EXPECT_TRUE(test::close_l2(it->second, e.view(name).to_f64_vector(), 1e-5)) << name;
  }
  EXPECT_EQ(r.grads.size(), expected);

  // Decoding (inference mode): the update slots run their kernels too.
  model->eval();
  std::vector<int64_t> prompt;
  for (double x : e.view("greedy.prompt").to_f64_vector()) prompt.push_back(static_cast<int64_t>(x));
  const auto want = e.view("greedy.ids").to_f64_vector();
  const std::vector<int64_t> none;
  {
    const test::ScopedEnv eager("KCPP_DECODE_GRAPHS", "0");
    models::CausalLM::GenerationStats st;
    const auto got = model->generate(prompt, static_cast<int64_t>(want.size() - prompt.size()), models::Sampling(), &none,
                                     nullptr, &st);
    EXPECT_EQ(std::vector<double>(got.begin(), got.end()), want);
    EXPECT_EQ(st.graph_replays, 0);
  }
  // By default the one-token steps run as a CUDA graph: the same ids, and on CUDA every step after the
  // second a replay.
  {
    const test::ScopedEnv graphs("KCPP_DECODE_GRAPHS", nullptr);
    const auto steps = static_cast<int64_t>(want.size() - prompt.size());
    models::CausalLM::GenerationStats st;
    const auto again = model->generate(prompt, steps, models::Sampling(), &none, nullptr, &st);
    EXPECT_EQ(std::vector<double>(again.begin(), again.end()), want);
    EXPECT_EQ(st.graph_replays, dev.is_cuda() ? std::max<int64_t>(steps - 2, 0) : 0);
    // Three prompts decoded together (one graph for the three rows): the greedy prompt's row makes
    // the same ids, the others what they make alone.
    const std::vector<std::vector<int64_t>> prompts = {{5, 6}, prompt, {9, 8, 7, 6, 5, 4}};
    const auto batch = model->generate_batch(prompts, steps, models::Sampling(), &none, {}, &st);
    EXPECT_EQ(std::vector<double>(batch[1].ids.begin(), batch[1].ids.end()), want);
    for (size_t i : {size_t{0}, size_t{2}}) EXPECT_EQ(batch[i].ids, model->generate(prompts[i], steps, models::Sampling(), &none));
    EXPECT_EQ(st.graph_replays, dev.is_cuda() ? std::max<int64_t>(steps - 2, 0) : 0);
  }

  int slots = 0;
  model->visit_slots([&](nn::Slot& s) {
    if (s.contract().rfind("RMSNorm", 0) == 0 || s.contract().rfind("ForCausalLMLoss", 0) == 0) return;
    ++slots;
    EXPECT_TRUE(s.kernel().has_value()) << s.layer_name() << ": " << s.reason() << "\n" << report.str();
    EXPECT_GT(s.stats().kernel_calls, 0) << s.layer_name();
    EXPECT_EQ(s.stats().fallbacks, 0) << s.layer_name() << ": " << s.stats().last_refusal;
  });
  EXPECT_EQ(slots, 8);  // 4 per layer, 2 layers
}

INSTANTIATE_TEST_SUITE_P(Fixtures, MambaKernelized,
                         ::testing::Values(Case{"mamba", Device::cpu()}, Case{"falcon_mamba", Device::cpu()},
                                           Case{"mamba", Device::cuda(0)}, Case{"falcon_mamba", Device::cuda(0)}),
                         [](const auto& info) {
                           return std::string(info.param.family) + (info.param.device.is_cpu() ? "_cpu" : "_cuda");
                         });

}  // namespace
}  // namespace kcpp
