// This build's kernel packages, loaded as a host loads them (for tests and benchmarks).
#pragma once

#include <filesystem>
#include <memory>
#include <string>

#include "hub/package.h"

namespace kcpp::test {

// The package `name` as kcpp_add_package built it (KCPP_PACKAGES_DIR overrides where, for a build
// folder moved to another machine): the CUDA variant when this machine has a GPU and that variant
// was built, else the CPU variant.  Loaded once per process; throws kcpp::Error when not built.
std::shared_ptr<const hub::LoadedPackage> built_package(const std::string& name);
// The folder of the built package `name` (manifest.json + build/), what a local reference names.
std::filesystem::path built_package_dir(const std::string& name);

}  // namespace kcpp::test
