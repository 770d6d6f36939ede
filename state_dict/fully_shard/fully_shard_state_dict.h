// State dicts of a module tree fully_shard (fsdp/fully_shard.h, PyTorch's
// FSDP2) was applied to, and its optimizer's, as PyTorch's
// torch.distributed.checkpoint.state_dict gives them for FSDP2:
//
//   get_model_state_dict(model)            FullyShardModelStateDict
//   get_optimizer_state_dict(model, optim) FullyShardOptimStateDict
//   set_model_state_dict / set_optimizer_state_dict
//                                          LoadFullyShardStateDict
//
// fully_shard shards every parameter in place, so the keys are the module's
// own FQNs ("blocks.0.fc1.weight"): no wrapper prefix, the same names as
// the unwrapped model's and as FullyShardedDataParallel's SHARDED and FULL
// state dicts (fsdp_state_dict.h). A sharded parameter is this rank's dim-0
// rows (Python's DTensor with Shard(0)), as one ShardedTensor piece at its
// flat offset (rows [dim0_offset, dim0_offset + rows) of the global
// parameter, flattened); a rank with an empty shard has no piece.
// Parameters fully_shard does not manage and buffers are whole on every
// rank and saved by rank 0 only ("replicated").
//
// The optimizer's entries are named "<fqn>/<entry>" (exp_avg, exp_avg_sq,
// max_exp_avg_sq, momentum_buffer: sharded like their parameter; "step": a
// 0-dim tensor, replicated), as FSDP1's ShardedOptimStateDict names them:
// the dicts are FsdpModelStateDicts of kind kSharded, so everything that
// writes FSDP1's (SaveModelCheckpoint, ShardToSave, SaveFsdpFullCheckpoint,
// MergeShardedStateDicts) writes these, and a checkpoint of either loads
// into the other at any world size (reshard on load).
//
//   auto state = FullyShardStateDict(*model, &optimizer);    // every rank
//   SaveFullyShardCheckpoint(root, step, *model, &optimizer,
//                            FullyShardCheckpointKind::kSharded);
//   ...
//   LoadFullyShardCheckpoint(*model, &optimizer, StepDirectory(root, step));
//
// The tensors of a got state dict are views of the live shards and
// optimizer state (as Python's); clone to keep a snapshot. Before reading
// or writing, every fully_shard module of the tree is resharded (PyTorch's
// state_dict hooks do the same), so call these between steps.
//
// Loads check everything before they write: every expected key present,
// of the expected global shape and dtype, covering this rank's rows; keys
// the model does not have (FSDP1's LOCAL "flat_param" keys, a typo) are
// refused by LoadFullyShardStateDict (PyTorch's strict=True). Errors
// (InvalidArgument / NotFound, the layer's rule: absl::Status) name the
// key, what it is and what was expected; the model and the optimizer are
// untouched on error.
//
// Optimizers: torch::optim Adam, AdamW, SGD (and optim/'s subclasses of
// them) stepping the model's sharded parameters. Every function is called
// by every rank of the shards' group (HSDP: every rank of the mesh).
// HSDP (a 2-D mesh of replicate x shard): rank (replicate index r, shard
// rank s) is checkpoint rank r * shard size + s of replicate x shard, as
// FSDP1's hybrid strategies number them, and only replica 0 writes the
// shard pieces (and, FULL, gathers and writes model.pt), so an HSDP
// checkpoint is an ordinary sharded one, loading anywhere.
// shard_placement_fn's Shard(d) shards, d > 0 (Python's DTensor with
// Shard(d)), are one piece per index of the dims before d (a 2-D weight on
// Shard(1): one piece per row, at that row's columns) and load into either
// layout; a FULL save (SaveFullyShardCheckpoint kFull) gathers each of them
// whole onto every rank of the group before writing it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>
#include <memory>

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "comm/process_group.h"
#include "state_dict/fsdp/fsdp_optim_state_dict.h"
#include "state_dict/fsdp/fsdp_state_dict.h"
#include "state_dict/fsdp/sharded_model.h"
#include "state_dict/sharded_tensor.h"
#include "state_dict/tensor_dict.h"

