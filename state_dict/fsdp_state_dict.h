// State dicts of an FSDP model (fsdp/fully_sharded_data_parallel.h), in the
// three forms of PyTorch's StateDictType:
//
//   kFull     every original parameter and buffer, full shape, clean FQNs
//             ("layers.0.weight"), as the unwrapped module's state dict.
//             Built under summon_full_params; loads on any world size.
//   kSharded  per ORIGINAL parameter, this rank's contiguous 1-D piece(s)
//             with global offsets and shape (ShardedTensor); buffers and
//             parameters FSDP does not manage (and, under NO_SHARD,
//             everything) are full on every rank and saved by rank 0 only.
//             SaveShard + CommitShardedCheckpoint write it; a checkpoint
//             written by N ranks loads on M ranks (reshard on load).
//   kLocal    the flat shards themselves ("<unit>.flat_param", the root's
//             "flat_param", padded shard as FSDP holds it) plus every buffer
//             and unmanaged parameter; loads only at the same world size.
//
// Every load validates the whole dict against the model (names, shapes,
// dtypes, covered ranges) before it writes anything: on error the model is
// untouched. Every rank must call the getters and loaders (kFull gathers;
// the others are local, but ranks should stay in step).
//
// Limitations (errors, not silent behaviour): the hybrid sharding
// strategies and models built with a device_mesh instead of a process_group
// are not supported (UnimplementedError).
//
// Optimizer state (bottom of this file) is supported for use_orig_params=true
// only: the optimizer (torch::optim Adam/AdamW/SGD) steps the original
// parameters, each a 1-D view of this rank's part of its flat shard.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "fsdp/fully_sharded_data_parallel.h"
#include "state_dict/optim_state.h"
#include "state_dict/pytorch_format.h"
#include "state_dict/sharded_tensor.h"

namespace state_dict {

enum class StateDictType { kFull, kSharded, kLocal };
const char* StateDictTypeName(StateDictType type);

// FullStateDictConfig's options (used by kFull only).
struct StateDictConfig {
  // Only rank 0 gathers into the returned dict; other ranks get an empty one.
  bool rank0_only = false;
  // The returned tensors are on the CPU.
  bool offload_to_cpu = false;
};

// The per-model default form (PyTorch's FSDP.state_dict_type context
// manager): while the guard lives, GetModelStateDict(model) without an
// explicit type uses `type` and `config`; the previous setting (kFull with
// default config when none) comes back when it is destroyed. Guards of one
// model must nest.
class StateDictTypeGuard {
 public:
  StateDictTypeGuard(const fsdp::FullyShardedDataParallel& model, StateDictType type,
                     StateDictConfig config = {});
  ~StateDictTypeGuard();
  StateDictTypeGuard(const StateDictTypeGuard&) = delete;
  StateDictTypeGuard& operator=(const StateDictTypeGuard&) = delete;

