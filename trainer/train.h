// The training loop of one rank: build the model and data from Options,
// optionally resume, train, log and checkpoint.
//
// The model is wrapped in FSDP as wrap.h says. Every rank computes the
// gradient of its B/W rows and FSDP reduces (averages) the gradients in
// backward. Because the global batch is split, not replicated, the loss
// sequence does not depend on W. Checkpoints, resume and --async-checkpoint:
// checkpointing.h.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <torch/optim/optimizer.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "c10/util/Exception.h"
#include "comm/process_group.h"
#include "trainer/options.h"

namespace trainer {

struct TrainResult {
  int64_t first_step = 1;      // > 1 when resumed
  std::vector<double> losses;  // global mean loss of steps first_step, ...
};

// Trains on this process as one rank of `group` (a 1-rank group for a
// single process; every rank calls Train with the same options). Rank 0
// prints progress to stdout and writes --log-json.
absl::StatusOr<TrainResult> Train(const Options& options, const comm::ProcessGroup& group);

// The trainer's exit status when a rank ran out of memory (IsOutOfMemory):
// distinct from 1 (any other error) and 2 (bad flags).
constexpr int kExitOutOfMemory = 3;

// Whether `status` is Train's out-of-memory error: an allocation failed in a
// step (CUDA's caching allocator threw c10::OutOfMemoryError, or the CPU
// allocator failed). Its code is ResourceExhausted and its message names
// the step, the device and the device's memory figures in the step (CUDA:
// the caching allocator's peak allocated and reserved bytes, and what it
// holds now; CPU: the process's peak RSS). The step's update was not
// applied and no checkpoint was being written, so every checkpoint written
// before it is complete and loads.
bool IsOutOfMemory(const absl::Status& status);

// `e`, thrown out of Train (outside a step's guard: building, wrapping,
// resuming), as a status: an allocation failure becomes an out-of-memory
// status (IsOutOfMemory), anything else Internal with its message.
absl::Status OutOfMemoryOutsideStep(const c10::Error& e);

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
absl::StatusOr<int64_t> ShardedStateBytes(const std::vector<at::Tensor>& params,
                                          const torch::optim::Optimizer& optimizer);

}  // namespace trainer
