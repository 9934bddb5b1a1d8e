#include "built_packages.h"

#include <cstdlib>
#include <filesystem>
#include <map>
#include <mutex>

#include "core/device.h"
#include "core/error.h"

namespace kcpp::test {

std::filesystem::path built_package_dir(const std::string& name) {
  const char* env = std::getenv("KCPP_PACKAGES_DIR");
  return std::filesystem::absolute(std::filesystem::path(env && *env ? env : KCPP_PACKAGES_DIR_DEFAULT) / name);
}

std::shared_ptr<const hub::LoadedPackage> built_package(const std::string& name) {
  static std::mutex mu;
  static std::map<std::string, std::shared_ptr<const hub::LoadedPackage>> loaded;
  std::lock_guard lock(mu);
  if (auto it = loaded.find(name); it != loaded.end()) return it->second;
  const std::filesystem::path root = built_package_dir(name) / "build";
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
