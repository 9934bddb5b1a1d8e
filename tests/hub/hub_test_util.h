// Helpers of the hub tests: error-message assertions, temporary folders, the fixtures' paths.
#pragma once

#include <gtest/gtest.h>

#include <filesystem>
#include <cstdlib>
#include <functional>
#include <string>

namespace kcpp::test {

// f() throws a std::exception whose message contains `needle`.
inline ::testing::AssertionResult throws_with(const std::function<void()>& f, const std::string& needle) {
  try {
    f();
  } catch (const std::exception& e) {
    if (std::string(e.what()).find(needle) != std::string::npos) return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure() << "threw \"" << e.what() << "\", which does not contain \"" << needle << "\"";
  }
  return ::testing::AssertionFailure() << "did not throw (expected an error containing \"" << needle << "\")";
}

// A fresh folder removed at destruction.
class TempDir {
 public:
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "kcpp-test-XXXXXX").string();
    path_ = ::mkdtemp(tmpl.data());
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

// Built by CMake next to the tests (see tests/hub/CMakeLists.txt); the environment variable of the
// same name overrides each path (scripts/device-check.sh runs the tests from a packed copy).
inline std::filesystem::path fixture(const char* env, const char* built) {
  const char* v = std::getenv(env);
  return v && *v ? v : built;
}
inline std::filesystem::path example_package_dir() {
  return fixture("KCPP_EXAMPLE_PACKAGE_DIR", KCPP_EXAMPLE_PACKAGE_DIR);
}
inline std::filesystem::path abi99_library() { return fixture("KCPP_EXAMPLE_ABI99_LIBRARY", KCPP_EXAMPLE_ABI99_LIBRARY); }
inline std::filesystem::path no_symbol_library() { return fixture("KCPP_NO_SYMBOL_LIBRARY", KCPP_NO_SYMBOL_LIBRARY); }
inline std::filesystem::path kcpp_binary() { return fixture("KCPP_BINARY", KCPP_BINARY); }

}  // namespace kcpp::test
