#include "hub/package.h"

#include <dlfcn.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <cstring>
#include <set>

#include "core/error.h"

namespace kcpp::hub {

std::pair<std::string, int> parse_contract(std::string_view c) {
  const size_t slash = c.find('/');
  int v = 0;
  if (slash == std::string_view::npos || slash == 0 || slash + 1 == c.size())
    KCPP_FAIL("bad layer contract '{}': expected Name/version, e.g. RMSNorm/1", c);
  const std::string_view num = c.substr(slash + 1);
  auto [p, ec] = std::from_chars(num.data(), num.data() + num.size(), v);
  if (ec != std::errc() || p != num.data() + num.size() || v < 1)
    KCPP_FAIL("bad layer contract '{}': the version must be a positive integer", c);
  for (char ch : c.substr(0, slash))
    if (!std::isalnum(static_cast<unsigned char>(ch)) && ch != '_')
      KCPP_FAIL("bad layer contract '{}': the name must be an identifier", c);
  return {std::string(c.substr(0, slash)), v};
}

std::string package_table_problem(const kcpp_package* t) {
  if (!t) return "kcpp_package_v1() returned NULL";
  if (t->abi_version != KCPP_ABI_VERSION)
    return fmt::format("built for ABI version {}, this host speaks ABI version {}", t->abi_version, KCPP_ABI_VERSION);
  if (t->struct_size < sizeof(kcpp_package))
    return fmt::format("package table of {} bytes, ABI 1 needs {}", t->struct_size, sizeof(kcpp_package));
  if (!t->name || !*t->name) return "the package has no name";
  if (!t->version || !*t->version) return "the package has no version";
  if (t->num_layers < 0 || t->num_ops < 0) return "negative layer or op count";
  if (t->num_layers > 0 && !t->layers) return "num_layers > 0 but no layer table";
  if (t->num_ops > 0 && !t->ops) return "num_ops > 0 but no op table";
  std::set<std::string> names;
  for (int32_t i = 0; i < t->num_layers; ++i) {
    const kcpp_layer& l = t->layers[i];
    const std::string id = l.name ? fmt::format("layer '{}'", l.name) : fmt::format("layer #{}", i);
    if (l.struct_size < sizeof(kcpp_layer)) return id + ": struct_size smaller than ABI 1's kcpp_layer";
    if (!l.name || !*l.name) return id + ": no name";
    if (!names.insert(l.name).second) return id + ": defined twice";
    if (!l.contract) return id + ": no contract";
    try {
      parse_contract(l.contract);
    } catch (const Error& e) {
      return id + ": " + e.what();
    }
    if (!(l.modes & (KCPP_MODE_INFERENCE | KCPP_MODE_TRAINING))) return id + ": fit for neither inference nor training";
    if (l.modes & ~(KCPP_MODE_INFERENCE | KCPP_MODE_TRAINING | KCPP_MODE_GRAPH)) return id + ": unknown mode bits";
    if (!l.devices) return id + ": runs on no device";
    if (!l.forward) return id + ": no forward";
    if ((l.modes & KCPP_MODE_TRAINING) && !l.backward) return id + ": claims training but has no backward";
  }
  names.clear();
  for (int32_t i = 0; i < t->num_ops; ++i) {
    const kcpp_op& o = t->ops[i];
    const std::string id = o.name ? fmt::format("op '{}'", o.name) : fmt::format("op #{}", i);
    if (o.struct_size < sizeof(kcpp_op)) return id + ": struct_size smaller than ABI 1's kcpp_op";
    if (!o.name || !*o.name) return id + ": no name";
    if (!names.insert(o.name).second) return id + ": defined twice";
    if (!o.call) return id + ": no entry point";
    if (!o.devices) return id + ": runs on no device";
  }
  return "";
}

std::shared_ptr<LoadedPackage> LoadedPackage::open_path(const std::string& path, std::string origin) {
  std::shared_ptr<LoadedPackage> p(new LoadedPackage());
  p->origin_ = std::move(origin);
  dlerror();
  p->handle_ = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!p->handle_) {
    const char* e = dlerror();
    KCPP_FAIL("{}: cannot load the library: {}", p->origin_, e ? e : "unknown dlopen error");
  }
  dlerror();
  void* sym = ::dlsym(p->handle_, KCPP_PACKAGE_SYMBOL_V1);
  if (!sym) KCPP_FAIL("{}: not a kcpp package: it does not export {}", p->origin_, KCPP_PACKAGE_SYMBOL_V1);
  const auto fn = reinterpret_cast<kcpp_package_v1_fn>(sym);
  p->table_ = fn();
  if (auto problem = package_table_problem(p->table_); !problem.empty()) KCPP_FAIL("{}: {}", p->origin_, problem);
  return p;
}

std::shared_ptr<LoadedPackage> LoadedPackage::open_image(std::string_view image, std::string origin) {
  if (image.size() < 4 || std::memcmp(image.data(), "\x7f" "ELF", 4) != 0)
    KCPP_FAIL("{}: cannot load the library: not an ELF shared object", origin);
  const int fd = ::memfd_create("kcpp-package", MFD_CLOEXEC);
  if (fd < 0) KCPP_FAIL("{}: memfd_create failed: {}", origin, std::strerror(errno));
  size_t done = 0;
  while (done < image.size()) {
    const ssize_t n = ::write(fd, image.data() + done, image.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = errno;
      ::close(fd);
      KCPP_FAIL("{}: cannot stage the library in memory: {}", origin, std::strerror(err));
    }
    done += static_cast<size_t>(n);
  }
  // The fd stays open until dlopen has mapped it; the mapping keeps the memory alive afterwards.
  std::shared_ptr<LoadedPackage> p;
  try {
    p = open_path("/proc/self/fd/" + std::to_string(fd), std::move(origin));
  } catch (...) {
    ::close(fd);
    throw;
  }
  ::close(fd);
  return p;
}

std::shared_ptr<LoadedPackage> LoadedPackage::open_file(const std::filesystem::path& path) {
  return open_path(std::filesystem::absolute(path).string(), path.string());
}

LoadedPackage::~LoadedPackage() {
  if (handle_) ::dlclose(handle_);
}

const kcpp_layer* LoadedPackage::layer(std::string_view name) const {
  for (int32_t i = 0; i < table_->num_layers; ++i)
    if (name == table_->layers[i].name) return &table_->layers[i];
  return nullptr;
}

const kcpp_layer* LoadedPackage::layer_by_contract(std::string_view contract) const {
  for (int32_t i = 0; i < table_->num_layers; ++i)
    if (contract == table_->layers[i].contract) return &table_->layers[i];
  return nullptr;
}

const kcpp_op* LoadedPackage::op(std::string_view name) const {
  for (int32_t i = 0; i < table_->num_ops; ++i)
    if (name == table_->ops[i].name) return &table_->ops[i];
  return nullptr;
}

}  // namespace kcpp::hub
