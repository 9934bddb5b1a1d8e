// A copy of a small device tensor to the host that the caller does not wait for at once:
//
//   PendingCopy c;
//   c.start(picks);                 // queued on the current stream into pinned host memory
//   ... queue more GPU work ...
//   std::vector<int64_t> v = c.wait();   // blocks until the copy has landed
//
// A decode loop reads one step's picks this way while the next step already runs on the device.
// The copy runs on a stream of its own once the current stream has written the tensor, so the
// current stream's next kernels do not wait behind it: the caller does not write the tensor again
// before wait().  start() keeps the tensor alive until wait(); a CPU tensor (or a build without
// CUDA) is read at start().  One copy in flight at a time.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "core/tensor.h"

namespace kcpp {

class PendingCopy {
 public:
  PendingCopy();
  ~PendingCopy();
  PendingCopy(const PendingCopy&) = delete;
  PendingCopy& operator=(const PendingCopy&) = delete;

  // t: i64, contiguous.  Throws if a copy is already in flight.
  void start(const Tensor& t);
  // The values of the tensor given to start().  Throws if none was started.
  std::vector<int64_t> wait();
  bool pending() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kcpp
