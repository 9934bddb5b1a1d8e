#include "hub/fs.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>
#include <thread>

#include "core/error.h"

namespace kcpp::hub {

std::string read_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) KCPP_FAIL("cannot read {}: {}", path.string(), std::strerror(errno));
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) KCPP_FAIL("error reading {}", path.string());
  return ss.str();
}

int write_all(int fd, std::string_view data) {
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t n = ::write(fd, data.data() + done, data.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return n < 0 ? errno : EIO;
    done += static_cast<size_t>(n);
  }
  return 0;
}

void write_file_atomic(const std::filesystem::path& path, std::string_view content, unsigned mode) {
  std::error_code ec;
  if (path.has_parent_path()) std::filesystem::create_directories(path.parent_path(), ec);
  std::random_device rd;
  const std::filesystem::path tmp =
      path.string() + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(rd());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, mode);
  if (fd < 0) KCPP_FAIL("cannot create {}: {}", tmp.string(), std::strerror(errno));
  if (const int err = write_all(fd, content)) {
    ::close(fd);
    ::unlink(tmp.c_str());
    KCPP_FAIL("cannot write {}: {}", tmp.string(), std::strerror(err));
  }
  ::fsync(fd);
  ::close(fd);
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    KCPP_FAIL("cannot rename {} to {}: {}", tmp.string(), path.string(), std::strerror(err));
  }
}

std::string relative_path_problem(std::string_view p) {
  if (p.empty()) return "empty path";
  if (p.find('\0') != std::string_view::npos) return "path contains a NUL character";
  if (p.find('\\') != std::string_view::npos) return fmt::format("path '{}' contains a backslash", p);
  if (p.front() == '/') return fmt::format("path '{}' is absolute", p);
  size_t start = 0;
  while (true) {
    const size_t at = p.find('/', start);
    const std::string_view part = p.substr(start, at == std::string_view::npos ? at : at - start);
    if (part.empty() || part == "." || part == "..")
      return fmt::format("path '{}' has an empty, '.' or '..' component", p);
    if (at == std::string_view::npos) break;
    start = at + 1;
  }
  return "";
}

FileLock::FileLock(const std::filesystem::path& path, std::chrono::milliseconds timeout) {
  std::error_code ec;
  if (path.has_parent_path()) std::filesystem::create_directories(path.parent_path(), ec);
  fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd_ < 0) KCPP_FAIL("cannot open lock file {}: {}", path.string(), std::strerror(errno));
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  auto wait = std::chrono::milliseconds(5);
  while (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    if (errno != EWOULDBLOCK && errno != EINTR) {
      const int err = errno;
      ::close(fd_);
      KCPP_FAIL("cannot lock {}: {}", path.string(), std::strerror(err));
    }
    if (std::chrono::steady_clock::now() > deadline) {
      ::close(fd_);
      KCPP_FAIL("timed out waiting for the lock {} (another process is downloading the same file; "
                "if none is, the lock is stale only if its holder is stuck)",
                path.string());
    }
    std::this_thread::sleep_for(wait);
    wait = std::min(wait * 2, std::chrono::milliseconds(200));
  }
}

std::unique_ptr<FileLock> FileLock::try_lock(const std::filesystem::path& path) {
  std::error_code ec;
  if (path.has_parent_path()) std::filesystem::create_directories(path.parent_path(), ec);
  std::unique_ptr<FileLock> lock(new FileLock());
  lock->fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (lock->fd_ < 0) KCPP_FAIL("cannot open lock file {}: {}", path.string(), std::strerror(errno));
  while (::flock(lock->fd_, LOCK_EX | LOCK_NB) != 0) {
    if (errno == EINTR) continue;
    if (errno == EWOULDBLOCK) return nullptr;  // the destructor closes the file
    KCPP_FAIL("cannot lock {}: {}", path.string(), std::strerror(errno));
  }
  return lock;
}

FileLock::~FileLock() {
  if (fd_ >= 0) {
    ::flock(fd_, LOCK_UN);
    ::close(fd_);
  }
}

bool env_flag(const char* name, bool fallback) {
  const char* v = std::getenv(name);
  if (!v || !*v) return fallback;
  std::string s(v);
  for (char& c : s) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  if (s == "1" || s == "ON" || s == "YES" || s == "TRUE") return true;
  if (s == "0" || s == "OFF" || s == "NO" || s == "FALSE") return false;
  return fallback;
}

std::string env_or(const char* name, std::string fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::string(v) : fallback;
}

}  // namespace kcpp::hub
