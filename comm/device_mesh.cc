#include "comm/device_mesh.h"

#include <algorithm>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "comm/subgroups.h"

namespace comm {

absl::StatusOr<DeviceMesh> DeviceMesh::create(const ProcessGroup& world, std::vector<int64_t> shape,
                                              std::vector<int> ranks) {
  const std::string shape_text = absl::StrCat("(", absl::StrJoin(shape, ", "), ")");
  if (!world.is_member()) {
    return absl::FailedPreconditionError(
        "DeviceMesh: this process is not a member of `world`: expected the "
        "world group");
  }
  if (shape.empty()) {
    return absl::InvalidArgumentError(
        "DeviceMesh: shape () is empty: expected at least one dimension");
  }
  int64_t total = 1;
  for (int64_t d : shape) {
    if (d <= 0) {
      return absl::InvalidArgumentError(absl::StrCat("DeviceMesh: shape ", shape_text,
                                                     " has dimension ", d,
                                                     ": expected positive dimensions"));
    }
    total *= d;
  }
  if (total != world.size()) {
    return absl::InvalidArgumentError(absl::StrCat("DeviceMesh: shape ", shape_text, " holds ",
                                                   total, " ranks: expected the world size ",
                                                   world.size()));
  }
  if (ranks.empty()) {
    for (int r = 0; r < world.size(); ++r) ranks.push_back(r);
  }
  std::vector<int> sorted = ranks;
  std::sort(sorted.begin(), sorted.end());
  for (int r = 0; r < static_cast<int>(sorted.size()); ++r) {
    if (static_cast<int>(sorted.size()) != world.size() || sorted[r] != r) {
      return absl::InvalidArgumentError(
          absl::StrCat("DeviceMesh: ranks [", absl::StrJoin(ranks, ", "),
                       "]: expected each world rank in [0, ", world.size(), ") exactly once"));
    }
  }

  DeviceMesh mesh;
  mesh.shape_ = std::move(shape);
  mesh.ranks_ = std::move(ranks);
  const int64_t ndim = mesh.ndim();
  // Row-major strides, and the calling rank's coordinate.
  std::vector<int64_t> strides(ndim, 1);
  for (int64_t d = ndim - 2; d >= 0; --d) {
    strides[d] = strides[d + 1] * mesh.shape_[d + 1];
  }
  const int64_t my_index =
      std::find(mesh.ranks_.begin(), mesh.ranks_.end(), world.rank()) - mesh.ranks_.begin();
  mesh.coordinate_.resize(ndim);
  for (int64_t d = 0; d < ndim; ++d) {
    mesh.coordinate_[d] = (my_index / strides[d]) % mesh.shape_[d];
  }
  // For each dimension, one group per line of the mesh along it. Every rank
  // creates every group, in the same order, as new_group requires.
  for (int64_t d = 0; d < ndim; ++d) {
    ProcessGroup mine;
    for (int64_t base = 0; base < total; ++base) {
      if ((base / strides[d]) % mesh.shape_[d] != 0) continue;  // not a line start
      std::vector<int> line;
      for (int64_t i = 0; i < mesh.shape_[d]; ++i) {
        line.push_back(mesh.ranks_[base + i * strides[d]]);
      }
      auto group = new_group(world, line);
      if (!group.ok()) return group.status();
      if (group->is_member()) mine = *group;
    }
    mesh.groups_.push_back(mine);
  }
  return mesh;
}

absl::StatusOr<ProcessGroup> DeviceMesh::get_group(int64_t mesh_dim) const {
  if (mesh_dim < 0 || mesh_dim >= ndim()) {
    return absl::InvalidArgumentError(
        absl::StrCat("DeviceMesh::get_group: mesh_dim=", mesh_dim, ": expected [0, ", ndim(),
                     ") for a mesh of shape (", absl::StrJoin(shape_, ", "), ")"));
  }
  return groups_[mesh_dim];
}

absl::StatusOr<DeviceMesh> init_hybrid_shard_mesh(const ProcessGroup& world, int64_t replicate_size,
                                                  int64_t shard_size) {
  if (replicate_size <= 0 || shard_size <= 0 || replicate_size * shard_size != world.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "init_hybrid_shard_mesh: replicate_size=", replicate_size, " x shard_size=", shard_size,
        ": expected positive sizes whose product is the world size ", world.size()));
  }
  return DeviceMesh::create(world, {replicate_size, shard_size});
}

absl::StatusOr<HybridShardGroups> hybrid_shard_groups(const DeviceMesh& mesh) {
  if (mesh.ndim() != 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("Expected device_mesh to have ndim=2 but got ", mesh.ndim()));
  }
  HybridShardGroups groups;
  groups.replicate = *mesh.get_group(0);
  groups.shard = *mesh.get_group(1);
  return groups;
}

absl::Status validate_hybrid_shard_groups(const ProcessGroup& shard, const ProcessGroup& replicate,
                                          const ProcessGroup& world) {
  if (!shard.is_member() || !replicate.is_member()) {
    return absl::InvalidArgumentError(
        absl::StrCat("hybrid shard process groups: world rank ", world.rank(),
                     " is not a member of the ", shard.is_member() ? "replicate" : "shard",
                     " group: expected a (shard, replicate) pair containing the caller"));
  }
  if (static_cast<int64_t>(shard.size()) * replicate.size() != world.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "hybrid shard process groups: shard group size ", shard.size(), " x replicate group size ",
        replicate.size(), ": expected the world size ", world.size()));
  }
  std::set<int> in_shard(shard.global_ranks().begin(), shard.global_ranks().end());
  std::vector<int> common;
  for (int r : replicate.global_ranks()) {
    if (in_shard.count(r)) common.push_back(r);
  }
  if (common.size() != 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "hybrid shard process groups: shard ranks [", absl::StrJoin(shard.global_ranks(), ", "),
        "] and replicate ranks [", absl::StrJoin(replicate.global_ranks(), ", "), "] share [",
        absl::StrJoin(common, ", "), "]: expected exactly the calling rank (orthogonal groups)"));
  }
  return absl::OkStatus();
}

}  // namespace comm
