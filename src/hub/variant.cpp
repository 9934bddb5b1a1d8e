#include "hub/variant.h"

#include <algorithm>
#include <charconv>

#include "core/error.h"
#include "core/platform.h"

namespace kcpp::hub {
namespace {

bool all_digits(std::string_view s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
}
int to_int(std::string_view s) {
  int v = 0;
  std::from_chars(s.data(), s.data() + s.size(), v);
  return v;
}
bool lower_token(std::string_view s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_';
  });
}

}  // namespace

const char* backend_name(Backend b) {
  switch (b) {
    case Backend::CPU: return "cpu";
    case Backend::CUDA: return "cuda";
    case Backend::ROCm: return "rocm";
    case Backend::Metal: return "metal";
    case Backend::XPU: return "xpu";
  }
  return "?";
}

Backend parse_backend(std::string_view name) {
  for (Backend b : {Backend::CPU, Backend::CUDA, Backend::ROCm, Backend::Metal, Backend::XPU})
    if (name == backend_name(b)) return b;
  KCPP_FAIL("unknown device '{}' (expected cuda, rocm, metal, xpu or cpu)", name);
}

Variant Variant::parse(std::string_view name) {
  auto bad = [&](const std::string& why) {
    KCPP_FAIL("bad variant name '{}': {} (expected kcpp<ABI>-<backend>-<arch>-<os>, e.g. kcpp1-cu130-x86_64-linux)",
              name, why);
  };
  Variant v;
  v.name = std::string(name);
  // Split on '-': arch names contain '_' but never '-'.
  std::vector<std::string_view> parts;
  size_t start = 0;
  while (true) {
    const size_t at = name.find('-', start);
    parts.push_back(name.substr(start, at == std::string_view::npos ? at : at - start));
    if (at == std::string_view::npos) break;
    start = at + 1;
  }
  if (parts.size() != 4) bad(fmt::format("{} parts separated by '-', expected 4", parts.size()));
  if (!parts[0].starts_with("kcpp") || !all_digits(parts[0].substr(4))) bad("it must start with kcpp<ABI version>");
  v.abi = to_int(parts[0].substr(4));
  const std::string_view be = parts[1];
  auto version_digits = [&](std::string_view digits, int minor_digits, const char* what) {
    if (!all_digits(digits) || digits.size() <= static_cast<size_t>(minor_digits))
      bad(fmt::format("'{}': {} needs a version, like {}", be, what,
                      minor_digits == 1 ? (be[0] == 'c' ? "cu130" : "rocm70") : "xpu20253"));
    v.major = to_int(digits.substr(0, digits.size() - minor_digits));
    v.minor = to_int(digits.substr(digits.size() - minor_digits));
  };
  if (be == "cpu") v.backend = Backend::CPU;
  else if (be == "metal") v.backend = Backend::Metal;
  else if (be.starts_with("cu")) v.backend = Backend::CUDA, version_digits(be.substr(2), 1, "cuda");
  else if (be.starts_with("rocm")) v.backend = Backend::ROCm, version_digits(be.substr(4), 1, "rocm");
  else if (be.starts_with("xpu")) v.backend = Backend::XPU, version_digits(be.substr(3), 1, "xpu");
  else bad(fmt::format("unknown backend '{}' (cpu, cu<ver>, rocm<ver>, metal, xpu<ver>)", be));
  if (v.backend == Backend::XPU && v.major < 2000) bad("xpu versions are <YEAR><N>, like xpu20253");
  if (!lower_token(parts[2])) bad(fmt::format("bad CPU arch '{}'", parts[2]));
  if (!lower_token(parts[3])) bad(fmt::format("bad OS '{}'", parts[3]));
  v.arch = std::string(parts[2]);
  v.os = std::string(parts[3]);
  return v;
}

