// Data-parallel training: every rank of a communicator group holds the model, takes its share of
// each step's batch, and the ranks' gradients are summed before one AdamW step, so every rank's
// model stays the same as the single-process model trained on the whole batch.
//
//   step:  T = sum over ranks of the labelled tokens of their share        (all_gather of the counts)
//          g_r = gradient of (sum of the share's token losses) / T          (each rank)
//          g = sum over ranks of g_r                                        (all_reduce, in buckets)
//          then AdamW with g, clipped by ||g||: the step of the whole batch
// The gradients travel in buckets of about `bucket_mib` (flattened, in `reduce_dtype`, one dtype of
// sums a bucket: by default a bf16 parameter's in bf16, as PyTorch FSDP2's MixedPrecisionPolicy and
// Megatron-core's grad_reduce_in_fp32=false sum them, half the traffic of f32 sums, and any other's
// (an f32 model's, a Mamba model's f32 A_log, D and dt bias) in f32.  reduce_dtype = f32 keeps bf16
// gradients' sums unrounded on the way, at a measured 6% of a 4-GPU step: bench/RESULTS.md).  With
// `overlap` (the default; models without MoE layers, whose every parameter has a gradient on every
// rank) a bucket
// is summed as soon as the last micro-batch's backward has finished its parameters (the final
// norm's and the head's, then the last layer's down to the first's, the embedding's last): over NCCL
// on a stream of its own, while the backward goes on with the layers below, at most two buckets'
// buffers alive, each sum written back into its gradients.  The sums are those of summing after
// the backward (bit for bit on the thread group; over NCCL with more than two ranks the order of an
// element's sum may depend on its place in its bucket, which differs, and so may its last bits).
//
// ZeRO (Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models",
// 2020), stages 1 and 2: the parameters are laid out once in flat buckets (the model's parameters
// last first, about `bucket_mib` each, one parameter dtype a bucket), each padded to a multiple of
// the world size and cut into `world` equal contiguous shards; rank r owns shard r of every bucket.
//
//   step:  each bucket's gradients packed flat (reduce_dtype)      [world * shard]
//          reduce_scatter: rank r receives the sum of its shard    [shard]
//          ||g||^2 = sum over ranks of the shards' squared norms    (all_reduce of one f64)
//          AdamW on the shard's pieces of parameters (its m, v, master: 1 / world of the state)
//          all_gather of the updated shards (the parameters' dtype) into every rank's parameters
//
// Half the gradient traffic of an all-reduce, and one all-gather a bucket instead of a broadcast a
// parameter.  AdamW's maths are the single process's (a piece keeps its parameter's weight decay;
// a parameter with a gradient on no rank is skipped), so the result is stage 0's up to the order of
// the norm's sum.  Stage 1 keeps the flat gradient buckets between steps (reduce-scattered in
// place: each rank's shard of them holds the sums); stage 2 keeps only each rank's shard of them,
// the flat bucket living only until it is reduce-scattered (gradient_bytes()).  With `overlap` the
// buckets are reduce-scattered in their order as soon as the backward has finished all of their
// parameters.
//
// Stage 3 (ZeRO-3; PyTorch FSDP's per-module all-gather) shards the parameters too.  The buckets
// are also cut where the parameter group changes (models::ParameterGroup: the embedding, each
// layer, the head's final norm and untied lm_head), so a group's parameters are a set of whole
// buckets; each rank keeps its shard of every bucket in a buffer of its own, of the parameters'
// dtype (AdamW's pieces are views of it: the optimizer updates the shard), and the parameters'
// memory is released between uses (Storage::evict: every handle and view of the model sees it; a
// read throws an error naming ZeRO-3).  The model's parameter_use hook, set by the trainer, brings
// a group in:
//
//   first use of group G (the model calls parameter_use(G, true)):
//          restore G's storages (allocated again, whole)
//          for each bucket of G: all_gather of the ranks' shards   [world * shard], a staging buffer
//                                (with `overlap` on the side stream, after the reduce-scatters
//                                 queued there, and waited for; without, on the current stream)
//                                copied into G's parameters
//   last use (parameter_use(G, false)): release G's storages
//   step:  stage 2's (reduce-scatter as each layer's backward ends, AdamW on the shards), without
//          the all-gather after it: the next forward gathers the updated shards
//
// Prefetch (`prefetch`, with `overlap`; PyTorch FSDP's forward_prefetch / backward_prefetch): a
// step's order of uses is known before it runs, the model's (models/parameter_use.h): for each micro-batch
// the embedding, layers 0 .. L-1, the head (with a tied head, the head and the embedding together:
// one use), then layers L-1 .. 0 (activation checkpointing recomputes a layer inside its backward's
// use: the order does not change).  When a step's use i begins, the all-gathers of use i + 1 are
// issued on the side stream into their staging buffers, so they run during use i's compute (in the
// backward before use i's reduce-scatter, which the side stream then runs during use i + 1); use
// i + 1 waits on that event only, restores its storages and copies its staged buckets in.  The
// last use of a step prefetches nothing (the optimizer changes the shards); the embedding of the
// next micro-batch is prefetched during layer 0's backward.  Each use is checked against the
// order: a use that deviates from it (another pass inside the step, a hook calling the model
// differently) drops the staged buckets (waited for, freed: their gathers were issued on every rank
// alike) and turns the prefetch off for the rest of the step, so the group is gathered at its use as
// without prefetch.  Only when the gather runs changes: the values are the same bit for bit.
//
// A pass uses one group at a time (a tied head also gathers the embedding), so a rank holds its
// shards, 1 / world of the parameters (up to an element of padding a bucket), plus one use's
// groups, or with prefetch the current use's groups and the next use's staged buckets (a use's
// staged bytes: its buckets' world * shard elements, its parameters' bytes up to world - 1 elements
// of padding a bucket); at the moment the next use begins, its storages are restored while its
// staged buckets are still held.  With bytes(u) a use's parameter bytes and staged(u) its staged
// bytes, over the uses u and consecutive uses a, b of a step, a step's peak is
//
//   shards + max(bytes(u))                                            without prefetch
//   shards + max(max(bytes(a), bytes(b)) + staged(b))   at most,      with prefetch
//
// (equal for an untied head; a tied head's pair is restored a group at a time): about two groups
// instead of one (parameter_bytes(), peak_parameter_bytes(); the staging buffer of a gather that is
// not prefetched lives only until it is copied, a bucket at a time, and is not counted).
// Gradients as at stage 2.  Each micro-batch's forward and backward gather again (with activation
// checkpointing the recomputed forward runs inside the backward's gather), so every rank must have
// the same number of micro-batches (checked: a named error).  The values are stage 2's: the same
// all-gathered shards, the same sums.  While the trainer lives the model refuses a forward with a KV
// cache (generation); gather_parameters() makes every parameter whole, and they stay whole if the
// trainer goes then; save_model() gathers them for rank 0's save of the model and releases them after.
// The optimizer's checkpoints are stage 2's.
//
// The embedding's gradient.  Its dense gradient [V, H] is whole only at the end of the backward, so
// its reduction overlaps nothing; but a rank's share of it comes from its T tokens only: the gradient
// of the embedding's output, rows [T, H], and the token ids.  With the sparse path every rank
// all-gathers the ids (at the step's start, with the token counts) and those rows (after the
// backward, padded with zero rows to the largest T of the ranks), and every rank adds all ranks'
// rows (ops::embedding_backward: f32 sums in a fixed order, rank order and token order within its
// tiles of sorted rows, rounded once to the gradient's dtype), into the rows of the embedding it
// needs: all of them at stage 0, its shard's at stages 1 to 3.  The result is the same on every rank, and the dense reduction's up to the order of
// the sums; the rows carry the step's 1 / T_total scale as the dense gradient does.  The default is
// the dense path: on two H200s at Llama-3's vocabulary the sparse one left more time exposed after
// the backward (bench/RESULTS.md), although it moves fewer bytes.  EmbeddingGradient::Auto takes the
// sparse path when a rank receives fewer bytes by it than by the dense one, with
// ring algorithms (NCCL's bus-bandwidth factors, nccl-tests' PERFORMANCE.md): with w ranks,
//   sparse: (w - 1) T_max (H bytes(gradient dtype) + 8)              (all-gather of rows and ids)
//   dense:  c (w - 1) / w V H bytes(reduce_dtype), c = 2 at stage 0 (all-reduce), 1 above (reduce-scatter)
// so for Llama-3's vocabulary of 128,256 and hidden 4096 below about 64 K tokens a rank (bf16, f32
// sums, 4 ranks, ZeRO-1), about 32 K with bf16 sums.  A tied head adds a dense gradient (the lm_head's) to the embedding's: it
// always takes the dense path.  The embedding is a bucket of its own (stages 1 to 3), so that no
// other parameter waits for it.
//
// The parameters' all-gather after AdamW (stages 1 and 2) overlapped with the next forward
// (`overlap_parameter_gather`, with `overlap`; Megatron-LM's overlapped parameter gather of its
// distributed optimizer): the step ends with only this rank's shards of the parameters updated, and
// the model's parameter_use hook (set then) issues every bucket's all-gather at the first use of a
// parameter group (the next forward's embedding), on the side stream, the buckets in the order the
// forward uses them (the embedding's, then layer 0's, ..., the head's), each followed by its copy
// into the parameters; each use waits (on the device) for the gathers of its group only, so the
// later buckets are gathered while the first layers compute.  The collectives stay in one order on
// every rank: the step's first ones (the token counts, the ids) are issued before the forward, and
// none on the compute stream until the side stream is waited for.  Until then the model's other
// ranks' shards are those of the step before: a forward is a collective (every rank runs it, as at
// stage 3), and anything else that reads the parameters between steps must call gather_parameters()
// first (every rank; it also unsets the hook, so that a forward with a KV cache, refused while it is
// set, can run); save_model() does.  The trainer going leaves the parameters as they are.  The
// gathered buckets are held until the last use waits for them: one more copy of the parameters.
//
// Where communication shows: comm_stats() sums, a step at a time, the time from the end of the
// backward's work to the end of the gradients' reduction (the buckets not yet summed, the
// embedding's rows, the wait for the side stream), and at stages 1 and 2 that of the all-gather of
// the updated parameters after AdamW (on a CUDA device by events on the compute stream, elsewhere by
// the host's clock).
#pragma once

