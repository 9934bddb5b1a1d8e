// CUDA graphs: a piece of host code whose GPU work is recorded once and replayed.
//
//   CudaGraph g;
//   g.capture(device, [&] { out = step(in); });   // records; runs nothing
//   g.replay();                                     // runs the recorded work on the current stream
//
// The body runs on a capture stream of its own (made current for its duration), with the device's
// allocator drawing from a private pool that lives as long as the graph (core/allocator.h), so the
// addresses the graph reads and writes stay its own between replays.  Inputs that change from one
// replay to the next must live in tensors made before the capture and be overwritten in place;
// tensors the body returns keep their addresses and hold each replay's results.
//
// What a body must not do: wait for the device (copy a result to the host, check indices by
// reading them back), copy from host memory (the capture would record the host address of a
// temporary), or launch on the legacy default stream (the capture stream is a blocking one, so
// that is an error rather than work missing from the graph).  The CUDA runtime refuses such calls
// while capturing; capture() then throws with the runtime's message and leaves no graph, and the
// caller runs the body eagerly instead.  Kernels from packages run in capture only when their
// layer declares the graph mode (nn::CaptureScope).
#pragma once

#include <functional>
#include <memory>

#include "core/allocator.h"
#include "core/device.h"

namespace kcpp {

class CudaGraph {
 public:
  CudaGraph();
  ~CudaGraph();
  CudaGraph(const CudaGraph&) = delete;
  CudaGraph& operator=(const CudaGraph&) = delete;

  // Records body's GPU work on `device` (a CUDA device).  Throws kcpp::Error if the capture fails;
  // a graph captured before is dropped first.
  void capture(Device device, const std::function<void()>& body);
  // Launches the recorded work on the device's current stream.  Throws if nothing was captured.
  void replay();
  bool captured() const;
  // Drops the graph and its memory.
  void reset();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Whether this build can capture graphs at all (a CUDA build).
bool cuda_graphs_compiled();

}  // namespace kcpp