Machine Machine::detect() {
  const PlatformInfo p = detect_platform();
  Machine m;
  std::string os = p.os;
  std::transform(os.begin(), os.end(), os.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  m.os = os;
  m.arch = p.cpu_arch;
  m.cuda_driver = p.cuda_driver_version;
  for (const GpuInfo& g : p.gpus) m.gpus.push_back({g.cc_major, g.cc_minor});
  return m;
}

std::string Machine::str() const {
  std::string s = fmt::format("{} {}", os, arch);
  if (cuda_driver) s += fmt::format(", CUDA driver {}", cuda_version_str(cuda_driver));
  else s += ", no CUDA driver";
  for (const Gpu& g : gpus) s += fmt::format(", GPU sm_{}{}", g.cc_major, g.cc_minor);
  return s;
}

ArchFit cuda_arch_fit(std::string_view arch, int cc_major, int cc_minor) {
  bool sass = true, ptx = true;
  if (arch.starts_with("sm_")) arch.remove_prefix(3), ptx = false;
  else if (arch.starts_with("compute_")) arch.remove_prefix(8), sass = false;
  if (arch.ends_with("-real")) arch.remove_suffix(5), ptx = false;
  else if (arch.ends_with("-virtual")) arch.remove_suffix(8), sass = false;
  char suffix = 0;
  if (!arch.empty() && (arch.back() == 'a' || arch.back() == 'f')) suffix = arch.back(), arch.remove_suffix(1);
  if (!all_digits(arch) || arch.size() < 2) return ArchFit::None;
  const int n = to_int(arch), major = n / 10, minor = n % 10;
  const int have = cc_major * 10 + cc_minor;
  // 'a' code runs on exactly that GPU; 'f' (family) and plain SASS on the same major with a minor
  // at least as new; plain PTX is JIT-compiled for any newer GPU.
  const bool same_family = cc_major == major && cc_minor >= minor;
  if (sass && (suffix == 'a' ? (cc_major == major && cc_minor == minor) : same_family)) return ArchFit::Native;
  if (ptx && (suffix == 'a' ? (cc_major == major && cc_minor == minor) : suffix == 'f' ? same_family : have >= n))
    return ArchFit::Ptx;
  return ArchFit::None;
}

std::string VariantChoice::explain(std::string_view package, const Machine& m) const {
  std::string s = fmt::format("no build variant of {} fits this machine ({})", package, m.str());
  if (refused.empty()) s += ": the package lists no variants";
  for (const auto& [name, why] : refused) s += fmt::format("\n  {}: {}", name, why);
  return s;
}

VariantChoice select_variant(const std::vector<VariantCandidate>& variants, const Machine& m) {
  VariantChoice out;
  int best_score = -1;
  std::string best_why;
  for (const VariantCandidate& c : variants) {
    std::string why_not, why;
    int score = 0;
    Variant v;
    try {
      v = Variant::parse(c.name);
    } catch (const Error& e) {
      out.refused.emplace_back(c.name, e.what());
      continue;
    }
    if (v.abi != 1) why_not = fmt::format("built for ABI {}, this host speaks ABI 1", v.abi);
    else if (v.os != m.os) why_not = fmt::format("built for {}, this machine runs {}", v.os, m.os);
    else if (v.arch != m.arch) why_not = fmt::format("built for {} CPUs, this machine is {}", v.arch, m.arch);
    else if (v.backend == Backend::CPU) score = 1, why = "CPU build (no better GPU variant fits)";
    else if (v.backend == Backend::CUDA) {
      const int drv_major = m.cuda_driver / 1000;
      if (m.cuda_driver == 0) why_not = "needs a CUDA driver, this machine has none";
      else if (drv_major < v.major)
        why_not = fmt::format("built with CUDA {}.{}, the driver supports only CUDA {}", v.major, v.minor,
                              cuda_version_str(m.cuda_driver));
      else if (m.gpus.empty()) why_not = "needs a CUDA GPU, this machine has none";
      else if (c.cuda_archs.empty()) why_not = "the manifest lists no CUDA architectures for it";
      else {
        ArchFit fit = ArchFit::None;
        std::string fit_arch;
        for (const auto& g : m.gpus)
          for (const std::string& a : c.cuda_archs)
            if (ArchFit f = cuda_arch_fit(a, g.cc_major, g.cc_minor); f > fit) fit = f, fit_arch = a;
        if (fit == ArchFit::None) {
          std::string archs;
          for (const auto& a : c.cuda_archs) archs += (archs.empty() ? "" : ",") + a;
          why_not = fmt::format("compiled for architectures {}, none runs on this GPU (sm_{}{})", archs,
                                m.gpus[0].cc_major, m.gpus[0].cc_minor);
        } else {
          const int toolkit = v.major * 1000 + v.minor * 10;
          // Native code beats JIT; then the newest toolkit not newer than the driver.
          score = 100 + (fit == ArchFit::Native ? 50 : 0) + (toolkit <= m.cuda_driver ? 20 : 0) + v.major;
          why = fmt::format("CUDA {}.{} build with {} code for sm_{}{} ({})", v.major, v.minor,
                            fit == ArchFit::Native ? "native" : "PTX (JIT-compiled)", m.gpus[0].cc_major,
                            m.gpus[0].cc_minor, fit_arch);
        }
      }
    } else if (v.backend == Backend::ROCm) {
      why_not = m.rocm ? "" : "needs ROCm, which this machine does not have";
      if (m.rocm) score = 90, why = "ROCm build";
    } else if (v.backend == Backend::Metal) {
      why_not = m.metal ? "" : "needs Metal, which this machine does not have";
      if (m.metal) score = 90, why = "Metal build";
    } else if (v.backend == Backend::XPU) {
      why_not = m.xpu ? "" : "needs an Intel XPU runtime, which this machine does not have";
      if (m.xpu) score = 90, why = "XPU build";
    }
    if (!why_not.empty()) {
      out.refused.emplace_back(c.name, why_not);
      continue;
    }
    if (score > best_score) {
      if (!out.chosen.empty()) out.refused.emplace_back(out.chosen, "fits, but " + c.name + " fits better");
      out.chosen = c.name, best_score = score, best_why = why;
    } else {
      out.refused.emplace_back(c.name, "fits, but " + out.chosen + " fits better");
    }
  }
  out.why = best_why;
  return out;
}

std::string host_variant_name(Backend backend, int major, int minor) {
  const Machine m = Machine::detect();
  std::string be = backend_name(backend);
  if (backend == Backend::CUDA) be = fmt::format("cu{}{}", major, minor);
  if (backend == Backend::ROCm) be = fmt::format("rocm{}{}", major, minor);
  if (backend == Backend::XPU) be = fmt::format("xpu{}{}", major, minor);
  return fmt::format("kcpp1-{}-{}-{}", be, m.arch, m.os);
}

}  // namespace kcpp::hub