#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dist/communicator.h"
#include "models/causal_lm.h"
#include "train/adamw.h"
#include "train/trainer.h"

namespace kcpp::train {

// How the embedding's gradient is summed over the ranks (see above).
enum class EmbeddingGradient {
  Auto,    // sparse when that moves fewer bytes, and the head is untied (not yet faster where measured)
  Sparse,  // the ranks' rows and ids all-gathered (an untied head only: an error with a tied one)
  Dense,   // the dense [V, H] gradient, like every other parameter's
};

struct DataParallelOptions {
  int zero_stage = 0;  // 0 (replicated), 1 (optimizer state sharded), 2 (and gradients), 3 (and parameters)
  double bucket_mib = 25.0;        // gradient bytes (in reduce_dtype) a bucket holds, about
  // The dtype gradients are summed in across the ranks: f32, f64, bf16 or f16; unset: a bf16
  // parameter's in bf16, any other's in f32 (see above).  reduce_dtype() tells the one taken.
  std::optional<DType> reduce_dtype;
  bool overlap = true;             // buckets summed during the backward (see above)
  bool prefetch = false;           // stage 3 with overlap: the next use's gathers issued during this one's
                                   // (off by default: slower than gathering at the use, bench/RESULTS.md)
  EmbeddingGradient embedding_gradient = EmbeddingGradient::Dense;
  // Stages 1 and 2 with overlap: the updated parameters' all-gather deferred to the next forward,
  // each group's waited for at its use (see above).  Off by default.
  bool overlap_parameter_gather = false;
};

// Where a tensor of optimizer state starts in its parameter (a data-parallel shard's piece of it),
// and the parameter's number of elements.
struct StateSlice {
  int64_t begin = 0, full = 0;
};
// Slices by parameter name; a parameter absent from it has its whole state.
using StateSlices = std::map<std::string, StateSlice>;

// One optimizer's state as rank `rank` of `world` writes it (a single process: 0 of 1), with the
// step count and the slices (for a shard) in the file's metadata; and the state of `opt`'s
// parameters (or the pieces of them `slices` names) read back from every such file of a folder,
// whatever world size or ZeRO stage wrote them.
void save_optimizer_state(const std::filesystem::path& folder, const AdamW& opt, int rank = 0, int world = 1,
                          const StateSlices& slices = {});
void load_optimizer_state(const std::filesystem::path& folder, AdamW& opt, const StateSlices& slices = {});

class SideStream;  // data_parallel.cpp
class StepClock;

class DataParallel {
 public:
  // The parameters of `model` (on comm.device()) start as rank 0's: they are broadcast here, before
  // the optimizer copies them.
  DataParallel(models::CausalLM& model, dist::Communicator& comm, AdamWOptions adamw, DataParallelOptions options = {});
  // A Mamba-family model: every stage and option of a CausalLM's (its buckets summed during the
  // backward, its groups gathered at their use through MambaLM::parameter_use) but the sparse embedding
  // gradient, an error: its embedding's gradient is summed dense.
  DataParallel(models::MambaLM& model, dist::Communicator& comm, AdamWOptions adamw, DataParallelOptions options = {});
  ~DataParallel();

