// The KernelConfig mapping text (src/nn/kernel_config.h) that `--kernels` and project files give:
// layer names, device tables, CUDA capability lists, mode keys, and the references inside; also
// the Liger switches (`--liger-kernel-config`).
//
// Input: byte 0 sets use_local_kernel, the rest is the JSON text.  A config that parses is asked
// for every layer it names, in every mode, on every device and for a few GPU capabilities: each
// answer is a reference of the kind the config allows, or a disabled entry.
#include <nlohmann/json.hpp>

#include "fuzz.h"
#include "nn/kernel_config.h"

using namespace kcpp;
using namespace kcpp::nn;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const bool use_local = data[0] & 1;
  const std::string_view text = fuzz::text(data + 1, size - 1);
  try {
    const KernelConfig c = KernelConfig::parse_text(text, use_local);
    for (const std::string& layer : c.layers())
      for (uint32_t mode : {uint32_t{kInference}, uint32_t{kTraining}, kInference | kGraph, kTraining | kGraph})
        for (hub::Backend device : {hub::Backend::CPU, hub::Backend::CUDA, hub::Backend::ROCm, hub::Backend::Metal, hub::Backend::XPU})
          for (auto [major, minor] : {std::pair{0, 0}, {8, 0}, {9, 0}, {10, 3}}) {
            std::string why;
            const auto e = c.select(layer, mode, device, major, minor, &why);
            if (e && e->ref)
              KCPP_FUZZ_EXPECT(e->ref->is_local() == use_local, "{}: a {} reference", why, e->ref->is_local() ? "local" : "hub");
          }
  } catch (const Error&) {
  }
  const nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!j.is_discarded()) {
    try {
      (void)LigerSwitches::parse(j);
    } catch (const Error&) {
    }
  }
  return 0;
}
