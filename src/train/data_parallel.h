// Data-parallel training: every rank of a communicator group holds the model, takes its share of
// each step's batch, and the ranks' gradients are summed before one AdamW step, so every rank's
// model stays the same as the single-process model trained on the whole batch.
//
//   step:  T = sum over ranks of the labelled tokens of their share        (all_reduce)
//          g_r = gradient of (sum of the share's token losses) / T          (each rank)
//          g = sum over ranks of g_r                                        (all_reduce, in buckets)
//          then AdamW with g, clipped by ||g||: the step of the whole batch
// The gradients travel in buckets of about `bucket_mib` (flattened, in `reduce_dtype`: f32 by
// default, so that sums of bf16 gradients are not rounded to bf16 on the way).  With `overlap` (the
// default; models without MoE layers, whose every parameter has a gradient on every rank) a bucket
// is summed as soon as the last micro-batch's backward has finished its parameters (the final
// norm's and the head's, then the last layer's down to the first's, the embedding's last): over NCCL
// on a stream of its own, while the backward goes on with the layers below, at most two buckets'
// buffers alive, each sum written back into its gradients.  The sums are those of summing after
// the backward (bit for bit on the thread group; over NCCL with more than two ranks the order of an
// element's sum may depend on its place in its bucket, which differs, and so may its last bits).
//
// ZeRO stage 1 (Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter
// Models", 2020): each parameter has an owner rank (whole parameters, balanced by size), only the
// owner keeps its AdamW state (m, v, master copy: 1 / world of the state per rank) and updates it,
// clipping by the norm of the whole gradient, and then broadcasts it to the other ranks.  The
// result is the same as stage 0's.
#pragma once

#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "dist/communicator.h"
#include "models/causal_lm.h"
#include "train/adamw.h"
#include "train/trainer.h"

namespace kcpp::train {

struct DataParallelOptions {
  int zero_stage = 0;              // 0 or 1
  double bucket_mib = 25.0;        // gradient bytes (in reduce_dtype) a bucket holds, about
  DType reduce_dtype = DType::f32;  // f32, or the gradients' own dtype (half the traffic for bf16)
  bool overlap = true;             // buckets summed during the backward (see above)
};

// One optimizer's state as rank `rank` of `world` writes it (a single process: 0 of 1), with the
// step count in the file's metadata; and the state of `opt`'s parameters read back from every such
// file of a folder, whatever world size wrote them.
void save_optimizer_state(const std::filesystem::path& folder, const AdamW& opt, int rank = 0, int world = 1);
void load_optimizer_state(const std::filesystem::path& folder, AdamW& opt);

class SideStream;  // data_parallel.cpp

class DataParallel {
 public:
  // The parameters of `model` (on comm.device()) start as rank 0's: they are broadcast here, before
  // the optimizer copies them.
  DataParallel(models::CausalLM& model, dist::Communicator& comm, AdamWOptions adamw, DataParallelOptions options = {});
  ~DataParallel();

  // One optimizer step; `micro` is this rank's share of the step's batch (its micro-batches).
  // Every rank gets the loss, the token count and the gradient norm of the whole step.
  StepResult step(const std::vector<MicroBatch>& micro);

  // The rank that owns (updates) each parameter: rank() for every one at stage 0.
  const std::map<std::string, int>& owners() const { return owner_; }
  // Bytes of AdamW state this rank keeps.
  size_t optimizer_state_bytes() const { return opt_.state_bytes(); }
  AdamW& optimizer() { return opt_; }

  // Checkpoints of the optimizer, independent of the world size: each rank writes the state of the
  // parameters it owns to folder/optimizer-rank<r>-of-<world>.safetensors (save_optimizer_state),
  // and a later run of any number of ranks reads them all and keeps what it owns.
  void save_optimizer(const std::filesystem::path& folder) const;
  void load_optimizer(const std::filesystem::path& folder);

 private:
  static std::map<std::string, int> assign_owners(const std::vector<std::pair<std::string, Tensor>>& params, int world);
  // anywhere[i]: whether some rank has a gradient of params_[i].
  void reduce_gradients(std::map<std::string, Tensor>& grads, const std::vector<char>& anywhere);
  // A bucket: its gradients flattened into one tensor of reduce_dtype, and back (in each parameter's
  // dtype and shape) once summed.
  Tensor pack(const std::vector<std::string>& names, const std::map<std::string, Tensor>& grads) const;
  void unpack(const std::vector<std::string>& names, const Tensor& flat, std::map<std::string, Tensor>& grads) const;

  models::CausalLM& model_;
  dist::Communicator& comm_;
  DataParallelOptions options_;
  std::vector<std::pair<std::string, Tensor>> params_;  // the model's, in its order (the same on every rank)
  std::map<std::string, Tensor> param_of_;              // the same, by name
  std::map<std::string, int> owner_;
  AdamW opt_;
  std::unique_ptr<SideStream> side_;  // where overlapped buckets are summed
};

}  // namespace kcpp::train