  // One optimizer step; `micro` is this rank's share of the step's batch (its micro-batches).
  // Every rank gets the loss, the token count and the gradient norm of the whole step.
  StepResult step(const std::vector<MicroBatch>& micro);

  // The dtype the gradients of a parameter of dtype `param` are summed in across the ranks
  // (DataParallelOptions::reduce_dtype, or unset: bf16 for bf16 parameters, f32 for the others).
  DType reduce_dtype(DType param) const;
  // Bytes of AdamW state this rank keeps (m, v, the f32 masters of its parameters or its shard).
  size_t optimizer_state_bytes() const { return opt_.state_bytes(); }
  // Bytes of gradient buffers kept between steps: the flat buckets at stage 1, this rank's shards of
  // them at stages 2 and 3, none at stage 0 (its gradients are the step's own tensors, gone when it
  // returns).
  size_t gradient_bytes() const;
  // Bytes of parameter memory this rank holds now: every parameter at stages 0 to 2; at stage 3 its
  // shards plus the groups gathered at the moment and the staged buckets of a prefetch (none between
  // steps).  The peak: its maximum since the trainer was made (at stage 3, since the constructor
  // released the parameters: the shards plus the largest use, a layer, the embedding, or the head
  // with a tied embedding; with prefetch, plus the next use's staged buckets: the bound above).
  size_t parameter_bytes() const;
  size_t peak_parameter_bytes() const;
  // Stage 3's prefetches since the trainer was made: uses whose gathers were issued ahead (a use
  // whose groups were all gathered already, e.g. by gather_parameters(), counts in none), of those
  // the ones their use took, and the steps whose order of uses deviated from the expected one (their
  // staged buckets dropped, the rest of the step without prefetch).
  struct PrefetchStats {
    int64_t issued = 0, used = 0, deviations = 0;
  };
  PrefetchStats prefetch_stats() const { return prefetch_stats_; }
  // Since the trainer was made (see above): the steps, those whose embedding gradient was summed
  // sparse, and the milliseconds spent after the backward on the gradients' reduction and (stages 1
  // and 2) on the parameters' all-gather after AdamW, over the `timed` steps (all of them once the
  // last one's events are read: this call waits for them).
  struct CommStats {
    int64_t steps = 0, sparse_embedding_steps = 0, timed = 0;
    double after_backward_ms = 0, parameter_gather_ms = 0;
  };
  CommStats comm_stats();
  // Stages 1 and 2 with overlap_parameter_gather: the deferred all-gather done and waited for, the
  // hook unset (a collective when one is due).
  // Stage 3: every parameter gathered whole on every rank (a collective: all ranks call it), e.g.
  // to save, evaluate or sample from the model, until release_parameters() (after which the model's
  // parameters are released again; the optimizer's shards are what training updates, so changes to
  // the whole parameters are not kept).  No-ops at stages 0 to 2.  The trainer's destructor leaves
  // the parameters as they are: gathered ones stay usable, released ones stay released.
  void gather_parameters();
  void release_parameters();
  // The model as a Hugging Face folder (its save()), written by rank 0 with whole parameters
  // (at stage 3 gathered for it by every rank, and released after).  Every rank calls it.
  void save_model(const std::filesystem::path& folder);
  AdamW& optimizer() { return opt_; }

