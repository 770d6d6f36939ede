// The training loop of one rank: build the model and data from Options,
// optionally resume, train, log and checkpoint.
//
// The model is always wrapped in fsdp::FullyShardedDataParallel over the
// given group (one rank included: one code path), per --sharding,
// --auto-wrap, --backward-prefetch, --mixed-precision and --cpu-offload,
// with use_orig_params so the stock optimizers run per original parameter
// (on this rank's part of it). Every rank computes the gradient of its B/W
// rows and FSDP reduces (averages) the gradients in backward. Because the
// global batch is split, not replicated, the loss sequence does not depend
// on W.
//
// Checkpoints are FULL until FSDP's sharded state-dict API (issue #8):
// every rank gathers the full parameters (summon_full_params) and the full
// optimizer state (all-gather of each state entry's shard pieces), rank 0
// writes them through state_dict/: one
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

// Trains on this process as one rank of `group` (a 1-rank group for a
// single process; every rank calls Train with the same options). Rank 0
// prints progress to stdout and writes --log-json.
absl::StatusOr<TrainResult> Train(const Options& options,
                                  const comm::ProcessGroup& group);

}  // namespace trainer
