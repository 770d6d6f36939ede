#include "trainer/lr_schedule.h"

#include <algorithm>
#include <cmath>

namespace trainer {

double LearningRate(const Options& o, int64_t step) {
  if (step <= o.warmup_steps) {
    return o.lr * static_cast<double>(step) / static_cast<double>(o.warmup_steps);
  }
  if (o.lr_schedule == LrSchedule::kConstant) return o.lr;
  const double progress = static_cast<double>(step - o.warmup_steps) /
                          static_cast<double>(std::max<int64_t>(1, o.steps - o.warmup_steps));
  return o.lr * 0.5 * (1.0 + std::cos(M_PI * std::min(1.0, progress)));
}

}  // namespace trainer
