// Optimizer state dicts of an FSDP model (PyTorch's FSDP.optim_state_dict,
// optim_state_dict_to_load and the older full_/sharded_/shard_full_/
// scatter_full_/flatten_sharded_optim_state_dict), for torch::optim Adam,
// AdamW and SGD stepping the model's parameters() — the original
// parameters (use_orig_params=true; each a 1-D view of this rank's part)
// or one flat parameter per unit (use_orig_params=false) — under every
// sharding strategy.
//
// Whatever the optimizer steps, the state dicts here are per ORIGINAL
// parameter, named by its clean FQN ("blocks.0.fc1.weight"), as a plain
// model's optimizer would have them: a FULL dict from a flat-parameter run
// equals the one from a use_orig_params run and from an unwrapped model
// (rekeyed by name), so state moves freely between them. Per-parameter
// entries shaped like the parameter (exp_avg, exp_avg_sq, max_exp_avg_sq,
// momentum_buffer) are split like the parameter; 0-dim entries ("step") are
// per parameter (a flat parameter's step is every original's step; loading
// into one requires its originals to agree).
//
// Original parameter IDs: an ID-keyed FULL dict numbers the original
// parameters in the order the optimizer sees them, a flat parameter's
// originals in flattening order (with use_orig_params these are the
// optimizer's own IDs). Name-keyed dicts need no numbering.
//
// Every function validates everything before it changes the optimizer;
// errors name the parameter and entry. Functions marked collective must be
// called by every rank of the model.
#pragma once

#include <string>
#include <vector>

#include <torch/optim/optimizer.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "fsdp/fully_sharded_data_parallel.h"
#include "state_dict/fsdp/fsdp_state_dict.h"
#include "state_dict/optim_state.h"

