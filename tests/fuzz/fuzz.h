// What every fuzz target shares: the input as text, a file holding it for the parsers that read
// paths, and the property checks.
//
// A parser answers bad input with a kcpp::Error (each target catches it: that is the expected
// outcome).  Anything else is a finding: a crash, a sanitizer report, any other exception escaping
// (std::terminate), an allocation past libFuzzer's -malloc_limit_mb, a hang, or a broken property
// checked with KCPP_FUZZ_EXPECT.
#pragma once

#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <string_view>

#include "core/error.h"

// Aborts with a message when a property the parser promises does not hold.
#define KCPP_FUZZ_EXPECT(cond, ...)                                     \
  do {                                                                  \
    if (!(cond)) {                                                      \
      std::fprintf(stderr, "fuzz property failed: %s\n  ", #cond);      \
      std::fprintf(stderr, "%s\n", ::fmt::format(__VA_ARGS__).c_str()); \
      std::abort();                                                     \
    }                                                                   \
  } while (0)

namespace kcpp::fuzz {

inline std::string_view text(const uint8_t* data, size_t size) { return {reinterpret_cast<const char*>(data), size}; }

// An in-memory file (memfd) rewritten with each input, for parsers that take a path: no disk I/O,
// nothing left behind.
class MemFile {
 public:
  MemFile() : fd_(::memfd_create("kcpp-fuzz", MFD_CLOEXEC)) {
    if (fd_ < 0) std::perror("memfd_create"), std::abort();
    path_ = "/proc/self/fd/" + std::to_string(fd_);
  }
  const std::string& write(std::string_view bytes) {
    if (::ftruncate(fd_, 0) != 0 || ::pwrite(fd_, bytes.data(), bytes.size(), 0) != static_cast<ssize_t>(bytes.size()))
      std::perror("memfd write"), std::abort();
    return path_;
  }

 private:
  int fd_;
  std::string path_;
};

// A folder of the fuzzer's own under $TMPDIR (kcpp-fuzz-<name>-XXXXXX), for parsers that read a
// folder; removed when the fuzzer exits (a crash leaves it).
struct TempFolder {
  std::filesystem::path path;
  explicit TempFolder(const std::string& name) {
    std::string tmpl = (std::filesystem::temp_directory_path() / ("kcpp-fuzz-" + name + "-XXXXXX")).string();
    if (!::mkdtemp(tmpl.data())) std::perror("mkdtemp"), std::abort();
    path = tmpl;
  }
  TempFolder(const TempFolder&) = delete;
  TempFolder& operator=(const TempFolder&) = delete;
  ~TempFolder() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
};

}  // namespace kcpp::fuzz