namespace state_dict {

// fully_shard's ShardedModel (sharded_model.h: the description of the shards
// our checkpoints, DCP and Hugging Face directories read and write
// through): the functions below. `model` must outlive the result.
std::unique_ptr<ShardedModel> ShardedModelOf(torch::nn::Module& model);

// The group the model's parameters are sharded over (that of its first
// sharded parameter; HSDP: the shard group). FailedPrecondition when fully_shard sharded none of
// `model`'s parameters.
absl::StatusOr<comm::ProcessGroup> FullyShardGroup(const torch::nn::Module& model);

// PyTorch's get_model_state_dict(model) for fully_shard: kSharded, each
// parameter's and buffer's entry under its FQN (above).
absl::StatusOr<FsdpModelStateDict> FullyShardModelStateDict(torch::nn::Module& model);

// PyTorch's get_optimizer_state_dict(model, optimizer) (the state, not the
// param_groups: a load keeps the optimizer's own hyperparameters; DCP saves
// them, fully_shard_dcp.h): "<fqn>/<entry>" entries. InvalidArgument for an
// optimizer parameter that is not one of `model`'s.
absl::StatusOr<FsdpModelStateDict> FullyShardOptimStateDict(
    torch::nn::Module& model, const torch::optim::Optimizer& optimizer);

// Both in one dict (the optimizer's entries after the model's), what one
// SaveModelCheckpoint writes; `optimizer` may be null.
absl::StatusOr<FsdpModelStateDict> FullyShardStateDict(torch::nn::Module& model,
                                                       const torch::optim::Optimizer* optimizer);

// PyTorch's get_model_state_dict / get_optimizer_state_dict with
// StateDictOptions(full_state_dict=True): every entry of
// FullyShardStateDict(model, optimizer) whole, in its global shape ("<fqn>"
// and "<fqn>/<entry>"), each sharded one all-gathered over the shards'
// group (so the caller holds the whole model, as Python's does). With
// `rank0_only` (Python's cpu_offload=True behaviour) ranks other than 0 get
// an empty dict. Collective. SaveFullyShardCheckpoint(kFull) writes the same
// tensors holding one at a time.
absl::StatusOr<TensorDict> FullyShardFullStateDict(torch::nn::Module& model,
                                                   const torch::optim::Optimizer* optimizer,
                                                   bool rank0_only = false);

// The optimizer's param_groups, each listing its parameters' FQNs, with
// its hyperparameters under Python's names (as get_optimizer_state_dict's
// param_groups). Local.
absl::StatusOr<std::vector<OptimParamGroup>> FullyShardParamGroups(
    const torch::nn::Module& model, const torch::optim::Optimizer& optimizer);

// PyTorch's set_model_state_dict + set_optimizer_state_dict from any reader
// (fsdp_state_dict.h's ShardedReader: a checkpoint directory, a DCP
// directory, an in-memory dict): every parameter's and buffer's entry
// ("<fqn>") is requested for this rank's rows and, when `optimizer` is not
// null, each entry of `optim_entries` ("<fqn>/<entry>", with its saved
// global shape and dtype) for its parameter's rows. `source` names the
// source in errors. The optimizer's state is checked and loaded first,
// then the model's (each all-or-nothing).
absl::Status LoadFullyShardFrom(torch::nn::Module& model, torch::optim::Optimizer* optimizer,
                                const std::string& source,
                                const std::vector<ShardedEntryInfo>& optim_entries,
                                const ShardedReader& read);

// From an in-memory SHARDED dict (any world size's pieces, e.g. every
// rank's of another run, or one rank's FULL tensors as single pieces):
// strict, so a key that is neither a parameter or buffer of `model` nor
// "<fqn>/<entry>" of one is refused (with `optimizer` null, optimizer
// entries are skipped).
absl::Status LoadFullyShardStateDict(torch::nn::Module& model, torch::optim::Optimizer* optimizer,
                                     const ShardedStateDict& state);

// How SaveFullyShardCheckpoint writes a step directory (checkpoint.h).
enum class FullyShardCheckpointKind {
  // Every rank writes its pieces (rank_<r>.pt), rank 0 commits: loads on
  // any world size, in fully_shard and in FullyShardedDataParallel.
  kSharded,
  // Rank 0 writes model.pt, each tensor gathered onto it just before its
  // record is written (fsdp_full_checkpoint.h): Python's torch.load opens it
  // as a dict {"model.<fqn>": tensor, "optim.<fqn>.<entry>": tensor}
  // (checkpoint_keys.h; the trainer's FULL layout).
  kFull,
};

// Collective: writes and commits "<root>/step_<step>" (the sharded kind's
// commit after every rank's pieces are durable; a failure on any rank is
// returned on every rank and nothing is committed).
absl::Status SaveFullyShardCheckpoint(const std::string& root, int64_t step,
                                      torch::nn::Module& model,
                                      const torch::optim::Optimizer* optimizer,
                                      FullyShardCheckpointKind kind);

// Loads a step directory of either kind, written at any world size by
// fully_shard or by FullyShardedDataParallel: sharded checkpoints read only
// this rank's rows; FULL ones are found under "<fqn>" (SaveModelCheckpoint
// of a kFull dict) or "model.<fqn>" / "optim.<fqn>.<entry>"
// (SaveFullyShardCheckpoint's kFull, the trainer's FULL). With `optimizer`,
// the checkpoint must hold optimizer state for every parameter that has
// some in it; parameters it has none for keep none.
absl::Status LoadFullyShardCheckpoint(torch::nn::Module& model, torch::optim::Optimizer* optimizer,
                                      const std::string& step_dir);

}  // namespace state_dict
