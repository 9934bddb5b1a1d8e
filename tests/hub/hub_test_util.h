// Helpers of the hub tests: error-message assertions, temporary folders, the fixtures' paths.
#pragma once

#include <gtest/gtest.h>

#include <filesystem>
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

// Built by CMake next to the tests (see tests/hub/CMakeLists.txt).
inline std::filesystem::path example_package_dir() { return KCPP_EXAMPLE_PACKAGE_DIR; }
inline std::filesystem::path abi99_library() { return KCPP_EXAMPLE_ABI99_LIBRARY; }
inline std::filesystem::path no_symbol_library() { return KCPP_NO_SYMBOL_LIBRARY; }
inline std::filesystem::path kcpp_binary() { return KCPP_BINARY; }

}  // namespace kcpp::test