  // Checkpoints of the optimizer, independent of the world size and the stage: each rank writes the
  // state it keeps to folder/optimizer-rank<r>-of-<world>.safetensors (save_optimizer_state; at
  // stage 0 every rank has all of it), and a later run of any number of ranks reads them all and
  // keeps its part.
  void save_optimizer(const std::filesystem::path& folder) const;
  void load_optimizer(const std::filesystem::path& folder);

 private:
  // A bucket of the sharded layout (stages 1 to 3).
  struct Bucket {
    std::vector<size_t> params;   // indices into params_
    std::vector<int64_t> offset;  // where each one starts in the flat bucket
    int64_t numel = 0, shard = 0;  // its parameters' elements; a rank's shard: ceil(numel / world)
    DType dtype = DType::f32;      // its parameters'
    Tensor flat;                   // [world * shard] reduce_dtype: kept at stage 1, one step's at stage 2
    Tensor grad;                   // [shard] this rank's summed shard (at stage 1 a view of flat)
    Tensor data;                   // stage 3: [shard] (dtype) this rank's shard of the parameters
    size_t group = 0;              // stage 3: its parameters' group (see ParamGroup)
  };
  // Stage 3: the parameters of one models::ParameterGroup (group 0: the embedding, 1 + l: layer l,
  // then the head's final norm and untied lm_head), their buckets, and the storages they fill (each
  // storage the memory of parameters of this group only, released and restored whole).
  struct ParamGroup {
    std::vector<size_t> buckets;
    std::vector<std::shared_ptr<Storage>> storages;
    size_t bytes = 0;  // the storages'
    int users = 0;     // gathered while positive
    // A prefetch not yet taken: the buckets' all-gathers ([world * shard] each, in g.buckets' order)
    // and the side stream's event after them (-1 where the gathers ran where they were called).
    std::vector<Tensor> staged;
    int staged_event = -1;
  };
  // This rank's part of one parameter: elements [begin, begin + length) of params_[param], at `at` in
  // the shard of bucket `bucket`.
  struct Piece {
    size_t bucket, param;
    int64_t begin, length, at;
  };
  // Lays out buckets_ and pieces_; returns the pieces as the parameters AdamW updates.
  std::vector<std::pair<std::string, Tensor>> shard_layout();
  StepResult step_replicated(const std::vector<MicroBatch>& micro, int64_t total);
  StepResult step_sharded(const std::vector<MicroBatch>& micro, int64_t total);
  // anywhere[i]: whether some rank has a gradient of params_[i].
  // `skip`: a parameter left out (the embedding, summed sparse).
  void reduce_gradients(std::map<std::string, Tensor>& grads, const std::vector<char>& anywhere, size_t skip);
  // The sparse embedding gradient: whether this step takes it (the same on every rank: from the
  // largest share of tokens); and rows [lo, hi) of the embedding's gradient summed from every rank's
  // rows (this rank's: `rows`, its micro-batches'), in the rows' dtype.
  bool sparse_embedding(int64_t rows_max) const;
  Tensor sparse_embedding_rows(const std::vector<Tensor>& rows, int64_t lo, int64_t hi);
  void read_clock();  // the last step's times into stats_
  // A bucket: its gradients flattened into one tensor of reduce_dtype, and back (in each parameter's
  // dtype and shape) once summed.
  Tensor pack(const std::vector<std::string>& names, const std::map<std::string, Tensor>& grads) const;
  void unpack(const std::vector<std::string>& names, const Tensor& flat, std::map<std::string, Tensor>& grads) const;
  // Sharded: bucket b's gradients (zeros where `grads` has none) reduce-scattered into its shard.
  void reduce_scatter_bucket(size_t b, const std::map<std::string, Tensor>& grads, std::vector<Tensor>& keep);
  StateSlices slices() const;
  // Stage 3: the group of params_[i]; groups_ laid out, the parameters released, the model's
  // parameter_use set.
  size_t group_of(const std::string& name) const;
  void release_layout();
  void acquire(size_t group);  // gathered by the first user (taking its prefetch, if any)
  void release(size_t group);  // released by the last
  // Stage 3: the all-gathers of group's buckets into new staging buffers on the side stream (an
  // event after them in `event`); and the group's storages restored and filled from them.
  std::vector<Tensor> gather_staged(size_t group, int& event);
  void fill_from(size_t group, const std::vector<Tensor>& staged);
  // Stage 3 prefetch: the groups of use `use` (its group; a tied head's also the embedding); the
  // hook's start of a use (checked against plan_, the next one prefetched); a prefetch dropped.
  std::vector<size_t> groups_of_use(size_t use) const;
  void begin_use(size_t use);
  void prefetch(size_t use);
  void drop_staged(size_t group);
  void end_plan();
  // Stages 1 and 2: the updated shards all-gathered into every rank's parameters, a bucket at a time,
  // on the current stream; or, with overlap_parameter_gather, the same on the side stream (issue:
  // marks per group in gather_marks_), waited for a group at a time (wait_gathered) or all at once
  // (finish_gathers).
  void gather_updated();
  void issue_gathers();
  void wait_gathered(size_t group);
  void finish_gathers();

