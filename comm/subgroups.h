// Groups made from an existing group, as torch.distributed.new_group /
// new_subgroups and FSDP's _init_intra_and_inter_node_groups.
//
// Every member of `parent` must make the same calls in the same order (they
// agree on store keys by counting), including ranks that will not be members
// of the new group. Errors are returned as absl::Status (see
// process_group.h).
#pragma once

#include <vector>

#include "absl/status/statusor.h"
#include "comm/process_group.h"

namespace comm {

// A group of the listed ranks, given as ranks of `parent` (which are world
// ranks when parent is the world). Rank order defines the new group's ranks.
// Callers not listed get a non-member ProcessGroup (is_member() false).
// Errors: parent not joined by this process, empty list, a rank outside
// [0, parent.size()), a duplicate.
absl::StatusOr<ProcessGroup> new_group(const ProcessGroup& parent, const std::vector<int>& ranks);

// Splits `parent` into consecutive groups of `group_size` ranks
// ([0..g-1], [g..2g-1], ...) and returns the one containing this process.
// Errors as torch.distributed.new_subgroups: group_size <= 0, larger than the
// parent, or not dividing its size.
absl::StatusOr<ProcessGroup> new_subgroups(const ProcessGroup& parent, int group_size);

struct IntraInterNodeGroups {
  // The ranks on this process's node: [node*n, node*n + n).
  ProcessGroup intra_node;
  // The ranks with this process's local rank on every node:
  // {local_rank + i*n for each node i}.
  ProcessGroup inter_node;
};

// FSDP HYBRID_SHARD's groups for nodes of `num_devices_per_node` ranks each
// (usually LOCAL_WORLD_SIZE). The world size must be a multiple of it.
absl::StatusOr<IntraInterNodeGroups> init_intra_and_inter_node_groups(
    const ProcessGroup& global_group, int num_devices_per_node);

}  // namespace comm
