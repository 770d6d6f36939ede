// What the FSDP state-dict functions need to know about a wrapped model:
// where each original parameter's piece lives on this rank, which tensors
// every rank holds in full, and how ranks are numbered in a checkpoint.
//
// Checkpoint numbering. Shards are cut over the shard group (the
// data-parallel group; under the hybrid strategies the intra-node group),
// and under the hybrid strategies the shard group is replicated over the
// replicate group. A checkpoint numbers rank (replicate index r, shard
// index s) as r * shard_size + s of replicate_size * shard_size, which is
// the world rank for the meshes comm/device_mesh.h builds. Only replicate
// index 0 writes shard pieces; the other replicas hold the same ones.
#pragma once

#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"
#include "comm/process_group.h"
#include "fsdp/flat_param.h"
#include "fsdp/fully_sharded_data_parallel.h"
#include "state_dict/fsdp/fsdp_state_dict.h"
#include "state_dict/sharded_tensor.h"

namespace state_dict::internal {

// One original parameter managed by a handle.
struct Managed {
  std::string name;
  const fsdp::FlatParamHandle* handle;
  const fsdp::FlatParamInfo* info;
};

// One flat parameter (LOCAL form; the optimizer's parameter without
// use_orig_params).
struct Flat {
  std::string name;
  const fsdp::FlatParamHandle* handle;
};

// A buffer or a parameter FSDP does not manage: full on every rank.
struct Extra {
  std::string name;
  torch::Tensor tensor;
};

struct ModelView {
  std::vector<Managed> managed;
  std::vector<Flat> flats;
  std::vector<Extra> extras;
  // Handles shard over this group; reductions over it see every piece once.
  comm::ProcessGroup shard_group;
  // Hybrid strategies: the group replicating the shard group (else empty).
  comm::ProcessGroup replicate_group;
  bool hybrid = false;
  // Checkpoint numbering (see the top of this file).
  int world_size = 1;
  int rank = 0;
  // NO_SHARD: every rank holds every parameter in full.
  bool replicated_shards = false;
  // Hybrid, replicate index > 0: this rank's pieces are a copy of the ones
  // the rank of replicate index 0 holds.
  bool shard_is_replica = false;
};

absl::StatusOr<ModelView> Describe(const fsdp::FullyShardedDataParallel& model);

// An empty state dict of `type` numbered as this rank (and, for kSharded,
// marked as a hybrid replica when it is one).
FsdpModelStateDict NewStateDict(const ModelView& view, StateDictType type);

// Broadcasts `tensor` (1-D, contiguous) from checkpoint rank 0 to every
// rank of the model: over the shard group, preceded under the hybrid
// strategies by the replicate group of shard index 0.
void BroadcastFromRankZero(const ModelView& view, const torch::Tensor& tensor);

// This rank's range of a flat parameter (the padded shard).
FlatRange ShardRange(const fsdp::FlatParamHandle& handle);

// `t` as one piece covering all of it.
ShardedTensor FullPiece(const torch::Tensor& t);

std::string JoinFqn(const std::string& prefix, const std::string& name);
std::string ShapeString(c10::IntArrayRef shape);

}  // namespace state_dict::internal
