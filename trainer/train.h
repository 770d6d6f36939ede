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
// Checkpoints (--checkpoint-dir, --checkpoint-every) go through
// state_dict/'s FSDP state-dict API. --checkpoint-format=sharded (the
// default): every rank writes its pieces of each original parameter and of
// its optimizer state (SHARDED model + optimizer state dicts, no gathering)
// plus "trainer.step" / "trainer.seed" with rank 0's; rank 0 commits once all
// are durable. --checkpoint-format=full: the FULL model and optimizer state
// dicts are gathered onto rank 0, which writes one model.pt that Python's
// torch.load opens ("model.<fqn>", "optim.<fqn>.<entry>", "trainer.step",
// "trainer.seed"). --resume reads either format on any world size and
// strategy (reshard on load). The batch of a step is a function of (seed,
// step) and the model has no randomness in training (no dropout), so model
// + optimizer + step is everything a resumed run needs to continue the
// exact loss sequence.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <torch/optim/optimizer.h>
#include <torch/types.h>

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

// The checkpoint to resume from, chosen once for the job: rank 0 takes the
// newest under `dir` that verifies, setting damaged newer ones aside with a
// message on stderr naming each, where it went and why
// (state_dict::RecoverLatestCheckpoint); the other ranks wait for it and
// then find the same one. Empty when there is none. Every rank calls it.
absl::StatusOr<std::optional<std::string>> ChooseResumeCheckpoint(
    const std::string& dir, const comm::ProcessGroup& group);

// The device this process computes on for --device: the CPU, or CUDA GPU
// LOCAL_RANK % (GPUs visible). For cuda, an Unimplemented error when this
// build has no CUDA and a FailedPrecondition one when the process sees no
// GPU, each naming what is missing.
absl::StatusOr<c10::Device> ComputeDevice(const Options& options);

// The process-group backend for --device: "gloo", or comm::kGlooCpuNcclCuda
// (NCCL for the model's CUDA tensors, Gloo for the trainer's CPU ones).
std::string ProcessGroupBackend(const Options& options);

// Bytes of the parameters `params`, their gradients and `optimizer`'s state
// (the JSON log's sharded_state_bytes of a rank: with FSDP's
// use_orig_params, `params` are views of the rank's shard, so this counts
// its shard, padding excluded).
absl::StatusOr<int64_t> ShardedStateBytes(const std::vector<torch::Tensor>& params,
                                          const torch::optim::Optimizer& optimizer);

}  // namespace trainer
