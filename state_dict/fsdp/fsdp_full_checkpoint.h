// A FULL checkpoint of an FSDP model (and optimizer) written without
// gathering the model: rank 0 writes model.pt (state_dict/checkpoint.h's
// SaveFullCheckpoint), and each tensor travels to it from the ranks that
// hold its pieces just before its record is written. So a FULL save adds
// one tensor (the largest) to rank 0's memory and nothing to the others',
// where GetModelStateDict(kFull) + SaveFullCheckpoint holds the whole model
// (and FullOptimStateDict its state) on rank 0 first.
//
// PyTorch: FSDP's FULL_STATE_DICT with rank0_only and offload_to_cpu, then
// torch.save on rank 0 — the same file, which torch.load reads as a dict of
// full tensors; Python gathers a unit at a time and holds the whole dict
// before torch.save writes it.
//
//   auto model_sd = GetModelStateDict(model, StateDictType::kSharded);
//   auto optim_sd = ShardedOptimStateDict(model, optimizer);
//   auto both = MergeShardedStateDicts(*model_sd, *optim_sd);
//   // every rank, collectively:
//   SaveFsdpFullCheckpoint(root, step, *both, group);
//
// Entries are written under their SHARDED names ("<fqn>", "<fqn>/<entry>"
// for the optimizer's), in the dict's order, each in its global shape and
// dtype; rename them (and add entries, e.g. the trainer's step, as
// replicated one-piece tensors) in the dict before the call. Where rank 0
// holds a whole tensor (replicated entries, NO_SHARD, a parameter inside
// its shard) it is written from rank 0's view without a copy.
//
// Errors (every rank returns one, nobody is left waiting): ranks whose
// dicts differ in names, dtypes or shapes, a rank with more than one piece
// of a tensor, pieces that leave part of a tensor uncovered
// (InvalidArgument naming the tensor and the ranks); rank 0's write failing
// (its error on rank 0, FailedPrecondition "... failed on rank 0" elsewhere; the
// ranks still sending are drained, nothing is committed); a rank that
// dies or stops answering (comm's timeout: Unavailable).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "comm/process_group.h"
#include "state_dict/fsdp/fsdp_state_dict.h"
#include "state_dict/fsdp/sharded_model.h"

namespace state_dict {

// Collective over `group` (the group `state` was taken on: its world size
// and rank). `state` must be kSharded (GetModelStateDict, possibly merged
// with ShardedOptimStateDict). Rank 0 of `group` writes
// "<root>/step_<step>" (AlreadyExists if complete already).
absl::Status SaveFsdpFullCheckpoint(const std::string& root, int64_t step,
                                    const FsdpModelStateDict& state,
                                    const comm::ProcessGroup& group);

// The same, as a Hugging Face checkpoint directory (hf_checkpoint.h's
// WriteHfCheckpoint: `dtype`, files of at most `max_shard_bytes`,
// `config_json` as config.json), written by rank 0 of `group` one tensor at
// a time. `state` holds the model's entries only (no optimizer state).
absl::Status SaveFsdpHfCheckpoint(const std::string& dir, const FsdpModelStateDict& state,
                                  const comm::ProcessGroup& group, c10::ScalarType dtype,
                                  int64_t max_shard_bytes, const std::string& config_json);

// A Hugging Face checkpoint directory (hf_checkpoint.h: one file or
// sharded with its index; float32, bfloat16 or float16, converted) into
// either FSDP's shards: every tensor's name, shape and dtype is checked
// against the model (both ways: a tensor the model lacks is refused) before
// any is read, then each rank reads only its ranges of each tensor, one
// tensor at a time (LoadModelTensorByTensor), so no rank holds more than
// its shard plus one tensor's pieces. Errors name the directory, the tensor
// and both values. Local (no collective): every rank loads its own ranges.
absl::Status LoadHfCheckpointIntoShards(const std::string& dir, ShardedModel& model);

// What both are made of: every tensor of `state` gathered onto rank 0 of
// `group`, one at a time, as `write`'s source (TensorSpec, TensorSource:
// tensor_dict.h), on rank 0 only; the other ranks send their pieces as
// rank 0 asks for them. `what` names the operation in errors. Collective,
// with the errors above.
using GatheredWrite =
    std::function<absl::Status(const std::vector<TensorSpec>& specs, const TensorSource& source)>;
absl::Status WriteGatheredOnRank0(const FsdpModelStateDict& state, const comm::ProcessGroup& group,
                                  const std::string& what, const GatheredWrite& write);

}  // namespace state_dict
