#include "train/schedule.h"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "core/error.h"

namespace kcpp::train {

const char* lr_schedule_name(LrScheduleKind kind) {
  switch (kind) {
    case LrScheduleKind::Constant:
      return "constant";
    case LrScheduleKind::ConstantWithWarmup:
      return "constant_with_warmup";
    case LrScheduleKind::Linear:
      return "linear";
    case LrScheduleKind::Cosine:
      return "cosine";
  }
  return "?";
}

LrSchedule LrSchedule::make(std::string_view name, int64_t warmup_steps, int64_t total_steps) {
  LrSchedule s;
  if (name == "constant") s.kind = LrScheduleKind::Constant;
  else if (name == "constant_with_warmup") s.kind = LrScheduleKind::ConstantWithWarmup;
  else if (name == "linear") s.kind = LrScheduleKind::Linear;
  else if (name == "cosine") s.kind = LrScheduleKind::Cosine;
  else
    KCPP_FAIL("learning-rate schedule '{}' is not one of constant, constant_with_warmup, linear, cosine (Transformers' "
              "lr_scheduler_type names)", name);
  KCPP_CHECK(warmup_steps >= 0, "learning-rate schedule: {} warmup steps; give 0 or more", warmup_steps);
  KCPP_CHECK(s.kind != LrScheduleKind::Constant || warmup_steps == 0,
             "learning-rate schedule: 'constant' has no warmup ({} warmup steps given); use constant_with_warmup", warmup_steps);
  KCPP_CHECK(!s.decays() || warmup_steps < total_steps,
             "learning-rate schedule '{}' over {} steps with {} warmup steps: the warmup must end before the schedule does",
             name, total_steps, warmup_steps);
  s.warmup_steps = warmup_steps;
  s.total_steps = total_steps;
  return s;
}

double LrSchedule::factor(int64_t t) const {
  const double w = static_cast<double>(warmup_steps), n = static_cast<double>(total_steps), x = static_cast<double>(t);
  if (kind == LrScheduleKind::Constant) return 1.0;
  if (t < warmup_steps) return x / std::max(1.0, w);
  switch (kind) {
    case LrScheduleKind::ConstantWithWarmup:
      return 1.0;
    case LrScheduleKind::Linear:
      return std::max(0.0, (n - x) / std::max(1.0, n - w));
    case LrScheduleKind::Cosine: {
      const double p = (x - w) / std::max(1.0, n - w);
      return std::max(0.0, 0.5 * (1.0 + std::cos(std::numbers::pi * p)));
    }
    case LrScheduleKind::Constant:
      break;
  }
  return 1.0;
}

}  // namespace kcpp::train
