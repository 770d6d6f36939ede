#include "comm/subgroups.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <memory>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "comm/internal/group_state.h"

namespace comm {

absl::StatusOr<ProcessGroup> new_group(const ProcessGroup& parent, const std::vector<int>& ranks) {
  const auto& p = parent.state();
  if (!p || !p->pg) {
    return absl::FailedPreconditionError(absl::StrCat(
        "new_group: this process is not a member of the parent group '", p ? p->name : "",
        "': expected every member of the parent to call it, "
        "and only them"));
  }
  if (ranks.empty()) {
    return absl::InvalidArgumentError(
        "new_group: ranks is empty: expected at least one rank of the parent");
  }
  std::set<int> seen;
  for (int r : ranks) {
    if (r < 0 || r >= p->size) {
      return absl::InvalidArgumentError(absl::StrCat(
          "new_group: ranks [", absl::StrJoin(ranks, ", "), "] contains ", r,
          ": expected ranks of the parent group '", p->name, "' in [0, ", p->size, ")"));
    }
    if (!seen.insert(r).second) {
      return absl::InvalidArgumentError(absl::StrCat("new_group: ranks [",
                                                     absl::StrJoin(ranks, ", "), "] lists ", r,
                                                     " twice: expected distinct ranks"));
    }
  }
  auto state = std::make_shared<internal::GroupState>();
  state->root_store = p->root_store;
  state->global_rank = p->global_rank;
  state->backend = p->backend;
  state->timeout = p->timeout;
  state->rendezvous = p->rendezvous;
  state->master_addr = p->master_addr;
  // Every member of the parent counts the groups made from it, so all agree
  // on this name (and store prefix) without communicating.
  state->name = absl::StrCat(p->name, "/", p->children_made.fetch_add(1));
  state->size = static_cast<int>(ranks.size());
  for (int i = 0; i < state->size; ++i) {
    state->global_ranks.push_back(p->global_ranks[ranks[i]]);
    if (ranks[i] == p->rank) state->rank = i;
  }
  if (state->rank >= 0) {
    auto store = c10::make_intrusive<c10d::PrefixStore>(state->name + "/", p->root_store);
    auto pg = internal::make_backend_group(p->backend, store, state->rank, state->size, p->timeout,
                                           p->master_addr);
    if (!pg.ok()) {
      return absl::Status(pg.status().code(),
                          absl::StrCat("new_group [", absl::StrJoin(ranks, ", "), "] ('",
                                       state->name, "'): ", pg.status().message()));
    }
    state->pg = *pg;
  }
  return ProcessGroup(std::move(state));
}

absl::StatusOr<ProcessGroup> new_subgroups(const ProcessGroup& parent, int group_size) {
  const int world = parent.size();
  if (group_size <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("The arg 'group_size' (", group_size, ") must be positive"));
  }
  if (group_size > world) {
    return absl::InvalidArgumentError(absl::StrCat(
        "The arg 'group_size' (", group_size, ") must not exceed the world size (", world, ")"));
  }
  if (world % group_size != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "The world size (", world, ") must be divisible by 'group_size=", group_size, "'"));
  }
  ProcessGroup mine;
  for (int first = 0; first < world; first += group_size) {
    std::vector<int> ranks;
    for (int r = first; r < first + group_size; ++r) ranks.push_back(r);
    auto group = new_group(parent, ranks);
    if (!group.ok()) return group.status();
    if (group->is_member()) mine = *group;
  }
  return mine;
}

absl::StatusOr<IntraInterNodeGroups> init_intra_and_inter_node_groups(
    const ProcessGroup& global_group, int num_devices_per_node) {
  const int world = global_group.size();
  if (num_devices_per_node <= 0 || world % num_devices_per_node != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "init_intra_and_inter_node_groups: num_devices_per_node=", num_devices_per_node,
        ": expected a positive divisor of the world "
        "size ",
        world, " (every node has the same number of ranks)"));
  }
  IntraInterNodeGroups groups;
  auto intra = new_subgroups(global_group, num_devices_per_node);
  if (!intra.ok()) return intra.status();
  groups.intra_node = *intra;
  const int num_nodes = world / num_devices_per_node;
  const int my_local_rank = global_group.rank() % num_devices_per_node;
  for (int local_rank = 0; local_rank < num_devices_per_node; ++local_rank) {
    std::vector<int> ranks;
    for (int node = 0; node < num_nodes; ++node) {
      ranks.push_back(local_rank + node * num_devices_per_node);
    }
    auto inter = new_group(global_group, ranks);
    if (!inter.ok()) return inter.status();
    if (local_rank == my_local_rank) groups.inter_node = *inter;
  }
  return groups;
}

}  // namespace comm
