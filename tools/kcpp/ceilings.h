// `kcpp bench --ceilings`: the device's copy bandwidth and GEMM rates, the ceilings every other
// benchmark figure is quoted against.  Measured, never taken from a datasheet.
#pragma once

#include <string>
#include <vector>

#include "core/device.h"

namespace kcpp::tools {

struct Ceiling {
  std::string name;     // "copy 2.00 GiB", "gemm bf16 8192^3"
  double ms = 0;        // median
  double gbps = 0;      // bytes read + written per second (copies)
  double tflops = 0;    // (GEMMs)
};

// quick: smaller sizes (for CI smoke runs).
std::vector<Ceiling> measure_ceilings(Device device, bool quick);

}  // namespace kcpp::tools
