// Collectives between the ranks of a data-parallel group: the sums and copies the trainer needs to
// keep several model replicas (or shards of one optimizer) in step.
//
// Every collective is called by every rank of the group, in the same order, with tensors of the
// same shape and dtype (contiguous, on the communicator's device).  Results are the same on every
// rank (the local group sums in rank order, in f64, rounding once; NCCL in its ring or tree order).
//
// Backends: `local_group` (ranks are threads of one process, tensors in host memory: the CPU
// backend, and what the tests of everything above the collectives use) and NCCL (one process per
// GPU; the library is loaded at run time, so a build without it still runs on one device).
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace kcpp::dist {

enum class ReduceOp { Sum, Avg };

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  virtual Device device() const = 0;
  virtual std::string backend() const = 0;  // "local", "nccl"

  // In place: t becomes the element-wise sum (or mean) of every rank's t.
  virtual void all_reduce(const Tensor& t, ReduceOp op) = 0;
  // out [n] of rank r = the reduction of every rank's in[r n : (r + 1) n] (in holds world * n).
  virtual void reduce_scatter(const Tensor& out, const Tensor& in, ReduceOp op) = 0;
  // out [world * n] = every rank's in [n], in rank order.
  virtual void all_gather(const Tensor& out, const Tensor& in) = 0;
  // t = rank root's t.
  virtual void broadcast(const Tensor& t, int root) = 0;
  // Collectives between begin_group and end_group may be fused into one launch (NCCL's groups);
  // each must still be called on every rank in the same order.
  virtual void begin_group() {}
  virtual void end_group() {}
};

// `world` communicators whose ranks are threads of this process (one communicator per thread),
// over CPU tensors.  A rank that fails in a collective (a bad argument, another collective than
// the others called) breaks the group: the others' collectives throw its error instead of waiting
// for it, and so does every later one.
std::vector<std::unique_ptr<Communicator>> local_group(int world);

// Where this process sits in a group started by a launcher: RANK, WORLD_SIZE and LOCAL_RANK as
// torchrun and `kcpp train --gpus` set them.  nullopt when RANK is not set; an error for values
// that do not make sense (named).
struct LaunchInfo {
  int rank = 0, world_size = 1, local_rank = 0;
};
std::optional<LaunchInfo> launch_info_from_env();

// NCCL, loaded at run time from the library path (libnccl.so.2: CUDA's, or the one PyTorch's
// nvidia-nccl wheel installs).  nccl_available says why not in `why`.
bool nccl_available(std::string* why = nullptr);
// A new group's identity as hex text (rank 0 makes it and hands it to the others, e.g. in the
// environment as KCPP_NCCL_ID).
std::string nccl_unique_id();
// This process's rank of the group `unique_id` names, on `device` (a CUDA device).  Blocks until
// every rank has joined.
std::unique_ptr<Communicator> nccl_communicator(const LaunchInfo& who, const std::string& unique_id, Device device);

}  // namespace kcpp::dist