  // The model: one of the two.  The sparse embedding gradient runs for causal_ only (the constructor
  // refuses it for mamba_); the rest reads the model through these.
  size_t layer_count() const;
  bool tied_head() const;
  models::ParameterUse& parameter_use() const;
  DataParallel(models::CausalLM* causal, models::MambaLM* mamba, std::vector<std::pair<std::string, Tensor>> params,
               dist::Communicator& comm, AdamWOptions adamw, DataParallelOptions options);
  models::CausalLM* causal_ = nullptr;
  models::MambaLM* mamba_ = nullptr;
  dist::Communicator& comm_;
  DataParallelOptions options_;
  std::vector<std::pair<std::string, Tensor>> params_;  // the model's, in its order (the same on every rank)
  std::map<std::string, Tensor> param_of_;              // the same, by name
  std::map<std::string, size_t> index_of_;              // position in params_, by name
  std::vector<Bucket> buckets_;                         // stages 1 and 2
  std::vector<size_t> bucket_of_;                       // params_[i]'s bucket
  std::vector<Piece> pieces_;                           // in the buckets' order
  // The embedding's index in params_ and its bucket (stages 1 to 3), set while opt_ is made.
  size_t embed_param_ = 0, embed_bucket_ = 0;
  AdamW opt_;
  std::unique_ptr<SideStream> side_;  // where overlapped buckets are summed
  std::vector<ParamGroup> groups_;         // stage 3
  size_t resident_ = 0, peak_ = 0;    // stage 3: parameter_bytes() and its peak
  // Stage 3 prefetch, during a step: the uses expected (group indices of the hook's groups, the head's
  // standing for a tied head's pair), and how many have begun; empty outside a step or after a
  // deviation.
  std::vector<size_t> plan_;
  size_t planned_ = 0;
  PrefetchStats prefetch_stats_;
  // This step's sparse embedding gradient: the largest share of tokens, every rank's ids (padded to
  // it with -1, in rank order).
  int64_t rows_max_ = 0;
  std::vector<int64_t> all_ids_;
  std::unique_ptr<StepClock> clock_;
  // overlap_parameter_gather: whether the last step's all-gather is still to be issued; once issued,
  // the side stream's mark after each group's last bucket (-1: waited for), and the buffers it uses.
  bool gathers_due_ = false;
  std::vector<int> gather_marks_;
  std::vector<Tensor> gather_buffers_;
  CommStats stats_;
};

}  // namespace kcpp::train
