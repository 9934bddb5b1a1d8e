// One optimizer step over several micro-batches (gradient accumulation), with the loss scaled as
// Transformers does it when it knows num_items_in_batch: every micro-batch's loss is the SUM over
// its labelled tokens, divided by the labelled tokens of the whole accumulated batch, so the step
// equals one over the concatenated batch (not the mean of per-micro-batch means).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "models/causal_lm.h"
#include "models/mamba.h"
#include "train/adamw.h"

namespace kcpp::train {

struct MicroBatch {
  Tensor input_ids, labels;  // [b, s] each; labels -100 where ignored (shifted inside the model)
};

struct StepResult {
  double loss = 0;       // mean over the labelled tokens of every micro-batch
  double grad_norm = 0;  // before clipping
  int64_t tokens = 0;    // labelled tokens in the step
};

// The gradients of the accumulated batch (summed over the micro-batches, already scaled).
struct Accumulated {
  std::map<std::string, Tensor> grads;
  // With the model's sparse_embedding_gradient (untied head): each micro-batch's embedding_rows, in
  // their order, in place of the embedding's gradient.
  std::vector<Tensor> embedding_rows;
  double loss = 0;
  int64_t tokens = 0;
};
// `total_tokens` > 0: the labelled tokens of the whole step when these micro-batches are one share
// of it (data parallelism: each rank's share), so that the shares' gradients sum to the step's.
// `ready`: called during the last micro-batch's backward with each parameter's accumulated gradient
// as it becomes whole (CausalLM::loss_and_gradients), the same tensor the result then holds.
Accumulated accumulate_gradients(models::CausalLM& model, const std::vector<MicroBatch>& micro, int64_t total_tokens = 0,
                                 const models::CausalLM::GradientReady& ready = {});

// accumulate_gradients, then one AdamW step.
StepResult train_step(models::CausalLM& model, AdamW& opt, const std::vector<MicroBatch>& micro);

// The same for a Mamba-family model (MambaLM::loss_and_gradients hands its gradients over in its own
// order).
Accumulated accumulate_gradients(models::MambaLM& model, const std::vector<MicroBatch>& micro, int64_t total_tokens = 0,
                                 const models::CausalLM::GradientReady& ready = {});
StepResult train_step(models::MambaLM& model, AdamW& opt, const std::vector<MicroBatch>& micro);

// trainer_state.json of a checkpoint (`kcpp train --save`, beside the model and the optimizer state):
// what a resumed run must match or continue: the steps taken, the data's seed and shape, the token
// stream and the learning-rate schedule.  A checkpoint from before the data and the schedule were
// saved has none of them: the embedded corpus and a constant rate.
struct TrainerState {
  int64_t steps_done = 0;
  uint64_t seed = 0;
  int64_t batch = 0, seq = 0;
  double lr = 0;
  std::string dtype;        // of the weights: "f32", "bf16", "f16"
  std::string data;         // the --data file, "" for the embedded corpus
  int64_t data_tokens = 0;  // of the token stream
  std::string data_sha256;  // of the token stream (and its labels); "" when not saved
  std::string lr_scheduler = "constant";
  int64_t warmup_steps = 0, schedule_steps = 0;

  std::string dump() const;  // the file's text
  // steps_done and seed are required, whole numbers from 0; batch and seq whole numbers from 0, lr a
  // finite number and dtype a string when present.  Anything else is a kcpp::Error naming `where`
  // and the key.
  static TrainerState parse(std::string_view text, const std::string& where);
};

}  // namespace kcpp::train
