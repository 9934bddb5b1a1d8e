// Loading this build's kernel packages in tests, and calling their layers through the ABI exactly as
// a host does (nn/kernel_call.h).
#pragma once

#include <gtest/gtest.h>

#include <memory>
#include <string>

#include "built_packages.h"
#include "nn/kernel_call.h"

namespace kcpp::test {

// Mode bits of a training call (what the runtime passes while training).
constexpr uint32_t kTraining = KCPP_MODE_TRAINING;
constexpr uint32_t kInference = KCPP_MODE_INFERENCE;

// The status and message of an entry point, for tests of refusals.
::testing::AssertionResult refused(const nn::KernelStatus& s, kcpp_status expect, const std::string& needle);

}  // namespace kcpp::test
