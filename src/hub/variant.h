// Build variants of a kernel package and choosing one for this machine.
//
// Grammar:  kcpp<ABI>-<backend>-<arch>-<os>
//   backend:  cpu | cu<MAJOR><MINOR> (cu130 = CUDA 13.0, cu118 = 11.8) | rocm<MAJOR><MINOR> (rocm70)
//             | metal | xpu<YEAR><N> (xpu20253 = oneAPI 2025.3)
//   arch:     x86_64 | aarch64 (other lowercase names parse, and are refused on this machine)
//   os:       linux | darwin | windows
// e.g. kcpp1-cu130-x86_64-linux, kcpp1-cpu-x86_64-linux, kcpp1-metal-aarch64-darwin.
//
// A variant fits the machine when: its ABI is ours; OS and CPU arch are the machine's; and for
//   cpu    always;
//   cuda   there is a CUDA driver whose major version is >= the variant's (a newer driver runs older
//          toolkits' code; within one major, CUDA's minor-version compatibility), and there is a GPU
//          that one of the variant's compiled architectures runs on (see cuda_arch_fit);
//   rocm / metal / xpu   the machine has that runtime (not detected yet: always refused, with the reason).
// Preference: a GPU variant over cpu; among CUDA ones, native code (SASS) over PTX JIT, then the
// newest toolkit the driver supports; ties go to the first listed.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace kcpp::hub {

enum class Backend { CPU, CUDA, ROCm, Metal, XPU };
const char* backend_name(Backend b);  // "cpu", "cuda", "rocm", "metal", "xpu"
// Throws for anything else, listing the valid names.
Backend parse_backend(std::string_view name);

struct Variant {
  int abi = 0;
  Backend backend = Backend::CPU;
  int major = 0, minor = 0;  // toolkit version: CUDA 13.0, ROCm 7.0, oneAPI 2025.3 (0 for cpu/metal)
  std::string arch, os, name;

  static Variant parse(std::string_view name);  // throws kcpp::Error naming the part that is wrong
};

// The facts selection needs, from detect_platform() or written by a test.
struct Machine {
  std::string os = "linux";
  std::string arch = "x86_64";
  int cuda_driver = 0;                 // e.g. 13000; 0 = no driver
  struct Gpu {
    int cc_major = 0, cc_minor = 0;
  };
  std::vector<Gpu> gpus;               // CUDA GPUs
  bool rocm = false, metal = false, xpu = false;

  static Machine detect();
  std::string str() const;  // "linux x86_64, CUDA driver 13.0, GPU sm_90" for messages
};

// How code compiled for `arch` (CMake / nvcc spelling: "90a", "80-real", "80-virtual", "sm_90a",
// "compute_80", "100f") runs on a GPU of compute capability major.minor.
enum class ArchFit { None = 0, Ptx = 1, Native = 2 };
ArchFit cuda_arch_fit(std::string_view arch, int cc_major, int cc_minor);

struct VariantCandidate {
  std::string name;
  std::vector<std::string> cuda_archs;  // for CUDA variants, from the manifest
};

struct VariantChoice {
  std::string chosen;                                     // "" when nothing fits
  std::string why;                                        // why it was chosen
  std::vector<std::pair<std::string, std::string>> refused;  // (variant, reason) for every other one
  // "no variant of PKG fits MACHINE:\n  V: reason\n..." for the error message.
  std::string explain(std::string_view package, const Machine& m) const;
};

VariantChoice select_variant(const std::vector<VariantCandidate>& variants, const Machine& machine);

// The variant name this build would produce for `backend` on this machine ("kcpp1-cpu-x86_64-linux").
std::string host_variant_name(Backend backend, int major = 0, int minor = 0);

}  // namespace kcpp::hub
