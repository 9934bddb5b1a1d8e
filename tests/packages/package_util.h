// Loading this build's kernel packages in tests, and calling their layers through the ABI exactly as
// a host does (nn/kernel_call.h).
#pragma once

#include <gtest/gtest.h>

#include <memory>
#include <string>

#include "hub/package.h"
#include "nn/kernel_call.h"

namespace kcpp::test {

// The package `name` as kcpp_add_package built it (KCPP_PACKAGES_DIR overrides where, for a build
// folder moved to another machine): the CUDA variant when this machine has a GPU and that variant
// was built, else the CPU variant.  Loaded once per process.
std::shared_ptr<const hub::LoadedPackage> built_package(const std::string& name);

// Mode bits of a training call (what the runtime passes while training).
constexpr uint32_t kTraining = KCPP_MODE_TRAINING;
constexpr uint32_t kInference = KCPP_MODE_INFERENCE;

// The status and message of an entry point, for tests of refusals.
::testing::AssertionResult refused(const nn::KernelStatus& s, kcpp_status expect, const std::string& needle);

}  // namespace kcpp::test