 private:
  const fsdp::FullyShardedDataParallel* model_;
  bool had_previous_;
  StateDictType previous_type_;
  StateDictConfig previous_config_;
};

// The model's current default (see StateDictTypeGuard).
StateDictType CurrentStateDictType(const fsdp::FullyShardedDataParallel& model);
StateDictConfig CurrentStateDictConfig(const fsdp::FullyShardedDataParallel& model);

struct FsdpModelStateDict {
  StateDictType type = StateDictType::kFull;
  // kFull: name -> full tensor (empty on ranks != 0 with rank0_only).
  TensorDict full;
  // kSharded: original FQN -> this rank's pieces. kLocal: flat-parameter
  // names -> this rank's padded shard (one piece at its flat offset), and
  // buffers / unmanaged parameters as one full piece.
  ShardedStateDict sharded;
  // kSharded: entries every rank holds in full (buffers, unmanaged
  // parameters; everything under NO_SHARD); only rank 0 saves their pieces.
  std::vector<std::string> replicated;
  // The data-parallel world size and rank it was taken at.
  int world_size = 1;
  int rank = 0;
};

// This rank's state dict in `type` form (`config` applies to kFull).
absl::StatusOr<FsdpModelStateDict> GetModelStateDict(
    fsdp::FullyShardedDataParallel& model, StateDictType type, StateDictConfig config = {});
// In the model's current default form (StateDictTypeGuard).
absl::StatusOr<FsdpModelStateDict> GetModelStateDict(fsdp::FullyShardedDataParallel& model);

// Loads `state` (any form) into the model. kFull: every rank passes the
// whole dict (exact names and shapes; written back under
// summon_full_params). kSharded: the pieces must cover what this rank
// holds under the current world size (pieces of any layout, e.g. every
// rank's of an older run, are resharded). kLocal: only at the world size
// and rank it was taken at.
absl::Status LoadModelStateDict(fsdp::FullyShardedDataParallel& model,
                                const FsdpModelStateDict& state);

// Checkpoints (checkpoint.h). kFull: rank 0 writes model.pt
// (SaveFullCheckpoint), others write nothing. kSharded/kLocal: every rank
// writes its shard (SaveShard); then, after a barrier, the caller commits
// once with CommitShardedCheckpoint. `state` must come from this model.
absl::Status SaveModelCheckpoint(const std::string& root, int64_t step,
                                 const FsdpModelStateDict& state);

// Loads a checkpoint step directory in form `type` into the model: kFull
// reads the FULL dict (a full or a sharded checkpoint of any world size;
// optimizer entries "<param>/<entry>" saved alongside are skipped),
// kSharded reads only this rank's ranges from a sharded checkpoint of any
// world size (LoadResharded), kLocal this rank's file of a checkpoint of the
// same world size. All checks happen before the model is written.
absl::Status LoadModelCheckpoint(fsdp::FullyShardedDataParallel& model,
                                 const std::string& step_dir, StateDictType type);

// ---- optimizer state (use_orig_params=true) -------------------------------
//
// Per-parameter state entries with the parameter's shape (exp_avg,
// exp_avg_sq, max_exp_avg_sq, momentum_buffer) are sharded like the
// parameter; 0-dim entries ("step") are the same on every rank holding
// the parameter. Every function errors with "not implemented: requires
// use_orig_params=true" for a model built without it. Every rank must call
// the functions that gather (FullOptimStateDict).

// PyTorch's full_optim_state_dict / optim_state_dict(FULL): name-keyed
// (OptimStateKeyType::kParamName), each entry in its parameter's original
// shape, param_groups with names. Collective over the model's group; with
// rank0_only only rank 0 gets it (others an empty dict).
absl::StatusOr<OptimStateDict> FullOptimStateDict(fsdp::FullyShardedDataParallel& model,
                                                  const torch::optim::Optimizer& optimizer,
                                                  bool rank0_only = false);

// PyTorch's shard_full_optim_state_dict / optim_state_dict_to_load(FULL):
// this rank's part of a FULL optimizer state dict (name-keyed, or ID-keyed
// with this optimizer's IDs), ID-keyed for ImportOptimizerState. A dict of a
// plain model's optimizer rekeyed by name (RekeyOptimStateDict with the
// plain model's OptimizerParamNames) is such a dict. Errors name the
// parameter and entry (unknown names, shapes differing from the original's).
// Local: every rank passes the full dict.
absl::StatusOr<OptimStateDict> ShardFullOptimStateDict(
    const fsdp::FullyShardedDataParallel& model, const torch::optim::Optimizer& optimizer,
    const OptimStateDict& full);

// PyTorch's scatter_full_optim_state_dict: as ShardFullOptimStateDict, but
// only rank 0 holds the FULL dict (`full` is read on rank 0 and ignored
// elsewhere); rank 0 broadcasts the state entries over the model's group.
// Hyperparameters are not scattered: every rank's result carries its own
// optimizer's current param_groups. A problem found on rank 0 is returned
// on every rank. Collective.
absl::StatusOr<OptimStateDict> ScatterFullOptimStateDict(
    fsdp::FullyShardedDataParallel& model, const torch::optim::Optimizer& optimizer,
    const OptimStateDict& full);

// PyTorch's sharded_optim_state_dict / optim_state_dict(SHARDED): each
// state entry as a ShardedTensor named "<param fqn>/<entry>" (e.g.
// "a.weight/exp_avg"), pieces at the parameter's global offsets, like the
// model's kSharded form (type kSharded; these names never collide with the
// model's, so both may be merged into one SaveShard). Hyperparameters are
// not included: loading keeps the optimizer's own.
absl::StatusOr<FsdpModelStateDict> ShardedOptimStateDict(
    const fsdp::FullyShardedDataParallel& model, const torch::optim::Optimizer& optimizer);

// PyTorch's optim_state_dict_to_load(SHARDED) + load: reshards the entries
// of `saved` (pieces of any layout covering this rank's ranges) and imports
// them into `optimizer`. Entries of names that are not optimizer parameters
// are errors; model entries (names without '/') are skipped. All checked
// before the optimizer changes.
absl::Status LoadShardedOptimStateDict(const fsdp::FullyShardedDataParallel& model,
                                       torch::optim::Optimizer& optimizer,
                                       const FsdpModelStateDict& saved);

// The same from a sharded checkpoint of any world size (only this rank's
// ranges are read).
absl::Status LoadShardedOptimCheckpoint(const fsdp::FullyShardedDataParallel& model,
                                        torch::optim::Optimizer& optimizer,
                                        const std::string& step_dir);

}  // namespace state_dict
