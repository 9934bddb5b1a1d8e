#include "hub/package.h"

#include <dlfcn.h>
#include <elf.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <cstring>
#include <set>

#include "core/error.h"
#include "hub/fs.h"

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

std::string elf_problem(std::string_view image) {
  // dlopen trusts the file's structure: a truncated library can make the loader fault on a page
  // past the end of the file instead of failing.  So every range the loader will read is checked.
  Elf64_Ehdr eh;
  if (image.size() < sizeof eh || std::memcmp(image.data(), ELFMAG, SELFMAG) != 0) return "not an ELF shared object";
  std::memcpy(&eh, image.data(), sizeof eh);
  if (eh.e_ident[EI_CLASS] != ELFCLASS64) return "not a 64-bit ELF object";
  if (eh.e_ident[EI_DATA] != ELFDATA2LSB) return "not a little-endian ELF object";
  if (eh.e_type != ET_DYN) return "not a shared object (ELF type is not ET_DYN)";
#if defined(__x86_64__)
  if (eh.e_machine != EM_X86_64) return fmt::format("built for another CPU (ELF machine {}), this is x86_64", eh.e_machine);
#elif defined(__aarch64__)
  if (eh.e_machine != EM_AARCH64) return fmt::format("built for another CPU (ELF machine {}), this is aarch64", eh.e_machine);
#endif
  const uint64_t size = image.size();
  auto fits = [&](uint64_t off, uint64_t len) { return off <= size && len <= size - off; };
  if (eh.e_phentsize != sizeof(Elf64_Phdr) || eh.e_phnum == 0 ||
      !fits(eh.e_phoff, uint64_t{eh.e_phnum} * sizeof(Elf64_Phdr)))
    return "truncated or malformed (program headers)";
  for (int i = 0; i < eh.e_phnum; ++i) {
    Elf64_Phdr ph;
    std::memcpy(&ph, image.data() + eh.e_phoff + i * sizeof ph, sizeof ph);
    if (!fits(ph.p_offset, ph.p_filesz))
      return fmt::format("truncated: segment {} needs bytes up to {}, the file has {}", i, ph.p_offset + ph.p_filesz,
                         size);
  }
  if (eh.e_shnum > 0 && (eh.e_shentsize != sizeof(Elf64_Shdr) || !fits(eh.e_shoff, uint64_t{eh.e_shnum} * sizeof(Elf64_Shdr))))
    return "truncated or malformed (section headers)";
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
  if (auto problem = elf_problem(image); !problem.empty())
    KCPP_FAIL("{}: cannot load the library: {}", origin, problem);
  const int fd = ::memfd_create("kcpp-package", MFD_CLOEXEC);
  if (fd < 0) KCPP_FAIL("{}: memfd_create failed: {}", origin, std::strerror(errno));
  if (const int err = write_all(fd, image)) {
    ::close(fd);
    KCPP_FAIL("{}: cannot stage the library in memory: {}", origin, std::strerror(err));
  }
  // The fd stays open as long as the library is loaded.  dlopen knows a library by its path, and
  // /proc/self/fd/N is reused with the number: closed after the load, the next package staged here
  // would get the same path, and dlopen would hand back the first library instead of loading it.
  std::shared_ptr<LoadedPackage> p;
  try {
    p = open_path("/proc/self/fd/" + std::to_string(fd), std::move(origin));
  } catch (...) {
    ::close(fd);
    throw;
  }
  p->fd_ = fd;
  return p;
}

std::shared_ptr<LoadedPackage> LoadedPackage::open_file(const std::filesystem::path& path) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) KCPP_FAIL("{}: cannot load the library: no such file", path.string());
  return open_image(read_file(path), path.string());
}

LoadedPackage::~LoadedPackage() {
  if (handle_) ::dlclose(handle_);
  if (fd_ >= 0) ::close(fd_);
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
