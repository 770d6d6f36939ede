// A diverged run stops before it costs anything: the checks that keep NaN
// and Inf out of the optimizer update, the checkpoints and the imports.
//
//   * each step (train.cc): the global loss, this rank's gradients and, with
//     --clip, the global gradient norm clip_grad_norm_ returns must be
//     finite, or the run ends (exit 1) before that step's optimizer update,
//     naming the step and the value (CheckStepFinite). Where --cuda-graphs
//     captures the update too (trainer/cuda_graphs.h), the update is in the
//     graph and withheld on the device by found_inf (the same condition,
//     WriteFoundInf), and the host's read after the replay ends the run
//     alike. The last checkpoint
//     written is then the newest finite state, and --keep-last, which only
//     runs after a save, never removes it;
//   * each save (checkpointing.cc), and --export-dcp: every rank's
//     parameters and optimizer state are checked first; a non-finite one
//     fails the save on every rank, nothing is written, nothing is pruned;
//   * each load (--resume, a restart, --import-dcp of any format): the loaded
//     state is checked the same way, refused unless --allow-nonfinite-import.
//
// PyTorch has the pieces, not the policy: torch.nn.utils.clip_grad_norm_'s
// error_if_nonfinite, the AMP GradScaler's skipped steps
// (torch.amp.GradScaler, which this trainer does not do: a step is never
// silently skipped here).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/optim/optimizer.h>

#include "absl/status/status.h"
#include "state_dict/fsdp/sharded_model.h"

namespace trainer {

// Whether every gradient of `params` (this rank's) is finite; an undefined
// gradient counts as finite. One host sync.
bool LocalGradsFinite(const std::vector<at::Tensor>& params);

// The step's figures, agreed over ranks: OK, or FailedPrecondition naming
// the step and the first non-finite value, e.g.
//   "step 12: the global loss is nan: expected a finite number (the run
//    diverged; stopped before this step's optimizer update: the newest
//    checkpoint holds the last finite state; resume from it with a lower
//    --lr, or a larger --warmup-steps / --clip)".
// `grad_norm` < 0: not computed (no --clip); `grads_finite`: every rank's
// LocalGradsFinite.
absl::Status CheckStepFinite(int64_t step, double global_loss, double grad_norm, bool grads_finite);

// This rank's shards of the model (parameters and buffers under their
// FQNs) and of the optimizer's state ("<fqn>/<entry>"), either FSDP's
// (state_dict/fsdp/sharded_model.h): OK, or FailedPrecondition
// "<what>: parameter <fqn> holds N NaN/Inf values of M on this rank (the
// first at flat index I: nan): expected finite values" naming the first
// one (the model's entries first, then "optimizer state <fqn>/<entry>"; I
// is the index into the flattened global tensor, the same at any world
// size). Reads every element once.
absl::Status CheckStateFinite(state_dict::ShardedModel& model,
                              const torch::optim::Optimizer& optimizer, const std::string& what);

}  // namespace trainer
