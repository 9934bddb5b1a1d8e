#include "core/platform.h"

#include <sys/utsname.h>
#include <unistd.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <thread>

#include "core/allocator.h"
#include "core/cuda_runtime.h"

#ifndef KCPP_CUDA_ARCHS
#define KCPP_CUDA_ARCHS ""
#endif

namespace kcpp {

#if KCPP_WITH_CUDA
namespace detail {
int probe_kernel_image(int device, std::string& note);  // platform_cuda.cu
}
#endif

namespace {

std::string read_os_release() {
  std::ifstream f("/etc/os-release");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("PRETTY_NAME=", 0) == 0) {
      std::string v = line.substr(12);
      if (v.size() >= 2 && v.front() == '"') v = v.substr(1, v.size() - 2);
      return v;
    }
  }
  return "unknown";
}

void read_cpuinfo(PlatformInfo& p) {
  static const std::set<std::string> kInteresting = {
      "sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_fp16",
      "avx512_vnni", "amx_tile", "amx_bf16", "asimd", "asimdhp", "sve", "sve2", "bf16", "i8mm"};
  std::ifstream f("/proc/cpuinfo");
  std::string line;
  bool flags_done = false;
  while (std::getline(f, line)) {
    const auto colon = line.find(':');
    if (colon == std::string::npos) continue;
    std::string key = line.substr(0, colon);
    while (!key.empty() && (key.back() == ' ' || key.back() == '\t')) key.pop_back();
    const std::string val = colon + 2 <= line.size() ? line.substr(colon + 2) : "";
    if (p.cpu_model.empty() && (key == "model name" || key == "Model")) p.cpu_model = val;
    if (!flags_done && (key == "flags" || key == "Features")) {
      std::istringstream ss(val);
      for (std::string w; ss >> w;)
        if (kInteresting.count(w)) p.cpu_isa.push_back(w);
      flags_done = true;
    }
  }
  if (p.cpu_model.empty()) p.cpu_model = "unknown";
}

}  // namespace

std::string cuda_version_str(int v) {
  if (v <= 0) return "none";
  return fmt::format("{}.{}", v / 1000, (v % 1000) / 10);
}

PlatformInfo detect_platform() {
  PlatformInfo p;
  utsname u{};
  if (uname(&u) == 0) {
    p.os = u.sysname;
    p.os_release = u.release;
    p.cpu_arch = u.machine;
  }
  p.distribution = read_os_release();
  read_cpuinfo(p);
  p.cpu_threads = static_cast<int>(std::thread::hardware_concurrency());
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  if (pages > 0 && page > 0) p.host_memory = static_cast<size_t>(pages) * static_cast<size_t>(page);

  p.cuda_compiled = cuda_compiled();
  p.cuda_archs_compiled = KCPP_CUDA_ARCHS;
#if KCPP_WITH_CUDA
  cudaRuntimeGetVersion(&p.cuda_runtime_version);
  if (cudaDriverGetVersion(&p.cuda_driver_version) != cudaSuccess) p.cuda_driver_version = 0;
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    p.cuda_status = p.cuda_driver_version == 0 ? "no CUDA driver"
                    : e == cudaErrorNoDevice   ? "no CUDA device"
                                               : fmt::format("CUDA unavailable: {}", cudaGetErrorString(e));
    n = 0;
  } else {
    p.cuda_status = n > 0 ? "ok" : "no CUDA device";
  }
  if (p.cuda_status == "ok" && p.cuda_driver_version < p.cuda_runtime_version)
    p.cuda_status = fmt::format("driver supports CUDA {} but this build needs {}", cuda_version_str(p.cuda_driver_version),
                                cuda_version_str(p.cuda_runtime_version));
  for (int i = 0; i < n; ++i) {
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, i) != cudaSuccess) {
      (void)cudaGetLastError();
      continue;
    }
    GpuInfo g;
    g.index = i;
    g.name = prop.name;
    g.cc_major = prop.major;
    g.cc_minor = prop.minor;
    g.sm_count = prop.multiProcessorCount;
    g.total_memory = prop.totalGlobalMem;
    g.l2_bytes = static_cast<size_t>(prop.l2CacheSize);
    g.shared_memory_per_block_optin = prop.sharedMemPerBlockOptin;
    g.memory_bus_width_bits = prop.memoryBusWidth;
    g.kernel_image_arch = detail::probe_kernel_image(i, g.kernel_image_note);
    p.gpus.push_back(std::move(g));
  }
#else
  p.cuda_status = "not compiled in";
#endif
  return p;
}

std::string format_platform(const PlatformInfo& p) {
  std::string s;
  auto line = [&](std::string_view k, const std::string& v) { s += fmt::format("{:<18} {}\n", k, v); };
  line("os", fmt::format("{} {} ({})", p.os, p.os_release, p.distribution));
  line("cpu", fmt::format("{} {}, {} threads", p.cpu_arch, p.cpu_model, p.cpu_threads));
  line("cpu isa", p.cpu_isa.empty() ? "(none of note)" : fmt::format("{}", fmt::join(p.cpu_isa, " ")));
  line("host memory", format_bytes(p.host_memory));
  line("cuda compiled", p.cuda_compiled ? fmt::format("yes, architectures {}", p.cuda_archs_compiled) : "no");
  if (p.cuda_compiled) {
    line("cuda runtime", cuda_version_str(p.cuda_runtime_version));
    line("cuda driver", p.cuda_driver_version ? cuda_version_str(p.cuda_driver_version) : "none");
  }
  line("cuda status", p.cuda_status);
  for (const GpuInfo& g : p.gpus) {
    line(fmt::format("gpu {}", g.index),
         fmt::format("{}, compute capability {}.{}, {} SMs, {} memory, {} L2, {}-bit bus", g.name, g.cc_major,
                     g.cc_minor, g.sm_count, format_bytes(g.total_memory), format_bytes(g.l2_bytes),
                     g.memory_bus_width_bits));
    line("", g.kernel_image_note);
  }
  return s;
}

std::string platform_json(const PlatformInfo& p) {
  nlohmann::json j;
  j["os"] = p.os;
  j["os_release"] = p.os_release;
  j["distribution"] = p.distribution;
  j["cpu_arch"] = p.cpu_arch;
  j["cpu_model"] = p.cpu_model;
  j["cpu_threads"] = p.cpu_threads;
  j["cpu_isa"] = p.cpu_isa;
  j["host_memory"] = p.host_memory;
  j["cuda"] = {{"compiled", p.cuda_compiled},     {"architectures", p.cuda_archs_compiled},
               {"runtime", p.cuda_runtime_version}, {"driver", p.cuda_driver_version},
               {"status", p.cuda_status}};
  j["gpus"] = nlohmann::json::array();
  for (const GpuInfo& g : p.gpus)
    j["gpus"].push_back({{"index", g.index},
                         {"name", g.name},
                         {"compute_capability", fmt::format("{}.{}", g.cc_major, g.cc_minor)},
                         {"sm_count", g.sm_count},
                         {"total_memory", g.total_memory},
                         {"l2_bytes", g.l2_bytes},
                         {"kernel_image_arch", g.kernel_image_arch},
                         {"kernel_image_note", g.kernel_image_note}});
  return j.dump(2);
}

}  // namespace kcpp
