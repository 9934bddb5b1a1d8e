// Where a tensor lives.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace kcpp {

enum class DeviceType : uint8_t { CPU, CUDA };

struct Device {
  DeviceType type = DeviceType::CPU;
  int index = 0;

  static constexpr Device cpu() { return {DeviceType::CPU, 0}; }
  static constexpr Device cuda(int i = 0) { return {DeviceType::CUDA, i}; }
  constexpr bool is_cpu() const { return type == DeviceType::CPU; }
  constexpr bool is_cuda() const { return type == DeviceType::CUDA; }
  friend constexpr bool operator==(Device, Device) = default;
  std::string str() const { return is_cpu() ? std::string("cpu") : "cuda:" + std::to_string(index); }
};

// Parses "cpu", "cuda", "cuda:1"; throws kcpp::Error otherwise.
Device parse_device(std::string_view s);

// True when this build has CUDA support compiled in (KCPP_WITH_CUDA).
bool cuda_compiled();
// Number of usable CUDA devices (0 without a driver or a GPU, or in a CPU-only build). Never throws.
int cuda_device_count();
// Makes a CUDA device this thread's current one for good (a process that drives one GPU of several,
// e.g. one rank of a data-parallel group); nothing for the CPU.  Throws for a device that does not exist.
void use_device(Device d);

}  // namespace kcpp
