// An FSDP model's (and its optimizer's) state to and from
// torch.distributed.checkpoint directories (dcp.h), keyed as Python saves
// FSDP state:
//
//   dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=dir)
//
// with model_sd from FullyShardedDataParallel's SHARDED_STATE_DICT or from
// fully_shard (FSDP2) via get_state_dict, and optim_sd from
// FSDP.optim_state_dict / get_state_dict:
//
//   model.<fqn>                   a parameter or buffer
//   optim.state.<fqn>.<entry>     exp_avg, exp_avg_sq, step, momentum_buffer
//   optim.param_groups.<i>.<opt>  lr, betas, ..., params (FQNs)
//
// A checkpoint of any world size and layout (FSDP1's and FSDP2's row
// chunks, ours cut at flat offsets) loads into our FSDP under any strategy
// and world size; what we save loads into Python FSDP and FSDP2 with
// dcp.load (checked in fsdp_dcp_test against Python itself).
//
//   // every rank (the last argument, optional: values beside the state,
//   // as dcp.save({..., "trainer": {"step": 12}}) saves a python int):
//   SaveFsdpDcpShard(dir, model, &optimizer, {{{"trainer", "step"}, int64_t{12}}});
//   barrier;
//   if (rank == 0) CommitDcpCheckpoint(dir, world_size);
//
//   LoadFsdpDcp(dir, model, &optimizer);  // every rank
//
// Loading takes the model's and the optimizer's state; the optimizer keeps
// its own hyperparameters (as a resume from our checkpoints does) — the
// saved ones are readable with DcpCheckpoint::LoadObject. Optimizers:
// torch::optim Adam, AdamW and SGD (fsdp_optim_state_dict.h). Errors name the
// directory and the key. The optimizer's state is loaded first, then the
// model's; each load checks everything it reads before it writes, so a bad
// entry leaves that part untouched (a bad model entry after a good
// optimizer load leaves the optimizer loaded).
#pragma once

#include <functional>
#include <string>
#include <vector>

#include <torch/optim/optimizer.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "fsdp/fully_sharded_data_parallel.h"
#include "state_dict/dcp.h"
#include "state_dict/fsdp/fsdp_state_dict.h"
#include "state_dict/fsdp/sharded_model.h"
#include "state_dict/optim_state.h"

namespace state_dict {

// Either FSDP's model and optimizer (sharded_model.h), as SaveFsdpDcpShard
// and LoadFsdpDcp below describe; those and fully_shard_dcp.h's are these
// for one FSDP.
absl::Status SaveShardedModelDcp(const std::string& dir, ShardedModel& model,
                                 const torch::optim::Optimizer* optimizer,
                                 const std::vector<DcpShard::Object>& extra_objects = {});
absl::Status LoadShardedModelDcp(const DcpCheckpoint& checkpoint, ShardedModel& model,
                                 torch::optim::Optimizer* optimizer);

// This rank's part: the model's SHARDED state and, when `optimizer` is not
// null, its sharded state and param groups (with Python's option names,
// including the options LibTorch's optimizers lack at their fixed values:
// foreach None, capturable/differentiable False, fused None,
// decoupled_weight_decay for AdamW). Collective (the optimizer's sharded
// state dict is). Commit with CommitDcpCheckpoint (dcp.h) after every rank
// returned.
//
// `extra_objects`: other values to save beside them, as Python's dcp.save
// saves the non-tensor leaves of its state dict (torch.save's bytes of a
// python int, float, str, ...): {{"trainer", "step"}, int64_t{12}} is the
// entry "trainer.step", which Python's
// dcp.load({"trainer": {"step": 0}}, ...) fills in, and
// DcpCheckpoint::LoadObject("trainer.step") reads. Rank 0's are saved (DCP
// keeps one copy of a value every rank has); pass the same on every rank.
// InvalidArgument for a path under "model" or "optim" (the state's own) or an
// empty one.
absl::Status SaveFsdpDcpShard(const std::string& dir, fsdp::FullyShardedDataParallel& model,
                              const torch::optim::Optimizer* optimizer,
                              const std::vector<DcpShard::Object>& extra_objects = {});

// Loads `dir` into the model and, when `optimizer` is not null, the
// optimizer's per-parameter state. Every rank reads only the chunks that
// overlap its ranges.
absl::Status LoadFsdpDcp(const std::string& dir, fsdp::FullyShardedDataParallel& model,
                         torch::optim::Optimizer* optimizer);
// The same from a checkpoint already open (its metadata read once, e.g. by
// a caller that first checked its objects).
absl::Status LoadFsdpDcp(const DcpCheckpoint& checkpoint, fsdp::FullyShardedDataParallel& model,
                         torch::optim::Optimizer* optimizer);

}  // namespace state_dict
