// What the machine really has: OS, CPU and its vector extensions, the CUDA driver and runtime, and
// every GPU, plus what this build compiled in.  Hub variant selection and `kcpp info` read this.
// detect_platform() never throws for a missing driver or GPU: it says so in cuda_status.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

namespace kcpp {

struct GpuInfo {
  int index = 0;
  std::string name;
  int cc_major = 0, cc_minor = 0;      // compute capability
  int sm_count = 0;
  size_t total_memory = 0;             // bytes
  size_t l2_bytes = 0;
  size_t shared_memory_per_block_optin = 0;
  int memory_bus_width_bits = 0;
  // Architecture of the kernel image this build runs on this GPU (e.g. 90 for sm_90a code), or 0
  // when the build has no image the GPU can run; kernel_image_note says which and why.
  int kernel_image_arch = 0;
  std::string kernel_image_note;
};

struct PlatformInfo {
  std::string os;            // "Linux"
  std::string os_release;    // kernel release
  std::string distribution;  // PRETTY_NAME of /etc/os-release
  std::string cpu_arch;      // "x86_64", "aarch64"
  std::string cpu_model;
  int cpu_threads = 0;
  std::vector<std::string> cpu_isa;  // the vector extensions that matter to kernels
  size_t host_memory = 0;            // bytes

  bool cuda_compiled = false;
  std::string cuda_archs_compiled;   // CMAKE_CUDA_ARCHITECTURES of this build, e.g. "80;90a"
  int cuda_runtime_version = 0;      // e.g. 13000 for 13.0
  int cuda_driver_version = 0;       // what the driver supports; 0 when there is no driver
  std::string cuda_status;           // "ok", "no CUDA driver", "no CUDA device", "not compiled in", ...
  std::vector<GpuInfo> gpus;
};

PlatformInfo detect_platform();
// Human-readable report (kcpp info) and JSON (kcpp info --json).
std::string format_platform(const PlatformInfo& p);
std::string platform_json(const PlatformInfo& p);
// "13.0" from 13000.
std::string cuda_version_str(int v);

}  // namespace kcpp
