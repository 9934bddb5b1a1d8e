// A program built against an installed kcpp (find_package(kcpp), kcpp::kcpp): a tensor, a reference
// op, and the installation's liger package loaded by its path through the hub, its LigerRMSNorm
// kernel named in a kernel_mapping and swapped into an RMSNorm slot.  Prints what the slot got and
// how far the kernel is from the reference; exits 1 on any disagreement.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/random.h"
#include "core/tensor.h"
#include "hub/hub.h"
#include "nn/kernel_config.h"
#include "nn/layers.h"
#include "nn/module.h"
#include "ops/nn/rms_norm.h"

namespace {

struct OneNorm : kcpp::nn::Module {
  explicit OneNorm(kcpp::Tensor weight) : norm(std::move(weight)) {}
  void visit_slots(const std::function<void(kcpp::nn::Slot&)>& fn) override { fn(norm); }
  kcpp::nn::RMSNorm norm;
};

}  // namespace

int main() {
  using namespace kcpp;
  try {
    Generator gen(2024);
    const Tensor x = Tensor::randn({8, 256}, DType::f32, Device::cpu(), gen);
    const Tensor w = Tensor::randn({256}, DType::f32, Device::cpu(), gen);
    const Tensor reference = ops::rms_norm_forward(x, w).y;

    hub::HubConfig hc = hub::HubConfig::from_env();
    hc.enabled = true;
    hc.allow_all_kernels = true;  // the installation's own packages are unsigned
    hc.lock_file.reset();
    const std::string liger = (std::filesystem::path(KCPP_PACKAGES_DIR) / "liger").string();
    const nn::KernelConfig config =
        nn::KernelConfig::parse(nlohmann::json{{"RMSNorm", liger + ":LigerRMSNorm"}}, /*use_local_kernel=*/true);
    OneNorm model(w);
    const nn::KernelizeReport report =
        model.kernelize(config, nn::kInference, Device::cpu(), nn::hub_loader(std::make_shared<hub::Hub>(hc)));
    const Tensor y = model.norm.forward(x);

    const std::vector<double> a = y.to_f64_vector(), b = reference.to_f64_vector();
    double diff = 0;
    for (size_t i = 0; i < a.size(); ++i) diff = std::max(diff, std::abs(a[i] - b[i]));
    const bool ok = model.norm.stats().kernel_calls == 1 && diff < 1e-4;
    std::printf("%s", report.str().c_str());
    std::printf("RMSNorm [8, 256]: kernel calls %lld, max |kernel - reference| %.3g: %s\n",
                static_cast<long long>(model.norm.stats().kernel_calls), diff, ok ? "ok" : "MISMATCH");
    return ok ? 0 : 1;
  } catch (const Error& e) {
    std::fprintf(stderr, "kcpp_consumer: %s\n", e.what());
    return 1;
  }
}
