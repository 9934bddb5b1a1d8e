#include "core/files.h"

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "core/error.h"

namespace kcpp {

void check_readable_file(const std::filesystem::path& path, std::string_view what) {
  std::error_code ec;
  const auto status = std::filesystem::status(path, ec);
  KCPP_CHECK(std::filesystem::exists(status), "{} {} does not exist", what, path.string());
  KCPP_CHECK(!std::filesystem::is_directory(status), "{} {} is a folder, not a file", what, path.string());
}

std::string read_whole_file(const std::filesystem::path& path, std::string_view what) {
  check_readable_file(path, what);
  std::ifstream in(path, std::ios::binary);
  KCPP_CHECK(in.good(), "{} {}: cannot open it: {}", what, path.string(), std::strerror(errno));
  std::ostringstream ss;
  ss << in.rdbuf();
  KCPP_CHECK(!in.bad(), "{} {}: cannot read it: {}", what, path.string(), std::strerror(errno));
  return ss.str();
}

}  // namespace kcpp