namespace state_dict {

// The names of the original parameters by original parameter ID (above).
absl::StatusOr<std::vector<std::string>> FsdpOptimizerParamNames(
    const fsdp::FullyShardedDataParallel& model, const torch::optim::Optimizer& optimizer);

// PyTorch's full_optim_state_dict: name-keyed
// (OptimStateKeyType::kParamName), each entry in its parameter's original
// shape, param_groups listing original names. Collective; with rank0_only
// only rank 0 gets it (others an empty dict).
absl::StatusOr<OptimStateDict> FullOptimStateDict(fsdp::FullyShardedDataParallel& model,
                                                  const torch::optim::Optimizer& optimizer,
                                                  bool rank0_only = false);

// PyTorch's shard_full_optim_state_dict: this rank's part of a FULL
// optimizer state dict (name-keyed, or ID-keyed by original parameter ID),
// keyed by this optimizer's IDs, ready for ImportOptimizerState. A plain
// model's optimizer state rekeyed by name (RekeyOptimStateDict with the
// plain model's OptimizerParamNames) is such a dict. Hyperparameters are
// taken from `full` (matched by the parameters of each group). Local: every
// rank passes the whole dict.
absl::StatusOr<OptimStateDict> ShardFullOptimStateDict(const fsdp::FullyShardedDataParallel& model,
                                                       const torch::optim::Optimizer& optimizer,
                                                       const OptimStateDict& full);

// PyTorch's scatter_full_optim_state_dict: as ShardFullOptimStateDict, but
// only rank 0 holds the FULL dict (ignored elsewhere) and broadcasts the
// state. Every rank's result carries its own optimizer's current
// hyperparameters. A problem found on rank 0 is returned on every rank.
// Collective.
absl::StatusOr<OptimStateDict> ScatterFullOptimStateDict(fsdp::FullyShardedDataParallel& model,
                                                         const torch::optim::Optimizer& optimizer,
                                                         const OptimStateDict& full);

// PyTorch's sharded_optim_state_dict: each state entry as a ShardedTensor
// named "<param fqn>/<entry>" (e.g. "a.weight/exp_avg"), pieces at the
// parameter's global offsets, like the model's kSharded form; these names
// never collide with the model's, so both may be merged into one SaveShard.
// Hyperparameters are not included (loading keeps the optimizer's own).
// Pieces are views of the optimizer's live state (see fsdp_state_dict.h).
absl::StatusOr<FsdpModelStateDict> ShardedOptimStateDict(
    const fsdp::FullyShardedDataParallel& model, const torch::optim::Optimizer& optimizer);

// The model's SHARDED state dict with the optimizer's SHARDED entries added,
// so one SaveModelCheckpoint writes both (and LoadModelCheckpoint /
// LoadShardedOptimCheckpoint each read their own entries back). Both must be
// kSharded and taken on this rank.
absl::StatusOr<FsdpModelStateDict> MergeShardedStateDicts(FsdpModelStateDict model,
                                                          const FsdpModelStateDict& optimizer);

// PyTorch's flatten_sharded_optim_state_dict: this rank's part of a sharded
// optimizer state dict (pieces of any layout covering this rank's ranges,
// e.g. every rank's of a run at another world size or strategy), keyed by
// this optimizer's IDs with its current hyperparameters, ready for
// ImportOptimizerState. Model entries (names without '/') are skipped;
// entries of parameters the optimizer does not have are errors.
absl::StatusOr<OptimStateDict> FlattenShardedOptimStateDict(
    const fsdp::FullyShardedDataParallel& model, const torch::optim::Optimizer& optimizer,
    const FsdpModelStateDict& sharded);

// FlattenShardedOptimStateDict + ImportOptimizerState.
absl::Status LoadShardedOptimStateDict(const fsdp::FullyShardedDataParallel& model,
                                       torch::optim::Optimizer& optimizer,
                                       const FsdpModelStateDict& sharded);

// The same from a sharded checkpoint directory of any world size and
// strategy (only this rank's ranges are read).
absl::Status LoadShardedOptimCheckpoint(const fsdp::FullyShardedDataParallel& model,
                                        torch::optim::Optimizer& optimizer,
                                        const std::string& step_dir);

// The optimizer's param_groups, each listing the clean FQNs of its original
// parameters (as FSDP.optim_state_dict's param_groups do), with its
// hyperparameters under Python's names. Local.
absl::StatusOr<std::vector<OptimParamGroup>> NamedParamGroups(
    const fsdp::FullyShardedDataParallel& model, const torch::optim::Optimizer& optimizer);

// A tensor a sharded source holds: its name, global shape and dtype.
struct ShardedEntryInfo {
  std::string name;
  std::vector<int64_t> global_shape;
  c10::ScalarType dtype = c10::ScalarType::Float;
};

// LoadShardedOptimCheckpoint from any reader (fsdp_state_dict.h): the
// optimizer entries ("<fqn>/<entry>") among `entries` are requested for this
// rank's ranges and loaded; `source` names the source in errors.
absl::Status LoadShardedOptimFrom(const fsdp::FullyShardedDataParallel& model,
                                  torch::optim::Optimizer& optimizer, const std::string& source,
                                  const std::vector<ShardedEntryInfo>& entries,
                                  const ShardedReader& read);

// ---- the state_dict_type-driven API (PyTorch's optim_state_dict) ----------

// An optimizer state dict in one of the model's forms.
struct FsdpOptimStateDict {
  StateDictType type = StateDictType::kFull;
  OptimStateDict full;         // kFull (empty on ranks != 0 with rank0_only)
  FsdpModelStateDict sharded;  // kSharded
};

// PyTorch's FSDP.optim_state_dict: kFull → FullOptimStateDict (the
// config's rank0_only applies; tensors are on the CPU already), kSharded →
// ShardedOptimStateDict. kLocal is an error: an optimizer state is only
// meaningful per original parameter (use kSharded, which loads at any
// world size). Collective.
absl::StatusOr<FsdpOptimStateDict> GetOptimStateDict(fsdp::FullyShardedDataParallel& model,
                                                     const torch::optim::Optimizer& optimizer,
                                                     StateDictType type,
                                                     StateDictConfig config = {});
// In the model's current form (StateDictTypeGuard).
absl::StatusOr<FsdpOptimStateDict> GetOptimStateDict(fsdp::FullyShardedDataParallel& model,
                                                     const torch::optim::Optimizer& optimizer);

// PyTorch's FSDP.optim_state_dict_to_load: what ImportOptimizerState needs
// on this rank, from either form (kFull: every rank passes the whole dict;
// kSharded: FlattenShardedOptimStateDict).
absl::StatusOr<OptimStateDict> OptimStateDictToLoad(const fsdp::FullyShardedDataParallel& model,
                                                    const torch::optim::Optimizer& optimizer,
                                                    const FsdpOptimStateDict& state);

// OptimStateDictToLoad + ImportOptimizerState (all-or-nothing).
absl::Status LoadOptimStateDict(const fsdp::FullyShardedDataParallel& model,
                                torch::optim::Optimizer& optimizer,
                                const FsdpOptimStateDict& state);

}  // namespace state_dict
