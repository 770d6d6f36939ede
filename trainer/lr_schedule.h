// The learning rate of each optimizer step, from --lr, --lr-schedule,
// --warmup-steps and --steps. A pure function of the step, so a resumed run
// needs no scheduler state.
#pragma once

#include <cstdint>

#include "trainer/options.h"

namespace trainer {

// Step `step` (1-based): linear warmup lr*step/warmup for step <= warmup;
// then `constant`: lr; `cosine`: lr * (1 + cos(pi * p)) / 2 with
// p = (step - warmup) / (steps - warmup), reaching 0 at --steps.
double LearningRate(const Options& options, int64_t step);

}  // namespace trainer
