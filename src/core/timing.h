// Timing for benchmarks: the median of many runs after warm-up, with CUDA events on a GPU (device
// work is asynchronous) and a steady clock on the CPU.
#pragma once

#include <cstddef>
#include <functional>

#include "core/device.h"

namespace kcpp {

struct Timing {
  double median_ms = 0, min_ms = 0, max_ms = 0;
  int runs = 0;
};

// Runs fn `warmup` times, then `reps` times each timed alone; returns median / min / max.
Timing time_op(Device device, const std::function<void()>& fn, int warmup = 5, int reps = 25);

// Waits for all work queued on the device.
void synchronize(Device device);

// Device copy bandwidth: a copy of `bytes` between two buffers on the device, timed as above;
// bytes read plus bytes written per second, in GB/s.  The ceiling memory-bound figures are quoted against.
struct CopyCeiling {
  Timing timing;
  double gbps = 0;
};
CopyCeiling measure_copy(Device device, size_t bytes, int reps = 20);

}  // namespace kcpp
