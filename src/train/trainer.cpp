#include "train/trainer.h"

#include "core/error.h"
#include "ops/ops.h"

namespace kcpp::train {

Accumulated accumulate_gradients(models::CausalLM& model, const std::vector<MicroBatch>& micro, int64_t total_tokens) {
  KCPP_CHECK(!micro.empty(), "accumulate_gradients: no micro-batches");
  Accumulated acc;
  for (const MicroBatch& m : micro) acc.tokens += models::CausalLM::labelled_tokens(m.labels);
  KCPP_CHECK(total_tokens > 0 || acc.tokens > 0, "accumulate_gradients: no labelled token in {} micro-batches", micro.size());
  KCPP_CHECK(total_tokens == 0 || total_tokens >= acc.tokens,
             "accumulate_gradients: total_tokens {} is less than these micro-batches' {}", total_tokens, acc.tokens);
  const double scale = 1.0 / static_cast<double>(total_tokens > 0 ? total_tokens : acc.tokens);
  for (const MicroBatch& m : micro) {
    auto r = model.loss_and_gradients(m.input_ids, m.labels, scale, ops::Reduction::Sum);
    acc.loss += r.loss.item() * scale;
    for (auto& [name, g] : r.grads) {
      auto it = acc.grads.find(name);
      if (it == acc.grads.end()) acc.grads.emplace(name, std::move(g));
      else it->second = ops::add(it->second, g);
    }
  }
  return acc;
}

StepResult train_step(models::CausalLM& model, AdamW& opt, const std::vector<MicroBatch>& micro) {
  Accumulated acc = accumulate_gradients(model, micro);
  StepResult r;
  r.loss = acc.loss;
  r.tokens = acc.tokens;
  opt.step(acc.grads);
  r.grad_norm = opt.grad_norm();
  return r;
}

}  // namespace kcpp::train
