// A loaded kernel package: the shared library, its ABI table checked, and lookups by name.
//
// Verified loads go through open_image(): the bytes whose sha256 was just checked are copied into
// an anonymous memory file (memfd) and that is what dlopen maps, so a file changed on disk after
// the check can never be the code that runs.  A package library must therefore be self-contained:
// it may depend on system and GPU-runtime libraries, not on other files of its folder ($ORIGIN).
// dlopen uses RTLD_NOW (unresolved symbols fail the load, not a later call) and RTLD_LOCAL (the
// package's symbols never leak into the host or into other packages).  The library is unloaded
// (dlclose) when the last shared_ptr to it goes.
#pragma once

#include <filesystem>
#include <memory>
#include <string>
#include <string_view>

#include "kcpp/abi.h"

namespace kcpp::hub {

class LoadedPackage {
 public:
  // `image`: the library's verified bytes; `origin`: how messages name it ("acme/example@v1.0.0
  // (kcpp1-cpu-x86_64-linux)").  Throws kcpp::Error: not a loadable library, no kcpp_package_v1,
  // wrong ABI version, a malformed table.
  static std::shared_ptr<LoadedPackage> open_image(std::string_view image, std::string origin);
  // Loads a file as it is (its bytes, through the same memfd path), unverified: for `kcpp package
  // index` and tests only.
  static std::shared_ptr<LoadedPackage> open_file(const std::filesystem::path& path);

  ~LoadedPackage();
  LoadedPackage(const LoadedPackage&) = delete;
  LoadedPackage& operator=(const LoadedPackage&) = delete;

  const kcpp_package& table() const { return *table_; }
  const std::string& origin() const { return origin_; }
  const kcpp_layer* layer(std::string_view name) const;          // nullptr if absent
  const kcpp_layer* layer_by_contract(std::string_view contract) const;
  const kcpp_op* op(std::string_view name) const;

 private:
  LoadedPackage() = default;
  static std::shared_ptr<LoadedPackage> open_path(const std::string& path, std::string origin);
  void* handle_ = nullptr;
  int fd_ = -1;  // the memfd dlopen mapped (its /proc/self/fd path names the library while loaded)
  const kcpp_package* table_ = nullptr;
  std::string origin_;
};

// Why `image` is not a complete shared object for this CPU that dlopen can map safely, or "".
std::string elf_problem(std::string_view image);

// Why `t` is not a valid ABI-1 package table, or "" when it is.
std::string package_table_problem(const kcpp_package* t);

// "RMSNorm/1" -> ("RMSNorm", 1); throws for anything else.
std::pair<std::string, int> parse_contract(std::string_view contract);

}  // namespace kcpp::hub
