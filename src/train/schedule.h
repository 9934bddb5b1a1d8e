// Learning-rate schedules as Transformers' `get_scheduler` makes them (transformers/optimization.py),
// so that `kcpp train --lr-scheduler cosine --warmup-steps 100` and `TrainingArguments(
// lr_scheduler_type="cosine", warmup_steps=100)` take the same rate at every step.
//
// The rate of the optimizer step that follows `t` earlier steps (t = 0 for the first, as the Trainer
// steps the scheduler after the optimizer) is lr x factor(t), with W warmup steps and T steps in all:
//   warmup (every kind but constant), t < W:   t / W            (the first step's rate is 0 when W > 0)
//   constant:                                   1
//   constant_with_warmup, t >= W:               1
//   linear, t >= W:                             max(0, (T - t) / (T - W))
//   cosine, t >= W:                             max(0, (1 + cos(pi p)) / 2),  p = (t - W) / (T - W)
// (the divisors taken as at least 1, as there).  Past T linear stays at 0 and cosine, as there, rises
// again: `kcpp train` does not take a run past its schedule.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace kcpp::train {

enum class LrScheduleKind { Constant, ConstantWithWarmup, Linear, Cosine };

struct LrSchedule {
  LrScheduleKind kind = LrScheduleKind::Constant;
  int64_t warmup_steps = 0;
  int64_t total_steps = 0;  // T: where linear and cosine reach 0

  // Transformers' names: "constant", "constant_with_warmup", "linear", "cosine".  Throws
  // kcpp::Error naming the choices for another name, and for what the schedule cannot mean: a
  // negative warmup, warmup steps for "constant" (Transformers ignores them there: use
  // constant_with_warmup), a decaying schedule with no steps, or warmup that is not shorter than it.
  static LrSchedule make(std::string_view name, int64_t warmup_steps, int64_t total_steps);

  double factor(int64_t t) const;
  // Whether the rate changes from step to step.
  bool varies() const { return kind != LrScheduleKind::Constant; }
  // Whether it reaches 0 at total_steps (linear, cosine): a run must not go past that.
  bool decays() const { return kind == LrScheduleKind::Linear || kind == LrScheduleKind::Cosine; }
};

const char* lr_schedule_name(LrScheduleKind kind);

}  // namespace kcpp::train
