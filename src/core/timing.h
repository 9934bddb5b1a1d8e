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
//
// On a GPU each timed run is preceded by zeroing a 256 MiB buffer, exactly as
// `triton.testing.do_bench` does (the anchors' timer): the run then starts with a cold L2 (no
// input left in the 50-60 MiB cache by the previous run), and the host enqueues the start event and
// the run while the GPU is still busy with the zeroing, so host-side launch cost does not show up as
// an idle gap between the events.  Without it, a 40 us kernel measured 3-5 us of launch latency too.
// KCPP_TIMING_FLUSH in the environment picks the flush: `zero` (the default, as above); `clean`, the
// zeroing followed by a read of the whole buffer, so that the lines the zeroing left dirty in the L2
// are written back before the timed run instead of during it (a kernel moving 128 MiB otherwise pays
// for up to an L2's worth of someone else's write-back: what a kernel costs alone, as Nsight Compute
// times it with its cache control); `none`, back to back (KCPP_TIMING_NO_FLUSH=1 too).
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
