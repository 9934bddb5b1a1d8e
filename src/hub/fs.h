// File-system helpers the hub needs: whole-file reads, atomic writes, advisory file locks, and the
// check that a path from a manifest or a server stays inside its folder.
#pragma once

#include <chrono>
#include <filesystem>
#include <memory>
#include <string>
#include <string_view>

namespace kcpp::hub {

std::string read_file(const std::filesystem::path& path);  // throws naming the file

// Writes all of `data` to `fd` (retrying short writes and EINTR); 0, or the errno of the failure.
int write_all(int fd, std::string_view data);

// Writes to a temporary file next to `path`, fsyncs it and renames it over `path`, so readers see
// the old content or the new, never a part.  Creates the parent folders.
void write_file_atomic(const std::filesystem::path& path, std::string_view content, unsigned mode = 0644);

// A relative path of '/'-separated names, none empty, "." or "..", no backslash or NUL, not
// absolute: "" when fine, else why not.
std::string relative_path_problem(std::string_view path);

// An exclusive advisory lock (flock) on `path` (created if missing), held until destruction.  Waits
// at most `timeout`; throws saying who to blame when it cannot get the lock in time.
class FileLock {
 public:
  explicit FileLock(const std::filesystem::path& path,
                    std::chrono::milliseconds timeout = std::chrono::minutes(10));
  // The lock if it is free now, else nullptr (someone holds it; never waits).
  static std::unique_ptr<FileLock> try_lock(const std::filesystem::path& path);
  ~FileLock();
  FileLock(const FileLock&) = delete;
  FileLock& operator=(const FileLock&) = delete;

 private:
  FileLock() = default;
  int fd_ = -1;
};

// Truthy environment values: 1, ON, YES, TRUE (any case); falsy: 0, OFF, NO, FALSE.
bool env_flag(const char* name, bool fallback);
std::string env_or(const char* name, std::string fallback);

}  // namespace kcpp::hub
