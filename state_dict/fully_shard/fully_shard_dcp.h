// A fully_shard model's (and its optimizer's) state to and from
// torch.distributed.checkpoint directories (dcp.h), keyed as Python saves
// FSDP2 state:
//
//   msd, osd = get_state_dict(model, optimizer)
//   dcp.save({"model": msd, "optim": osd}, checkpoint_id=dir)
//
//   model.<fqn>                   a parameter (its Shard(0) rows per rank)
//                                 or buffer
//   optim.state.<fqn>.<entry>     exp_avg, exp_avg_sq, step, momentum_buffer
//   optim.param_groups.<i>.<opt>  lr, betas, ..., params (FQNs)
//
// The same keys as FullyShardedDataParallel's (fsdp_dcp.h), so a directory
// either wrote loads into the other. A directory Python's fully_shard (or
// FSDP1) wrote on any world size loads here on any other, each rank reading
// only the chunks that overlap its rows; what we write loads into Python's
// fully_shard with dcp.load + set_state_dict (fully_shard_dcp_test checks
// both against Python itself).
//
//   SaveFullyShardDcpShard(dir, *model, &optimizer);   // every rank
//   barrier;
//   if (rank == 0) CommitDcpCheckpoint(dir, world_size);
//
//   LoadFullyShardDcp(dir, *model, &optimizer);        // every rank
//
// The optimizer keeps its own hyperparameters on load (the saved ones are
// readable with DcpCheckpoint::LoadObject). Errors name the directory and
// the key; each load checks everything before it writes.
#pragma once

#include <string>
#include <vector>

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include "absl/status/status.h"
#include "state_dict/dcp.h"

namespace state_dict {

// This rank's part: the model's SHARDED state (FullyShardModelStateDict)
// and, when `optimizer` is not null, its state and param groups (with
// Python's option names, the options LibTorch lacks at their fixed values,
// as SaveFsdpDcpShard). `extra_objects`: values saved beside them (rank
// 0's), as SaveFsdpDcpShard's; a path under "model" or "optim" is
// InvalidArgument. Commit with CommitDcpCheckpoint after every rank
// returned.
absl::Status SaveFullyShardDcpShard(const std::string& dir, torch::nn::Module& model,
                                    const torch::optim::Optimizer* optimizer,
                                    const std::vector<DcpShard::Object>& extra_objects = {});

// Loads `dir` into the model and, when `optimizer` is not null, the
// optimizer's per-parameter state (the optimizer's first, then the
// model's).
absl::Status LoadFullyShardDcp(const std::string& dir, torch::nn::Module& model,
                               torch::optim::Optimizer* optimizer);
absl::Status LoadFullyShardDcp(const DcpCheckpoint& checkpoint, torch::nn::Module& model,
                               torch::optim::Optimizer* optimizer);

}  // namespace state_dict
