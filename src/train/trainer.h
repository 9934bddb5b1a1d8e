// One optimizer step over several micro-batches (gradient accumulation), with the loss scaled as
// Transformers does it when it knows num_items_in_batch: every micro-batch's loss is the SUM over
// its labelled tokens, divided by the labelled tokens of the whole accumulated batch, so the step
// equals one over the concatenated batch (not the mean of per-micro-batch means).
#pragma once

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

// The same step for a Mamba-family model: each micro-batch's mean loss weighted by its share of the
// labelled tokens (dloss = its tokens / all of them), so that the step is the whole batch's.
StepResult train_step(models::MambaLM& model, AdamW& opt, const std::vector<MicroBatch>& micro);

}  // namespace kcpp::train
