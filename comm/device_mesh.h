// An N-dimensional arrangement of the world's ranks (torch's DeviceMesh),
// with one process group per mesh dimension for the calling rank. FSDP's
// HYBRID_SHARD uses a 2-D mesh (replicate x shard): dimension 0 replicates
// (inter-node), dimension 1 shards (intra-node).
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "comm/process_group.h"

namespace comm {

class DeviceMesh {
 public:
  // Builds the mesh over `world` (all its members must call this, in the same
  // order as other group creation). `ranks` lists world ranks in row-major
  // order over `shape`; empty means 0, 1, ..., world.size()-1. Errors: a
  // non-positive dimension, product(shape) != world size, `ranks` not a
  // permutation of the world's ranks.
  static absl::StatusOr<DeviceMesh> create(const ProcessGroup& world, std::vector<int64_t> shape,
                                           std::vector<int> ranks = {});

  int64_t ndim() const { return static_cast<int64_t>(shape_.size()); }
  const std::vector<int64_t>& shape() const { return shape_; }
  // Row-major world ranks.
  const std::vector<int>& ranks() const { return ranks_; }
  // The calling rank's index along each dimension.
  const std::vector<int64_t>& coordinate() const { return coordinate_; }
  // The group of ranks that differ from the calling rank only along
  // `mesh_dim`. Error when mesh_dim is outside [0, ndim()).
  absl::StatusOr<ProcessGroup> get_group(int64_t mesh_dim) const;

 private:
  DeviceMesh() = default;
  std::vector<int64_t> shape_;
  std::vector<int> ranks_;
  std::vector<int64_t> coordinate_;
  std::vector<ProcessGroup> groups_;  // one per dimension
};

// HYBRID_SHARD's pair of groups for the calling rank.
struct HybridShardGroups {
  ProcessGroup shard;      // all-gather / reduce-scatter of flat parameters
  ProcessGroup replicate;  // all-reduce of the reduce-scattered gradients
};

// A (replicate_size x shard_size) mesh over the world, ranks in order, so
// shard groups are consecutive ranks (a node) and replicate groups are
// strided. Errors when replicate_size * shard_size != world size.
absl::StatusOr<DeviceMesh> init_hybrid_shard_mesh(const ProcessGroup& world, int64_t replicate_size,
                                                  int64_t shard_size);

// shard = mesh dim 1, replicate = mesh dim 0 (as FSDP does). Error unless
// mesh.ndim() == 2: "Expected device_mesh to have ndim=2 but got N".
absl::StatusOr<HybridShardGroups> hybrid_shard_groups(const DeviceMesh& mesh);

// Checks a user-supplied (shard, replicate) pair: the caller is a member of
// both, shard.size() * replicate.size() == world.size(), and the two groups
// share exactly the calling rank.
absl::Status validate_hybrid_shard_groups(const ProcessGroup& shard, const ProcessGroup& replicate,
                                          const ProcessGroup& world);

}  // namespace comm
