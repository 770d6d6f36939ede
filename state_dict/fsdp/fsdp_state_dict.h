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
// kSharded and kLocal pieces are views of the live flat parameters and
// buffers, as Module::state_dict() and FSDP2's state_dict() return: saving
// them copies nothing, and they change as the model trains (clone a piece
// to keep a snapshot). kFull tensors are copies (they are gathered).
//
// Every load validates the whole dict against the model (names, shapes,
// dtypes, covered ranges) before it writes anything: on error the model is
// untouched. Every rank must call the getters and loaders (kFull gathers;
// the others are local, but ranks should stay in step).
//
// Every sharding strategy is supported, with a process_group, hybrid_groups
// or a device_mesh. Under the hybrid strategies a checkpoint numbers rank
// (replicate index r, shard index s) r * shard_size + s (the world rank of
// comm's hybrid meshes) and only replicate index 0 writes the shard pieces,
// so a hybrid checkpoint is an ordinary sharded one: it loads into any
// strategy at any world size, and any sharded checkpoint loads into a
// hybrid model.
//
// Optimizer state dicts: fsdp_optim_state_dict.h.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "fsdp/fully_sharded_data_parallel.h"
#include "state_dict/sharded_tensor.h"
#include "state_dict/tensor_dict.h"

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
  // The world size and rank it was taken at (checkpoint numbering, above).
  int world_size = 1;
  int rank = 0;
  // kSharded under a hybrid strategy on replicate index > 0: the pieces
  // duplicate another rank's, so SaveModelCheckpoint writes none of them.
  bool shard_is_replica = false;
};

// This rank's state dict in `type` form (`config` applies to kFull).
absl::StatusOr<FsdpModelStateDict> GetModelStateDict(fsdp::FullyShardedDataParallel& model,
                                                     StateDictType type,
                                                     StateDictConfig config = {});
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

// What this rank's SaveShard writes for a kSharded/kLocal `state`: its
// pieces, without those another rank writes (replicated entries on ranks
// other than 0, a hybrid replica's). For saving them another way, e.g.
// AsyncCheckpointer::SaveShardInPlace.
ShardedStateDict ShardToSave(const FsdpModelStateDict& state);

// Where a SHARDED load reads the pieces it requests, with LoadResharded's
// contract (checkpoint.h): a checkpoint step directory, or a
// torch.distributed.checkpoint directory with its keys mapped (fsdp_dcp.h).
using ShardRequests = std::vector<std::pair<std::string, ShardRequest>>;
using ShardedReader = std::function<absl::StatusOr<ShardedStateDict>(const ShardRequests&)>;

// LoadModelCheckpoint's kSharded load from any reader: this rank's ranges
// of every managed parameter and the whole of every buffer and unmanaged
// parameter, requested by clean FQN, all checked before the model is
// written.
absl::Status LoadModelShardedFrom(fsdp::FullyShardedDataParallel& model, const ShardedReader& read);

// Loads a checkpoint step directory in form `type` into the model: kFull
// reads the FULL dict (a full or a sharded checkpoint of any world size;
// optimizer entries "<param>/<entry>" saved alongside are skipped),
// kSharded reads only this rank's ranges from a sharded checkpoint of any
// world size (LoadResharded), kLocal this rank's file of a checkpoint of the
// same world size. All checks happen before the model is written.
absl::Status LoadModelCheckpoint(fsdp::FullyShardedDataParallel& model, const std::string& step_dir,
                                 StateDictType type);

}  // namespace state_dict
