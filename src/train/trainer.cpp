#include "train/trainer.h"

#include <cmath>
#include <cstdint>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "ops/ops.h"

namespace kcpp::train {

namespace {

// The labelled tokens of `micro` counted into `acc`, checked against `total_tokens` (the step's when
// these micro-batches are one rank's share of it; 0: theirs): the divisor of every token's loss.
double count_tokens(Accumulated& acc, const std::vector<MicroBatch>& micro, int64_t total_tokens) {
  KCPP_CHECK(!micro.empty(), "accumulate_gradients: no micro-batches");
  for (const MicroBatch& m : micro) acc.tokens += models::CausalLM::labelled_tokens(m.labels);
  KCPP_CHECK(total_tokens > 0 || acc.tokens > 0, "accumulate_gradients: no labelled token in {} micro-batches", micro.size());
  KCPP_CHECK(total_tokens == 0 || total_tokens >= acc.tokens,
             "accumulate_gradients: total_tokens {} is less than these micro-batches' {}", total_tokens, acc.tokens);
  return static_cast<double>(total_tokens > 0 ? total_tokens : acc.tokens);
}

// `g` summed into the accumulated gradient of `name`; the sum.
const Tensor& add_in(Accumulated& acc, const std::string& name, const Tensor& g) {
  auto it = acc.grads.find(name);
  if (it == acc.grads.end()) return acc.grads.emplace(name, g).first->second;
  return it->second = ops::add(it->second, g);
}

// The shares' gradients of either family: every micro-batch's forward and backward with its token
// losses summed and scaled by 1 / total (a micro-batch without labels adds zeros), the last one's
// handed to `ready` as its backward finishes each.
template <class Model>
Accumulated accumulate(Model& model, const std::vector<MicroBatch>& micro, int64_t total_tokens,
                       const models::CausalLM::GradientReady& ready) {
  Accumulated acc;
  const double scale = 1.0 / count_tokens(acc, micro, total_tokens);
  for (size_t i = 0; i < micro.size(); ++i) {
    const MicroBatch& m = micro[i];
    const bool hooked = ready && i + 1 == micro.size();
    // The last micro-batch's gradients are summed in as the backward finishes each one.
    models::CausalLM::GradientReady each;
    if (hooked) each = [&](const std::string& name, const Tensor& g) { ready(name, add_in(acc, name, g)); };
    auto r = model.loss_and_gradients(m.input_ids, m.labels, scale, ops::Reduction::Sum, each);
    if (!hooked)
      for (auto& [name, g] : r.grads) add_in(acc, name, g);
    if (r.embedding_rows.defined()) acc.embedding_rows.push_back(r.embedding_rows);
    acc.loss += r.loss.item() * scale;
  }
  return acc;
}

template <class Model>
StepResult accumulate_and_step(Model& model, AdamW& opt, const std::vector<MicroBatch>& micro) {
  Accumulated acc = accumulate(model, micro, 0, {});
  StepResult r;
  r.loss = acc.loss;
  r.tokens = acc.tokens;
  opt.step(acc.grads);
  r.grad_norm = opt.grad_norm();
  return r;
}

}  // namespace

Accumulated accumulate_gradients(models::CausalLM& model, const std::vector<MicroBatch>& micro, int64_t total_tokens,
                                 const models::CausalLM::GradientReady& ready) {
  return accumulate(model, micro, total_tokens, ready);
}

Accumulated accumulate_gradients(models::MambaLM& model, const std::vector<MicroBatch>& micro, int64_t total_tokens,
                                 const models::CausalLM::GradientReady& ready) {
  return accumulate(model, micro, total_tokens, ready);
}

StepResult train_step(models::CausalLM& model, AdamW& opt, const std::vector<MicroBatch>& micro) {
  return accumulate_and_step(model, opt, micro);
}

StepResult train_step(models::MambaLM& model, AdamW& opt, const std::vector<MicroBatch>& micro) {
  return accumulate_and_step(model, opt, micro);
}

std::string TrainerState::dump() const {
  const nlohmann::json j{{"steps_done", steps_done},   {"seed", seed},
                         {"batch", batch},             {"seq", seq},
                         {"lr", lr},                   {"dtype", dtype},
                         {"data", data},               {"data_tokens", data_tokens},
                         {"data_sha256", data_sha256}, {"lr_scheduler", lr_scheduler},
                         {"warmup_steps", warmup_steps}, {"schedule_steps", schedule_steps}};
  return j.dump(1) + "\n";
}

TrainerState TrainerState::parse(std::string_view text, const std::string& where) {
  const auto j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  KCPP_CHECK(j.is_object() && j.contains("steps_done") && j["steps_done"].is_number_integer() && j.contains("seed"),
             "{}: trainer_state.json is not one kcpp train wrote", where);
  // Every value of its type and range, or an error naming it (not the JSON library's exception, nor
  // a float cast to an integer).
  auto bad = [&](const char* key, const char* what) {
    KCPP_FAIL("{}: trainer_state.json: '{}' must be {}, is {} (is this a folder kcpp train --save wrote?)", where, key, what,
              j[key].dump());
  };
  auto count = [&](const char* key) -> int64_t {  // 0 when absent
    if (!j.contains(key)) return 0;
    const auto& v = j[key];
    if (!v.is_number_unsigned() || v.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX))
      bad(key, "a whole number, 0 or more");
    return v.get<int64_t>();
  };
  TrainerState s;
  s.steps_done = count("steps_done");
  if (!j["seed"].is_number_unsigned()) bad("seed", "a whole number, 0 or more");
  s.seed = j["seed"].get<uint64_t>();
  s.batch = count("batch");
  s.seq = count("seq");
  auto string = [&](const char* key, std::string& into) {  // left as it is when absent
    if (!j.contains(key)) return;
    if (!j[key].is_string()) bad(key, "a string");
    into = j[key].get<std::string>();
  };
  if (j.contains("lr")) {
    if (!j["lr"].is_number() || !std::isfinite(j["lr"].get<double>())) bad("lr", "a finite number");
    s.lr = j["lr"].get<double>();
  }
  string("dtype", s.dtype);
  string("data", s.data);
  s.data_tokens = count("data_tokens");
  string("data_sha256", s.data_sha256);
  string("lr_scheduler", s.lr_scheduler);
  s.warmup_steps = count("warmup_steps");
  s.schedule_steps = count("schedule_steps");
  return s;
}

}  // namespace kcpp::train
