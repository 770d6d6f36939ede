// The training loop of one rank: build the model and data from Options,
// optionally resume, train, log and checkpoint.
//
// Distributed runs (a comm::ProcessGroup of W > 1 ranks) are plain data
// parallel for now: every rank holds the whole model, computes the gradient
// of its B/W rows, and the gradients are averaged with one comm::all_reduce
// per optimizer step. Because the global batch is split, not replicated,
// the loss sequence does not depend on W. FSDP (issue #7) replaces the
// model wrapping and that all-reduce; see README "FSDP integration".
//
// Checkpoints are FULL, written by rank 0 through state_dict/: one
// TensorDict with "model.<fqn>" (the model's state dict),
// "optim.<fqn>.<entry>" (the optimizer state, name-keyed, e.g.
// "optim.blocks.0.fc1.weight.exp_avg") and "trainer.step" / "trainer.seed".
// The batch of a step is a function of (seed, step) and the model has no
// randomness in training (no dropout), so model + optimizer + step is
// everything a resumed run needs to continue the exact loss sequence.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "comm/process_group.h"
#include "trainer/options.h"

namespace trainer {

struct TrainResult {
  int64_t first_step = 1;     // > 1 when resumed
  std::vector<double> losses;  // global mean loss of steps first_step, ...
};

// Trains on this process. `group` is null for a single process, else the
// world group (every rank calls Train with the same options). Rank 0 prints
// progress to stdout and writes --log-json.
absl::StatusOr<TrainResult> Train(const Options& options,
                                  const comm::ProcessGroup* group);

}  // namespace trainer
