#include "built_packages.h"

#include <cstdlib>
#include <filesystem>
#include <map>
#include <mutex>

#include "core/device.h"
#include "core/error.h"

namespace kcpp::test {

std::shared_ptr<const hub::LoadedPackage> built_package(const std::string& name) {
  static std::mutex mu;
  static std::map<std::string, std::shared_ptr<const hub::LoadedPackage>> loaded;
  std::lock_guard lock(mu);
  if (auto it = loaded.find(name); it != loaded.end()) return it->second;
  const char* env = std::getenv("KCPP_PACKAGES_DIR");
  const std::filesystem::path root = std::filesystem::path(env && *env ? env : KCPP_PACKAGES_DIR_DEFAULT) / name / "build";
  std::filesystem::path cpu, gpu;
  if (std::filesystem::is_directory(root))
    for (const auto& e : std::filesystem::directory_iterator(root)) {
      const std::string v = e.path().filename().string();
      if (v.starts_with("kcpp1-cpu-")) cpu = e.path();
      if (v.starts_with("kcpp1-cu")) gpu = e.path();
    }
  const std::filesystem::path dir = !gpu.empty() && cuda_device_count() > 0 ? gpu : cpu;
  KCPP_CHECK(!dir.empty(), "no built variant of package '{}' under {} (build it, or set KCPP_PACKAGES_DIR)", name,
             root.string());
  auto p = hub::LoadedPackage::open_file(dir / ("lib" + name + ".so"));
  loaded[name] = p;
  return p;
}

}  // namespace kcpp::test
